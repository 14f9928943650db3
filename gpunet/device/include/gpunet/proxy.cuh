// gpunet/proxy.cuh — the CPU-proxy FIFO, device side: 16-byte commands pushed into a host-mapped
// multi-producer FIFO that CPU threads (gpunet/host/proxy.py) drain into mlx5 QPs. The mechanism under
// transport/proxy.cuh (the verbs for peers whose doorbell cannot be mapped into the GPU, DESIGN.md
// "Transports under one device API"); failures use status.cuh's vocabulary.
//
// The command format, the channel's memory layout and the completion protocol are defined here;
// gpunet/device/abi.py mirrors the format and the layout (PROXY_*) and gpunet/host/proxy.py drains by them
// (tests/test_proxy.py checks the mirror against this header compiled).
//
// ------------------------------------------------------------------------------------------------
// Command: two 64-bit words, little-endian, 16-byte aligned slot.
//
//   w0  63      VALID      lap parity: command sequence s (0, 1, 2, ...) carries ((s/depth)&1)^1,
//                          so lap 0 writes 1 into the zeroed ring, lap 1 writes 0, ... A slot is
//                          never cleared: the consumer at tail t expects ((t/depth)&1)^1 and a
//                          stale slot from the previous lap shows the other parity. (A producer is
//                          never more than one lap ahead of the tail: it waits for space first.)
//       58..62  OP         OP_* (5 bits)
//       46..57  PEER       destination rank (12 bits)
//       39..45  LOCAL_HI   local heap offset bits 32..38
//       32..38  REMOTE_HI  remote heap offset bits 32..38
//        0..31  ARG        PUT/GET: bytes. SIGNAL_ADD/SIGNAL_SET: the 64-bit value's low half.
//                          ATOMIC_FA, OPERAND: 0.
//   w1   0..31  LOCAL_LO   local heap offset bits 0..31 (SIGNAL_*: the value's high half)
//       32..63  REMOTE_LO  remote heap offset bits 0..31
//   OPERAND's w1 is a whole 64-bit value instead (see ATOMIC_FA).
//
// Why these widths:
//   - offsets are 39 bits: EP buffers reach several GiB (DeepEP normal mode), and a 4 GiB heap cap
//     would be a silent limit;
//   - sizes are 32 bits: an mlx5 data segment's byte_count is 32 bits and ConnectX's max_msg_sz is
//     1 GiB, so a larger size never reaches the wire in one WQE anyway (the proxy splits at 1 GiB;
//     proxy_put splits above 4 GiB - 1 into several commands);
//   - SIGNAL_ADD / SIGNAL_SET carry a full 64-bit value (ARG + LOCAL_LO): they land nowhere locally
//     (the proxy owns the 8-byte landing slot an mlx5 atomic needs), so the local offset is free;
//   - ATOMIC_FA needs the result offset AND a 64-bit addend, more than one slot holds: it is TWO
//     commands in ONE reservation, the header (op, peer, result offset in LOCAL, word offset in
//     REMOTE) in slot s and OPERAND (the addend in w1) in slot s + 1. The proxy takes the pair only
//     once both slots are valid and completes the operand with its header (tests/test_api_transport.py
//     checks addends 2**31, 2**63, 2**64 - 1 and -1 through the API).
//   - put_signal is two commands in ONE reservation (adjacent slots, same channel), so the signal
//     goes on the same QP right behind its payload: the RC QP executes in order, so a receiver that
//     sees the signal sees the payload.
// The 8-byte words the NIC's atomics touch (signals, fetch-add results) are numbers in the NIC's
// atomic order (Nic.atomic_endianness: native by default, big-endian in the IB wire order);
// this header moves their bytes unchanged and the transport above converts them with
// api::signal_order (devctx.cuh), the one place that knows the order.
//
// Write order: the producer stores w1 (relaxed), then w0 with store_release_sys, so the proxy,
// which loads w0 with acquire and checks VALID before loading w1, never reads a half-written
// command. A 16-byte vector store would be one PCIe write in practice, but nothing guarantees its
// single-copy atomicity, so the valid bit lives in the word written last.
//
// ------------------------------------------------------------------------------------------------
// Channel memory (ProxyChannel holds three addresses):
//   fifo      depth x 16 B, host-mapped (policy "proxy_fifo": pinned host memory the GPU maps).
//   HostCtrl  64 B, host-mapped, written only by the channel's proxy thread, read by producers:
//             tail (commands taken from the FIFO), completed (every command with a sequence below
//             it has completed at the NIC), error (0 or the first failure, packed), err_seq and
//             err_peer (the failed command's sequence and destination rank, written before error).
//   DevCtrl   128 B, device memory, touched only by producers: head (slots reserved, atomic_add)
//             and, on its own 64-byte line, cached_tail (the largest tail any producer has read).
//
// Push (proxy_push / proxy_push_warp):
//   1. seq = atomic_add(head, n)                         one reservation per call (per WARP in
//                                                        proxy_push_warp: 1 atomic for 32/64 lanes)
//   2. space: seq + n <= cached_tail + depth ?           device memory, cheap. Only if it says
//      else loop { t = load_acquire_sys(host tail);      full: read the host tail over PCIe, raise
//                  cached_tail = max(cached_tail, t);    cached_tail for everyone, back off
//                  until seq + n <= t + depth }          exponentially, bounded by the Waiter's
//                                                        timeout (FACTS: 16,896 lanes spinning on
//                                                        the tail collapsed the ring to 2.8 M/s)
//   3. per slot: store_relaxed(w1); store_release_sys(w0 | VALID)
//   Returns the issue count seq + n: pass it to proxy_quiet.
//
//   A push that gives up in step 2 leaves its reserved slots unwritten, and the proxy stops at the
//   first of them: it times out (STATUS_TIMEOUT, SITE_PROXY_FIFO: space only fails to appear when
//   the proxy is gone or stuck for the whole timeout), or it sees a failure recorded meanwhile
//   (any failure in the Status: the grid drains at once, it does not wait for the proxy). With no
//   kernel running the host fills those slots with NOPs as the proxy frees them
//   (gpunet/host/proxy.py ProxyChannel.fill_holes, called by gpunet.context's recovery), so the
//   channel drains and stays usable; a channel whose proxy is gone stays lost.
//
// Completion (the proxy, gpunet/host/proxy.py): each command becomes WQE(s) on the peer's QP chosen by
// (channel, peer), so one channel's commands to one peer stay in order on one QP. Commands to
// different peers complete out of order across QPs; the proxy keeps an in-order window of depth
// slots per channel and advances `completed` only over a prefix of completed commands. It takes a
// command from the FIFO only while tail - completed < depth. An error CQE completes its command
// (and every later flushed one) and records the first failure of the channel in HostCtrl.error
// (release-stored after err_seq / err_peer and before the `completed` that covers it).
//
// Quiet (proxy_quiet): bounded wait until completed >= issued, reading ONE word of HostCtrl over
// PCIe per poll: `completed`, whose top bit (COMPLETED_ERROR) the proxy sets in every value it
// publishes once HostCtrl.error holds a failure (error, err_seq, err_peer are stored first,
// release). Why one word: a read over PCIe costs ~1.4 us, and polling error then completed made
// every poll 2.8 us, so a command that completed just after a poll waited 2.8 us more (H200: the
// round trip through the soft NIC measured 7.5-8.5 us against 4.2 us for the proxy alone,
// bench/proxy.py). A set COMPLETED_ERROR fails the quiet; HostCtrl.error is copied into the
// Status block (first failure wins; STATUS_COMPLETION_ERROR with syndrome / qpn / wqe_counter, the failed command's peer, the
// channel and the command's sequence). An error is sticky: every later quiet on the channel fails.
// HostCtrl.error is the authoritative record of a channel's failure (the host raises it with
// ProxyChannel.raise_if_error whether or not a kernel quieted); the Status holds a copy of it, made
// by the first quiet that saw it (tests/test_status.py checks that both name the same peer).
// ------------------------------------------------------------------------------------------------
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "status.cuh"

namespace gpunet {
namespace proxy {

// ---- command format (gpunet/device/abi.py mirrors every value as PROXY_*) ------------------------------
enum : uint32_t {
  OP_NOP = 0,         // completes when every earlier command of the channel has
  OP_PUT = 1,         // RDMA WRITE local[loff, +size) -> peer[roff, +size)
  OP_GET = 2,         // RDMA READ  peer[roff, +size) -> local[loff, +size)
  OP_SIGNAL_ADD = 3,  // 8-byte fetch-add of a 64-bit value on peer[roff] (result dropped)
  OP_ATOMIC_FA = 4,   // 8-byte fetch-add on peer[roff]; old value -> local[loff] (BE); the addend
                      // is in the OPERAND command right behind it (same reservation)
  OP_SIGNAL_SET = 5,  // 8-byte store of a 64-bit value (in the NIC's atomic order) to peer[roff]
  OP_OPERAND = 6,     // the 64-bit operand (w1) of the command in the slot before it
  OP_MAX = 6,
};

constexpr uint32_t kCmdBytes = 16;
constexpr uint32_t VALID_SHIFT = 63, OP_SHIFT = 58, PEER_SHIFT = 46, LOCAL_HI_SHIFT = 39,
                   REMOTE_HI_SHIFT = 32;
constexpr uint64_t OP_MASK = 0x1f, PEER_MASK = 0xfff, HI_MASK = 0x7f, ARG_MASK = 0xffffffffull;
constexpr uint32_t OFFSET_BITS = 39;
constexpr uint64_t MAX_OFFSET = (uint64_t(1) << OFFSET_BITS) - 1;
constexpr uint32_t MAX_PEERS = PEER_MASK + 1;
constexpr uint64_t MAX_CMD_SIZE = ARG_MASK;

// packed HostCtrl.error: code(8) | syndrome(8) | vendor syndrome(8) | wqe_counter(16) | qpn(24)
enum : uint32_t { ERR_NONE = 0, ERR_CQE = 1, ERR_BAD_COMMAND = 2 };
constexpr uint64_t COMPLETED_ERROR = uint64_t(1) << 63;   // HostCtrl.completed: error is set

struct Command {
  uint64_t w0, w1;
};
static_assert(sizeof(Command) == kCmdBytes, "16-byte commands");

struct HostCtrl {          // host-mapped; written by the proxy thread only
  uint64_t tail;           // @0  commands taken from the FIFO (published every N and when idle)
  uint64_t completed;      // @8  every command with sequence < (completed & ~COMPLETED_ERROR) has
                           //     completed; bit 63 (COMPLETED_ERROR): `error` holds a failure
  uint64_t error;          // @16 0, or the channel's first failure (packed, see above)
  uint64_t err_seq;        // @24 sequence of the failed command (written before error)
  uint64_t err_peer;       // @32 destination rank of the failed command (written before error)
  uint64_t reserved[3];
};
static_assert(sizeof(HostCtrl) == 64, "HostCtrl layout is mirrored in gpunet/device/abi.py");
static_assert(__builtin_offsetof(HostCtrl, err_peer) == 32, "PROXY_HC_ERR_PEER in gpunet/device/abi.py");

struct DevCtrl {           // device memory; producers only
  uint64_t head;           // @0  slots reserved
  uint64_t pad0[7];
  uint64_t cached_tail;    // @64 max tail seen by any producer (own line: read by every push)
  uint64_t pad1[7];
};
static_assert(sizeof(DevCtrl) == 128, "DevCtrl layout is mirrored in gpunet/device/abi.py");

struct ProxyChannel {      // the descriptor device code gets (descriptors.proxy_channel_desc fills it)
  uint64_t fifo;           // Command[depth], host-mapped (the GPU's address of it)
  uint64_t host;           // HostCtrl*, host-mapped
  uint64_t dev;            // DevCtrl*, device memory
  uint32_t depth;          // power of two
  uint32_t id;             // channel index in its engine (for Status)
};
static_assert(sizeof(ProxyChannel) == 32, "ProxyChannel layout is mirrored in gpunet/device/abi.py");

// Backoff of a producer that found the FIFO full: spin_pause() 1, 2, 4, ... kMaxBackoff times
// between two reads of the host tail (CUDA: __nanosleep(64) each, so at most ~4 us between PCIe
// reads; the proxy drains a full 1024-slot ring in ~100+ us, so a longer sleep would not cost
// throughput, a shorter one would cost PCIe bandwidth).
constexpr uint32_t kMaxBackoff = 64;
// Quiet: the first kQuietEagerPolls polls of `completed` go back to back, with nothing else
// between them (no Status read, no pause): each is one PCIe read (~1.4 us on the H200, half the
// 2.85 us round trip of FACTS.md), so a poll's own latency paces the loop, and anything added
// between two polls is added to every round trip whose completion lands during it (a Status read
// there made the first two polls ~2.8 us apart). Two eager polls cover a round trip (the first
// returns before the proxy can have answered, the second is the one that sees a prompt answer);
// then each poll is followed by kQuietBackoff spin_pause()s, which leave issue slots to other
// warps and, on the HOST arm, yield the core to the proxy and let the emulated store buffer drain
// (P1). The Status and the clock are read every kQuietCheckEvery polls (never among the eager
// ones). bench/proxy.py --gpu measures it (the round trip rows).
constexpr uint32_t kQuietEagerPolls = 2;
constexpr uint32_t kQuietBackoff = 2;
constexpr uint32_t kQuietCheckEvery = 8;

// ---- encoding ------------------------------------------------------------------------------------
GPUNET_HOST_DEVICE Command encode(uint32_t op, uint32_t peer, uint64_t arg, uint64_t local_off,
                                  uint64_t remote_off) {
  Command c;
  c.w0 = ((uint64_t(op) & OP_MASK) << OP_SHIFT) | ((uint64_t(peer) & PEER_MASK) << PEER_SHIFT) |
         (((local_off >> 32) & HI_MASK) << LOCAL_HI_SHIFT) |
         (((remote_off >> 32) & HI_MASK) << REMOTE_HI_SHIFT) | (arg & ARG_MASK);
  c.w1 = (local_off & ARG_MASK) | ((remote_off & ARG_MASK) << 32);
  return c;
}
GPUNET_HOST_DEVICE Command encode_signal(uint32_t op, uint32_t peer, uint64_t value,
                                         uint64_t remote_off) {
  return encode(op, peer, value & ARG_MASK, value >> 32, remote_off);
}
// The OPERAND command carrying `value` for the command in the slot before it.
GPUNET_HOST_DEVICE Command encode_operand(uint32_t peer, uint64_t value) {
  Command c = encode(OP_OPERAND, peer, 0, 0, 0);
  c.w1 = value;
  return c;
}
GPUNET_HOST_DEVICE uint32_t command_peer(const Command& c) {
  return uint32_t((c.w0 >> PEER_SHIFT) & PEER_MASK);
}
GPUNET_HOST_DEVICE uint64_t valid_bit(uint64_t seq, uint32_t depth) {
  return (((seq / depth) & 1) ^ 1) << VALID_SHIFT;
}

namespace detail {

GPUNET_DEVICE HostCtrl* hctrl(const ProxyChannel& ch) {
  return reinterpret_cast<HostCtrl*>(uintptr_t(ch.host));
}
GPUNET_DEVICE DevCtrl* dctrl(const ProxyChannel& ch) {
  return reinterpret_cast<DevCtrl*>(uintptr_t(ch.dev));
}
GPUNET_DEVICE Command* slot(const ProxyChannel& ch, uint64_t seq) {
  return reinterpret_cast<Command*>(uintptr_t(ch.fifo)) + (seq & (ch.depth - 1));
}
GPUNET_DEVICE uint32_t popc64(uint64_t x) {  // portable: arch.cuh has no popcount
  x = x - ((x >> 1) & 0x5555555555555555ull);
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
  return uint32_t((x * 0x0101010101010101ull) >> 56);
}

// cached_tail = max(cached_tail, t)
GPUNET_DEVICE void raise_cached_tail(DevCtrl* d, uint64_t t) {
  uint64_t cur = arch::atomic_load(&d->cached_tail);
  while (cur < t) {
    const uint64_t old = arch::atomic_cas(&d->cached_tail, cur, t);
    if (old == cur) break;
    cur = old;
  }
}

// Step 2: wait until slots [seq, seq + n) are free. false: a failure is recorded (or was).
// `peer`: the destination of the commands waiting (PEER_NONE for a warp's mixed peers).
GPUNET_DEVICE bool wait_space(const ProxyChannel& ch, const Waiter& w, uint64_t seq, uint32_t n,
                              uint32_t peer) {
  DevCtrl* d = dctrl(ch);
  if (seq + n <= arch::atomic_load(&d->cached_tail) + ch.depth) return true;  // the common case
  HostCtrl* h = hctrl(ch);
  const uint64_t t0 = arch::now_ns();
  uint32_t backoff = 1;
  uint64_t t = 0;
  for (;;) {
    t = arch::load_acquire_sys(&h->tail);
    raise_cached_tail(d, t);
    if (seq + n <= t + ch.depth) return true;
    if (failed(w)) return false;
    const uint64_t now = arch::now_ns();
    if (now - t0 > w.timeout_ns) {
      Failure f(STATUS_TIMEOUT, SITE_PROXY_FIFO);
      f.peer = peer;
      f.channel = ch.id;
      f.seq = seq;
      f.expected = seq + n - ch.depth;  // the tail this push needs
      f.observed = t;
      f.waited_ns = now - t0;
      record_failure(w.st, f);
      return false;
    }
    for (uint32_t i = 0; i < backoff; ++i) arch::spin_pause();
    if (backoff < kMaxBackoff) backoff *= 2;
    // someone else may have read a newer tail meanwhile
    if (seq + n <= arch::atomic_load(&d->cached_tail) + ch.depth) return true;
  }
}

// Step 3 for one slot.
GPUNET_DEVICE void write_slot(const ProxyChannel& ch, uint64_t seq, const Command& c) {
  Command* s = slot(ch, seq);
  arch::store_relaxed(&s->w1, c.w1);
  arch::store_release_sys(&s->w0, c.w0 | valid_bit(seq, ch.depth));  // publishes w1 too
}

// The command fields are in range: peer < MAX_PEERS, the (end) offsets <= MAX_OFFSET, `size` <=
// `max_size`. Otherwise a BAD_ARGUMENT names the first field out of range (limit vs given).
GPUNET_DEVICE bool check_args(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                              uint64_t local_off, uint64_t remote_off, uint64_t size = 0,
                              uint64_t max_size = 0) {
  uint64_t limit = 0, got = 0;
  if (peer >= MAX_PEERS) {
    limit = MAX_PEERS - 1, got = peer;
  } else if (local_off > MAX_OFFSET || remote_off > MAX_OFFSET) {
    limit = MAX_OFFSET, got = local_off > remote_off ? local_off : remote_off;
  } else if (size > max_size) {
    limit = max_size, got = size;
  } else {
    return true;
  }
  Failure f(STATUS_BAD_ARGUMENT, SITE_PROXY_ARG);
  f.peer = peer;
  f.channel = ch.id;
  f.expected = limit;
  f.observed = got;
  record_failure(w.st, f);
  return false;
}

}  // namespace detail

// ---- push ----------------------------------------------------------------------------------------

// Push `n` commands (1..depth) with one reservation, in order, from one thread. `issued` gets the
// channel's issue count after them (pass it to proxy_quiet). false: a failure is recorded.
GPUNET_DEVICE bool proxy_push_n(const ProxyChannel& ch, const Waiter& w, const Command* cmds,
                                uint32_t n, uint64_t* issued = nullptr) {
  if (n == 0 || n > ch.depth) {
    Failure f(STATUS_BAD_ARGUMENT, SITE_PROXY_ARG);
    f.channel = ch.id;
    f.expected = ch.depth;
    f.observed = n;
    record_failure(w.st, f);
    return false;
  }
  DevCtrl* d = detail::dctrl(ch);
  const uint64_t seq = arch::atomic_add(&d->head, uint64_t(n));
  // The Status and the cached tail are read with the reservation in flight, not before it (one
  // round trip to device memory per push, not two: bench/proxy.py's round trip). A failure
  // recorded meanwhile fills the slots with NOPs (completed by the proxy as soon as it reads
  // them), so the channel stays whole; when there is no room for them, the host's recovery
  // writes them (the header: "A push that gives up").
  const bool was_failed = failed(w);
  const uint64_t cached = arch::atomic_load(&d->cached_tail);
  const bool room = seq + n <= cached + ch.depth;
  if (was_failed) {
    if (room || detail::wait_space(ch, w, seq, n, command_peer(cmds[0])))
      for (uint32_t i = 0; i < n; ++i) detail::write_slot(ch, seq + i, encode(OP_NOP, 0, 0, 0, 0));
    return false;
  }
  if (!room && !detail::wait_space(ch, w, seq, n, command_peer(cmds[0]))) return false;
  for (uint32_t i = 0; i < n; ++i) detail::write_slot(ch, seq + i, cmds[i]);
  if (issued) *issued = seq + n;
  return true;
}

GPUNET_DEVICE bool proxy_push(const ProxyChannel& ch, const Waiter& w, const Command& cmd,
                              uint64_t* issued = nullptr) {
  return proxy_push_n(ch, w, &cmd, 1, issued);
}

// Warp-cooperative push: EVERY lane of the warp calls it (converged, arch's *_sync rule); lanes
// with `active` push `cmd`. One atomic_add for the whole warp (lane 0), one space check, then each
// active lane writes slot base + (active lanes below it). Correct for warps of 32 and 64 (ballot
// is 64-bit). Returns the same answer on every lane; `issued` = base + number of active lanes.
GPUNET_DEVICE bool proxy_push_warp(const ProxyChannel& ch, const Waiter& w, const Command& cmd,
                                   bool active, uint64_t* issued = nullptr) {
  const uint32_t lane = arch::lane_id();
  const uint64_t mask = arch::ballot(active);
  const uint32_t total = detail::popc64(mask);
  const uint64_t below = lane >= 64 ? mask : (mask & ((uint64_t(1) << lane) - 1));
  const uint32_t rank = detail::popc64(below);
  uint64_t base = 0;
  uint32_t ok = 1;
  if (lane == 0) {
    if (failed(w)) {
      ok = 0;
    } else if (total > 0) {
      base = arch::atomic_add(&detail::dctrl(ch)->head, uint64_t(total));
      ok = detail::wait_space(ch, w, base, total, PEER_NONE) ? 1u : 0u;
    }
  }
  base = arch::shfl(base, 0);
  ok = arch::shfl(ok, 0);
  if (ok && active) detail::write_slot(ch, base + rank, cmd);
  if (issued) *issued = base + total;
  return ok != 0;
}

// ---- completion ----------------------------------------------------------------------------------

// Copy the channel's recorded failure into the Status (first failure wins there too).
GPUNET_DEVICE void proxy_record_error(const ProxyChannel& ch, const Waiter& w, uint64_t err) {
  HostCtrl* h = detail::hctrl(ch);
  const uint32_t code = uint32_t(err >> 56) & 0xff;
  const uint32_t synd = uint32_t(err >> 48) & 0xff, vendor = uint32_t(err >> 40) & 0xff;
  const uint32_t counter = uint32_t(err >> 24) & 0xffff, qpn = uint32_t(err) & 0xffffff;
  Failure f(code == ERR_CQE ? STATUS_COMPLETION_ERROR : STATUS_BAD_ARGUMENT,
            code == ERR_CQE ? SITE_CQE : SITE_PROXY_CMD);
  f.seq = arch::load_relaxed(&h->err_seq);  // ordered by the acquire of `error`
  f.peer = uint32_t(arch::load_relaxed(&h->err_peer));
  f.channel = ch.id;
  if (code == ERR_CQE) {
    f.qpn = qpn;
    f.syndrome = synd;
    f.vendor_syndrome = vendor;
    f.wqe_counter = counter;
  } else {  // ERR_BAD_COMMAND: the syndrome field holds the op the proxy rejected
    f.expected = OP_MAX;
    f.observed = synd;
  }
  record_failure(w.st, f);
}

// Bounded wait until every command with a sequence below `issued` has completed. true: all
// completed and the channel has no failure; false: a failure is recorded in the Status.
// `peer`: the PE the caller waits for (PEER_NONE: the whole channel), named on a timeout.
GPUNET_DEVICE bool proxy_quiet(const ProxyChannel& ch, const Waiter& w, uint64_t issued,
                               uint32_t peer = PEER_NONE) {
  HostCtrl* h = detail::hctrl(ch);
  const uint64_t t0 = arch::now_ns();   // a clock register on the GPU: no memory access
  for (uint32_t n = 1;; ++n) {
    // The one PCIe read of a poll. An acquire: what the proxy wrote before `completed` (the
    // error words; a GET's or fetch-add's data landed by the NIC before its CQE) is visible to
    // the caller's later loads without a separate fence.
    const uint64_t done = arch::load_acquire_sys(&h->completed);
    if (done & COMPLETED_ERROR) {
      proxy_record_error(ch, w, arch::load_acquire_sys(&h->error));
      return false;
    }
    if (done >= issued) return true;
    if (n < kQuietEagerPolls) continue;   // back to back: see kQuietEagerPolls
    if (n % kQuietCheckEvery == 0) {
      if (failed(w)) return false;
      const uint64_t now = arch::now_ns();
      if (now - t0 > w.timeout_ns) {
        Failure f(STATUS_TIMEOUT, SITE_PROXY_QUIET);
        f.peer = peer;
        f.channel = ch.id;
        f.seq = issued;
        f.expected = issued;
        f.observed = done;
        f.waited_ns = now - t0;
        record_failure(w.st, f);
        return false;
      }
    }
    for (uint32_t i = 0; i < kQuietBackoff; ++i) arch::spin_pause();
  }
}

// Quiet everything reserved on the channel so far (by any thread).
GPUNET_DEVICE bool proxy_quiet_all(const ProxyChannel& ch, const Waiter& w,
                                   uint32_t peer = PEER_NONE) {
  return proxy_quiet(ch, w, arch::atomic_load(&detail::dctrl(ch)->head), peer);
}

// ---- operations (what gpunet.cuh's per-peer dispatch calls for a proxy peer) ----------------------
// Offsets are into the symmetric heap (the proxy adds the local / the peer's heap base and keys).

namespace detail {
// PUT or GET of any size: commands of at most MAX_CMD_SIZE bytes (one reservation each).
GPUNET_DEVICE bool push_split(const ProxyChannel& ch, const Waiter& w, uint32_t op, uint32_t peer,
                              uint64_t local_off, uint64_t remote_off, uint64_t nbytes,
                              uint64_t* issued) {
  if (!check_args(ch, w, peer, local_off + nbytes, remote_off + nbytes)) return false;
  do {
    const uint64_t n = nbytes < MAX_CMD_SIZE ? nbytes : MAX_CMD_SIZE;
    if (!proxy_push(ch, w, encode(op, peer, n, local_off, remote_off), issued)) return false;
    local_off += n;
    remote_off += n;
    nbytes -= n;
  } while (nbytes > 0);
  return true;
}
}  // namespace detail

GPUNET_DEVICE bool proxy_put(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                             uint64_t local_off, uint64_t remote_off, uint64_t nbytes,
                             uint64_t* issued = nullptr) {
  return detail::push_split(ch, w, OP_PUT, peer, local_off, remote_off, nbytes, issued);
}

GPUNET_DEVICE bool proxy_get(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                             uint64_t local_off, uint64_t remote_off, uint64_t nbytes,
                             uint64_t* issued = nullptr) {
  return detail::push_split(ch, w, OP_GET, peer, local_off, remote_off, nbytes, issued);
}

// Signal alone: SIGNAL_ADD (add = true) or SIGNAL_SET of `value` on peer[sig_off].
GPUNET_DEVICE bool proxy_signal(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                                uint64_t sig_off, uint64_t value, bool add,
                                uint64_t* issued = nullptr) {
  if (!detail::check_args(ch, w, peer, 0, sig_off)) return false;
  return proxy_push(ch, w, encode_signal(add ? OP_SIGNAL_ADD : OP_SIGNAL_SET, peer, value, sig_off),
                    issued);
}

// put_signal: PUT then SIGNAL in ONE reservation (adjacent slots: same channel, same QP, in order),
// so a receiver that sees the signal sees the payload. nbytes <= MAX_CMD_SIZE.
GPUNET_DEVICE bool proxy_put_signal(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                                    uint64_t local_off, uint64_t remote_off, uint64_t nbytes,
                                    uint64_t sig_off, uint64_t value, bool add,
                                    uint64_t* issued = nullptr) {
  if (!detail::check_args(ch, w, peer, local_off + nbytes,
                          remote_off + nbytes > sig_off ? remote_off + nbytes : sig_off, nbytes,
                          MAX_CMD_SIZE))
    return false;
  Command c[2] = {encode(OP_PUT, peer, nbytes, local_off, remote_off),
                  encode_signal(add ? OP_SIGNAL_ADD : OP_SIGNAL_SET, peer, value, sig_off)};
  return proxy_push_n(ch, w, c, 2, issued);
}

// Fetch-add of any 64-bit addend (two's complement: -1 decrements): the old value of
// peer[remote_off] lands at local[result_off] (8 bytes in the NIC's atomic order); waits for it
// (a quiet up to this command) and returns those 8 bytes through `old` as they are in memory
// (`raw_old`: the caller converts, api::signal_order). `local_heap` is the device's address of
// the local symmetric heap. ATOMIC_FA + OPERAND, one reservation (see the command format).
GPUNET_DEVICE bool proxy_atomic_fetch_add(const ProxyChannel& ch, const Waiter& w, uint32_t peer,
                                          uint64_t remote_off, uint64_t addend,
                                          uint64_t result_off, const uint8_t* local_heap,
                                          uint64_t* raw_old) {
  if (!detail::check_args(ch, w, peer, result_off, remote_off)) return false;
  const Command c[2] = {encode(OP_ATOMIC_FA, peer, 0, result_off, remote_off),
                        encode_operand(peer, addend)};
  uint64_t issued = 0;
  if (!proxy_push_n(ch, w, c, 2, &issued)) return false;
  if (!proxy_quiet(ch, w, issued, peer)) return false;
  const uint64_t raw =
      arch::load_acquire_sys(reinterpret_cast<const uint64_t*>(local_heap + result_off));
  if (raw_old) *raw_old = raw;
  return true;
}

}  // namespace proxy
}  // namespace gpunet
