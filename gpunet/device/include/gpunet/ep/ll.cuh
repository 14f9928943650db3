// gpunet/ep/ll.cuh — MoE expert-parallel LOW-LATENCY dispatch and combine (DeepEP V1's LL packed
// layout), written on the user device API alone: it includes <gpunet/gpunet.cuh> and nothing below
// it, moves data only with its verbs (put_nbi, put_signal_nbi, signal_read, quiet_pe, fence), records
// a wait's timeout as wait_until does (wait_peer: the same Status record, a bound extended by
// heartbeats) and uses gpunet::arch only for SIMT ids, barriers, atomics on its own workspace and
// the clock.
//
// The host side is gpunet/ep/buffer.py (it computes every address and size); gpunet/device/ep.py mirrors
// LlParams / EpStatus byte for byte; tests/test_ep_ll.py checks the results against
// gpunet/ep/reference.py on 2 and 4 ranks, warps of 32 and 64, over ibgda, proxy and mixed worlds.
//
// ------------------------------------------------------------------------------------------------
// Dispatch (rank `me` sends its T tokens; every rank receives into the packed per-expert layout)
//
//   E_loc = E / R; global expert e lives on rank e / E_loc as local expert e % E_loc.
//   SEND  1. block 0 quiets every live peer (the previous use of this LL buffer's send staging is
//            complete at the NIC before it is overwritten; a failure names the peer; a grid flag
//            tells the blocks that stage); there is no plan to wait for.
//         2. every warp, a token each: lane k sets bit t of selection k's expert's token bitmap
//            and the lane of the token's first selection on a rank bit t of that rank's slot
//            bitmap (atomic ors on device memory, nothing returned, nothing waited for).
//         3. every warp, a token each (a part of it, a warp each, when every peer is mapped): the
//            row (bf16, or fp8 + one f32 scale per 128 columns, quantised here) is staged ONCE in
//            the send buffer when a NIC peer needs it, and stored ONCE per mapped destination RANK
//            (not per expert) at slot t of this rank's area there; the token's meta (t, then its
//            K experts, -1 for holes and repeats) follows the row, and a NIC destination gets the
//            staged row and meta in ONE put to slot t.
//         4. every block (once every block's bits are in) fills a few rows of the bitmaps into
//            the headers: per destination n_d messages, per-local-expert counts, the slot bitmap
//            of d, then per local expert its token bitmap with the running count of the bits
//            before each word; and zeroes them for the next launch. The block that finishes last
//            (every other block's puts are reserved before its own, so they execute first on each
//            peer's in-order RC QP or proxy channel) sets the token count T and sets the signal
//            word (dispatch, buffer b, source me) on d, in one put_signal per destination (a
//            mapped peer's header is stored there in place).
//   RECV  5. block 0 waits (bounded, per source) for each live source's signal to pass the count it
//            expects (device-resident, so a CUDA graph replays correctly), reads the headers, and
//            writes begin_j(e) = sum_{i<j} count_i(e), layout_range, packed_recv_count and the
//            stats. A source that stays silent or fails is masked (enable_shrink) or recorded as
//            failed (the host raises EPTimeout); it contributes count 0 either way.
//         6. every warp unpacks messages (slot t < T_j of source j whose bitmap bit is set; the
//            meta must name t, and expert e's token bitmap must hold t): the bits below t,
//            idx_e(t) = #{t' < t from j selecting e} (one word's running count + one popcount),
//            give pos = begin_j(e) + idx_e(t) for each local expert of the meta; the row goes to
//            packed_recv_x[e][pos] (fp8: scales column-major, float or packed UE8M0), t to
//            src_info[e][pos]. The result is the contract's deterministic layout
//            (gpunet/ep/reference.py ll_dispatch_ref) whatever the arrival order.
//   DIRECT (F_DIRECT: a receive pool, every peer p2p on this GPU): between 2 and 3 a count round
//            (block 0) gives each source begin_j(e) on every destination, and step 3 stores each
//            (token, local expert) row straight into packed_recv_x on a destination whose
//            tensors lie in its pool; step 6 has nothing to unpack ("The direct dispatch" below).

// Combine (the expert side sends rows back; the token side reduces with its weights)
//   Rows travel once per (token, selected expert) (DeepEP's choice): the weights live on the token
//   side (low_latency_combine's topk_weights), and the V1 dispatch never sees them, so the expert
//   side cannot pre-reduce per destination rank without an extra weight exchange (one more network
//   hop) — and per-selection bf16 rows reduced in float32 on the token side are exactly DeepEP's
//   arithmetic (bound: calc_diff < 1e-5 against the float32 reference, met with margin).
//   SEND  7. for each (local expert e, source j) the rows [begin, begin+count) of x are contiguous:
//            copied into the send staging (unless zero_copy: x IS the staging buffer) with their
//            source token indices (src_info), then ONE put of the rows and one of the indices to
//            this rank's area on j. The per-j headers (per-expert counts, from the handle alone)
//            are filled at the start by a warp each; the last block puts them + a signal.
//   RECV  8. block 0 waits for each live source's signal and header; every warp then builds the
//            slot table table[t][k] = (source, row) from the received token indices (a token that
//            names the same expert twice gets the row twice: its weights add, as in the reference);
//            a grid barrier; then warp per token: out[t] = bf16(sum_k w[t,k] * row(t,k)) in float32,
//            k ascending (deterministic: same inputs, same bits), rows of masked ranks left out.
//
// Self: what a rank sends to itself never goes through the NIC. The send phase stores those
// messages / rows straight into its own receive areas (plain stores: the local heap is mapped),
// writes its own header there, and announces it by adding 1 to a device-memory counter
// (self_sig[kind][buf]) instead of a NIC signal; the receive side reads them like any source's.
// With 2 ranks that is half the traffic the soft NIC's engine no longer copies.
//
// Failures: every verb is called on a PER-PEER copy of the Context's DevCtx (`ctxs[p]`) whose
// Status block is its own: a dead peer's error CQE or a silent peer's timeout is recorded for that
// peer alone and never makes operations to live peers fail fast. A verb that returns false marks
// the peer failed (`failed[p]`), and with F_SHRINK masked (`mask[p]`): masked peers are skipped
// before posting, never waited for, and count 0. A wait on a peer (wait_peer) is final only when
// the peer has stopped beating (see "heartbeats" below): a live peer late from waiting out a dead
// third rank is not masked. Grid-internal waits (a block waiting for block 0's
// quiet or receive tables, or for the other blocks at a barrier) are bounded by
// LlParams::timeout_ns and recorded in EpStatus. Nothing traps; every block leaves.
//
// Memory orders: workspace written by one block and read by others is published with grid_fence
// (system scope; device scope when every peer is p2p on this GPU, F_GPU_SCOPE) + an atomic flag
// and read after the flag with the same fence (acquire); staged rows and metas are plain stores
// followed by syncwarp and the poster's fence() before the put (the NIC reads them).
//
// Speed rules (the p2p rows of bench/RESULTS.md were 300-1400 us for 1.8 MB a rank before them):
//   - Every put is put_nbi_warp, called by the whole warp: over p2p the warp's lanes copy the row
//     together in 16-byte stores. A put_nbi from one lane makes that lane copy 14 KB (dispatch)
//     or ~50 KB (combine, several rows) alone, one 16-byte store at a time: that was the time.
//     Over ibgda the warp put posts ONE WQE per max_wqe bytes (GPUNET_WARP_MIN_CHUNK below):
//     splitting a row into 32 WQEs would multiply the NIC's (and the soft NIC's) work.
//   - One fence() per warp item (token / expert-source run) before its first put, not one per
//     destination: a system fence after a p2p put waits for those remote stores to land.
//   - The combine reduction is one item per (token, 8 * warp_size columns), so every warp works
//     even when T is smaller than the grid's warps; each lane loads all K rows of its columns
//     before it adds (independent loads in flight), then adds in k order (deterministic).
//   - No serial memory chains: copies keep kCopyUnroll loads in flight per lane (warp_copy), a
//     thread's walk over the E_loc counts loads kBatch at a time (batched), a message's K
//     selections are read by K lanes, and a last block loads its header words before it
//     stores any (see dispatch_send_last).
// bench/ep_profile.py measures each phase (LlParams::prof stamps) and the host's share.
#pragma once

#include <stdint.h>

// put_nbi_warp over ibgda: chunks of max_wqe bytes (one WQE per max_wqe, as put_nbi), not one WQE
// per lane (see "Speed rules" above). Defined before gpunet.cuh so transport/ibgda.cuh takes it.
#ifndef GPUNET_WARP_MIN_CHUNK
#define GPUNET_WARP_MIN_CHUNK (uint64_t(1) << 40)
#endif

#include <gpunet/gpunet.cuh>
#if defined(GPUNET_TEST_LL_EXIT_AFTER_COUNTS) && defined(GPUNET_ARCH_HOST)
#include <unistd.h>
#endif

namespace gpunet {
namespace ep {

constexpr uint32_t kMaxTopk = 16;       // DeepEP caps LL at 11; users ask for 16 (EP-ANCHORS §C.7)
constexpr uint32_t kGroup = 128;        // columns per FP8 scale
// message meta: t, K, hidden, 0; then kMaxTopk experts (ht.cuh: then kMaxTopk weights)
constexpr uint32_t kMetaHead = 16;
constexpr uint32_t kMetaBytes = kMetaHead + 8 * kMaxTopk;  // fixed, so ranks may differ in K
// header words: n, tokens, hidden, experts, msg_stride, t_max, 0, 0; then E_loc counts. The
// receiver checks hidden, experts, msg_stride and t_max: ranks that disagree (DeepEP#208) fail
// with EP_ERR_MISMATCH naming the peer instead of reading each other's bytes at wrong offsets.
constexpr uint32_t kHdrHead = 8;
constexpr float kFp8Max = 448.0f;       // largest finite float8_e4m3fn
constexpr float kAmaxFloor = 1e-4f;     // amax clamp: an all-zero group still gets a finite scale

enum : uint32_t { OP_DISPATCH = 0, OP_COMBINE = 1, OP_CLEAN = 2 };
enum : uint32_t { PH_SEND = 1, PH_RECV = 2 };
enum : uint32_t {
  F_FP8 = 1,             // dispatch: send e4m3 + float scales
  F_ROUND_SCALE = 2,     // scales rounded up to powers of two
  F_UE8M0 = 4,           // output scales packed as UE8M0 bytes, 4 per int32 (implies rounding)
  F_ZERO_COPY = 8,       // combine: x is the send staging buffer already
  F_SHRINK = 16,         // a failed peer is masked (else only recorded; the host raises)
  F_WAIT_STATS_2D = 32,  // wait_stats is [R, R]: this rank's row; else [R]
  // (bits 64..4096 are ht.cuh's F_HT_*: HtParams::base.flags shares this word)
  F_ALL_MAPPED = 1u << 16,  // every peer but this rank is mapped here (p2p): rows go unstaged
  F_GPU_SCOPE = 1u << 17,   // every peer (this rank too) is p2p on this GPU: see grid_fence
  F_DIRECT = 1u << 18,      // dispatch, every peer mapped on one GPU, a receive pool: the count round
                            // runs, and rows go straight to each direct destination's packed
                            // rows ("The direct dispatch" below); the same on every rank
  F_DIRECT_RECV = 1u << 19, // this rank's recv_x and src_info lie in its heap (the receive pool):
                            // it is a direct destination this launch
};
enum : uint32_t { SIG_DISPATCH = 0, SIG_COMBINE = 1 };
// grid sync words (each on its own 64-byte line of LlParams::sync), zero between launches
enum : uint32_t {
  SYNC_SEND_QUIET = 0, SYNC_SEND_BITS = 1, SYNC_SEND_BAD = 2, SYNC_SEND_DONE = 3,
  SYNC_RECV_READY = 4, SYNC_RECV_TABLE = 5, SYNC_RECV_DONE = 6, SYNC_SEND_COUNTS = 7, SYNC_WORDS = 8,
};
constexpr uint32_t kSyncStride = 8;     // u64 words between two sync words (64 bytes)
// A combine slot-table entry is (source << 32 | row of its receive area), or kSelfRow | (row of x)
// for this rank's own rows read in place (bit 62: no source rank reaches 2^30).
constexpr int64_t kSelfRow = int64_t(1) << 62;

// EpStatus codes and sites. gpunet/device/ep.py: EP_ERR_*, EP_SITE_*.
enum : uint32_t {
  EP_OK = 0,
  EP_ERR_GRID_WAIT = 1,    // a block waited too long for another block of the same launch
  EP_ERR_BAD_MESSAGE = 2,  // a received message or row names a slot outside its range
  EP_ERR_LAYOUT = 3,       // combine: a handle's layout does not fit this buffer
  EP_ERR_MISMATCH = 4,     // a peer's header disagrees on hidden / num_experts
};
enum : uint32_t {
  EP_SITE_QUIET = 1, EP_SITE_RECV_READY = 2, EP_SITE_TABLE = 3, EP_SITE_MESSAGE = 4,
  EP_SITE_HEADER = 5, EP_SITE_COMBINE_LAYOUT = 6, EP_SITE_SELF = 7,
  EP_SITE_BITS = 11,  // (8..10, 12: ht.cuh's EP_SITE_HT_*)
  EP_SITE_DIRECT = 13,  // the direct dispatch: a count row, or a source's row positions
};

// One launch's arguments, passed BY VALUE (a CUDA graph captures them). 352 B. gpunet/device/ep.py.
struct LlParams {
  uint32_t op, phases, flags, buf;             // OP_*, PH_* bits, F_* bits, LL buffer 0/1
  uint32_t rank, nranks, num_experts, e_loc;
  uint32_t hidden, topk, num_tokens, t_max;    // topk K <= kMaxTopk; num_tokens T <= t_max
  uint32_t msg_stride, payload_bytes, hdr_stride, c_rows;  // c_rows: rows of one source's area
  uint64_t ctxs;          // DevCtx[nranks]: per-peer copies of the Context's, each its own Status
  uint64_t timeout_ns;    // bound of grid-internal waits (> the longest wait on a peer: the
                          // per-peer bound in ctxs, extended by heartbeats up to 3x; see wait_peer)
  // symmetric heap (this rank's addresses; the same offsets on every peer)
  uint64_t sig;           // u64 [2 kinds][2 bufs][R] + barrier [R] + hb [R] (heartbeats)
                          // + count tags [2 bufs][R] (the direct dispatch: ctag_word)
  uint64_t d_send, d_shdr, d_recv, d_rhdr;                 // buffer `buf`'s dispatch areas
  uint64_t c_send, c_stags, c_shdr, c_recv, c_rtags, c_rhdr;  // and combine areas
  // the caller's tensors (device memory on GPUs)
  uint64_t x;             // dispatch: bf16 [T, H]; combine: bf16 [E_loc, R*t_max, H]
  uint64_t topk_idx;      // int64 [T, K]
  uint64_t topk_weights;  // float [T, K] (combine)
  uint64_t out_x;         // dispatch: bf16 | fp8 [E_loc, R*t_max, H]; combine: bf16 [T, H]
  uint64_t out_scales;    // fp8: float [E_loc, H/128, R*t_max] | int32 [E_loc, ceil(H/512), R*t_max]
  uint64_t out_count;     // int32 [E_loc]
  uint64_t src_info;      // int32 [E_loc, R*t_max]
  uint64_t layout_range;  // int64 [E_loc, R]
  uint64_t cum_stats;     // int32 [E_loc] or 0
  uint64_t wait_stats;    // int64 [R] or [R, R] or 0
  // per-rank state the host reads without a device sync (heap memory, never sent)
  uint64_t mask;          // int32 [R], persistent: 1 = masked
  uint64_t failed;        // int32 [R], persistent: a verb to this peer returned false
  uint64_t got;           // int32 [R], this launch: 1 = the peer's signal and header arrived
  uint64_t nrecv;         // int32 [R], this launch: messages / rows the peer sent us (written,
                          // never read here: the copies the kernels read are in `tab`)
  uint64_t status_flag;   // uint32: set to 1 (a plain store) once `status` records a failure
  uint64_t status;        // EpStatus, device memory: its first-failure CAS must not be an atomic
                          // on host-mapped memory (PCIe atomics are not guaranteed everywhere)
  // workspace (device memory)
  uint64_t expected;      // u64 [2 kinds][2 bufs][R]: signal counts seen so far, then self
                          // expected [2][2] and self_sig [2][2] (see "Self" above), then the
                          // signals raised [2 kinds][2 bufs][R] (sent_word) and the cleans run
                          // [1] (clean_epoch), then the time of this rank's last
                          // heartbeat [1] (ll_beat): 8 R + 10 words
  uint64_t sync;          // u64 [SYNC_WORDS * kSyncStride], zero between launches
  uint64_t bits;          // u32 dispatch send bitmaps, zero between launches (expert_bits)
  uint64_t tab;           // int32 [2][R * E_loc] + [R]: the receive controller's tables
  uint64_t table;         // int64 [t_max * K], -1 between launches: combine (source, row) slots
  // host-visible copies of the failure words, or 0 (the host reads mask / failed / status_flag
  // where they are: a host-mapped heap). u32 [1 + R]: [0] = status_flag, [1 + p] = failed[p].
  // Pinned host memory mapped into the device: with a device-memory heap (p2p) the host then
  // learns of a failure without copying the heap (a device sync) after every call.
  uint64_t host_flags;
  uint64_t prof;          // u64 [grid][kStamps] phase stamps (now_ns), or 0: bench/ep_profile.py
};
static_assert(sizeof(LlParams) == 352, "LlParams layout is mirrored in gpunet/device/ep.py");

// LlParams::prof: thread 0 of every block stores now_ns() at these points (0 = not reached).
enum : uint32_t {
  ST_BEGIN = 0,       // kernel entry
  ST_SEND_PLAN = 1,   // the block may write the send staging (block 0's quiet is done)
  ST_SEND_LOOP = 2,   // every warp of the block has posted its puts / copies
  ST_SEND_HDR = 3,    // (last block) headers + signals posted, self announced
  ST_RECV_READY = 4,  // the block has the receive tables (block 0: every source arrived)
  ST_RECV_TABLE = 5,  // combine: after the slot-table barrier
  ST_RECV_LOOP = 6,   // every warp of the block is done with its unpack / reduce
  ST_END = 7,         // the block leaves
  ST_QUIET = 8,       // block 0: its quiet of the live peers done
  ST_SEND_LAST = 9,   // the last block of the send phase: it knows it is last
  ST_HDR_FILLED = 10, // the last block: headers written, before the signals
  ST_HDR_SIGNALED = 11,  // the last block: every header's signal posted, before announce / reset
  ST_FILLED = 12,     // dispatch: the block's header rows filled (fill_header_row), before last_block
  ST_COUNTED = 13,    // direct dispatch, block 0: the count round done (direct_counts), before its flag
  kStamps = 14,
};

// The first EP-level failure of a launch (first wins). 64 B. gpunet/device/ep.py: EpStatus.
struct EpStatus {
  uint64_t code;       // EP_ERR_*
  uint64_t valid;      // release-stored 1 after the fields below
  uint32_t op, site;
  uint32_t block, peer;
  uint64_t expected, observed, waited_ns;
  uint64_t pad;
};
static_assert(sizeof(EpStatus) == 64, "EpStatus layout is mirrored in gpunet/device/ep.py");

// ---- numerics: software conversions, bit-exact on every arm (the HOST arm has no fp8) ---------

GPUNET_HOST_DEVICE uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
GPUNET_HOST_DEVICE float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
GPUNET_HOST_DEVICE float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// Round to nearest even, as torch's float -> bfloat16 cast (NaN -> 0x7fc0).
GPUNET_HOST_DEVICE uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(0x7fc0u | ((u >> 16) & 0x8000u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// float -> float8_e4m3fn as torch's tensor cast does it (what the contract's reference uses):
// round to nearest even; 4 exponent bits (bias 7), 3 mantissa bits, no infinity; magnitudes that
// round above 448 (and +-inf) SATURATE to +-448; NaN -> 0x7f | sign. (tests/test_ep_ll.py checks
// every e4m3 value, every midpoint and generated floats against torch.)
GPUNET_HOST_DEVICE uint8_t f32_to_e4m3(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7f);       // NaN
  const uint32_t ex = a >> 23;                             // biased float32 exponent
  if (ex >= 127 - 6) {                                     // |f| >= 2^-6: e4m3 normals
    const int32_t e = int32_t(ex) - 127;
    if (e > 8) return uint8_t(sign | 0x7e);                // >= 512 (and inf): saturate
    const uint32_t m = a & 0x7fffffu;
    const uint32_t keep = m >> 20, rem = m & 0xfffffu;
    uint32_t code = (uint32_t(e + 7) << 3) | keep;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) code += 1;  // carries into the exponent
    return uint8_t(sign | (code > 0x7eu ? 0x7eu : code));
  }
  if (ex == 0) return sign;                                // float32 zero / subnormal: 0
  // e4m3 subnormals are multiples of 2^-9: code = rne(|f| * 2^9); 8 lands on the first normal
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;       // |f| = mant * 2^(ex - 150)
  const uint32_t s = 141 - ex;                             // |f| * 2^9 = mant >> s
  if (s > 24) return sign;                                 // below half of 2^-9
  uint32_t q = mant >> s;
  const uint32_t rem = mant & ((1u << s) - 1), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) q += 1;
  return uint8_t(sign | q);
}

// Two values at once, as the quantiser stores them (lo in the low byte). CUDA sm_89+: the
// hardware conversion (arch::cvt_e4m3x2: 1 instruction for 2 values where f32_to_e4m3 is ~20 a
// value; FP8 dispatch was 91.8 us against BF16's 62.5 on the H200, the difference the
// quantisation), with NaN rewritten to the contract's 0x7f | sign (the instruction's NaN sign is
// not what torch gives). Everywhere else f32_to_e4m3. tests/test_ep_cuda.py checks the GPU's
// bytes against f32_to_e4m3 on every e4m3 code, every midpoint, the saturation edges, NaN and inf.
GPUNET_DEVICE uint16_t f32x2_to_e4m3x2(float lo, float hi) {
#if defined(GPUNET_ARCH_HAS_E4M3X2)
  uint16_t r = arch::cvt_e4m3x2(lo, hi);
  if (lo != lo) r = uint16_t((r & 0xff00u) | 0x7fu | ((f32_bits(lo) >> 24) & 0x80u));
  if (hi != hi) r = uint16_t((r & 0x00ffu) | ((0x7fu | ((f32_bits(hi) >> 24) & 0x80u)) << 8));
  return r;
#else
  return uint16_t(f32_to_e4m3(lo) | (uint32_t(f32_to_e4m3(hi)) << 8));
#endif
}

GPUNET_HOST_DEVICE float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t ex = (c >> 3) & 0xfu, m = c & 7u;
  if (ex == 15 && m == 7) return bits_f32(0x7fc00000u | sign);
  if (ex == 0) {  // subnormal: m * 2^-9
    const float v = float(m) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((ex + 120u) << 23) | (m << 20));
}

// 2^ceil(log2(s)) for a positive normal float s (exact: no log2 rounding).
GPUNET_HOST_DEVICE float ceil_pow2(float s) {
  const uint32_t u = f32_bits(s);
  const uint32_t ex = (u >> 23) + ((u & 0x7fffffu) ? 1u : 0u);
  return bits_f32(ex << 23);
}

// The contract's per-group scale: amax = max|x| clamped to >= 1e-4; scale = amax / 448, rounded up
// to a power of two when asked (round_scale or UE8M0).
GPUNET_HOST_DEVICE float group_scale(float amax, bool round) {
  const float a = amax < kAmaxFloor ? kAmaxFloor : amax;
  const float s = a / kFp8Max;
  return round ? ceil_pow2(s) : s;
}

GPUNET_HOST_DEVICE uint32_t popc64(uint64_t x) {
  x = x - ((x >> 1) & 0x5555555555555555ull);
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
  return uint32_t((x * 0x0101010101010101ull) >> 56);
}

// ---- small helpers --------------------------------------------------------------------------

struct alignas(16) V16 {
  uint64_t a, b;
};

struct Geo {  // this thread's place in the grid
  uint32_t tid, bdim, bid, nblocks, ws, lane, wid, nwarps, gw, gwarps;
};
GPUNET_DEVICE Geo geo() {
  Geo g;
  const arch::Dim3 bd = arch::block_dim(), b = arch::block_idx(), gd = arch::grid_dim();
  g.tid = arch::thread_rank();
  g.bdim = bd.x * bd.y * bd.z;
  g.bid = b.x + gd.x * (b.y + gd.y * b.z);
  g.nblocks = gd.x * gd.y * gd.z;
  g.ws = arch::warp_size();
  g.lane = arch::lane_id();
  g.wid = g.tid / g.ws;
  g.nwarps = (g.bdim + g.ws - 1) / g.ws;
  g.gw = g.bid * g.nwarps + g.wid;
  g.gwarps = g.nblocks * g.nwarps;
  return g;
}

template <class T>
GPUNET_DEVICE T* ptr(uint64_t a) {
  return reinterpret_cast<T*>(uintptr_t(a));
}

// The warp reads n bytes at src (n % 16 == 0, 16-byte aligned), 16 bytes per lane per step, in
// rounds of kCopyUnroll steps with every load of a round issued before its stores, then rounds of
// kCopyUnroll / 2, then single steps, and hands each 16 bytes to store(offset, value): a lane has
// up to kCopyUnroll loads in flight, not one. A 14 KB row is 28 steps of a 32-lane warp: one load
// at a time made that 28 memory latencies per row, 4 in flight 7, now 4 (3 rounds of 8, one of
// 4): the copies of dispatch's send and receive were rounds of latency, not bandwidth, in the
// H200 profile. (Predicated partial rounds instead of the halving took 178 registers, not 126.)
constexpr uint32_t kCopyUnroll = 8;
template <uint32_t U, class Store>
GPUNET_DEVICE void copy_rounds(uint64_t& i, uint64_t step, uint64_t src, uint64_t n, Store& store) {
  for (; i + (U - 1) * step < n; i += U * step) {
    V16 v[U];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) v[u] = *ptr<const V16>(src + i + u * step);
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) store(i + u * step, v[u]);
  }
}
template <class Store>
GPUNET_DEVICE void warp_copy_rounds(const Geo& g, uint64_t src, uint64_t n, Store store) {
  const uint64_t step = uint64_t(g.ws) * 16;
  uint64_t i = uint64_t(g.lane) * 16;
  copy_rounds<kCopyUnroll>(i, step, src, n, store);
  copy_rounds<kCopyUnroll / 2>(i, step, src, n, store);
  copy_rounds<1>(i, step, src, n, store);
}
// The warp copies n bytes (n % 16 == 0, both ends 16-byte aligned).
GPUNET_DEVICE void warp_copy(const Geo& g, uint64_t dst, uint64_t src, uint64_t n) {
  warp_copy_rounds(g, src, n, [&](uint64_t off, const V16& v) { *ptr<V16>(dst + off) = v; });
}

// The same n bytes from src to each of the nd (>= 1) addresses dst[q], read once (kCopyUnroll
// loads in flight, each 16 bytes stored to every copy): a row to each of its packed rows.
GPUNET_DEVICE void warp_copy_each(const Geo& g, const uint64_t* dst, uint32_t nd, uint64_t src, uint64_t n) {
  if (nd == 1) return warp_copy(g, dst[0], src, n);
  warp_copy_rounds(g, src, n, [&](uint64_t off, const V16& v) {
    for (uint32_t q = 0; q < nd; ++q) *ptr<V16>(dst[q] + off) = v;
  });
}

// One thread's walk over n values (per-expert counts: E_loc is 100s): load(i) for kBatch values
// at a time, all issued before use(i, value) of any of them. Header and layout walks store as
// they go, and a store to int32 memory may alias the next load, so a plain loop waits one memory
// latency per value (144 of them for DeepEP's 288 experts on 2 ranks: tens of us, serially).
constexpr uint32_t kBatch = 16;
template <class Load, class Use>
GPUNET_DEVICE void batched(uint32_t n, Load load, Use use) {
  for (uint32_t i0 = 0; i0 < n; i0 += kBatch) {
    int64_t v[kBatch];
#pragma unroll
    for (uint32_t u = 0; u < kBatch; ++u) v[u] = i0 + u < n ? int64_t(load(i0 + u)) : 0;
#pragma unroll
    for (uint32_t u = 0; u < kBatch; ++u)
      if (i0 + u < n) use(i0 + u, v[u]);
  }
}

// Warp-collective (every lane, same n): the exclusive prefix of value(i), i < n, handed to
// out(i, prefix); returns the total on every lane. Lane l takes i = i0 + l of each chunk of ws
// values; an inclusive scan by log2(ws) shuffles per chunk (the chunks' loads do not wait for
// each other's sums). value(i) and out(i, .) run only for i < n.
template <class Value, class Out>
GPUNET_DEVICE int64_t warp_scan(const Geo& g, uint32_t n, Value value, Out out) {
  int64_t run = 0;
  for (uint32_t i0 = 0; i0 < n; i0 += g.ws) {
    const uint32_t i = i0 + g.lane;
    const int64_t c = i < n ? int64_t(value(i)) : 0;
    int64_t x = c;
    for (uint32_t d = 1; d < g.ws; d <<= 1) {
      const int64_t y = arch::shfl(x, g.lane >= d ? g.lane - d : g.lane);
      if (g.lane >= d) x += y;
    }
    if (i < n) out(i, run + x - c);
    run += arch::shfl(x, g.ws - 1);
  }
  return run;
}

// Warp-collective: the sum of v over the warp's lanes, on every lane (log2(ws) shuffles).
template <class T>
GPUNET_DEVICE T warp_sum(const Geo& g, T v) {
  for (uint32_t off = 1; off < g.ws; off <<= 1) v += arch::shfl(v, g.lane ^ off);
  return v;
}

GPUNET_DEVICE const DevCtx& peer_ctx(const LlParams& P, uint32_t p) {
  return ptr<const DevCtx>(P.ctxs)[p];
}
// Block-collective: v stored into `word` (a symmetric word, this rank's copy) at every other
// rank j with pick(j) that this rank maps, then a system fence. A store through the mapping, not
// put_signal_nbi: its callers revoke what a peer may no longer use once a wait on that peer
// failed, and the verbs refuse such a peer. Unmapped peers are skipped (they never store in place).
template <class Pick>
GPUNET_DEVICE void store_at_mapped_peers(const LlParams& P, const Geo& g, uint64_t* word, uint64_t v, Pick pick) {
  for (uint32_t j = g.tid; j < P.nranks; j += g.bdim) {
    if (j == P.rank || !pick(j)) continue;
    uint64_t* m = static_cast<uint64_t*>(gpunet::ptr(peer_ctx(P, j), word, int(j)));
    if (m) arch::atomic_store(m, v);
  }
  arch::fence_sys();
}
GPUNET_DEVICE uint64_t* sig_word(const LlParams& P, uint32_t kind, uint32_t b, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(kind * 2 + b) * P.nranks + j);
}
GPUNET_DEVICE uint64_t* expected_word(const LlParams& P, uint32_t kind, uint32_t b, uint32_t j) {
  return ptr<uint64_t>(P.expected) + (uint64_t(kind * 2 + b) * P.nranks + j);
}
GPUNET_DEVICE uint64_t* barrier_sig(const LlParams& P, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(4) * P.nranks + j);
}
// hb[j]: rank j's heartbeat (the time of its last beat, SET by j; see Beat below)
GPUNET_DEVICE uint64_t* ll_hb(const LlParams& P, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(5) * P.nranks + j);
}
// Self traffic: the counts seen, and the counters the send phase adds to (device memory).
GPUNET_DEVICE uint64_t* self_expected(const LlParams& P, uint32_t kind, uint32_t b) {
  return ptr<uint64_t>(P.expected) + (uint64_t(4) * P.nranks + kind * 2 + b);
}
GPUNET_DEVICE uint64_t* self_sig(const LlParams& P, uint32_t kind, uint32_t b) {
  return ptr<uint64_t>(P.expected) + (uint64_t(4) * P.nranks + 4 + kind * 2 + b);
}
// The dispatch / combine signals are SET, not ADD: the value is this rank's count of the signals
// of that (kind, buffer) it raised on d, kept here (after the self words). The c500 profile's p2p
// peers take stores only (transport/p2p.cuh: an ADD to one is refused), so an ADD made EP over
// p2p impossible there; over p2p a SET is one release store (an ADD: fence, load, CAS), over a NIC
// an 8-byte WRITE. (On the H200 the last block's signal phase did not get shorter with it:
// bench/RESULTS.md, eleventh session, call 2.)
GPUNET_DEVICE uint64_t* sent_word(const LlParams& P, uint32_t kind, uint32_t b, uint32_t d) {
  return ptr<uint64_t>(P.expected) + (uint64_t(4) * P.nranks + 8 + uint64_t(kind * 2 + b) * P.nranks + d);
}
GPUNET_DEVICE uint64_t* sync_word(const LlParams& P, uint32_t w) {
  return ptr<uint64_t>(P.sync) + uint64_t(w) * kSyncStride;
}

// A peer that is masked, or that failed a verb earlier, gets no posts and no waits. Both words
// are loaded before either is tested (two loads in flight, not two round trips in a row).
GPUNET_DEVICE bool peer_out(const LlParams& P, uint32_t p) {
  const uint32_t m = arch::atomic_load(ptr<uint32_t>(P.mask) + p);
  const uint32_t f = arch::atomic_load(ptr<uint32_t>(P.failed) + p);
  return (m | f) != 0;
}
GPUNET_DEVICE void peer_fail(const LlParams& P, uint32_t p) {
  arch::atomic_store(ptr<uint32_t>(P.failed) + p, 1u);
  if (P.flags & F_SHRINK) arch::atomic_store(ptr<uint32_t>(P.mask) + p, 1u);
  if (P.host_flags) arch::store_release_sys(ptr<uint32_t>(P.host_flags) + 1 + p, 1u);
}

// Phase stamp of this block (LlParams::prof; bench/ep_profile.py reads them).
GPUNET_DEVICE void stamp(const LlParams& P, const Geo& g, uint32_t which) {
  if (P.prof && g.tid == 0) ptr<uint64_t>(P.prof)[uint64_t(g.bid) * kStamps + which] = arch::now_ns();
}

// A stamp once the whole block got there (a block barrier, only when profiling: P.prof is the
// same for every thread, so the barrier is uniform).
GPUNET_DEVICE void stamp_after_block(const LlParams& P, const Geo& g, uint32_t which) {
  if (!P.prof) return;
  arch::syncthreads();
  stamp(P, g, which);
}

// The hot loops (a post per token and destination) read peer_out from a copy in shared memory
// (one byte per peer, the launch's dynamic shared memory): mask and failed live in host-mapped
// memory on GPUs (the host reads them without a device sync), where every read crosses PCIe. A
// peer that fails during the launch is marked in the copy of the block that saw it; other blocks
// keep posting to it until their verbs fail fast on its own Status (harmless).
// Dynamic shared memory: the peer view (one byte per peer, 16-byte rounded), then 16 bytes per
// peer for the controllers (smem_ctl_bytes; ep_ll.cu sizes it): the combine's receive controller
// keeps int64 [R] per-source row counts there; a send keeps its [R] header slots (header_slots)
// there, then its [R] mapped-peer table (mapped_table).
GPUNET_HOST_DEVICE uint32_t smem_view_bytes(uint32_t nranks) { return (nranks + 15) / 16 * 16; }
GPUNET_HOST_DEVICE uint32_t smem_ctl_bytes(uint32_t nranks) { return 16 * nranks; }

GPUNET_DEVICE uint8_t* load_peer_view(const LlParams& P, const Geo& g) {
  uint8_t* v = arch::shared_mem();
  for (uint32_t p = g.tid; p < P.nranks; p += g.bdim) v[p] = peer_out(P, p) ? 1 : 0;
  arch::syncthreads();
  return v;
}

// A send's table of the mapped peers, per block: gpunet::ptr of the anchor P.sig (a heap address)
// on peer p, 0 for a peer that is not mapped (a NIC peer) and for this rank. gpunet::ptr maps a
// peer's whole heap as one range, so symmetric `sym` is at mapped[p] + (sym - P.sig) there: the
// row loops add an offset (mapped_at) instead of calling gpunet::ptr per token and destination,
// each call a chain of dependent loads (the peer's context, then its descriptor) in front of the
// row's stores. Thread p loads it with p's view word, its loads in flight with the mask and failed
// words' (load_send_view: one barrier for both).
GPUNET_DEVICE uint64_t* mapped_table(const LlParams& P) {
  return reinterpret_cast<uint64_t*>(arch::shared_mem() + smem_view_bytes(P.nranks) + 8 * P.nranks);
}
GPUNET_DEVICE uint8_t* load_send_view(const LlParams& P, const Geo& g) {
  uint8_t* v = arch::shared_mem();
  uint64_t* m = mapped_table(P);
  for (uint32_t p = g.tid; p < P.nranks; p += g.bdim) {
    void* a = p == P.rank ? nullptr : gpunet::ptr(peer_ctx(P, p), ptr<const void>(P.sig), int(p));
    v[p] = peer_out(P, p) ? 1 : 0;
    m[p] = uint64_t(uintptr_t(a));
  }
  arch::syncthreads();
  return v;
}
// Where symmetric `sym` (an address of this rank's heap) is on mapped peer d, or 0 (not mapped).
GPUNET_DEVICE uint64_t mapped_at(const LlParams& P, uint32_t d, uint64_t sym) {
  const uint64_t b = mapped_table(P)[d];
  return b ? b + (sym - P.sig) : 0;
}
GPUNET_DEVICE void peer_fail_view(const LlParams& P, uint8_t* view, uint32_t p) {
  view[p] = 1;
  peer_fail(P, p);
}

GPUNET_DEVICE bool ep_failed(const LlParams& P) {
  return arch::atomic_load(&ptr<EpStatus>(P.status)->code) != 0;
}
GPUNET_DEVICE void ep_fail(const LlParams& P, uint32_t code, uint32_t site, uint32_t peer,
                           uint64_t expected, uint64_t observed, uint64_t waited) {
  EpStatus* s = ptr<EpStatus>(P.status);
  if (arch::atomic_cas(&s->code, uint64_t(0), uint64_t(code)) != 0) return;
  arch::store_relaxed(&s->op, P.op);
  arch::store_relaxed(&s->site, site);
  const Geo g = geo();
  arch::store_relaxed(&s->block, g.bid);
  arch::store_relaxed(&s->peer, peer);
  arch::store_relaxed(&s->expected, expected);
  arch::store_relaxed(&s->observed, observed);
  arch::store_relaxed(&s->waited_ns, waited);
  arch::store_release_sys(&s->valid, uint64_t(1));
  arch::store_release_sys(ptr<uint32_t>(P.status_flag), 1u);
  if (P.host_flags) arch::store_release_sys(ptr<uint32_t>(P.host_flags), 1u);
}

// The fence of the grid-internal hand-offs (a flag or count that one block sets and others read,
// publishing what it wrote before): system scope, since those writes include staging and headers
// a NIC reads later (a block's later fence_sys before a post does not make ANOTHER block's
// earlier stores visible to the NIC unless the hand-off was system-scope too); device scope
// (fence_gpu) under F_GPU_SCOPE, where every reader is an SM of this GPU (p2p peers on this GPU,
// this rank itself). A system fence waits for every outstanding store of the thread to be
// acknowledged system-wide: ~1-2 us each on the H200 (bench/RESULTS.md "Where the EP LL time
// went": the last block's headers, ~8 us, were four of them). HOST: both are one fence, so
// tests/test_ep_ll.py covers the protocol; the flag's choice is tested there
// (test_ll_flags_name_the_world).
GPUNET_DEVICE void grid_fence(const LlParams& P) {
  if (P.flags & F_GPU_SCOPE) arch::fence_gpu();
  else arch::fence_sys();
}

// Polls of a grid-internal word spin without backing off for the first kHotSpins reads: the
// hand-offs are short (a block waits for block 0's quiet or tables, ~microseconds), and a 64 ns
// sleep per read adds up to the sleep's granularity to every hand-off. Then spin_pause (leaves issue slots
// to the other blocks; on the HOST arm it yields, so the emulator's threads progress).
constexpr uint32_t kHotSpins = 256;

// Bounded wait until *word >= target (another block's flag or arrival count), then acquire.
GPUNET_DEVICE bool grid_wait(const LlParams& P, uint64_t* word, uint64_t target, uint32_t site) {
  uint64_t t0 = 0;
  uint32_t n = 0;
  uint64_t v = arch::atomic_load(word);
  while (v < target) {
    if ((n & 7) == 0) {
      if (ep_failed(P)) return false;
      const uint64_t now = arch::now_ns();
      if (t0 == 0) t0 = now;
      if (now - t0 > P.timeout_ns) {
        ep_fail(P, EP_ERR_GRID_WAIT, site, 0, target, v, now - t0);
        return false;
      }
    }
    if (++n > kHotSpins) arch::spin_pause();
    v = arch::atomic_load(word);
  }
  grid_fence(P);
  return true;
}

// The whole block waits for a flag that one block set; every thread gets the same answer.
GPUNET_DEVICE bool block_wait(const LlParams& P, const Geo& g, uint32_t w, uint64_t target,
                              uint32_t site) {
  bool ok = true;
  if (g.tid == 0) ok = grid_wait(P, sync_word(P, w), target, site);
  const bool bad = arch::block_any(!ok);
  if (!bad) grid_fence(P);
  return !bad;
}

// Block 0 publishes what it computed (after a syncthreads) to the other blocks.
GPUNET_DEVICE void block_publish(const LlParams& P, const Geo& g, uint32_t w) {
  arch::syncthreads();
  if (g.tid == 0) {
    grid_fence(P);
    arch::atomic_store(sync_word(P, w), uint64_t(1));
  }
}

// Every block calls it once when it has finished a phase. True in the one block that arrives
// last: every other block's posts are reserved (and published) before anything it posts next,
// and their reads of this launch's shared words are over.
GPUNET_DEVICE bool last_block(const LlParams& P, const Geo& g, uint32_t w) {
  arch::syncthreads();
  uint64_t old = 0;
  if (g.tid == 0) {
    grid_fence(P);
    old = arch::atomic_add(sync_word(P, w), uint64_t(1));
  }
  const bool last = arch::block_any(g.tid == 0 && old + 1 == g.nblocks);
  if (last) grid_fence(P);
  return last;
}

// The block has finished what sync word w counts (its stores published to whoever waits for
// the count; nothing waited for here).
GPUNET_DEVICE void grid_arrive(const LlParams& P, const Geo& g, uint32_t w) {
  arch::syncthreads();
  if (g.tid == 0) {
    grid_fence(P);
    arch::atomic_add(sync_word(P, w), uint64_t(1));
  }
}

// Grid barrier inside a launch: arrive, then wait for every block.
GPUNET_DEVICE bool grid_barrier(const LlParams& P, const Geo& g, uint32_t w, uint32_t site) {
  grid_arrive(P, g, w);
  return block_wait(P, g, w, g.nblocks, site);
}

// Reset the sync words of a launch (the last block, when nobody reads them any more).
GPUNET_DEVICE void reset_sync(const LlParams& P, const Geo& g, uint32_t first, uint32_t last_incl) {
  arch::syncthreads();
  if (g.tid == 0)
    for (uint32_t w = first; w <= last_incl; ++w) arch::atomic_store(sync_word(P, w), uint64_t(0));
}

// Block 0: complete every live peer's earlier operations (the staging they read is reused next).
// Nothing to complete when every other peer is mapped (F_ALL_MAPPED): a p2p put has copied its
// bytes when it returns, this rank's own traffic never goes through a NIC, and the signals order
// what the peers read; the loop (mask, failed and the peer's descriptor loaded, then a fence) was
// ~3.5 us at the head of block 0's send in the H200 profile, before anything else could start.
GPUNET_DEVICE void quiet_live_peers(const LlParams& P, const Geo& g) {
  if (P.flags & F_ALL_MAPPED) return;
  for (uint32_t p = g.tid; p < P.nranks; p += g.bdim)
    if (!peer_out(P, p) && !quiet_pe(peer_ctx(P, p), int(p))) peer_fail(P, p);
}

// ---- heartbeats: a live peer that waits out a dead rank is not taken for dead ----------------
// Bounds alone cannot tell a dead peer from a live one that is itself waiting out a dead third
// rank. A rank whose dispatch waits a whole bound for a dead source enters combine one bound
// late; a survivor that got everything went into combine at once, and its bound on that rank
// ran out first whenever the late one's way from dispatch to combine was a little longer than
// its own: it masked a LIVE rank and left its experts out of combine (tests/test_ep_ll.py
// test_a_rank_late_from_waiting_out_a_dead_one_is_not_masked; a longer fixed bound only scales
// the race, since the wait on the dead rank grows with it). So a rank that waits also says it is
// alive: it SETs its word hb[rank] on every live peer, at most once a period (heartbeat), and a
// bound that runs out on peer d is final only when d's word has not moved (silent). The first
// time, d's word is read and d gets two more periods; after that every move of it grants d
// another bound, up to `cap` from the wait's start, so every wait stays bounded. A dead rank
// beats no more: it is masked two periods (half a bound) later than a bound. Nothing is read or
// sent while peers answer in time. Both modes use them (ht.cuh: ht_beat).
struct Beat {
  uint64_t* words;  // hb[R] in this rank's heap, the same offset on every rank
  uint64_t* last;   // device word: the time of this rank's last beat (one beat a period)
  uint64_t period;  // between two beats of this rank
  uint64_t cap;     // the longest a wait extends on a peer that keeps beating (from its start)
};
constexpr uint64_t kHbSeen = 1ull << 63;  // a heartbeat word as read (0 = not read yet)

// The one thread that wins the rank's time word SETs hb[rank] on every live peer to the time (any
// value that moves would do). From idle waits only: a call within the period costs one device
// load and the clock read the caller made. `out`: the block's view of the peers out (or null). A
// failed put is left to the waits (the peer's own Status fails its next verb).
GPUNET_DEVICE void heartbeat(const LlParams& B, const Beat& b, uint64_t now, const uint8_t* out) {
  const uint64_t prev = arch::atomic_load(b.last);
  if (now - prev < b.period || arch::atomic_cas(b.last, prev, now) != prev) return;
  uint64_t* w = b.words + B.rank;
  for (uint32_t p = 0; p < B.nranks; ++p)
    if (p != B.rank && !(out && out[p]) && !peer_out(B, p))
      (void)put_signal_nbi(peer_ctx(B, p), w, w, 0, w, now | 1, int(p), SIGNAL_SET);
}

// Peer d has made no progress for `bound` since *tlast (now). Is it silent? (see above; *seen is
// d's word as last read, *tlast where d's current bound started). true: the caller marks d failed.
GPUNET_DEVICE bool silent(const LlParams& B, const Beat& b, uint32_t d, uint64_t* seen,
                          uint64_t* tlast, uint64_t bound, uint64_t now, uint64_t t_start) {
  const uint64_t v = signal_read(peer_ctx(B, d), b.words + d) | kHbSeen;
  if (*seen == 0) {
    *seen = v;
    *tlast = now - bound + 2 * b.period;
    return false;
  }
  if (v == *seen || now - t_start > b.cap) return true;
  *seen = v;
  *tlast = now;
  return false;
}

// The LL kernels' heartbeats: a period of a quarter of the per-peer bound T, a cap of 3 T (a live
// peer is late by at most its own wait on a dead rank, 1.5 T); LlParams::timeout_ns, the bound of
// the grid-internal waits (other blocks wait for block 0's), is above it (host: 4 T + 1 s).
// `t`: the per-peer bound (the same in every ctxs[p]: gpunet/ep/buffer.py), so no load here.
GPUNET_DEVICE Beat ll_beat(const LlParams& P, uint64_t t) {
  return Beat{ll_hb(P, 0), ptr<uint64_t>(P.expected) + (uint64_t(8) * P.nranks + 9), t / 4, 3 * t};
}

// Bounded wait until source j's word `w` (in this rank's heap, SET by j) is >= want: gpunet.cuh's
// wait_until with the bound extended while j beats (above), the timeout recorded in j's Status as
// wait_until records it (the host names the word), and this rank's own beats from its idle polls.
// `wt`: j's Waiter (api::waiter of its context: the per-peer bound); `b`: the mode's heartbeats
// (the LL kernels: ll_beat, the overload below; HT's notify: ht.cuh ht_beat).
GPUNET_DEVICE bool wait_peer(const LlParams& P, uint32_t j, const uint64_t* w, uint64_t want,
                             const Waiter& wt, const Beat& b) {
  const DevCtx& cx = peer_ctx(P, j);
  uint64_t t_start = 0, tlast = 0, seen = 0;
  for (uint32_t n = 0;; ++n) {
    const uint64_t v = signal_read(cx, w);
    if (v >= want) return true;
    if (n % kCheckEvery == 0) {
      if (failed(wt)) return false;
      const uint64_t now = arch::now_ns();
      if (t_start == 0) t_start = tlast = now;
      if (n >= kWaitFastPolls) heartbeat(P, b, now, nullptr);
      if (now - tlast > wt.timeout_ns && silent(P, b, j, &seen, &tlast, wt.timeout_ns, now, t_start)) {
        Failure f(STATUS_TIMEOUT, SITE_NONE);
        api::describe_wait(f, cx, w, CMP_GE, want);
        f.observed = v;
        f.waited_ns = now - t_start;
        record_failure(wt.st, f);
        return false;
      }
    }
    if (n >= kWaitFastPolls) arch::spin_pause();
  }
}
GPUNET_DEVICE bool wait_peer(const LlParams& P, uint32_t j, const uint64_t* w, uint64_t want) {
  const Waiter wt = api::waiter(peer_ctx(P, j));
  return wait_peer(P, j, w, want, wt, ll_beat(P, wt.timeout_ns));
}

// Bounded wait for source j's signal of kind/buffer to pass the count this rank expects; adds
// the wait to the stats. true: the header and data it announces are visible (acquire).
GPUNET_DEVICE bool wait_source(const LlParams& P, uint32_t kind, uint32_t j) {
  const bool self = j == P.rank;
  uint64_t* exp = self ? self_expected(P, kind, P.buf) : expected_word(P, kind, P.buf, j);
  const uint64_t want = *exp + 1;
  const uint64_t t0 = arch::now_ns();
  // self: a block of this launch (or of the send launch before a hook) adds to a device counter
  const bool ok = self ? grid_wait(P, self_sig(P, kind, P.buf), want, EP_SITE_SELF)
                       : wait_peer(P, j, sig_word(P, kind, P.buf, j), want);
  const uint64_t waited = arch::now_ns() - t0;
  // A SET signal carries the source's own count (sent_word), which can run ahead of what this
  // rank expected (a signal it stopped waiting for, counted by the source): the count seen is
  // adopted, so a later wait is never satisfied by an earlier launch's value.
  uint64_t seen = want;
  if (ok && !self) {
    const uint64_t v = signal_read(peer_ctx(P, j), sig_word(P, kind, P.buf, j));
    seen = v > want ? v : want;
  }
  if (P.wait_stats) {
    int64_t* ws = ptr<int64_t>(P.wait_stats) +
                  ((P.flags & F_WAIT_STATS_2D) ? uint64_t(P.rank) * P.nranks + j : j);
    *ws += int64_t(waited);
  }
  if (ok) *exp = seen;
  else peer_fail(P, j);
  return ok;
}

// Before a header's put_signal: fence() orders the block's header stores (and, cumulatively,
// what the grid handed to this block) before the post, for a NIC that reads them from memory.
// Under F_GPU_SCOPE every peer is p2p on this GPU: the put_signal copies the header itself
// (this thread's loads after the block barrier) and releases the signal at device scope
// (transport/p2p.cuh signal_release), so the system fence (~1-2 us on the H200) is not needed.
GPUNET_DEVICE bool header_fence(const LlParams& P, const DevCtx& cx) {
  return (P.flags & F_GPU_SCOPE) ? true : fence(cx);
}

// Header words 2..7 (both directions): what the receiver checks against its own call.
GPUNET_DEVICE void fill_header_tail(const LlParams& P, int32_t* h) {
  h[2] = int32_t(P.hidden);
  h[3] = int32_t(P.num_experts);
  h[4] = int32_t(P.msg_stride);
  h[5] = int32_t(P.t_max);
  h[6] = 0;
  h[7] = 0;
}
GPUNET_DEVICE bool header_matches(const LlParams& P, const int32_t* h, uint32_t peer) {
  if (uint32_t(h[2]) == P.hidden && uint32_t(h[3]) == P.num_experts &&
      uint32_t(h[4]) == P.msg_stride && uint32_t(h[5]) == P.t_max)
    return true;
  // expected / observed: (experts, hidden) packed; the host prints all four from the header
  ep_fail(P, EP_ERR_MISMATCH, EP_SITE_HEADER, peer, (uint64_t(P.num_experts) << 32) | P.hidden,
          (uint64_t(uint32_t(h[3])) << 32) | uint32_t(h[2]), 0);
  return false;
}

// The header this rank fills for destination d: its own receive slot for itself (rhdr: the
// receive headers of this op, slot `rank` on every rank), the same slot ON a mapped peer (the
// block stores the header there itself, and the signal then carries no payload: copying it
// from staging was one thread's chain of ~10 dependent 16-byte loads before every signal, most of
// the last block's ~7 us in the H200 profile), or the staging slot (shdr) a NIC peer's put reads.
GPUNET_DEVICE int32_t* header_slot(const LlParams& P, uint64_t rhdr, uint64_t shdr, uint32_t d) {
  const uint64_t mine = rhdr + uint64_t(P.rank) * P.hdr_stride;
  if (d == P.rank) return ptr<int32_t>(mine);
  if (void* m = gpunet::ptr(peer_ctx(P, d), ptr<const void>(mine), int(d))) return static_cast<int32_t*>(m);
  return ptr<int32_t>(shdr + uint64_t(d) * P.hdr_stride);
}

// A send's header slots, found by every block BEFORE last_block's fences (a peer mapping is a
// chain of dependent loads, and after a fence each misses L1): int32_t* [R] in the controllers'
// shared memory (smem_ctl_bytes), null for a destination out of this block's view. The
// syncthreads of last_block orders them for the block.
GPUNET_DEVICE int32_t** header_slots(const LlParams& P, const Geo& g, uint64_t rhdr, uint64_t shdr,
                                     const uint8_t* out) {
  int32_t** hs = reinterpret_cast<int32_t**>(arch::shared_mem() + smem_view_bytes(P.nranks));
  for (uint32_t d = g.tid; d < P.nranks; d += g.bdim)
    hs[d] = out[d] ? nullptr : header_slot(P, rhdr, shdr, d);
  return hs;
}

// What a send's last block needs for its header to destination d that does not change in the
// launch: the header slot, whether there is nothing to send (d out in this block's view or in
// the mask / failed words, host-mapped: a PCIe read on GPUs), a PeerRef and the count last raised
// on d (sent_word: only the last block writes it, once a launch). Each last block loads its
// destinations' BEFORE last_block's fences (header_pre): after them every such load was one more
// round trip on the last block's chain, the headers waiting for ~9 in a row (dispatch hdr.s
// ~5.5 us on the H200, combine ~5.8). A peer failing meanwhile is seen by its put (its own
// Status) or masked by the next launch. header_pre finds the slot itself rather than reading
// header_slots' entry: warp d loads it before last_block's barrier, the one that orders that
// entry (another warp's store) for the block.
struct HeaderPre {
  int32_t* h = nullptr;
  bool skip = true;
  PeerRef ref{{}, -1};
  uint64_t sent = 0;
};
GPUNET_DEVICE HeaderPre header_pre(const LlParams& P, uint32_t kind, uint64_t rhdr, uint64_t shdr,
                                   uint32_t d, const uint8_t* out) {
  HeaderPre x;
  x.skip = out[d] || peer_out(P, d);
  if (x.skip) return x;
  x.h = header_slot(P, rhdr, shdr, d);
  if (d != P.rank) {
    x.ref = peer_ref(peer_ctx(P, d), int(d));
    x.sent = *sent_word(P, kind, P.buf, d);
  }
  return x;
}

// One thread, destination d, after last_block (every row before the header handed over) and
// the header's other words, word 0 (n: the messages or rows to d) included: word 1 (h1) and the
// tail, then for d != rank the signal (kind, buf, rank) on d raised by one put_signal, which
// copies the header (`bytes`) from staging for a NIC peer and nothing for a mapped one
// (header_slot).
GPUNET_DEVICE void header_finish(const LlParams& P, uint32_t kind, uint64_t rhdr, uint64_t shdr,
                                 uint32_t d, const HeaderPre& x, int32_t h1, uint32_t bytes) {
  int32_t* h = x.h;
  h[1] = h1;
  fill_header_tail(P, h);
  if (d == P.rank) return;
  const DevCtx& cx = peer_ctx(P, d);
  const bool staged = h == ptr<const int32_t>(shdr + uint64_t(d) * P.hdr_stride);
  const uint64_t v = x.sent + 1;
  *sent_word(P, kind, P.buf, d) = v;  // (counted even when the put fails: the peer is failed then)
  if (!(header_fence(P, cx) &&
        put_signal_nbi(cx, ptr<void>(rhdr + uint64_t(P.rank) * P.hdr_stride), h, staged ? bytes : 0,
                       sig_word(P, kind, P.buf, P.rank), v, x.ref, SIGNAL_SET)))
    peer_fail(P, d);
}

// Send and receive in ONE launch (no hook), BF16 dispatch or any combine: the receive reads this
// rank's own rows straight from x (device memory on GPUs), which stays valid for the whole launch;
// with a hook the caller may reuse x after the send, so the send phase copies them.
GPUNET_DEVICE bool self_reads_source(const LlParams& P) {
  return (P.phases & PH_RECV) && (P.phases & PH_SEND) && (P.op == OP_COMBINE || !(P.flags & F_FP8));
}

// The last block of a send phase: this rank's own header and data (stored by the whole grid,
// ordered by last_block's fences) are announced to its receive phase.
GPUNET_DEVICE void announce_self(const LlParams& P, const Geo& g, uint32_t kind) {
  arch::syncthreads();
  if (g.tid == 0 && !peer_out(P, P.rank)) {
    grid_fence(P);
    arch::atomic_add(self_sig(P, kind, P.buf), uint64_t(1));
  }
}

// ---- dispatch -----------------------------------------------------------------------------------

// FP8: one lane quantises one 128-column group of a bf16 row (256 B, 16-byte aligned) into 128
// e4m3 bytes and a float scale, in 16-byte loads and stores: the staging it writes is
// host-mapped on GPUs, where single-byte stores each cross PCIe (measured on the H200: FP8
// dispatch 3.6x slower than BF16 with byte stores).
GPUNET_DEVICE float bf16_at(const V16& v, uint32_t q) {
  return bf16_to_f32(uint16_t((q < 4 ? v.a : v.b) >> (16 * (q & 3))));
}
// The larger of amax and the largest magnitude among v's 8 bf16 values. Both quantisers
// (quantise_group, fp8_to_destinations) use it and e4m3x16, so their scales and bytes agree.
GPUNET_DEVICE float amax8(const V16& v, float amax) {
  for (uint32_t i = 0; i < 8; ++i) {
    const float a = bits_f32(f32_bits(bf16_at(v, i)) & 0x7fffffffu);
    amax = a > amax ? a : amax;
  }
  return amax;
}
// 16 bf16 values (lo's 8, then hi's) divided by the group's scale s, as 16 e4m3 bytes in the same
// order (the first in the low byte of .a): one 16-byte store, not 16 single-byte ones (above).
GPUNET_DEVICE V16 e4m3x16(const V16& lo, const V16& hi, float s) {
  V16 o = {0, 0};
  for (uint32_t i = 0; i < 8; i += 2) {
    o.a |= uint64_t(f32x2_to_e4m3x2(bf16_at(lo, i) / s, bf16_at(lo, i + 1) / s)) << (8 * i);
    o.b |= uint64_t(f32x2_to_e4m3x2(bf16_at(hi, i) / s, bf16_at(hi, i + 1) / s)) << (8 * i);
  }
  return o;
}
GPUNET_DEVICE void quantise_group(const uint16_t* src, uint8_t* q, float* scale, bool round) {
  const V16* in = reinterpret_cast<const V16*>(src);
  float amax = 0.0f;
  for (uint32_t c = 0; c < kGroup / 8; ++c) amax = amax8(in[c], amax);
  const float s = group_scale(amax, round);
  V16* out = reinterpret_cast<V16*>(q);
  for (uint32_t c = 0; c < kGroup / 16; ++c) out[c] = e4m3x16(in[2 * c], in[2 * c + 1], s);
  *scale = s;
}

// The dispatch header to destination d, in u32 words: kHdrHead head words, E_loc counts, the
// slot bitmap (bit t % 32 of word t / 32: slot t holds a message of this launch), then from
// word ebits_word0 (8-byte aligned) u64 [E_loc][dmask_words(t_max)]: per local expert q and word
// w, the low half bits t of q's selections in w and the high half the count of q's selections
// before word w. The position of t among q's tokens is then one load and one popcount.
GPUNET_HOST_DEVICE uint32_t dmask_words(uint32_t t_max) { return (t_max + 31) / 32; }
GPUNET_HOST_DEVICE uint32_t ebits_word0(uint32_t e_loc, uint32_t t_max) {
  return (kHdrHead + e_loc + dmask_words(t_max) + 1) / 2 * 2;
}
GPUNET_HOST_DEVICE uint32_t dispatch_hdr_words(uint32_t e_loc, uint32_t t_max) {
  return ebits_word0(e_loc, t_max) + 2 * e_loc * dmask_words(t_max);
}

// The dispatch send's bitmaps (LlParams::bits, device memory), u32: [E][dmask_words(t_max)] bit
// t = token t selected expert e, then [R][dmask_words(t_max)] bit t = token t goes to rank d. The
// warps or into them (nothing returned, nothing waited for); the send's last block turns them
// into the headers and zeroes them: zero between launches (gpunet/ep/buffer.py zeroes them after
// a launch that failed half way).
GPUNET_DEVICE uint32_t* expert_bits(const LlParams& P, uint32_t e) {
  return ptr<uint32_t>(P.bits) + uint64_t(e) * dmask_words(P.t_max);
}
GPUNET_DEVICE uint32_t* dmask_row(const LlParams& P, uint32_t d) {
  return expert_bits(P, P.num_experts + d);
}

// Step 3's row: bf16 copied, or fp8 quantised with its scales, into the token's send slot.
GPUNET_DEVICE void stage_row(const LlParams& P, const Geo& g, uint32_t t) {
  const uint32_t H = P.hidden;
  const uint64_t msg = P.d_send + uint64_t(t) * P.msg_stride;
  const uint64_t row = P.x + uint64_t(t) * H * 2;
  if (P.flags & F_FP8) {
    const bool round = (P.flags & (F_ROUND_SCALE | F_UE8M0)) != 0;
    for (uint32_t grp = g.lane; grp < H / kGroup; grp += g.ws)
      quantise_group(ptr<const uint16_t>(row) + grp * kGroup, ptr<uint8_t>(msg) + grp * kGroup,
                     ptr<float>(msg + H) + grp, round);
  } else {
    warp_copy(g, msg, row, uint64_t(H) * 2);
  }
}

constexpr uint32_t kCombineParts = 4;  // combine_send: parts of an item when every peer is mapped
constexpr uint32_t kRowParts = 4;      // dispatch: at most this many warps per row

// Warps per row of a dispatch send (unstaged) or receive: the `warps` over the n rows,
// 1..kRowParts (the same for every warp of the launch).
GPUNET_DEVICE uint32_t row_parts(uint32_t warps, uint64_t n) {
  const uint64_t s = n ? warps / n : 1;
  return s < 1 ? 1 : (s > kRowParts ? kRowParts : uint32_t(s));
}

// Every peer other than this rank is mapped here (gpunet::ptr: p2p), so a BF16 row can go from
// x straight to each destination, unstaged. (Masked peers count too: every block must get the
// same answer, and mask words may change during the launch.) The host says so (F_ALL_MAPPED,
// gpunet/ep/buffer.py from the peers' transports): walking the R peer descriptors here was a
// chain of dependent loads at the start of every block. A wrong flag cannot pass the mixed-world
// tests: a NIC peer would then be sent unstaged send slots.
GPUNET_DEVICE bool all_peers_mapped(const LlParams& P) { return (P.flags & F_ALL_MAPPED) != 0; }

// Lane k < K of the warp: selection k of token t, its expert `e` (-1 for a hole and for a repeat
// of an earlier selection: a token counts once per expert) and that expert's rank `d` (-1 for a
// hole); returns the ballot of the lanes whose selection is the token's first on its rank. From
// topk_idx alone: nothing waits for a plan.
struct Selection {
  int32_t e = -1;
  int32_t d = -1;
  uint64_t first = 0;
};
GPUNET_DEVICE Selection token_selections(const LlParams& P, const Geo& g, uint32_t t) {
  const uint32_t K = P.topk;
  Selection s;
  if (g.lane < K) {
    const int64_t e = ptr<const int64_t>(P.topk_idx)[uint64_t(t) * K + g.lane];
    if (e >= 0 && e < int64_t(P.num_experts)) {
      s.e = int32_t(e);
      s.d = int32_t(uint32_t(e) / P.e_loc);
    }
  }
  bool first = s.d >= 0, repeat = false;
  for (uint32_t k = 0; k < K; ++k) {  // an earlier selection of the same expert / rank
    const int32_t ek = arch::shfl(s.e, k), dk = arch::shfl(s.d, k);
    if (k < g.lane && dk == s.d) first = false;
    if (k < g.lane && ek == s.e) repeat = true;
  }
  if (repeat) s.e = -1;
  s.first = arch::ballot(first);
  return s;
}

// Message slot of token t from this rank on any destination: slot t of this rank's area.
GPUNET_DEVICE uint64_t dispatch_slot(const LlParams& P, uint32_t t) {
  return P.d_recv + (uint64_t(P.rank) * P.t_max + t) * P.msg_stride;
}

// Row i of the dispatch send's bitmaps into its header (one thread): i < E is (destination
// i / EL, local expert i % EL): its words with the running count of the bits before each, and its
// count; E + d is d's slot bitmap: its words and its popcount, the message count (header word 0).
// A destination out of the block's view (hs null) gets nothing. The row goes back to zero for
// the next launch. The words are loaded in one batch before any store (a header store may alias
// the next load: one memory latency per word otherwise).
constexpr uint32_t kFillBatch = 4;  // words a batch: DeepEP's 128 tokens are one
GPUNET_DEVICE void fill_header_row(const LlParams& P, int32_t* const* hs, uint32_t i, uint32_t TW) {
  const uint32_t E = P.num_experts, EL = P.e_loc, W = dmask_words(P.t_max);
  const uint32_t e0w = ebits_word0(EL, P.t_max);
  uint32_t* row = expert_bits(P, i);
  int32_t* h = hs[i < E ? i / EL : i - E];
  uint32_t run = 0;
  for (uint32_t w0 = 0; w0 < TW; w0 += kFillBatch) {
    uint32_t v[kFillBatch];
#pragma unroll
    for (uint32_t u = 0; u < kFillBatch; ++u) v[u] = w0 + u < TW ? row[w0 + u] : 0u;
#pragma unroll
    for (uint32_t u = 0; u < kFillBatch; ++u) {
      const uint32_t w = w0 + u;
      if (w >= TW) break;
      if (h && i < E)
        (reinterpret_cast<uint64_t*>(h + e0w) + uint64_t(i % EL) * W)[w] = uint64_t(v[u]) | (uint64_t(run) << 32);
      else if (h)
        h[kHdrHead + EL + w] = int32_t(v[u]);
      run += popc64(v[u]);
      if (v[u]) row[w] = 0;
    }
  }
  if (h) h[i < E ? kHdrHead + i % EL : 0] = int32_t(run);
}

// The end of dispatch's send, in every block: once every block's bits are in (dispatch_bits;
// they were set before the rows, so nobody waits here in practice), each block turns a few rows
// of the bitmaps into the headers (fill_header_row: row i in block i % nblocks), then the block
// that arrives last (every other block's rows, metas, puts and header words are ordered before
// it) finishes the headers and puts one signal per destination. One last block filling all of
// the E + R rows (DeepEP's 290 on 2 ranks) took 6-15 us on the H200 after the other blocks were
// done (bench/RESULTS.md, fifteenth session: hdr.f); spread over the grid the rows are filled by
// each block after its own rows, in parallel. Every block finds its header slots (peer mappings:
// dependent loads) and each destination's HeaderPre before last_block's fences.
GPUNET_DEVICE bool dispatch_send_last(const LlParams& P, const Geo& g, const uint8_t* out) {
  const uint32_t T = P.num_tokens, EL = P.e_loc, R = P.nranks;
  int32_t** hs = header_slots(P, g, P.d_rhdr, P.d_shdr, out);
  // warp w loads destination w's HeaderPre
  const uint32_t d0 = g.wid;
  HeaderPre pre0;
  if (d0 < R) pre0 = header_pre(P, SIG_DISPATCH, P.d_rhdr, P.d_shdr, d0, out);
  // (block_wait's barrier orders hs for the block)
  if (!block_wait(P, g, SYNC_SEND_BITS, g.nblocks, EP_SITE_BITS)) return false;
  const uint32_t nrows = P.num_experts + R, TW = (T + 31) / 32;  // words of slots t < T
  for (uint64_t i = g.bid + uint64_t(g.tid) * g.nblocks; i < nrows; i += uint64_t(g.bdim) * g.nblocks)
    fill_header_row(P, hs, uint32_t(i), TW);
  stamp_after_block(P, g, ST_FILLED);
  if (last_block(P, g, SYNC_SEND_DONE)) {
    stamp(P, g, ST_SEND_LAST);
    for (uint32_t d = g.wid; d < R; d += g.nwarps) {
      const HeaderPre x = d == d0 ? pre0 : header_pre(P, SIG_DISPATCH, P.d_rhdr, P.d_shdr, d, out);
      // hs[d] too: the view that filled d's rows in this block (null: they were not filled)
      if (g.lane == 0 && !x.skip && hs[d])
        header_finish(P, SIG_DISPATCH, P.d_rhdr, P.d_shdr, d, x, int32_t(T),
                      dispatch_hdr_words(EL, P.t_max) * 4);
    }
    stamp(P, g, ST_HDR_FILLED);
    stamp_after_block(P, g, ST_HDR_SIGNALED);
    announce_self(P, g, SIG_DISPATCH);
    reset_sync(P, g, SYNC_SEND_QUIET, SYNC_SEND_DONE);
    if (P.flags & F_DIRECT) reset_sync(P, g, SYNC_SEND_COUNTS, SYNC_SEND_COUNTS);
    stamp(P, g, ST_SEND_HDR);
  }
  return true;
}

// Dispatch's bitmaps, before any row moves: a warp per token sets, lane k, bit t of selection
// k's expert's token bitmap, and the lane of the token's first selection on a rank bit t of that
// rank's slot bitmap (atomic ors on device memory, nothing returned, nothing waited for); then
// the block arrives at SYNC_SEND_BITS (dispatch_send_last turns the bitmaps into the headers).
GPUNET_DEVICE void dispatch_bits(const LlParams& P, const Geo& g) {
  for (uint32_t t = g.gw; t < P.num_tokens; t += g.gwarps) {
    const Selection sel = token_selections(P, g, t);
    const uint32_t bit = 1u << (t % 32);
    if (sel.e >= 0) arch::atomic_or(&expert_bits(P, uint32_t(sel.e))[t / 32], bit);
    if ((sel.first >> g.lane) & 1) arch::atomic_or(&dmask_row(P, uint32_t(sel.d))[t / 32], bit);
  }
  grid_arrive(P, g, SYNC_SEND_BITS);
}


// The start of a send phase: block 0 quiets the live peers (the previous use of this LL buffer's
// staging is complete at the NIC before it is overwritten; a failure names the peer); with
// `stage` (a NIC peer: staging is written) the other blocks wait for it (a grid flag), else
// nobody waits: there is no plan. false: the wait failed (recorded).
GPUNET_DEVICE bool send_start(const LlParams& P, const Geo& g, bool stage) {
  if (g.bid == 0) {
    quiet_live_peers(P, g);
    stamp(P, g, ST_QUIET);
    if (stage && g.nblocks > 1) block_publish(P, g, SYNC_SEND_QUIET);
    arch::syncthreads();
  } else if (stage && !block_wait(P, g, SYNC_SEND_QUIET, 1, EP_SITE_QUIET)) {
    return false;
  }
  stamp(P, g, ST_SEND_PLAN);
  return true;
}

// ---- the direct dispatch (F_DIRECT) ------------------------------------------------------------
// The message path moves each token once per destination rank and the receiver then expands it
// into the packed layout: on one GPU the receiver's unpack writes as many bytes as the whole torch
// gather does, after the rows arrived (docs/EP.md "Where the low-latency time goes"). When every
// peer is mapped (p2p) and a destination's recv_x / src_info lie in its heap (the receive pool,
// F_DIRECT_RECV), the source can store each (token, local expert) row straight into its packed
// row there, if it knows where its rows start: begin_me(e) = sum over sources i < me of
// count_i(e). So a direct launch adds ONE round before the rows (the count round, block 0):
//   1. once every block's bits are in, block 0 counts its tokens per expert (and keeps each
//      bitmap word with the running count before it, dpre: the rows' positions are read there,
//      since the header fill zeroes the bitmaps while other blocks may still send);
//   2. it stores its count row (hidden, E, t_max, whether its recv_x is in its heap, where, then
//      the E counts) into every live peer's count area, row `me`, then SETs the row's tag there
//      (ctag_word: the control allocation, to the value its dispatch signal will carry);
//   3. it waits (bounded, heart-beating) for every live peer's row, computes begin_me(e) from the
//      rows of the sources before it, and stores those begins (the E_loc of each direct
//      destination) into that destination's "begins used" row `me`;
//   4. a grid flag; then every warp stores rows: to a direct destination at
//      out_x[le][begin_me(e) + idx_e(t)] (and t into src_info), to any other the message as before.
// The headers and signals follow as before (the same counts), and the receiver lays out as before;
// a direct receiver unpacks nothing. It checks that each source's begins used equal its own:
// where a source failed after its count row (its rows counted by the later sources, then never
// signalled) the later sources' rows sit above their places and are moved down (direct_compact);
// begins below this rank's (a source that left out a peer this rank counted: ranges overlap) fail
// the launch (EP_ERR_BAD_MESSAGE at EP_SITE_DIRECT) rather than return mixed rows.
// Off unless GPUNET_EP_LL_DIRECT=1 (gpunet/ep/buffer.py _ll_direct_ok): as first built it was ~25%
// slower than the messages on the H100 (the count round: 9-12 us before any row moves;
// bench/RESULTS.md, thirty-second session).
// The count area (the LL buffer's, after the R dispatch receive headers): [R] count rows of
// cnt_stride_words, then [R] "begins used" rows of bu_stride_words.
// A count row's head: hidden, E, t_max, direct, then int64 offsets from P.sig of recv_x, src_info
// and (FP8) the scales; then the E counts
constexpr uint32_t kCntHead = 16;
GPUNET_HOST_DEVICE uint32_t cnt_stride_words(uint32_t e) { return (kCntHead + e + 15) / 16 * 16; }
GPUNET_HOST_DEVICE uint32_t bu_stride_words(uint32_t e_loc) { return (e_loc + 15) / 16 * 16; }
GPUNET_DEVICE int32_t* cnt_row(const LlParams& P, uint32_t j) {
  return ptr<int32_t>(P.d_rhdr + uint64_t(P.nranks) * P.hdr_stride) + uint64_t(j) * cnt_stride_words(P.num_experts);
}
GPUNET_DEVICE int32_t* bu_row(const LlParams& P, uint32_t j) {
  return cnt_row(P, P.nranks) + uint64_t(j) * bu_stride_words(P.e_loc);
}
// The tag of source j's count row of this LL buffer (SET by j; the control allocation, which the
// user never scribbles on, unlike the RDMA buffer's areas).
GPUNET_DEVICE uint64_t* ctag_word(const LlParams& P, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(6 + P.buf) * P.nranks + j);
}
// Workspace after the dispatch bitmaps (LlParams::bits; gpunet/device/ep.py direct_ws_words):
// dpre u64 [E][W] (bitmap word | running count << 32), dbeg int32 [E] (begin_me(e) on e's rank),
// dout u64 [R][3] (destination d's recv_x, src_info and FP8 scales as this rank reaches them;
// 0: not direct).
GPUNET_DEVICE uint64_t* dpre(const LlParams& P) {
  const uint64_t w = uint64_t(P.num_experts + P.nranks) * dmask_words(P.t_max);
  return reinterpret_cast<uint64_t*>(ptr<uint32_t>(P.bits) + (w + 1) / 2 * 2);
}
GPUNET_DEVICE int32_t* dbeg(const LlParams& P) {
  return reinterpret_cast<int32_t*>(dpre(P) + uint64_t(P.num_experts) * dmask_words(P.t_max));
}
GPUNET_DEVICE uint64_t* dout(const LlParams& P) {
  return reinterpret_cast<uint64_t*>(dbeg(P) + (P.num_experts + 1) / 2 * 2);
}

// A direct receiver's block 0, once its layout is done: every mapped source it got nothing from
// (failed, masked, or not yet launched: a host stalled past the bound) gets its count tag
// revoked there. The receive tensors go back to the caller now; a late source's count round
// then finds this rank's tag is not its op's and stores no rows into them
// (tests/test_ep_ll.py test_a_late_direct_source_stores_nothing_into_returned_tensors). A store
// through the mapping: the verbs refuse a peer once a wait on it failed. The LL clean zeroes the
// tags (clean_epoch), so a revoked one does not outlive the resync.
constexpr uint64_t kRevokedTag = ~uint64_t(0);
GPUNET_DEVICE void direct_revoke(const LlParams& P, const Geo& g, const int32_t* got) {
  store_at_mapped_peers(P, g, ctag_word(P, P.rank), kRevokedTag, [&](uint32_t j) { return got[j] == 0; });
}

// Block 0 of a direct send: steps 1-3 above, then the grid flag. The other blocks wait for it
// (direct_wait). A peer whose row does not come is failed (masked with F_SHRINK): no rows go
// to it and its counts are left out of the begins, as its receivers leave it out.
GPUNET_DEVICE bool direct_counts(const LlParams& P, const Geo& g, uint8_t* out) {
  const uint32_t E = P.num_experts, R = P.nranks, EL = P.e_loc, W = dmask_words(P.t_max);
  const uint32_t TW = (P.num_tokens + 31) / 32;
  if (!block_wait(P, g, SYNC_SEND_BITS, g.nblocks, EP_SITE_BITS)) return false;
  int32_t* mine = cnt_row(P, P.rank);
  for (uint32_t e = g.tid; e < E; e += g.bdim) {
    const uint32_t* row = expert_bits(P, e);
    uint64_t* pre = dpre(P) + uint64_t(e) * W;
    uint32_t run = 0;
    for (uint32_t w = 0; w < TW; ++w) {
      const uint32_t v = row[w];
      pre[w] = uint64_t(v) | (uint64_t(run) << 32);
      run += popc64(v);
    }
    mine[kCntHead + e] = int32_t(run);
  }
  if (g.tid == 0) {
    mine[0] = int32_t(P.hidden);
    mine[1] = int32_t(E);
    mine[2] = int32_t(P.t_max);
    mine[3] = (P.flags & F_DIRECT_RECV) ? 1 : 0;
    int64_t* off = reinterpret_cast<int64_t*>(mine + 4);
    off[0] = int64_t(P.out_x - P.sig);  // symmetric: the same offsets from P.sig on every rank
    off[1] = int64_t(P.src_info - P.sig);
    off[2] = (P.flags & F_FP8) ? int64_t(P.out_scales - P.sig) : 0;
  }
  arch::syncthreads();
  // 2. the row to every live peer, a warp each, then its tag
  const uint32_t nw = kCntHead + E;
  for (uint32_t d = g.wid; d < R; d += g.nwarps) {
    if (d == P.rank || out[d]) continue;
    int32_t* there = ptr<int32_t>(mapped_at(P, d, uint64_t(uintptr_t(mine))));
    if (!there) {  // (F_DIRECT implies every peer mapped; a wrong flag must not write to 0)
      if (g.lane == 0) peer_fail_view(P, out, d);
      continue;
    }
    for (uint32_t i = g.lane; i < nw; i += g.ws) there[i] = mine[i];
    arch::syncwarp();
    if (g.lane == 0) {
      grid_fence(P);
      const DevCtx& cx = peer_ctx(P, d);
      uint64_t* tag = ctag_word(P, P.rank);
      const uint64_t v = *sent_word(P, SIG_DISPATCH, P.buf, d) + 1;  // the signal's value to come
      if (!put_signal_nbi(cx, tag, tag, 0, tag, v, int(d), SIGNAL_SET)) peer_fail_view(P, out, d);
    }
  }
  // 3. every live peer's row (a thread each), then the begins and the destinations
  for (uint32_t j = g.tid; j < R; j += g.bdim) {
    if (j == P.rank || out[j]) continue;
    const uint64_t want = *expected_word(P, SIG_DISPATCH, P.buf, j) + 1;
    // exactly this op's tag: kRevokedTag (or a later one) says j ended this op without this rank
    // and returned the tensors its row names (direct_revoke): nothing goes to it
    if (!wait_peer(P, j, ctag_word(P, j), want) || arch::atomic_load(ctag_word(P, j)) != want) {
      peer_fail_view(P, out, j);
      continue;
    }
    const int32_t* h = cnt_row(P, j);
    if (uint32_t(h[0]) != P.hidden || uint32_t(h[1]) != E || uint32_t(h[2]) != P.t_max) {
      ep_fail(P, EP_ERR_MISMATCH, EP_SITE_DIRECT, j, (uint64_t(E) << 32) | P.hidden,
              (uint64_t(uint32_t(h[1])) << 32) | uint32_t(h[0]), 0);
      out[j] = 1;  // nothing goes to a rank running another call (the host raises)
    }
  }
  arch::syncthreads();
  for (uint32_t e = g.tid; e < E; e += g.bdim) {
    int32_t run = 0;
    for (uint32_t i = 0; i < P.rank; ++i)
      if (!out[i]) run += cnt_row(P, i)[kCntHead + e];
    dbeg(P)[e] = run;
  }
  const bool fp8 = (P.flags & F_FP8) != 0;
  for (uint32_t d = g.tid; d < R; d += g.bdim) {
    uint64_t xb = 0, sb = 0, cb = 0;
    if (d == P.rank) {
      if (P.flags & F_DIRECT_RECV) xb = P.out_x, sb = P.src_info, cb = P.out_scales;
    } else if (!out[d] && cnt_row(P, d)[3]) {
      const int64_t* off = reinterpret_cast<const int64_t*>(cnt_row(P, d) + 4);
      xb = mapped_at(P, d, P.sig + uint64_t(off[0]));
      sb = mapped_at(P, d, P.sig + uint64_t(off[1]));
      cb = fp8 ? mapped_at(P, d, P.sig + uint64_t(off[2])) : 0;
    }
    if (!xb || !sb || (fp8 && !cb)) xb = sb = cb = 0;
    dout(P)[3 * d] = xb;
    dout(P)[3 * d + 1] = sb;
    dout(P)[3 * d + 2] = cb;
  }
  arch::syncthreads();
  for (uint32_t d = g.wid; d < R; d += g.nwarps) {
    if (!dout(P)[3 * d]) continue;
    int32_t* dst = d == P.rank ? bu_row(P, P.rank)
                               : ptr<int32_t>(mapped_at(P, d, uint64_t(uintptr_t(bu_row(P, P.rank)))));
    for (uint32_t i = g.lane; i < EL; i += g.ws) dst[i] = dbeg(P)[uint64_t(d) * EL + i];
  }
#if defined(GPUNET_TEST_LL_EXIT_AFTER_COUNTS) && defined(GPUNET_ARCH_HOST)
  // tests: this rank dies with its count rows out and its begins sent, before any row (the
  // later sources counted it: their rows sit above their places at every receiver)
  arch::syncthreads();
  if (g.tid == 0) ::_exit(0);
  arch::syncthreads();
#endif
  stamp(P, g, ST_COUNTED);
  block_publish(P, g, SYNC_SEND_COUNTS);
  return true;
}

// Lane k of token t's warp: where selection k's row goes on a direct destination (x 0: nowhere:
// a hole, a repeat, or a destination that takes messages), and with FP8 where its group 0 scale
// goes (sc: the scales are [E_loc][G][rows] floats, or UE8M0 [E_loc][ceil(G/4)][rows] int32 of
// four exponent bytes: group q at sc + (q / 4) * rows * 4 + q % 4). Part 0 stores t into
// src_info there. A position outside the packed rows (a corrupt count row) is recorded, skipped.
struct DirectDst {
  uint64_t x = 0, sc = 0;
};
GPUNET_DEVICE uint32_t scale_words(const LlParams& P) {
  const uint32_t G = P.hidden / kGroup;
  return (P.flags & F_UE8M0) ? (G + 3) / 4 : G;
}
GPUNET_DEVICE DirectDst direct_row(const LlParams& P, const Selection& sel, uint32_t t, uint32_t part) {
  DirectDst r;
  if (sel.e < 0) return r;
  const uint64_t* o = dout(P) + 3 * uint32_t(sel.d);
  const uint64_t xb = o[0];
  if (!xb) return r;
  const uint64_t rows = uint64_t(P.nranks) * P.t_max;
  const uint32_t e = uint32_t(sel.e), le = e - uint32_t(sel.d) * P.e_loc;
  const uint64_t v = dpre(P)[uint64_t(e) * dmask_words(P.t_max) + t / 32];
  const uint64_t pos = uint64_t(int64_t(dbeg(P)[e])) + uint32_t(v >> 32) + popc64(uint32_t(v) & ((1u << (t % 32)) - 1));
  if (pos >= rows) {
    ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_DIRECT, uint32_t(sel.d), rows, pos, 0);
    return r;
  }
  if (part == 0) ptr<int32_t>(o[1])[uint64_t(le) * rows + pos] = int32_t(t);
  const bool fp8 = (P.flags & F_FP8) != 0;
  r.x = xb + (uint64_t(le) * rows + pos) * P.hidden * (fp8 ? 1 : 2);
  if (fp8) r.sc = o[2] + (uint64_t(le) * scale_words(P) * rows + pos) * 4;
  return r;
}
GPUNET_DEVICE bool direct_dest(const LlParams& P, uint32_t d) {
  return (P.flags & F_DIRECT) && dout(P)[3 * d] != 0;
}
// One group's scale s (FP8) into a direct destination's scales (DirectDst::sc of its row): a
// float, or UE8M0 its exponent byte (the last group of a word also zeroes the word's unused
// bytes, as the message path's packing does).
GPUNET_DEVICE void direct_scale(const LlParams& P, uint64_t sc, uint32_t q, float s) {
  const uint64_t rows = uint64_t(P.nranks) * P.t_max;
  if (!(P.flags & F_UE8M0)) {
    *ptr<float>(sc + uint64_t(q) * rows * 4) = s;
    return;
  }
  uint8_t* w = ptr<uint8_t>(sc + uint64_t(q / 4) * rows * 4);
  w[q % 4] = uint8_t((f32_bits(s) >> 23) & 0xffu);
  if (q + 1 == P.hidden / kGroup)
    for (uint32_t i = q % 4 + 1; i < 4; ++i) w[i] = 0;
}

// A direct receiver's block 0, after its layout (begin [E_loc][R], the counts cnt [R][E_loc] and
// got[j] as dispatch_recv computed them): a warp per local expert checks each live source's
// begins used against begin and moves rows that sit above their place (a source before them
// failed after its count row). Rows move down, sources and rows ascending, so nothing is
// overwritten before it moved (the ranges were checked not to overlap).
GPUNET_DEVICE void direct_compact(const LlParams& P, const Geo& g, const int32_t* cnt,
                                  const int32_t* begin, const int32_t* got) {
  const uint32_t R = P.nranks, EL = P.e_loc, SW = scale_words(P);
  // Every source's begins are this rank's in a launch where no source failed after its counts:
  // one round of independent loads over (source, expert) settles it. (The checks and moves below
  // walk each expert's sources in order, a chain of loads: ~12-15 us on the H100 for DeepEP's
  // 144 local experts, bench/RESULTS.md thirty-second session, paid only when something moved.)
  bool moved = false;
  for (uint32_t i = g.tid; i < R * EL; i += g.bdim) {
    const uint32_t j = i / EL, le = i % EL;
    if (got[j] && cnt[i] != 0 && bu_row(P, j)[le] != begin[uint64_t(le) * R + j]) moved = true;
  }
  if (!arch::block_any(moved)) return;
  const bool fp8 = (P.flags & F_FP8) != 0;
  const uint64_t rows = uint64_t(R) * P.t_max, row_bytes = uint64_t(P.hidden) * (fp8 ? 1 : 2);
  for (uint32_t le = g.wid; le < EL; le += g.nwarps) {
    int64_t end = 0;
    for (uint32_t j = 0; j < R; ++j) {
      const int64_t c = got[j] ? cnt[uint64_t(j) * EL + le] : 0;
      if (c == 0) continue;
      const int64_t b = begin[uint64_t(le) * R + j], u = bu_row(P, j)[le];
      if (u < b || u < end || uint64_t(u + c) > rows) {
        if (g.lane == 0) ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_DIRECT, j, uint64_t(b), uint64_t(u), 0);
        break;
      }
      end = u + c;
      if (u == b) continue;
      int32_t* si = ptr<int32_t>(P.src_info) + uint64_t(le) * rows;
      for (int64_t i = 0; i < c; ++i) {
        const uint64_t from = uint64_t(le) * rows + uint64_t(u + i), to = uint64_t(le) * rows + uint64_t(b + i);
        warp_copy(g, P.out_x + to * row_bytes, P.out_x + from * row_bytes, row_bytes);
        if (g.lane == 0) si[b + i] = si[u + i];
        if (fp8) {  // the row's scale words, column-major: word q of (le, pos) at (le * SW + q) * rows + pos
          int32_t* sc = ptr<int32_t>(P.out_scales) + uint64_t(le) * SW * rows;
          for (uint32_t q = g.lane; q < SW; q += g.ws) sc[q * rows + uint64_t(b + i)] = sc[q * rows + uint64_t(u + i)];
        }
        arch::syncwarp();
      }
    }
  }
}

// FP8 with every peer mapped (nothing staged): part `part` of S of token t's groups, a lane per
// half group (64 columns; the group's amax joins the partner lane h ^ 1's by one shuffle), its
// e4m3 bytes (and, the first half's lane, the group's scale) stored from registers straight into
// the token's slot on each destination rank. The same numbers as quantise_group (the same amax8,
// group_scale and e4m3x16; max is exact in any order, so the halves' join changes nothing).
// Staged, a lane quantised whole groups (two a lane for DeepEP's 7168 columns) and one warp a
// token then copied the row to each destination: the FP8 send took ~24 us on the H200 against
// BF16's ~8 (bench/RESULTS.md, fourteenth session).
constexpr uint32_t kHalf = kGroup / 2;
GPUNET_DEVICE void fp8_to_destinations(const LlParams& P, const Geo& g, uint32_t t, uint32_t part,
                                       uint32_t S, const Selection& sel, const uint8_t* out) {
  const uint32_t H = P.hidden, G = H / kGroup, K = P.topk;
  // lane k: the slot of selection k's rank when k is the token's first selection on it (0: none)
  uint64_t slot = 0;
  if ((sel.first >> g.lane) & 1) {
    const uint32_t d = uint32_t(sel.d);
    if (!out[d] && !direct_dest(P, d))
      slot = d == P.rank ? dispatch_slot(P, t)
                         : mapped_at(P, d, dispatch_slot(P, t));
  }
  // lane k: selection k's packed row on a direct destination (F_DIRECT), else none
  const DirectDst dd = (P.flags & F_DIRECT) ? direct_row(P, sel, t, part) : DirectDst{};
  const bool round = (P.flags & (F_ROUND_SCALE | F_UE8M0)) != 0;
  const uint32_t per = (G + S - 1) / S, g0 = part * per;
  const uint32_t nh = g0 < G ? 2 * ((g0 + per < G ? g0 + per : G) - g0) : 0;
  for (uint32_t h0 = 0; h0 < nh; h0 += g.ws) {  // warp-uniform: every lane shuffles
    const uint32_t h = h0 + g.lane;
    const bool act = h < nh;
    const uint32_t col = (g0 + h / 2) * kGroup + (h % 2) * kHalf;
    V16 in[kHalf / 8] = {};
    float amax = 0.0f;
    if (act) {
      const V16* src = ptr<const V16>(P.x + (uint64_t(t) * H + col) * 2);
#pragma unroll
      for (uint32_t c = 0; c < kHalf / 8; ++c) in[c] = src[c];
#pragma unroll
      for (uint32_t c = 0; c < kHalf / 8; ++c) amax = amax8(in[c], amax);
    }
    const float other = arch::shfl(amax, g.lane ^ 1);  // h0 is even: lane ^ 1 holds h ^ 1
    amax = other > amax ? other : amax;
    const float s = group_scale(amax, round);
    V16 o[kHalf / 16];
#pragma unroll
    for (uint32_t c = 0; c < kHalf / 16; ++c) o[c] = e4m3x16(in[2 * c], in[2 * c + 1], s);
    for (uint32_t k = 0; k < K; ++k) {
      const uint64_t dst = arch::shfl(slot, k);
      const uint64_t dx = arch::shfl(dd.x, k), dsc = arch::shfl(dd.sc, k);
      if (!act) continue;
      if (dst) {
#pragma unroll
        for (uint32_t c = 0; c < kHalf / 16; ++c) ptr<V16>(dst + col)[c] = o[c];
        if (h % 2 == 0) ptr<float>(dst + H)[col / kGroup] = s;
      }
      if (dx) {
#pragma unroll
        for (uint32_t c = 0; c < kHalf / 16; ++c) ptr<V16>(dx + col)[c] = o[c];
        if (h % 2 == 0) direct_scale(P, dsc, col / kGroup, s);
      }
    }
  }
}

// Dispatch's send. A token's message goes to slot t of this rank's area on each destination
// (its header's bitmap says which slots hold one), so the rows need no plan, and neither do the
// experts' positions: the header carries each expert's token bitmap, and the receiver counts the
// bits below t (dispatch_recv). Every warp takes tokens: it stages the row where staging is
// needed, stores it on every mapped destination (and into this rank's own receive slot when the
// receive does not read x), sets the token's bits, writes the meta and puts whole messages to NIC
// peers. (Before, block 0 ranked every (token, expert) first, ~10 us of dependent steps on the
// H200 that every meta waited for.)
GPUNET_DEVICE bool dispatch_send(const LlParams& P, const Geo& g) {
  const uint32_t K = P.topk, T = P.num_tokens, H = P.hidden;
  const bool fp8 = (P.flags & F_FP8) != 0;
  const bool self_direct = self_reads_source(P);
  // the send slot holds the row only for a NIC peer (the verbs read the heap; FP8 quantised
  // once there, copied to each destination); with every peer mapped the rows go from x (BF16) or
  // from the quantiser's registers (FP8) to each destination, this rank's own slot included when
  // the receive does not read x (a hook, or FP8)
  const bool stage = !all_peers_mapped(P);
  uint8_t* out = load_send_view(P, g);
  if (!send_start(P, g, stage)) return false;
  dispatch_bits(P, g);
  const bool direct = (P.flags & F_DIRECT) != 0;  // (the host sets it only with !stage)
  if (direct) {
    if (g.bid == 0 ? !direct_counts(P, g, out)
                   : !block_wait(P, g, SYNC_SEND_COUNTS, 1, EP_SITE_DIRECT))
      return false;
  }
  // Unstaged rows (!stage): a token's row is cut in S contiguous parts, a warp each, when there
  // are warps to spare (DeepEP's 128 tokens on 65 blocks of 8 warps: S = 4). Part 0 also sets
  // the bits and writes the meta and the self message. Staged rows keep S = 1: the warp that
  // staged a row sends it.
  const uint32_t S = stage ? 1u : row_parts(g.gwarps, T);
  const uint64_t part_bytes = (uint64_t(P.payload_bytes) / S + 15) / 16 * 16;
  const uint64_t meta_bytes = P.msg_stride - P.payload_bytes;
  for (uint64_t u = g.gw; u < uint64_t(T) * S; u += g.gwarps) {
    const uint32_t t = uint32_t(u / S), part = uint32_t(u % S);
    const uint64_t msg = P.d_send + uint64_t(t) * P.msg_stride;
    if (stage) stage_row(P, g, t);
    const Selection sel = token_selections(P, g, t);
    const bool copy = stage || !fp8;  // else the quantiser stores the part itself
    if (!copy) fp8_to_destinations(P, g, t, part, S, sel, out);
    arch::syncwarp();  // the staged row's stores before other lanes read it
    const uint64_t src = stage ? msg : P.x + uint64_t(t) * H * 2;
    const uint64_t lo = part * part_bytes;
    const uint64_t hi = lo + part_bytes < P.payload_bytes ? lo + part_bytes : P.payload_bytes;
    if (direct && copy) {  // BF16: each (token, local expert) row of a direct destination, read once
      const uint64_t xdst = direct_row(P, sel, t, part).x;
      const uint64_t have = arch::ballot(xdst != 0);
      uint64_t dst[kMaxTopk];
      uint32_t nd = 0;
      for (uint32_t k = 0; k < K; ++k)
        if ((have >> k) & 1) dst[nd++] = arch::shfl(xdst, k) + lo;
      if (nd && lo < hi) warp_copy_each(g, dst, nd, src + lo, hi - lo);
    }
    for (uint32_t k = 0; copy && k < K && lo < hi; ++k) {
      if (!((sel.first >> k) & 1)) continue;
      const uint32_t d = uint32_t(arch::shfl(sel.d, k));
      if (direct && direct_dest(P, d)) continue;
      if (d == P.rank) {  // this rank's own slot (no NIC), unless the receive reads x
        if (!self_direct && !out[d]) warp_copy(g, dispatch_slot(P, t) + lo, src + lo, hi - lo);
        continue;
      }
      if (out[d]) continue;
      // a mapped peer: the warp stores the row there itself, published by the last block's
      // fences and signal like a p2p put (a NIC peer gets the whole message below)
      if (const uint64_t mapped = mapped_at(P, d, dispatch_slot(P, t)))
        warp_copy(g, mapped + lo, src + lo, hi - lo);
    }
    if (part != 0) continue;
    int32_t* meta = ptr<int32_t>(msg + P.payload_bytes);
    if (g.lane == 0) {
      meta[0] = int32_t(t);
      meta[1] = int32_t(K);
      meta[2] = int32_t(H);
      meta[3] = 0;
    }
    if (g.lane < K) meta[4 + g.lane] = sel.e;
    arch::syncwarp();  // row and meta stores of every lane before the copies and the posts
    bool fenced = false;
    for (uint32_t k = 0; k < K; ++k) {
      if (!((sel.first >> k) & 1)) continue;
      const uint32_t d = uint32_t(arch::shfl(sel.d, k));
      if (out[d] || (direct && direct_dest(P, d))) continue;
      if (d == P.rank) {
        warp_copy(g, dispatch_slot(P, t) + P.payload_bytes, msg + P.payload_bytes, meta_bytes);
        continue;
      }
      const DevCtx& cx = peer_ctx(P, d);
      if (const uint64_t mapped = mapped_at(P, d, dispatch_slot(P, t))) {
        warp_copy(g, mapped + P.payload_bytes, msg + P.payload_bytes, meta_bytes);
        continue;
      }
      // one fence per token (the staged row and meta before the first post), on every lane
      bool ok = fenced || arch::all(fence(cx));
      fenced = true;
      ok = ok && put_nbi_warp(cx, ptr<void>(dispatch_slot(P, t)), ptr<const void>(msg), P.msg_stride, int(d));
      if (!ok && g.lane == 0) peer_fail_view(P, out, d);
    }
  }
  stamp_after_block(P, g, ST_SEND_LOOP);
  return dispatch_send_last(P, g, out);
}

GPUNET_DEVICE bool dispatch_recv(const LlParams& P, const Geo& g) {
  const uint32_t R = P.nranks, EL = P.e_loc, H = P.hidden;
  const uint64_t rows = uint64_t(R) * P.t_max;  // second dimension of the packed outputs
  int32_t* cnt = ptr<int32_t>(P.tab);           // [R][E_loc] per-source counts
  int32_t* begin = cnt + uint64_t(R) * EL;      // [E_loc][R]
  int32_t* nmsg = begin + uint64_t(EL) * R;     // [R] message slots to scan per source (its T)
  int32_t* nrecv = ptr<int32_t>(P.nrecv);       // messages per source: for the host only
  int32_t* got = ptr<int32_t>(P.got);
  if (g.bid == 0) {
    // thread j waits for source j and checks its header: n messages in the first `slots` of
    // its t_max slots (nmsg[j] = -1: nothing from j); then the whole block copies the
    // per-expert counts of every source (one round of loads: a thread walking a source's E_loc
    // counts was E_loc / kBatch dependent rounds, 9 for DeepEP's 2 x 144)
    for (uint32_t j = g.tid; j < R; j += g.bdim) {
      bool ok = !peer_out(P, j) && wait_source(P, SIG_DISPATCH, j);
      int32_t n = 0, slots = 0;
      if (ok) {
        const int32_t* h = ptr<const int32_t>(P.d_rhdr + uint64_t(j) * P.hdr_stride);
        n = h[0];
        slots = h[1];
        if (!header_matches(P, h, j)) {
          ok = false;
        } else if (slots < 0 || uint32_t(slots) > P.t_max || n < 0 || n > slots) {
          ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_HEADER, j, P.t_max,
                  (uint64_t(uint32_t(n)) << 32) | uint32_t(slots), 0);
          ok = false;
        }
      }
      nmsg[j] = ok ? slots : -1;
      nrecv[j] = ok ? n : 0;
      got[j] = ok ? 1 : 0;
    }
    arch::syncthreads();
    for (uint32_t i = g.tid; i < R * EL; i += g.bdim) {
      const uint32_t j = i / EL;
      cnt[i] = nmsg[j] >= 0 ? ptr<const int32_t>(P.d_rhdr + uint64_t(j) * P.hdr_stride)[kHdrHead + i % EL] : 0;
    }
    arch::syncthreads();
    // (read by the other blocks after block_publish below; a direct receiver unpacks nothing:
    // its sources stored every row in place)
    const bool direct = (P.flags & (F_DIRECT | F_DIRECT_RECV)) == (F_DIRECT | F_DIRECT_RECV);
    for (uint32_t j = g.tid; j < R; j += g.bdim)
      if (nmsg[j] < 0 || direct) nmsg[j] = 0;
    int64_t* lr = ptr<int64_t>(P.layout_range);
    int32_t* count = ptr<int32_t>(P.out_count);
    for (uint32_t le = g.tid; le < EL; le += g.bdim) {
      int32_t run = 0;
      batched(R, [&](uint32_t j) { return cnt[uint64_t(j) * EL + le]; },
              [&](uint32_t j, int64_t v) {
                const int32_t c = int32_t(v);
                begin[uint64_t(le) * R + j] = run;
                lr[uint64_t(le) * R + j] = (int64_t(run) << 32) | int64_t(uint32_t(c));
                run += c;
              });
      count[le] = run;
      if (P.cum_stats) ptr<int32_t>(P.cum_stats)[le] += run;
    }
    if (direct) {
      arch::syncthreads();
      direct_compact(P, g, cnt, begin, got);
      direct_revoke(P, g, got);
    }
    block_publish(P, g, SYNC_RECV_READY);
  } else if (!block_wait(P, g, SYNC_RECV_READY, 1, EP_SITE_RECV_READY)) {
    return false;
  }
  stamp(P, g, ST_RECV_READY);
  uint64_t total = 0;
  for (uint32_t j = 0; j < R; ++j) total += uint64_t(nmsg[j]);
  const bool fp8 = (P.flags & F_FP8) != 0;
  const bool ue8m0 = (P.flags & F_UE8M0) != 0;
  const bool self_direct = self_reads_source(P);
  const uint32_t G = H / kGroup, NW = (G + 3) / 4;
  const uint32_t e0 = P.rank * EL, W = dmask_words(P.t_max), e0w = ebits_word0(EL, P.t_max);
  // A message's row is cut in S contiguous parts, a warp each, when the grid has warps to spare
  // (as the unstaged send: DeepEP's 128 tokens from 2 ranks are 256 messages, fewer than a
  // grid's warps); part 0 also writes src_info and the FP8 scales.
  const uint32_t S = row_parts(g.gwarps, total);
  const uint64_t row_bytes = fp8 ? uint64_t(H) : uint64_t(H) * 2;
  const uint64_t part_bytes = (row_bytes / S + 15) / 16 * 16;
  for (uint64_t u = g.gw; u < total * S; u += g.gwarps) {
    const uint64_t it = u / S;
    const uint32_t part = uint32_t(u % S);
    uint32_t j = 0;
    uint64_t m = it;
    while (m >= uint64_t(nmsg[j])) m -= uint64_t(nmsg[j++]);
    // slot m holds a message of this launch when the header's bitmap says so
    const uint32_t word = ptr<const uint32_t>(P.d_rhdr + uint64_t(j) * P.hdr_stride)[kHdrHead + EL + m / 32];
    if (!((word >> (m % 32)) & 1)) continue;
    const uint64_t msg = P.d_recv + (uint64_t(j) * P.t_max + m) * P.msg_stride;
    const int32_t* meta = ptr<const int32_t>(msg + P.payload_bytes);
    const uint64_t* ebits = reinterpret_cast<const uint64_t*>(
        ptr<const int32_t>(P.d_rhdr + uint64_t(j) * P.hdr_stride) + e0w);
    // t, K and lane k's selection k are loaded together (the meta is kMetaBytes whatever the
    // sender's K: selection k's words exist for every k < kMaxTopk), not K after t
    const int32_t t = meta[0];
    const uint32_t k_raw = uint32_t(meta[1]);
    const int32_t e = g.lane < kMaxTopk ? meta[4 + g.lane] : -1;
    const uint32_t kk = k_raw < kMaxTopk ? k_raw : kMaxTopk;  // the sender's K
    // the packed rows this message goes to (one per local expert the token selected): lane k
    // reads selection k (the lanes' loads overlap; one lane walking k made K dependent chains);
    // its position idx_e(t) is the bits below t in the expert's token bitmap: the word's running
    // count plus a popcount
    bool mine = false;
    uint64_t my_dst = 0;
    if (g.lane < kk && e >= int32_t(e0) && e < int32_t(e0 + EL) && t == int32_t(m)) {
      const uint32_t le = uint32_t(e) - e0;
      const uint64_t v = ebits[uint64_t(le) * W + m / 32];
      const uint32_t b = uint32_t(v);
      const uint32_t idx = uint32_t(v >> 32) + popc64(b & ((1u << (m % 32)) - 1));
      const int32_t c = cnt[uint64_t(j) * EL + le];
      if (!((b >> (m % 32)) & 1) || int64_t(idx) >= c) {
        ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_MESSAGE, j, uint64_t(c), uint64_t(idx), 0);
      } else {
        my_dst = uint64_t(le) * rows + uint64_t(begin[uint64_t(le) * R + j]) + idx;
        mine = true;
        if (part == 0) ptr<int32_t>(P.src_info)[my_dst] = t;
      }
    } else if (g.lane == 0 && t != int32_t(m)) {
      ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_MESSAGE, j, m, uint64_t(uint32_t(t)), 0);
    }
    const uint64_t have = arch::ballot(mine);
    uint64_t dst[kMaxTopk];
    uint32_t nd = 0;
    for (uint32_t k = 0; k < kk; ++k) {
      if (!((have >> k) & 1)) continue;
      const uint64_t dk = arch::shfl(my_dst, k);
      dst[nd++] = P.out_x + dk * row_bytes;
      const uint64_t le = dk / rows, pos = dk % rows;
      if (!fp8 || part != 0) continue;
      const float* sc = ptr<const float>(msg + H);
      if (!ue8m0) {
        for (uint32_t grp = g.lane; grp < G; grp += g.ws)
          ptr<float>(P.out_scales)[(uint64_t(le) * G + grp) * rows + pos] = sc[grp];
      } else {
        for (uint32_t w = g.lane; w < NW; w += g.ws) {
          uint32_t word = 0;
          for (uint32_t i = 0; i < 4 && 4 * w + i < G; ++i)
            word |= ((f32_bits(sc[4 * w + i]) >> 23) & 0xffu) << (8 * i);
          ptr<int32_t>(P.out_scales)[(uint64_t(le) * NW + w) * rows + pos] = int32_t(word);
        }
      }
    }
    // the part is read once and written to every copy
    const uint64_t lo = part * part_bytes;
    const uint64_t hi = lo + part_bytes < row_bytes ? lo + part_bytes : row_bytes;
    if (lo >= hi || nd == 0) continue;
    const uint64_t src = ((j == P.rank && self_direct) ? P.x + m * row_bytes : msg) + lo;
    for (uint32_t q = 0; q < nd; ++q) dst[q] += lo;
    warp_copy_each(g, dst, nd, src, hi - lo);
  }
  stamp_after_block(P, g, ST_RECV_LOOP);
  if (last_block(P, g, SYNC_RECV_DONE)) reset_sync(P, g, SYNC_RECV_READY, SYNC_RECV_DONE);
  return true;
}

// ---- combine ------------------------------------------------------------------------------------

// table[t][k] = slot for every k whose expert is ge (a token naming ge twice gets it twice): the K
// expert ids are loaded first (the table stores could alias them: one latency per k otherwise).
GPUNET_DEVICE void table_mark(const LlParams& P, uint32_t t, int64_t ge, int64_t slot) {
  const uint32_t K = P.topk;
  const int64_t* row = ptr<const int64_t>(P.topk_idx) + uint64_t(t) * K;
  int64_t* table = ptr<int64_t>(P.table) + uint64_t(t) * K;
  int64_t sel[kMaxTopk];
#pragma unroll
  for (uint32_t k = 0; k < kMaxTopk; ++k) sel[k] = k < K ? row[k] : -1;
#pragma unroll
  for (uint32_t k = 0; k < kMaxTopk; ++k)
    if (k < K && sel[k] == ge) table[k] = slot;
}

// Warp-collective: the rows this rank sends rank j for its local experts below le (the handle's
// counts), i.e. the first row of item (le, j) in this rank's area on j. Each warp adds up its own
// item's (E_loc / ws loads a lane): block 0's prefix over every (expert, rank), published by a
// grid flag, was ~3-4 us that every send waited for on the H200.
GPUNET_DEVICE uint64_t rows_before(const LlParams& P, const Geo& g, uint32_t j, uint32_t le) {
  const int64_t* lr = ptr<const int64_t>(P.layout_range);
  uint64_t n = 0;
  for (uint32_t q = g.lane; q < le; q += g.ws) n += uint64_t(lr[uint64_t(q) * P.nranks + j] & 0xffffffff);
  return warp_sum(g, n);
}

// Warp-uniform: a combine item or header whose rows do not fit (`bad`: a corrupt handle; `room`
// the rows there are, `end` the rows it needs) is recorded by lane 0 (EP_ERR_LAYOUT: the host
// raises a ConfigError) and skipped by the caller, so nothing goes outside x or the receive area.
GPUNET_DEVICE bool layout_fails(const LlParams& P, const Geo& g, bool bad, uint32_t j,
                                uint64_t room, uint64_t end) {
  if (bad && g.lane == 0) ep_fail(P, EP_ERR_LAYOUT, EP_SITE_COMBINE_LAYOUT, j, room, end, 0);
  return bad;
}

// Combine's headers come from the handle alone (layout_range: per local expert and rank the
// rows' begin and count), so they are filled at the START of the send, a warp per destination j
// (the grid's last warps), while the other warps copy rows: the per-expert counts (loaded
// together, then stored), their sum n (word 0) and the layout check (every row inside x's packed
// layout, n inside this rank's area on j). The send's last block then only sets word 1 and
// signals: filled by the last block after every row, they were ~8 us of the H200's combine
// (bench/RESULTS.md, fifteenth session: hdr.f). A header that does not fit is recorded
// (EP_ERR_LAYOUT, the host raises a ConfigError) and counted in SYNC_SEND_BAD: the last block
// then signals nobody, this rank included (a corrupt handle: nothing is announced with it).
// A destination out of the warp's view is left alone (the last block skips it too: a view only
// gains peers that are out, and header_pre reads the mask and failed words again).
GPUNET_DEVICE void combine_header_early(const LlParams& P, const Geo& g, const uint8_t* out) {
  const uint32_t R = P.nranks, EL = P.e_loc;
  const uint64_t rows = uint64_t(R) * P.t_max;
  const int64_t* lr = ptr<const int64_t>(P.layout_range);
  for (uint32_t j = g.gwarps - 1 - g.gw; j < R; j += g.gwarps) {
    if (out[j]) continue;  // warp-uniform
    int32_t* h = header_slot(P, P.c_rhdr, P.c_shdr, j);
    uint64_t n = 0;
    bool fits = true;
    for (uint32_t le0 = 0; le0 < EL; le0 += g.ws * kBatch)
      batched(kBatch, [&](uint32_t u) {
        const uint32_t le = le0 + u * g.ws + g.lane;
        return le < EL ? lr[uint64_t(le) * R + j] : int64_t(0);
      }, [&](uint32_t u, int64_t v) {
        const uint32_t le = le0 + u * g.ws + g.lane;
        const int64_t b = v >> 32, c = v & 0xffffffff;
        if (le >= EL) return;
        if (b < 0 || b + c > int64_t(rows)) fits = false;
        h[kHdrHead + le] = int32_t(c);
        n += uint64_t(c);
      });
    n = warp_sum(g, n);
    fits = arch::all(fits) && n <= P.c_rows;
    if (layout_fails(P, g, !fits, j, P.c_rows, n)) {
      if (g.lane == 0) arch::atomic_add(sync_word(P, SYNC_SEND_BAD), uint64_t(1));
    } else if (g.lane == 0) {
      h[0] = int32_t(n);
    }
  }
}

GPUNET_DEVICE bool combine_send(const LlParams& P, const Geo& g) {
  const uint32_t R = P.nranks, EL = P.e_loc, H = P.hidden;
  const uint64_t rows = uint64_t(R) * P.t_max;
  const int64_t* lr = ptr<const int64_t>(P.layout_range);  // the handle's [E_loc, R]
  uint8_t* out = load_send_view(P, g);
  // staging (the rows unless zero_copy, their token indices, the headers) only for NIC peers
  if (!send_start(P, g, !all_peers_mapped(P))) return false;
  combine_header_early(P, g, out);
  const bool zero_copy = (P.flags & F_ZERO_COPY) != 0;
  const int64_t* topk = ptr<const int64_t>(P.topk_idx);
  int64_t* table = ptr<int64_t>(P.table);
  // With every peer mapped, an item (expert, source) is cut in S parts, part p taking its rows
  // p, p + S, ...: the rows a warp copies itself are then spread over the grid's warps (an item
  // has ~3.5 rows of 14 KB in DeepEP's workload). A put to a NIC peer stays one per item (S = 1).
  // The work list is the (R - 1) * E_loc * S parts of the other ranks' items, then this rank's
  // own E_loc items (whole: with one launch only their slots are tabled, rows read in place).
  // The grid stride (its warp count, a multiple of R * S) must not fix a warp's destination:
  // enumerated as (expert, destination), each warp would get one destination every turn, and
  // with 2 ranks half the warps only this rank's own items, which copy nothing (docs/decisions.md;
  // no test sees the spread: bench/ep_profile.py's send phase per rank does).
  const uint32_t S = all_peers_mapped(P) ? kCombineParts : 1;
  const uint64_t remote = uint64_t(EL) * (R - 1) * S, work = remote + EL;
  for (uint64_t u = g.gw; u < work; u += g.gwarps) {
    uint32_t j = P.rank, le = 0, part = 0;
    if (u < remote) {
      const uint64_t it = u / S;
      part = uint32_t(u % S);
      const uint32_t jj = uint32_t(it % (R - 1));
      le = uint32_t(it / (R - 1));
      j = jj < P.rank ? jj : jj + 1;
    } else {
      le = uint32_t(u - remote);
    }
    if (out[j]) continue;  // warp-uniform: the warp puts below
    const int64_t v = lr[uint64_t(le) * R + j];
    const uint64_t b = uint64_t(v >> 32), c = uint64_t(v & 0xffffffff);
    if (c <= part) continue;
    if (layout_fails(P, g, v < 0 || b + c > rows, j, rows, b + c)) continue;  // outside x's layout
    const uint64_t r0 = uint64_t(le) * rows + b;
    if (j == P.rank && self_reads_source(P)) {
      // the receive of this launch reads these rows from x: their slots go in the table now
      const int64_t ge = int64_t(P.rank) * EL + le;
      for (uint64_t i = g.lane; i < c; i += g.ws) {
        const int32_t t = ptr<const int32_t>(P.src_info)[r0 + i];
        if (t < 0 || uint32_t(t) >= P.num_tokens) continue;  // (the receive reports it)
        table_mark(P, uint32_t(t), ge, kSelfRow | int64_t(r0 + i));
      }
      continue;
    }
    const uint64_t first = rows_before(P, g, j, le);
    if (layout_fails(P, g, first + c > P.c_rows, j, P.c_rows, first + c)) continue;  // area on j
    const uint64_t dst_row = uint64_t(P.rank) * P.c_rows + first;
    if (j == P.rank) {
      // to self, with a hook: rows and token indices into its own receive area (no NIC)
      warp_copy(g, P.c_recv + dst_row * H * 2, P.x + r0 * H * 2, c * H * 2);
      for (uint64_t i = g.lane; i < c; i += g.ws)
        ptr<int32_t>(P.c_rtags)[dst_row + i] = ptr<const int32_t>(P.src_info)[r0 + i];
      continue;
    }
    const DevCtx& cx = peer_ctx(P, j);
    // a mapped peer: the warp stores its part's rows (from x, unstaged) and their token indices
    // there itself, published by the last block's fences and signal like a p2p put
    if (const uint64_t mapped = mapped_at(P, j, P.c_recv + dst_row * H * 2)) {
      for (uint64_t r = part; r < c; r += S)
        warp_copy(g, mapped + r * H * 2, P.x + (r0 + r) * H * 2, uint64_t(H) * 2);
      int32_t* tags = ptr<int32_t>(mapped_at(P, j, P.c_rtags + dst_row * 4));
      for (uint64_t i = part + uint64_t(g.lane) * S; i < c; i += uint64_t(g.ws) * S)
        tags[i] = ptr<const int32_t>(P.src_info)[r0 + i];
      continue;
    }
    if (part != 0) continue;  // (S > 1 only when every peer is mapped: never taken)
    if (!zero_copy) warp_copy(g, P.c_send + r0 * H * 2, P.x + r0 * H * 2, c * H * 2);
    for (uint64_t i = g.lane; i < c; i += g.ws)
      ptr<int32_t>(P.c_stags)[r0 + i] = ptr<const int32_t>(P.src_info)[r0 + i];
    arch::syncwarp();
    // the whole warp: one fence, then the rows and their token indices (ll.cuh "Speed rules")
    bool ok = arch::all(fence(cx));
    ok = ok && put_nbi_warp(cx, ptr<void>(P.c_recv + dst_row * H * 2),
                            ptr<const void>(P.c_send + r0 * H * 2), c * H * 2, int(j));
    ok = ok && put_nbi_warp(cx, ptr<void>(P.c_rtags + dst_row * 4),
                            ptr<const void>(P.c_stags + r0 * 4), c * 4, int(j));
    if (!ok && g.lane == 0) peer_fail_view(P, out, j);
  }
  stamp_after_block(P, g, ST_SEND_LOOP);
  // every block: the header slots and warp w's destination's HeaderPre before last_block's
  // fences (as the dispatch's)
  int32_t** hs = header_slots(P, g, P.c_rhdr, P.c_shdr, out);
  const uint32_t j0 = g.wid;
  HeaderPre pre0;
  if (j0 < R) pre0 = header_pre(P, SIG_COMBINE, P.c_rhdr, P.c_shdr, j0, out);
  if (last_block(P, g, SYNC_SEND_DONE)) {
    stamp(P, g, ST_SEND_LAST);
    // every header was filled at the start (combine_header_early); none is sent when one did
    // not fit (the block reads the count once: every thread the same answer)
    const bool bad = arch::block_any(g.tid == 0 && arch::atomic_load(sync_word(P, SYNC_SEND_BAD)) != 0);
    for (uint32_t j = g.wid; !bad && j < R; j += g.nwarps) {
      const HeaderPre x = j == j0 ? pre0 : header_pre(P, SIG_COMBINE, P.c_rhdr, P.c_shdr, j, out);
      if (g.lane == 0 && !x.skip && hs[j])
        header_finish(P, SIG_COMBINE, P.c_rhdr, P.c_shdr, j, x, int32_t(P.t_max), (kHdrHead + EL) * 4);
    }
    stamp(P, g, ST_HDR_FILLED);
    stamp_after_block(P, g, ST_HDR_SIGNALED);
    if (!bad) announce_self(P, g, SIG_COMBINE);
    reset_sync(P, g, SYNC_SEND_QUIET, SYNC_SEND_DONE);
    stamp(P, g, ST_SEND_HDR);
  }
  return true;
}

// Step 8's reduce. One item = (token t, a span of SUB * 8 * ws columns): lane l reduces the SUB
// groups of 8 columns c0 + s * 8 * ws (s < SUB). A warp takes a contiguous run of items (mostly
// one token's spans), so a token's K row addresses and weights are read once for its run, and
// each item costs one round of SUB * K loads in flight (a round waits one memory latency: with
// K <= 8, SUB = 2 halves the rounds at the same registers as K <= 16, SUB = 1). KM: the largest K.
template <uint32_t KM, uint32_t SUB>
GPUNET_DEVICE void combine_reduce(const LlParams& P, const Geo& g) {
  const uint32_t H = P.hidden, K = P.topk, T = P.num_tokens;
  const int64_t* table = ptr<const int64_t>(P.table);
  const float* w = ptr<const float>(P.topk_weights);
  const uint32_t group = 8 * g.ws, span = SUB * group, nspan = (H + span - 1) / span;
  const uint64_t spans = uint64_t(T) * nspan, per = (spans + g.gwarps - 1) / g.gwarps;
  const uint64_t it0 = uint64_t(g.gw) * per, it1 = it0 + per < spans ? it0 + per : spans;
  uint32_t cur = ~0u, have = 0;  // have: bit k = selection k of token cur sent a row
  uint64_t base[KM];             // its row's first byte
  float wk[KM];
  for (uint64_t it = it0; it < it1; ++it) {
    const uint32_t t = uint32_t(it / nspan);
    if (t != cur) {
      cur = t;
      have = 0;
#pragma unroll
      for (uint32_t k = 0; k < KM; ++k) {
        base[k] = 0;
        wk[k] = 0.0f;
        if (k >= K) continue;
        const int64_t s = table[uint64_t(t) * K + k];
        if (s < 0) continue;
        have |= 1u << k;
        const uint64_t o = uint64_t(s) >> 32, i = uint64_t(s) & 0xffffffffu;
        base[k] = (s & kSelfRow) ? P.x + uint64_t(s & ~kSelfRow) * H * 2
                                 : P.c_recv + (o * P.c_rows + i) * H * 2;
        wk[k] = w[uint64_t(t) * K + k];
      }
    }
    const uint32_t c0 = uint32_t(it % nspan) * span + g.lane * 8;
    // every row of every group first (SUB * K independent 16-byte loads in flight), then the sums
    // in k order (deterministic: same inputs, same bits)
    V16 v[SUB][KM];
#pragma unroll
    for (uint32_t q = 0; q < SUB; ++q)
#pragma unroll
      for (uint32_t k = 0; k < KM; ++k)
        v[q][k] = (((have >> k) & 1) && c0 + q * group < H)
                      ? *ptr<const V16>(base[k] + uint64_t(c0 + q * group) * 2) : V16{0, 0};
#pragma unroll
    for (uint32_t q = 0; q < SUB; ++q) {
      const uint32_t c = c0 + q * group;
      if (c >= H) continue;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (uint32_t k = 0; k < KM; ++k) {
        if (!((have >> k) & 1)) continue;  // a hole adds nothing (not even 0 * row)
        for (uint32_t e = 0; e < 8; ++e) acc[e] += wk[k] * bf16_at(v[q][k], e);
      }
      V16 res = {0, 0};
      for (uint32_t e = 0; e < 8; ++e)
        (e < 4 ? res.a : res.b) |= uint64_t(f32_to_bf16(acc[e])) << (16 * (e & 3));
      *ptr<V16>(P.out_x + (uint64_t(t) * H + c) * 2) = res;
    }
  }
}

GPUNET_DEVICE bool combine_recv(const LlParams& P, const Geo& g) {
  const uint32_t R = P.nranks, EL = P.e_loc, K = P.topk, T = P.num_tokens;
  int32_t* pre = ptr<int32_t>(P.tab);                         // [R][E_loc]: first row of le from o
  int32_t* cnt = pre + uint64_t(R) * EL;                      // [R][E_loc]
  int32_t* nrecv = ptr<int32_t>(P.nrecv);
  int32_t* got = ptr<int32_t>(P.got);
  int64_t* table = ptr<int64_t>(P.table);
  const int64_t* topk = ptr<const int64_t>(P.topk_idx);
  if (g.bid == 0) {
    // thread o waits for source o and checks its header (srcn[o]: its row count, or kNoSource);
    // then a warp per source takes the prefix of its E_loc counts (warp_scan; one thread's walk
    // was E_loc / kBatch dependent rounds)
    int64_t* srcn = reinterpret_cast<int64_t*>(arch::shared_mem() + smem_view_bytes(R));  // [R]
    constexpr int64_t kNoSource = INT64_MIN;
    for (uint32_t o = g.tid; o < R; o += g.bdim) {
      bool ok = !peer_out(P, o) && wait_source(P, SIG_COMBINE, o);
      const int32_t* h = ptr<const int32_t>(P.c_rhdr + uint64_t(o) * P.hdr_stride);
      srcn[o] = ok && header_matches(P, h, o) ? int64_t(h[0]) : kNoSource;
    }
    arch::syncthreads();
    for (uint32_t o = g.wid; o < R; o += g.nwarps) {
      const int64_t n = srcn[o];
      bool ok = n != kNoSource, negative = false;
      int64_t run = 0;
      if (ok) {
        const int32_t* h = ptr<const int32_t>(P.c_rhdr + uint64_t(o) * P.hdr_stride);
        run = warp_scan(g, EL,
                        [&](uint32_t le) {
                          const int32_t c = h[kHdrHead + le];
                          cnt[uint64_t(o) * EL + le] = c;
                          negative |= c < 0;
                          return c;
                        },
                        [&](uint32_t le, int64_t before) { pre[uint64_t(o) * EL + le] = int32_t(before); });
      }
      ok = ok && !arch::any(negative);
      if (ok && (run != n || uint64_t(run) > P.c_rows)) {
        if (g.lane == 0) ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_HEADER, o, P.c_rows, uint64_t(run), 0);
        ok = false;
      }
      if (!ok)
        for (uint32_t le = g.lane; le < EL; le += g.ws) cnt[uint64_t(o) * EL + le] = 0;
      if (g.lane == 0) {
        nrecv[o] = ok ? int32_t(n) : 0;
        got[o] = ok ? 1 : 0;
      }
    }
    block_publish(P, g, SYNC_RECV_READY);
  } else if (!block_wait(P, g, SYNC_RECV_READY, 1, EP_SITE_RECV_READY)) {
    return false;
  }
  stamp(P, g, ST_RECV_READY);
  // the slot table: (source, row) of every (token, k) whose expert sent a row
  const uint64_t items = uint64_t(R) * EL;
  const bool self_tabled = self_reads_source(P);
  for (uint64_t it = g.gw; it < items; it += g.gwarps) {
    const uint32_t o = uint32_t(it / EL), le = uint32_t(it % EL);
    const int32_t c = cnt[it];
    if (c <= 0 || (o == P.rank && self_tabled)) continue;
    const int64_t ge = int64_t(o) * EL + le;
    const uint64_t p0 = uint64_t(o) * P.c_rows + uint64_t(pre[it]);
    for (uint32_t r = g.lane; r < uint32_t(c); r += g.ws) {
      const int32_t t = ptr<const int32_t>(P.c_rtags)[p0 + r];
      if (t < 0 || uint32_t(t) >= T) {
        ep_fail(P, EP_ERR_BAD_MESSAGE, EP_SITE_MESSAGE, o, T, uint64_t(uint32_t(t)), 0);
        continue;
      }
      table_mark(P, uint32_t(t), ge, (int64_t(o) << 32) | int64_t(uint32_t(pre[it]) + r));
    }
  }
  if (!grid_barrier(P, g, SYNC_RECV_TABLE, EP_SITE_TABLE)) return false;
  stamp(P, g, ST_RECV_TABLE);
  if (K <= kMaxTopk / 2) combine_reduce<kMaxTopk / 2, 2>(P, g);
  else combine_reduce<kMaxTopk, 1>(P, g);
  stamp_after_block(P, g, ST_RECV_LOOP);
  // the slot table back to -1 (between launches) once every block has read it
  if (last_block(P, g, SYNC_RECV_DONE)) {
    for (uint64_t i = g.tid; i < uint64_t(T) * K; i += g.bdim) table[i] = -1;
    reset_sync(P, g, SYNC_RECV_READY, SYNC_RECV_DONE);
  }
  return true;
}

// ---- clean: a barrier over the live ranks, then every signal count re-read, then a barrier -------

// The barrier's signals are SET, as the dispatch / combine ones (sent_word): an ADD to a p2p peer
// is refused on the c500 profile (store-only), which made every clean there time out
// (tests/test_ep_ll.py test_the_c500_profile_runs_rounds_and_cleans_over_p2p). The value names
// the barrier: 2e - 1 and 2e for the two barriers of this rank's e-th clean (clean_epoch). Cleans
// are collective, so every rank's e-th clean is the same one, and a wait for >= 2e - 1 cannot
// pass on a raise of an earlier clean (<= 2e - 2). A count of raises could: a rank that skipped
// a masked peer's raise stayed one barrier behind its count, and its next clean's first wait
// passed on that old raise, before the peer had left its last LL call (tests/test_ep_ll.py
// test_any_fault_sequence_then_vllms_clean_gives_exact_rounds, its first example).
GPUNET_DEVICE uint64_t* clean_epoch(const LlParams& P) {
  return ptr<uint64_t>(P.expected) + (uint64_t(8) * P.nranks + 8);
}
GPUNET_DEVICE void barrier_live(const LlParams& P, const Geo& g, uint64_t v) {
  const uint32_t R = P.nranks;
  for (uint32_t p = g.tid; p < R; p += g.bdim) {
    if (p == P.rank || peer_out(P, p)) continue;
    const DevCtx& cx = peer_ctx(P, p);
    uint64_t* s = barrier_sig(P, P.rank);
    if (!(fence(cx) && put_signal_nbi(cx, s, s, 0, s, v, int(p), SIGNAL_SET))) peer_fail(P, p);
  }
  for (uint32_t j = g.tid; j < R; j += g.bdim) {
    if (j == P.rank || peer_out(P, j)) continue;
    if (!wait_peer(P, j, barrier_sig(P, j), v)) peer_fail(P, j);
  }
  arch::syncthreads();
}

// One block. After it, every live rank's signal counts equal what arrived: a launch that failed
// half way, or a masked peer's late signals, no longer shift what the next launch waits for.
GPUNET_DEVICE void clean(const LlParams& P, const Geo& g) {
  if (g.bid != 0) return;
  const uint64_t e = *clean_epoch(P) + 1;
  arch::syncthreads();  // (every thread read it before thread 0 moves it on)
  if (g.tid == 0) *clean_epoch(P) = e;
  barrier_live(P, g, 2 * e - 1);
  for (uint32_t i = g.tid; i < 4 * P.nranks; i += g.bdim)
    ptr<uint64_t>(P.expected)[i] = signal_read(peer_ctx(P, P.rank), ptr<const uint64_t>(P.sig) + i);
  for (uint32_t i = g.tid; i < 4; i += g.bdim)
    *self_expected(P, i / 2, i % 2) = arch::atomic_load(self_sig(P, i / 2, i % 2));
  for (uint32_t w = g.tid; w < SYNC_WORDS; w += g.bdim) arch::atomic_store(sync_word(P, w), uint64_t(0));
  // the direct dispatch's count tags: a source whose launch failed after its count rows left a
  // tag one ahead of its signal, the value its next count row carries too; after the resync
  // above that stale tag would pass the next wait before the new row is there
  for (uint32_t i = g.tid; i < 2 * P.nranks; i += g.bdim)
    arch::atomic_store(ptr<uint64_t>(P.sig) + 6 * uint64_t(P.nranks) + i, uint64_t(0));
  arch::syncthreads();
  barrier_live(P, g, 2 * e);
}

GPUNET_DEVICE void run(const LlParams& P) {
  const Geo g = geo();
  stamp(P, g, ST_BEGIN);
  if (P.op == OP_DISPATCH) {
    bool ok = true;
    if (P.phases & PH_SEND) ok = dispatch_send(P, g);
    if (ok && (P.phases & PH_RECV)) dispatch_recv(P, g);
  } else if (P.op == OP_COMBINE) {
    bool ok = true;
    if (P.phases & PH_SEND) ok = combine_send(P, g);
    if (ok && (P.phases & PH_RECV)) combine_recv(P, g);
  } else if (P.op == OP_CLEAN) {
    clean(P, g);
  }
  stamp(P, g, ST_END);
}

}  // namespace ep
}  // namespace gpunet
