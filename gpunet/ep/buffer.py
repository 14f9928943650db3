"""gpunet.ep.Buffer: DeepEP V1's ``Buffer`` (deep_ep/buffers/legacy.py) over gpunet's transports.

Same constructor, argument names, defaults, return tuples, shapes and dtypes as DeepEP's, so
vLLM's and SGLang's DeepEP backends can switch by import (``gpunet.ep.install_as_deep_ep()``).
Both modes: low-latency (decode: ``low_latency_dispatch`` / ``low_latency_combine``) and
high-throughput (training / prefill: ``get_dispatch_layout`` / ``dispatch`` / ``combine``).

Everything a kernel needs is computed here (gpunet/ep/_layout.py) and passed by value in one
LlParams / HtParams (gpunet/device/ep.py); the kernels are gpunet/device/include/gpunet/ep/ll.cuh and ht.cuh. On the CPU platform the
kernels run on the HOST arm synchronously; on CUDA they are enqueued on the current stream and
nothing here waits for them (CUDA-graph safe: counts stay in device tensors).

gpunet extensions are keyword-only and default to DeepEP's behaviour: ``transport`` ("auto" |
"ibgda" | "proxy", or a per-peer choice, see gpunet.init), ``timeout_s`` (runtime-settable, see
``set_timeout``), ``diagnostics`` (wait-cost matrices always on, ``report()``), and the launch
geometry (``num_blocks``, ``block_threads``, ``warp_size`` for the HOST arm).
"""
import ctypes
import logging
import weakref

import numpy as np
import torch

from gpunet import config
from gpunet.device import abi
from gpunet.device import ep as dep
from gpunet.errors import ClosedError, ConfigError, EPTimeout, GpunetError, with_hint
from gpunet.errors import TimeoutError as GpunetTimeoutError
from gpunet._launch import to_host
from gpunet.ep import _layout as lay
from gpunet.ep._pool import RecvPool, packed_empty

log = logging.getLogger("gpunet.ep")

topk_idx_t = torch.int64


class _CpuEvent:
    """The CPU platform's stand-in for a CUDA event: kernels there run synchronously, so it is
    complete when made."""

    def current_stream_wait(self):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class EventHandle:
    """A CUDA event recorded on the current stream when made (DeepEP's EventHandle); on the CPU
    platform a completed stand-in."""

    def __init__(self):
        if _on_gpu():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())
        else:
            self.event = _CpuEvent()

    def current_stream_wait(self):
        if isinstance(self.event, _CpuEvent):
            return
        torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self):
        self.event.synchronize()

    def query(self):
        return self.event.query()


class EventOverlap:
    """DeepEP's EventOverlap: an event (or None) plus tensors to keep alive until it completes.

    ``with ev: ...`` runs the block, then makes the current stream wait for the event;
    ``current_stream_wait()`` does the wait at once.
    """

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is None:
            raise ConfigError("this EventOverlap holds no event (pass async_finish=True to get one)")
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None:
            self.event.current_stream_wait()


# DeepEP's NUM_MAX_NVL_PEERS: up to this many ranks its high-throughput mode is intranode and
# needs no RDMA buffer (Config.get_rdma_buffer_size_hint returns 0, as DeepEP's does).
NUM_MAX_NVL_PEERS = 8


class Config:
    """DeepEP's performance Config (used by the high-throughput mode; kept for callers that build
    one, e.g. SGLang from JSON): ``Config(num_sms, num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        vals = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError("Config: every field is a positive int, got %r" % (vals,))
        if num_sms % 2:
            raise ConfigError("Config: num_sms must be even (channels use SM pairs), not %d" % num_sms)
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ConfigError("Config: NVL send chunk %d must be smaller than the receive buffer %d"
                              % (num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens))
        if num_max_rdma_chunked_send_tokens >= num_max_rdma_chunked_recv_tokens:
            raise ConfigError("Config: RDMA send chunk %d must be smaller than the receive buffer %d"
                              % (num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens))
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def _channels(self):
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of the high-throughput buffer (``num_nvl_bytes``) for this config: signal words
        and R headers, then for dispatch and for combine a staging ring and a receive ring of
        num_max_nvl_chunked_recv_tokens messages per (channel, rank), channels = num_sms / 2,
        a message being a bf16 row of hidden_bytes / 2 columns (rounded up to a multiple of 128)
        plus 144 B of metadata. Independent of the token count (the rings are reused in chunks).
        Exactly what dispatch / combine check (gpunet/ep/_layout.py HtLayout)."""
        _check_pos(hidden_bytes, "hidden_bytes")
        _check_pos(num_ranks, "num_ranks")
        hidden = -(-hidden_bytes // 2 // dep.GROUP) * dep.GROUP or dep.GROUP
        nc = max(1, min(self._channels(), dep.HT_MAX_CHANNELS))
        return lay.ht_size_hint(hidden, num_ranks, nc, self.num_max_nvl_chunked_recv_tokens)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0 for up to 8 ranks, as DeepEP's (its intranode mode needs no RDMA buffer): callers that
        allocate both hints (SGLang: num_nvl_bytes = max of the NVL hints, num_rdma_bytes = max of
        the RDMA ones) then get one high-throughput region, not two. More ranks: gpunet's HT mode
        has one flat group of ranks (no separate RDMA stage), so the same bytes as
        get_nvl_buffer_size_hint, usable as num_rdma_bytes of a Buffer with low_latency_mode=False
        and num_nvl_bytes=0."""
        _check_pos(num_ranks, "num_ranks")
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        return self.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)

    def __repr__(self):
        return ("Config(num_sms=%d, nvl_send=%d, nvl_recv=%d, rdma_send=%d, rdma_recv=%d)" % (
            self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens))


def _collectively(group, what, fn, *args):
    """``fn(*args)`` as one collective step over ``group`` (Bootstrap.collective: a failure on
    any rank raises a gpunet error on every rank, naming that rank); where torch.distributed is
    not initialised (one process, or torchrun variables the Context will initialise from) just
    ``fn(*args)``."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return fn(*args)
    from gpunet.host.bootstrap import Bootstrap
    return Bootstrap(group).collective(what, fn, *args)


def _check_timeout(seconds):
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
        raise ConfigError("timeout_s must be a number of seconds in (0, 86400], not %r" % (seconds,))


def _check_pos(v, name):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError("%s must be a positive int, not %r" % (name, v))


def _on_gpu():
    from gpunet.host.platform import get_platform
    return get_platform().name == "cuda"


def _addr(t):
    return 0 if t is None else t.data_ptr()


# HOST arm launch geometry: two blocks (the cross-block protocol runs in CI) of two warps each.
# Every thread is an OS thread on the CI machine's 2 cores, so it stays small; each block's
# threads wait on peers, so the grid must be co-resident (it is: far below the emulator's wave).
HOST_BLOCKS = 2
HOST_WARPS_PER_BLOCK = 2
# CUDA: 8 warps a block; the LL kernel takes 168-208 registers a thread (nvcc 13, sm_90: the
# p2p-only and the full build), so ONE block fits an SM. The grid (ll_grid): ranks sharing a GPU
# under MPS must all be resident at once (their blocks wait for each other), so a world of
# several ranks all p2p on one GPU splits its SMs but CUDA_SPARE_SMS among them: 2 ranks on an H200,
# 64-65 blocks a rank against 32: combine kernel 49.1-57.9 us against 58.6-64.4, dispatch's
# receive 11.3-12.7 against 13.7-14.8 (bench/RESULTS.md, 2026-12-03 thirteenth session, calls
# 1-2, aligned starts). Other worlds (a rank alone, NIC peers) keep one block per two SMs, at
# most CUDA_LL_BLOCKS (the split is not measured there), and no more than the sharing ranks
# leave room for.
CUDA_WARPS_PER_BLOCK = 8
CUDA_SPARE_SMS = 2
CUDA_LL_BLOCKS = 32
# High-throughput mode: 2 blocks per channel (send, receive). HOST: at most 2 channels of 2 warps
# (OS threads on 2 cores); CUDA: 16 warps a block (a sender's warps each own destinations, a
# receiver's warps take one token each per round; 16 x 32 threads at the kernel's 128 registers
# fill an SM's register file). With 8, DeepEP's default Config at 2 ranks, (20, 24, 256), took
# 622 us a BF16 dispatch and 844 us a combine where 16 warps took 547 and 596 (H100, 2 ranks
# under MPS, 4096 tokens x 7168, one run: bench/RESULTS.md, twenty-seventh session); every best
# Config of the sweeps since the twenty-fourth session had 16.
HOST_HT_MAX_CHANNELS = 2
HOST_HT_WARPS = 2
CUDA_HT_WARPS = 16
# The send chunk of the Configs a caller that passes none gets at 2 ranks (get_dispatch_config /
# get_combine_config; vLLM's DeepEP backend passes get_dispatch_config(R)); more ranks keep
# DeepEP's chunks (not measured here). At Buffer.num_sms = 20 on an H100 (2 ranks under MPS, p2p,
# 4096 tokens x 7168, 3 runs each: bench/RESULTS.md, thirty-seventh session) DeepEP's chunks (24 /
# 10, ring 256) took 433-479 us a BF16 dispatch and 624-631 a combine, chunk 48 with the same
# ring 362-371 and 587-591. The ring stays DeepEP's 256 tokens: a buffer sized from the old
# Config's hint still holds it.
HT_DEFAULT_CHUNK_2_RANKS = 48
# A dispatch's one host wait (the notify's counts): polls of the mapped-host mailbox
# (HtParams::host_info) before a stream synchronisation takes over. Only in worlds whose other
# ranks are all p2p peers: the soft NIC's engine is a Python thread, which a spin holding the GIL
# would starve. ~100 ns a poll on the 2-core CI VM, so ~10 ms, far above a notify's tens of us.
HT_NOTIFY_POLLS = 100_000


def ll_grid(sms, sharing, split):
    """Default LL grid on CUDA: blocks of one rank whose GPU has ``sms`` SMs and is used by
    ``sharing`` rank processes (this one included). ``split`` (every rank p2p on this GPU) and
    shared: (sms - CUDA_SPARE_SMS) // sharing; else min(CUDA_LL_BLOCKS, sms // 2), and shared
    never more than (sms - CUDA_SPARE_SMS) // sharing: every sharing rank's blocks (one an SM)
    are resident together."""
    room = (sms - CUDA_SPARE_SMS) // sharing if sharing > 1 else sms
    if split and sharing > 1:
        return max(1, room)
    return max(1, min(CUDA_LL_BLOCKS, sms // 2, room))


class Buffer:
    """The EP communication buffers of one rank (DeepEP V1's ``Buffer``; both modes).

    Attributes (as DeepEP's): ``rank``, ``group``, ``group_size``, ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``low_latency_mode``, ``explicitly_destroy``, ``enable_shrink``,
    ``runtime`` (here: the gpunet Context that owns the NIC, heap and transports).
    Only two LL buffers exist and the tensors a call returns (and the handle a dispatch returns)
    stay valid while at most two LL calls follow it: hold at most 2 LL results at once (DeepEP's
    rule). Calls of one Buffer must be ordered on one stream.
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None, *, transport="auto",
                 timeout_s=100.0, diagnostics=False, num_blocks=None, block_threads=None,
                 warp_size=None, recv_pool_bytes=0):
        """Collective over ``group``: every rank builds its buffers and connects to every peer.

        Arguments (DeepEP's): ``group`` a torch.distributed ProcessGroup (None: the default
        group); ``num_nvl_bytes`` (kept for the high-throughput mode; allocated on first use of
        ``get_local_buffer_tensor``); ``num_rdma_bytes`` the low-latency buffer, in the symmetric
        heap (size it with ``get_low_latency_rdma_size_hint``); ``low_latency_mode``;
        ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` (accepted:
        gpunet uses one QP or proxy channel per peer); ``explicitly_destroy`` (then ``destroy()``
        frees everything; else the garbage collector does); ``enable_shrink`` (a peer that stops
        answering is masked instead of raising EPTimeout); ``comm`` (mpi4py: not supported).

        gpunet extensions (keyword-only): ``transport`` as gpunet.init's; ``timeout_s`` the bound
        of every wait on a peer (runtime-settable: ``set_timeout``); ``diagnostics`` keeps the
        per-peer wait-cost matrices on when the caller passes none (``report()``);
        ``num_blocks`` / ``block_threads`` the kernels' grid; ``warp_size`` the HOST arm's warp
        (32 or 64; GPUs use theirs); ``recv_pool_bytes`` (the same on every rank; 0: none) a
        receive pool in the symmetric heap: the high-throughput dispatch allocates its receive
        tensors there (fresh tensors the caller owns, as torch.empty's; on CUDA through a
        torch MemPool, so stream-ordered reuse and record_stream work as usual), and every p2p
        peer then stores its rows straight into them instead of into a ring the receiver copies
        out of (docs/EP.md "The receive pool"). A call whose tensors do not fit (or one captured
        into a CUDA graph) takes ordinary memory and the ring. Receive tensors from the pool are
        valid until the Buffer is destroyed. Size: a dispatch's receive tensors, about
        rows x (2 hidden + 12 K + 4) bytes for BF16, with room for those the caller still holds.
        """
        from gpunet.context import Context

        self._closed = True            # until the Context exists
        self._ctx = None
        # Collective: a bad argument on one rank raises on every rank at once (the others would
        # otherwise wait in the Context's first exchange for torch.distributed's own timeout)
        _collectively(group, "gpunet.ep.Buffer", self._check_args, comm, dict(
            num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
            num_qps_per_rank=num_qps_per_rank, recv_pool_bytes=recv_pool_bytes), dict(
            low_latency_mode=low_latency_mode, explicitly_destroy=explicitly_destroy,
            enable_shrink=enable_shrink, diagnostics=diagnostics), timeout_s)
        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.diagnostics = diagnostics
        self.num_qps_per_rank = num_qps_per_rank
        self.recv_pool_bytes = recv_pool_bytes
        ctx = Context(group=group, transport=transport,
                      heap_bytes=self._heap_bytes(num_rdma_bytes, group, num_nvl_bytes) + lay.align(recv_pool_bytes, 4096),
                      timeout_s=float(timeout_s), warp_size=warp_size)
        self._ctx = ctx
        self.runtime = ctx
        self._closed = False
        # what this Buffer frees besides the Context (_free): the receive pool and host-mapped
        # words; the finalizer holds the dict, not the Buffer, and sees what is added later
        self._owned = {}
        try:
            self._setup(num_blocks, block_threads, float(timeout_s))
        except BaseException:
            self._close()
            raise
        if not explicitly_destroy:
            self._finalizer = weakref.finalize(self, Buffer._finalize, ctx, self._owned)

    @staticmethod
    def _check_args(comm, counts, flags, timeout_s):
        """ConfigError for arguments of the wrong type or range (run on every rank at once)."""
        if comm is not None:
            raise ConfigError("Buffer(comm=...): mpi4py communicators are not supported; pass a "
                              "torch.distributed ProcessGroup as `group`")
        for name, v in counts.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError("Buffer: %s must be a non-negative int, not %r" % (name, v))
        for name, v in flags.items():
            if not isinstance(v, bool):
                raise ConfigError("Buffer: %s must be a bool, not %r" % (name, v))
        _check_timeout(timeout_s)

    @staticmethod
    def _heap_bytes(num_rdma_bytes, group, num_nvl_bytes=0):
        import torch.distributed as dist
        r = group.size() if group is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        _, ctl = lay.ctl_layout(r)
        from gpunet.context import RESERVED_BYTES
        return RESERVED_BYTES + lay.align(num_rdma_bytes, 4096) + lay.align(num_nvl_bytes, 4096) + \
            ctl + (64 << 10)

    def _setup(self, num_blocks, block_threads, timeout_s):
        ctx = self._ctx
        self.rank, self.group_size = ctx.rank, ctx.world_size
        r = self.group_size
        self._gpu = ctx.platform.name == "cuda"
        # (an indexed device: tensors this Buffer allocates stay on its GPU whatever is current later)
        self._device = torch.device("cuda", torch.cuda.current_device()) if self._gpu else torch.device("cpu")
        self._build_kinds = self._kernel_kinds()  # the LL and HT kernels' (fixed for the Context)
        self._lib = dep.load_ep("cuda" if self._gpu else "host", kinds=self._build_kinds)
        self._ws = 32 if self._gpu else ctx.warp_size
        # collective, like the Context's steps: a grid one rank refuses raises on every rank
        ctx._boot.collective("gpunet.ep.Buffer (grid)", self._check_grid, num_blocks, block_threads)
        # the RDMA buffer (user-visible) and the control allocation (signals, per-peer state)
        self._ll = ctx.alloc((self.num_rdma_bytes,), torch.uint8) if self.num_rdma_bytes else None
        self._ctl_off, ctl_bytes = lay.ctl_layout(r)
        self._ctl = ctx.alloc((ctl_bytes,), torch.uint8)
        base = self._ctl_base = int(self._ctl.data_ptr())
        # a device-memory heap (CUDA) is not CPU-addressable: the numpy views then read a
        # host mirror that _ctl_refresh copies in (tests/test_p2p_cuda.py's EP round)
        self._ctl_mirror = bool(getattr(ctx, "_device_heap", False))
        self._ctl_np = (np.zeros(ctl_bytes, dtype=np.uint8) if self._ctl_mirror else
                        np.frombuffer((ctypes.c_uint8 * ctl_bytes).from_address(base), dtype=np.uint8))
        # two views of the per-peer state: numpy (the host reads it at once, without a device
        # sync) and a heap tensor (writes stream-ordered after the kernels queued before them)
        i32 = lambda name: self._ctl_np[self._ctl_off[name]:self._ctl_off[name] + 4 * r].view(np.int32)
        t32 = lambda name, n=r: self._ctl[self._ctl_off[name]:self._ctl_off[name] + 4 * n].view(torch.int32)
        self._mask_np, self._failed_np = i32("mask"), i32("failed")
        self._got_np, self._nrecv_np = i32("got"), i32("nrecv")
        self._mask_t, self._failed_t = t32("mask"), t32("failed")
        self._status_flag = self._ctl_np[self._ctl_off["status_flag"]:][:4].view(np.uint32)
        self._status_flag_t = t32("status_flag", 1)
        # the failure words the host polls after every call (LlParams::host_flags): [0] status
        # flag, [1 + p] failed[p]. The kernels store them here as well as in the heap, in mapped
        # host memory, so _check reads them with no device sync and no copy of a device-memory
        # heap (that copy, a sync per call, was in every p2p figure); every platform uses them,
        # so the CPU tests of failures cover this path
        self._hflags_mem = self._owned["hflags"] = ctx.platform.alloc("host", 4 * (1 + r))
        self._hflags_np = self._hflags_mem.view()[:4 * (1 + r)].view(np.int32)
        self._hflags_mv = memoryview(self._hflags_np)
        self._ht_mail = None        # (allocation, int32 view, memoryview): _ht_notify's mailbox
        self._failed_mv, self._status_flag_mv = memoryview(self._failed_np), memoryview(self._status_flag)
        # the current-stream lookup of every LL launch (_stream)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) if self._gpu else None
        self._prof_addr = 0         # LlParams::prof (bench/ep_profile.py: _set_profile)
        self._layouts = {}          # (t_max, hidden, num_experts) -> LlLayout
        self._param_cache = {}      # call key -> LlParams / HtParams template (_template)
        self._ht_layouts = {}       # (hidden, channels, ring) -> HtLayout
        self._ep_status = torch.zeros(ctypes.sizeof(dep.EpStatus), dtype=torch.uint8,
                                      device=self._device)
        # the per-peer Status blocks of the per-peer device contexts: device memory (every verb
        # reads its context's Status); the host reads one only to describe a failure
        self._peer_status = torch.zeros(128 * r, dtype=torch.uint8, device=self._device)
        # workspace (device memory): signal counts seen, grid sync words; per shape: the rest
        # (ll.cuh LlParams::expected: seen counts, self words, the signals raised, the cleans run,
        # the time of this rank's last heartbeat)
        self._expected = torch.zeros(8 * r + 10, dtype=torch.int64, device=self._device)
        self._sync = torch.zeros(dep.SYNC_WORDS * dep.SYNC_STRIDE, dtype=torch.int64, device=self._device)
        self._shape_ws = {}
        self._ctxs_buf = None
        self.set_timeout(timeout_s)
        self._ll_idx = 0
        # the LL order rule's bookkeeping (_ll_area_check): LL sends launched, per area (kind *
        # 2 + LL buffer) the record of the send that used it last, and the highest send number
        # whose receive has completed here
        self._ll_sent = 0
        self._ll_areas = [None] * 4
        self._ll_max_done = -1
        # the high-throughput region (symmetric heap): num_nvl_bytes, or without it in normal mode
        # the num_rdma_bytes allocation; and its device-memory workspace (ht.cuh)
        self._nvl = ctx.alloc((self.num_nvl_bytes,), torch.uint8) if self.num_nvl_bytes else None
        self._ht = self._nvl if self._nvl is not None else (None if self.low_latency_mode else self._ll)
        # (ht.cuh HtParams::epoch: the op counter, then the notifies run: the same on every rank)
        self._ht_epoch = torch.tensor([1, 0], dtype=torch.int64, device=self._device)
        # (ht.cuh HtParams::self_sig: the self words, then the last heartbeat's time)
        self._ht_self = torch.zeros(4 * dep.HT_MAX_CHANNELS + 1, dtype=torch.int64, device=self._device)
        self._ht_sync = torch.zeros(dep.SYNC_WORDS * dep.SYNC_STRIDE, dtype=torch.int64, device=self._device)
        self._ht_ws = torch.zeros(dep.ht_ws_words(r), dtype=torch.int64, device=self._device)
        self._ht_lib = None
        # the receive pool (recv_pool_bytes): the HT dispatch's receive tensors, which mapped
        # peers store rows into (gpunet/ep/_pool.py; ht.cuh "the receive pool")
        self._pool_mem = ctx.alloc((self.recv_pool_bytes,), torch.uint8) if self.recv_pool_bytes else None
        self._pool = self._owned["pool"] = RecvPool(self._pool_mem) if self._pool_mem is not None else None
        self._pool_warned = False   # _pool_full said it once
        # (fp8, hidden, topk) -> the rows of the last HT dispatch of that kind (_ht_recv_guess_rows)
        self._ht_rows_seen = {}
        self._ht_prelaunch = config.get("GPUNET_EP_HT_PRELAUNCH") == "1"
        self._ht_pull = config.get("GPUNET_EP_HT_PULL") == "1"
        self._ht_split = config.get("GPUNET_EP_HT_SPLIT") == "1"
        self._ht_prelaunched = 0    # dispatches whose prelaunched data phase ran (the tests read it)
        self._stats = {"dispatch": torch.zeros(r, r, dtype=torch.int64, device=self._device),
                       "combine": torch.zeros(r, r, dtype=torch.int64, device=self._device)}
        self._warned_masked = set()

    def _check_grid(self, num_blocks, block_threads):
        """The kernels' grid (self._grid, self._block) from the arguments and the platform;
        ConfigError for one the kernels cannot launch."""
        if self._gpu:
            self._cuda_index = torch.cuda.current_device()      # the device of every LL launch
            sms = torch.cuda.get_device_properties(self._cuda_index).multi_processor_count
            self._grid = num_blocks or ll_grid(sms, len(self._ctx.ranks_on_gpu),
                                               bool(self._ll_world_flags() & dep.F_GPU_SCOPE))
            self._block = block_threads or CUDA_WARPS_PER_BLOCK * 32
        else:
            self._grid = num_blocks or HOST_BLOCKS
            self._block = block_threads or HOST_WARPS_PER_BLOCK * self._ws
        if self._block % self._ws or not 0 < self._block <= 1024 or self._grid < 1:
            raise ConfigError("Buffer: block_threads must be a multiple of the warp size (%d) up to "
                              "1024 and num_blocks >= 1 (got %r, %r)" % (self._ws, block_threads, num_blocks))
        most = self._lib.gpunet_ep_ll_max_block()
        if most and self._block > most:
            raise ConfigError("Buffer: block_threads=%d, but the low-latency kernel takes at most %d "
                              "threads a block on this device (its registers); the default is %d"
                              % (self._block, most, CUDA_WARPS_PER_BLOCK * 32 if self._gpu else
                                 HOST_WARPS_PER_BLOCK * self._ws))
        if not self._gpu and self._grid * self._block > 1024:
            raise ConfigError("Buffer: on the CPU platform the grid (num_blocks * block_threads = %d) "
                              "must be co-resident in the HOST emulator's wave of 1024 threads"
                              % (self._grid * self._block))

    # ---- lifetime ---------------------------------------------------------------------------
    @staticmethod
    def _finalize(ctx, owned):
        try:
            Buffer._free(ctx, owned)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to report to
            pass

    @staticmethod
    def _free(ctx, owned):
        """The receive pool (its tensors lie in the Context's heap), the Context, then the
        host-mapped words (``owned``: "pool", "hflags", "mail"). Also what the garbage collector
        runs for a Buffer made with explicitly_destroy=False, which closed the Context alone and
        left the host-mapped allocations (cudaHostAlloc on GPUs) behind."""
        pool = owned.get("pool")
        if pool is not None:
            pool.close()
        ctx.close()
        for k in ("hflags", "mail"):
            if owned.get(k) is not None:
                owned[k].close()

    def _close(self):
        if self._ctx is not None:
            fin = getattr(self, "_finalizer", None)
            if fin is not None:
                fin.detach()
            ctx, self._ctx = self._ctx, None
            self._closed = True
            Buffer._free(ctx, getattr(self, "_owned", {}))

    def destroy(self):
        """Free every resource (NIC, heap, transports). Requires ``explicitly_destroy=True``
        (as DeepEP); not collective. The Buffer is unusable afterwards."""
        if not self.explicitly_destroy:
            raise ConfigError("destroy(): this Buffer was made with explicitly_destroy=False, so the "
                              "garbage collector frees it; pass explicitly_destroy=True to destroy it "
                              "yourself")
        self._close()
        self.runtime = None

    def _alive(self):
        if self._closed:
            raise ClosedError("this gpunet.ep.Buffer was destroyed")

    # ---- DeepEP's static helpers ------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled():
        """True: gpunet compiles its CUDA arm for sm_90 (GPUNET_CUDA_ARCH)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """SMs of the high-throughput kernels (must be even, as DeepEP's)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 2 \
                or new_num_sms % 2:
            raise ConfigError("set_num_sms: the SM count must be an even int >= 2, not %r" % (new_num_sms,))
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An EventOverlap of an event recorded on the current stream now."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts, *, breakdown=False):
        """Bytes the RDMA buffer needs for low-latency calls of this shape (pass them as
        ``num_rdma_bytes``). Any hidden that is a multiple of 128, any token count; raises
        ConfigError for a shape whose buffer would overflow an offset (int32 positions, 39-bit
        heap offsets). ``breakdown=True`` (gpunet): returns ``(bytes, {area: bytes})`` over both
        LL buffers."""
        layout = lay.LlLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        if breakdown:
            return layout.total, layout.breakdown()
        return layout.total

    @staticmethod
    def _default_ht_config(num_ranks, chunk_more_ranks):
        """``Buffer.num_sms`` SMs, DeepEP's 256-token receive ring, send chunks of
        HT_DEFAULT_CHUNK_2_RANKS at up to 2 ranks, else ``chunk_more_ranks`` (DeepEP's)."""
        _check_pos(num_ranks, "num_ranks")
        chunk = chunk_more_ranks if num_ranks > 2 else HT_DEFAULT_CHUNK_2_RANKS
        return Config(Buffer.num_sms, chunk, 256, 6, 128)

    @staticmethod
    def get_dispatch_config(num_ranks):
        """A Config for the high-throughput dispatch (any rank count; _default_ht_config, DeepEP's
        chunk of 6 beyond 2 ranks)."""
        return Buffer._default_ht_config(num_ranks, 6)

    @staticmethod
    def get_combine_config(num_ranks):
        """A Config for the high-throughput combine (any rank count; _default_ht_config, DeepEP's
        chunk of 4 beyond 2 ranks)."""
        return Buffer._default_ht_config(num_ranks, 4)

    def get_comm_stream(self):
        """The communication stream (CUDA: a torch.cuda.Stream of this Buffer; the CPU platform has
        no streams: None). Low-latency kernels run on the caller's current stream, as DeepEP's."""
        self._alive()
        if not self._gpu:
            return None
        if getattr(self, "_comm_stream", None) is None:
            self._comm_stream = torch.cuda.Stream()
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """The raw buffer as a tensor of ``dtype`` from byte ``offset`` (``size``: a torch.Size,
        the first size.numel() elements viewed with that shape). ``use_rdma_buffer``: the RDMA
        (low-latency) buffer in the symmetric heap; else the NVL buffer (num_nvl_bytes in the
        symmetric heap: the high-throughput mode's rings). Callers may use the RDMA buffer as scratch between LL phases,
        then call ``clean_low_latency_buffer`` on every rank before the next LL call."""
        self._alive()
        if use_rdma_buffer:
            raw = self._ll if self._ll is not None else torch.empty(0, dtype=torch.uint8, device=self._device)
        else:
            raw = self._nvl if self._nvl is not None else torch.empty(0, dtype=torch.uint8, device=self._device)
        es = torch.empty((), dtype=dtype).element_size()
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= raw.numel():
            raise ConfigError("get_local_buffer_tensor: offset %r outside [0, %d] bytes"
                              % (offset, raw.numel()))
        n = (raw.numel() - offset) // es
        t = raw[offset:offset + n * es].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > t.numel():
            raise ConfigError("get_local_buffer_tensor: size %s needs %d elements, the buffer holds %d"
                              % (tuple(size), size.numel(), t.numel()))
        return t[:size.numel()].view(size)

    # ---- high-throughput mode (gpunet/device/include/gpunet/ep/ht.cuh) ------------------------------
    def _ht_geometry(self, config):
        """(channels, ring, chunk, block threads) for a Config: channels = num_sms / 2 (the grid is
        2 blocks per channel, so never more blocks than num_sms); the HOST arm caps the channels
        at HOST_HT_MAX_CHANNELS (every device thread is an OS thread there)."""
        nc = config.num_sms // 2
        warps = getattr(self, "_ht_warps", None)    # bench/ep_ht.py sweeps it (private knob)
        if self._gpu:
            block = (warps or CUDA_HT_WARPS) * 32
        else:
            nc = min(nc, HOST_HT_MAX_CHANNELS)
            block = (warps or HOST_HT_WARPS) * self._ws
        nc = max(1, min(nc, dep.HT_MAX_CHANNELS))
        ring = config.num_max_nvl_chunked_recv_tokens
        chunk = config.num_max_nvl_chunked_send_tokens
        if chunk > dep.HT_MAX_CHUNK:
            raise ConfigError("Config %r: the send chunk (num_max_nvl_chunked_send_tokens=%d) is at most "
                              "%d in gpunet's HT mode" % (config, chunk, dep.HT_MAX_CHUNK))
        if ring < 2 * chunk + 32:
            raise ConfigError("Config %r: the receive ring (num_max_nvl_chunked_recv_tokens=%d) must "
                              "hold at least 2 * send chunk + 32 = %d tokens (the combine receiver "
                              "works on up to 32 tokens past the last credit)" % (config, ring, 2 * chunk + 32))
        return nc, ring, chunk, block

    def _ht_region(self, hidden, nc, ring, what):
        if self._ht is None:
            raise ConfigError("%s: this Buffer has no high-throughput buffer: pass num_nvl_bytes="
                              "Config.get_nvl_buffer_size_hint(hidden * 2, num_ranks) (or, with "
                              "low_latency_mode=False, num_rdma_bytes)" % what)
        key = (hidden, nc, ring)
        layout = self._ht_layouts.get(key)
        if layout is None:          # checked when it was made (the host's time per call counts)
            layout = self._ht_layouts[key] = lay.HtLayout(int(self._ht.numel()), hidden, self.group_size,
                                                          nc, ring, what)
        return layout

    def _ht_params(self, op, phases, flags, layout, hidden, num_tokens, topk, nc, ring, chunk):
        """A fresh HtParams for one launch (a copy of the template per call shape: _template); the
        caller sets the tensor addresses."""
        P = self._template(("ht", op, phases, flags, hidden, num_tokens, topk, nc, ring, chunk, self._timeout_s),
                           lambda: self._build_ht_params(op, phases, flags, layout, hidden, num_tokens,
                                                         topk, nc, ring, chunk))
        P.base.prof = self._prof_addr
        return P

    def _build_ht_params(self, op, phases, flags, layout, hidden, num_tokens, topk, nc, ring, chunk):
        r = self.group_size
        P = dep.HtParams()
        B = P.base
        B.op, B.phases, B.flags, B.rank, B.nranks = op, phases, flags, self.rank, r
        B.hidden, B.topk, B.num_tokens = hidden, topk, num_tokens
        B.msg_stride, B.payload_bytes = lay.msg_stride(hidden, bool(flags & dep.F_FP8))
        B.hdr_stride = lay.HT_HDR_STRIDE
        B.ctxs = self._ctxs_addr
        # the grid waits' bound: above the longest notify wait on a beating peer (ht.cuh hb_cap,
        # 3 x (2 T + 1 s), and a last bound T: "Waits on a peer")
        B.timeout_ns = int((7 * self._timeout_s + 4.0) * 1e9)
        for k in ("mask", "failed", "got", "nrecv", "status_flag"):
            setattr(B, k, self._ctl_base + self._ctl_off[k])
        B.status, B.sync = _addr(self._ep_status), _addr(self._ht_sync)
        if self.enable_shrink:
            B.flags |= dep.F_SHRINK
        P.nchannels, P.ring, P.chunk = nc, ring, chunk
        P.peer_timeout_ns = int(self._timeout_s * 1e9)
        P.epoch, P.self_sig, P.ws = _addr(self._ht_epoch), _addr(self._ht_self), _addr(self._ht_ws)
        base = int(self._ht.data_ptr())
        kind = 1 if op == dep.OP_HT_COMBINE else 0
        P.sig, P.shdr, P.rhdr = base + layout.sig, base + layout.shdr, base + layout.rhdr
        P.send_ring, P.recv_ring = base + layout.send[kind], base + layout.recv[kind]
        P.rdesc = base + layout.rdesc
        if self._pool is not None:
            # every rank has a pool (the same size: a collective alloc); a combine's token side
            # finds its peers' in-place rows by their offsets in it (ht.cuh ht_take_pull)
            P.pool, P.pool_bytes = int(self._pool_mem.data_ptr()), int(self._pool_mem.numel())
            if op == dep.OP_HT_DISPATCH:
                B.flags |= dep.F_HT_DESC
        # failures mirrored into host memory (as the LL kernels: _check reads them without a
        # device sync or a copy of a device-memory heap), and the profile stamps
        B.host_flags = self._hflags_mem.ptr
        return P

    def _ht_launch(self, P, grid, block, what):
        if self._ht_lib is None:
            self._ht_lib = dep.load_ep_ht("cuda" if self._gpu else "host", kinds=self._build_kinds)
        if P.base.prof and self._prof_ref.numel() < grid * dep.STAMPS:
            err = ConfigError("%s: the profile stamps tensor holds %d blocks, this launch has %d"
                              % (what, self._prof_ref.numel() // dep.STAMPS, grid))
        else:
            stream = self._stream() if self._gpu else None
            rc = self._ht_lib.gpunet_ep_ht_launch(ctypes.addressof(P), grid, block, self._ws, stream, 0)
            if rc == 0:
                return
            err = GpunetError("%s: EP kernel launch failed (error %d)" % (what, rc))
        if P.base.phases & dep.PH_NOTIFY:
            self._ht_epoch[1:].add_(1)  # not launched: the peers' notifies counted this one
        if P.base.flags & dep.F_HT_BUMP and not P.base.flags & dep.F_HT_PRE:
            self._ht_skip_op()          # not launched: neither was the epoch bump it carries
            # (a prelaunched data phase's caller does that once the notify has ended: dispatch)
        raise err

    @staticmethod
    def _wait_previous(previous_event):
        if previous_event is not None:
            if not isinstance(previous_event, EventOverlap):
                raise ConfigError("previous_event must be an EventOverlap (Buffer.capture()), not %r"
                                  % (previous_event,))
            if previous_event.event is not None:
                previous_event.current_stream_wait()

    @staticmethod
    def _event(async_finish, keep):
        return EventOverlap(EventHandle(), keep) if async_finish else EventOverlap(None)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """Where each token goes, from its top-k experts (plain torch ops on the current stream).

        Arguments: ``topk_idx`` int64 [T, K] (-1 = no expert), ``num_experts`` (a multiple of the
        rank count; expert e lives on rank e // (E / R)); ``previous_event`` an EventOverlap to
        wait for first; ``async_finish`` return an event; ``allocate_on_comm_stream`` accepted.

        Returns ``(num_tokens_per_rank int32 [R], None (num_tokens_per_rdma_rank: intranode),
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], event)``: a token counts
        once per rank and once per expert however many of its slots name them."""
        self._alive()
        r = self.group_size
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or \
                num_experts % r:
            raise ConfigError("get_dispatch_layout: num_experts must be a positive multiple of the %d "
                              "ranks, not %r" % (r, num_experts))
        topk_idx = self._tensor(topk_idx, "topk_idx", topk_idx_t, ndim=2)
        self._wait_previous(previous_event)
        t = topk_idx.shape[0]
        e_loc = num_experts // r
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        # a -1 (or out-of-range) slot goes to an extra column, dropped after the scatter
        col = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts))
        per_expert = torch.zeros((t, num_experts + 1), dtype=torch.bool, device=self._device)
        per_expert.scatter_(1, col, True)
        rank_col = torch.where(valid, topk_idx // e_loc, torch.full_like(topk_idx, r))
        in_rank = torch.zeros((t, r + 1), dtype=torch.bool, device=self._device)
        in_rank.scatter_(1, rank_col, True)
        is_token_in_rank = in_rank[:, :r].contiguous()
        num_tokens_per_expert = per_expert[:, :num_experts].sum(0, dtype=torch.int32)
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        keep = (topk_idx, is_token_in_rank, num_tokens_per_expert, num_tokens_per_rank)
        return (num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank,
                self._event(async_finish, keep))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None,
                 async_finish=False, allocate_on_comm_stream=False):
        """High-throughput dispatch: each token goes once to every rank in its is_token_in_rank row.

        Arguments: ``x`` bf16 [T, H], or FP8 ``(x_e4m3 [T, H] float8_e4m3fn, scales float32
        [T, H/128])`` (H any multiple of 128); ``handle`` a previous dispatch's handle (cached
        layout: the same tokens go to the same ranks; topk_idx / topk_weights must be None); else
        ``is_token_in_rank`` bool [T, R] and ``num_tokens_per_expert`` int32 [E] (from
        get_dispatch_layout; ``num_tokens_per_rank`` is accepted and not needed),
        ``topk_idx`` int64 [T, K] and ``topk_weights`` float32 [T, K] (both or neither, K <= 16);
        ``expert_alignment`` rounds each expert count up to a multiple; ``num_worst_tokens`` > 0:
        recv tensors have exactly that many rows, no host sync (rows past the received ones have
        recv_topk_idx -1; recv_x there is unspecified), the count list is empty; ``config`` a
        Config (default get_dispatch_config(R)); ``previous_event`` wait for it first;
        ``async_finish`` return an event. ``num_tokens_per_rdma_rank`` must be None (intranode).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``: recv_x like x with N rows (bf16 [N, H], or (fp8 [N, H], float32
        [N, H/128])), rows from source rank 0 first, then 1, ..., each source's tokens in order;
        recv_topk_idx int64 [N, K] with LOCAL expert ids (global - rank * E/R) and -1 for experts
        elsewhere; recv_topk_weights float32 [N, K] (0 where -1); the per-local-expert counts as a
        python list (aligned); handle (opaque: pass it to combine or a cached dispatch). With a
        handle: ``(recv_x, None, None, None, None, event)``. Without num_worst_tokens or a handle
        the receive tensors may be views of the first N rows of an allocation for up to 1/8 more
        (made while the notify ran, sized from the last such call: _ht_recv_guess_rows). The receive
        tensors (recv_x, its scales, recv_topk_idx, recv_topk_weights and the handle's source
        indices) are parts of one allocation (_pool.packed): it is freed when the last dies."""
        self._alive()
        what = "dispatch"
        r = self.group_size
        if num_tokens_per_rdma_rank is not None:
            raise ConfigError("dispatch: num_tokens_per_rdma_rank must be None (gpunet's HT mode is "
                              "one flat group of ranks; get_dispatch_layout returns None for it)")
        fp8 = isinstance(x, (tuple, list))
        if fp8:
            if len(x) != 2:
                raise ConfigError("dispatch: FP8 x is the pair (x_e4m3 [T, H], scales [T, H/128])")
            xq = self._tensor(x[0], "x[0]", torch.float8_e4m3fn, ndim=2)
            num_tokens, hidden = xq.shape
            xs = self._tensor(x[1], "x[1] (scales)", torch.float32, shape=(num_tokens, hidden // dep.GROUP))
            xs = xs.contiguous()
        else:
            xq = self._tensor(x, "x", torch.bfloat16, ndim=2)
            xs = None
            num_tokens, hidden = xq.shape
        if hidden % dep.GROUP or hidden == 0:
            raise ConfigError("dispatch: hidden %d is not a positive multiple of %d" % (hidden, dep.GROUP))
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ConfigError("dispatch: num_worst_tokens must be an int >= 0, not %r" % (num_worst_tokens,))
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ConfigError("dispatch: expert_alignment must be an int >= 1, not %r" % (expert_alignment,))
        config = config if config is not None else self.get_dispatch_config(r)
        if not isinstance(config, Config):
            raise ConfigError("dispatch: config must be a gpunet.ep.Config, not %r" % (config,))
        self._wait_previous(previous_event)
        dev = self._device
        flags = dep.F_FP8 if fp8 else 0
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ConfigError("dispatch(handle=...): a cached dispatch takes no topk_idx / "
                                  "topk_weights (as DeepEP's)")
            h = self._ht_handle(handle, what)
            if h["num_tokens"] != num_tokens or h["hidden"] != hidden:
                raise ConfigError("dispatch(handle=...): the handle is for %d tokens of hidden %d, x is "
                                  "[%d, %d]" % (h["num_tokens"], h["hidden"], num_tokens, hidden))
            nc, ring, chunk, block = self._ht_geometry(config)
            nc = h["nc"]
            layout = self._ht_region(hidden, nc, ring, what)
            rows = h["rows"]
            recv_x, recv_s, src, _, _, direct = self._ht_recv_tensors(fp8, rows, hidden, 0)
            P = self._ht_params(dep.OP_HT_DISPATCH, dep.PH_DATA, flags | dep.F_HT_BUMP, layout, hidden,
                                num_tokens, 0, nc, ring, chunk)
            P.base.flags |= direct
            P.x, P.x_scales = _addr(xq), _addr(xs)
            P.out_x, P.out_scales, P.out_src_idx = _addr(recv_x), _addr(recv_s), _addr(src)
            P.send_pos, P.send_cnt = _addr(h["send_pos"]), _addr(h["send_cnt"])
            P.chan_prefix = _addr(h["chan_prefix"])
            P.num_recv_max = rows
            keep = (xq, xs, recv_x, recv_s, src) + tuple(handle)
            self._ht_launch(P, 2 * nc, block, what)
            self._check(what, "dispatch", mirrored=True)
            out_x = (recv_x, recv_s) if fp8 else recv_x
            return out_x, None, None, None, None, self._event(async_finish, keep)
        if is_token_in_rank is None:
            raise ConfigError("dispatch: is_token_in_rank (from get_dispatch_layout) is required "
                              "without a handle")
        in_rank = self._tensor(is_token_in_rank, "is_token_in_rank", torch.bool, shape=(num_tokens, r))
        if (topk_idx is None) != (topk_weights is None):
            raise ConfigError("dispatch: pass topk_idx and topk_weights together (or neither)")
        k = 0
        if topk_idx is not None:
            topk_idx = self._tensor(topk_idx, "topk_idx", topk_idx_t, ndim=2)
            k = topk_idx.shape[1]
            if topk_idx.shape[0] != num_tokens or not 1 <= k <= dep.MAX_TOPK:
                raise ConfigError("dispatch: topk_idx must be [%d, K] with 1 <= K <= %d, not %s"
                                  % (num_tokens, dep.MAX_TOPK, tuple(topk_idx.shape)))
            topk_weights = self._tensor(topk_weights, "topk_weights", torch.float32, shape=(num_tokens, k))
            flags |= dep.F_HT_TOPK | dep.F_HT_WEIGHTS
        if num_tokens_per_expert is not None:
            ntpe = self._tensor(num_tokens_per_expert, "num_tokens_per_expert", torch.int32, ndim=1)
            num_experts = ntpe.numel()
        elif topk_idx is not None:
            raise ConfigError("dispatch: num_tokens_per_expert (from get_dispatch_layout) is required "
                              "with topk_idx")
        else:
            ntpe, num_experts = None, r
        if num_experts % r or num_experts < 1:
            raise ConfigError("dispatch: %d experts is not a positive multiple of the %d ranks"
                              % (num_experts, r))
        e_loc = num_experts // r
        if lay.HT_HDR_STRIDE // 4 < dep.HT_HDR_HEAD + dep.HT_MAX_CHANNELS + e_loc:
            raise ConfigError("dispatch: %d local experts per rank do not fit the %d-byte header"
                              % (e_loc, lay.HT_HDR_STRIDE))
        nc, ring, chunk, block = self._ht_geometry(config)
        layout = self._ht_region(hidden, nc, ring, what)
        # the notify writes all four; one allocation (each torch.empty is host time before the
        # launch)
        send_pos, send_cnt, chan_prefix, info = packed_empty(
            [((num_tokens, r), torch.int32), ((nc, r), torch.int32), ((r, nc + 1), torch.int32),
             ((r + 2 + e_loc,), torch.int32)], dev)
        P = self._ht_params(dep.OP_HT_DISPATCH, dep.PH_NOTIFY, flags, layout, hidden, num_tokens, k,
                            nc, ring, chunk)
        P.base.num_experts, P.base.e_loc = num_experts, e_loc
        P.alignment = expert_alignment
        P.x, P.x_scales = _addr(xq), _addr(xs)
        P.topk_idx, P.topk_weights = _addr(topk_idx), _addr(topk_weights)
        P.in_rank, P.ntpe = _addr(in_rank), _addr(ntpe)
        P.send_pos, P.send_cnt, P.chan_prefix, P.recv_info = (_addr(send_pos), _addr(send_cnt),
                                                             _addr(chan_prefix), _addr(info))
        worst = num_worst_tokens > 0
        if worst:
            rows = num_worst_tokens
            recv = self._ht_recv_tensors(fp8, rows, hidden, k)
            self._ht_data_params(P, recv, rows, P.base.flags | dep.F_HT_WORST, dep.PH_NOTIFY | dep.PH_DATA)
            self._ht_launch(P, 2 * nc, block, what)
        else:
            key = (fp8, hidden, k)
            cap = self._ht_recv_guess_rows(key)
            if cap and self._ht_prelaunch_ok():
                P.base.flags |= dep.F_HT_PRE    # the notify writes the go word
            P.num_recv_max = cap
            notify_flags = P.base.flags
            n = r + 2 + e_loc                   # recv_info's words: rank prefix, expert counts, go
            pre = []                            # [True] once the data phase is prelaunched
            filled = False                      # recv: the prelaunch's tensors, filled for it
            try:
                host, early = self._ht_notify(P, info, block, n, what,
                                              meanwhile=lambda: self._ht_early(P, key, cap, nc, block, what, pre))
                rows = int(host[r])
                self._ht_rows_seen[key] = rows
                went = bool(notify_flags & dep.F_HT_PRE) and host[n - 1] != 0
                if not went:
                    self._check(what, "dispatch", mirrored=True)  # the notify is done: its failures are seen
                    recv = self._ht_recv_fit(early, rows)
                    filled = recv is not None and bool(pre)   # (its data phase ended unrun: go 0)
                    early = None        # a guess that does not fit is freed before the exact tensors
                    if recv is None:
                        recv = self._ht_recv_tensors(fp8, rows, hidden, k)
            except BaseException as e:
                # (prelaunched: the data phase bumped the epoch itself if its go word said run)
                self._ht_skip_op(getattr(e, "ht_peer_op", None), ran=info[n - 1:n] if pre else None)
                raise
            if not went:
                self._ht_data_params(P, recv, rows, notify_flags & ~dep.F_HT_PRE, dep.PH_DATA, fill=not filled)
                self._ht_launch(P, 2 * nc, block, what)
            else:                       # the prelaunched data phase runs: views of its tensors
                self._ht_prelaunched += 1
                recv = self._ht_recv_fit(early, rows)
                if recv is None:        # (the go word is _ht_recv_fit's rule: never)
                    raise GpunetError("%s: internal: the prelaunched data phase runs into tensors of %d "
                                      "rows for %d received ones" % (what, early[0].shape[0], rows))
        recv_x, recv_s, src, recv_topk, recv_w, _ = recv
        try:
            self._check(what, "dispatch", mirrored=True)
        except GpunetError as e:
            # num_worst_tokens: the notify ran in this launch, whose last block bumped the count
            if getattr(e, "ht_peer_op", None) is not None:
                self._ht_catch_up(e.ht_peer_op)
            raise
        counts = [] if worst else host[r + 1:n - 1].tolist()    # python ints (numpy's tolist)
        handle = (info[:r + 1], chan_prefix, src, in_rank, send_pos, send_cnt,
                  {"nc": nc, "rows": rows, "num_tokens": num_tokens, "hidden": hidden, "topk": k,
                   "num_recv": None if worst else rows})
        keep = (xq, xs, topk_idx, topk_weights, in_rank, ntpe, recv_x, recv_s, recv_topk, recv_w) + handle[:6]
        out_x = (recv_x, recv_s) if fp8 else recv_x
        return out_x, recv_topk, recv_w, counts, handle, self._event(async_finish, keep)

    def _ht_skip_op(self, peer_op=None, ran=None):
        """This rank's HT operation ends without the launch that bumps the epoch (the host raised
        once it had started the notify: an allocation, a failure the notify recorded, a launch
        that failed). The peers finish the operation without this rank (they mask it or raise) and
        bump theirs, so this rank's epoch moves on too, on the stream: a rank left one epoch
        behind reads every peer word of the next operation as complete (ht.cuh count_of) and
        returns stale rows as received ones. An exception before the notify launch leaves the
        epoch alone (nothing of the operation reached a peer: calling it again resumes it).

        ``peer_op``: the notify found this rank out of step (EP_ERR_OUT_OF_STEP) with a peer at
        that op count, ahead of it (it skipped an op without a notify its peers ran): this rank
        catches up with it, to the count the peer has after this op, so that once the ranks
        unmask each other (low_latency_clean_mask_buffer) they are in step again.

        ``ran``: the notify's go word (an int32 tensor of one element, on the device) when the
        data phase was prelaunched: 1 if that data phase ran, and with it the bump it carries (the
        host raised after launching it, before it read the word: an interrupt while it polled),
        so the counter moves by 1 - go, on the stream behind both kernels."""
        # the op counter; the notify counter moved if the notify ran
        self._ht_epoch[:1].add_(1 if ran is None else 1 - ran.to(torch.int64))
        if peer_op is not None:
            self._ht_catch_up(peer_op)

    def _ht_catch_up(self, peer_op):
        """This rank's op count after an operation the notify found out of step with a peer at
        ``peer_op`` (ahead): the peer's count after it."""
        self._ht_epoch[0] = max(int(self._ht_epoch[0]), int(peer_op) + 1)

    def _ht_notify(self, P, info, block, n, what, meanwhile=None):
        """Launch the dispatch's notify and return ``(recv_info's n int32 words on the host,
        meanwhile())``: the one host wait of a dispatch (recv_x's rows), with ``meanwhile`` run
        between the launch and the wait (host work the notify's GPU time hides). The kernel
        mirrors the words into a mapped-host mailbox and sets its flag last; in worlds whose
        other ranks are all p2p the host polls that flag (no stream synchronisation: with it and
        the fills this dispatch no longer makes, the H200's notify-to-data gap went from 66 to 32
        us, bench/RESULTS.md), else, or when the polls run out, it copies info with a
        synchronisation."""
        mail = self._ht_mail
        if mail is None or mail[1].size < 1 + n:
            if mail is not None:
                mail[0].close()
            mem = self._owned["mail"] = self._ctx.platform.alloc("host", 4 * (1 + n))
            arr = mem.view()[:4 * (1 + n)].view(np.int32)
            mail = self._ht_mail = (mem, arr, memoryview(arr))
        mem, arr, flag = mail
        flag[0] = 0
        P.host_info = mem.ptr
        self._ht_launch(P, 1, block, what + " (notify)")
        try:
            extra = meanwhile() if meanwhile is not None else None
        except BaseException:
            # the notify still runs and will set the mailbox's flag and words: a retried call
            # would clear the flag first and then read this one's counts (or reallocate the
            # mailbox under it), so it ends before the error goes up (GPUs; the HOST arm's
            # launch has ended already)
            if self._gpu:
                torch.cuda.current_stream(self._cuda_index).synchronize()
            raise
        if not self._gpu:
            return arr[1:1 + n].copy(), extra   # the HOST arm's launch has finished
        if self._ll_world_flags() & dep.F_ALL_MAPPED:
            for _ in range(HT_NOTIFY_POLLS):
                if flag[0]:
                    return arr[1:1 + n].copy(), extra
        return to_host(info).numpy(), extra

    def _ht_recv_guess_rows(self, key):
        """How many rows to allocate the receive tensors for before the notify has counted them:
        1/8 more than the last dispatch of this kind (``key`` = (fp8, hidden, topk)) received, or 0
        for the first one (then nothing is allocated early).

        Why: allocating them after the notify put ~18 us of host time (five torch allocations,
        through the pool's MemPool context ~5 us more) between the notify and the data kernel,
        where the GPU waits (docs/EP.md "Where the high-throughput time goes"). A call whose
        rows fit takes views of their first rows (_ht_recv_fit): the views keep the whole
        allocation, up to 1/8 more bytes than the rows need, or twice as many after a call with
        far more rows."""
        seen = self._ht_rows_seen.get(key)
        return seen + -(-seen // 8) if seen else 0

    def _ht_early(self, P, key, cap, nc, block, what, pre):
        """The notify's ``meanwhile`` (host work its GPU time hides): the receive tensors for
        ``cap`` rows (_ht_recv_guess_rows; None when 0) and, with F_HT_PRE in ``P``'s flags, the
        data phase launched into them now, behind the notify (ht.cuh run_ht "The prelaunched data
        phase"): it runs when the notify's go word (recv_info's last word) says the rows fit them,
        so no host time lies between the two kernels; else it ends at once and dispatch launches
        the data phase again. Once it is launched, True goes into the list ``pre`` (the error
        path's epoch then depends on the go word: _ht_skip_op). GPUNET_EP_HT_PRELAUNCH=0 leaves it
        out (the A/B of bench/ep_ht.py)."""
        if not cap:
            return None
        fp8, hidden, k = key
        early = self._ht_recv_tensors(fp8, cap, hidden, k)
        if P.base.flags & dep.F_HT_PRE:
            self._ht_data_params(P, early, cap, P.base.flags, dep.PH_DATA)
            self._ht_launch(P, 2 * nc, block, what + " (data, prelaunched)")
            pre.append(True)
        return early

    def _ht_prelaunch_ok(self):
        """Whether a dispatch may prelaunch its data phase (_ht_early): GPUNET_EP_HT_PRELAUNCH=1
        (the default) and, on a GPU, every other rank p2p (F_ALL_MAPPED), where the host reads
        the counts by polling the notify's mailbox. Elsewhere it copies them with a stream-ordered
        copy, which would wait for the whole prelaunched data phase: the call would return only
        when its rows are in. The CPU's launches finish in the call anyway (every world
        prelaunches there, so the tests cover the protocol over every transport)."""
        return self._ht_prelaunch and (not self._gpu or bool(self._ll_world_flags() & dep.F_ALL_MAPPED))

    def _ht_data_params(self, P, recv, rows, flags, phases, fill=True):
        """Point ``P`` (the notify's params) at receive tensors ``recv`` (_ht_recv_tensors) of
        ``rows`` rows for the launch of the data phase (``phases``; num_worst_tokens: with the
        notify) with ``flags`` (the notify's, F_HT_WORST / F_HT_PRE as the caller wants).
        ``fill=False``: the tensors were filled for a prelaunch that did not run (enable_shrink)."""
        recv_x, recv_s, src, recv_topk, recv_w, direct = recv
        if recv_topk is not None and self.enable_shrink and fill:
            # a masked rank's rows (never written) read as "no expert"; else every row's K slots
            # are written by the kernel (a failed rank raises: no output), with num_worst_tokens
            # those past the received rows too (ht.cuh ht_fill_tail)
            recv_topk.fill_(-1)
            recv_w.zero_()
        P.host_info = 0
        P.base.phases = phases
        P.base.flags = flags | dep.F_HT_BUMP | direct
        P.num_recv_max = rows
        P.out_x, P.out_scales, P.out_src_idx = _addr(recv_x), _addr(recv_s), _addr(src)
        P.out_topk_idx, P.out_weights = _addr(recv_topk), _addr(recv_w)

    @staticmethod
    def _ht_recv_fit(early, rows):
        """``early`` (_ht_early's tensors) narrowed to ``rows`` rows when they fit and use at least half
        of it (no more than twice the bytes held), else None (the caller allocates them now)."""
        if early is None or not early[0].shape[0] // 2 <= rows <= early[0].shape[0]:
            return None
        return tuple(t if t is None else t[:rows] for t in early[:5]) + (early[5],)

    def _ht_recv_tensors(self, fp8, rows, hidden, k):
        """A dispatch's receive tensors ``(recv_x [rows, H] bf16 | fp8, scales float32
        [rows, H/128] | None, src_idx int32 [rows], topk_idx int64 [rows, k] | None, weights float32
        [rows, k] | None, flag)``, uninitialised: from the receive pool when it has room (flag
        F_HT_DIRECT: mapped peers store their rows into them), else from torch (flag 0)."""
        shapes = [((rows, hidden), torch.float8_e4m3fn if fp8 else torch.bfloat16),
                  ((rows, hidden // dep.GROUP), torch.float32) if fp8 else None,
                  ((rows,), torch.int32),
                  ((rows, k), topk_idx_t) if k else None,
                  ((rows, k), torch.float32) if k else None]
        if self._pool is not None:
            got = self._pool.empty_many(shapes)
            if got is not None:
                return tuple(got) + (dep.F_HT_DIRECT,)
            self._pool_full(shapes)
        return tuple(packed_empty(shapes, self._device)) + (0,)

    def _pool_full(self, shapes, what="a dispatch's receive tensors", fallback=(
            "the call used torch memory (high throughput: the rings; low latency: messages, not "
            "the direct dispatch)")):
        """The receive pool had no room (not a graph capture): said once per Buffer, with the
        sizes. On CUDA the pool then stays out of use (RecvPool.exhausted: torch keeps its cached
        blocks in it, and each try synchronised the device)."""
        if self._pool_warned or (self._gpu and torch.cuda.is_current_stream_capturing()):
            return
        self._pool_warned = True
        need = sum(int(np.prod(sd[0])) * sd[1].itemsize for sd in shapes if sd)
        log.warning("gpunet.ep rank %d: the receive pool (recv_pool_bytes=%d, %d in use) had no room for "
                    "%s (%d bytes): %s%s; pass a larger recv_pool_bytes (room for the tensors held "
                    "at once)", self.rank, self.recv_pool_bytes, self._pool.used_bytes(), what, need,
                    fallback,
                    "; the pool is not used again by this Buffer (on CUDA torch keeps its cached blocks "
                    "in it, each later try would synchronise the device)" if self._pool.exhausted else "")

    def _ht_handle(self, handle, what):
        if not isinstance(handle, tuple) or len(handle) != 7 or not isinstance(handle[6], dict):
            raise ConfigError("%s: handle must be the one a high-throughput dispatch returned" % what)
        rank_prefix, chan_prefix, src, in_rank, send_pos, send_cnt, meta = handle
        out = dict(meta)
        out.update(rank_prefix=rank_prefix, chan_prefix=chan_prefix, src=src, in_rank=in_rank,
                   send_pos=send_pos, send_cnt=send_cnt)
        r = self.group_size
        if tuple(chan_prefix.shape) != (r, out["nc"] + 1) or tuple(send_pos.shape) != (out["num_tokens"], r):
            raise ConfigError("%s: the handle is from a Buffer with another rank count" % what)
        return out

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """High-throughput combine: every received row goes back to its source rank, which SUMS
        (no weights) the rows of each of its tokens, in float32, rounded to bf16 once.

        Arguments: ``x`` bf16 [N, H] (N: the rows dispatch returned, in its order); ``handle``
        the dispatch's; ``topk_weights`` float32 [N, K] or None (summed the same way into
        combined_topk_weights); ``bias`` None, a bf16 [T, H] tensor or a tuple of up to two
        (added once per token); ``config`` (default get_combine_config(R); its rings and chunk,
        the channels are the dispatch's); ``previous_event``, ``async_finish`` as dispatch's.

        Returns ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None, event)``:
        combined_x[t] = bias0[t] + bias1[t] + sum over the ranks d the token went to (ascending)
        of x_d[row of t on d]; rows of masked ranks are left out.

        When ``x`` (and ``topk_weights``, if given) lie in this rank's receive pool
        (``recv_pool_bytes``; e.g. dispatch's recv_x and recv_topk_weights themselves), peers that
        can load from this rank's heap (p2p, not the c500 profile) read the rows in place instead
        of being sent them (docs/EP.md "the in-place combine"); the result is the same, bit for
        bit. ``GPUNET_EP_HT_PULL=0`` turns that off. When, besides, every row this rank sends and
        receives in a channel goes in place, the channel's sender block reduces half its tokens
        (ht.cuh "the split in-place combine"; ``GPUNET_EP_HT_SPLIT=0`` turns that off)."""
        self._alive()
        what = "combine"
        r = self.group_size
        h = self._ht_handle(handle, what)
        rows, hidden, num_tokens, k = h["rows"], h["hidden"], h["num_tokens"], h["topk"]
        x = self._tensor(x, "x", torch.bfloat16, shape=(rows, hidden))
        flags = 0
        if topk_weights is not None:
            if not k:
                raise ConfigError("combine: topk_weights given, but the dispatch had no top-k")
            topk_weights = self._tensor(topk_weights, "topk_weights", torch.float32, shape=(rows, k))
            flags |= dep.F_HT_WEIGHTS
        if bias is None:
            biases = ()
        elif isinstance(bias, torch.Tensor):
            biases = (bias,)
        elif isinstance(bias, (tuple, list)) and len(bias) <= 2:
            biases = tuple(b for b in bias if b is not None)
        else:
            raise ConfigError("combine: bias is None, a tensor or a tuple of up to two tensors")
        biases = tuple(self._tensor(b, "bias", torch.bfloat16, shape=(num_tokens, hidden)) for b in biases)
        config = config if config is not None else self.get_combine_config(r)
        if not isinstance(config, Config):
            raise ConfigError("combine: config must be a gpunet.ep.Config, not %r" % (config,))
        _, ring, chunk, block = self._ht_geometry(config)
        nc = h["nc"]
        layout = self._ht_region(hidden, nc, ring, what)
        self._wait_previous(previous_event)
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self._device)
        out_w = torch.empty((num_tokens, k), dtype=torch.float32, device=self._device) \
            if topk_weights is not None else None
        P = self._ht_params(dep.OP_HT_COMBINE, dep.PH_DATA, flags | dep.F_HT_BUMP, layout, hidden,
                            num_tokens, k, nc, ring, chunk)
        P.x, P.topk_weights = _addr(x), _addr(topk_weights)
        P.out_x, P.out_weights = _addr(out), _addr(out_w)
        P.send_pos, P.send_cnt, P.chan_prefix = _addr(h["send_pos"]), _addr(h["send_cnt"]), _addr(h["chan_prefix"])
        P.nbias = len(biases)
        P.bias0 = _addr(biases[0]) if biases else 0
        P.bias1 = _addr(biases[1]) if len(biases) > 1 else 0
        P.num_recv_max = rows
        if self._ht_pull and self._pool is not None and all(
                t is None or self._pool.contains(t) for t in (x, topk_weights)):
            P.base.flags |= dep.F_HT_PULL   # peers that can load from this heap read x in place
            if self._ht_split:              # and idle senders reduce half their channel's tokens
                P.base.flags |= dep.F_HT_SPLIT
        self._ht_launch(P, 2 * nc, block, what)
        self._check(what, "combine", mirrored=True)
        keep = (x, topk_weights, out, out_w) + biases + tuple(handle[:6])
        return out, out_w, self._event(async_finish, keep)

    def empty_combine_x(self, handle):
        """A fresh, uninitialised bf16 tensor [N, H] for ``combine``'s ``x`` (N: the rows the
        high-throughput dispatch of ``handle`` returned, H its hidden size), in this rank's receive
        pool when it has room, else in ordinary memory (said once, as for a dispatch's tensors).

        gpunet extension (DeepEP has none; its low-latency ``get_next_low_latency_combine_buffer``
        is the same idea): write the experts' outputs into it (row i the output for the dispatch's
        ``recv_x[i]``, e.g. ``torch.matmul(..., out=y)`` or ``y.copy_(...)``) and pass it to
        ``combine``: peers that can load from this rank's heap then read its rows in place instead
        of being sent them (docs/EP.md "the in-place combine"), as for a combine of recv_x itself.
        The caller owns it as one from ``torch.empty``; its bytes go back to the pool when it dies.
        Not in the pool (ordinary memory) without ``recv_pool_bytes`` or during a CUDA graph
        capture; the combine then takes the rings, with the same result."""
        self._alive()
        h = self._ht_handle(handle, "empty_combine_x")
        shapes = [((h["rows"], h["hidden"]), torch.bfloat16)]
        if self._pool is not None:
            got = self._pool.empty_many(shapes)
            if got is not None:
                return got[0]
            self._pool_full(shapes, "combine's x (empty_combine_x)",
                            "it is in torch memory, and combine sends its rows through the rings")
        return torch.empty(shapes[0][0], dtype=torch.bfloat16, device=self._device)

    def internode_dispatch(self, *args, **kwargs):
        raise NotImplementedError("internode_dispatch: gpunet's high-throughput mode is one flat "
                                  "group of ranks; call dispatch()")

    def internode_combine(self, *args, **kwargs):
        raise NotImplementedError("internode_combine: gpunet's high-throughput mode is one flat "
                                  "group of ranks; call combine()")

    def intranode_dispatch(self, *args, **kwargs):
        raise NotImplementedError("intranode_dispatch: call dispatch() (DeepEP's public method)")

    def intranode_combine(self, *args, **kwargs):
        raise NotImplementedError("intranode_combine: call combine() (DeepEP's public method)")

    # ---- timeout, masks, stats ----------------------------------------------------------------
    @property
    def timeout_s(self):
        """The bound (seconds) of every wait on a peer; settable at run time (``set_timeout``)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds):
        self.set_timeout(seconds)

    def set_timeout(self, seconds):
        """Set the bound of every device wait on a peer from the next call on (DeepEP fixes 100 s
        at build time). A peer silent for this long is masked (enable_shrink) or named in an
        EPTimeout."""
        self._alive()
        _check_timeout(seconds)
        self._timeout_s = float(seconds)
        self._write_ctxs()

    def _write_ctxs(self):
        """The per-peer device contexts: the Context's DevCtx, each with its own Status block and
        this Buffer's timeout (a failure on one peer never makes operations to others fail fast)."""
        r = self.group_size
        base = self._ctx.device_context_image()
        arr = (abi.DevCtx * r)()
        for p in range(r):
            ctypes.memmove(ctypes.addressof(arr[p]), ctypes.addressof(base), ctypes.sizeof(abi.DevCtx))
            arr[p].status = self._peer_status.data_ptr() + 128 * p
            arr[p].timeout_ns = int(self._timeout_s * 1e9)
        raw = torch.frombuffer(bytearray(bytes(arr)), dtype=torch.uint8)
        if self._ctxs_buf is None:
            self._ctxs_buf = torch.zeros(raw.numel() + 128, dtype=torch.uint8, device=self._device)
        # 128-byte aligned inside the buffer (DevCtx is read as 16-byte words on GPUs)
        off = (-self._ctxs_buf.data_ptr()) % 128
        self._ctxs_buf[off:off + raw.numel()].copy_(raw)
        self._ctxs_addr = self._ctxs_buf.data_ptr() + off

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Mask (``mask=True``) or unmask a rank: a masked rank is neither sent to nor waited for
        in dispatch, combine and clean, and counts 0. Local to this rank. Unmasking also forgets
        its failure; call ``clean_low_latency_buffer`` on every live rank (the unmasked one
        included) before the next LL call. Needs ``enable_shrink=True``."""
        self._alive()
        self._need_shrink("low_latency_update_mask_buffer")
        r = self._rank_arg(rank_to_mask, "rank_to_mask")
        self._mask_t[r] = 1 if mask else 0
        if not mask:
            self._forget_failure(r)

    def low_latency_query_mask_buffer(self, mask_status):
        """Write the mask into ``mask_status`` ([num_ranks] int32 tensor; 1 = masked)."""
        self._alive()
        self._need_shrink("low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32 or \
                tuple(mask_status.shape) != (self.group_size,):
            raise ConfigError("low_latency_query_mask_buffer: mask_status must be an int32 tensor of "
                              "shape [%d]" % self.group_size)
        mask_status.copy_(self._mask_t)

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank and forget their failures; with ``low_latency_mode``, then bring the
        LL state back in step on every rank, as ``clean_low_latency_buffer`` does (its barrier,
        signal counts re-read, the LL buffer in use reset to the first).

        Collective in low-latency mode: EVERY rank calls it (vLLM's ``clean_buffers`` does, on
        each rank, after zeroing the RDMA buffer; vllm#43637). DeepEP's only zeroes the local mask
        words, because its signal counters live in the RDMA buffer that vLLM zeroes on every rank.
        gpunet keeps them outside it: after a fault, a rank that masked a peer has not counted the
        signals that peer sent it meanwhile, so unmasking alone would let the next wait take an
        old signal for a new one and read stale (or zeroed) headers. A rank that does not call it
        within ``timeout_s`` is masked again (bounded, never a hang). Without ``low_latency_mode``
        it only unmasks, locally."""
        self._alive()
        what = "low_latency_clean_mask_buffer"
        self._need_shrink(what)
        self._mask_t.zero_()
        for r in range(self.group_size):
            self._forget_failure(r)
        if self.low_latency_mode and self._ll is not None:
            # the clean reads no LL buffer area (ll.cuh clean: signal words, counts, sync words),
            # so any shape's layout serves; a cached one when there is one
            self._resync(what, lambda: next(iter(self._layouts.values()), None) or
                         lay.LlLayout(1, dep.GROUP, self.group_size, self.group_size))

    def _forget_failure(self, r):
        self._failed_t[r] = 0
        self._hflags_np[1 + r] = 0
        self._peer_status[128 * r:128 * (r + 1)].zero_()
        self._warned_masked.discard(r)

    def _need_shrink(self, what):
        if not self.enable_shrink:
            raise ConfigError("%s needs a Buffer made with enable_shrink=True (the mask buffer)" % what)

    def _rank_arg(self, r, what):
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.group_size:
            raise ConfigError("%s must be a rank in [0, %d), not %r" % (what, self.group_size, r))
        return r

    def _ctl_refresh(self):
        """Device-memory heap: copy the control allocation into the host mirror the numpy views
        read (stream-ordered, after the launches queued so far; not while a CUDA graph is being
        captured, where no copy may run). A host-mapped heap needs nothing."""
        if self._ctl_mirror and not torch.cuda.is_current_stream_capturing():
            self._ctl_np[:] = to_host(self._ctl).numpy()

    def masked_ranks(self):
        """(gpunet) The ranks masked now, as a sorted list."""
        self._alive()                   # after destroy() the mask words are freed memory
        self._ctl_refresh()
        return [p for p in range(self.group_size) if self._mask_np[p]]

    def report(self):
        """(gpunet) The cumulative per-peer wait costs this Buffer measured (diagnostics=True, on
        calls that passed no stats tensor of their own): {"dispatch": [R] ns waited for each
        source, "combine": [R], "slowest": {phase: (rank, ns)}, "masked": [...]}."""
        self._alive()
        out = {"masked": self.masked_ranks(), "slowest": {}}
        for phase, m in self._stats.items():
            row = to_host(m[self.rank]).tolist()
            out[phase] = row
            if any(row):
                j = max(range(len(row)), key=lambda i: row[i])
                out["slowest"][phase] = (j, row[j])
        return out

    # ---- workspace ------------------------------------------------------------------------------
    def _workspace(self, t_max, num_experts):
        key = (t_max, num_experts)
        ws = self._shape_ws.get(key)
        if ws is not None:
            return ws
        r, dev = self.group_size, self._device
        e_loc = num_experts // r
        ws = {
            # the dispatch send's bitmaps, zero between launches (ll.cuh expert_bits): per
            # expert its tokens, then per destination its message slots; then the direct
            # dispatch's scratch (ll.cuh dpre, dbeg, dout: written before read each launch)
            "bits": torch.zeros(dep.bits_words(t_max, r, num_experts), dtype=torch.int32, device=dev),
            "tab": torch.zeros(2 * r * e_loc + r, dtype=torch.int32, device=dev),
            "table": torch.full((t_max * dep.MAX_TOPK,), -1, dtype=torch.int64, device=dev),
        }
        self._shape_ws[key] = ws
        return ws

    def _reset_workspace(self):
        """After a launch that failed half way: grid words, send counters and slot tables back to
        their between-launch values (stream-ordered on GPUs)."""
        self._sync.zero_()
        self._ht_sync.zero_()
        for ws in self._shape_ws.values():
            ws["bits"].zero_()
            ws["table"].fill_(-1)
        self._ep_status.zero_()
        self._status_flag_t.zero_()
        self._hflags_np[0] = 0

    # ---- launches ---------------------------------------------------------------------------------
    def _layout(self, t_max, hidden, num_experts, what):
        if not self.low_latency_mode:
            raise ConfigError("%s needs a Buffer made with low_latency_mode=True" % what)
        key = (t_max, hidden, num_experts)
        layout = self._layouts.get(key)
        if layout is not None:      # checked when it was made (the host's time per call counts)
            return layout
        layout = lay.LlLayout(t_max, hidden, self.group_size, num_experts)
        if layout.total > self.num_rdma_bytes:
            raise ConfigError(
                "%s: num_rdma_bytes=%d is too small for num_max_dispatch_tokens_per_rank=%d, hidden=%d, "
                "%d ranks, %d experts: it needs %d bytes (Buffer.get_low_latency_rdma_size_hint)"
                % (what, self.num_rdma_bytes, t_max, hidden, self.group_size, num_experts, layout.total))
        self._layouts[key] = layout
        return layout

    def _params(self, op, phases, flags, buf, layout, num_tokens, topk):
        """A fresh LlParams for one launch, copied from a template per call shape: everything but
        the caller's tensors is fixed per (op, phases, flags, buffer, shape, timeout) (the
        Buffer's allocations never move), and building it field by field cost more host time
        than the kernel (bench/ep_profile.py). The caller sets the tensor addresses."""
        P = self._template(("ll", op, phases, flags, buf, layout.t_max, layout.hidden, layout.num_experts,
                            num_tokens, topk, self._timeout_s),
                           lambda: self._build_params(op, phases, flags, buf, layout, num_tokens, topk))
        P.prof = self._prof_addr
        return P

    def _template(self, key, build):
        """A fresh copy of the launch parameters (an LlParams or HtParams) cached under ``key``,
        made by ``build()`` the first time: everything but the caller's tensors is fixed per call
        shape (the Buffer's allocations never move), and building one field by field cost more
        host time than the kernel (bench/ep_profile.py)."""
        tmpl = self._param_cache.get(key)
        if tmpl is None:
            if len(self._param_cache) >= 256:
                self._param_cache.clear()
            tmpl = self._param_cache[key] = build()
        return type(tmpl).from_buffer_copy(tmpl)

    def _build_params(self, op, phases, flags, buf, layout, num_tokens, topk):
        r = self.group_size
        P = dep.LlParams()
        P.op, P.phases, P.flags, P.buf = op, phases, flags, buf
        P.rank, P.nranks, P.num_experts, P.e_loc = self.rank, r, layout.num_experts, layout.e_loc
        P.hidden, P.topk, P.num_tokens, P.t_max = layout.hidden, topk, num_tokens, layout.t_max
        P.msg_stride, P.payload_bytes = lay.msg_stride(layout.hidden, bool(flags & dep.F_FP8))
        P.hdr_stride, P.c_rows = layout.hdr_stride, layout.c_rows
        P.ctxs = self._ctxs_addr
        # grid-internal waits outlast block 0's waits on a peer (up to 3 T with heartbeats)
        P.timeout_ns = int((4 * self._timeout_s + 1.0) * 1e9)
        P.sig = self._ctl_base + self._ctl_off["sig"]
        base = int(self._ll.data_ptr())
        for k, off in layout.buffers[buf].items():
            setattr(P, k, base + off)
        P.mask = self._ctl_base + self._ctl_off["mask"]
        P.failed = self._ctl_base + self._ctl_off["failed"]
        P.got = self._ctl_base + self._ctl_off["got"]
        P.nrecv = self._ctl_base + self._ctl_off["nrecv"]
        P.status_flag = self._ctl_base + self._ctl_off["status_flag"]
        P.status = _addr(self._ep_status)
        P.expected, P.sync = _addr(self._expected), _addr(self._sync)
        ws = self._workspace(layout.t_max, layout.num_experts)
        P.bits = _addr(ws["bits"])
        P.tab, P.table = _addr(ws["tab"]), _addr(ws["table"])
        P.host_flags = self._hflags_mem.ptr
        if self.enable_shrink:
            P.flags |= dep.F_SHRINK
        P.flags |= self._ll_world_flags()
        return P

    def _kernel_kinds(self):
        """The transports the LL and HT kernels are built with: a world whose peers are all p2p (this
        rank too) gets the p2p-only build (gpunet/device/ep.py load_ep: half the code, so fewer
        instruction fetches in a launch whose code is cold; bench/RESULTS.md), any other world
        the build with every transport. GPUNET_EP_KERNEL_BUILD=all gives every world the latter."""
        if config.get("GPUNET_EP_KERNEL_BUILD") == "all":
            return None
        peers = self._ctx._dev.peers
        kinds = {int(peers[p].kind) for p in range(self._ctx.world_size)}
        return kinds if kinds == {abi.TRANSPORT_P2P} else None

    def _ll_direct_ok(self):
        """Whether the LL dispatch runs direct (ll.cuh F_DIRECT): a receive pool
        (recv_pool_bytes, the same on every rank), every other rank a p2p peer (F_ALL_MAPPED), and
        no link between them to spare: every rank's heap on this GPU (F_GPU_SCOPE), or the CPU
        platform (the ranks' arenas in one memory). A direct row goes once per (token, expert),
        where a message goes once per (token, rank): across GPUs the link would carry ~K / (ranks
        a token reaches) times the bytes, so those worlds keep messages. Off unless
        GPUNET_EP_LL_DIRECT=1: as first built it was slower than the messages on the H100
        (bench/RESULTS.md, thirty-second session)."""
        ok = getattr(self, "_direct_ok", None)
        if ok is None:
            flags = self._ll_world_flags()
            ok = self._direct_ok = bool(
                self._pool is not None and flags & dep.F_ALL_MAPPED
                and (flags & dep.F_GPU_SCOPE or not self._gpu)
                and config.get("GPUNET_EP_LL_DIRECT") == "1")
        return ok

    def _ll_world_flags(self):
        """LlParams flags that follow from the peers' transports (fixed for the Context's life):
        F_ALL_MAPPED when every other rank is a p2p peer (its heap mapped here: BF16 rows go
        unstaged), and F_GPU_SCOPE when, besides, every rank (this one too) is p2p with its heap
        on this GPU (P2P_SAME_DEVICE): the kernels' grid-internal hand-offs and header signals
        then fence at device scope (ll.cuh grid_fence). A NIC peer anywhere clears both."""
        flags = getattr(self, "_world_flags", None)
        if flags is not None:
            return flags
        peers = self._ctx._dev.peers
        kinds = [(int(peers[p].kind), int(peers[p].rkey)) for p in range(self.group_size)]
        others = [k for p, k in enumerate(kinds) if p != self.rank]
        flags = 0
        if all(kind == abi.TRANSPORT_P2P for kind, _ in others):
            flags |= dep.F_ALL_MAPPED
            if all(kind == abi.TRANSPORT_P2P and rkey & abi.P2P_SAME_DEVICE for kind, rkey in kinds):
                flags |= dep.F_GPU_SCOPE
        self._world_flags = flags
        return flags

    def _set_profile(self, stamps):
        """(bench/ep_profile.py, bench/ep_ht.py) Record phase stamps of every later LL / HT launch
        into ``stamps``, an int64 tensor of at least [num_blocks, gpunet/device/ep.py STAMPS] on this
        Buffer's device (each launch overwrites the rows of its blocks; an HT launch of more
        blocks than the tensor holds is refused), or stop with None."""
        if stamps is None:
            self._prof_addr = 0
            return
        if (not isinstance(stamps, torch.Tensor) or stamps.dtype != torch.int64 or
                stamps.device.type != self._device.type or not stamps.is_contiguous() or
                stamps.numel() < self._grid * dep.STAMPS):
            raise ConfigError("_set_profile: stamps must be a contiguous int64 tensor of >= %d "
                              "elements on %s" % (self._grid * dep.STAMPS, self._device))
        self._prof_ref = stamps
        self._prof_addr = int(stamps.data_ptr())

    def _stream(self):
        """The current CUDA stream of this Buffer's device, as the raw handle: torch's private
        _cuda_getCurrentRawStream where it exists (~1 us; torch.cuda.current_stream() took 30-44 us
        of each call's host time on the H200, bench/RESULTS.md), else the public call."""
        raw = self._raw_stream
        if raw is not None:
            return raw(self._cuda_index)
        return torch.cuda.current_stream(self._cuda_index).cuda_stream

    def _launch(self, P, what, grid=None):
        stream = self._stream() if self._gpu else None
        rc = self._lib.gpunet_ep_ll_launch(ctypes.addressof(P), grid or self._grid, self._block,
                                           self._ws, stream, 0)
        if rc != 0:
            raise GpunetError("%s: EP kernel launch failed (error %d)" % (what, rc))

    def _check(self, what, phase, mirrored=False):
        """Raise what the kernels recorded: an EP-level failure (then the workspace is reset), or,
        without enable_shrink, the peers that failed (EPTimeout). CPU: the launch just finished;
        CUDA: whatever launches have completed so far (host-mapped state, no device sync).
        ``mirrored``: the kernels store their failure words in ``_hflags_np`` too (the LL
        kernels: LlParams::host_flags), so a device-memory heap is not copied (no device sync);
        otherwise a device-memory heap is read through a stream-ordered copy of it."""
        hf = self._hflags_np
        heap = not (mirrored and self._ctl_mirror)  # the heap's words are current on the host
        if heap:
            self._ctl_refresh()
        # the common case, nothing recorded, through memoryviews of the same words (a numpy
        # element read costs ~10x a memoryview's; this runs after every call)
        if not any(self._hflags_mv) and not (heap and (self._status_flag_mv[0] or any(self._failed_mv))):
            return
        if hf[0] or (heap and self._status_flag[0]):
            # the failure path may wait: the failed launch and what follows it finish, the
            # workspace is reset, and the reset is done before the next call reads the flag
            if self._gpu:
                torch.cuda.current_stream().synchronize()
            err = self._ep_error(what)
            self._reset_workspace()
            if self._gpu:
                torch.cuda.current_stream().synchronize()
            raise err
        failed = [p for p in range(self.group_size) if hf[1 + p] or (heap and self._failed_np[p])]
        if not failed:
            return
        if self.enable_shrink:
            new = [p for p in failed if p not in self._warned_masked]
            if new:
                log.warning("gpunet.ep rank %d: %s masked rank(s) %s: %s", self.rank, what, new,
                            "; ".join(self._peer_detail(p) for p in new))
                self._warned_masked.update(new)
            return
        if not heap:
            self._ctl_refresh()     # the counts seen (the failure path may copy the heap)
        seen = {p: (int(self._nrecv_np[p]) if self._got_np[p] else None) for p in range(self.group_size)}
        raise with_hint(EPTimeout(
            "%s on rank %d: peer(s) %s did not answer or failed within %.3g s (%s); pass "
            "enable_shrink=True to mask them and go on" % (
                what, self.rank, failed, self._timeout_s,
                "; ".join(self._peer_detail(p) for p in failed)),
            phase=phase, peers_silent=failed, counts_seen=seen), self._ctx.nic.timeout_hint())

    def _peer_detail(self, p):
        raw = to_host(self._peer_status[128 * p:128 * (p + 1)]).numpy().tobytes()
        err = abi.status_error(abi.Status.from_buffer_copy(raw), "rank %d" % p)
        # No verb recorded an error for p: the EP kernel's own bounded waits marked it (ht.cuh: no
        # credit or tail progress from it for the indirect timeout; ll.cuh: no header / message)
        return str(err) if err is not None else (
            "rank %d: silent (the EP kernel saw no header, message or credit from it within the "
            "timeout; no put or wait to it recorded an error)" % p)

    def _ep_error(self, what):
        st = dep.EpStatus.from_buffer_copy(to_host(self._ep_status).numpy().tobytes())
        code = int(st.code)
        text = "%s on rank %d: %s, at %s (peer %d, block %d; expected %d, observed %d, %.3f s)" % (
            what, self.rank, dep.EP_ERR_NAMES.get(code, "EP failure %d" % code),
            dep.EP_SITE_NAMES.get(int(st.site), "site %d" % st.site), st.peer, st.block,
            st.expected, st.observed, st.waited_ns / 1e9)
        if code == dep.EP_ERR_GRID_WAIT:
            return with_hint(GpunetTimeoutError(text), self._ctx.nic.timeout_hint())
        if code in (dep.EP_ERR_MISMATCH, dep.EP_ERR_LAYOUT):
            return ConfigError(text)
        err = GpunetError(text)
        if code == dep.EP_ERR_OUT_OF_STEP:
            err.ht_peer_op = int(st.observed)   # the peer's HT op count (_ht_skip_op catches up)
        return err

    def _tensor(self, t, name, dtype, shape=None, ndim=None):
        # (per call, several times: the cheap tensor properties only; t.device builds an object
        # and tuple(t.shape) a tuple, which cost ~40% of combine's host time, bench/ep_host.py)
        if not isinstance(t, torch.Tensor):
            raise ConfigError("%s must be a torch.Tensor, not %s" % (name, type(t).__name__))
        if t.dtype != dtype:
            raise ConfigError("%s must be %s, not %s" % (name, dtype, t.dtype))
        # GPU: one get_device() (-1 for a CPU tensor) says both whether t is a CUDA tensor and
        # whether it is on this Buffer's GPU; another GPU's memory would fault the kernels, or be
        # read by peer loads over the link where the GPUs have peer access
        dev = t.get_device() if self._gpu else -1
        if not (dev >= 0 if self._gpu else t.is_cpu):
            raise ConfigError("%s is on %s; this Buffer's tensors are on %s" % (name, t.device, self._device))
        if self._gpu and dev != self._cuda_index:
            raise ConfigError("%s is on cuda:%d; this Buffer's kernels run on cuda:%d (the device "
                              "current when it was made)" % (name, dev, self._cuda_index))
        if ndim is not None and t.dim() != ndim:
            raise ConfigError("%s must have %d dimensions, has shape %s" % (name, ndim, tuple(t.shape)))
        if shape is not None and t.shape != shape:
            raise ConfigError("%s must have shape %s, not %s" % (name, tuple(shape), tuple(t.shape)))
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = t.contiguous().clone() if t.data_ptr() % 16 else t.contiguous()
        return t

    def _stats_arg(self, t, name, what):
        r = self.group_size
        if t is None:
            if self.diagnostics:
                return self._stats[what], dep.F_WAIT_STATS_2D
            return None, 0
        t2 = self._tensor(t, name, torch.int64)
        if tuple(t.shape) == (r,):
            flag = 0
        elif tuple(t.shape) == (r, r):
            flag = dep.F_WAIT_STATS_2D
        else:
            raise ConfigError("%s must be int64 [%d] or [%d, %d] (ns waited per source; [R, R]: this "
                              "rank's row), not %s" % (name, r, r, r, tuple(t.shape)))
        if t2.data_ptr() != t.data_ptr():
            raise ConfigError("%s must be contiguous (the kernel adds into it in place)" % name)
        return t, flag

    # ---- low-latency mode ---------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Collective over the live (unmasked) ranks: after it, every rank's signal counts equal
        what has arrived, the kernels' scratch is reset and every rank's next LL call uses the
        first LL buffer, so the next LL call starts clean — after the RDMA buffer was used as
        scratch, after a failed call, after unmasking a rank, or after the LL order rule refused
        a send (_ll_area_check). Every live rank must call it.
        Bounded: a silent rank is masked or raises."""
        self._alive()
        self._resync("clean_low_latency_buffer",
                     lambda: self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                          "clean_low_latency_buffer"))

    def _resync(self, what, layout_of):
        """The LL clean (ll.cuh OP_CLEAN), collective over the live ranks: a barrier, every signal
        count this rank expects set to what has arrived, a barrier; the kernels' scratch reset;
        and the next LL call on the first of the two LL buffers, on every rank alike (a rank that
        made one LL call more than the others, e.g. one alone while it had them masked, would
        otherwise wait for signals on the other buffer than its peers use). ``layout_of()``
        gives the LlLayout (inside the clean: a rank that rejects its arguments skips it too)."""
        try:
            layout = layout_of()
            self._reset_workspace()
            P = self._params(dep.OP_CLEAN, 0, 0, 0, layout, 0, 1)
            self._launch(P, what, grid=1)
        except BaseException:
            self._skip_clean()
            raise
        self._ll_idx = 0
        # the clean's barriers come after every rank's earlier LL calls (stream order): no rank
        # reads an area of them any more (a hook from before the clean records nothing)
        self._ll_areas = [None] * 4
        self._check(what, "clean", mirrored=True)

    def _skip_clean(self):
        """This rank's clean ends before its launch (the host raised: an allocation, an argument
        only this rank rejected, a launch that failed). Cleans are collective and the kernel counts
        them (ll.cuh clean_epoch: the barrier values 2e - 1 and 2e of the e-th): the other ranks
        finish theirs without this rank (they mask it, or raise), so its count moves on too, on
        the stream. Left one behind, every later clean's first barrier passed at once on an old
        value, and the others masked it again in each one: vLLM's recovery
        (low_latency_clean_mask_buffer on every rank) never brought it back."""
        self._expected[8 * self.group_size + 8].add_(1)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False,
                             topk_weights=None, x_global_scale=None, use_nvfp4=False,
                             use_ue8m0_for_sf=False):
        """Send each token to the ranks of its top-k experts (once per rank) and receive this
        rank's experts' tokens in DeepEP's packed layout.

        Arguments: ``x`` bf16 [T, H] (T <= num_max_dispatch_tokens_per_rank, H any multiple of
        128); ``topk_idx`` int64 [T, K] (K <= 16, -1 = no expert); ``num_max_dispatch_tokens_per_rank``
        (the same on every rank; any size); ``num_experts`` (a multiple of the rank count);
        ``cumulative_local_expert_recv_stats`` int32 [E_loc] (+= the counts received);
        ``dispatch_wait_recv_cost_stats`` int64 [R] or [R, R] (+= ns waited for each source; [R, R]:
        this rank's row); ``use_fp8`` (e4m3 + float scale per 128 columns: amax/448), ``round_scale``
        (scales rounded up to powers of two), ``use_ue8m0`` (scales packed as UE8M0, implies
        rounding); ``async_finish`` (return an event); ``return_recv_hook`` (this call only sends;
        ``hook()`` receives; a send reuses the area of the LL call two calls before it, so it is
        refused, ConfigError, until that call was received and one LL call sent after that was
        received too: hooks right after their sends, or DeepEP's two-batch overlap).
        ``topk_weights``, ``x_global_scale``, ``use_ue8m0_for_sf`` (other DeepEP branches'
        arguments) are accepted and unused; ``use_nvfp4`` is not implemented.

        Returns ``(recv_x, recv_count, handle, event, hook)``: recv_x bf16 [E_loc, R*T_max, H], or
        with use_fp8 ``(fp8 [E_loc, R*T_max, H], scales)`` with scales float32
        [E_loc, R*T_max, H/128] or (use_ue8m0) int32 [E_loc, R*T_max, ceil(H/512)], both
        column-major in the last two dims (``.transpose(1, 2)`` of a contiguous [E_loc, G, R*T_max]);
        recv_count int32 [E_loc] (only the first recv_count[e] rows of expert e are valid);
        handle ``(src_info int32 [E_loc, R*T_max], layout_range int64 [E_loc, R] = begin << 32 | count,
        T_max, H, num_experts)``; event an EventOverlap; hook: with return_recv_hook a callable
        that receives (call it once), else None (as DeepEP's). Rows of expert e from source rank j
        sit at [begin_j, begin_j + count_j) in increasing token order (deterministic).
        """
        self._alive()
        what = "low_latency_dispatch"
        if use_nvfp4:
            raise NotImplementedError("low_latency_dispatch(use_nvfp4=True): NVFP4 is not implemented "
                                      "in gpunet's low-latency mode; use use_fp8 (e4m3) or bf16")
        t_max, e = num_max_dispatch_tokens_per_rank, num_experts
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ConfigError("%s: x must be a bf16 tensor [num_tokens, hidden]" % what)
        x = self._tensor(x, "x", torch.bfloat16, ndim=2)
        num_tokens, hidden = x.shape
        layout = self._layout(t_max, hidden, e, what)
        topk_idx = self._tensor(topk_idx, "topk_idx", topk_idx_t, ndim=2)
        k = topk_idx.shape[1]
        if topk_idx.shape[0] != num_tokens:
            raise ConfigError("%s: x has %d tokens, topk_idx %d" % (what, num_tokens, topk_idx.shape[0]))
        if not 1 <= k <= dep.MAX_TOPK:
            raise ConfigError("%s: top-k %d outside [1, %d]" % (what, k, dep.MAX_TOPK))
        if num_tokens > t_max:
            raise ConfigError("%s: %d tokens > num_max_dispatch_tokens_per_rank %d"
                              % (what, num_tokens, t_max))
        el, r = layout.e_loc, self.group_size
        if cumulative_local_expert_recv_stats is not None:
            c = self._tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats",
                             torch.int32, shape=(el,))
            if c.data_ptr() != cumulative_local_expert_recv_stats.data_ptr():
                raise ConfigError("cumulative_local_expert_recv_stats must be contiguous (updated in place)")
        stats, sflag = self._stats_arg(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats",
                                       "dispatch")
        flags = sflag
        if use_fp8:
            flags |= dep.F_FP8
            if round_scale:
                flags |= dep.F_ROUND_SCALE
            if use_ue8m0:
                flags |= dep.F_UE8M0
        rows = r * t_max
        dev = self._device
        recv_x = src_info = scales = None
        g = hidden // dep.GROUP
        g = -(-g // 4) if use_ue8m0 else g      # scale words per row (UE8M0: 4 exponents a word)
        sc_dtype = torch.int32 if use_ue8m0 else torch.float32
        if self._ll_direct_ok():
            # the direct dispatch (ll.cuh "The direct dispatch"): every peer mapped on this GPU and
            # a receive pool, the same on every rank, so every rank runs the count round; the
            # receive tensors from the pool (F_DIRECT_RECV: the sources store the rows in place)
            # when it has room and no graph is being captured, else ordinary ones and messages
            flags |= dep.F_DIRECT
            shapes = [((el, rows, hidden), torch.float8_e4m3fn if use_fp8 else torch.bfloat16),
                      ((el, rows), torch.int32), ((el, g, rows), sc_dtype) if use_fp8 else None]
            got = self._pool.empty_many(shapes)
            if got is not None:
                recv_x, src_info, scales = got
                if scales is not None:
                    scales = scales.transpose(1, 2)     # [E_loc, R*T_max, G], column-major
                flags |= dep.F_DIRECT_RECV
            else:
                self._pool_full(shapes)
        if recv_x is None and use_fp8:
            recv_x = torch.empty((el, rows, hidden), dtype=torch.float8_e4m3fn, device=dev)
            # the scales as returned: [E_loc, R*T_max, G] column-major in the last two dims (the
            # kernel writes [E_loc, G, R*T_max] contiguous), made so at once (no transpose per call)
            scales = torch.empty_strided((el, rows, g), (g * rows, 1, rows), dtype=sc_dtype, device=dev)
        elif recv_x is None:
            recv_x = torch.empty((el, rows, hidden), dtype=torch.bfloat16, device=dev)
        count = torch.empty(el, dtype=torch.int32, device=dev)
        if src_info is None:
            src_info = torch.empty((el, rows), dtype=torch.int32, device=dev)
        layout_range = torch.empty((el, r), dtype=torch.int64, device=dev)
        buf = self._ll_idx
        self._ll_area_check(what, buf)
        self._ll_idx ^= 1
        P = self._params(dep.OP_DISPATCH, 0, flags, buf, layout, num_tokens, k)
        P.x, P.topk_idx = _addr(x), _addr(topk_idx)
        P.out_x, P.out_scales, P.out_count = _addr(recv_x), _addr(scales), _addr(count)
        P.src_info, P.layout_range = _addr(src_info), _addr(layout_range)
        P.cum_stats = _addr(cumulative_local_expert_recv_stats)
        P.wait_stats = _addr(stats)
        keep = (x, topk_idx, recv_x, scales, count, src_info, layout_range,
                cumulative_local_expert_recv_stats, stats)
        hook = self._run_phases(P, what, "dispatch", return_recv_hook, keep, buf)
        handle = (src_info, layout_range, t_max, hidden, e)
        out_x = (recv_x, scales) if use_fp8 else recv_x
        event = EventOverlap(EventHandle(), keep if async_finish else None) if async_finish \
            else EventOverlap(None)
        return out_x, count, handle, event, hook

    def _run_phases(self, P, what, phase, return_recv_hook, keep, area):
        """Send now; receive now too (returns None, as DeepEP's hook without return_recv_hook),
        or in the returned hook (return_recv_hook). ``area``: the LL area the send writes into
        on the peers (_ll_area_check); a send whose launch raised never used it, a receive that
        raised (or a send that raised after its launch: no hook to receive with) ended its op."""
        if not return_recv_hook:
            P.phases = dep.PH_SEND | dep.PH_RECV
            self._launch(P, what)
            self._ll_received(area, self._ll_area_use(what, area))
            self._check(what, phase, mirrored=True)
            return None
        P.phases = dep.PH_SEND
        self._launch(P, what + " (send)")
        rec = self._ll_area_use(what, area)
        try:
            self._check(what, phase, mirrored=True)
        except BaseException:
            self._ll_received(area, rec)
            raise
        R = dep.LlParams()
        ctypes.memmove(ctypes.addressof(R), ctypes.addressof(P), ctypes.sizeof(P))
        R.phases = dep.PH_RECV
        state = {"done": False}

        def hook():
            """Receive what the matching send announced (once)."""
            if state["done"]:
                raise ConfigError("%s: this receive hook was called already" % what)
            self._alive()
            state["done"] = True
            _ = keep
            try:
                self._launch(R, what + " (receive hook)")
                self._check(what, phase, mirrored=True)
            finally:
                self._ll_received(area, rec)
        return hook

    # The LL order rule. An LL send writes into the peers' area (kind, LL buffer) that the send
    # two LL calls before it used too; every rank makes the same calls in the same order, but
    # with receive hooks a rank may run ahead: after dispatch A (buffer 0), dispatch B (buffer 1),
    # hook A, hook B, a fast rank's hook B passes once a slow peer has SENT B, which that peer
    # did before its own hook A, so the fast rank's dispatch C (buffer 0) overwrote A's header and
    # rows there before the peer read them (its A got C's counts, silently, and its hook C timed
    # out and masked the live fast rank: the audit's ll_two_ahead, 2 ranks over p2p). The host
    # cannot see the peers, but it can prove they are done: a send into an area last used by
    # call p is safe iff p's receive has completed here AND some call q sent AFTER that has
    # completed its receive here, so every live peer has sent q, after its own receive of p. The
    # bookkeeping is a few list and int operations per call (bench/ep_host.py). Every rank
    # refuses the same call, before anything is launched (ConfigError).
    _LL_KINDS = ("dispatch", "dispatch", "combine", "combine")

    def _ll_area_check(self, what, area):
        """Refuse (ConfigError) an LL send into ``area`` (kind * 2 + LL buffer) that a peer may
        still be reading for the call that used it last."""
        rec = self._ll_areas[area]
        if rec is not None and (rec[2] is None or self._ll_max_done < rec[2]):
            raise ConfigError(
                "%s (LL send #%d of this Buffer, LL buffer %d): refused, nothing launched: it "
                "would write into the peers' %s area of LL buffer %d, which %s (LL send #%d) may "
                "still be reading: %s. Every rank refuses this same call. An LL call's area is "
                "used again two LL calls later: receive each call (its hook) and complete the "
                "receive of one LL call sent after that before the send that reuses its area; "
                "e.g. call each hook before the next LL send, or interleave two batches as "
                "DeepEP's two-batch overlap does (dispatch 0, dispatch 1, hook 0, hook 1, "
                "combine 0, combine 1, hook 0, hook 1, then the next layer). To go on from "
                "here, call clean_low_latency_buffer on every rank (a barrier)" % (
                    what, self._ll_sent + 1, area & 1, self._LL_KINDS[area], area & 1, rec[0],
                    rec[1] + 1,
                    "its receive hook has not run on this rank" if rec[2] is None else
                    "it was received here, but no LL call sent after that receive has been "
                    "received yet, so a slower peer may not have received it"))

    def _ll_area_use(self, what, area):
        """The send of ``what`` into ``area`` launched: the area's record [what, send number,
        the sends launched when its receive completed (None until then)]."""
        n = self._ll_sent
        self._ll_sent = n + 1
        rec = self._ll_areas[area] = [what, n, None]
        return rec

    def _ll_received(self, area, rec):
        """The receive of ``rec``'s call completed here, or ended (it raised: its error names the
        peers that did not deliver, masked with enable_shrink). Not for a call from before a
        clean (its area's record is no longer ``rec``)."""
        if self._ll_areas[area] is rec:
            rec[2] = self._ll_sent
            if rec[1] > self._ll_max_done:
                self._ll_max_done = rec[1]

    def get_next_low_latency_combine_buffer(self, handle):
        """The next low_latency_combine's send buffer as a bf16 tensor
        [E_loc, R*T_max, H] in the symmetric heap: write the expert outputs there and call
        ``low_latency_combine(..., zero_copy=True)`` to skip the copy."""
        self._alive()
        t_max, hidden, e = self._handle(handle, "get_next_low_latency_combine_buffer")[2:5]
        layout = self._layout(t_max, hidden, e, "get_next_low_latency_combine_buffer")
        off = layout.buffers[self._ll_idx]["c_send"]
        n = layout.e_loc * self.group_size * t_max * hidden
        return self._ll[off:off + 2 * n].view(torch.bfloat16).view(layout.e_loc, self.group_size * t_max,
                                                                    hidden)

    def _handle(self, handle, what):
        if not isinstance(handle, (tuple, list)) or len(handle) != 5:
            raise ConfigError("%s: handle must be the 5-tuple low_latency_dispatch returned "
                              "(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, "
                              "num_experts)" % what)
        src_info, layout_range, t_max, hidden, e = handle
        return src_info, layout_range, int(t_max), int(hidden), int(e)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None, overlap=False, src_signals=None,
                            src_signal_expect_value=0, packed_recv_count=None, comp_signal=None,
                            block_m=64, threshold=0, num_sms=3):
        """Send each expert output row back to its token's rank and reduce there with the weights.

        Arguments: ``x`` bf16 [E_loc, R*T_max, H] (the experts' outputs in the dispatch layout);
        ``topk_idx`` int64 [T, K] and ``topk_weights`` float32 [T, K] (this rank's routing, as
        dispatched); ``handle`` the dispatch's; ``zero_copy`` (x is
        ``get_next_low_latency_combine_buffer(handle)``, already filled); ``async_finish``,
        ``return_recv_hook`` as in dispatch; ``out`` bf16 [T, H] to write into;
        ``combine_wait_recv_cost_stats`` int64 [R] or [R, R]. ``use_logfmt`` is not implemented;
        the other branches' arguments (overlap, src_signals, ...) are accepted and unused.

        Returns ``(combined_x, event, hook)``: combined_x bf16 [T, H] =
        sum_k w[t,k] * x_of_expert(topk_idx[t,k])[row of (this rank, t)] over k with
        topk_idx[t,k] != -1 and the expert's rank not masked, in float32, rounded to bf16 once
        (with return_recv_hook: once hook() has run); hook as in dispatch (None without
        return_recv_hook).
        """
        self._alive()
        what = "low_latency_combine"
        if use_logfmt:
            raise NotImplementedError("low_latency_combine(use_logfmt=True): the LogFMT 10-bit format is "
                                      "not implemented in gpunet's low-latency mode")
        if overlap:
            raise NotImplementedError("low_latency_combine(overlap=True): signal-driven overlap (DeepEP "
                                      "branch argument) is not implemented")
        src_info, layout_range, t_max, hidden, e = self._handle(handle, what)
        layout = self._layout(t_max, hidden, e, what)
        el, r = layout.e_loc, self.group_size
        rows = r * t_max
        x = self._tensor(x, "x", torch.bfloat16, shape=(el, rows, hidden))
        topk_idx = self._tensor(topk_idx, "topk_idx", topk_idx_t, ndim=2)
        num_tokens, k = topk_idx.shape
        if not 1 <= k <= dep.MAX_TOPK:
            raise ConfigError("%s: top-k %d outside [1, %d]" % (what, k, dep.MAX_TOPK))
        if num_tokens > t_max:
            raise ConfigError("%s: %d tokens > num_max_dispatch_tokens_per_rank %d"
                              % (what, num_tokens, t_max))
        topk_weights = self._tensor(topk_weights, "topk_weights", torch.float32, shape=(num_tokens, k))
        src_info = self._tensor(src_info, "handle's src_info", torch.int32, shape=(el, rows))
        layout_range = self._tensor(layout_range, "handle's layout_range", torch.int64, shape=(el, r))
        stats, sflag = self._stats_arg(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats",
                                       "combine")
        buf = self._ll_idx
        flags = sflag
        if zero_copy:
            want = int(self._ll.data_ptr()) + layout.buffers[buf]["c_send"]
            if x.data_ptr() != want:
                raise ConfigError("%s(zero_copy=True): x must be the tensor "
                                  "get_next_low_latency_combine_buffer(handle) returned just before "
                                  "this call" % what)
            flags |= dep.F_ZERO_COPY
        if out is None:
            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self._device)
        else:
            o2 = self._tensor(out, "out", torch.bfloat16, shape=(num_tokens, hidden))
            if o2.data_ptr() != out.data_ptr():
                raise ConfigError("%s: out must be contiguous and 16-byte aligned (written in place)" % what)
        self._ll_area_check(what, 2 + buf)
        self._ll_idx ^= 1
        P = self._params(dep.OP_COMBINE, 0, flags, buf, layout, num_tokens, k)
        P.x, P.topk_idx, P.topk_weights = _addr(x), _addr(topk_idx), _addr(topk_weights)
        P.out_x, P.src_info, P.layout_range = _addr(out), _addr(src_info), _addr(layout_range)
        P.wait_stats = _addr(stats)
        keep = (x, topk_idx, topk_weights, src_info, layout_range, out, stats)
        hook = self._run_phases(P, what, "combine", return_recv_hook, keep, 2 + buf)
        event = EventOverlap(EventHandle(), keep) if async_finish else EventOverlap(None)
        return out, event, hook
