// gpunet/qp.cuh — GPU-initiated operations on one mlx5 RC queue pair: reserve, write, publish,
// ring, poll, quiet. The device-visible descriptors (QpDesc, CqDesc, Status) are defined here
// once; device/abi.py mirrors them byte for byte and tests/test_device_qp.py checks the layout.
//
// ------------------------------------------------------------------------------------------------
// The posting protocol (every counter is a 64-bit, monotonically increasing WQEBB count; the ring
// slot of counter c is c & (sq_wqebbs - 1), the WQE index in the ctrl segment c & 0xffff):
//
//   post(n WQEBBs)
//     1. base = atomic_add(resv_head, n)                       reservation, in reservation order
//     2. wait until base + n - done_head <= sq_wqebbs          space; the waiter polls the CQ AND
//                                                              flushes the doorbell, so published
//                                                              but unrung work always gets rung
//                                                              (otherwise a full ring deadlocks)
//     3. write the WQE words with arch::store_relaxed          the NIC reads them
//     4. wait until ready_head == base                         publish in reservation order
//     5. slot_nbb[base & mask] = n; slot_db[(base+n) & mask] = doorbell word of this WQE
//     6. store_release_sys(ready_head, base + n)               publishes 3 and 5 (cumulative)
//     7. ring (flush_doorbell) if a db_batch boundary was crossed or nobody reserved after us
//        (atomic_load(resv_head) == base + n); a later reserver takes the duty over otherwise.
//
//   flush_doorbell: until db_head >= the ready_head seen at entry (bounded):
//     try-lock db_lock; fence; r = ready_head; if r > db_head:
//       fence_sys; DBR[1] = htobe32(r & 0xffff); fence_sys; doorbell_store64(db, slot_db[r&mask]);
//       db_head = r;  unlock (release).
//     slot_db[r & mask] cannot be overwritten while we read it: the WQE ending at r + sq_wqebbs
//     needs done_head >= r, and nothing at or above db_head completes before it is rung.
//
//   Every WQE is signalled (CQ_UPDATE) and completes in order, so one CQE tells how far the ring
//   is done (one poller at a time: try-lock poll_lock). Owner-bit CQ: that poller consumes every valid CQE
//   (rdma-core's ownership rule), credits done_head, then writes the CQ DBR. cqe_cnt >=
//   sq_wqebbs, so the CQ can never overrun.
//
//   Collapsed CQ (one slot, overwritten by every completion; read by the poll_lock holder):
//     d = (cqe.wqe_counter - done) & 0xffff      done = done_head read BEFORE the CQE
//     r = ready_head                               read AFTER the CQE (acquire)
//     credit iff d < r - done:  s = done + d;  done_head = max(done_head, s + slot_nbb[s & mask])
//   Why this is exact: the slot holds the NEWEST completion s_true. The NIC completes only rung
//   WQEs, a WQE is rung only after its publish (ready_head release; the ringer fences after
//   reading it, before the DBR), so r > s_true for every CQE we can read (causality through the
//   NIC). If s_true >= done then d = s_true - done < r - done: credited. If s_true < done, the CQE
//   was credited already (done only grows from CQEs, done <= s_true + nbb), d >= 2^16 - kMaxWqeBBs
//   > r - done (r - done <= sq_wqebbs <= 32768 for a fresh done): ignored. A done read very late
//   (stale by ~2^16) can only alias to a start s < s_true - 2^16 + sq_wqebbs, whose credit is below
//   the current done_head: harmless. A ring exactly full (r - done == sq_wqebbs) works: d <= r -
//   done - 1.
//   The previous rule bounded s by db_head (s < db_head) and by sq_wqebbs. It ignored a VALID
//   newest CQE whenever the poller read db_head before the ringer's db_head store was visible (the
//   NIC completes WQEs before the ringer stores db_head: the window of the owner-bit bug), leaving
//   every waiter's progress hostage to the visibility of one relaxed store of a thread that may be
//   descheduled (2-core CI, 256 emulated threads) or, in the weak model, hold it in its store
//   buffer while blocked at a warp collective; with every poster waiting for space no further CQE
//   arrives to replace it, so all of them spin on a CQE they refuse, and the time until that store
//   shows counted against their deadlines. The suspected cause of the hypothesis run's timeout
//   (SITE_SQ_SPACE on a 64-deep ring, db_batch 2, counters ~70,885, a loaded 2-core box); not
//   reproduced as a permanent hang, the refusal itself is (test_device_qp.py
//   test_collapsed_cq_credits_the_newest_cqe_exactly[rung_before_db_head]). ready_head is
//   visible to the poller whenever the CQE is, so no valid CQE is ever refused.
//
// Memory orders (arch.cuh's atomics are RELAXED, like CUDA's): locks are CAS then fence_sys;
// credits to done_head follow a fence_sys, so a thread that reads done_head with acquire also
// sees what the NIC wrote for those WQEs (READ data, atomic results) — the CQE was read with
// acquire, the NIC publishes op_own / the CQE's last 4 bytes with a release store.
//
// Failures: every wait is bounded by Status-aware deadlines (see Waiter). The first failure is
// recorded in the Status block (CAS code 0 -> code, fill, release-store valid); every other wait
// sees code != 0 and returns false at once, so the grid drains. Nothing traps or exits early.
//
// Test-only switches (tests/test_device_qp.py builds them to prove its fence test can fail):
//   GPUNET_TEST_DROP_DOORBELL_FENCE   no fence between the DBR store and the doorbell store
//   GPUNET_TEST_RELAXED_PUBLISH       ready_head published with a relaxed store, not a release
//   GPUNET_TEST_DELAY_POINTS          arch::spin_pause() at points where real hardware may stall
//                                     a thread (legal in the real build; the weak HOST model pops
//                                     one buffered store there, widening the windows)
//
// Warp-cooperative posting (post_warp): one reservation per warp (lane 0's atomic_add, shfl of
// the base), lane i writes WQE i, syncwarp, lane 0 publishes and rings. Correct for warps of 32
// and 64; every lane of the warp must call it (arch's *_sync rule).
//
// Per-thread posting from divergent lanes of one warp needs independent thread scheduling
// (CUDA sm_70+, the HOST arm): lane B may wait for lane A's publish. Where lanes of one warp do
// not make independent progress (assumed for MACA until verified) use the warp variants.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "mlx5.cuh"

namespace gpunet {

// ------------------------------------------------------------------------------------------------
// Descriptors (device memory). Plain structs, fixed-width fields, explicit padding: the Python
// mirror is device/abi.py (ctypes), checked by tests/test_device_qp.py::test_abi_layout_matches.
// ------------------------------------------------------------------------------------------------

// Status codes (Status::code). abi.py: STATUS_*.
enum : uint32_t {
  STATUS_OK = 0,
  STATUS_TIMEOUT = 1,           // a bounded wait ran out
  STATUS_COMPLETION_ERROR = 2,  // an error CQE (syndrome, vendor syndrome, qpn, wqe_counter)
  STATUS_BAD_ARGUMENT = 3,      // e.g. a post larger than the ring, pe out of range
  STATUS_QP_ERROR = 4,          // posting on a QP already in error (its cause is recorded first)
};

// What waited / failed (Status::site). abi.py: SITE_*.
enum : uint32_t {
  SITE_NONE = 0,
  SITE_SQ_SPACE = 1,     // post: waiting for ring space (done_head)
  SITE_READY = 2,        // post: waiting for earlier reservations to publish (ready_head)
  SITE_DOORBELL = 3,     // flush_doorbell: waiting for db_head to reach the ready head
  SITE_QUIET = 4,        // quiet: waiting for done_head to reach the ready head
  SITE_CQE = 5,          // CQ poll: an error CQE
  SITE_WAIT_UNTIL = 6,   // wait_until on a signal word
  SITE_ATOMIC = 7,       // atomic_fetch_add waiting for its result
  SITE_POST_ARG = 8,     // argument check of a post
};

// The first failure of a kernel (or of a DevCtx's lifetime until the host clears it). 128 B.
struct Status {
  uint64_t code;             // 0: no failure. First failure wins: CAS 0 -> code.
  uint64_t valid;            // release-stored 1 after every field below is written
  uint32_t site;             // SITE_*
  uint32_t qpn;
  uint32_t peer;
  uint32_t syndrome;         // error CQE: mlx5 syndrome (FACTS.md); 0 otherwise
  uint32_t vendor_syndrome;
  uint32_t wqe_counter;      // error CQE: its 16-bit wqe_counter
  uint32_t block;            // linear block index of the recording thread
  uint32_t thread;           // linear thread index in its block
  uint64_t wqe_index;        // 64-bit WQEBB counter concerned (base of the post, s of the CQE)
  uint64_t expected;         // the value waited for
  uint64_t observed;         // the value seen last
  uint64_t waited_ns;        // how long it waited
  uint64_t reserved[6];
};
static_assert(sizeof(Status) == 128, "Status layout is mirrored in device/abi.py");

// A CQ as the device polls it. 32 B.
struct CqDesc {
  uint64_t buf;        // CQE ring (cqe_cnt * 64 B), host-mapped
  uint64_t dbrec;      // CQ doorbell record (dbrec[0] = consumer index)
  uint32_t cqe_cnt;    // power of two; 1 when collapsed
  uint32_t collapsed;  // 1: one slot, overwritten, read by wqe_counter
  uint64_t ci;         // owner-bit mode: consumer index (written under QpDesc::poll_lock only)
};
static_assert(sizeof(CqDesc) == 32, "CqDesc layout is mirrored in device/abi.py");

// One QP: constants (first 128 B, written by the host) then state (next 64 B, device only).
struct QpDesc {
  uint64_t sq;          // send ring, sq_wqebbs * 64 B, host-mapped (the NIC reads it)
  uint64_t dbrec;       // doorbell record (8 B): dbrec[1] = htobe32(sq_pi & 0xffff)
  uint64_t db;          // doorbell register (UAR + 0x800; the soft NIC's db word)
  uint64_t slot_db;     // device memory, uint64[sq_wqebbs]: doorbell word of the WQE ENDING there
  uint64_t slot_nbb;    // device memory, uint32[sq_wqebbs]: WQEBBs of the WQE STARTING there
  uint32_t sq_wqebbs;   // power of two, 8 .. 32768 (16-bit WQE counters)
  uint32_t qpn;
  uint32_t peer;        // the PE this QP reaches (for Status)
  uint32_t db_batch;    // ring at least once every db_batch WQEBBs (1: every post)
  uint32_t max_inline;  // bytes of inline payload the QP accepts
  uint32_t pad0;
  CqDesc cq;            // at 64
  uint64_t pad1[4];     // to 128
  // ---- state (device memory; only device threads touch it), at 128 ----
  uint64_t resv_head;   // WQEBBs reserved
  uint64_t ready_head;  // WQEBBs written and published, in order
  uint64_t db_head;     // WQEBBs announced to the NIC (DBR written, doorbell rung)
  uint64_t done_head;   // WQEBBs completed (credited from CQEs)
  uint64_t db_lock;     // 0 free, 1 held: the DBR + doorbell sequence
  uint64_t poll_lock;   // 0 free, 1 held: the one CQ poller (either mode)
  uint64_t errored;     // 1 once an error CQE was seen: posts fail fast
  uint64_t pad2;
};
static_assert(sizeof(QpDesc) == 192, "QpDesc layout is mirrored in device/abi.py");
static_assert(__builtin_offsetof(QpDesc, resv_head) == 128, "QpDesc state at 128");

// ------------------------------------------------------------------------------------------------
// Bounded waits
// ------------------------------------------------------------------------------------------------

// The wait context threaded through every call: where failures go and how long a wait may last.
struct Waiter {
  Status* st;
  uint64_t timeout_ns;
};

// How often a spin loop reads the status word and the clock (a load of device memory and a
// clock read are cheap, but not free on the hot path of a short wait).
constexpr uint32_t kCheckEvery = 8;

#if defined(GPUNET_TEST_DELAY_POINTS)
#define GPUNET_DELAY_POINT() ::gpunet::arch::spin_pause()
#else
#define GPUNET_DELAY_POINT() ((void)0)
#endif

GPUNET_DEVICE bool failed(const Waiter& w) { return arch::atomic_load(&w.st->code) != 0; }

// Record the first failure; later ones are dropped (first failure wins).
GPUNET_DEVICE void record_failure(Status* st, uint32_t code, uint32_t site, uint32_t qpn,
                                  uint32_t peer, uint64_t wqe_index, uint64_t expected,
                                  uint64_t observed, uint64_t waited_ns, uint32_t syndrome = 0,
                                  uint32_t vendor_syndrome = 0, uint32_t wqe_counter = 0) {
  if (arch::atomic_cas(&st->code, uint64_t(0), uint64_t(code)) != 0) return;
  arch::store_relaxed(&st->site, site);
  arch::store_relaxed(&st->qpn, qpn);
  arch::store_relaxed(&st->peer, peer);
  arch::store_relaxed(&st->syndrome, syndrome);
  arch::store_relaxed(&st->vendor_syndrome, vendor_syndrome);
  arch::store_relaxed(&st->wqe_counter, wqe_counter);
  const arch::Dim3 b = arch::block_idx(), g = arch::grid_dim();
  arch::store_relaxed(&st->block, b.x + g.x * (b.y + g.y * b.z));
  arch::store_relaxed(&st->thread, arch::thread_rank());
  arch::store_relaxed(&st->wqe_index, wqe_index);
  arch::store_relaxed(&st->expected, expected);
  arch::store_relaxed(&st->observed, observed);
  arch::store_relaxed(&st->waited_ns, waited_ns);
  arch::store_release_sys(&st->valid, uint64_t(1));
}

// One spin of a bounded wait: false when the wait must give up (a failure is recorded, by us on
// timeout or by someone else before). `t0` is 0 until the first check.
// Waits on the QP's monotone counters (db_head, done_head, ready_head) are bounded by the time
// WITHOUT PROGRESS (`progress`: an observed value larger than the last one restarts the clock):
// a poster behind hundreds of others on a busy ring is not hung while the ring moves, and a
// dead ring (no completion for timeout_ns) still fails. The distance to the target is finite
// and every step restarts a finite clock, so the wait stays bounded. Status::waited_ns is the
// time since the last progress. wait_until (a user's word, any comparison) keeps a plain bound.
struct Spin {
  uint64_t t0 = 0;
  uint64_t last = 0;
  uint32_t n = 0;
  bool progress = true;
  GPUNET_DEVICE bool keep_going(const Waiter& w, uint32_t site, const QpDesc* qp,
                                uint64_t wqe_index, uint64_t expected, uint64_t observed) {
    if ((n++ % kCheckEvery) != 0) {
      arch::spin_pause();
      return true;
    }
    if (failed(w)) return false;
    const uint64_t now = arch::now_ns();
    if (t0 == 0 || (progress && observed > last)) {
      t0 = now;
      last = observed;
    }
    if (now - t0 > w.timeout_ns) {
      record_failure(w.st, STATUS_TIMEOUT, site, qp ? qp->qpn : 0, qp ? qp->peer : 0, wqe_index,
                     expected, observed, now - t0);
      return false;
    }
    arch::spin_pause();
    return true;
  }
};

// ------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------
namespace qpd {

GPUNET_DEVICE uint64_t* u64p(uint64_t addr) { return reinterpret_cast<uint64_t*>(uintptr_t(addr)); }
GPUNET_DEVICE uint32_t* u32p(uint64_t addr) { return reinterpret_cast<uint32_t*>(uintptr_t(addr)); }

GPUNET_DEVICE bool try_lock(uint64_t* lock) {
  if (arch::atomic_cas(lock, uint64_t(0), uint64_t(1)) != 0) return false;
  arch::fence_sys();  // acquire: what the previous holder wrote before its release is visible
  return true;
}
GPUNET_DEVICE void unlock(uint64_t* lock) { arch::store_release_sys(lock, uint64_t(0)); }

// done_head = max(done_head, v). A fence first, so that a reader acquiring done_head also sees
// what the CQE (read with acquire) announced.
GPUNET_DEVICE void credit_done(QpDesc* qp, uint64_t v) {
  arch::fence_sys();
  uint64_t cur = arch::atomic_load(&qp->done_head);
  while (cur < v) {
    const uint64_t old = arch::atomic_cas(&qp->done_head, cur, v);
    if (old == cur) break;
    cur = old;
  }
}

// The doorbell word of a WQE: the first 8 bytes of its ctrl segment, as the little-endian integer
// those bytes form (one 64-bit store reproduces them): be32(opmod_idx_opcode) | be32(qpn_ds).
GPUNET_DEVICE uint64_t ctrl_word0(uint64_t pi, uint32_t opcode, uint32_t qpn, uint32_t ds) {
  const uint32_t a = (uint32_t(pi & 0xffff) << 8) | (opcode & 0xff);
  const uint32_t b = ((qpn & 0xffffff) << 8) | (ds & 0xff);
  return uint64_t(arch::bswap32(a)) | (uint64_t(arch::bswap32(b)) << 32);
}
// ctrl bytes 8..15: signature 0, dci_stream_channel_id 0, fm_ce_se, imm (stored as given).
GPUNET_DEVICE uint64_t ctrl_word1(uint32_t fm_ce_se, uint32_t imm_raw) {
  return (uint64_t(fm_ce_se & 0xff) << 24) | (uint64_t(imm_raw) << 32);
}
// A 16-byte segment made of a big-endian 64-bit field then a big-endian 32-bit one (raddr seg),
// or be32, be32, be64 (data seg): returned as two little-endian words.
GPUNET_DEVICE void raddr_seg(uint64_t raddr, uint32_t rkey, uint64_t& w0, uint64_t& w1) {
  w0 = arch::bswap64(raddr);
  w1 = uint64_t(arch::bswap32(rkey));
}
GPUNET_DEVICE void data_seg(uint32_t byte_count, uint32_t lkey, uint64_t addr, uint64_t& w0,
                            uint64_t& w1) {
  w0 = uint64_t(arch::bswap32(byte_count)) | (uint64_t(arch::bswap32(lkey)) << 32);
  w1 = arch::bswap64(addr);
}

// Store 8-byte word `i` (0..8*nbb) of the WQE starting at counter `base`, wrapping per WQEBB.
GPUNET_DEVICE void wqe_store(const QpDesc* qp, uint64_t base, uint32_t i, uint64_t v) {
  const uint64_t mask = qp->sq_wqebbs - 1;
  const uint64_t bb = (base + i / 8) & mask;
  arch::store_relaxed(u64p(qp->sq + bb * mlx5::WQEBB + (i % 8) * 8), v);
}

}  // namespace qpd

// A WQE as the posting code builds it: up to kMaxWqeWords 8-byte words (the inline limit).
// ds, opcode and nbb describe it; words[] are stored with store_relaxed by whoever posts it.
constexpr uint32_t kMaxWqeBBs = 4;  // 256 B: ctrl + raddr + inline header + up to 220 B inline
struct Wqe {
  uint32_t opcode;
  uint32_t ds;
  uint32_t nbb;
  uint32_t fm_ce_se;
  uint64_t w[kMaxWqeBBs * 8];
};

// Build helpers: every device WQE is signalled (CQ_UPDATE): completions are counted per WQE.
GPUNET_DEVICE void wqe_rdma(Wqe& q, uint32_t opcode, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                            uint32_t lkey, uint32_t nbytes) {
  q.opcode = opcode;
  q.ds = mlx5::DS_RDMA;
  q.nbb = 1;
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  q.w[1] = qpd::ctrl_word1(q.fm_ce_se, 0);
  qpd::raddr_seg(raddr, rkey, q.w[2], q.w[3]);
  qpd::data_seg(nbytes, lkey, laddr, q.w[4], q.w[5]);
  q.w[6] = q.w[7] = 0;
}
GPUNET_DEVICE void wqe_atomic_fa(Wqe& q, uint64_t raddr, uint32_t rkey, uint64_t result_addr,
                                 uint32_t lkey, uint64_t add) {
  q.opcode = mlx5::OPCODE_ATOMIC_FA;
  q.ds = mlx5::DS_ATOMIC;
  q.nbb = 1;
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  q.w[1] = qpd::ctrl_word1(q.fm_ce_se, 0);
  qpd::raddr_seg(raddr, rkey, q.w[2], q.w[3]);
  q.w[4] = arch::bswap64(add);  // atomic seg: swap_add be64, compare be64
  q.w[5] = 0;
  qpd::data_seg(8, lkey, result_addr, q.w[6], q.w[7]);
}
GPUNET_DEVICE void wqe_nop(Wqe& q) {
  q.opcode = mlx5::OPCODE_NOP;
  q.ds = mlx5::DS_NOP;
  q.nbb = 1;
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  q.w[1] = qpd::ctrl_word1(q.fm_ce_se, 0);
  for (int i = 2; i < 8; ++i) q.w[i] = 0;
}
// RDMA WRITE with the payload carried inline (read by this thread now: the source may be reused
// as soon as the post returns). nbytes <= kMaxInline; the NIC also checks its max_inline.
constexpr uint32_t kMaxInline = kMaxWqeBBs * mlx5::WQEBB - 32 - 4;
GPUNET_DEVICE void wqe_write_inline(Wqe& q, uint64_t raddr, uint32_t rkey, const uint8_t* src,
                                    uint32_t nbytes) {
  q.opcode = mlx5::OPCODE_RDMA_WRITE;
  q.ds = 2 + (4 + nbytes + 15) / 16;
  q.nbb = (q.ds * 16 + 63) / 64;
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  q.w[1] = qpd::ctrl_word1(q.fm_ce_se, 0);
  qpd::raddr_seg(raddr, rkey, q.w[2], q.w[3]);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&q.w[4]);
  const uint32_t hdr = arch::bswap32(nbytes | mlx5::INLINE_SEG);
  for (int i = 0; i < 4; ++i) bytes[i] = uint8_t(hdr >> (8 * i));
  const uint32_t total = q.nbb * 64 - 32;
  for (uint32_t i = 0; i < total - 4; ++i) bytes[4 + i] = i < nbytes ? src[i] : 0;
}

// ------------------------------------------------------------------------------------------------
// Polling
// ------------------------------------------------------------------------------------------------

// Handle one CQE's last word (wqe_counter be16 @60, signature @62, op_own @63) and, for an error
// CQE, its syndromes. Returns the WQE start counter it names (or UINT64_MAX if stale / bogus).
GPUNET_DEVICE uint64_t cqe_start(const QpDesc* qp, uint64_t done, uint32_t last_word) {
  const uint32_t w = ((last_word & 0xff) << 8) | ((last_word >> 8) & 0xff);
  const uint64_t d = (uint64_t(w) - done) & 0xffff;  // s - done modulo 2^16
  if (d >= qp->sq_wqebbs) return UINT64_MAX;          // credited already (or never posted)
  return done + d;
}

GPUNET_DEVICE void cqe_error(QpDesc* qp, const Waiter& w, uint64_t cqe_addr, uint64_t s,
                             uint32_t last_word) {
  const uint32_t w52 = arch::load_relaxed(qpd::u32p(cqe_addr + 52));  // vendor @54, synd @55
  const uint32_t w56 = arch::bswap32(arch::load_relaxed(qpd::u32p(cqe_addr + 56)));
  const uint32_t counter = ((last_word & 0xff) << 8) | ((last_word >> 8) & 0xff);
  arch::atomic_store(&qp->errored, uint64_t(1));
  record_failure(w.st, STATUS_COMPLETION_ERROR, SITE_CQE, w56 & 0xffffff, qp->peer, s, 0, 0, 0,
                 (w52 >> 24) & 0xff, (w52 >> 16) & 0xff, counter);
}

// Poll the QP's CQ once: credit done_head with whatever completed. Never waits.
GPUNET_DEVICE void poll_cq(QpDesc* qp, const Waiter& w) {
  const CqDesc& cq = qp->cq;
  const uint64_t mask = qp->sq_wqebbs - 1;
  const uint32_t* slot_nbb = qpd::u32p(qp->slot_nbb);
  if (cq.collapsed) {
    // One poller at a time: every waiting warp reading the host-mapped CQE slot over PCIe made
    // 264 warps on one QP 20x slower (bench/RESULTS.md); the others re-read done_head instead.
    if (!qpd::try_lock(&qp->poll_lock)) return;
    // The rule and why it is exact: the header comment ("Collapsed CQ"). Order matters: done
    // before the CQE (a stale done can only under-credit), ready_head after it (never older than
    // the WQE the CQE names).
    const uint64_t done = arch::load_acquire_sys(&qp->done_head);
    const uint32_t last = arch::load_acquire_sys(qpd::u32p(cq.buf + 60));
    const uint32_t op = (last >> 24) >> 4;
    const uint64_t ready = arch::load_acquire_sys(&qp->ready_head);
    const uint32_t wc = ((last & 0xff) << 8) | ((last >> 8) & 0xff);
    const uint64_t d = (uint64_t(wc) - done) & 0xffff;  // s - done modulo 2^16
    // Skip an INVALID slot, and a CQE credited already (or with nothing posted).
    if (op != mlx5::CQE_INVALID && ready > done && d < ready - done) {
      const uint64_t s = done + d;
      if (op == mlx5::CQE_REQ_ERR || op == mlx5::CQE_RESP_ERR) cqe_error(qp, w, cq.buf, s, last);
      qpd::credit_done(qp, s + arch::load_relaxed(&slot_nbb[s & mask]));
    }
    qpd::unlock(&qp->poll_lock);
    return;
  }
  QpDesc* q = qp;
  if (!qpd::try_lock(&q->poll_lock)) return;
  uint64_t ci = arch::load_relaxed(&q->cq.ci);
  uint64_t done = arch::load_acquire_sys(&q->done_head);
  uint64_t new_done = done;
  bool consumed = false;
  for (uint32_t k = 0; k < cq.cqe_cnt; ++k) {
    const uint64_t addr = cq.buf + (ci & (cq.cqe_cnt - 1)) * mlx5::CQE_SIZE;
    const uint32_t last = arch::load_acquire_sys(qpd::u32p(addr + 60));
    const uint32_t op_own = last >> 24;
    const uint32_t op = op_own >> 4;
    if (op == mlx5::CQE_INVALID || (op_own & 1) != ((ci & cq.cqe_cnt) ? 1u : 0u)) break;
    // Every valid CQE is consumed exactly once, in order: no staleness check is needed (nor
    // allowed: the NIC may complete a WQE before its ringer has advanced db_head).
    const uint64_t s = cqe_start(qp, new_done, last);
    if (s != UINT64_MAX) {
      if (op == mlx5::CQE_REQ_ERR || op == mlx5::CQE_RESP_ERR) cqe_error(q, w, addr, s, last);
      new_done = s + arch::load_relaxed(&slot_nbb[s & mask]);
    }
    ++ci;
    consumed = true;
  }
  if (consumed) {
    arch::store_relaxed(&q->cq.ci, ci);
    // CQ DBR: consumed up to ci. Release: our reads of those CQEs come first.
    arch::store_release_sys(qpd::u32p(cq.dbrec), arch::bswap32(uint32_t(ci & 0xffffff)));
    if (new_done > done) qpd::credit_done(q, new_done);
  }
  qpd::unlock(&q->poll_lock);
}

// ------------------------------------------------------------------------------------------------
// Doorbell
// ------------------------------------------------------------------------------------------------

// Ring once for everything published so far, if someone has not already. Returns false only when
// a failure is recorded. Any thread may call it any time.
GPUNET_DEVICE bool flush_doorbell(QpDesc* qp, const Waiter& w) {
  const uint64_t target = arch::load_acquire_sys(&qp->ready_head);
  Spin spin;
  uint64_t seen = arch::load_acquire_sys(&qp->db_head);
  while (seen < target) {
    if (qpd::try_lock(&qp->db_lock)) {
      const uint64_t r = arch::load_acquire_sys(&qp->ready_head);
      const uint64_t dbh = arch::load_relaxed(&qp->db_head);
      if (r > dbh) {
        const uint64_t word = arch::load_relaxed(&qpd::u64p(qp->slot_db)[r & (qp->sq_wqebbs - 1)]);
        arch::fence_sys();  // the WQEs (published to us through ready_head) before the DBR
        arch::store_relaxed(qpd::u32p(qp->dbrec + 4 * mlx5::DBREC_SND),
                            arch::bswap32(uint32_t(r & 0xffff)));
#if !defined(GPUNET_TEST_DROP_DOORBELL_FENCE)
        arch::fence_sys();  // the DBR before the doorbell: the NIC reads the DBR when it sees it
#endif
        arch::doorbell_store64(reinterpret_cast<volatile uint64_t*>(uintptr_t(qp->db)), word);
        GPUNET_DELAY_POINT();
        arch::atomic_store(&qp->db_head, r);
      }
      qpd::unlock(&qp->db_lock);  // release: db_head, DBR and doorbell before the lock is free
      seen = arch::load_acquire_sys(&qp->db_head);
      if (seen >= target) break;
    }
    if (!spin.keep_going(w, SITE_DOORBELL, qp, target, target, seen)) return false;
    seen = arch::load_acquire_sys(&qp->db_head);
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// Posting
// ------------------------------------------------------------------------------------------------

// Step 1+2: reserve n WQEBBs and wait for their space. base is set even on failure (then the
// caller must not publish: a failure is recorded and every wait behind it gives up).
GPUNET_DEVICE bool reserve(QpDesc* qp, const Waiter& w, uint32_t n, uint64_t& base) {
  base = arch::atomic_add(&qp->resv_head, uint64_t(n));
  const uint64_t need = base + n - qp->sq_wqebbs;  // done_head must reach this (may wrap < 0)
  if (base + n <= qp->sq_wqebbs) return true;
  Spin spin;
  uint64_t done = arch::load_acquire_sys(&qp->done_head);
  while (done < need) {
    if (arch::atomic_load(&qp->errored)) return false;
    if (!flush_doorbell(qp, w)) return false;
    poll_cq(qp, w);
    done = arch::load_acquire_sys(&qp->done_head);
    if (done >= need) break;
    if (!spin.keep_going(w, SITE_SQ_SPACE, qp, base, need, done)) return false;
  }
  return true;
}

// Step 4-7 for the WQE(s) [base, base+n) whose words are already stored by this thread (or by
// lanes that then passed a syncwarp with it). `last_word0` is the doorbell word of the last WQE.
GPUNET_DEVICE bool publish(QpDesc* qp, const Waiter& w, uint64_t base, uint32_t n,
                           uint64_t last_word0) {
  Spin spin;
  uint64_t ready = arch::load_acquire_sys(&qp->ready_head);
  while (ready != base) {
    if (!spin.keep_going(w, SITE_READY, qp, base, base, ready)) return false;
    ready = arch::load_acquire_sys(&qp->ready_head);
  }
  const uint64_t mask = qp->sq_wqebbs - 1;
  arch::store_relaxed(&qpd::u64p(qp->slot_db)[(base + n) & mask], last_word0);
#if defined(GPUNET_TEST_RELAXED_PUBLISH)
  arch::atomic_store(&qp->ready_head, base + n);
#elif defined(GPUNET_PUBLISH_GPU_SCOPE)
  // Option (measured in bench/device_post.py, not the default): ready_head is read only by GPU
  // threads, and whoever rings fences at system scope after reading it, so by cumulativity a
  // device-scope release should suffice; unverified against a real NIC, hence off by default.
  arch::store_release_gpu(&qp->ready_head, base + n);
#else
  arch::store_release_sys(&qp->ready_head, base + n);
#endif
  GPUNET_DELAY_POINT();
  const uint64_t batch = qp->db_batch ? qp->db_batch : 1;
  const bool crossed = (base / batch) != ((base + n) / batch);
  if (crossed || arch::atomic_load(&qp->resv_head) == base + n) return flush_doorbell(qp, w);
  return true;
}

// Write a built WQE at counter `base` (this thread's stores) and record its size.
GPUNET_DEVICE uint64_t write_wqe(const QpDesc* qp, uint64_t base, Wqe& q) {
  q.w[0] = qpd::ctrl_word0(base, q.opcode, qp->qpn, q.ds);
  for (uint32_t i = 0; i < q.nbb * 8; ++i) qpd::wqe_store(qp, base, i, q.w[i]);
  arch::store_relaxed(&qpd::u32p(qp->slot_nbb)[base & (qp->sq_wqebbs - 1)], q.nbb);
  GPUNET_DELAY_POINT();
  return q.w[0];
}

// Post `count` (1 or 2) WQEs as one reservation, in order (put_signal: WRITE then ATOMIC).
// `end` (optional) receives the counter just past the last WQE (for wait_done).
GPUNET_DEVICE bool post(QpDesc* qp, const Waiter& w, Wqe* wqes, uint32_t count,
                        uint64_t* end = nullptr) {
  if (failed(w)) return false;
  if (arch::atomic_load(&qp->errored)) {
    record_failure(w.st, STATUS_QP_ERROR, SITE_POST_ARG, qp->qpn, qp->peer, 0, 0, 0, 0);
    return false;
  }
  uint32_t n = 0;
  for (uint32_t i = 0; i < count; ++i) n += wqes[i].nbb;
  if (n > qp->sq_wqebbs) {
    record_failure(w.st, STATUS_BAD_ARGUMENT, SITE_POST_ARG, qp->qpn, qp->peer, 0, qp->sq_wqebbs, n, 0);
    return false;
  }
  uint64_t base;
  if (!reserve(qp, w, n, base)) return false;
  uint64_t at = base, word = 0;
  for (uint32_t i = 0; i < count; ++i) {
    word = write_wqe(qp, at, wqes[i]);
    at += wqes[i].nbb;
  }
  if (end) *end = base + n;
  return publish(qp, w, base, n, word);
}

// Warp-cooperative post: every lane of the warp calls it (converged); lane i < nposts posts
// wqe (its own), lanes >= nposts pass a dummy. One reservation for the warp; returns the same
// answer on every lane.
GPUNET_DEVICE bool post_warp(QpDesc* qp, const Waiter& w, Wqe& q, uint32_t nposts) {
  const uint32_t lane = arch::lane_id();
  const bool mine = lane < nposts;
  // Offsets of each lane's WQE: prefix sum of nbb over lanes (all 1-WQEBB here when uniform;
  // computed generally by shuffles of the running sum).
  uint32_t my_nbb = mine ? q.nbb : 0;
  uint32_t off = 0, total = 0;
  const uint32_t ws = arch::warp_size();
  for (uint32_t l = 0; l < ws; ++l) {
    const uint32_t v = arch::shfl(my_nbb, l);
    if (l < lane) off += v;
    total += v;
  }
  bool ok = !failed(w) && !arch::atomic_load(&qp->errored) && total <= qp->sq_wqebbs;
  ok = arch::all(ok);
  uint64_t base = 0;
  bool lane0_ok = true;
  if (ok && lane == 0) lane0_ok = reserve(qp, w, total, base);
  base = arch::shfl(base, 0);
  ok = arch::shfl(uint32_t(ok && lane0_ok), 0) != 0;
  // The last posting lane's doorbell word goes to lane 0 BEFORE the WQE stores: after them the
  // only collective is the syncwarp whose ordering the publish relies on (and tests check).
  uint64_t word = mine ? qpd::ctrl_word0(base + off, q.opcode, qp->qpn, q.ds) : 0;
  const uint32_t last_lane = nposts ? (nposts < ws ? nposts : ws) - 1 : 0;
  word = arch::shfl(word, last_lane);
  if (ok && mine) write_wqe(qp, base + off, q);
  arch::syncwarp();  // lanes' WQE stores happen-before lane 0's release below (cumulative)
  uint32_t res = 1;
  if (lane == 0 && total > 0) res = ok && publish(qp, w, base, total, word);
  res = arch::shfl(res, 0);
  return ok && res != 0;
}

// Warp-cooperative posting of warp_size * k single-WQEBB WQEs with ONE reservation and ONE
// publish (one system-scope release per warp_size * k WQEs instead of per warp_size: on the H200
// the release, not the stores, bounds post_warp's rate, bench/RESULTS.md). Lane l builds WQE j
// (0 <= j < k) with make(j, wqe) and writes it at base + j * warp_size + l, so every store
// instruction of the warp covers warp_size consecutive WQEBBs. All lanes call it converged with
// the same k (1 <= k, warp_size * k <= sq_wqebbs); a WQE of more than one WQEBB is a bad argument.
template <class Make>
GPUNET_DEVICE bool post_warp_k(QpDesc* qp, const Waiter& w, uint32_t k, Make make) {
  const uint32_t lane = arch::lane_id(), ws = arch::warp_size();
  const uint64_t total = uint64_t(ws) * k;
  // The last WQE's doorbell word travels to lane 0 before any WQE store (see post_warp).
  Wqe last;
  make(k - 1, last);
  bool ok = !failed(w) && !arch::atomic_load(&qp->errored) && k >= 1 && total <= qp->sq_wqebbs &&
            last.nbb == 1;
  ok = arch::all(ok);
  if (!ok) {
    if (lane == 0 && !failed(w) && !arch::atomic_load(&qp->errored))
      record_failure(w.st, STATUS_BAD_ARGUMENT, SITE_POST_ARG, qp->qpn, qp->peer, 0, qp->sq_wqebbs,
                     total, 0);
    return false;
  }
  uint64_t base = 0;
  bool lane0_ok = true;
  if (lane == 0) lane0_ok = reserve(qp, w, uint32_t(total), base);
  base = arch::shfl(base, 0);
  ok = arch::shfl(uint32_t(lane0_ok), 0) != 0;
  uint64_t word = qpd::ctrl_word0(base + total - ws + lane, last.opcode, qp->qpn, last.ds);
  word = arch::shfl(word, ws - 1);
  for (uint32_t j = 0; ok && j < k; ++j) {
    if (j + 1 == k) {
      write_wqe(qp, base + uint64_t(j) * ws + lane, last);
    } else {
      Wqe q;
      make(j, q);
      write_wqe(qp, base + uint64_t(j) * ws + lane, q);
    }
  }
  arch::syncwarp();  // every lane's WQE stores happen-before lane 0's release (cumulative)
  uint32_t res = 1;
  if (lane == 0) res = ok && publish(qp, w, base, uint32_t(total), word);
  res = arch::shfl(res, 0);
  return ok && res != 0;
}

// ------------------------------------------------------------------------------------------------
// Completion
// ------------------------------------------------------------------------------------------------

// Wait until the WQEBB counter `end` is completed (a specific post: atomic results, reads).
GPUNET_DEVICE bool wait_done(QpDesc* qp, const Waiter& w, uint64_t end, uint32_t site) {
  if (!flush_doorbell(qp, w)) return false;
  Spin spin;
  uint64_t done = arch::load_acquire_sys(&qp->done_head);
  while (done < end) {
    poll_cq(qp, w);
    done = arch::load_acquire_sys(&qp->done_head);
    if (done >= end) break;
    if (arch::atomic_load(&qp->errored)) return false;
    if (!spin.keep_going(w, site, qp, end, end, done)) return false;
    // Someone may have published after us and not rung yet (their duty, but cheap to help).
    if (!flush_doorbell(qp, w)) return false;
  }
  return !arch::atomic_load(&qp->errored);
}

// Wait until every WQE published on this QP before the call has completed (flushing the doorbell
// first). true: they all completed successfully; false: a failure is recorded in the Status.
GPUNET_DEVICE bool quiet(QpDesc* qp, const Waiter& w) {
  return wait_done(qp, w, arch::load_acquire_sys(&qp->ready_head), SITE_QUIET) && !failed(w);
}

}  // namespace gpunet
