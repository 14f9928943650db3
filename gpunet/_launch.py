"""How a Context runs device code for its host wrappers: one thread of gpunet/device/kernels/ops.cu's
op-list kernel per call, or its bulk put with blocks sized to the bytes (p2p puts: the threads
copy, see bulk_geometry), and (CUDA) the ring of OpDesc slots for launches in flight.

- CPU platform: the HOST arm runs the kernel synchronously on the calling thread; the Status
  block is read right after it.
- CUDA: the kernel is enqueued on ``torch.cuda.current_stream()``; its OpDescs live in a ring in
  NIC-registered (host-mapped) memory until the next wait for every stream launched on frees
  every slot.

The Status block has one rule on both: a failure a kernel recorded is reported once and then
cleared, by the next synchronizing call (:meth:`Launcher.run` with ``blocking``, :meth:`sync`)
or, for a user kernel, by ``Context.check()``; a failure still recorded when a launch starts (a
user kernel nobody checked) is reported before that launch, so no kernel starts with the
failure of another (every device call would return false at once).
"""
import ctypes

import torch

from gpunet.device import abi
from gpunet.device.ops import op_list  # noqa: F401 - the Context builds its op lists with it
from gpunet.errors import ConfigError, GpunetError, with_hint
from gpunet.errors import TimeoutError as GpunetTimeoutError
from gpunet.host import progress
from gpunet.host.rawmem import HOOKED_IDLE_SLEEP_MAX_US
from gpunet.resource import Resource

OPS_RING = 1024                   # GPU: OpDesc slots for launches in flight (64 KiB, mapped arena)

# Bulk puts (ops.cu k_put_bulk: the grid shares a list of puts, each block moving chunks with
# put_nbi_block). A p2p put is a copy by the threads that run it, so one thread would copy a large
# tensor at one thread's speed: bulk_geometry gives it blocks for its size. NIC peers keep the
# one-thread op list (one WQE moves any size; the NIC's DMA engine is the bulk copier).
BULK_BLOCK_GPU = 256              # threads per block on a GPU (8 warps of 32)
# GPU geometry and copy variant by size, from bench/p2p.py's copy sweep on the H200 (2026-12-02,
# bench/RESULTS.md): (largest put of the tier in bytes, bytes per block, blocks per SM at most,
# variant of ops.cu k_put_p2p: bit 0 Unroll 8 16-byte loads in flight per thread (else 4), bit 1
# weak vector stores (else volatile)). Up to 1 MiB a block per 8 KiB (more blocks, one round of
# 4 loads per thread: 2.92 us for 1 MiB against 3.23 with 32 KiB blocks of Unroll 8); to 4 MiB a
# block per 16 KiB with Unroll 4; above, 32 KiB blocks, 8 a SM, Unroll 8 (16 MiB: 7.42 us against
# 8.38 with 16 KiB blocks of Unroll 4; 8 MiB 5.08 against 5.28; 64 MiB 37.0 against 38.6; the
# tenth session's sweep). Beyond a tier's blocks per SM the threads take more rounds.
BULK_TIERS_GPU = ((1 << 20, 8 << 10, 8, 2),
                  (4 << 20, 16 << 10, 4, 2),
                  (None, 32 << 10, 8, 3))
BULK_CHUNK_ALIGN = 256            # chunk boundaries keep 16-byte (vector) alignment and whole lines
BULK_MIN_BYTES_CPU = 256 << 10    # HOST arm: a block of one warp per 256 KiB, at most
BULK_MAX_BLOCKS_CPU = 2           # 2 blocks (every emulated thread is an OS thread; the CPU
                                  # gains nothing from more, but the bulk path runs in CI)


def bulk_tier(nbytes):
    """(bytes per block, blocks per SM, k_put_p2p variant) of a GPU put of ``nbytes``
    (BULK_TIERS_GPU)."""
    for top, per_block, per_sm, variant in BULK_TIERS_GPU:
        if top is None or nbytes <= top:
            return per_block, per_sm, variant
    raise AssertionError("BULK_TIERS_GPU ends with an open tier")


def bulk_geometry(nbytes, gpu, warp_size, sms=0, per_block=None, per_sm=None,
                  block=BULK_BLOCK_GPU):
    """(grid, block, chunk) of ops.cu's bulk put for ``nbytes`` in all, or None where the op-list
    kernel's single thread is the right launch (the CPU below BULK_MIN_BYTES_CPU). GPU: a block of
    ``block`` threads per ``per_block`` bytes, at most ``per_sm`` blocks per SM (``sms``; by
    default the size's tier, bulk_tier: bench/p2p.py's copy sweep tries others); chunk: the bytes
    each block moves per turn (a multiple of BULK_CHUNK_ALIGN)."""
    nbytes = int(nbytes)
    if gpu:
        tier_block, tier_sm, _ = bulk_tier(nbytes)
        per_block = per_block or tier_block
        per_sm = per_sm or tier_sm
        grid = max(1, min(-(-nbytes // per_block), max(1, sms) * per_sm))
    else:
        if nbytes < BULK_MIN_BYTES_CPU:
            return None
        grid, block = min(BULK_MAX_BLOCKS_CPU, nbytes // BULK_MIN_BYTES_CPU), warp_size
    per = -(-max(nbytes, 1) // grid)
    chunk = -(-per // BULK_CHUNK_ALIGN) * BULK_CHUNK_ALIGN
    return grid, block, chunk


def current_stream_handle(device=None):
    """The raw cudaStream_t of torch's current stream on ``device`` (None: the current device):
    torch's private _cuda_getCurrentRawStream where it exists (about 1 us), else the public
    torch.cuda.current_stream(device).cuda_stream, which took 30-44 us of each call's host time
    on the H200 (bench/RESULTS.md, the EP LL profile)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(torch.cuda.current_device() if device is None else device)
    return torch.cuda.current_stream(device).cuda_stream


def to_host(t):
    """``t`` copied to the CPU, stream-ordered as ``t.cpu()``: a CUDA tensor's current stream is
    synchronized first, and only then copied. While a thread sits in a ``.cpu()`` queued behind a
    running kernel, the soft NIC engine's CUDA copies wait for it (bench/copy_engine_stall.py:
    1.62 s of a 1.9 s kernel on the H200), so a kernel waiting for NIC-set data in a device heap
    would only see it after its bound; a thread in a stream synchronize does not hold them up."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    return t.cpu()


class Launcher(Resource):
    """Runs op lists for one Context. ``nic``: where the CUDA ring lives (``nic.alloc``);
    ``gpu``: launch on CUDA (else the HOST arm); ``warp_size``: the launches' warp size. ``dev``
    (the Context's device context, gpunet/device/descriptors.py DeviceContext) is set once it exists.

    A Resource: on CUDA ``close()`` first waits for every stream it launched on, because no
    kernel may still run on descriptors its Context is about to free (the Context closes it first).
    """

    def __init__(self, nic, gpu, warp_size):
        from gpunet.device.ops import Launch, load_ops

        self._gpu = gpu
        self._nic = nic               # its timeout_hint goes into a timed-out launch's error
        self._sms = 0                 # GPU: the device's SM count, read at the first bulk put
        self._device = torch.cuda.current_device() if gpu else None   # the Context's GPU
        self.dev = None
        self.warp_size = warp_size
        self.launch = Launch(grid=1, block=1, warp_size=warp_size)
        self._args, self._args_dev = None, None   # launch.args() + (dev.addr,), for self.dev
        self.lib = load_ops("cuda" if gpu else "host")
        if not gpu:
            # HOST arm: a launch that waits (a quiet, a wait_until) runs the CPU engines' passes
            # (the soft NIC's) on the caller's thread instead of waiting for their threads to be
            # scheduled (gpunet/host/progress.py; bench/cpu_put.py)
            progress.add_library(self.lib)
            if hasattr(nic, "set_idle_sleep_max"):     # its waiters progress it: sleep longer
                nic.set_idle_sleep_max(HOOKED_IDLE_SLEEP_MAX_US)
        if gpu:
            u32, vp = ctypes.c_uint32, ctypes.c_void_p
            f = self.lib.gpunet_ops_launch_stream
            f.argtypes, f.restype = [u32, u32, u32, vp, vp, u32, vp, u32], ctypes.c_int
            self._ring = nic.alloc(OPS_RING * ctypes.sizeof(abi.OpDesc), 4096)
            self._top = 0            # next free OpDesc slot; reset after each wait (_wait_launched)
            self._streams = set()    # the streams launched on since the last wait (raw handles)

    def bulk(self, kind, nbytes):
        """The bulk put geometry (bulk_geometry) for a put of ``nbytes`` to a peer reached by
        transport ``kind``, or None for the op-list kernel: only p2p puts are copies by the
        launching threads."""
        if kind != "p2p":
            return None
        if self._gpu and not self._sms:
            self._sms = torch.cuda.get_device_properties(
                torch.cuda.current_device()).multi_processor_count
        return bulk_geometry(nbytes, self._gpu, self.warp_size, self._sms)

    def run(self, ops, what, blocking=True, bulk=None):
        """Launch the op-list kernel on ``ops`` (with ``bulk``, a (grid, block, chunk) of
        :func:`bulk_geometry`: ops.cu's bulk put on them, every op an OP_PUT). Returns (the OpDescs
        the kernel writes, the failure recorded or None, whether the kernel is known to be done:
        always on the CPU, on CUDA only with ``blocking``: then the stream was synchronized)."""
        if bulk is not None:
            for o in ops:
                o.ok = 1              # k_put_bulk clears the ok of a put a block failed
        if self._gpu and bulk is not None and len(ops) == 1:
            return self._run_gpu_put1(ops, what, blocking, bulk)
        if self._gpu:
            return self._run_gpu(ops, what, blocking, bulk)
        st = self.dev.status
        if st.code:                   # recorded by a kernel nobody checked (see the module doc)
            return ops, self._take_failure("an earlier device kernel (not followed by "
                                           "ctx.check()), reported before %s" % what), False
        if bulk is not None and len(ops) == 1:   # one put: the p2p copy kernel, as on a GPU
            rc = self._launch_put_p2p(ops[0], bulk, None, 1)
        elif bulk is not None:
            grid, block, chunk = bulk
            rc = self.lib.gpunet_put_bulk_launch(grid, block, self.warp_size, 0, 0, 0, 0,
                                                 self.dev.addr, ctypes.addressof(ops), len(ops),
                                                 chunk, None, 1)
        else:
            if self._args_dev is not self.dev:
                self._args, self._args_dev = self.launch.args() + (self.dev.addr,), self.dev
            rc = self.lib.gpunet_ops_launch(*self._args, ctypes.addressof(ops), len(ops))
        if rc != 0:
            raise GpunetError("%s: device kernel launch failed (%d)" % (what, rc))
        return ops, self._take_failure(what) if st.code else None, True

    def _run_gpu(self, ops, what, blocking, bulk=None):
        n = len(ops)
        if n > OPS_RING:
            raise ConfigError("%s: %d ops exceed the launch ring (%d)" % (what, n, OPS_RING))
        if self._top + n > OPS_RING:
            err = self.sync(what)    # every slot in flight: wait for them (and report)
            if err is not None:
                return ops, err, False
        stream = self.stream()
        if len(self._streams) > 1 and any(o.kind == abi.OP_QUIET for o in ops):
            # a quiet covers the posts made before it runs: a put launched on another stream
            # may not have run yet (tests/test_api_cuda.py test_quiet_waits_for_a_put_on_another_stream)
            torch.cuda.synchronize(self._device)
            self._streams = {stream}
        addr = self._ring.ctypes.data + self._top * ctypes.sizeof(abi.OpDesc)
        self._top += n
        dops = (abi.OpDesc * n).from_address(addr)
        ctypes.memmove(addr, ctypes.addressof(ops), ctypes.sizeof(ops))
        if bulk is not None:
            grid, block, chunk = bulk
            rc = self.lib.gpunet_put_bulk_launch(grid, block, self.warp_size, 0, 0, 0, 0,
                                                 self.dev.addr, addr, n, chunk, stream or None, 0)
        else:
            rc = self.lib.gpunet_ops_launch_stream(1, 1, self.warp_size, self.dev.addr, addr, n,
                                                   stream or None, 0)
        if rc != 0:
            raise GpunetError("%s: CUDA kernel launch failed (cudaError %d)" % (what, rc))
        if blocking:
            return dops, self.sync(what), True
        return dops, None, False

    def _run_gpu_put1(self, ops, what, blocking, bulk):
        """One bulk put as the p2p copy kernel (ops.cu k_put_p2p): no OpDesc in the ring,
        nothing the kernel reads but the source."""
        rc = self._launch_put_p2p(ops[0], bulk, self.stream() or None, 0)
        if rc != 0:
            raise GpunetError("%s: CUDA kernel launch failed (cudaError %d)" % (what, rc))
        if blocking:
            return ops, self.sync(what), True
        return ops, None, False

    def _launch_put_p2p(self, o, bulk, stream, sync):
        """ops.cu k_put_p2p for OP_PUT ``o`` to a p2p peer: its destination as mapped here (the
        PeerDesc's remote_base, the host shadow of what the device reads), so the kernel reads
        no descriptor. The range was checked against the peer's live allocation
        (Context._check_remote), as the verb's in_heap would have."""
        grid, block, chunk = bulk
        dst = self.dev.peers[o.pe].remote_base + (o.dst - self.dev.ctx.local_base)
        return self.lib.gpunet_put_p2p_launch(grid, block, self.warp_size, dst, o.src, o.nbytes,
                                              chunk, bulk_tier(o.nbytes)[2], stream, sync)

    def stream(self):
        """The stream launches go on: torch's current CUDA stream handle (0 on the CPU), read
        per call (the caller may switch streams between puts) through current_stream_handle,
        and remembered until the next wait (_wait_launched)."""
        if not self._gpu:
            return 0
        h = current_stream_handle(self._device)
        self._streams.add(h)
        return h

    def _wait_launched(self):
        """CUDA: wait until every kernel launched since the last wait is done, then free the
        ring's slots. The current stream when it is the only one launched on, else the whole
        device: a kernel queued on another stream still reads its OpDescs from the ring when it
        runs (a slot reused now would give it another call's), and its puts are what a quiet
        promises complete."""
        if self._streams <= {current_stream_handle(self._device)}:
            torch.cuda.current_stream(self._device).synchronize()
        else:
            torch.cuda.synchronize(self._device)
        self._streams.clear()
        self._top = 0

    def sync(self, what):
        """Wait until every kernel launched so far is done (CUDA: _wait_launched), then take
        the failure they recorded: returned (and cleared), or None."""
        if self._gpu:
            self._wait_launched()
        st = self.dev.read_status()
        if not st.code:
            return None
        return self._take_failure(what + " (or an earlier non-blocking call on this stream)"
                                  if self._gpu else what)

    def _take_failure(self, what):
        err = abi.status_error(self.dev.read_status(), what)
        self.dev.clear_status()
        if isinstance(err, GpunetTimeoutError):
            err = with_hint(err, self._nic.timeout_hint())
        return err

    def _release(self):
        if self._gpu:
            self._wait_launched()
