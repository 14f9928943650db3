"""gpunet/arch.cuh on the HOST arm (SIMT emulator, weak-memory model), the CUDA arm's compile, and
gpunet/device/loader.py.

Kernels are in gpunet/device/testing/kernels/arch.cu; every HOST test runs with emulated warps of 32 and 64.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunet.device import loader, testing
from gpunet.errors import ToolchainError

KERNELS = testing.kernels_dir() / "arch.cu"
WARPS = [32, 64]
P = ctypes.c_void_p
U32 = ctypes.c_uint32
U64 = ctypes.c_uint64


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.fixture(scope="module")
def lib():
    lib = loader.build([KERNELS], arch="host")
    sigs = {
        "test_ids": [U32, U32, U32, P],
        "test_syncthreads": [U32, U32, U32, U32, P],
        "test_warp": [U32, U32, U32, U32] + [P] * 9,
        "test_atomics": [U32, U32, U32, U32] + [P] * 5,
        "test_atomic_or": [U32, U32, U32, P, P, P],
        "test_mp_step": [U32, U32, U64, U32, P, P, P],
        "test_mp_spin": [U32, U32, U64, U32, P, P, P, P],
        "test_doorbell": [U32, U32, U64, U32, U32, P, P, P, P],
        "test_doorbell_step": [U32, U32, U64, U32, P, P, P, P],
        "test_every_primitive": [U32, U32, P, P, P],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


# ---------------------------------------------------------------------------------------------
# SIMT emulator


@pytest.mark.parametrize("ws", WARPS)
def test_ids_cover_the_grid_exactly(lib, ws):
    """Every (block, thread) pair runs once; lane/warp derive from the linear thread id; a block
    that is not a multiple of the warp size ends in a partial warp."""
    grid, block = 3, 80
    out = np.full((grid * block, 8), 0xFFFFFFFF, dtype=np.uint32)
    assert lib.test_ids(grid, block, ws, ptr(out)) == 0
    g = np.arange(grid * block)
    t = g % block
    np.testing.assert_array_equal(out[:, 0], t)
    np.testing.assert_array_equal(out[:, 1], g // block)
    assert (out[:, 2] == block).all() and (out[:, 3] == grid).all()
    np.testing.assert_array_equal(out[:, 4], t % ws)
    np.testing.assert_array_equal(out[:, 5], t // ws)
    assert (out[:, 6] == ws).all()
    np.testing.assert_array_equal(out[:, 7], t)


@pytest.mark.parametrize("ws", WARPS)
def test_syncthreads_orders_shared_memory_writes_across_the_block(lib, ws):
    """After syncthreads every thread reads the value its neighbour wrote that round, for 40
    rounds in 2 blocks of 96 threads (shared memory is per block)."""
    errors = np.zeros(1, dtype=np.uint32)
    assert lib.test_syncthreads(2, 96, ws, 40, ptr(errors)) == 0
    assert errors[0] == 0


@st.composite
def warp_inputs(draw, ws):
    block = draw(st.integers(1, 2 * ws + 5))
    n_live = draw(st.integers(1, block))
    n = block
    vals = np.array(draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)), dtype=np.uint32)
    preds = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.uint8)
    src = np.array(draw(st.lists(st.integers(0, ws - 1), min_size=n, max_size=n)), dtype=np.uint32)
    return block, n_live, vals, preds, src


def _check_warp(lib, ws, block, n_live, vals, preds, src):
    n = block
    shfl = np.zeros(n, np.uint32)
    shfl64 = np.zeros(n, np.uint64)
    ballot = np.zeros(n, np.uint64)
    any_ = np.full(n, 7, np.uint8)
    all_ = np.full(n, 7, np.uint8)
    bany = np.full(n, 7, np.uint8)
    assert lib.test_warp(1, block, ws, n_live, ptr(vals), ptr(preds), ptr(src), ptr(shfl), ptr(shfl64),
                         ptr(ballot), ptr(any_), ptr(all_), ptr(bany)) == 0
    live_preds = preds[:n_live].astype(bool)
    for t in range(n_live):
        base = (t // ws) * ws
        lanes = range(base, min(base + ws, n_live))  # live lanes of t's warp
        s = base + int(src[t])
        # HOST rule: a shfl from an exited (or never-existing) lane returns the caller's value.
        want = vals[s] if s < n_live else vals[t]
        want_g = s if s < n_live else t
        assert shfl[t] == want, (t, s)
        assert shfl64[t] == (int(want) << 32) | want_g
        mask = sum(1 << (l - base) for l in lanes if preds[l])
        assert ballot[t] == mask
        assert any_[t] == any(preds[l] for l in lanes)
        assert all_[t] == all(preds[l] for l in lanes)
        assert bany[t] == live_preds.any()
    assert (any_[n_live:] == 7).all()  # exited threads wrote nothing


@pytest.mark.parametrize("ws", WARPS)
def test_warp_collectives_match_a_reference(lib, ws):
    """Generated block sizes (partial warps included), exited tails, values, predicates and source
    lanes: shfl, ballot, any, all over the live lanes of each warp and block_any over the block's
    live threads equal a numpy reference."""

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(warp_inputs(ws))
    def run(inp):
        _check_warp(lib, ws, *inp)

    run()


@pytest.mark.parametrize("ws", WARPS)
def test_atomics_from_many_threads_give_exact_sums(lib, ws):
    """4 blocks x 64 threads x 150 iterations: fetch-add hands out every old value exactly once;
    32/64-bit adds and CAS increment loops lose no update."""
    iters, total = 150, 4 * 64 * 150
    c32 = np.zeros(1, np.uint32)
    c64 = np.zeros(1, np.uint64)
    cas32 = np.zeros(1, np.uint32)
    cas64 = np.zeros(1, np.uint64)
    olds = np.zeros(total, np.uint32)
    assert lib.test_atomics(4, 64, ws, iters, ptr(c32), ptr(c64), ptr(cas32), ptr(cas64), ptr(olds)) == 0
    assert c32[0] == total
    assert c64[0] == total << 33
    assert cas32[0] == total
    assert cas64[0] == 3 * total
    assert (olds == 1).all()


@pytest.mark.parametrize("ws", WARPS)
def test_atomic_or_returns_the_old_word_and_sets_the_bits(lib, ws):
    """4 blocks x 64 threads each set their own bit twice with atomic_or, in a 64-bit word and in a
    32-bit word: the first old value lacks the bit, the second has it, and every word ends with
    all its bits set."""
    words = np.zeros(4, np.uint64)
    words32 = np.zeros(8, np.uint32)
    seen = np.zeros(256, np.uint32)
    assert lib.test_atomic_or(4, 64, ws, ptr(words), ptr(words32), ptr(seen)) == 0
    assert (seen == 3).all()
    assert (words == np.uint64(0xFFFFFFFFFFFFFFFF)).all()
    assert (words32 == np.uint32(0xFFFFFFFF)).all()


@pytest.mark.parametrize("ws", WARPS)
def test_every_primitive_gives_its_documented_result(lib, ws):
    """The kernel the CUDA arm is compiled with, run on the HOST arm: byte swaps, loads/stores of
    1/2/4/8 bytes, atomics' old values, clock monotonicity, ids, and the collectives."""
    block = 2 * ws
    out = np.zeros(16, np.uint64)
    u32 = np.zeros(8, np.uint32)
    u64 = np.zeros(8, np.uint64)
    assert lib.test_every_primitive(block, ws, ptr(out), ptr(u32), ptr(u64)) == 0
    assert out[0] == 0x3412
    assert out[1] == 0x44332211
    assert out[2] == 0x0807060504030201
    assert out[3] == 13 + 15 + 5 + 7
    assert out[4] == 0 + 0 + 2 + 3
    assert out[5] == 17 + 19
    assert out[6] == 1
    assert out[7] == block
    assert out[8] == 0 + 1 + 1 + 1 + 1 + ws + 1
    assert u64[4] == 21 and u32[4] == 4 and u64[2] == 6
    assert u64[6] == 23 and u64[7] == 25                  # store_relaxed_v2


# ---------------------------------------------------------------------------------------------
# Weak-memory model (host_simt.h, rules R1-R3, F1-F3, B1, L1-L2, P1-P2)

NO_FENCE, FENCE, RELEASE = 0, 1, 2
RANDOM, FIFO, LIFO = 0, 1, 2


def _mp_step(lib, mode, weak, seed, order=RANDOM):
    data = np.zeros(1, np.uint32)
    flag = np.zeros(1, np.uint32)
    seen = np.zeros(3, np.uint32)
    assert lib.test_mp_step(mode, weak, seed, order, ptr(data), ptr(flag), ptr(seen)) == 0
    assert seen[2] == 1 and data[0] == 1 and flag[0] == 1  # the kernel ran; exit drained (F2)
    return int(seen[0]), int(seen[1])


def test_weak_mode_reorders_message_passing_without_a_fence(lib):
    """Litmus MP: data then flag, both relaxed, no fence; the writer makes ONE pending store
    visible, then another thread looks. Over 32 seeds some show flag=1 with stale data=0 (and
    some the other way); LIFO order shows it deterministically."""
    outcomes = {_mp_step(lib, NO_FENCE, 1, seed) for seed in range(32)}
    assert (1, 0) in outcomes, outcomes
    assert (0, 1) in outcomes, outcomes
    assert _mp_step(lib, NO_FENCE, 1, 0, LIFO) == (1, 0)


@pytest.mark.parametrize("mode", [FENCE, RELEASE])
def test_weak_mode_never_shows_flag_before_data_with_fence_or_release(lib, mode):
    """Same litmus with fence_sys between the stores, or store_release_sys on the flag: for every
    seed (and FIFO/LIFO order) an observer that sees flag=1 also sees data=1."""
    for order in (RANDOM, FIFO, LIFO):
        for seed in range(32 if order == RANDOM else 1):
            assert _mp_step(lib, mode, 1, seed, order) != (1, 0), (mode, order, seed)


def test_strong_mode_is_sequentially_ordered(lib):
    """With weak mode off the stores go straight to memory: the observer sees both."""
    for seed in range(4):
        assert _mp_step(lib, NO_FENCE, 0, seed) == (1, 1)


def _mp_spin(lib, mode, seed, sleep_ns=300_000):
    data = np.zeros(1, np.uint32)
    flag = np.zeros(1, np.uint32)
    ack = np.zeros(1, np.uint32)
    seen = np.zeros(4, np.uint32)
    assert lib.test_mp_spin(mode, 1, seed, sleep_ns, ptr(data), ptr(flag), ptr(ack), ptr(seen)) == 0
    assert seen[2] == 1 and seen[0] == 1
    return int(seen[0]), int(seen[1])


def test_weak_mode_spin_loops_expose_stale_data_without_hooks(lib):
    """No test hook: the writer's spin loop makes one pending store visible per turn (P1), the
    observer polls the flag. Without a fence some seed lets it read stale data (timing decides
    whether the observer looks inside the window, so up to 48 seeds are tried); with a release on
    the flag no seed does."""
    assert any(_mp_spin(lib, NO_FENCE, seed) == (1, 0) for seed in range(48)), "never reordered"
    for seed in range(12):
        assert _mp_spin(lib, RELEASE, seed) == (1, 1), seed


def _doorbell(lib, fence_before_db, release_dbr, seed, order=RANDOM, sleep_ns=300_000):
    wqe = np.zeros(1, np.uint64)
    dbr = np.zeros(1, np.uint32)
    db = np.zeros(1, np.uint64)
    seen = np.zeros(5, np.uint32)
    assert lib.test_doorbell(fence_before_db, release_dbr, seed, order, sleep_ns, ptr(wqe), ptr(dbr),
                             ptr(db), ptr(seen)) == 0
    assert seen[0] == 1 and db[0] == 0xABCD
    return bool(seen[1]), bool(seen[2])  # (DBR visible, WQE visible) when the doorbell was seen


def _doorbell_step(lib, fence_before_db, release_dbr, seed, order=RANDOM):
    wqe = np.zeros(1, np.uint64)
    dbr = np.zeros(1, np.uint32)
    db = np.zeros(1, np.uint64)
    seen = np.zeros(2, np.uint32)
    assert lib.test_doorbell_step(fence_before_db, release_dbr, seed, order, ptr(wqe), ptr(dbr), ptr(db),
                                  ptr(seen)) == 0
    assert seen[1] >= 1 and db[0] == 0xABCD and wqe[0] == 0x1122334455667788
    return int(seen[0])  # states in which the doorbell was visible before the DBR or the WQE


@pytest.mark.parametrize("release_dbr", [0, 1])
def test_weak_mode_catches_a_missing_fence_before_the_doorbell(lib, release_dbr):
    """WQE word, DBR (relaxed, or even store_release_sys), then the doorbell with NO fence before
    it. Memory is inspected after every single pop of the writer's store buffer: the doorbell
    becomes visible before the DBR or the WQE for some seed (R1, R2: a release does not hold back
    younger stores), and always under LIFO order. Keep this test: it is the reason the weak model
    exists; a qp.cuh that drops its fence must fail the same way."""
    assert _doorbell_step(lib, 0, release_dbr, 0, LIFO) > 0
    assert any(_doorbell_step(lib, 0, release_dbr, s) > 0 for s in range(32))


def test_weak_mode_doorbell_after_a_fence_always_sees_dbr_and_wqe(lib):
    """With fence_sys before the doorbell, no intermediate state of any seed or order shows the
    doorbell without the DBR and the WQE; and free-running, whoever sees the doorbell sees both."""
    for order in (RANDOM, FIFO, LIFO):
        for seed in range(32 if order == RANDOM else 1):
            assert _doorbell_step(lib, 1, 1, seed, order) == 0, (order, seed)
            assert _doorbell_step(lib, 1, 0, seed, order) == 0, (order, seed)
    for seed in range(6):
        assert _doorbell(lib, 1, 1, seed, RANDOM, 0) == (True, True), seed


def test_weak_mode_free_running_doorbell_overtakes_without_a_fence(lib):
    """The same bug with no test hook: writer spins (one pop per turn), observer polls the doorbell.
    Timing decides whether the observer looks inside the window, so up to 48 seeds are tried."""
    assert any(_doorbell(lib, 0, 1, s, LIFO if s % 2 else RANDOM) != (True, True) for s in range(48))


# ---------------------------------------------------------------------------------------------
# CUDA and MACA arms (compile only: no GPU here)


def _nvcc():
    return shutil.which("nvcc")


def _ptx(src: Path, *flags: str) -> str:
    """The PTX nvcc makes of `src` for sm_90 with gpunet's include dir (flags: e.g. -O3)."""
    return subprocess.run(
        [_nvcc(), "-std=c++17", *flags, "-arch=sm_90", "-ptx", "-x", "cu", f"-I{loader.include_dir()}",
         str(src), "-o", "-"],
        capture_output=True, text=True, timeout=300, check=True).stdout


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled here")
def test_cuda_arm_compiles_and_emits_the_intended_ptx():
    """arch.cuh and the every-primitive kernel compile with nvcc for sm_90, both as a shared
    library through the loader and as PTX that contains the system-scope acquire/release/fence."""
    lib = loader.build([KERNELS], arch="cuda")
    assert lib.gpunet_path.exists()
    ptx = _ptx(KERNELS)
    for needle in ("ld.acquire.sys", "st.release.sys", "fence.acq_rel.sys", "%globaltimer",
                   "ld.relaxed.gpu", "st.relaxed.gpu", "prmt.b32", "nanosleep", "bar.red.or",
                   "st.volatile.v2.u64"):
        assert needle in ptx, needle


RING_TO_PROBE = r"""
#include <gpunet/qp.cuh>
extern "C" __global__ void k_ring_to(gpunet::QpDesc* qp, uint64_t r, uint64_t word) {
  gpunet::qpd::ring_to(gpunet::qp_ref(qp), r, word);
}
"""


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled here")
def test_ring_to_reads_no_descriptor_after_its_fences(tmp_path):
    """qp.cuh ring_to's rule: the QP's addresses (DBR, doorbell, slot_db) are read before the first
    system fence. A descriptor load after a fence is a dependent L2 round trip on every post's
    chain (bench/RESULTS.md, tenth session: 0.3 us of a one-warp post). In the PTX of ring_to
    alone, no ld.global may follow the first fence.acq_rel.sys (the only load there is the
    ld.volatile of another publisher's doorbell word, which must come after the fence)."""
    src = tmp_path / "ring_to_probe.cu"
    src.write_text(RING_TO_PROBE)
    ptx = _ptx(src, "-O3")
    body = ptx[ptx.index(".entry k_ring_to"):]
    fences = body.count("fence.acq_rel.sys")
    assert fences == 2, "ring_to should have its two system fences, found %d" % fences
    after = body[body.index("fence.acq_rel.sys"):]
    loads = [ln.strip() for ln in after.splitlines() if "ld.global" in ln]
    assert not loads, "descriptor loads after ring_to's first fence: %s" % loads
    assert "ld.volatile" in after  # the slot_db word (word == 0): read after the fence, as it must


POST_LOOP_PROBE = r"""
#include <gpunet/qp.cuh>
extern "C" __global__ void k_post_loop(gpunet::QpDesc* qp, gpunet::Status* st, uint64_t raddr,
                                       uint32_t iters) {
  const gpunet::Waiter w{st, 1000000};
  const gpunet::QpRef c = gpunet::qp_ref(qp);  // once, as a caller that posts in a loop does
  for (uint32_t i = 0; i < iters; ++i) {
    gpunet::Wqe q;
    gpunet::wqe_rdma(q, gpunet::mlx5::OPCODE_RDMA_WRITE, raddr + 64 * (i * 32 + gpunet::arch::lane_id()),
                     1, raddr, 2, 64);
    if (!gpunet::post_warp(c, w, q, 32)) break;
  }
}
"""


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled here")
def test_a_posting_loop_on_a_qp_ref_loads_no_constant_before_its_reservation(tmp_path):
    """qp.cuh's QpRef rule: a caller that posts in a loop takes the QP's constants once (qp_ref)
    and every post_warp on it keeps them in registers. A constant read inside the post comes after
    the previous post's system fences, misses L1, and post_warp's ring-size check put that L2 round
    trip in front of every reservation's atomic (bench/RESULTS.md, sixteenth session). In the PTX
    of a kernel that calls post_warp(QpRef) in a loop, nothing is loaded from global memory between
    the warp's vote at post_warp's start and the reservation's atom.global.add but the relaxed
    loads that go out with it (Status, errored, done_head, db_head); the constants are read once,
    ld.global.nc (arch::load_const)."""
    src = tmp_path / "post_loop_probe.cu"
    src.write_text(POST_LOOP_PROBE)
    ptx = _ptx(src, "-O3")
    body = ptx[ptx.index(".entry k_post_loop"):]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("//")]
    resv = [i for i, ln in enumerate(lines) if ln.startswith("atom.global.add.u64")]
    assert resv, "no reservation atomic in the probe"
    at = resv[0]
    start = max(i for i in range(at) if lines[i].startswith("vote.sync"))
    loads = [ln for ln in lines[start:at] if ln.startswith("ld.") and not ln.startswith("ld.param")]
    assert loads and all(ln.startswith("ld.relaxed.gpu") for ln in loads), (
        "loads between post_warp's start and its reservation other than the relaxed ones that "
        "go out with it: %s" % loads)
    # Each constant is read once on the way to the first reservation: a post that reads them
    # itself reloads them in the loop's body (the same addresses again, before its vote).
    const = [ln.split("[")[1] for ln in lines[:at] if ln.startswith("ld.global.nc")]
    assert const, "the QP's constants should be read through arch::load_const (ld.global.nc)"
    assert len(const) == len(set(const)), "constants read again inside the posting loop: %s" % const


def test_load_const_is_not_speculated_past_a_branch():
    """No device header loads memory in an asm the compiler may treat as pure (no ``volatile``):
    such an asm is hoisted and speculated like arithmetic, i.e. executed on paths the code does
    not take. arch::load_const was one in ae9bb25 (a one-warp post 16.0 M WQE/s against 14.7-14.9
    with __ldg), and bench/p2p.py's ping-pong kernel faulted with an illegal address on the H200
    in every run until it became __ldg (bench/RESULTS.md, sixteenth session). A load is __ldg,
    a volatile asm, or a plain or atomic access."""
    pure_loads = []
    for hdr in sorted(Path(loader.include_dir()).rglob("*.cuh")):
        text = hdr.read_text()
        for m in re.finditer(r"\basm\s*\(\s*\"([^\"]*)\"", text):   # asm( without volatile
            if re.search(r"\bld\.", m.group(1)):
                line = text.count("\n", 0, m.start()) + 1
                pure_loads.append("%s:%d: %s" % (hdr.name, line, m.group(1)))
    assert not pure_loads, "loads in a non-volatile asm: %s" % pure_loads
    assert "__ldg" in (Path(loader.include_dir()) / "gpunet" / "arch.cuh").read_text()


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled here")
def test_p2p_put_waits_for_the_previous_kernel_before_touching_memory():
    """ops.cu's p2p put is launched overlapping the kernel before it in the stream
    (LaunchSpec::overlap_previous, programmatic stream serialization): every variant of k_put_p2p
    must run griddepcontrol.wait before its first global load or store (else it could copy a
    source its producer has not finished writing), and the launcher must ask for the overlap."""
    ptx = _ptx(loader.kernels_dir() / "ops.cu", "-O3")
    entries = [m.start() for m in re.finditer(r"\.entry \S*k_put_p2p", ptx)]
    assert len(entries) == 4, "expected the four k_put_p2p variants, found %d" % len(entries)
    for at in entries:
        body = ptx[at:ptx.index("\n}", at)]
        wait = body.find("griddepcontrol.wait")
        assert wait >= 0, "a k_put_p2p variant without griddepcontrol.wait"
        first_mem = min((i for i in (body.find("ld.global"), body.find("st.global"),
                                     body.find("st.volatile.global")) if i >= 0), default=len(body))
        assert wait < first_mem, "k_put_p2p touches memory before griddepcontrol.wait"
    src = (loader.kernels_dir() / "ops.cu").read_text()
    launcher = src[src.index("int gpunet_put_p2p_launch"):]
    assert "s.overlap_previous = true" in launcher[:launcher.index("switch")]


MACA_STUB = r"""
// Declarations standing in for the MACA runtime, only to type-check arch.cuh's MACA arm with g++.
#define GPUNET_SYNTAX_CHECK_ONLY
#define __device__
#define __host__
#define __global__
#define __shared__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#include <cstdint>
struct uint3_ { unsigned x, y, z; };
extern uint3_ threadIdx, blockIdx, blockDim, gridDim;
void __threadfence_system(); void __threadfence(); void __syncthreads(); void __syncwarp(); int __syncthreads_or(int);
unsigned atomicAdd(unsigned*, unsigned); unsigned long long atomicAdd(unsigned long long*, unsigned long long);
unsigned atomicCAS(unsigned*, unsigned, unsigned);
unsigned long long atomicCAS(unsigned long long*, unsigned long long, unsigned long long);
unsigned long long atomicOr(unsigned long long*, unsigned long long); unsigned atomicOr(unsigned*, unsigned); unsigned atomicMax(unsigned*, unsigned);
long long clock64();
template <class T> T __shfl(T, int); unsigned long long __ballot(int); int __any(int); int __all(int);
#include <gpunet/arch.cuh>
namespace a = gpunet::arch;
uint64_t use(uint32_t* p, uint64_t* q) {
  a::store_release_sys(p, 1u); a::fence_sys(); a::store_relaxed(q, uint64_t(2));
  a::doorbell_store64(q, 3); a::spin_pause(); a::wait_previous_grid(); a::launch_dependents(); a::store_relaxed_v2(q, 4, 5);
  return a::load_acquire_sys(p) + a::load_acquire_sys(q) + a::atomic_add(p, 1u) + a::atomic_cas(q, 1, 2) +
         a::bswap64(5) + a::bswap16(1) + a::now_ns() + a::shfl(7u, 1) + a::ballot(true) + a::any(true) +
         a::block_any(false) + a::lane_id() + a::warp_size() + a::atomic_load(q) + a::load_const(q) + a::load_const(p) + a::atomic_or(q, 8) + a::atomic_or(p, 8u) + a::shared_mem()[0];
}
"""


def test_maca_arm_type_checks_against_declared_intrinsics(tmp_path):
    """The MACA arm cannot be compiled here; g++ -fsyntax-only over it with the intrinsics it
    assumes declared catches typos and type errors (not whether MACA really has them)."""
    src = tmp_path / "maca_stub.cpp"
    src.write_text(MACA_STUB)
    res = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-DGPUNET_ARCH_MACA",
                          f"-I{loader.include_dir()}", str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------------------------
# loader

TINY = 'extern "C" int answer() { return %d; }\n'


def test_loader_caches_by_content(tmp_path, monkeypatch):
    """A second build of the same source (even after the process forgot it) does not run the
    compiler; changing the source does."""
    monkeypatch.setenv("GPUNET_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY % 42)
    n0 = loader.compile_count
    lib = loader.build([src], arch="host")
    assert lib.gpunet_compiled and loader.compile_count == n0 + 1
    assert lib.answer() == 42
    again = loader.build([src], arch="host")
    assert again is lib and not again.gpunet_compiled
    monkeypatch.setattr(loader, "_loaded", {})  # as a fresh process would
    third = loader.build([src], arch="host")
    assert not third.gpunet_compiled and loader.compile_count == n0 + 1
    assert third.gpunet_path == lib.gpunet_path
    src.write_text(TINY % 43)
    fourth = loader.build([src], arch="host")
    assert fourth.gpunet_compiled and fourth.answer() == 43
    assert not list((tmp_path / "cache").glob("*.tmp")), "temporary files left behind"


def test_loader_reports_a_missing_compiler(tmp_path, monkeypatch):
    """A compiler that is not installed is a ToolchainError that names it and what to install."""
    monkeypatch.setenv("GPUNET_HOST_CXX", "gpunet-no-such-g++")
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY % 1)
    with pytest.raises(ToolchainError, match="gpunet-no-such-g\\+\\+.*install g\\+\\+"):
        loader.build([src], arch="host")
    if shutil.which("mxcc") is None and not os.environ.get("GPUNET_MXCC"):
        with pytest.raises(ToolchainError, match="mxcc"):
            loader.build([src], arch="maca")


def test_loader_reports_compile_errors_with_the_compilers_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUNET_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken.cpp"
    src.write_text('extern "C" int f() { return not_declared_anywhere; }\n')
    with pytest.raises(ToolchainError, match="not_declared_anywhere"):
        loader.build([src], arch="host")
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_include_dir_holds_arch_cuh():
    """The loader's include dir holds arch.cuh; gpunet's kernels and the test kernels are found
    where the package says (also when installed)."""
    assert (loader.include_dir() / "gpunet" / "arch.cuh").is_file()
    assert Path(loader.kernels_dir(), "ops.cu").is_file()
    assert KERNELS.is_file()
