"""The HOST arm's launch of a single thread (host_simt.h): it runs on the calling thread (the cost
of starting an OS thread per host-wrapper call is what bench/cpu_put.py measured away), with the
same device-side view as a threaded launch, and leaves the caller's context as it found it."""
import ctypes
import threading

import numpy as np
import pytest

import gpunet

KERNEL = r"""
#include <gpunet/arch.cuh>
#include <sys/syscall.h>
#include <unistd.h>
namespace arch = gpunet::arch;

// Each thread g writes: its OS thread id, thread/block index, lane/warp size, a ballot after a
// block and a warp barrier, and (relaxed, buffered in weak mode) a marker the host reads after
// the launch returned (F2: kernel exit makes it visible).
GPUNET_GLOBAL void k_who(uint64_t* out) {
  const uint32_t g = arch::block_idx().x * arch::block_dim().x + arch::thread_idx().x;
  arch::syncthreads();
  arch::syncwarp();
  const uint64_t b = arch::ballot(true);
  out[5 * g + 0] = uint64_t(syscall(SYS_gettid));
  out[5 * g + 1] = arch::thread_idx().x | (uint64_t(arch::block_idx().x) << 32);
  out[5 * g + 2] = arch::lane_id() | (uint64_t(arch::warp_size()) << 32);
  out[5 * g + 3] = b;
  arch::store_relaxed<uint64_t>(&out[5 * g + 4], 0xC0FFEEull + g);
}

extern "C" int who(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t* out) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = ws;
  s.weak = weak != 0;
  s.weak_seed = 7;
  return gpunet::launch_kernel(s, k_who, out);
}

// What a caller outside any launch sees: a lone thread, lane 0 of a 32-lane warp.
extern "C" uint64_t outside() {
  return arch::thread_idx().x | (uint64_t(arch::warp_size()) << 32);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from gpunet.device import loader
    src = tmp_path_factory.mktemp("launch") / "who.cu"
    src.write_text(KERNEL)
    try:
        lib = loader.build([src], arch="host")
    except gpunet.ToolchainError as e:
        pytest.skip(f"no HOST-arm toolchain: {e}")
    lib.who.argtypes = [ctypes.c_uint32] * 4 + [ctypes.c_void_p]
    lib.who.restype = ctypes.c_int
    lib.outside.restype = ctypes.c_uint64
    return lib


@pytest.mark.parametrize("weak", [0, 1])
@pytest.mark.parametrize("ws", [32, 64])
def test_single_thread_launch_runs_inline_and_restores_context(lib, ws, weak):
    """grid 1 x block 1: the kernel runs on the caller's OS thread, sees thread 0 of block 0,
    lane 0 of a warp of `ws` whose ballot has only lane 0, its buffered stores are visible when
    the launch returns (weak mode too), and afterwards the caller is outside a launch again
    (warp size 32, thread 0), also from a second Python thread."""
    for caller in range(2):
        out = np.zeros(5, np.uint64)
        res = {}

        def go():
            res["rc"] = lib.who(1, 1, ws, weak, out.ctypes.data)
            res["tid"] = threading.get_native_id()
            res["after"] = int(lib.outside())
        if caller == 0:
            go()
        else:
            t = threading.Thread(target=go)
            t.start()
            t.join()
        assert res["rc"] == 0
        assert int(out[0]) == res["tid"], "a one-thread launch must run on the calling thread"
        assert int(out[1]) == 0 and int(out[2]) == (ws << 32) and int(out[3]) == 1
        assert int(out[4]) == 0xC0FFEE
        assert res["after"] == (32 << 32)


def test_multi_thread_launch_still_runs_every_thread_on_its_own(lib):
    """grid 2 x block 3 (warp 32): six distinct OS threads, none the caller, each with its own
    indices; each block's warp ballot shows the block's three lanes."""
    out = np.zeros(5 * 6, np.uint64)
    assert lib.who(2, 3, 32, 0, out.ctypes.data) == 0
    rows = out.reshape(6, 5)
    tids = {int(r[0]) for r in rows}
    assert len(tids) == 6 and threading.get_native_id() not in tids
    assert [int(r[1]) for r in rows] == [t | (b << 32) for b in range(2) for t in range(3)]
    assert all(int(r[3]) == 0b111 for r in rows)
    assert [int(r[4]) for r in rows] == [0xC0FFEE + g for g in range(6)]
