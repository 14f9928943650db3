// gpunet/ep/ht.cuh — MoE expert-parallel HIGH-THROUGHPUT dispatch and combine (DeepEP V1's
// "normal" mode: training and prefill), on the user device API alone: it includes
// <gpunet/gpunet.cuh> (through ll.cuh, whose helpers it reuses: Geo, the per-peer contexts, the
// mask / failed words, EpStatus, the grid sync words) and moves data only with its verbs
// (put_nbi, put_signal_nbi with SIGNAL_SET, wait_until, signal_read, quiet_pe, fence) and plain
// stores through gpunet::ptr into a mapped (p2p) peer's ring.
//
// The host side is gpunet/ep/buffer.py (addresses, sizes, the Config); gpunet/device/ep.py mirrors
// HtParams; tests/test_ep_ht.py checks it against gpunet/ep/reference.py (ht_dispatch_ref /
// ht_combine_ref) on 2 and 4 ranks, warps of 32 and 64, over ibgda, proxy, p2p and mixed worlds.
//
// ------------------------------------------------------------------------------------------------
// Channels. The grid is 2 * nc blocks (nc = Config.num_sms / 2, so a launch never uses more
// blocks than the Config's SM count): block 2c SENDS channel c, block 2c+1 RECEIVES it. Channel c
// of a rank's T tokens is the contiguous range [T*c/nc, T*(c+1)/nc). Per (channel, peer pair)
// there is a RING of `ring` message slots in the receiver's heap (Config's
// num_max_nvl_chunked_recv_tokens) and a staging ring of the same size in the sender's heap; the
// whole buffer is a few rings, far smaller than the data (docs/EP.md gives the formula).
//
// Dispatch
//   NOTIFY (block 0): per (channel c, destination d) a warp scans is_token_in_rank with ballots:
//          send_pos[t][d] = the token's index among channel c's tokens going to d (-1: not sent),
//          send_cnt[c][d] = how many. One header per destination (counts per channel and per
//          local expert, plus hidden / nc / msg_stride / experts, checked by the receiver) is put
//          with a SET signal. Then block 0 waits (bounded, per source) for every live source's
//          header and writes chan_prefix[j][c] (where source j's channel-c rows start in recv_x:
//          sources in rank order, channels in order, tokens in order: DeepEP's rank_prefix
//          layout) and recv_info (rank prefix, aligned per-expert counts, total).
//   DATA   sender block c, in block-wide steps: every destination whose ring has room for its
//          next chunk gets up to `chunk` messages (the row — bf16, or fp8 + scales — then the
//          meta: source token, local expert ids (-1 elsewhere), weights (0 elsewhere)), staged by
//          all warps of the block into consecutive staging slots and put (one put, two when the
//          ring wraps; a mapped peer's messages are stored straight into its ring instead, no
//          staging and no put), then a SET of the tail word tail[c][me] on d to
//          (epoch << 32 | sent). A destination without room (the receiver's credit, head[c][d]
//          on this rank, SET by d) is only skipped for that step: a sender never blocks on one
//          destination, so no cycle of waits can form across ranks.
//          receiver block c: polls every live source's tail, copies whatever arrived to its rows
//          (chan_prefix[j][c] + index), SETs its credit back every `chunk` messages and at the end.
//          A sender finishes once every destination has CONSUMED all of its messages (its final
//          credit), so when a call returns the rings hold nothing of it: the next call may write.
//          RECEIVE POOL (F_HT_DESC / F_HT_DIRECT; docs/EP.md "The receive pool"): a receiver whose
//          receive tensors lie in its pool in the heap tells each mapped source where (a
//          descriptor, ht_send_descs), and that source stores its rows straight into them
//          (ht_deliver; no ring, no credit), its tails carrying kHtDirectBit.
// Combine (the reverse direction; expert side sends, token side reduces)
//   DATA   sender block c (expert side): for each source rank j, the rows
//          [chan_prefix[j][c], chan_prefix[j][c+1]) of x go back in order, with their weights.
//          receiver block c (token side): warps take channel c's tokens in rounds of one token
//          per warp; token t's row from d sits at ring slot send_pos[t][d] (its dispatch index),
//          so each warp waits (bounded) for exactly that row: out[t] = bf16(bias0 + bias1 +
//          sum over d ascending of row_d) in float32 (deterministic: same inputs, same bits), and
//          combined weights = sum of the rows' weights. Credits after each round.
//          A round needs at most nwarps slots past the last credit: the host checks
//          ring >= 2 * chunk + 32 so a sender waiting for room never waits on a row the receiver
//          needs first.
//          IN PLACE (F_HT_PULL: x in the receive pool; a peer that may load from it): the sender
//          gives the token side a descriptor instead of the rows and the token side loads them
//          from the peer's pool (ht_offer_pull / ht_take_pull: "the in-place combine" below).
//
// Signals: every word has ONE writer and is SET (never added) to (epoch << 32 | count): the store
// form every transport has (c500 p2p peers take no ADD). The epoch is a device word, the same on
// every rank (each HT op bumps it by one at its end), so a word left over from an earlier call is
// always below what this call waits for, and nothing needs resetting between calls. A rank's own
// tokens never touch a ring: its dispatch sender stores them straight into their receive rows
// (the notify step gave their positions), and its combine receiver reads its own rows from x in
// place (x stays valid for the launch).
//
// Failures: as the LL kernels (ll.cuh): per-peer device contexts, a peer that fails or stays
// silent for timeout_ns (no credit, no tail progress, no header) is marked failed (masked with
// F_SHRINK) and skipped from then on, never waited for again; the host raises EPTimeout or masks.
// Grid-internal waits are bounded and recorded in EpStatus. Nothing traps; every block leaves.
#pragma once

#include <stdint.h>

#include <gpunet/ep/ll.cuh>

namespace gpunet {
namespace ep {

constexpr uint32_t kHtMaxChannels = 64;    // signal words are laid out for this many channels
constexpr uint32_t kHtMaxChunk = 64;       // messages per send step (Config's send chunk, checked)
constexpr uint32_t kHtMetaBytes = 16 + 8 * kMaxTopk;  // t, K, op, ring; K local ids; K weights
constexpr uint32_t kHtHdrHead = 9;         // magic, hidden, nc | ring << 8, msg_stride, experts, total, K,
                                           // notify tag (ht_rhdr), op counter (HtParams::epoch[0])
constexpr int32_t kHtMagic = 0x48544550;   // "PETH": a header of this mode
enum : uint32_t { OP_HT_DISPATCH = 3, OP_HT_COMBINE = 4 };
enum : uint32_t { PH_NOTIFY = 1, PH_DATA = 2 };
enum : uint32_t {
  F_HT_TOPK = 64,       // topk_idx / topk_weights are present
  F_HT_WEIGHTS = 128,   // topk_weights present (combine: weights travel back)
  F_HT_BUMP = 256,      // this launch ends the op: the last block bumps the epoch
  F_HT_WORST = 512,     // num_worst_tokens: recv rows are fixed (num_recv_max); check, no host sync
  F_HT_DESC = 1024,     // dispatch data: receivers send mapped sources their receive descriptor
                        // (every rank has a receive pool: the flag is the same on every rank)
  F_HT_DIRECT = 2048,   // dispatch data: this rank's receive tensors lie in its pool (HtParams::pool)
  F_HT_PRE = 4096,      // dispatch: the data launch went before the host read the counts ("The
                        // prelaunched data phase" in run_ht); the notify writes its go word
  F_HT_PULL = 8192,     // combine: this rank's x (and topk_weights) lie in its receive pool, so
                        // peers that can load from it read their rows in place (ht_offer_pull)
  F_HT_SPLIT = 32768,   // combine with F_HT_PULL: a sender block whose rows are all loaded in place
                        // may reduce half its channel's tokens (ht_split_claim); bit 16384 is free
};
// A dispatch tail word's count with this bit: the rows were stored straight into the receive
// tensors ("Receive pool" above), nothing to copy out of a ring and no credit to give.
constexpr uint64_t kHtDirectBit = 1ull << 31;
// The receive descriptor (u64 words) a receiver stores into each mapped source's rdesc[receiver]:
enum : uint32_t { RD_DIRECT = 0, RD_ROW0 = 1, RD_ROWS = 2, RD_X = 3, RD_SCALES = 4, RD_TOPK = 5,
                  RD_WEIGHTS = 6, RD_SRC = 7, RD_WORDS = 8 };
constexpr uint64_t kHtNoTensor = ~0ull;  // an RD_* offset: the call has no such tensor
enum : uint32_t { HT_KIND_DISPATCH = 0, HT_KIND_COMBINE = 1 };
// grid sync words (HtParams::base.sync)
enum : uint32_t { HT_SYNC_NOTIFY = 0, HT_SYNC_END = 1 };
// EpStatus codes and sites of this mode (gpunet/device/ep.py: EP_ERR_WORST, EP_SITE_HT_*)
enum : uint32_t { EP_ERR_WORST = 5, EP_ERR_OUT_OF_STEP = 6 };
enum : uint32_t { EP_SITE_HT_HEADER = 8, EP_SITE_HT_NOTIFY = 9, EP_SITE_HT_WORST = 10, EP_SITE_HT_BULK = 12,
                  EP_SITE_HT_COMBINE_ROW = 14 };
// LlParams::prof (HtParams::base.prof; bench/ep_ht.py --profile): per block, thread 0 stores
// now_ns() at the points below and, at the block's end, what it summed over its loop (ns and
// counts, thread 0's view: it takes part in every step). 0 = not reached. Slots below ll.cuh's
// kStamps; gpunet/device/ep.py HT_ST_NAMES names them.
enum : uint32_t {
  HT_ST_BEGIN = 0,         // data launch: the block enters
  HT_ST_END = 1,           // data launch: the block's loop is over (before the end-of-op barrier)
  HT_ST_NOTIFY_BEGIN = 2,  // block 0: notify starts
  HT_ST_NOTIFY_SENT = 3,   // block 0: send_pos / counts computed and the headers posted
  HT_ST_NOTIFY_END = 4,    // block 0: every source's header seen, prefixes written
  HT_ST_FIRST = 5,         // sender: first chunk posted; receiver: first rows seen
  HT_ST_T_MOVE = 6,        // sum ns: sender staging (+ p2p stores); receiver copying / reducing
  HT_ST_T_POST = 7,        // sum ns: sender puts + tail signals; receiver credits
  HT_ST_T_IDLE = 8,        // sum ns: steps that moved nothing (no credit / nothing arrived);
                           // combine receiver: warp 0's waits for its tokens' rows (part of T_MOVE)
  HT_ST_STEPS = 9,         // count: loop steps (receiver combine: rounds)
  HT_ST_IDLE_STEPS = 10,   // count: steps that moved nothing
  HT_ST_ITEMS = 11,        // count: messages moved by the block
  HT_ST_NOTIFY_POS = 12,   // block 0: send_pos / send_cnt computed (before the headers' fill)
};
static_assert(uint32_t(HT_ST_NOTIFY_POS) < uint32_t(kStamps), "HT stamps share LlParams::prof's rows");

// Thread 0's phase clock for the stamps: lap() returns the ns since the previous lap (0 without
// a profile: no clock reads).
struct HtClock {
  bool on;
  uint64_t t;
  GPUNET_DEVICE uint64_t lap() {
    if (!on) return 0;
    const uint64_t n = arch::now_ns(), d = n - t;
    t = n;
    return d;
  }
};
GPUNET_DEVICE HtClock ht_clock(const LlParams& B, const Geo& g) {
  HtClock c;
  c.on = B.prof != 0 && g.tid == 0;
  c.t = c.on ? arch::now_ns() : 0;
  return c;
}
// The sums go straight to the block's row (the host zeroes it before the call): counters kept in
// registers across the loops took nvcc from 128 to 198 registers a thread.
GPUNET_DEVICE void ht_stamp_add(const LlParams& B, const Geo& g, uint32_t which, uint64_t v) {
  if (B.prof && g.tid == 0) ptr<uint64_t>(B.prof)[uint64_t(g.bid) * kStamps + which] += v;
}
// One loop step of a sender or dispatch receiver: it moved `items` messages (0: it waited).
GPUNET_DEVICE void ht_step_stamps(const LlParams& B, const Geo& g, const HtClock& clk, uint64_t items,
                                  uint64_t dt_move, uint64_t dt_post) {
  if (!clk.on) return;
  uint64_t* row = ptr<uint64_t>(B.prof) + uint64_t(g.bid) * kStamps;
  row[HT_ST_STEPS] += 1;
  if (items) {
    row[HT_ST_T_MOVE] += dt_move;
    row[HT_ST_T_POST] += dt_post;
    if (!row[HT_ST_ITEMS]) row[HT_ST_FIRST] = clk.t;
    row[HT_ST_ITEMS] += items;
  } else {
    row[HT_ST_T_IDLE] += dt_move + dt_post;
    row[HT_ST_IDLE_STEPS] += 1;
  }
}

// per-(channel, peer) state words in HtParams::ws (device memory, set up at every launch)
// (WS_MAPPED: the sender's, d's ring slot 0 as mapped here; the combine receiver keeps its words
// in shared memory: ht_recv_words)
// (WS_HB: the peer's heartbeat word as last read, bit 63 set; 0 = not read yet: ht_silent)
enum : uint32_t { WS_SENT = 0, WS_CURSOR = 1, WS_TLAST = 2, WS_CREDIT = 3, WS_DONE = 4, WS_TOTAL = 5,
                  WS_AVAIL = 6, WS_MAPPED = 7, WS_HB = 8,
                  // sender, a destination whose receive tensors are in its pool (0: not direct):
                  // this channel's first row there, then the tensors' addresses as mapped here
                  WS_ROW = 9, WS_OX = 10, WS_OS = 11, WS_OI = 12, WS_OW = 13, WS_OSRC = 14,
                  // combine sender: 1 while d loads this channel's rows in place (ht_offer_pull)
                  WS_PULL = 15, WS_WORDS = 16 };

// One launch's arguments, by value. `base` carries what ll.cuh's helpers read (op, flags, rank,
// nranks, experts, hidden, topk, num_tokens, msg_stride, payload_bytes, hdr_stride, ctxs,
// timeout_ns, mask, failed, got, nrecv, status_flag, status, sync). gpunet/device/ep.py: HtParams.
struct HtParams {
  LlParams base;
  uint32_t nchannels, ring, chunk, num_recv_max;  // num_recv_max: rows of the receive tensors
  uint32_t alignment, nbias;
  uint64_t peer_timeout_ns;  // how long a silent peer (no header, no tail progress, no credit) is waited for
  uint64_t epoch;        // u64 device words: [0] the op counter (same on every rank), [1] the
                         // notifies run (the same on every rank: ht_rhdr's slot, h[7]'s tag)
  uint64_t sig;          // heap: tail[2 kinds][kHtMaxChannels][R], head[2][kHtMaxChannels][R], hdr[R],
                         // hb[R] (each source's heartbeat, ht_heartbeat)
  uint64_t self_sig;     // device: u64 [2 kinds][2 (tail, head)][kHtMaxChannels], then the time of
                         // this rank's last heartbeat
  uint64_t send_ring;    // heap: [nc][R][ring] messages of msg_stride bytes (this op's kind)
  uint64_t recv_ring;    // heap: [nc][R][ring]
  uint64_t shdr, rhdr;   // heap: shdr [R], rhdr [2 notify parities][R] headers of hdr_stride bytes
  uint64_t x;            // dispatch: bf16 [T, H] or fp8 [T, H]; combine: bf16 [N_recv, H]
  uint64_t x_scales;     // dispatch fp8: float [T, H/128]
  uint64_t topk_idx;     // dispatch: int64 [T, K] (or 0)
  uint64_t topk_weights; // dispatch: float [T, K]; combine: float [N_recv, K] (or 0)
  uint64_t in_rank;      // dispatch notify: bool [T, R]
  uint64_t ntpe;         // dispatch notify: int32 [E] num_tokens_per_expert (or 0)
  uint64_t out_x;        // dispatch: [num_recv_max, H] bf16 | fp8; combine: bf16 [T, H]
  uint64_t out_scales;   // dispatch fp8: float [num_recv_max, H/128]
  uint64_t out_topk_idx; // dispatch: int64 [num_recv_max, K]
  uint64_t out_weights;  // dispatch: float [num_recv_max, K]; combine: float [T, K] (or 0)
  uint64_t out_src_idx;  // dispatch: int32 [num_recv_max]
  uint64_t send_pos;     // int32 [T, R]
  uint64_t send_cnt;     // int32 [nc, R]
  uint64_t chan_prefix;  // int32 [R, nc + 1]
  uint64_t recv_info;    // int32 [R + 2 + E_loc]: rank prefix (R + 1 entries), aligned expert counts,
                         // the prelaunched data phase's go word (run_ht)
  uint64_t bias0, bias1; // combine: bf16 [T, H] (or 0)
  uint64_t ws;           // device: u64 [2 (send, recv)][nc][R][WS_WORDS], int32 [R], int32 [nc][R][kHtMaxChunk]
                         // (laid out for nc = kHtMaxChannels), then u64 [kHtMaxChannels][R + 2] (ht_split_words)
  uint64_t host_info;    // dispatch notify: mapped host int32 [1 + R + 2 + E_loc] (or 0): recv_info's
                         // words at [1..], then [0] = 1 (a release): the host reads the counts
                         // without a stream synchronisation
  uint64_t pool;         // heap: this rank's receive pool (F_HT_DESC; symmetric: a peer's is at the
                         // same offset of its heap), the base of the RD_* offsets
  uint64_t rdesc;        // heap: [R] receive descriptors of RD_WORDS u64, slot d written by d
  uint64_t pool_bytes;   // the pool's size
};
static_assert(sizeof(HtParams) == 616, "HtParams layout is mirrored in gpunet/device/ep.py");

// ---- small helpers ------------------------------------------------------------------------------

GPUNET_HOST_DEVICE uint32_t ctz64(uint64_t x) { return popc64((x & (~x + 1)) - 1); }

// The count a SET word holds for this op's epoch: 0 when the word is from an earlier op.
GPUNET_DEVICE uint64_t count_of(uint64_t v, uint64_t epoch) {
  const uint64_t e = v >> 32;
  if (e == epoch) return v & 0xffffffffull;
  return e > epoch ? 0xffffffffull : 0;
}
GPUNET_DEVICE uint64_t* ht_tail(const HtParams& P, uint32_t kind, uint32_t c, uint32_t j) {
  return ptr<uint64_t>(P.sig) + ((uint64_t(kind) * kHtMaxChannels + c) * P.base.nranks + j);
}
GPUNET_DEVICE uint64_t* ht_head(const HtParams& P, uint32_t kind, uint32_t c, uint32_t d) {
  return ptr<uint64_t>(P.sig) + ((uint64_t(2 + kind) * kHtMaxChannels + c) * P.base.nranks + d);
}
GPUNET_DEVICE uint64_t* ht_hdr_sig(const HtParams& P, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(4) * kHtMaxChannels * P.base.nranks + j);
}
GPUNET_DEVICE uint64_t* ht_hb(const HtParams& P, uint32_t j) {
  return ptr<uint64_t>(P.sig) + (uint64_t(4) * kHtMaxChannels * P.base.nranks + P.base.nranks + j);
}
// The signal of the receive descriptor destination d stored here (rdesc[d]).
GPUNET_DEVICE uint64_t* ht_desc_sig(const HtParams& P, uint32_t d) {
  return ptr<uint64_t>(P.sig) + (uint64_t(4) * kHtMaxChannels * P.base.nranks + 2 * P.base.nranks + d);
}
GPUNET_DEVICE uint64_t* ht_self(const HtParams& P, uint32_t kind, uint32_t head, uint32_t c) {
  return ptr<uint64_t>(P.self_sig) + ((uint64_t(kind) * 2 + head) * kHtMaxChannels + c);
}
GPUNET_DEVICE uint64_t* ws_word(const HtParams& P, uint32_t recv, uint32_t c, uint32_t p, uint32_t w) {
  return ptr<uint64_t>(P.ws) +
         (((uint64_t(recv) * P.nchannels + c) * P.base.nranks + p) * WS_WORDS + w);
}
// Notify's per-source scratch (int32 [R]) after the per-(channel, peer) state words.
GPUNET_DEVICE int32_t* notify_scratch(const HtParams& P) {
  return ptr<int32_t>(P.ws + uint64_t(2) * P.nchannels * P.base.nranks * WS_WORDS * 8);
}
GPUNET_DEVICE uint64_t chan_begin(uint64_t T, uint32_t nc, uint32_t c) { return T * c / nc; }
// Source j's header of this rank's notify number `nt` (HtParams::epoch[1]) in this rank's heap:
// one slot per notify PARITY. The notify reads the headers again after its barrier (prefixes,
// expert counts), which waits for the slowest source; a source that exchanges no rows with this
// rank can meanwhile finish the dispatch, run a combine (and cached dispatches: no notify) and
// start its next notify, whose header then lands in the OTHER slot. Its notify after that waits
// for this rank's next header, so it cannot write this slot again before this notify is over; a
// source that masked this rank sends it no header at all. (A slot per op-epoch parity failed:
// dispatch, combine, dispatch is two epochs, the same slot; a tag in h[7] says which notify.)
GPUNET_DEVICE uint64_t ht_rhdr(const HtParams& P, uint32_t j, uint64_t nt) {
  return P.rhdr + ((nt & 1) * P.base.nranks + j) * uint64_t(P.base.hdr_stride);
}
GPUNET_DEVICE uint64_t slot_addr(const HtParams& P, uint64_t ring, uint32_t c, uint32_t p, uint64_t i) {
  return ring + ((uint64_t(c) * P.base.nranks + p) * P.ring + i % P.ring) * P.base.msg_stride;
}

// Waits on a peer fall in two kinds. DIRECT: a header, or a combine row the peer must have sent
// already (within its credit window): timeout_s (peer_timeout_ns). INDIRECT: a sender's credit
// or a dispatch receiver's tail progress, which a LIVE peer may hold back while it waits directly
// on a dead one (a combine receiver stuck on a dead rank's row credits nobody meanwhile): twice
// that plus a second, so a live rank is never taken for dead because a third one died
// (tests/test_ep_ht.py: the killed-rank tests, which mask or raise exactly the dead rank). A
// rank's own traffic is never timed out (its receiver is bounded by its own direct waits).
// Bounds alone cannot tell a dead peer from a live one that waits out a dead third rank: a rank
// dying amid a dispatch's data can leave one survivor with all its rows (into combine at once, a
// direct wait on the other's rows) while the other waits out the dead rank's tail (indirect):
// the first then masked the LIVE second (found by tests/test_ep_ht.py
// test_a_rank_that_dies_at_any_moment_leaves_the_survivors_exact, about 1 death in 10 in that
// window; a longer fixed bound for a peer's first word of an op only moved the race). So a rank
// that waits also says it is alive: HEARTBEATS (ht_heartbeat, from the idle steps of every loop
// that waits on a peer), and a bound that runs out on peer d is only final when d's heartbeat
// word has not moved since it was last read (ht_silent). A dead rank beats no more: it is masked
// at most two heartbeat periods (half a timeout_s) later than before. (The LL kernels beat the
// same way: ll.cuh "heartbeats", whose helpers these are.)
// The notify's wait for a header is direct and beats too (ll.cuh wait_peer with ht_beat). While
// it waits out a dead source, its rank sends nothing, so its peers' dispatch waits on it are
// indirect and end with it (tests/test_ep_ht.py
// test_a_rank_late_from_waiting_out_a_dead_one_is_not_masked, which held with a plain bound
// too). But the header comes from a peer that may still be in the PREVIOUS op, waiting out a dead
// rank that this rank had already masked (its combine receiver for a bound and a half, its
// sender until then: failed_meanwhile). With a plain bound this rank masked that LIVE peer in the
// next notify (test_a_rank_still_waiting_out_a_dead_one_is_not_masked_by_the_next_notify). The
// grid waits (LlParams::timeout_ns: the data blocks wait for the notify when both run in one
// launch) are above hb_cap + timeout_s (host: 7 x timeout_s + 4 s).
GPUNET_DEVICE uint64_t indirect_timeout(const HtParams& P) {
  return 2 * P.peer_timeout_ns + 1000000000ull;
}
// The longest a loop waits on a peer that keeps beating (from the loop's start): a live peer is
// late by at most its own indirect wait on a dead rank and that rank's second look.
GPUNET_DEVICE uint64_t hb_cap(const HtParams& P) { return 3 * indirect_timeout(P); }

// HT's heartbeats (ll.cuh "heartbeats": heartbeat, silent): a period of a quarter of timeout_s
// (a live waiting rank beats at least twice within silent's second look), hb[R] after the header
// signals, the time of the last beat after the self words. Called from idle steps only.
GPUNET_DEVICE Beat ht_beat(const HtParams& P) {
  return Beat{ht_hb(P, 0), ptr<uint64_t>(P.self_sig) + uint64_t(4) * kHtMaxChannels,
              P.peer_timeout_ns / 4, hb_cap(P)};
}
GPUNET_DEVICE void ht_heartbeat(const HtParams& P, uint64_t now, const uint8_t* out) {
  heartbeat(P.base, ht_beat(P), now, out);
}
GPUNET_DEVICE bool ht_silent(const HtParams& P, uint32_t d, uint64_t* seen, uint64_t* tlast,
                             uint64_t bound, uint64_t now, uint64_t t_start) {
  return silent(P.base, ht_beat(P), d, seen, tlast, bound, now, t_start);
}

// An indirect wait on peer d that has seen no progress for a direct bound (timeout_s) ends at
// once when another wait of this rank has marked d failed meanwhile (the mask / failed words: the
// block's view `out` is a copy from the launch's start). Without it a combine sender waited the
// whole indirect bound and a half for a dead rank's credit after its own receiver had given up on
// that rank (~8.5 s against ~4.5 on a 3 s bound: tests/test_ep_ht.py
// test_a_rank_still_waiting_out_a_dead_one_is_not_masked_by_the_next_notify). Those words are
// host memory on GPUs (a PCIe read), so they are read only past the direct bound.
GPUNET_DEVICE bool failed_meanwhile(const HtParams& P, uint32_t d, uint64_t idle) {
  return idle > P.peer_timeout_ns && peer_out(P.base, d);
}

// The count peer p's SET word (or this rank's own device word) holds for this op: the
// receiver's credit (head) or the sender's progress (tail). Acquire.
GPUNET_DEVICE uint64_t read_count(const HtParams& P, uint32_t kind, uint32_t head, uint32_t c,
                                  uint32_t p, uint64_t epoch) {
  if (p == P.base.rank) {
    const uint64_t v = arch::atomic_load(ht_self(P, kind, head, c));
    arch::fence_sys();
    return count_of(v, epoch);
  }
  const uint64_t* w = head ? ht_head(P, kind, c, p) : ht_tail(P, kind, c, p);
  return count_of(signal_read(peer_ctx(P.base, p), w), epoch);
}

// SET peer p's word (tail of channel c for this rank as source, or head as destination) to
// (epoch << 32 | n), after the payload put before it (same QP / channel: in order), and after
// what the block stored or loaded before its last barrier (the rows staged or stored into p's
// ring, the rows read out of this rank's ring before a credit). A NIC peer: fence() first (the
// NIC reads the staging from memory). A mapped peer (p2p): the SET is itself a release store
// (transport/p2p.cuh signal_store; device scope when p's heap is on this GPU), cumulative over
// the block barrier, so the system fence (~1-2 us on the H200, one per step and destination) is
// not needed: the p2p rounds of tests/test_ep_ht.py (ht_then_ll) and the bench's bit-exact
// check on the H200 guard it. false: the verb failed (the caller marks the peer).
GPUNET_DEVICE bool write_count(const HtParams& P, uint32_t kind, uint32_t head, uint32_t c,
                               uint32_t p, uint64_t epoch, uint64_t n) {
  const uint64_t v = (epoch << 32) | n;
  if (p == P.base.rank) {
    arch::fence_sys();
    arch::atomic_store(ht_self(P, kind, head, c), v);
    return true;
  }
  uint64_t* w = head ? ht_head(P, kind, c, P.base.rank) : ht_tail(P, kind, c, P.base.rank);
  const DevCtx& cx = peer_ctx(P.base, p);
  const bool mapped = gpunet::ptr(cx, w, int(p)) != nullptr;
  return (mapped || fence(cx)) && put_signal_nbi(cx, w, w, 0, w, v, int(p), SIGNAL_SET);
}

// ---- notify (dispatch, block 0) ---------------------------------------------------------------

GPUNET_DEVICE void ht_notify(const HtParams& P, const Geo& g, uint64_t epoch) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels, EL = B.e_loc;
  const uint64_t nt = arch::atomic_load(ptr<const uint64_t>(P.epoch) + 1);  // notifies run before
  // the ring size in the header too: ranks whose Configs differ in it address each other's rings
  // at other offsets (the layout's receive half starts after the send rings)
  const uint32_t shape = nc | (P.ring << 8);
  const uint64_t T = B.num_tokens;
  const uint8_t* in_rank = ptr<const uint8_t>(P.in_rank);
  int32_t* send_pos = ptr<int32_t>(P.send_pos);
  int32_t* send_cnt = ptr<int32_t>(P.send_cnt);
  const uint64_t below = g.lane == 0 ? 0 : (~uint64_t(0) >> (64 - g.lane));
  stamp(B, g, HT_ST_NOTIFY_BEGIN);
  // send_pos / send_cnt: a warp per (channel, group of kPosDests destinations), ws tokens per
  // ballot; each lane loads kRounds ballots' flags of every destination of the group before the
  // first store (a store to send_pos may alias in_rank, so a load-ballot-store loop waits one
  // memory latency per ballot). With a warp per (channel, destination) the H100's notify spent
  // 9.5 us of its 26 here (2 ranks, 32 channels, 16 warps: 4 items a warp, now 2).
  constexpr uint32_t kRounds = 4, kPosDests = 2;  // larger ones spill in the kernel (nvcc 13, sm_90)
  const uint32_t groups = (R + kPosDests - 1) / kPosDests;
  for (uint32_t it = g.wid; it < nc * groups; it += g.nwarps) {
    const uint32_t c = it / groups, d0 = (it % groups) * kPosDests;
    const uint32_t nd = R - d0 < kPosDests ? R - d0 : kPosDests;
    const uint64_t cb = chan_begin(T, nc, c), ce = chan_begin(T, nc, c + 1);
    uint32_t run[kPosDests] = {};
    for (uint64_t t0 = cb; t0 < ce; t0 += uint64_t(g.ws) * kRounds) {
      bool in[kRounds][kPosDests];
#pragma unroll
      for (uint32_t u = 0; u < kRounds; ++u) {
        const uint64_t t = t0 + uint64_t(u) * g.ws + g.lane;
#pragma unroll
        for (uint32_t q = 0; q < kPosDests; ++q) in[u][q] = q < nd && t < ce && in_rank[t * R + d0 + q] != 0;
      }
#pragma unroll
      for (uint32_t u = 0; u < kRounds; ++u) {
        const uint64_t t = t0 + uint64_t(u) * g.ws + g.lane;
#pragma unroll
        for (uint32_t q = 0; q < kPosDests; ++q) {
          if (q >= nd) continue;  // uniform in the warp: every lane ballots the same destinations
          const uint64_t bits = arch::ballot(in[u][q]);
          if (t < ce) send_pos[t * R + d0 + q] = in[u][q] ? int32_t(run[q] + popc64(bits & below)) : -1;
          run[q] += popc64(bits);
        }
      }
    }
    if (g.lane == 0)
#pragma unroll
      for (uint32_t q = 0; q < kPosDests; ++q)  // (a fixed trip count keeps run[] in registers)
        if (q < nd) send_cnt[uint64_t(c) * R + d0 + q] = int32_t(run[q]);
  }
  // A NIC peer's (or the proxy's) read of the previous header's staging, shdr[d], may still be
  // pending: nothing else of HT quiets a peer it sent no rows to (ht_send quiets only after rows),
  // and the rewrite below would go out under the old signal. Mapped peers took it by stores.
  for (uint32_t d = g.tid; d < R; d += g.bdim)
    if (d != B.rank && !peer_out(B, d) && gpunet::ptr(peer_ctx(B, d), ptr<void>(P.shdr), int(d)) == nullptr &&
        !quiet_pe(peer_ctx(B, d), int(d)))
      peer_fail(B, d);
  arch::syncthreads();
  stamp(B, g, HT_ST_NOTIFY_POS);
  // one header per destination: its count words filled by the whole block (one load and store a
  // thread, not nc + E_loc dependent pairs in one thread), then its head by thread d
  const uint32_t hdr_words = kHtHdrHead + nc + EL;
  auto hdr_of = [&](uint32_t d) {
    return ptr<int32_t>(d == B.rank ? ht_rhdr(P, B.rank, nt) : P.shdr + uint64_t(d) * B.hdr_stride);
  };
  for (uint32_t i = g.tid; i < R * (nc + EL); i += g.bdim) {
    const uint32_t d = i / (nc + EL), w = i % (nc + EL);
    if (peer_out(B, d)) continue;
    hdr_of(d)[kHtHdrHead + w] = w < nc ? send_cnt[uint64_t(w) * R + d]
                                       : P.ntpe ? ptr<const int32_t>(P.ntpe)[uint64_t(d) * EL + w - nc] : 0;
  }
  arch::syncthreads();
  for (uint32_t d = g.tid; d < R; d += g.bdim) {
    if (peer_out(B, d)) continue;
    const bool self = d == B.rank;
    int32_t* h = hdr_of(d);
    int64_t total = 0;
    batched(nc, [&](uint32_t c) { return send_cnt[uint64_t(c) * R + d]; },
            [&](uint32_t, int64_t v) { total += v; });
    h[0] = kHtMagic;
    h[1] = int32_t(B.hidden);
    h[2] = int32_t(shape);
    h[3] = int32_t(B.msg_stride);
    h[4] = int32_t(B.num_experts);
    h[5] = int32_t(total);
    h[6] = int32_t(B.topk);
    h[7] = int32_t(uint32_t(nt));  // the tag the receiver checks (ht_rhdr)
    h[8] = int32_t(uint32_t(epoch));  // and the op counter (see the check below)
    if (self) continue;
    const DevCtx& cx = peer_ctx(B, d);
    const uint64_t rh = ht_rhdr(P, B.rank, nt);
    if (!(fence(cx) && put_signal_nbi(cx, ptr<void>(rh), h, uint64_t(hdr_words) * 4,
                                       ht_hdr_sig(P, B.rank), (epoch << 32) | 1, int(d), SIGNAL_SET)))
      peer_fail(B, d);
  }
  arch::syncthreads();  // this rank's own header (stored above) is complete
  stamp(B, g, HT_ST_NOTIFY_SENT);
  // every live source's header (bounded per source: headers go out unconditionally first)
  int32_t* info_dev = ptr<int32_t>(P.recv_info);
  int32_t* info_host = P.host_info ? ptr<int32_t>(P.host_info) + 1 : nullptr;
  auto set_info = [&](uint32_t i, int32_t v) {
    info_dev[i] = v;
    if (info_host) info_host[i] = v;
  };
  int32_t* pre = ptr<int32_t>(P.chan_prefix);
  int32_t* nrecv = ptr<int32_t>(B.nrecv);
  int32_t* got = ptr<int32_t>(B.got);
  for (uint32_t j = g.tid; j < R; j += g.bdim) {
    bool ok = !peer_out(B, j);
    if (ok && j != B.rank) {
      // a DIRECT wait (timeout_s), with heartbeats: j may still be in the previous op, waiting
      // out a dead rank (see "Waits on a peer" above)
      ok = wait_peer(B, j, ht_hdr_sig(P, j), (epoch << 32) | 1, api::waiter(peer_ctx(B, j)), ht_beat(P));
      if (!ok) peer_fail(B, j);
    }
    const int32_t* h = ptr<const int32_t>(ht_rhdr(P, j, nt));
    if (ok && (h[0] != kHtMagic || uint32_t(h[1]) != B.hidden || uint32_t(h[2]) != shape ||
               uint32_t(h[3]) != B.msg_stride || uint32_t(h[4]) != B.num_experts)) {
      ep_fail(B, EP_ERR_MISMATCH, EP_SITE_HT_HEADER, j, (uint64_t(shape) << 32) | B.hidden,
              (uint64_t(uint32_t(h[2])) << 32) | uint32_t(h[1]), 0);
      ok = false;
    }
    if (ok && uint32_t(h[7]) != uint32_t(nt)) {  // another notify's header: the ranks are out of step
      ep_fail(B, EP_ERR_BAD_MESSAGE, EP_SITE_HT_HEADER, j, uint32_t(nt), uint32_t(h[7]), 0);
      ok = false;
    }
    // The same notify at another op: a rank whose host refused a call without a notify (a
    // combine, a cached dispatch) before its launch while its peers ran it. It is an op behind
    // for good: the wait above takes a later op's header signal (>=), and count_of a later op's
    // words for complete ones, or (a skipped dispatch) the words the peer left of that op for
    // this one's (tests/test_ep_ht.py test_a_rank_left_an_operation_behind_is_told_it_is_out_of_step:
    // stale ring rows returned as received). The peer ahead never gets a header it waits for
    // from this rank (it masks it or raises), so only the rank behind sees it, here.
    if (ok && uint32_t(h[8]) != uint32_t(epoch)) {
      ep_fail(B, EP_ERR_OUT_OF_STEP, EP_SITE_HT_HEADER, j, uint32_t(epoch), uint32_t(h[8]), 0);
      ok = false;
    }
    int64_t sum = 0;
    if (ok)  // batched: a loop that stops at the first negative count waits for each load in turn
      batched(nc, [&](uint32_t c) { return h[kHtHdrHead + c]; }, [&](uint32_t, int64_t v) {
        if (v < 0) ok = false;
        sum += v;
      });
    if (ok && sum != h[5]) {
      ep_fail(B, EP_ERR_BAD_MESSAGE, EP_SITE_HT_HEADER, j, uint64_t(h[5]), uint64_t(sum), 0);
      ok = false;
    }
    got[j] = ok ? 1 : 0;
    nrecv[j] = ok ? h[5] : 0;
    notify_scratch(P)[j] = ok ? 1 : 0;
  }
  arch::syncthreads();
#if defined(GPUNET_TEST_HT_NOTIFY_STALL_NS)
  // (tests/test_ep_ht.py) a stall where the barrier above waits for a slow source: the headers
  // are read again below, after it (ht_rhdr)
  if (g.tid == 0)
    for (const uint64_t t0 = arch::now_ns(); arch::now_ns() - t0 < uint64_t(GPUNET_TEST_HT_NOTIFY_STALL_NS);)
      arch::spin_pause();
  arch::syncthreads();
#endif
  if (g.tid == 0) {
    int64_t run = 0;
    for (uint32_t j = 0; j < R; ++j) {
      const bool ok = notify_scratch(P)[j] != 0;
      const int32_t* h = ptr<const int32_t>(ht_rhdr(P, j, nt));
      set_info(j, int32_t(run));
      // batched: the stores to pre may alias the header loads (one latency per channel otherwise)
      batched(nc, [&](uint32_t c) { return ok ? h[kHtHdrHead + c] : 0; },
              [&](uint32_t c, int64_t v) {
                pre[uint64_t(j) * (nc + 1) + c] = int32_t(run);
                run += v;
              });
      pre[uint64_t(j) * (nc + 1) + nc] = int32_t(run);
    }
    set_info(R, int32_t(run));
    if ((B.flags & F_HT_WORST) && run > int64_t(P.num_recv_max))
      ep_fail(B, EP_ERR_WORST, EP_SITE_HT_WORST, B.rank, P.num_recv_max, uint64_t(run), 0);
    // the prelaunched data phase's go word (run_ht): the rows fit the receive tensors the host
    // allocated before it knew them (num_recv_max; at least half used: Buffer._ht_recv_fit's
    // rule) and the notify saw every rank's header with nothing failed or masked
    bool go = (B.flags & F_HT_PRE) && !ep_failed(B) && run <= int64_t(P.num_recv_max) &&
              run >= int64_t(P.num_recv_max / 2);
    for (uint32_t j = 0; go && j < R; ++j) go = notify_scratch(P)[j] != 0 && !peer_out(B, j);
    set_info(R + 1 + EL, go ? 1 : 0);
  }
  for (uint32_t le = g.tid; le < EL; le += g.bdim) {
    int64_t n = 0;
    for (uint32_t j = 0; j < R; ++j)
      if (notify_scratch(P)[j])
        n += ptr<const int32_t>(ht_rhdr(P, j, nt))[kHtHdrHead + nc + le];
    const int64_t a = P.alignment ? int64_t(P.alignment) : 1;
    set_info(R + 1 + le, int32_t((n + a - 1) / a * a));
  }
  arch::syncthreads();
  if (info_host && g.tid == 0) {  // after every thread's words (the barrier; the fence is cumulative)
    arch::fence_sys();
    arch::store_release_sys(ptr<uint32_t>(P.host_info), 1u);
  }
  if (g.tid == 0) arch::atomic_store(ptr<uint64_t>(P.epoch) + 1, nt + 1);  // every read above is done
  stamp(B, g, HT_ST_NOTIFY_END);
}

// ---- the sender (block 2c): dispatch tokens or combine rows to every destination ------------------

// Slot k of token `src` as destination d sees it: the local expert id (-1: not on d) and weight.
GPUNET_DEVICE int32_t local_slot(const HtParams& P, uint64_t src, uint32_t d, uint32_t k, float* w) {
  const LlParams& B = P.base;
  *w = 0.0f;
  if (!(B.flags & F_HT_TOPK)) return -1;
  const int64_t e = ptr<const int64_t>(P.topk_idx)[src * B.topk + k];
  const int64_t lo = int64_t(d) * B.e_loc;
  if (e < lo || e >= lo + int64_t(B.e_loc)) return -1;
  if (B.flags & F_HT_WEIGHTS) *w = ptr<const float>(P.topk_weights)[src * B.topk + k];
  return int32_t(e - lo);
}

// ---- bulk copies ---------------------------------------------------------------------------------
// The data loops copy whole rows (x -> a mapped peer's ring or this rank's receive rows, ring ->
// receive rows): 14 KB for DeepEP's hidden 7168. A warp copying with loads and stores keeps
// kCopyUnroll 16-byte loads a lane in flight, 4 KB a warp, the most its registers allow (the
// kernel is at its bound of 128 a thread), and the H200 / H100 profiles show those loops as
// rounds of memory latency (sender "move" ~220 us of a ~290 us BF16 dispatch kernel, 2 ranks,
// bench/RESULTS.md twenty-fourth session). Where the GPU has the TMA (CUDA, sm_90+) and the
// launch has the shared memory (ep_ht.cu asks for ht_bulk_smem_bytes), lane 0 of each warp
// copies instead with bulk copies through kBulkBufs shared buffers of kBulkPiece bytes:
// kBulkBufs pieces in flight a warp, no registers. Completion: each buffer's mbarrier (loads,
// bounded wait), and before the block barrier that publishes or credits the rows, every bulk
// store complete (ht_copy_done). Elsewhere (MACA, older GPUs, a launch without the shared
// memory) the warp copies as before: the same bytes land either way. The HOST arm emulates the
// bulk primitives (arch.cuh) and its launches have the shared memory, so CI runs this path.
constexpr uint32_t kBulkPiece = 4096, kBulkBufs = 3;
// A warp's control bytes: kBulkBufs mbarriers, then their uses; at kBulkRowsAt the combine
// reduce's list of up to kReduceRows row addresses (ht_reduce_bulk).
constexpr uint32_t kBulkCtl = 128, kBulkRowsAt = 64, kReduceRows = 8;
// Every HT launch's shared memory: the peer view (ll.cuh load_peer_view), then the combine
// receiver's per-peer words (ht_recv_words: 3 x u32 a peer, then from ht_pull_words_at, 8-aligned,
// 2 x u64 a peer); the bulk buffers follow.
GPUNET_HOST_DEVICE uint64_t ht_pull_words_at(uint32_t nranks) {
  return (uint64_t(smem_view_bytes(nranks)) + 12 * uint64_t(nranks) + 7) / 8 * 8;
}
GPUNET_HOST_DEVICE uint64_t ht_smem_bytes(uint32_t nranks) {
  return ht_pull_words_at(nranks) + 16 * uint64_t(nranks);
}
GPUNET_HOST_DEVICE uint64_t ht_bulk_base(uint32_t nranks) { return (ht_smem_bytes(nranks) + 127) / 128 * 128; }
// The dynamic shared memory a launch of nwarps warps a block needs for bulk copies.
GPUNET_HOST_DEVICE uint64_t ht_bulk_smem_bytes(uint32_t nranks, uint32_t nwarps) {
  return ht_bulk_base(nranks) + (uint64_t(nwarps) * kBulkCtl + 127) / 128 * 128 +
         uint64_t(nwarps) * kBulkBufs * kBulkPiece;
}
struct HtBulk {
  uint8_t* buf = nullptr;  // this warp's kBulkBufs buffers; null: copy with loads and stores
  uint64_t* bar = nullptr;
  uint32_t* uses = nullptr;  // per buffer: phases waited for (the next wait's parity)
};
GPUNET_DEVICE HtBulk ht_bulk(const HtParams& P, const Geo& g) {
  HtBulk b;
#if defined(GPUNET_ARCH_HAS_BULK_COPY)
  const uint32_t R = P.base.nranks;
  if (arch::dynamic_smem_bytes() < ht_bulk_smem_bytes(R, g.nwarps)) return b;
  uint8_t* base = arch::shared_mem() + ht_bulk_base(R);
  uint8_t* ctl = base + uint64_t(g.wid) * kBulkCtl;
  b.bar = reinterpret_cast<uint64_t*>(ctl);
  b.uses = reinterpret_cast<uint32_t*>(ctl + 8 * kBulkBufs);
  b.buf = base + (uint64_t(g.nwarps) * kBulkCtl + 127) / 128 * 128 +
          uint64_t(g.wid) * kBulkBufs * kBulkPiece;
#else
  (void)P;
  (void)g;
#endif
  return b;
}
// Once per launch, before any copy: lane 0 of each warp arms its barriers.
GPUNET_DEVICE void ht_bulk_init(const HtParams& P, const Geo& g) {
#if defined(GPUNET_ARCH_HAS_BULK_COPY)
  const HtBulk b = ht_bulk(P, g);
  if (b.buf && g.lane == 0)
    for (uint32_t i = 0; i < kBulkBufs; ++i) {
      arch::mbar_init(&b.bar[i]);
      b.uses[i] = 0;
    }
  arch::syncwarp();
#else
  (void)P;
  (void)g;
#endif
}
// The warp copies n bytes (n % 16 == 0, both ends 16-byte aligned) from src to dst.
GPUNET_DEVICE void ht_copy(const HtParams& P, const Geo& g, const HtBulk& b, uint64_t dst, uint64_t src,
                           uint64_t n) {
#if defined(GPUNET_ARCH_HAS_BULK_COPY)
  if (b.buf) {
    if (g.lane == 0) {
      arch::bulk_fence_proxy();
      const uint64_t np = (n + kBulkPiece - 1) / kBulkPiece;
      auto len = [&](uint64_t k) { return uint32_t(n - k * kBulkPiece < kBulkPiece ? n - k * kBulkPiece : kBulkPiece); };
      for (uint64_t k = 0; k < np && k < kBulkBufs; ++k)
        arch::bulk_load(b.buf + k * kBulkPiece, ptr<const void>(src + k * kBulkPiece), len(k), &b.bar[k]);
      const uint64_t t0 = arch::now_ns();
      for (uint64_t k = 0; k < np; ++k) {
        const uint32_t i = uint32_t(k % kBulkBufs);
        // bounded: a piece that never lands (it cannot, short of a fault) is recorded
        for (uint32_t n_try = 0; !arch::mbar_test(&b.bar[i], b.uses[i] & 1); ++n_try)
          if ((n_try & 255) == 255 && arch::now_ns() - t0 > P.base.timeout_ns) {
            ep_fail(P.base, EP_ERR_GRID_WAIT, EP_SITE_HT_BULK, P.base.rank, n, k * kBulkPiece,
                    arch::now_ns() - t0);
            break;
          }
        ++b.uses[i];
        arch::bulk_store(ptr<void>(dst + k * kBulkPiece), b.buf + uint64_t(i) * kBulkPiece, len(k));
        if (k + kBulkBufs < np) {
          arch::bulk_wait_read();  // the store above has read buffer i
          arch::bulk_load(b.buf + uint64_t(i) * kBulkPiece, ptr<const void>(src + (k + kBulkBufs) * kBulkPiece),
                          len(k + kBulkBufs), &b.bar[i]);
        }
      }
      arch::bulk_wait_read();  // the buffers are free for the warp's next copy
    }
    arch::syncwarp();
    return;
  }
#else
  (void)P;
  (void)b;
#endif
  warp_copy(g, dst, src, n);
}
// Before the block barrier that publishes (a tail) or frees (a credit) what the warp copied:
// its bulk stores complete, ordered before the generic-proxy release that follows.
GPUNET_DEVICE void ht_copy_done(const Geo& g, const HtBulk& b) {
#if defined(GPUNET_ARCH_HAS_BULK_COPY)
  if (b.buf && g.lane == 0) arch::bulk_wait_done();
#else
  (void)g;
  (void)b;
#endif
}

// Combine: the warp writes row dst (H bf16) = the sum of its nrows rows (H bf16 each, the
// addresses lane 0 listed at bar + kBulkRowsAt, in the order to sum them) in float32, rounded
// once. Through the warp's bulk buffers: stage s is the slice [s W, s W + W) bytes of every row,
// side by side in buffer s % kBulkBufs (W = kBulkPiece / nrows, in 16-byte units), one barrier
// phase for the stage's nrows loads; the warp sums stage s from shared memory while lane 0's
// next stages are in flight. kBulkBufs x 4 KB in flight a warp, where the register loop of
// ht_recv_combine holds 2 KB of one row at a time (the H100 profile: ~30 us a combine round of
// one 2-row token a warp, twenty-sixth session). false: a stage never landed (recorded).
GPUNET_DEVICE bool ht_reduce_bulk(const HtParams& P, const Geo& g, const HtBulk& b, uint32_t nrows,
                                  uint64_t dst) {
#if defined(GPUNET_ARCH_HAS_BULK_COPY)
  const uint64_t* rows = reinterpret_cast<const uint64_t*>(reinterpret_cast<uint8_t*>(b.bar) + kBulkRowsAt);
  const uint64_t rb = uint64_t(P.base.hidden) * 2;
  const uint64_t W = kBulkPiece / nrows / 16 * 16;
  const uint64_t ns = (rb + W - 1) / W;
  auto len = [&](uint64_t s) { return uint32_t(rb - s * W < W ? rb - s * W : W); };
  auto issue = [&](uint64_t s) {  // lane 0
    const uint32_t i = uint32_t(s % kBulkBufs), n = len(s);
    arch::bulk_expect(&b.bar[i], n * nrows);
    for (uint32_t r = 0; r < nrows; ++r)
      arch::bulk_load_tx(b.buf + uint64_t(i) * kBulkPiece + r * W, ptr<const void>(rows[r] + s * W), n, &b.bar[i]);
  };
  if (g.lane == 0) {
    arch::bulk_fence_proxy();  // the rows' tails this warp (or its block) acquired
    for (uint64_t s = 0; s < ns && s < kBulkBufs; ++s) issue(s);
  }
  const uint64_t t0 = arch::now_ns();
  bool ok = true;
  for (uint64_t s = 0; s < ns; ++s) {
    const uint32_t i = uint32_t(s % kBulkBufs);
    // every lane waits for the phase (it reads the buffer); lane 0's clock decides the bound
    bool landed = false;
    for (uint32_t n_try = 0;; ++n_try) {
      landed = landed || arch::mbar_test(&b.bar[i], b.uses[i] & 1);
      if (arch::all(landed)) break;
      const bool late = (n_try & 255) == 255 && arch::now_ns() - t0 > P.base.timeout_ns;
      if (arch::shfl(late ? 1u : 0u, 0)) {
        if (g.lane == 0)
          ep_fail(P.base, EP_ERR_GRID_WAIT, EP_SITE_HT_BULK, P.base.rank, rb, s * W, arch::now_ns() - t0);
        ok = false;
        break;
      }
    }
    if (!ok) break;
    const uint8_t* in = b.buf + uint64_t(i) * kBulkPiece;
    for (uint32_t o = g.lane * 16; o < len(s); o += g.ws * 16) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (uint32_t r = 0; r < nrows; ++r) {
        const V16 v = *reinterpret_cast<const V16*>(in + r * W + o);
        for (uint32_t q = 0; q < 8; ++q) acc[q] += bf16_at(v, q);
      }
      V16 out = {0, 0};
      for (uint32_t q = 0; q < 8; ++q) (q < 4 ? out.a : out.b) |= uint64_t(f32_to_bf16(acc[q])) << (16 * (q & 3));
      *ptr<V16>(dst + s * W + o) = out;
    }
    arch::syncwarp();  // every lane has read buffer i (and seen its phase) before it is reloaded
    if (g.lane == 0) ++b.uses[i];
    arch::syncwarp();
    if (g.lane == 0 && s + kBulkBufs < ns) {
      arch::bulk_fence_proxy_shared();
      issue(s + kBulkBufs);
    }
  }
  return ok;
#else
  (void)P;
  (void)g;
  (void)b;
  (void)nrows;
  (void)dst;
  return false;
#endif
}

// Where a dispatch writes rank d's received rows: its receive tensors (this rank's own, or a
// mapped peer's as this rank maps them; 0 = absent).
struct HtOut {
  uint64_t x, scales, topk_idx, weights, src_idx;
};
// Dispatch, token t straight into receive row `pos` of destination d's tensors `o` (no ring, no
// signal): this rank's own tokens (d = rank), and a mapped peer's whose tensors lie in its pool.
GPUNET_DEVICE void ht_deliver(const HtParams& P, const Geo& g, const HtBulk& bk, const HtOut& o,
                              uint64_t pos, uint64_t t, uint32_t d) {
  const LlParams& B = P.base;
  const uint32_t H = B.hidden, K = B.topk;
  if (B.flags & F_FP8) {
    ht_copy(P, g, bk, o.x + pos * H, P.x + t * H, H);
    const uint32_t G = H / kGroup;
    for (uint32_t q = g.lane; q < G; q += g.ws)
      ptr<float>(o.scales)[pos * G + q] = ptr<const float>(P.x_scales)[t * G + q];
  } else {
    ht_copy(P, g, bk, o.x + pos * H * 2, P.x + t * H * 2, uint64_t(H) * 2);
  }
  if (g.lane == 0) ptr<int32_t>(o.src_idx)[pos] = int32_t(t);
  if ((B.flags & F_HT_TOPK) && o.topk_idx && g.lane < K) {
    float w;
    const int32_t le = local_slot(P, t, d, g.lane, &w);
    ptr<int64_t>(o.topk_idx)[pos * K + g.lane] = le;
    if (o.weights) ptr<float>(o.weights)[pos * K + g.lane] = w;
  }
}
GPUNET_DEVICE HtOut ht_own_out(const HtParams& P) {
  return HtOut{P.out_x, P.out_scales, P.out_topk_idx, P.out_weights, P.out_src_idx};
}

// Stage message `idx` (token or row `src`) for destination d into `msg`. Its meta words 2 and 3
// are the op counter and this rank's ring size: the combine receiver checks them (ht_recv_combine:
// the combine sends no header, so ranks whose combine Configs differ in the ring would otherwise
// each read the other's rows at its own offsets).
GPUNET_DEVICE void ht_stage(const HtParams& P, const Geo& g, const HtBulk& bk, uint64_t msg, uint64_t src,
                            uint32_t d, bool combine, uint64_t epoch) {
  const LlParams& B = P.base;
  const uint32_t H = B.hidden, K = B.topk;
  const bool fp8 = !combine && (B.flags & F_FP8);
  if (fp8) {
    ht_copy(P, g, bk, msg, P.x + src * H, H);
    const uint32_t G = H / kGroup;
    for (uint32_t q = g.lane; q < G; q += g.ws)
      ptr<float>(msg + H)[q] = ptr<const float>(P.x_scales)[src * G + q];
  } else {
    ht_copy(P, g, bk, msg, P.x + src * H * 2, uint64_t(H) * 2);
  }
  int32_t* meta = ptr<int32_t>(msg + B.payload_bytes);
  if (g.lane == 0) {
    meta[0] = int32_t(src);
    meta[1] = int32_t(K);
    meta[2] = int32_t(uint32_t(epoch));
    meta[3] = int32_t(P.ring);
  }
  if (g.lane < K) {
    float w = 0.0f;
    int32_t le = -1;
    if (!combine) le = local_slot(P, src, d, g.lane, &w);
    else if (B.flags & F_HT_WEIGHTS) w = ptr<const float>(P.topk_weights)[src * K + g.lane];
    meta[4 + g.lane] = le;
    ptr<float>(msg + B.payload_bytes)[4 + kMaxTopk + g.lane] = w;
  }
}

// Where message `idx` of channel c for destination d is written by this block: the slot in d's
// own receive ring when d's heap is mapped here (a p2p peer: gpunet::ptr), so the warp's stores
// ARE the transfer (one copy, x -> the peer's ring, instead of x -> staging -> the peer's ring);
// else the staging slot in this rank's heap, which a put then carries. 0: stage (not mapped).
// The sender looks the mapping up once per launch (WS_MAPPED: slot 0; a ring is contiguous in
// the heap, so slot i is i message strides on), not per message (a chain of dependent loads
// through the peer's context).
GPUNET_DEVICE uint64_t ht_mapped_ring(const HtParams& P, uint32_t c, uint32_t d) {
  if (d == P.base.rank) return 0;
  void* m = gpunet::ptr(peer_ctx(P.base, d), ptr<const void>(slot_addr(P, P.recv_ring, c, P.base.rank, 0)),
                        int(d));
  return uint64_t(uintptr_t(m));
}
GPUNET_DEVICE uint64_t ht_mapped_slot(const HtParams& P, uint32_t c, uint32_t d, uint64_t idx) {
  const uint64_t m0 = *ws_word(P, 0, c, d, WS_MAPPED);
  return m0 ? m0 + (idx % P.ring) * P.base.msg_stride : 0;
}

// ---- the receive pool: rows stored in place ------------------------------------------------------
// A dispatch receiver whose receive tensors lie in its pool (F_HT_DIRECT) tells every mapped source
// where they are: one descriptor a source (RD_*: offsets from the pool's base, which is at the
// same heap offset on every rank, and where the source's rows start), stored into the source's
// rdesc[receiver] and released by a SET of its signal. Without a pool it still sends one (direct
// 0): a mapped source cannot tell otherwise whether to wait. Block 1 (channel 0's receiver) sends
// them at the start of the data phase; the notify has written chan_prefix.
GPUNET_DEVICE void ht_send_descs(const HtParams& P, const Geo& g, uint64_t epoch, uint8_t* out) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels;
  const bool direct = (B.flags & F_HT_DIRECT) != 0;
  auto off = [&](uint64_t a) { return a ? a - P.pool : kHtNoTensor; };
  for (uint32_t j = g.tid; j < R; j += g.bdim) {
    if (j == B.rank || out[j]) continue;
    const DevCtx& cx = peer_ctx(B, j);
    uint64_t* slot = ptr<uint64_t>(P.rdesc + uint64_t(B.rank) * RD_WORDS * 8);
    uint64_t* rd = static_cast<uint64_t*>(gpunet::ptr(cx, slot, int(j)));
    if (!rd) continue;  // not mapped: that source stages into the ring (and waits for no descriptor)
    rd[RD_DIRECT] = direct ? 1 : 0;
    rd[RD_ROW0] = uint64_t(ptr<const int32_t>(P.chan_prefix)[uint64_t(j) * (nc + 1)]);
    rd[RD_ROWS] = P.num_recv_max;
    rd[RD_X] = off(P.out_x);
    rd[RD_SCALES] = off(P.out_scales);
    rd[RD_TOPK] = off(P.out_topk_idx);
    rd[RD_WEIGHTS] = off(P.out_weights);
    rd[RD_SRC] = off(P.out_src_idx);
    uint64_t* w = ht_desc_sig(P, B.rank);
    if (!put_signal_nbi(cx, w, w, 0, w, (epoch << 32) | 1, int(j), SIGNAL_SET)) peer_fail_view(B, out, j);
  }
}

// A descriptor is this op's while its signal holds (epoch << 32) | 1. A receiver that ends the
// dispatch with a source failed or masked SETs that source's word to (epoch << 32) | 2 (revoked:
// ht_revoke_descs, its last block), and its next dispatch SETs a later epoch: either way its
// receive tensors of this op are the caller's by now. A source whose data launch came after that
// (its host stalled between its notify and its data launch for longer than the bound: the
// receiver masked it and returned those tensors) stores nothing into them: it takes the
// receiver for failed (tests/test_ep_ht.py test_a_late_source_stores_nothing_into_returned_tensors).
GPUNET_DEVICE bool ht_desc_current(const HtParams& P, uint32_t d, uint64_t epoch) {
  return arch::atomic_load(ht_desc_sig(P, d)) == ((epoch << 32) | 1);
}

// The sender's lane 0, once per (channel c, mapped destination d): waits (bounded, direct, with
// heartbeats: d may still be in its notify) for d's descriptor and, when d's rows go in place,
// keeps where (WS_ROW: channel c's first row, WS_O*: d's tensors as mapped here). false: d failed
// (or revoked its descriptor, ht_desc_current).
GPUNET_DEVICE bool ht_take_desc(const HtParams& P, uint32_t c, uint32_t d, uint64_t epoch) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks;
  *ws_word(P, 0, c, d, WS_OX) = 0;
  if (!wait_peer(B, d, ht_desc_sig(P, d), (epoch << 32) | 1, api::waiter(peer_ctx(B, d)), ht_beat(P)) ||
      !ht_desc_current(P, d, epoch))
    return false;
  const uint64_t* rd = ptr<const uint64_t>(P.rdesc + uint64_t(d) * RD_WORDS * 8);
  if (!rd[RD_DIRECT]) return true;
  uint64_t row = rd[RD_ROW0];
  const int32_t* cnt = ptr<const int32_t>(P.send_cnt);
  for (uint32_t cc = 0; cc < c; ++cc) row += uint64_t(cnt[uint64_t(cc) * R + d]);
  // every row of this channel must fit d's tensors: else nothing goes in place (the ring then
  // carries them and d's own check reports the overflow)
  if (row + uint64_t(cnt[uint64_t(c) * R + d]) > rd[RD_ROWS] || rd[RD_X] == kHtNoTensor ||
      rd[RD_SRC] == kHtNoTensor)
    return true;
  // d's pool as mapped here: one lookup (the heap is mapped whole, so the pool is contiguous)
  const uint64_t base = uint64_t(uintptr_t(gpunet::ptr(peer_ctx(B, d), ptr<void>(P.pool), int(d))));
  auto at = [&](uint32_t k) -> uint64_t {
    return rd[k] == kHtNoTensor || rd[k] >= P.pool_bytes || !base ? 0 : base + rd[k];
  };
  *ws_word(P, 0, c, d, WS_ROW) = row;
  *ws_word(P, 0, c, d, WS_OS) = at(RD_SCALES);
  *ws_word(P, 0, c, d, WS_OI) = at(RD_TOPK);
  *ws_word(P, 0, c, d, WS_OW) = at(RD_WEIGHTS);
  *ws_word(P, 0, c, d, WS_OSRC) = at(RD_SRC);
  *ws_word(P, 0, c, d, WS_OX) = at(RD_X);
  return true;
}
GPUNET_DEVICE HtOut ht_peer_out(const HtParams& P, uint32_t c, uint32_t d) {
  return HtOut{*ws_word(P, 0, c, d, WS_OX), *ws_word(P, 0, c, d, WS_OS), *ws_word(P, 0, c, d, WS_OI),
               *ws_word(P, 0, c, d, WS_OW), *ws_word(P, 0, c, d, WS_OSRC)};
}

// ---- the in-place combine: rows loaded where they are ------------------------------------------
// A combine whose x (and topk_weights, if any) the host found in this rank's receive pool
// (F_HT_PULL: typically the dispatch's recv_x, combined as DeepEP's tests and bench do) need not
// travel: a destination d that can LOAD from this rank's heap (a p2p peer without P2P_STORE_ONLY;
// the mapping is taken as symmetric: this rank can load from d) gets, in place of channel c's rows,
// where they are: a descriptor in slot 0 of d's ring for (c, this rank) (PD_*: x's and the
// weights' offsets in the pool, which is at the same heap offset on every rank, and the channel's
// first row), with the op and ring in the meta words as a row has them (ht_stage), released by the
// tail (total | kHtDirectBit). d's token side loads the rows from the mapping and reduces them as
// if they had come (the bytes a row moved: 4 passes with the ring, 2 in place), and its final
// credit says it has read them all: until then the sender keeps x (the call does not return).
// A sender that gives d up (silent, failed) before that credit SETs d's tail back to count 0
// (ht_pull_revoke): d checks its tail once more after its loads and before that credit, so a d that
// was masked while it read fails d rather than return rows x may no longer hold.
enum : uint32_t { PD_X = 0, PD_W = 1, PD_ROW0 = 2 };
GPUNET_DEVICE bool ht_offer_pull(const HtParams& P, uint32_t c, uint32_t d, uint64_t epoch, uint64_t row0,
                                 uint8_t* out) {
  const LlParams& B = P.base;
  const uint64_t m0 = *ws_word(P, 0, c, d, WS_MAPPED);
  if (!(B.flags & F_HT_PULL) || !m0 || !gpunet::ptr_load(peer_ctx(B, d), ptr<const void>(P.pool), int(d)))
    return false;
  uint64_t* desc = reinterpret_cast<uint64_t*>(uintptr_t(m0));
  desc[PD_X] = P.x - P.pool;
  desc[PD_W] = P.topk_weights ? P.topk_weights - P.pool : kHtNoTensor;
  desc[PD_ROW0] = row0;
  int32_t* m = reinterpret_cast<int32_t*>(uintptr_t(m0 + B.payload_bytes));
  m[2] = int32_t(uint32_t(epoch));
  m[3] = int32_t(P.ring);
  *ws_word(P, 0, c, d, WS_PULL) = 1;
  if (!write_count(P, HT_KIND_COMBINE, 0, c, d, epoch, *ws_word(P, 0, c, d, WS_TOTAL) | kHtDirectBit))
    peer_fail_view(B, out, d);
  return true;
}
GPUNET_DEVICE void ht_pull_revoke(const HtParams& P, uint32_t c, uint32_t d, uint64_t epoch) {
  if (*ws_word(P, 0, c, d, WS_PULL)) write_count(P, HT_KIND_COMBINE, 0, c, d, epoch, 0);
}

// The sender works in block-wide steps: (1) the warp that owns a destination (d % nwarps) decides,
// from d's credit, whether d gets n more messages now and lists their tokens (rows); (2) every warp
// of the block stages the listed messages of every destination (a 2-rank world has 1 remote
// destination: all warps stage its rows, not one); (3) the owner posts them (a mapped peer: nothing
// to post, the stores were the transfer) and the tail. Lane 0 of the owner reads and writes d's state words, so every lane takes the same branches (the ballots
// and shuffles need that).
GPUNET_DEVICE int32_t* tok_list(const HtParams& P, uint32_t c, uint32_t d) {
  const uint64_t scratch = P.ws + uint64_t(2) * P.nchannels * P.base.nranks * WS_WORDS * 8;
  return ptr<int32_t>(scratch + (uint64_t(P.base.nranks) * 4 + 7) / 8 * 8) +
         (uint64_t(c) * P.base.nranks + d) * kHtMaxChunk;
}

// (below: the split in-place combine)
GPUNET_DEVICE bool ht_split_offer(const HtParams& P, uint32_t c, uint64_t epoch, const uint8_t* out);
GPUNET_DEVICE void ht_recv_combine(const HtParams& P, const Geo& g, uint32_t c, uint64_t epoch,
                                   uint8_t* out, bool helper, bool split);

// The sender's first step: each destination's state words and, in a combine, the offers of rows
// loaded in place; true when this block then reduces half its channel's tokens (the split in-place
// combine, ht_split_offer) before its loop (ht_send).
GPUNET_DEVICE bool ht_send_begin(const HtParams& P, const Geo& g, uint32_t c, uint64_t epoch, uint8_t* out,
                                 bool split) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels;
  const bool combine = B.op == OP_HT_COMBINE;
  const uint64_t cb = chan_begin(B.num_tokens, nc, c);
  const int32_t* pre = ptr<const int32_t>(P.chan_prefix);
  const uint64_t t_start = arch::now_ns();
  if (g.lane == 0) {
    for (uint32_t d = g.wid; d < R; d += g.nwarps) {
      // to itself: nothing to send (combine: its receiver reads x in place; dispatch: its
      // receiver block stores this rank's own rows, ht_recv_self)
      const uint64_t total = d == B.rank ? 0
                             : combine ? uint64_t(pre[uint64_t(d) * (nc + 1) + c + 1] - pre[uint64_t(d) * (nc + 1) + c])
                                       : uint64_t(ptr<const int32_t>(P.send_cnt)[uint64_t(c) * R + d]);
      *ws_word(P, 0, c, d, WS_SENT) = 0;
      *ws_word(P, 0, c, d, WS_MAPPED) = ht_mapped_ring(P, c, d);
      *ws_word(P, 0, c, d, WS_OX) = 0;
      if (!combine && (B.flags & F_HT_DESC) && *ws_word(P, 0, c, d, WS_MAPPED) && !out[d] &&
          !ht_take_desc(P, c, d, epoch))
        peer_fail_view(B, out, d);
      *ws_word(P, 0, c, d, WS_CURSOR) = combine ? uint64_t(pre[uint64_t(d) * (nc + 1) + c]) : cb;
      *ws_word(P, 0, c, d, WS_TLAST) = t_start;
      *ws_word(P, 0, c, d, WS_TOTAL) = total;
      *ws_word(P, 0, c, d, WS_DONE) = 0;
      *ws_word(P, 0, c, d, WS_AVAIL) = 0;
      *ws_word(P, 0, c, d, WS_HB) = 0;
      *ws_word(P, 0, c, d, WS_PULL) = 0;
      // the in-place combine: every row is "sent" at once; the final credit still ends it
      if (combine && total && !out[d] && ht_offer_pull(P, c, d, epoch, *ws_word(P, 0, c, d, WS_CURSOR), out))
        *ws_word(P, 0, c, d, WS_SENT) = total;
    }
  }
  // an in-place combine with nothing to stage: this block may reduce half of its channel's tokens
  // before it waits for its final credits (ht_split_offer)
  if (!split || !combine || !(B.flags & F_HT_SPLIT)) return false;
  arch::syncthreads();  // every warp's offers (their state words) before thread 0 reads them
  return arch::block_any(g.tid == 0 && ht_split_offer(P, c, epoch, out));
}

GPUNET_DEVICE void ht_send(const HtParams& P, const Geo& g, uint32_t c, uint64_t epoch, uint8_t* out) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels;
  const bool combine = B.op == OP_HT_COMBINE;
  const uint32_t kind = combine ? HT_KIND_COMBINE : HT_KIND_DISPATCH;
  const uint64_t ce = chan_begin(B.num_tokens, nc, c + 1);
  const int32_t* send_pos = ptr<const int32_t>(P.send_pos);
  const uint64_t t_start = arch::now_ns();
  HtClock clk = ht_clock(B, g);
  const HtBulk bk = ht_bulk(P, g);
  for (;;) {
    // (1) decide and list
    bool left = false;  // lane 0: one of this warp's destinations is not done
    for (uint32_t d = g.wid; d < R; d += g.nwarps) {  // warp-uniform
      uint32_t act = 0;  // 2: send n now
      uint64_t sent = 0, n = 0, cur = 0;
      if (g.lane == 0) {
        *ws_word(P, 0, c, d, WS_AVAIL) = 0;
        if (!*ws_word(P, 0, c, d, WS_DONE)) {
          if (out[d]) {
            ht_pull_revoke(P, c, d, epoch);
            *ws_word(P, 0, c, d, WS_DONE) = 1;
          } else if (*ws_word(P, 0, c, d, WS_OX) && !ht_desc_current(P, d, epoch)) {
            peer_fail_view(B, out, d);  // d revoked its tensors meanwhile: no more rows into them
            *ws_word(P, 0, c, d, WS_DONE) = 1;
          } else {
            const uint64_t total = *ws_word(P, 0, c, d, WS_TOTAL);
            sent = *ws_word(P, 0, c, d, WS_SENT);
            cur = *ws_word(P, 0, c, d, WS_CURSOR);
            // to itself, or in place (no ring): nothing to wait for
            const uint64_t consumed = d == B.rank || *ws_word(P, 0, c, d, WS_OX) ? sent
                                      : read_count(P, kind, 1, c, d, epoch);
            // combine: the first step a third of a chunk, so the token side (the slower one)
            // gets its first rows sooner (it waited ~40 us for a first chunk of 48 rows): the
            // combine 1-2% faster in 3 of 3 pairs (H100); the dispatch with the same ramp was
            // ~3% slower (3 of 3), so it keeps whole chunks (bench/RESULTS.md, 27th session)
            const uint64_t step = combine && sent == 0 ? (uint64_t(P.chunk) + 2) / 3 : uint64_t(P.chunk);
            n = total - sent < step ? total - sent : step;
            if (sent == total && consumed >= total) {
              *ws_word(P, 0, c, d, WS_DONE) = 1;
              if (d != B.rank && total && !quiet_pe(peer_ctx(B, d), int(d))) peer_fail_view(B, out, d);
            } else if (sent == total || sent - consumed + n > P.ring) {
              const uint64_t now = arch::now_ns();
              ht_heartbeat(P, now, out);
              const uint64_t idle = now - *ws_word(P, 0, c, d, WS_TLAST);
              if (d != B.rank && (failed_meanwhile(P, d, idle) ||
                                  (idle > indirect_timeout(P) &&
                                   ht_silent(P, d, ws_word(P, 0, c, d, WS_HB), ws_word(P, 0, c, d, WS_TLAST),
                                             indirect_timeout(P), now, t_start)))) {
                peer_fail_view(B, out, d);  // no credit for that long: the peer is silent
                ht_pull_revoke(P, c, d, epoch);
                *ws_word(P, 0, c, d, WS_DONE) = 1;
              }
            } else {
              act = 2;
            }
          }
          left = left || !*ws_word(P, 0, c, d, WS_DONE);
        }
      }
      act = arch::shfl(act, 0);
      if (act != 2) continue;
      n = arch::shfl(n, 0);
      cur = arch::shfl(cur, 0);
      int32_t* list = tok_list(P, c, d);
      if (combine) {
        for (uint64_t i = g.lane; i < n; i += g.ws) list[i] = int32_t(cur + i);
        cur += n;
      } else {
        uint64_t taken = 0;
        while (taken < n) {  // warp-uniform: a ballot over ws tokens from the cursor
          const uint64_t t = cur + g.lane;
          const bool in = t < ce && send_pos[t * R + d] >= 0;
          const uint64_t bits = arch::ballot(in);
          const uint64_t below = g.lane == 0 ? 0 : (~uint64_t(0) >> (64 - g.lane));
          const uint64_t cnt = popc64(bits);
          const uint64_t take = cnt < n - taken ? cnt : n - taken;
          const uint64_t rank_in = popc64(bits & below);
          if (in && rank_in < take) list[taken + rank_in] = int32_t(t);
          uint64_t last = 0;  // the position of the last token taken
          for (uint64_t b = bits, q = 0; q < take; ++q, b &= b - 1) last = ctz64(b);
          cur = take < cnt ? cur + last + 1 : cur + g.ws;
          taken += take;
        }
      }
      if (g.lane == 0) {
        *ws_word(P, 0, c, d, WS_CURSOR) = cur;
        *ws_word(P, 0, c, d, WS_AVAIL) = n;
      }
    }
    const bool more = arch::block_any(left);  // (also the barrier after the lists)
    // (2) every warp stages the listed messages of every destination
    uint64_t items = 0;
    for (uint32_t d = 0; d < R; ++d) items += *ws_word(P, 0, c, d, WS_AVAIL);
    for (uint64_t it = g.wid; it < items; it += g.nwarps) {
      uint32_t d = 0;
      uint64_t i = it;
      while (i >= *ws_word(P, 0, c, d, WS_AVAIL)) i -= *ws_word(P, 0, c, d, WS_AVAIL), ++d;
      const uint64_t idx = *ws_word(P, 0, c, d, WS_SENT) + i;
      const uint64_t src = uint64_t(tok_list(P, c, d)[i]);
      if (*ws_word(P, 0, c, d, WS_OX)) {  // into d's receive tensors (its pool)
        ht_deliver(P, g, bk, ht_peer_out(P, c, d), *ws_word(P, 0, c, d, WS_ROW) + idx, src, d);
        continue;
      }
      const uint64_t m = ht_mapped_slot(P, c, d, idx);
      ht_stage(P, g, bk, m ? m : slot_addr(P, P.send_ring, c, d, idx), src, d, combine, epoch);
    }
    ht_copy_done(g, bk);
    arch::syncthreads();  // every staging store before the puts read them
    const uint64_t dt_move = clk.lap();
    // (3) the puts, by the whole block: on p2p every thread copies (put_nbi_block), on the NIC
    // transports it is a few WQEs (ibgda) or one command (proxy); then the owners SET the tails
    for (uint32_t d = 0; d < R; ++d) {  // block-uniform
      const uint64_t n = *ws_word(P, 0, c, d, WS_AVAIL);
      if (!n || d == B.rank) continue;
      const uint64_t sent = *ws_word(P, 0, c, d, WS_SENT);
      if (ht_mapped_slot(P, c, d, sent)) continue;  // stored in d's ring or tensors above
      // the slots [sent, sent + n) of the ring: one put, two when they wrap
      const uint64_t s0 = sent % P.ring;
      const uint64_t n1 = P.ring - s0 < n ? P.ring - s0 : n;
      const DevCtx& cx = peer_ctx(B, d);
      const uint64_t msz = B.msg_stride;
      bool ok = put_nbi_block(cx, ptr<void>(slot_addr(P, P.recv_ring, c, B.rank, sent)),
                              ptr<const void>(slot_addr(P, P.send_ring, c, d, sent)), n1 * msz, int(d));
      if (ok && n1 < n)
        ok = put_nbi_block(cx, ptr<void>(slot_addr(P, P.recv_ring, c, B.rank, 0)),
                           ptr<const void>(slot_addr(P, P.send_ring, c, d, 0)), (n - n1) * msz, int(d));
      if (!ok && g.tid == 0) peer_fail_view(B, out, d);
    }
    arch::syncthreads();  // every thread's stores of the puts (p2p) before the owners' fences
    for (uint32_t d = g.wid; d < R; d += g.nwarps) {
      if (g.lane != 0) continue;
      const uint64_t n = *ws_word(P, 0, c, d, WS_AVAIL);
      if (!n) continue;
      const uint64_t sent = *ws_word(P, 0, c, d, WS_SENT);
      *ws_word(P, 0, c, d, WS_SENT) = sent + n;
      *ws_word(P, 0, c, d, WS_TLAST) = arch::now_ns();
      *ws_word(P, 0, c, d, WS_HB) = 0;  // progress: a later stall takes a new baseline
      if (d == B.rank) continue;
      const uint64_t flag = *ws_word(P, 0, c, d, WS_OX) ? kHtDirectBit : 0;
      if (out[d] || !write_count(P, kind, 0, c, d, epoch, (sent + n) | flag)) {
        peer_fail_view(B, out, d);
        *ws_word(P, 0, c, d, WS_DONE) = 1;
      }
    }
    ht_step_stamps(B, g, clk, items, dt_move, clk.lap());
    if (!more) break;
    if (!items) arch::spin_pause();
    arch::syncthreads();  // the owners' state words before the next step reads them
  }
}

// ---- the receiver (block 2c+1) --------------------------------------------------------------------

// Dispatch, this rank's own rows: its tokens in the channel go straight to their receive rows
// (no ring, no signal), stored by the RECEIVER block, not the sender. The sender's copies are the
// dispatch's bottleneck (H100: ~225 us of "move" in a ~285 us kernel, of which half were these
// rows) while the receiver idles ~120 us waiting for the peers' rows; so the receiver stores its
// own rows in the steps where nothing arrived (kSelfBatch tokens a warp at a time), and the rest
// after its loop. `t` (block-uniform) is the next token of the channel to look at.
struct HtSelf {
  uint64_t t, end, row;  // next token, the channel's end, this rank's first receive row of it
};
constexpr uint32_t kSelfBatch = 2;
GPUNET_DEVICE HtSelf ht_self_begin(const HtParams& P, uint32_t c) {
  const uint32_t nc = P.nchannels;
  const uint64_t T = P.base.num_tokens;
  return HtSelf{chan_begin(T, nc, c), chan_begin(T, nc, c + 1),
                uint64_t(ptr<const int32_t>(P.chan_prefix)[uint64_t(P.base.rank) * (nc + 1) + c])};
}
// The next n tokens of the channel (at most up to its end): a warp per token, those that go to
// this rank (send_pos: the token's index among the channel's tokens to this rank) stored.
GPUNET_DEVICE void ht_recv_self(const HtParams& P, const Geo& g, const HtBulk& bk, HtSelf& s, uint64_t n) {
  const uint64_t end = s.end - s.t < n ? s.end : s.t + n;
  const uint32_t R = P.base.nranks;
  const int32_t* send_pos = ptr<const int32_t>(P.send_pos);
  for (uint64_t t = s.t + g.wid; t < end; t += g.nwarps) {
    const int32_t p = send_pos[t * R + P.base.rank];
    if (p >= 0) ht_deliver(P, g, bk, ht_own_out(P), s.row + uint64_t(p), t, P.base.rank);
  }
  s.t = end;
}

// Dispatch: copy whatever arrived from every source into its rows; credit back every chunk.
GPUNET_DEVICE void ht_recv_dispatch(const HtParams& P, const Geo& g, uint32_t c, uint64_t epoch,
                                    uint8_t* out) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels, H = B.hidden, K = B.topk;
  const int32_t* pre = ptr<const int32_t>(P.chan_prefix);
  const bool fp8 = (B.flags & F_FP8) != 0;
  const uint64_t row_bytes = fp8 ? uint64_t(H) : uint64_t(H) * 2;
  const uint32_t G = H / kGroup;
  const uint64_t t_start = arch::now_ns();
  for (uint32_t j = g.tid; j < R; j += g.bdim) {
    // its own rows are not in a ring (ht_recv_self)
    const uint64_t total = j == B.rank ? 0 : uint64_t(pre[uint64_t(j) * (nc + 1) + c + 1] -
                                                      pre[uint64_t(j) * (nc + 1) + c]);
    *ws_word(P, 1, c, j, WS_SENT) = 0;       // consumed
    *ws_word(P, 1, c, j, WS_CREDIT) = 0;
    *ws_word(P, 1, c, j, WS_TOTAL) = total;
    *ws_word(P, 1, c, j, WS_TLAST) = t_start;
    *ws_word(P, 1, c, j, WS_AVAIL) = 0;
    *ws_word(P, 1, c, j, WS_DONE) = total == 0 ? 1 : 0;
    *ws_word(P, 1, c, j, WS_HB) = 0;
  }
  if (c == 0 && (B.flags & F_HT_DESC)) ht_send_descs(P, g, epoch, out);
  arch::syncthreads();
  HtClock clk = ht_clock(B, g);
  const HtBulk bk = ht_bulk(P, g);
  HtSelf self = ht_self_begin(P, c);
  for (;;) {
    for (uint32_t j = g.tid; j < R; j += g.bdim) {
      uint64_t avail = 0;
      if (!*ws_word(P, 1, c, j, WS_DONE)) {
        if (out[j]) {
          *ws_word(P, 1, c, j, WS_DONE) = 1;
        } else {
          const uint64_t done = *ws_word(P, 1, c, j, WS_SENT);
          uint64_t tail = read_count(P, HT_KIND_DISPATCH, 0, c, j, epoch);
          // j stored the rows in place (this rank's pool): they are there, nothing to copy
          const bool direct = tail != 0xffffffffull && (tail & kHtDirectBit);
          if (direct) tail &= ~kHtDirectBit;
          const uint64_t total = *ws_word(P, 1, c, j, WS_TOTAL);
          if (tail > total) tail = total;
          const uint64_t fresh = tail > done ? tail - done : 0;
          if (direct && fresh) {
            *ws_word(P, 1, c, j, WS_SENT) = tail;
            *ws_word(P, 1, c, j, WS_TLAST) = arch::now_ns();
            *ws_word(P, 1, c, j, WS_HB) = 0;
            if (tail == total) *ws_word(P, 1, c, j, WS_DONE) = 1;
          } else {
            avail = fresh;
          }
          if (fresh == 0 && j != B.rank) {
            const uint64_t now = arch::now_ns();
            ht_heartbeat(P, now, out);
            const uint64_t idle = now - *ws_word(P, 1, c, j, WS_TLAST);
            if (failed_meanwhile(P, j, idle) ||
                (idle > indirect_timeout(P) &&
                 ht_silent(P, j, ws_word(P, 1, c, j, WS_HB), ws_word(P, 1, c, j, WS_TLAST),
                           indirect_timeout(P), now, t_start))) {
              peer_fail_view(B, out, j);
              *ws_word(P, 1, c, j, WS_DONE) = 1;
            }
          }
        }
      }
      *ws_word(P, 1, c, j, WS_AVAIL) = avail;
    }
    arch::syncthreads();
    uint64_t items = 0;
    for (uint32_t j = 0; j < R; ++j) items += *ws_word(P, 1, c, j, WS_AVAIL);
    for (uint64_t it = g.wid; it < items; it += g.nwarps) {
      uint32_t j = 0;
      uint64_t m = it;
      while (m >= *ws_word(P, 1, c, j, WS_AVAIL)) m -= *ws_word(P, 1, c, j, WS_AVAIL), ++j;
      const uint64_t idx = *ws_word(P, 1, c, j, WS_SENT) + m;
      const uint64_t msg = slot_addr(P, P.recv_ring, c, j, idx);
      const uint64_t pos = uint64_t(pre[uint64_t(j) * (nc + 1) + c]) + idx;
      ht_copy(P, g, bk, P.out_x + pos * row_bytes, msg, row_bytes);
      if (fp8)
        for (uint32_t q = g.lane; q < G; q += g.ws)
          ptr<float>(P.out_scales)[pos * G + q] = ptr<const float>(msg + H)[q];
      const int32_t* meta = ptr<const int32_t>(msg + B.payload_bytes);
      if (g.lane == 0) ptr<int32_t>(P.out_src_idx)[pos] = meta[0];
      if ((B.flags & F_HT_TOPK) && g.lane < K) {
        ptr<int64_t>(P.out_topk_idx)[pos * K + g.lane] = int64_t(meta[4 + g.lane]);
        if (P.out_weights)
          ptr<float>(P.out_weights)[pos * K + g.lane] =
              ptr<const float>(msg + B.payload_bytes)[4 + kMaxTopk + g.lane];
      }
    }
    if (items == 0) ht_recv_self(P, g, bk, self, uint64_t(g.nwarps) * kSelfBatch);  // nothing arrived
    ht_copy_done(g, bk);
    arch::syncthreads();  // every copy out of the ring is done before the credit frees its slots
    const uint64_t dt_move = clk.lap();
    bool left = false;
    for (uint32_t j = g.tid; j < R; j += g.bdim) {
      const uint64_t avail = *ws_word(P, 1, c, j, WS_AVAIL);
      if (avail) {
        const uint64_t done = *ws_word(P, 1, c, j, WS_SENT) + avail;
        *ws_word(P, 1, c, j, WS_SENT) = done;
        *ws_word(P, 1, c, j, WS_TLAST) = arch::now_ns();
        *ws_word(P, 1, c, j, WS_HB) = 0;  // progress: a later stall takes a new baseline
        const uint64_t total = *ws_word(P, 1, c, j, WS_TOTAL);
        if (done == total || done - *ws_word(P, 1, c, j, WS_CREDIT) >= P.chunk) {
          if (!write_count(P, HT_KIND_DISPATCH, 1, c, j, epoch, done)) {
            peer_fail_view(B, out, j);
            *ws_word(P, 1, c, j, WS_DONE) = 1;
          }
          *ws_word(P, 1, c, j, WS_CREDIT) = done;
        }
        if (done == total) *ws_word(P, 1, c, j, WS_DONE) = 1;
      }
      left = left || !*ws_word(P, 1, c, j, WS_DONE);
    }
    const bool more = arch::block_any(left);
    ht_step_stamps(B, g, clk, items, dt_move, clk.lap());
    if (!more) break;
    if (self.t == self.end) arch::spin_pause();
  }
  ht_recv_self(P, g, bk, self, self.end - self.t);  // what the idle steps left
  ht_copy_done(g, bk);
  // A source that failed with rows still due: in place (F_HT_DIRECT), its stores past the last
  // tail seen may have landed in part, so those rows become holes (no expert, weight 0), as a
  // row the ring never delivered reads (the host filled them so before the launch)
  if ((B.flags & F_HT_DIRECT) && (B.flags & F_HT_TOPK))
    for (uint32_t j = 0; j < R; ++j) {
      if (j == B.rank || !out[j]) continue;
      const uint64_t r0 = uint64_t(pre[uint64_t(j) * (nc + 1) + c]) + *ws_word(P, 1, c, j, WS_SENT);
      const uint64_t r1 = uint64_t(pre[uint64_t(j) * (nc + 1) + c + 1]);
      for (uint64_t i = r0 * K + g.tid; i < r1 * K; i += g.bdim) {
        ptr<int64_t>(P.out_topk_idx)[i] = -1;
        if (P.out_weights) ptr<float>(P.out_weights)[i] = 0.0f;
      }
    }
}

// The combine receiver's per-peer words, in the block's shared memory (ht_smem_bytes): [0, R) the
// tail of d last seen (a lower bound: warps store it racily, never above the truth; it spares
// most reads of the word itself), [R, 2R) one past the highest ring position of d a warp of this
// round took (atomic max), [2R, 3R) the credit given to d; then (ht_pull_words_at) [0, R) u64
// where d's rows of this channel are as mapped here when d's combine is in place (0: in the ring;
// ht_take_pull), [R, 2R) d's weights there (0: none). Only this block uses them: in shared
// memory they cost no L2 round trip, and the max is one native atomic instead of a CAS loop on
// one global word that every warp of the round hits.
GPUNET_DEVICE uint32_t* ht_recv_words(const LlParams& B) {
  return reinterpret_cast<uint32_t*>(arch::shared_mem() + smem_view_bytes(B.nranks));
}
GPUNET_DEVICE uint64_t* ht_pull_words(const LlParams& B) {
  return reinterpret_cast<uint64_t*>(arch::shared_mem() + ht_pull_words_at(B.nranks));
}

// The token side's lane 0, on d's tail with kHtDirectBit (ht_offer_pull): d's descriptor (slot 0
// of the ring, its meta checked as a row's by the caller) gives where d's rows of channel c are;
// kept in the pull words. false: d's pool cannot be loaded here (an asymmetric mapping: d took it
// for one) or the descriptor points outside it.
GPUNET_DEVICE bool ht_take_pull(const HtParams& P, uint32_t c, uint32_t d, uint64_t total) {
  const LlParams& B = P.base;
  const uint64_t* desc = ptr<const uint64_t>(slot_addr(P, P.recv_ring, c, d, 0));
  const uint64_t base = uint64_t(uintptr_t(gpunet::ptr_load(peer_ctx(B, d), ptr<const void>(P.pool), int(d))));
  const uint64_t row_bytes = uint64_t(B.hidden) * 2, w_bytes = uint64_t(B.topk) * 4;
  const uint64_t x = desc[PD_X], w = desc[PD_W], row0 = desc[PD_ROW0];
  if (!base || x >= P.pool_bytes || (P.pool_bytes - x) / row_bytes < row0 + total ||
      (w != kHtNoTensor && (w >= P.pool_bytes || (P.pool_bytes - w) / (w_bytes ? w_bytes : 1) < row0 + total)))
    return false;
  uint64_t* pw = ht_pull_words(B);
  pw[d] = base + x + row0 * row_bytes;
  pw[B.nranks + d] = w == kHtNoTensor ? 0 : base + w + row0 * w_bytes;
  return true;
}
// Where token side c reads d's row at ring position p: in d's x (in place) or in the ring.
GPUNET_DEVICE uint64_t ht_row_of(const HtParams& P, const uint64_t* pull_of, uint32_t c, uint32_t d, int32_t p) {
  return pull_of[d] ? pull_of[d] + uint64_t(p) * P.base.hidden * 2 : slot_addr(P, P.recv_ring, c, d, uint64_t(p));
}

// ---- the split in-place combine: the idle sender reduces half its channel ----------------------
// In an in-place combine whose rows all go in place (F_HT_PULL: each destination loads this rank's
// rows; nothing to stage) a sender block has nothing to do but wait for its final credits, while
// its channel's token side (the receiver block) loads and sums every row alone: at 20 SMs (10
// channels) half the grid idled. With F_HT_SPLIT the sender block c offers its rows, then claims
// the upper half of channel c's tokens [mid, ce) (a whole number of rounds) if every row the
// token side gets in that channel comes in place too (each source's tail has kHtDirectBit: no
// ring, so no credit depends on the order of the two blocks' reads). The receiver block reaches
// mid after its lower half and claims the rest for itself unless the sender claimed first: one
// CAS on a word tagged with the op counter decides, so neither waits for the other to decide.
// The helper gives no credit: it stores its highest row per source and an epoch-tagged done word;
// the receiver waits for that word (a grid-internal wait), takes the maximum of both blocks'
// rows, and gives the final credits (after the tail's re-check) as if it had read every row.
// The words (ht_split_words) have a part of the workspace of their own: the state words ws_word
// indexes with this launch's channel count, so a launch with fewer channels finds another
// launch's words (and tok_list's) where a channel-count-free index would put them.
enum : uint32_t { HT_SPLIT_HELP = 1, HT_SPLIT_NO = 2, HT_SPLIT_TAKEN = 3 };
// channel c's split words: [0] the claim (op << 2 | state), [1] the helper's done word (its op),
// [2 + d] the helper's highest row + 1 of source d. gpunet/device/ep.py ht_split_at mirrors it.
GPUNET_DEVICE uint64_t* ht_split_words(const HtParams& P, uint32_t c) {
  const uint64_t R = P.base.nranks;
  return ptr<uint64_t>(P.ws) + 2 * uint64_t(kHtMaxChannels) * R * WS_WORDS + R + 1 +
         uint64_t(kHtMaxChannels) * R * kHtMaxChunk / 2 + uint64_t(c) * (R + 2);
}

// The first token of the helper's half: half the channel rounded up to whole rounds of nwarps.
GPUNET_DEVICE uint64_t ht_split_mid(const Geo& g, uint64_t cb, uint64_t ce) {
  const uint64_t n = ce - cb, half = (n + 1) / 2;
  const uint64_t r = (half + g.nwarps - 1) / g.nwarps * g.nwarps;
  return cb + (r < n ? r : n);
}

// Thread 0: put `state` (tagged with this op) into channel c's split word unless this op's
// state is there already; returns the state that is there now.
GPUNET_DEVICE uint32_t ht_split_claim(const HtParams& P, uint32_t c, uint64_t epoch, uint32_t state) {
  uint64_t* w = ht_split_words(P, c);
  uint64_t v = arch::atomic_load(w);
  while ((v >> 2) != epoch) {
    const uint64_t old = arch::atomic_cas(w, v, (epoch << 2) | state);
    if (old == v) return state;
    v = old;
  }
  return uint32_t(v & 3);
}

// Thread 0 of sender block c, after its offers: whether it takes the upper half of channel c's
// token side. Every destination with rows must have been offered them in place, and every source
// with rows for this channel must have SET its tail in place; polls until then, until a source
// comes through the ring, or until the receiver block claims the half (it reached mid).
GPUNET_DEVICE bool ht_split_offer(const HtParams& P, uint32_t c, uint64_t epoch, const uint8_t* out) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks;
  for (uint32_t d = 0; d < R; ++d)
    if (d != B.rank && !out[d] && *ws_word(P, 0, c, d, WS_TOTAL) && !*ws_word(P, 0, c, d, WS_PULL)) return false;
  const int32_t* send_cnt = ptr<const int32_t>(P.send_cnt);
  const uint64_t t0 = arch::now_ns();
  for (uint32_t n = 0;; ++n) {
    bool all = true;
    for (uint32_t d = 0; d < R && all; ++d) {
      if (d == B.rank || out[d] || send_cnt[uint64_t(c) * R + d] == 0) continue;
      const uint64_t tail = read_count(P, HT_KIND_COMBINE, 0, c, d, epoch);
      if (tail == 0) {
        all = false;  // not SET yet: poll again
      } else if (tail == 0xffffffffull || !(tail & kHtDirectBit)) {
        ht_split_claim(P, c, epoch, HT_SPLIT_NO);  // rows through the ring (or a peer ahead)
        return false;
      }
    }
    if (all) return ht_split_claim(P, c, epoch, HT_SPLIT_HELP) == HT_SPLIT_HELP;
    if ((n & 7) == 0) {
      const uint64_t w = arch::atomic_load(ht_split_words(P, c));
      if ((w >> 2) == epoch || ep_failed(B) || arch::now_ns() - t0 > P.peer_timeout_ns) return false;
    }
    arch::spin_pause();
  }
}

// Combine, token side: rounds of one token per warp, each waiting for exactly its rows. The
// receiver block of channel c (helper false) and, in a split combine, its sender block for the
// upper half (helper true: ht_split_offer won; no credits, its rows handed over at the end).
GPUNET_DEVICE void ht_recv_combine(const HtParams& P, const Geo& g, uint32_t c, uint64_t epoch,
                                   uint8_t* out, bool helper, bool split) {
  const LlParams& B = P.base;
  const uint32_t R = B.nranks, nc = P.nchannels, H = B.hidden, K = B.topk;
  const uint64_t T = B.num_tokens;
  const uint64_t c0 = chan_begin(T, nc, c), c1 = chan_begin(T, nc, c + 1);
  const uint64_t mid = ht_split_mid(g, c0, c1);
  const bool may_split = split && !helper && (B.flags & F_HT_SPLIT) && mid < c1;
  const uint64_t cb = helper ? mid : c0;
  uint64_t ce = c1;  // the receiver: lowered to mid when the helper took the upper half
  const int32_t* send_pos = ptr<const int32_t>(P.send_pos);
  const int32_t* send_cnt = ptr<const int32_t>(P.send_cnt);
  // its own rows: read in place from x (rows [self_row, ...) of this channel), never sent
  const uint64_t self_row = uint64_t(ptr<const int32_t>(P.chan_prefix)[uint64_t(B.rank) * (nc + 1) + c]);
  uint32_t* const seen_of = ht_recv_words(B);
  uint32_t* const maxp_of = seen_of + R;
  uint32_t* const credit_of = seen_of + 2 * R;
  uint64_t* const pull_of = ht_pull_words(B);  // [0, R) rows, [R, 2R) weights (ht_take_pull)
  for (uint32_t d = g.tid; d < R; d += g.bdim) {
    arch::atomic_store(&seen_of[d], 0u);
    arch::atomic_store(&maxp_of[d], 0u);
    credit_of[d] = 0;
    pull_of[d] = pull_of[R + d] = 0;
  }
  arch::syncthreads();
  HtClock clk = ht_clock(B, g);
  const HtBulk bk = ht_bulk(P, g);
  for (uint64_t base = cb; base < ce; base += g.nwarps) {
    if (may_split && base == mid) {
      const uint32_t st = g.tid == 0 ? ht_split_claim(P, c, epoch, HT_SPLIT_TAKEN) : 0;
      if (arch::block_any(st == HT_SPLIT_HELP)) {
        // the helper reduces [mid, c1): this step reduces nothing and, once the helper's done
        // word says its rows are read, credits with the larger of both blocks' rows per source
        ce = mid;
        bool ok = true;
        if (g.tid == 0 && (ok = grid_wait(B, ht_split_words(P, c) + 1, epoch, EP_SITE_HT_COMBINE_ROW)))
          for (uint32_t d = 0; d < R; ++d) {
            const uint32_t h = uint32_t(ht_split_words(P, c)[2 + d]);
            if (h > arch::atomic_load(&maxp_of[d])) arch::atomic_store(&maxp_of[d], h);
          }
        if (arch::block_any(!ok)) break;
      }
    }
    const uint64_t t = base + g.wid;
    if (t < ce) {
      float wsum = 0.0f;       // lane k < K: the combined weight of slot k
      uint64_t have = 0;       // bit d (d < 64): d's row is here (the sum below reads those only)
      // wait for each row this token gets (d ascending); one timeout_s for all of them
      const uint64_t t0 = arch::now_ns();
      const uint64_t w0 = clk.on ? t0 : 0;
      for (uint32_t d = 0; d < R; ++d) {
        const int32_t p = send_pos[t * R + d];
        if (p < 0) continue;
        bool ok = !out[d];
        if (d == B.rank) {
          if (ok && g.lane < K && (B.flags & F_HT_WEIGHTS))
            wsum += ptr<const float>(P.topk_weights)[(self_row + uint64_t(p)) * K + g.lane];
          if (ok && d < 64) have |= uint64_t(1) << d;
          continue;
        }
        if (ok && g.lane == 0) {
          uint32_t* seen = &seen_of[d];
          if (arch::atomic_load(seen) <= uint32_t(p)) {
            uint32_t n = 0;
            uint64_t tail, tlast = t0, hb = 0;
            while ((tail = read_count(P, HT_KIND_COMBINE, 0, c, d, epoch)) <= uint64_t(p)) {
              if ((n++ & 7) == 0) {
                if (out[d]) {
                  ok = false;
                  break;
                }
                const uint64_t now = arch::now_ns();
                ht_heartbeat(P, now, out);
                if (now - tlast > P.peer_timeout_ns &&
                    ht_silent(P, d, &hb, &tlast, P.peer_timeout_ns, now, t0)) {
                  ok = false;
                  break;
                }
              }
              arch::spin_pause();
            }
            if (ok && tail != 0xffffffffull) {
              // The row this wait was for names this op and the ring this rank's layout has
              // (ht_stage). Checked once per tail read, not per row: a sender whose Config has
              // another ring put every row elsewhere; this row is then another op's or ring's
              // (tests/test_ep_ht.py test_ranks_whose_combine_configs_differ_in_the_ring_raise).
              // In place (kHtDirectBit): the descriptor in slot 0 carries them the same way.
              const bool pull = (tail & kHtDirectBit) != 0;
              tail &= ~kHtDirectBit;
              const int32_t* m =
                  ptr<const int32_t>(slot_addr(P, P.recv_ring, c, d, pull ? 0 : uint64_t(p)) + B.payload_bytes);
              const uint32_t op = uint32_t(m[2]), ring = uint32_t(m[3]);
              if (op != uint32_t(epoch) || ring != P.ring) {
                ep_fail(B, EP_ERR_MISMATCH, EP_SITE_HT_COMBINE_ROW, d, (uint64_t(P.ring) << 32) | uint32_t(epoch),
                        (uint64_t(ring) << 32) | op, 0);
                ok = false;
              } else if (pull && (tail != uint64_t(send_cnt[uint64_t(c) * R + d]) || !ht_take_pull(P, c, d, tail))) {
                ep_fail(B, EP_ERR_BAD_MESSAGE, EP_SITE_HT_COMBINE_ROW, d, uint64_t(send_cnt[uint64_t(c) * R + d]),
                        tail, 0);
                ok = false;
              } else {
                arch::fence_sys();  // release: what this acquire made visible, to the warps reading seen
                arch::atomic_store(seen, uint32_t(tail));
              }
            }
            if (!ok && !out[d]) peer_fail_view(B, out, d);
          } else {
            arch::fence_sys();  // acquire: the rows below the tail another warp of this block read
          }
        }
        ok = arch::shfl(ok ? 1u : 0u, 0) != 0;
        if (!ok) continue;
        if (d < 64) have |= uint64_t(1) << d;
        arch::syncwarp();  // lane 0's pull words (taken, or acquired, above) before the lanes read them
        if (g.lane < K && (B.flags & F_HT_WEIGHTS)) {
          const uint64_t pw = pull_of[R + d];
          wsum += pull_of[d] ? (pw ? ptr<const float>(pw)[uint64_t(p) * K + g.lane] : 0.0f)
                             : ptr<const float>(slot_addr(P, P.recv_ring, c, d, uint64_t(p)) +
                                                B.payload_bytes)[4 + kMaxTopk + g.lane];
        }
        if (g.lane == 0) arch::atomic_max(&maxp_of[d], uint32_t(p) + 1);
      }
      if (w0) ht_stamp_add(B, g, HT_ST_T_IDLE, arch::now_ns() - w0);
      // out[t] = bias0 + bias1 + sum_d row_d: a second pass over the rows (they are all here now).
      // With bulk buffers and at most kReduceRows rows: lane 0 lists them, ht_reduce_bulk sums.
      uint32_t nrows = kReduceRows + 1;
      if (bk.buf) {
        if (g.lane == 0) {
          uint64_t* rows = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(bk.bar) + kBulkRowsAt);
          const uint64_t bias[2] = {P.bias0, P.bias1};
          nrows = 0;
          for (uint32_t b = 0; b < P.nbias; ++b) rows[nrows++] = bias[b] + t * H * 2;
          for (uint32_t d = 0; d < R && nrows <= kReduceRows; ++d) {
            const int32_t p = send_pos[t * R + d];
            if (p < 0 || (d < 64 ? !((have >> d) & 1) : out[d] != 0)) continue;
            if (nrows < kReduceRows)
              rows[nrows] = d == B.rank ? P.x + (self_row + uint64_t(p)) * H * 2 : ht_row_of(P, pull_of, c, d, p);
            ++nrows;
          }
        }
        nrows = arch::shfl(nrows, 0);
        arch::syncwarp();  // lane 0's list
      }
      if (nrows == 0) {  // no row and no bias: zeros
        for (uint32_t c0 = g.lane * 8; c0 < H; c0 += g.ws * 8) *ptr<V16>(P.out_x + (t * H + c0) * 2) = V16{0, 0};
      } else if (nrows <= kReduceRows) {
        ht_reduce_bulk(P, g, bk, nrows, P.out_x + t * H * 2);
      } else {
        // kU groups of 8 columns per lane at a time: kU row loads in flight (host memory on GPUs)
        constexpr uint32_t kU = 4;
        const uint32_t span = g.ws * 8;
        for (uint32_t c0 = g.lane * 8; c0 < H; c0 += span * kU) {
          float acc[kU][8];
          for (uint32_t u = 0; u < kU; ++u)
            for (uint32_t q = 0; q < 8; ++q) acc[u][q] = 0.0f;
          const uint64_t bias[2] = {P.bias0, P.bias1};
          for (uint32_t b = 0; b < P.nbias; ++b)
            for (uint32_t u = 0; u < kU && c0 + u * span < H; ++u) {
              const V16 v = *ptr<const V16>(bias[b] + (t * H + c0 + u * span) * 2);
              for (uint32_t q = 0; q < 8; ++q) acc[u][q] += bf16_at(v, q);
            }
          for (uint32_t d = 0; d < R; ++d) {
            const int32_t p = send_pos[t * R + d];
            if (p < 0 || (d < 64 ? !((have >> d) & 1) : out[d] != 0)) continue;
            const uint64_t row = d == B.rank ? P.x + (self_row + uint64_t(p)) * H * 2 : ht_row_of(P, pull_of, c, d, p);
            V16 v[kU];
            for (uint32_t u = 0; u < kU; ++u)
              if (c0 + u * span < H) v[u] = *ptr<const V16>(row + uint64_t(c0 + u * span) * 2);
            for (uint32_t u = 0; u < kU && c0 + u * span < H; ++u)
              for (uint32_t q = 0; q < 8; ++q) acc[u][q] += bf16_at(v[u], q);
          }
          for (uint32_t u = 0; u < kU && c0 + u * span < H; ++u) {
            V16 o = {0, 0};
            for (uint32_t q = 0; q < 8; ++q)
              (q < 4 ? o.a : o.b) |= uint64_t(f32_to_bf16(acc[u][q])) << (16 * (q & 3));
            *ptr<V16>(P.out_x + (t * H + c0 + u * span) * 2) = o;
          }
        }
      }
      if (P.out_weights && g.lane < K) ptr<float>(P.out_weights)[t * K + g.lane] = wsum;
    }
    arch::syncthreads();  // the round's rows are read: credit them
    ht_stamp_add(B, g, HT_ST_T_MOVE, clk.lap());
    if (clk.on && !ptr<uint64_t>(B.prof)[uint64_t(g.bid) * kStamps + HT_ST_STEPS]) stamp(B, g, HT_ST_FIRST);
    ht_stamp_add(B, g, HT_ST_STEPS, 1);
    if (!helper) {  // the helper credits nothing: the receiver credits its rows (below)
      for (uint32_t d = g.tid; d < R; d += g.bdim) {
        if (out[d] || d == B.rank) continue;
        const uint64_t m = arch::atomic_load(&maxp_of[d]);
        const uint64_t cr = credit_of[d];
        const uint64_t total = uint64_t(send_cnt[uint64_t(c) * R + d]);
        // in place: one credit, at the end, and only while d still holds its rows for this rank
        // (its tail as it offered them: ht_offer_pull / ht_pull_revoke); the loads came before
        const bool pull = pull_of[d] != 0;
        if (m > cr && (m == total || (!pull && m - cr >= P.chunk))) {
#if defined(GPUNET_TEST_HT_PULL_STALL_NS)
          // (tests/test_ep_ht.py) a token side that stalls after its loads, before its final credit:
          // the sender gives it up meanwhile and revokes its rows (ht_pull_revoke)
          if (pull)
            for (const uint64_t t0 = arch::now_ns(); arch::now_ns() - t0 < uint64_t(GPUNET_TEST_HT_PULL_STALL_NS);)
              arch::spin_pause();
#endif
          if (pull) arch::fence_sys();
          const uint64_t tail = pull ? read_count(P, HT_KIND_COMBINE, 0, c, d, epoch) : 0;
          if (pull && tail != (total | kHtDirectBit)) {
            ep_fail(B, EP_ERR_BAD_MESSAGE, EP_SITE_HT_COMBINE_ROW, d, total | kHtDirectBit, tail, 1);
            peer_fail_view(B, out, d);
          } else if (!write_count(P, HT_KIND_COMBINE, 1, c, d, epoch, m)) {
            peer_fail_view(B, out, d);
          }
          credit_of[d] = uint32_t(m);
        }
      }
    }
    arch::syncthreads();
    ht_stamp_add(B, g, HT_ST_T_POST, clk.lap());
  }
  ht_stamp_add(B, g, HT_ST_ITEMS, ce - cb);
  if (helper) {
    // hand the rows read over to the receiver block, which credits them (ht_split_offer)
    for (uint32_t d = g.tid; d < R; d += g.bdim) ht_split_words(P, c)[2 + d] = arch::atomic_load(&maxp_of[d]);
    arch::syncthreads();
    if (g.tid == 0) {
      grid_fence(B);  // release: the loads above are done, the words stored
      arch::atomic_store(ht_split_words(P, c) + 1, epoch);
    }
  }
}

// ---- num_worst_tokens: the rows past the received ones ---------------------------------------------

// They read "no expert" (recv_topk_idx -1, weight 0): written here, by the whole grid after the
// notify (recv_info[R] is the received total), so the host allocates them uninitialised (two
// fill launches less in the call's host time, which the GPU waits out in a call it starts idle).
// A masked rank's rows (enable_shrink) are never written: the host still fills those calls.
GPUNET_DEVICE void ht_fill_tail(const HtParams& P, const Geo& g) {
  const LlParams& B = P.base;
  const uint64_t K = B.topk;
  if (!K || !P.out_topk_idx) return;
  const uint64_t end = uint64_t(P.num_recv_max) * K;
  const uint64_t stride = uint64_t(g.nblocks) * g.bdim;
  for (uint64_t i = uint64_t(ptr<const int32_t>(P.recv_info)[B.nranks]) * K + uint64_t(g.bid) * g.bdim + g.tid;
       i < end; i += stride) {
    ptr<int64_t>(P.out_topk_idx)[i] = -1;
    if (P.out_weights) ptr<float>(P.out_weights)[i] = 0.0f;
  }
}

// The last block of a dispatch with a receive pool: every mapped source this rank ends the op
// without (failed or masked) gets its descriptor revoked (ht_desc_current): the receive tensors
// go back to the caller now, and a late source must not store into them.
GPUNET_DEVICE void ht_revoke_descs(const HtParams& P, const Geo& g, uint64_t epoch) {
  const LlParams& B = P.base;
  store_at_mapped_peers(B, g, ht_desc_sig(P, B.rank), (epoch << 32) | 2,
                        [&](uint32_t j) { return peer_out(B, j); });
}

// ---- the kernel ------------------------------------------------------------------------------------

// split: this launch may split its in-place combine (F_HT_SPLIT). A compile-time constant in each
// kernel (ep_ht.cu k_ep_ht<split>): the split's code, compiled into every launch, cost the
// others ~3-7% on an H100 (the kernel is at its 128-register bound: ptxas 1010 bytes of spill
// stores against 852), so only the split combine's launches run the kernel that holds it.
GPUNET_DEVICE void run_ht(const HtParams& P, bool split) {
  const Geo g = geo();
  const LlParams& B = P.base;
  // The prelaunched data phase (F_HT_PRE; Buffer.dispatch): the host launched it right behind the
  // notify, into receive tensors sized from the last dispatch's rows, so that no host time lies
  // between the two kernels. It runs only when the notify's go word says those tensors hold this
  // op's rows and no rank was out; else every block ends here (nothing sent, no epoch bump, no
  // descriptor) and the host, seeing the same word, launches the data phase again with tensors
  // for the rows. A peer whose data phase comes later is waited for as a late peer is.
  if ((B.flags & F_HT_PRE) && !(B.phases & PH_NOTIFY) &&
      ptr<const int32_t>(P.recv_info)[B.nranks + 1 + B.e_loc] == 0)
    return;
  const uint64_t epoch = arch::atomic_load(ptr<const uint64_t>(P.epoch));
  bool ok = true;
  if ((B.phases & PH_NOTIFY) && g.bid == 0) ht_notify(P, g, epoch);
  if ((B.phases & PH_NOTIFY) && (B.phases & PH_DATA)) {
    if (g.bid == 0) block_publish(B, g, HT_SYNC_NOTIFY);
    else ok = block_wait(B, g, HT_SYNC_NOTIFY, 1, EP_SITE_HT_NOTIFY);
  }
  if (ok && (B.phases & PH_DATA) && !ep_failed(B)) {
    stamp(B, g, HT_ST_BEGIN);
    if ((B.flags & F_HT_WORST) && B.op == OP_HT_DISPATCH) ht_fill_tail(P, g);
    ht_bulk_init(P, g);
    uint8_t* out = load_peer_view(B, g);
    const uint32_t c = g.bid / 2;
    if (c < P.nchannels) {
      // even blocks send, odd blocks receive; in a split in-place combine a sender may first reduce
      // half its channel's tokens (ht_send_begin). `split` is a constant in each kernel, which
      // holds one inlined copy of each role either way (a second copy spilled more).
      const bool sender = g.bid % 2 == 0;
      if (!split) {
        if (sender) {
          ht_send_begin(P, g, c, epoch, out, false);
          ht_send(P, g, c, epoch, out);
        } else if (B.op == OP_HT_COMBINE) {
          ht_recv_combine(P, g, c, epoch, out, false, false);
        } else {
          ht_recv_dispatch(P, g, c, epoch, out);
        }
      } else {
        const bool helper = sender && ht_send_begin(P, g, c, epoch, out, true);
        if (!sender || helper) ht_recv_combine(P, g, c, epoch, out, helper, true);
        if (sender) ht_send(P, g, c, epoch, out);
      }
    }
    stamp(B, g, HT_ST_END);
  }
  if (last_block(B, g, HT_SYNC_END)) {
    if (B.op == OP_HT_DISPATCH && (B.flags & F_HT_DESC) && (B.phases & PH_DATA)) ht_revoke_descs(P, g, epoch);
    if (g.tid == 0 && (B.flags & F_HT_BUMP)) {
      arch::atomic_store(ptr<uint64_t>(P.epoch), epoch + 1);
      arch::fence_sys();
    }
    reset_sync(B, g, HT_SYNC_NOTIFY, HT_SYNC_END);
  }
}

}  // namespace ep
}  // namespace gpunet
