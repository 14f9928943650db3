"""Where everything of the low-latency mode lives, computed from the call's shape alone.

One function of (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts) gives the
byte offsets inside the RDMA buffer (the user-visible ``num_rdma_bytes`` region of the symmetric
heap) for both LL buffers; the same function is the size hint, so a buffer sized with
``Buffer.get_low_latency_rdma_size_hint`` always fits. Device code (gpunet/device/include/gpunet/ep/ll.cuh)
gets the addresses in its LlParams; it never computes a layout itself.

Per LL buffer (two, alternating as DeepEP's), 64-byte aligned areas:
  dispatch  send     t_max messages (the staged rows, one per token)
            shdr     R headers (one per destination)
            recv     R * t_max messages (source j's slot s at j * t_max + s)
            rhdr     R headers (one per source): counts, slot bitmap, per-expert token bitmaps;
                     then the direct dispatch's count rows and begins used (ll.cuh cnt_row)
  combine   send     [E_loc, R*t_max, H] bf16: the zero-copy buffer (get_next_low_latency_combine_buffer)
            stags    [E_loc, R*t_max] int32: the token index of each row sent
            shdr     R headers
            recv     R * c_rows rows of H bf16 (source o's rows from o * c_rows)
            rtags    R * c_rows int32
            rhdr     R headers
A message is the row (bf16 2H bytes, or fp8 H bytes + H/128 float scales) then META_BYTES of meta;
the areas are sized for bf16 (the larger). c_rows = t_max * min(16, E_loc): a source's experts
send back at most one row per (token, local expert) and a token selects at most 16 experts.

Signal words and per-peer state are NOT in this region (users reuse the RDMA buffer as scratch
between LL phases, then call clean_low_latency_buffer): they live in a separate small symmetric
allocation (see CTL_* below).
"""
from gpunet.device import ep as dep
from gpunet.errors import ConfigError

ALIGN = 64
# The proxy transport carries 39-bit heap offsets (gpunet/device/include/gpunet/proxy.cuh): a larger
# buffer would make puts fail on proxy peers, so the size hint refuses it.
MAX_REGION_BYTES = (1 << 39) - (1 << 30)
INT32_MAX = (1 << 31) - 1


def align(n, a=ALIGN):
    return (int(n) + a - 1) // a * a


def msg_stride(hidden, fp8):
    """(stride, payload) of one dispatch message: the row (FP8: and its scales) padded to 16
    bytes, then the fixed-size meta (a 16-byte multiple): row and meta are whole 16-byte units,
    which the kernels copy separately (ll.cuh dispatch_send)."""
    payload = align(hidden + 4 * (hidden // dep.GROUP) if fp8 else 2 * hidden, 16)
    return payload + dep.META_BYTES, payload


def check_shape(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, what="shape"):
    """Raise ConfigError unless the LL shape is one this implementation supports."""
    for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                    ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError("%s: %s must be an int, not %r" % (what, name, v))
        if v < 1:
            raise ConfigError("%s: %s must be >= 1, not %d" % (what, name, v))
    if hidden % dep.GROUP:
        raise ConfigError("%s: hidden %d is not a multiple of %d (any multiple of 128 works)"
                          % (what, hidden, dep.GROUP))
    if num_experts % num_ranks:
        raise ConfigError("%s: num_experts %d is not a multiple of the %d ranks"
                          % (what, num_experts, num_ranks))
    if num_ranks * num_max_dispatch_tokens_per_rank > INT32_MAX:
        raise ConfigError("%s: num_ranks * num_max_dispatch_tokens_per_rank = %d overflows the "
                          "int32 positions of src_info / layout_range"
                          % (what, num_ranks * num_max_dispatch_tokens_per_rank))


class LlLayout:
    """Offsets (bytes from the RDMA buffer's start) of both LL buffers' areas for one shape.

    Attributes: ``t_max, hidden, nranks, num_experts, e_loc, msg_bf16, hdr_stride, c_rows``,
    ``buffers`` (two dicts name -> offset), ``per_buffer`` (dict name -> bytes of one buffer),
    ``total`` (bytes of the whole region).
    """

    NAMES = ("d_send", "d_shdr", "d_recv", "d_rhdr", "c_send", "c_stags", "c_shdr", "c_recv",
             "c_rtags", "c_rhdr")

    def __init__(self, num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        check_shape(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        t, h, r, e = num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        self.t_max, self.hidden, self.nranks, self.num_experts = t, h, r, e
        self.e_loc = el = e // r
        self.msg_bf16 = msg_stride(h, False)[0]
        # header: head words, per-local-expert counts, then (dispatch) the slot bitmap and each
        # local expert's token bitmap (ll.cuh dispatch_hdr_words; the combine's is shorter)
        self.hdr_stride = align(4 * dep.dispatch_hdr_words(el, t))
        self.c_rows = t * min(dep.MAX_TOPK, el)
        if r * self.c_rows > INT32_MAX:
            raise ConfigError("num_ranks * num_max_dispatch_tokens_per_rank * min(16, local experts) "
                              "= %d overflows the int32 row indices of the combine receive area"
                              % (r * self.c_rows))
        sizes = {
            "d_send": t * self.msg_bf16,
            "d_shdr": r * self.hdr_stride,
            "d_recv": r * t * self.msg_bf16,
            # the receive headers, then the direct dispatch's count area (ll.cuh cnt_row)
            "d_rhdr": r * self.hdr_stride + 4 * dep.direct_area_words(r, e),
            "c_send": el * r * t * 2 * h,
            "c_stags": el * r * t * 4,
            "c_shdr": r * self.hdr_stride,
            "c_recv": r * self.c_rows * 2 * h,
            "c_rtags": r * self.c_rows * 4,
            "c_rhdr": r * self.hdr_stride,
        }
        self.per_buffer = {k: align(v) for k, v in sizes.items()}
        one = sum(self.per_buffer.values())
        self.buffers = []
        for b in range(2):
            off, d = b * one, {}
            for k in self.NAMES:
                d[k] = off
                off += self.per_buffer[k]
            self.buffers.append(d)
        self.total = 2 * one
        if self.total > MAX_REGION_BYTES:
            raise ConfigError("the low-latency buffer for t_max=%d, hidden=%d, %d ranks, %d experts "
                              "needs %d bytes, more than the %d a heap offset can address (proxy "
                              "commands carry 39-bit offsets); use fewer tokens per rank"
                              % (t, h, r, e, self.total, MAX_REGION_BYTES))

    def breakdown(self):
        """dict area -> bytes over both buffers (what the size hint adds up)."""
        return {k: 2 * v for k, v in self.per_buffer.items()}


# ---- the small control allocation (symmetric, never user-visible) ------------------------------
def ctl_layout(num_ranks):
    """Offsets inside the control allocation: signal words (NIC atomics land there) and the
    per-peer state and EP status the host reads without a device sync (on GPUs the heap is
    host-mapped). Returns (dict name -> offset, total bytes)."""
    r = num_ranks
    # sig: u64 dispatch / combine signals [2][2][R], barrier [R], heartbeats [R] (ll.cuh ll_hb),
    # the direct dispatch's count tags [2][R] (ll.cuh ctag_word)
    sizes = [("sig", 8 * 8 * r), ("mask", 4 * r), ("failed", 4 * r), ("got", 4 * r),
             ("nrecv", 4 * r), ("status_flag", 4)]
    out, off = {}, 0
    for k, n in sizes:
        out[k] = off
        off += align(n)
    return out, align(off, 4096)


# ---- the high-throughput mode's region (gpunet/device/include/gpunet/ep/ht.cuh) ----------------------
# Its own symmetric allocation (num_nvl_bytes; with num_nvl_bytes = 0 and low_latency_mode=False
# the num_rdma_bytes allocation). Fixed offsets first, so nothing a peer signals moves when a later
# call uses another Config or shape (a word left from an earlier call is epoch-stamped, ht.cuh):
#   sig    u64 tail[2 kinds][64 channels][R], head[2][64][R], hdr[R], hb[R] (heartbeats),
#          desc[R] (receive descriptors' signals)
#   shdr   R headers of HT_HDR_STRIDE bytes (send staging), rhdr 2 x R headers (one per source and
#          notify parity: ht.cuh ht_rhdr)
#   rdesc  R receive descriptors of HT_RD_WORDS u64 (ht.cuh "the receive pool"), one per destination
#   then the rest in two halves, dispatch then combine, each: a send (staging) ring and a receive
#   ring of [nc][R][ring] messages (msg_stride of bf16 rows: the larger kind).
HT_HDR_STRIDE = 4096


def ht_sig_bytes(num_ranks):
    """Bytes of the HT signal words (ht.cuh ht_tail, ht_head, ht_hdr_sig, ht_hb, ht_desc_sig)."""
    return 8 * (4 * dep.HT_MAX_CHANNELS * num_ranks + 3 * num_ranks)


def ht_fixed_bytes(num_ranks):
    return align(ht_sig_bytes(num_ranks), 4096) + 3 * num_ranks * HT_HDR_STRIDE + \
        align(num_ranks * dep.HT_RD_WORDS * 8, 4096)


def ht_area_bytes(hidden, num_ranks, nchannels, ring):
    """Bytes of one kind's rings (send + receive) for this shape and Config."""
    return 2 * nchannels * num_ranks * ring * msg_stride(hidden, False)[0]


def ht_size_hint(hidden, num_ranks, nchannels, ring):
    """Bytes the HT region needs: the fixed part and two halves of one kind's rings each."""
    return ht_fixed_bytes(num_ranks) + 2 * align(ht_area_bytes(hidden, num_ranks, nchannels, ring))


class HtLayout:
    """Offsets inside the HT region of ``region_bytes`` for one call's (hidden, ranks, channels,
    ring). ``sig, shdr, rhdr`` and per kind (0 dispatch, 1 combine) ``send[k], recv[k]``. Raises
    ConfigError when the rings do not fit in their half (with the bytes the hint asks for)."""

    def __init__(self, region_bytes, hidden, num_ranks, nchannels, ring, what="dispatch"):
        r = num_ranks
        need = ht_size_hint(hidden, r, nchannels, ring)
        if need > region_bytes:
            raise ConfigError(
                "%s: the high-throughput buffer holds %d bytes; hidden %d, %d ranks, %d channels "
                "(Config.num_sms / 2), %d-token rings need %d (Config.get_nvl_buffer_size_hint("
                "hidden * 2, num_ranks); pass it as num_nvl_bytes) or use a Config with smaller "
                "rings" % (what, region_bytes, hidden, r, nchannels, ring, need))
        self.sig = 0
        self.shdr = align(ht_sig_bytes(r), 4096)
        self.rhdr = self.shdr + r * HT_HDR_STRIDE
        self.rdesc = self.rhdr + 2 * r * HT_HDR_STRIDE
        start = ht_fixed_bytes(r)
        half = (region_bytes - start) // 2 // ALIGN * ALIGN
        per = ht_area_bytes(hidden, r, nchannels, ring) // 2
        self.send = [start, start + half]
        self.recv = [start + per, start + half + per]
        self.msg_stride = msg_stride(hidden, False)[0]
