"""The kernels of gpunet/device/kernels/ep_ll.cu (gpunet.ep's low-latency dispatch / combine), bound for
Python: the LlParams / EpStatus mirrors of gpunet/device/include/gpunet/ep/ll.cuh, its constants, and
``load_ep`` (build, bind, check the struct sizes). The C++ header is the source of truth."""
import ctypes

u32, u64 = ctypes.c_uint32, ctypes.c_uint64

# ---- ll.cuh constants ----------------------------------------------------------------------------
MAX_TOPK = 16
GROUP = 128
META_HEAD = 16
META_BYTES = META_HEAD + 8 * MAX_TOPK
HDR_HEAD = 8


def dmask_words(t_max):
    """u32 words of one destination's slot bitmap (ll.cuh dmask_words)."""
    return (t_max + 31) // 32


def dispatch_hdr_words(e_loc, t_max):
    """u32 words of a dispatch header (ll.cuh dispatch_hdr_words): head, counts, slot bitmap
    (padded to 8 bytes), then u64 [e_loc][dmask_words] expert token bitmaps with running counts."""
    return (HDR_HEAD + e_loc + dmask_words(t_max) + 1) // 2 * 2 + 2 * e_loc * dmask_words(t_max)


OP_DISPATCH, OP_COMBINE, OP_CLEAN = 0, 1, 2
PH_SEND, PH_RECV = 1, 2
F_FP8, F_ROUND_SCALE, F_UE8M0, F_ZERO_COPY, F_SHRINK, F_WAIT_STATS_2D = 1, 2, 4, 8, 16, 32
F_ALL_MAPPED, F_GPU_SCOPE, F_DIRECT, F_DIRECT_RECV = 1 << 16, 1 << 17, 1 << 18, 1 << 19
CNT_HEAD = 16


def direct_area_words(num_ranks, num_experts):
    """u32 words of one LL buffer's count area (ll.cuh cnt_row / bu_row), after the R dispatch
    receive headers: [R] count rows of CNT_HEAD + E words, then [R] "begins used" rows of E_loc
    words, each row rounded up to 16 words."""
    e_loc = num_experts // num_ranks
    return num_ranks * ((CNT_HEAD + num_experts + 15) // 16 * 16 + (e_loc + 15) // 16 * 16)


def bits_words(t_max, num_ranks, num_experts):
    """u32 words of the dispatch workspace LlParams::bits: the bitmaps [E + R][W], then the
    direct dispatch's dpre u64 [E][W], dbeg int32 [E] and dout u64 [R][3] (ll.cuh dpre)."""
    w = dmask_words(t_max)
    return ((num_experts + num_ranks) * w + 1) // 2 * 2 + 2 * num_experts * w + \
        (num_experts + 1) // 2 * 2 + 6 * num_ranks
SYNC_WORDS, SYNC_STRIDE = 8, 8
# LlParams::prof: per block, now_ns() at these points (ll.cuh ST_*); bench/ep_profile.py
ST_NAMES = ("begin", "send_plan", "send_loop", "send_hdr", "recv_ready", "recv_table", "recv_loop",
            "end", "quiet", "send_last", "hdr_filled", "hdr_signaled", "filled", "counted")
STAMPS = len(ST_NAMES)

EP_OK, EP_ERR_GRID_WAIT, EP_ERR_BAD_MESSAGE, EP_ERR_LAYOUT, EP_ERR_MISMATCH = range(5)
EP_ERR_NAMES = {
    EP_ERR_GRID_WAIT: "a block of the EP kernel waited too long for another block of the same "
                      "launch (the grid must be co-resident: fewer blocks, or a device less busy)",
    EP_ERR_BAD_MESSAGE: "a received message or row names a slot outside its range (corrupt data, "
                        "or ranks running different calls)",
    EP_ERR_LAYOUT: "the combine handle's layout does not fit this buffer (a handle from another "
                   "Buffer or another num_max_dispatch_tokens_per_rank?)",
    EP_ERR_MISMATCH: "a peer's call disagrees on hidden / num_experts / num_max_dispatch_tokens_per_rank "
                     "/ use_fp8 / the high-throughput Config (every rank must pass the same values)",
}
EP_SITE_NAMES = {1: "block 0's quiet of the peers (the send staging's flag)", 2: "the receive controller's flag",
                 3: "the combine slot-table barrier", 4: "a received message", 5: "a peer's header",
                 6: "the combine layout check", 7: "this rank's own data (self counter)",
                 8: "a peer's high-throughput header", 9: "the high-throughput notify flag",
                 10: "the num_worst_tokens check", 11: "the dispatch's token bitmaps (every block's)",
                 12: "a high-throughput bulk (TMA) copy into shared memory",
                 13: "the direct dispatch (a peer's count row, or a source's row positions)",
                 14: "a high-throughput combine row (expected / observed: ring << 32 | op counter; in place "
                     "(ht.cuh ht_take_pull, ht_recv_combine): the rows of the channel / the tail, with "
                     "kHtDirectBit, then the tail again before the credit)"}


class LlParams(ctypes.Structure):
    _fields_ = [("op", u32), ("phases", u32), ("flags", u32), ("buf", u32),
                ("rank", u32), ("nranks", u32), ("num_experts", u32), ("e_loc", u32),
                ("hidden", u32), ("topk", u32), ("num_tokens", u32), ("t_max", u32),
                ("msg_stride", u32), ("payload_bytes", u32), ("hdr_stride", u32), ("c_rows", u32),
                ("ctxs", u64), ("timeout_ns", u64),
                ("sig", u64), ("d_send", u64), ("d_shdr", u64), ("d_recv", u64), ("d_rhdr", u64),
                ("c_send", u64), ("c_stags", u64), ("c_shdr", u64), ("c_recv", u64),
                ("c_rtags", u64), ("c_rhdr", u64),
                ("x", u64), ("topk_idx", u64), ("topk_weights", u64), ("out_x", u64),
                ("out_scales", u64), ("out_count", u64), ("src_info", u64), ("layout_range", u64),
                ("cum_stats", u64), ("wait_stats", u64),
                ("mask", u64), ("failed", u64), ("got", u64), ("nrecv", u64),
                ("status_flag", u64), ("status", u64),
                ("expected", u64), ("sync", u64), ("bits", u64),
                ("tab", u64), ("table", u64), ("host_flags", u64), ("prof", u64)]


class EpStatus(ctypes.Structure):
    _fields_ = [("code", u64), ("valid", u64), ("op", u32), ("site", u32), ("block", u32),
                ("peer", u32), ("expected", u64), ("observed", u64), ("waited_ns", u64),
                ("pad", u64)]


SIZES = {"LlParams": 352, "EpStatus": 64, "DevCtx": 128}


def _load(source, kind, abi_size_fn, sizes, mirrors, arch, defines, bind):
    """Build (cached) ``gpunet/device/kernels/<source>`` for ``arch``, bind ``gpunet_ep_<kind>_launch`` and
    run ``bind(lib)`` once (the other argtypes); check that ``abi_size_fn(i)`` equals ``sizes``'
    i-th entry, and so does the size of this module's ctypes mirror of each struct in ``mirrors``."""
    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    lib = loader.build([loader.kernels_dir() / source], arch=arch, defines=defines or {})
    flag = "_gpunet_ep_%s_bound" % kind
    if getattr(lib, flag, False):
        return lib
    abi_size = getattr(lib, abi_size_fn)
    abi_size.argtypes, abi_size.restype = [u32], u32
    launch = getattr(lib, "gpunet_ep_%s_launch" % kind)
    launch.argtypes = [ctypes.c_void_p, u32, u32, u32, ctypes.c_void_p, u32]
    launch.restype = ctypes.c_int
    bind(lib)
    for i, (name, want) in enumerate(sizes.items()):
        got = abi_size(i)
        if got != want or (name in mirrors and ctypes.sizeof(globals()[name]) != want):
            raise ToolchainError("%s was built with sizeof(%s) = %d, gpunet/device/ep.py expects %d"
                                 % (source, name, got, want))
    setattr(lib, flag, True)
    return lib


def _bind_ll(lib):
    vp = ctypes.c_void_p
    lib.gpunet_ep_f32_to_e4m3.argtypes = [vp, vp, u64]
    lib.gpunet_ep_f32_to_bf16.argtypes = [vp, vp, u64]
    lib.gpunet_ep_group_scale.argtypes = [vp, vp, u64, u32]
    for f in (lib.gpunet_ep_f32_to_e4m3, lib.gpunet_ep_f32_to_bf16, lib.gpunet_ep_group_scale):
        f.restype = None
    lib.gpunet_ep_f32_to_e4m3_device.argtypes = [vp, vp, u64]
    lib.gpunet_ep_f32_to_e4m3_device.restype = ctypes.c_int
    lib.gpunet_ep_ll_max_block.argtypes, lib.gpunet_ep_ll_max_block.restype = [], u32


def transports_define(kinds):
    """The ``GPUNET_TRANSPORTS`` define (devctx.cuh: bit k for kind k) of a build for the
    transport kinds ``kinds`` (gpunet/device/abi.py TRANSPORT_*), or None for the default build with
    every transport."""
    from gpunet.device import abi
    kinds = set(kinds)
    if not kinds or not kinds <= {abi.TRANSPORT_IBGDA, abi.TRANSPORT_PROXY, abi.TRANSPORT_P2P}:
        raise ValueError("transport kinds %r: each must be one of abi.TRANSPORT_IBGDA/PROXY/P2P"
                         % sorted(kinds))
    if kinds == {abi.TRANSPORT_IBGDA, abi.TRANSPORT_PROXY, abi.TRANSPORT_P2P}:
        return None
    return "%du" % sum(1 << k for k in kinds)


def load_ep(arch="host", defines=None, kinds=None):
    """Build (cached) and bind gpunet/device/kernels/ep_ll.cu for ``arch``; checks the struct sizes.
    ``kinds``: the transport kinds (abi.TRANSPORT_*) the kernels may meet (None: all); a build
    for fewer carries no code of the others (transports_define)."""
    return _load("ep_ll.cu", "ll", "gpunet_ep_abi_size", SIZES, ("LlParams", "EpStatus"), arch,
                 with_transports(defines, kinds), _bind_ll)


def with_transports(defines, kinds):
    """A copy of ``defines`` plus the GPUNET_TRANSPORTS of a build for ``kinds`` (None: every transport)."""
    defines = dict(defines or {})
    mask = transports_define(kinds) if kinds is not None else None
    if mask is not None:
        defines["GPUNET_TRANSPORTS"] = mask
    return defines


# ---- ht.cuh (the high-throughput mode) ---------------------------------------------------------
HT_MAX_CHANNELS = 64
HT_MAX_CHUNK = 64
HT_HDR_HEAD = 9
OP_HT_DISPATCH, OP_HT_COMBINE = 3, 4
PH_NOTIFY, PH_DATA = 1, 2
F_HT_TOPK, F_HT_WEIGHTS, F_HT_BUMP, F_HT_WORST, F_HT_DESC, F_HT_DIRECT, F_HT_PRE, F_HT_PULL = (
    64, 128, 256, 512, 1024, 2048, 4096, 8192)
F_HT_SPLIT = 32768
HT_WS_WORDS = 16


def ht_split_at(r):
    """The u64 index in Buffer._ht_ws of channel 0's split words (ht.cuh ht_split_words): after the
    state words, the notify scratch and the token lists laid out for HT_MAX_CHANNELS; each channel
    has r + 2 words (the claim, the helper's done word, the helper's rows per source)."""
    return 2 * HT_MAX_CHANNELS * r * HT_WS_WORDS + r + 1 + HT_MAX_CHANNELS * r * HT_MAX_CHUNK // 2


def ht_ws_words(r):
    """Buffer._ht_ws's u64 words for r ranks (ht.cuh HtParams::ws)."""
    return ht_split_at(r) + HT_MAX_CHANNELS * (r + 2)


HT_RD_WORDS = 8       # ht.cuh RD_WORDS: a receive descriptor's u64 words
# HtParams::base.prof (LlParams::prof's rows, ht.cuh HT_ST_*): stamps (now_ns) and, from
# "t_move" on, what thread 0 summed over the block's loop (ns, then counts); bench/ep_ht.py
HT_ST_NAMES = ("begin", "end", "notify_begin", "notify_sent", "notify_end", "first", "t_move",
               "t_post", "t_idle", "steps", "idle_steps", "items", "notify_pos")
EP_ERR_WORST = 5
EP_ERR_NAMES[EP_ERR_WORST] = ("more tokens arrived than num_worst_tokens rows (pass a larger "
                              "num_worst_tokens, or 0 to size recv_x exactly)")
EP_ERR_OUT_OF_STEP = 6
EP_ERR_NAMES[EP_ERR_OUT_OF_STEP] = (
    "this rank and the peer are out of step: they are at different high-throughput operations "
    "(expected: this rank's count of them, observed: the peer's). A rank whose call raised "
    "before its launch (a combine or cached dispatch it refused) while its peers ran it is one "
    "behind: every rank must make the same sequence of dispatch / combine calls (a call one rank "
    "refused must be made again there, with valid arguments, before its next one). This rank "
    "has caught up with the peer's count; once the ranks unmask each other "
    "(low_latency_clean_mask_buffer on each) the next call is in step")


class HtParams(ctypes.Structure):
    _fields_ = [("base", LlParams),
                ("nchannels", u32), ("ring", u32), ("chunk", u32), ("num_recv_max", u32),
                ("alignment", u32), ("nbias", u32), ("peer_timeout_ns", u64),
                ("epoch", u64), ("sig", u64), ("self_sig", u64), ("send_ring", u64),
                ("recv_ring", u64), ("shdr", u64), ("rhdr", u64),
                ("x", u64), ("x_scales", u64), ("topk_idx", u64), ("topk_weights", u64),
                ("in_rank", u64), ("ntpe", u64), ("out_x", u64), ("out_scales", u64),
                ("out_topk_idx", u64), ("out_weights", u64), ("out_src_idx", u64),
                ("send_pos", u64), ("send_cnt", u64), ("chan_prefix", u64), ("recv_info", u64),
                ("bias0", u64), ("bias1", u64), ("ws", u64), ("host_info", u64),
                ("pool", u64), ("rdesc", u64), ("pool_bytes", u64)]


HT_SIZES = {"HtParams": 616, "EpStatus": 64, "DevCtx": 128}


def load_ep_ht(arch="host", defines=None, kinds=None):
    """Build (cached) and bind gpunet/device/kernels/ep_ht.cu for ``arch``; checks the struct sizes.
    ``kinds``: as load_ep's."""
    return _load("ep_ht.cu", "ht", "gpunet_ep_ht_abi_size", HT_SIZES, ("HtParams", "EpStatus"),
                 arch, with_transports(defines, kinds), lambda lib: None)
