// gpunet/status.cuh — the failure vocabulary every transport shares: the Status block, the status
// codes, the ONE registry of wait / failure sites, record_failure, Waiter and the bounded wait
// (Spin). gpunet/device/abi.py mirrors every value and the layout once (tests/test_device_qp.py
// test_abi_layout_matches_cpp, tests/test_status.py test_site_registry_is_mirrored_once); its
// failure_error() is the one host-side decoder of a Status into a gpunet exception.
//
// Rules:
//   - Every device wait is bounded by Waiter::timeout_ns; a wait that gives up records why and
//     returns false. Nothing traps or exits early, so the grid drains and the host raises.
//   - The first failure wins: record_failure CASes code 0 -> code, fills the fields, then
//     release-stores valid = 1. Every later wait sees code != 0 (failed()) and gives up at once.
//   - A field that does not apply holds its NONE value (PEER_NONE, CHANNEL_NONE, NO_HEAP_OFF), so
//     the decoder names only what the failure concerns (a wait_until names no QP and no peer).
// Every transport header includes this file; none includes another transport for it
// (tests/test_include_rule.py).
#pragma once

#include <stdint.h>

#include "arch.cuh"

namespace gpunet {

// Status codes (Status::code). abi.py: STATUS_*.
enum : uint32_t {
  STATUS_OK = 0,
  STATUS_TIMEOUT = 1,           // a bounded wait ran out
  STATUS_COMPLETION_ERROR = 2,  // an error CQE (syndrome, vendor syndrome, qpn, wqe_counter)
  STATUS_BAD_ARGUMENT = 3,      // e.g. a post larger than the ring, pe out of range
  STATUS_QP_ERROR = 4,          // posting on a QP already in error (its cause is recorded first)
};

// What waited / failed (Status::site): the one registry of every transport's sites. abi.py: SITE_*.
// Numbers are stable (they appear in logs; 2 and 3 are retired, never reused); 16..31 are the
// proxy transport's, 32.. the next transport's.
enum : uint32_t {
  SITE_NONE = 0,
  // ibgda (qp.cuh)
  SITE_SQ_SPACE = 1,     // post: waiting for ring space (done_head)
  SITE_DOORBELL_TURN = 11,  // post on a POST_SERIAL QP: waiting for the posts reserved before it
  SITE_QUIET = 4,        // quiet: waiting for done_head to reach the ready head
  SITE_CQE = 5,          // an error CQE (a QP's CQ, or the proxy's QP behind a channel)
  SITE_WAIT_UNTIL = 6,   // wait_until on a signal word (no transport: a local word)
  SITE_ATOMIC = 7,       // atomic_fetch_add waiting for its result
  SITE_POST_ARG = 8,     // argument check of a post
  // every verb (devctx.cuh api::peer)
  SITE_PEER_RANGE = 9,   // the pe a verb was given is out of range [0, npes)
  SITE_PEER_KIND = 10,   // the pe has no transport (PeerDesc::kind is TRANSPORT_NONE or unknown)
  // proxy (proxy.cuh)
  SITE_PROXY_FIFO = 16,   // push: waiting for FIFO space (the proxy's tail)
  SITE_PROXY_QUIET = 17,  // quiet: waiting for the proxy's completed counter
  SITE_PROXY_ARG = 18,    // argument check of a push (peer, offset, size out of range)
  SITE_PROXY_CMD = 19,    // the proxy rejected a command (HostCtrl.error code ERR_BAD_COMMAND)
  // p2p (transport/p2p.cuh)
  SITE_P2P_RANGE = 32,       // an access outside the peer's mapped heap (observed = heap offset)
  SITE_P2P_STORE_ONLY = 33,  // a get / atomic / ADD to a store-only peer (observed: 1, 2, 3)
};

// "Does not apply" values of Status fields.
constexpr uint32_t PEER_NONE = 0xffffffffu;            // the failure concerns no peer
constexpr uint32_t CHANNEL_NONE = 0xffffffffu;         // no proxy channel
constexpr uint64_t NO_HEAP_OFF = ~uint64_t(0);         // addr is not in the local symmetric heap

// The first failure of a kernel (or of a DevCtx's lifetime until the host clears it). 128 B.
struct Status {
  uint64_t code;             // 0: no failure. First failure wins: CAS 0 -> code.
  uint64_t valid;            // release-stored 1 after every field below is written
  uint32_t site;             // SITE_*
  uint32_t qpn;              // the QP concerned (0: none)
  uint32_t peer;             // the PE concerned, PEER_NONE if none
  uint32_t syndrome;         // error CQE: mlx5 syndrome (FACTS.md); 0 otherwise
  uint32_t vendor_syndrome;
  uint32_t wqe_counter;      // error CQE: its 16-bit wqe_counter
  uint32_t block;            // linear block index of the recording thread
  uint32_t thread;           // linear thread index in its block
  uint64_t wqe_index;        // 64-bit WQEBB counter concerned (base of the post, s of the CQE)
  uint64_t expected;         // the value waited for (a bad argument: the limit)
  uint64_t observed;         // the value seen last (a bad argument: the value given)
  uint64_t waited_ns;        // how long it waited
  uint64_t addr;             // the word concerned (wait_until: the signal word), 0 if none
  uint64_t heap_off;         // addr's offset in the local symmetric heap, NO_HEAP_OFF if outside
  uint32_t cmp;              // wait_until: the comparison (gpunet.cuh CMP_*)
  uint32_t channel;          // proxy sites: the channel index, CHANNEL_NONE otherwise
  uint64_t seq;              // proxy sites: the command's sequence number in its channel
  uint64_t reserved[2];
};
static_assert(sizeof(Status) == 128, "Status layout is mirrored in gpunet/device/abi.py");

// What record_failure writes: code and site, every other field at its "does not apply" value
// until the recorder sets it.
struct Failure {
  uint32_t code, site;
  uint32_t qpn = 0, peer = PEER_NONE, syndrome = 0, vendor_syndrome = 0, wqe_counter = 0;
  uint32_t cmp = 0, channel = CHANNEL_NONE;
  uint64_t wqe_index = 0, expected = 0, observed = 0, waited_ns = 0, addr = 0;
  uint64_t heap_off = NO_HEAP_OFF, seq = 0;
  GPUNET_DEVICE Failure(uint32_t code_, uint32_t site_) : code(code_), site(site_) {}
};

// The wait context threaded through every call: where failures go and how long a wait may last.
struct Waiter {
  Status* st;
  uint64_t timeout_ns;
};

// How often a spin loop reads the status word and the clock (a load of device memory and a
// clock read are cheap, but not free on the hot path of a short wait).
constexpr uint32_t kCheckEvery = 8;

// GPUNET_TEST_DELAY_POINTS (tests/test_device_qp.py): arch::spin_pause() where real hardware may
// stall a thread (legal in the real build; the weak HOST model pops one buffered store there).
#if defined(GPUNET_TEST_DELAY_POINTS)
#define GPUNET_DELAY_POINT() ::gpunet::arch::spin_pause()
#else
#define GPUNET_DELAY_POINT() ((void)0)
#endif

GPUNET_DEVICE bool failed(const Waiter& w) { return arch::atomic_load(&w.st->code) != 0; }

// Record the first failure; later ones are dropped (first failure wins).
GPUNET_DEVICE void record_failure(Status* st, const Failure& f) {
  if (arch::atomic_cas(&st->code, uint64_t(0), uint64_t(f.code)) != 0) return;
  arch::store_relaxed(&st->site, f.site);
  arch::store_relaxed(&st->qpn, f.qpn);
  arch::store_relaxed(&st->peer, f.peer);
  arch::store_relaxed(&st->syndrome, f.syndrome);
  arch::store_relaxed(&st->vendor_syndrome, f.vendor_syndrome);
  arch::store_relaxed(&st->wqe_counter, f.wqe_counter);
  const arch::Dim3 b = arch::block_idx(), g = arch::grid_dim();
  arch::store_relaxed(&st->block, b.x + g.x * (b.y + g.y * b.z));
  arch::store_relaxed(&st->thread, arch::thread_rank());
  arch::store_relaxed(&st->wqe_index, f.wqe_index);
  arch::store_relaxed(&st->expected, f.expected);
  arch::store_relaxed(&st->observed, f.observed);
  arch::store_relaxed(&st->waited_ns, f.waited_ns);
  arch::store_relaxed(&st->addr, f.addr);
  arch::store_relaxed(&st->heap_off, f.heap_off);
  arch::store_relaxed(&st->cmp, f.cmp);
  arch::store_relaxed(&st->channel, f.channel);
  arch::store_relaxed(&st->seq, f.seq);
  arch::store_release_sys(&st->valid, uint64_t(1));
}

// A bad argument: `limit` and `got` land in expected / observed.
GPUNET_DEVICE void record_bad_argument(const Waiter& w, uint32_t site, uint32_t qpn, uint32_t peer,
                                       uint64_t limit, uint64_t got) {
  Failure f(STATUS_BAD_ARGUMENT, site);
  f.qpn = qpn;
  f.peer = peer;
  f.expected = limit;
  f.observed = got;
  record_failure(w.st, f);
}

// One spin of a bounded wait: false when the wait must give up (a failure is recorded, by us on
// timeout or by someone else before). `describe(Failure&)` fills in what waited (site, QP, peer,
// addresses, expected); it runs only when the wait times out, so the fast path pays nothing for it.
// Waits on monotone counters (a QP's db_head, done_head, ready_head) are bounded by the time
// WITHOUT PROGRESS (`progress`: an observed value larger than the last one restarts the clock): a
// poster behind hundreds of others on a busy ring is not hung while the ring moves, and a dead
// ring (no completion for timeout_ns) still fails. The distance to the target is finite and every
// step restarts a finite clock, so the wait stays bounded. Status::waited_ns is the time since the
// last progress. wait_until (a user's word, any comparison) sets progress = false: a plain bound.
// `fast`: spins before the first pause (0: pause from the first). A wait whose word is in device
// memory and whose latency is the point (wait_until: a p2p signal's round trip) polls at the
// load's own pace first: each poll is one memory round trip, and a pause there adds its sleep
// to the moment the word changes.
struct Spin {
  uint64_t t0 = 0;
  uint64_t last = 0;
  uint32_t n = 0;
  uint32_t fast = 0;
  bool progress = true;
  template <class Describe>
  GPUNET_DEVICE bool keep_going(const Waiter& w, uint64_t observed, Describe describe) {
    if ((n++ % kCheckEvery) != 0) {
      if (n > fast) arch::spin_pause();
      return true;
    }
    if (failed(w)) return false;
    const uint64_t now = arch::now_ns();
    if (t0 == 0 || (progress && observed > last)) {
      t0 = now;
      last = observed;
    }
    if (now - t0 > w.timeout_ns) {
      Failure f(STATUS_TIMEOUT, SITE_NONE);
      describe(f);
      f.observed = observed;
      f.waited_ns = now - t0;
      record_failure(w.st, f);
      return false;
    }
    if (n > fast) arch::spin_pause();
    return true;
  }
};

}  // namespace gpunet
