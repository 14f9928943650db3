// gpunet/qp.cuh — GPU-initiated operations on one mlx5 RC queue pair: reserve, write, publish,
// ring, poll, quiet: the mechanism under transport/ibgda.cuh. The device-visible descriptors
// (QpDesc, CqDesc) are defined here once; device/abi.py mirrors them byte for byte and
// tests/test_device_qp.py checks the layout. WQEs are mlx5.cuh's segment values (the builders
// tests/test_mlx5_mirror.py checks byte for byte against gpunet/mlx5.py), written as whole 16-byte
// stores (arch::store_relaxed_v2); failures use status.cuh's vocabulary.
//
// ------------------------------------------------------------------------------------------------
// The posting protocol (every counter is a 64-bit, monotonically increasing WQEBB count; the ring
// slot of counter c is c & (sq_wqebbs - 1), the WQE index in the ctrl segment c & 0xffff):
//
//   post(n WQEBBs)
//     1. base = atomic_add(resv_head, n)                       reservation, in reservation order
//     2. wait until base + n - done_head <= sq_wqebbs          space; the waiter polls the CQ
//     3. write the WQE words with arch::store_relaxed          the NIC reads them
//        slot_nbb[base & mask] = n (per WQE); slot_db[(base+n) & mask] = doorbell word of the last
//     4. publish: hand [base, base+n) to the doorbell lock's holder, or become it (below). A post
//        never waits for earlier posts: it returns once its WQEs are rung or handed over.
//
//   The doorbell lock (db_lock: 0 free, 1 held, 3 held and asked to scan again). Only its holder
//   moves ready_head / db_head and writes the DBR and the doorbell, so the DBR never goes back.
//     publisher (its WQEs written):
//       if CAS(db_lock, 0 -> 1) and ready_head == base: hold, with [base, base+n) ready (no tag)
//       else: tag: slot_ready[base & mask] = base + n (release, device scope); fence_gpu (SC);
//             loop: CAS(0 -> 1): hold | saw 3: return | CAS(1 -> 3) saw 1 or 3: return | retry
//     holder:
//       r = ready_head; while slot_ready[r & mask] > r: r = slot_ready[r & mask]   (scan)
//       if r moved: ready_head = db_head = r; fence_sys; DBR[1] = htobe32(r & 0xffff);
//                   fence_sys; doorbell_store64(db, slot_db[r & mask])              (ONE ring)
//       else fence_gpu (what we stored before the lock is free);
//       release: CAS(1 -> 0); if it saw 3: CAS(3 -> 1), fence_gpu, scan again.
//   So one doorbell covers every reservation that became ready while the previous ring was in
//   flight, whichever warp wrote it: the in-order publish per warp is gone (bench/RESULTS.md).
//   Why no ready WQE is left unrung: a tagged publisher either holds the lock (and scans after its
//   tag), or its CAS saw the lock held and left 3 in it, which the holder sees at its release and
//   answers with a scan ordered after the tag (the tag store, the SC fence and the CAS are in that
//   order; the holder's CAS(3 -> 1) and fence_gpu come before its scan). A scan stops at the first
//   reservation not yet tagged; that reservation's own publish scans again. The shortcut (hold
//   with ready_head == base: no tag at all) needs no tag because the holder moves ready_head past
//   the reservation itself.
//   Why a tag is exact: slot_ready[p] holds the end of the last reservation that STARTED at p. For
//   a ready_head r, a value written in an earlier lap is <= r (it started at <= r - sq_wqebbs and
//   spans <= sq_wqebbs); a reservation of the current lap starting at r writes r + n > r; no
//   later lap can start at r + sq_wqebbs before r completes, i.e. before r is rung. So "ready at r"
//   is exactly slot_ready[r & mask] > r. The tag is a release: a holder that reads it and fences
//   (fence_sys before the DBR) has the WQEs, slot_nbb and slot_db it covers. The holder's fence_sys
//   is cumulative over them (the tag is read at device scope, the DBR written at system scope).
//   The doorbell word is a wake-up: the NIC reads the producer index from the DBR, which only
//   holders write, after a fence_sys, in increasing order; two holders' doorbell stores may land
//   in either order (the soft NIC re-reads the DBR on any doorbell change).
//   db_batch is not used by this protocol: every ring covers what was ready (the field stays in
//   the descriptor for the descriptor mirror).
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
//   WQEs, and the holder stores ready_head = r before its fence_sys and DBR, so r > s_true for
//   every CQE we can read (causality through the NIC). If s_true >= done then d = s_true - done <
//   r - done: credited. If s_true < done, the CQE
//   was credited already (done only grows from CQEs, done <= s_true + nbb), d >= 2^16 - kMaxWqeBBs
//   > r - done (r - done <= sq_wqebbs <= 32768 for a fresh done): ignored. A done read very late
//   (stale by ~2^16) can only alias to a start s < s_true - 2^16 + sq_wqebbs, whose credit is below
//   the current done_head: harmless. A ring exactly full (r - done == sq_wqebbs) works: d <= r -
//   done - 1.
//   Why ready_head bounds s (and is stored before the ring): a bound stored after the doorbell
//   refuses a valid newest CQE until that store shows, and with every poster waiting for space no
//   newer CQE comes to replace it (test_device_qp.py
//   test_collapsed_cq_credits_the_newest_cqe_exactly[rung_before_db_head]).
//
// Memory orders (arch.cuh's atomics are RELAXED, like CUDA's): the poll lock is CAS then
// fence_sys, the doorbell lock CAS then fence_gpu (its holder fences at system scope before the
// DBR anyway); credits to done_head follow a fence_sys, so a thread that reads done_head with acquire also
// sees what the NIC wrote for those WQEs (READ data, atomic results) — the CQE was read with
// acquire, the NIC publishes op_own / the CQE's last 4 bytes with a release store.
//
// Failures: every wait is a status.cuh Spin (bounded, first failure wins, the grid drains).
//
// Test-only switches (tests/test_device_qp.py builds them to prove its fence test can fail):
//   GPUNET_TEST_DROP_DOORBELL_FENCE   no fence between the DBR store and the doorbell store
//   GPUNET_TEST_RELAXED_PUBLISH       a publisher's tag (slot_ready) stored relaxed, not a release
//   GPUNET_TEST_DROP_PUBLISH_FENCE    no SC fence between a publisher's tag and its lock attempt
//   GPUNET_TEST_DELAY_POINTS          status.cuh's GPUNET_DELAY_POINT(): a stall where real
//                                     hardware may stall a thread (widens the weak model's windows)
//
// Warp-cooperative posting (post_warp): one reservation per warp (lane 0's atomic_add, shfl of
// the base), lane i writes WQE i, syncwarp, lane 0 publishes (and rings if it gets the lock). Correct for warps of 32
// and 64; every lane of the warp must call it (arch's *_sync rule).
//
// Per-thread posting from divergent lanes of one warp needs independent thread scheduling
// (CUDA sm_70+, the HOST arm): lane B may wait for ring space that lane A's posts hold. Where lanes of one warp do
// not make independent progress (assumed for MACA until verified) use the warp variants.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "mlx5.cuh"
#include "status.cuh"

namespace gpunet {

// ------------------------------------------------------------------------------------------------
// Descriptors (device memory). Plain structs, fixed-width fields, explicit padding: the Python
// mirror is device/abi.py (ctypes), checked by tests/test_device_qp.py::test_abi_layout_matches_cpp.
// ------------------------------------------------------------------------------------------------

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
  uint32_t db_batch;    // not used by the posting protocol (every ring covers what is ready)
  uint32_t max_inline;  // bytes of inline payload the QP accepts
  uint32_t pad0;
  CqDesc cq;            // at 64
  uint64_t slot_ready;  // device memory, uint64[sq_wqebbs]: end of the reservation STARTING there
  uint64_t pad1[3];     // to 128
  // ---- state (device memory; only device threads touch it), at 128 ----
  uint64_t resv_head;   // WQEBBs reserved
  uint64_t ready_head;  // WQEBBs written and handed to the NIC, in order (doorbell lock holder)
  uint64_t db_head;     // == ready_head once the holder's ring is out (kept for the mirror)
  uint64_t done_head;   // WQEBBs completed (credited from CQEs)
  uint64_t db_lock;     // 0 free, 1 held, 3 held + scan again: ready_head, the DBR, the doorbell
  uint64_t poll_lock;   // 0 free, 1 held: the one CQ poller (either mode)
  uint64_t errored;     // 1 once an error CQE was seen: posts fail fast
  uint64_t pad2;
};
static_assert(sizeof(QpDesc) == 192, "QpDesc layout is mirrored in device/abi.py");
static_assert(__builtin_offsetof(QpDesc, resv_head) == 128, "QpDesc state at 128");

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

// What a wait on this QP names when it times out (status.cuh Spin): the site, the QP, its peer.
GPUNET_DEVICE auto on_qp(const QpDesc* qp, uint32_t site, uint64_t wqe_index, uint64_t expected) {
  return [=](Failure& f) {
    f.site = site;
    f.qpn = qp->qpn;
    f.peer = qp->peer;
    f.wqe_index = wqe_index;
    f.expected = expected;
  };
}

}  // namespace qpd

// A WQE as the posting code builds it: mlx5.cuh segment values, up to kMaxWqeBBs WQEBBs. seg[0]
// (the ctrl segment) is stamped with the producer index and the QPN by write_wqe, which stores
// every segment with one 16-byte store.
constexpr uint32_t kMaxWqeBBs = 4;  // 256 B: ctrl + raddr + inline header + up to 220 B inline
struct Wqe {
  uint32_t opcode;
  uint32_t ds;
  uint32_t nbb;
  uint32_t fm_ce_se;
  mlx5::Seg16 seg[kMaxWqeBBs * 4];
};

// Build helpers: every device WQE is signalled (CQ_UPDATE): completions are counted per WQE.
GPUNET_DEVICE void wqe_take(Wqe& q, const mlx5::Wqebb& b, uint32_t opcode, uint32_t ds) {
  q.opcode = opcode;
  q.ds = ds;
  q.nbb = 1;
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  for (int i = 0; i < 4; ++i) q.seg[i] = b.seg[i];
}
GPUNET_DEVICE void wqe_rdma(Wqe& q, uint32_t opcode, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                            uint32_t lkey, uint32_t nbytes) {
  wqe_take(q, mlx5::rdma_wqe(0, 0, opcode, mlx5::WQE_CTRL_CQ_UPDATE, raddr, rkey, laddr, lkey,
                             nbytes, 0),
           opcode, mlx5::DS_RDMA);
}
GPUNET_DEVICE void wqe_atomic_fa(Wqe& q, uint64_t raddr, uint32_t rkey, uint64_t result_addr,
                                 uint32_t lkey, uint64_t add) {
  wqe_take(q, mlx5::atomic_wqe(0, 0, mlx5::OPCODE_ATOMIC_FA, mlx5::WQE_CTRL_CQ_UPDATE, raddr, rkey,
                               result_addr, lkey, add, 0),
           mlx5::OPCODE_ATOMIC_FA, mlx5::DS_ATOMIC);
}
GPUNET_DEVICE void wqe_nop(Wqe& q) {
  wqe_take(q, mlx5::nop_wqe(0, 0, mlx5::WQE_CTRL_CQ_UPDATE), mlx5::OPCODE_NOP, mlx5::DS_NOP);
}
// RDMA WRITE with the payload carried inline (read by this thread now: the source may be reused
// as soon as the post returns). nbytes <= kMaxInline; the NIC also checks its max_inline.
constexpr uint32_t kMaxInline =
    kMaxWqeBBs * mlx5::WQEBB - mlx5::CTRL_SEG_SIZE - mlx5::RADDR_SEG_SIZE - mlx5::INLINE_HDR_SIZE;
GPUNET_DEVICE void wqe_write_inline(Wqe& q, uint64_t raddr, uint32_t rkey, const uint8_t* src,
                                    uint32_t nbytes) {
  q.opcode = mlx5::OPCODE_RDMA_WRITE;
  q.ds = mlx5::inline_ds(nbytes);
  q.fm_ce_se = mlx5::WQE_CTRL_CQ_UPDATE;
  q.nbb = mlx5::write_inline_wqe(q.seg, 0, 0, q.opcode, q.fm_ce_se, raddr, rkey, src, nbytes, 0);
}

// ------------------------------------------------------------------------------------------------
// Polling
// ------------------------------------------------------------------------------------------------

// The WQE start counter an owner-bit CQE names (its 16-bit wqe_counter, in the window above
// `done`), or UINT64_MAX if stale / bogus.
GPUNET_DEVICE uint64_t cqe_start(const QpDesc* qp, uint64_t done, uint32_t tail) {
  const uint64_t d = (uint64_t(mlx5::cqe_tail_wqe_counter(tail)) - done) & 0xffff;  // s - done
  if (d >= qp->sq_wqebbs) return UINT64_MAX;          // credited already (or never posted)
  return done + d;
}

// An error CQE at `cqe_addr` naming WQE start `s`: the QP is in error; record its syndromes.
GPUNET_DEVICE void cqe_error(QpDesc* qp, const Waiter& w, uint64_t cqe_addr, uint64_t s,
                             uint32_t tail) {
  const uint8_t* cqe = reinterpret_cast<const uint8_t*>(uintptr_t(cqe_addr));
  arch::atomic_store(&qp->errored, uint64_t(1));
  Failure f(STATUS_COMPLETION_ERROR, SITE_CQE);
  f.qpn = arch::bswap32(arch::load_relaxed(qpd::u32p(cqe_addr + mlx5::CQE_SOP_DROP_QPN))) & 0xffffff;
  f.peer = qp->peer;
  f.wqe_index = s;
  f.syndrome = arch::load_relaxed(cqe + mlx5::CQE_SYNDROME);
  f.vendor_syndrome = arch::load_relaxed(cqe + mlx5::CQE_VENDOR_ERR_SYND);
  f.wqe_counter = mlx5::cqe_tail_wqe_counter(tail);
  record_failure(w.st, f);
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
    const uint32_t tail = arch::load_acquire_sys(qpd::u32p(cq.buf + mlx5::CQE_WQE_COUNTER));
    const uint32_t op = mlx5::cqe_tail_op_own(tail) >> 4;
    const uint64_t ready = arch::load_acquire_sys(&qp->ready_head);
    const uint64_t d = (uint64_t(mlx5::cqe_tail_wqe_counter(tail)) - done) & 0xffff;  // s - done
    // Skip an INVALID slot, and a CQE credited already (or with nothing posted).
    if (op != mlx5::CQE_INVALID && ready > done && d < ready - done) {
      const uint64_t s = done + d;
      if (op == mlx5::CQE_REQ_ERR || op == mlx5::CQE_RESP_ERR) cqe_error(qp, w, cq.buf, s, tail);
      qpd::credit_done(qp, s + arch::load_relaxed(&slot_nbb[s & mask]));
    }
    qpd::unlock(&qp->poll_lock);
    return;
  }
  if (!qpd::try_lock(&qp->poll_lock)) return;
  uint64_t ci = arch::load_relaxed(&qp->cq.ci);
  uint64_t done = arch::load_acquire_sys(&qp->done_head);
  uint64_t new_done = done;
  bool consumed = false;
  for (uint32_t k = 0; k < cq.cqe_cnt; ++k) {
    const uint64_t addr = cq.buf + (ci & (cq.cqe_cnt - 1)) * mlx5::CQE_SIZE;
    const uint32_t tail = arch::load_acquire_sys(qpd::u32p(addr + mlx5::CQE_WQE_COUNTER));
    if (!mlx5::op_own_is_valid(mlx5::cqe_tail_op_own(tail), ci, cq.cqe_cnt)) break;
    const uint32_t op = mlx5::cqe_tail_op_own(tail) >> 4;
    // Every valid CQE is consumed exactly once, in order: no staleness check is needed (nor
    // allowed: the NIC may complete a WQE before its ringer has advanced db_head).
    const uint64_t s = cqe_start(qp, new_done, tail);
    if (s != UINT64_MAX) {
      if (op == mlx5::CQE_REQ_ERR || op == mlx5::CQE_RESP_ERR) cqe_error(qp, w, addr, s, tail);
      new_done = s + arch::load_relaxed(&slot_nbb[s & mask]);
    }
    ++ci;
    consumed = true;
  }
  if (consumed) {
    arch::store_relaxed(&qp->cq.ci, ci);
    // CQ DBR: consumed up to ci. Release: our reads of those CQEs come first.
    arch::store_release_sys(qpd::u32p(cq.dbrec + 4 * mlx5::DBREC_RCV), mlx5::cq_dbrec_value(ci));
    if (new_done > done) qpd::credit_done(qp, new_done);
  }
  qpd::unlock(&qp->poll_lock);
}

// ------------------------------------------------------------------------------------------------
// Doorbell (the protocol: header comment, "The doorbell lock")
// ------------------------------------------------------------------------------------------------
namespace qpd {
constexpr uint64_t kDbFree = 0, kDbHeld = 1, kDbRescan = 3;

// Holder only: ready_head = db_head = r, then ONE ring for everything below r. `word`: the
// doorbell word of the WQE ending at r when the caller has it, else 0 (read from slot_db; a
// doorbell word is never 0: ds >= 1).
GPUNET_DEVICE void ring_to(QpDesc* qp, uint64_t r, uint64_t word) {
  arch::atomic_store(&qp->ready_head, r);  // before the DBR: bounds collapsed-CQ credits (poll_cq)
  arch::atomic_store(&qp->db_head, r);
  arch::fence_sys();  // the WQEs (ours, or others' through their tags), slot_db, heads before the DBR
  if (word == 0) word = arch::load_relaxed(&u64p(qp->slot_db)[r & (qp->sq_wqebbs - 1)]);
  arch::store_relaxed(u32p(qp->dbrec + 4 * mlx5::DBREC_SND), mlx5::sq_dbrec_value(r));
#if !defined(GPUNET_TEST_DROP_DOORBELL_FENCE)
  arch::fence_sys();  // the DBR before the doorbell: the NIC reads the DBR when it sees it
#endif
  arch::doorbell_store64(reinterpret_cast<volatile uint64_t*>(uintptr_t(qp->db)), word);
  GPUNET_DELAY_POINT();
}

// Holder only (db_lock taken and acquired): [r0, r) is ready (r0: ready_head as read after the
// lock; `word` as ring_to's, for r); `scan`: false when tags[r] was already seen not ready.
// Scans on, rings once, releases; scans again while publishers ask for it (kDbRescan).
GPUNET_DEVICE void hold_and_ring(QpDesc* qp, uint64_t r0, uint64_t r, uint64_t word, bool scan) {
  const uint64_t mask = qp->sq_wqebbs - 1;
  const uint64_t* tags = u64p(qp->slot_ready);
  for (;;) {
    // Each step moves r forward by one reservation; r - r0 <= sq_wqebbs (ring space), so the
    // scan ends within sq_wqebbs steps.
    for (uint32_t i = 0; scan && i < qp->sq_wqebbs; ++i) {
      const uint64_t t = arch::load_relaxed(&tags[r & mask]);
      if (t <= r) break;
      r = t;
      word = 0;
    }
    if (r > r0) ring_to(qp, r, word);
    else arch::fence_gpu();  // release: our tag (if any) before the lock is free
    if (arch::atomic_cas(&qp->db_lock, kDbHeld, kDbFree) == kDbHeld) return;
    arch::atomic_cas(&qp->db_lock, kDbRescan, kDbHeld);  // only the holder clears kDbRescan
    arch::fence_gpu();  // acquire: the tags of the publishers that asked
    r0 = r = arch::atomic_load(&qp->ready_head);
    word = 0;
    scan = true;
  }
}

// Hand what is tagged to the holder, or become it. Never waits for the holder. false only when a
// failure is recorded (the lock flipping for timeout_ns without settling).
GPUNET_DEVICE bool take_or_hand_over(QpDesc* qp, const Waiter& w) {
  Spin spin;
  spin.progress = false;
  for (;;) {
    const uint64_t old = arch::atomic_cas(&qp->db_lock, kDbFree, kDbHeld);
    if (old == kDbFree) {
      arch::fence_gpu();  // acquire: ready_head and the tags the last holder saw
      const uint64_t r0 = arch::atomic_load(&qp->ready_head);
      hold_and_ring(qp, r0, r0, 0, true);
      return true;
    }
    if (old == kDbRescan) return true;
    if (arch::atomic_cas(&qp->db_lock, kDbHeld, kDbRescan) != kDbFree) return true;
    if (!spin.keep_going(w, 0, on_qp(qp, SITE_DOORBELL, 0, 0))) return false;
  }
}
}  // namespace qpd

// ------------------------------------------------------------------------------------------------
// Posting
// ------------------------------------------------------------------------------------------------

// Step 1+2: reserve n WQEBBs and wait for their space. base is set even on failure (then the
// caller must not publish: a failure is recorded and every wait behind it gives up). `done0`: a
// done_head the caller read before (relaxed, issued with its other loads so that the reservation
// costs one round trip): a stale one only sends us to the exact check below.
GPUNET_DEVICE bool reserve(QpDesc* qp, const Waiter& w, uint32_t n, uint64_t& base,
                           uint64_t done0) {
  base = arch::atomic_add(&qp->resv_head, uint64_t(n));
  // The WQE stores that follow need the slots' old WQEs read by the NIC: it read them before the
  // CQE that credited done_head (credit_done fences first). A store that depends on the compared
  // value (its address, the branch) is not issued before the load returns.
  if (base + n <= done0 + qp->sq_wqebbs) return true;
  const uint64_t need = base + n - qp->sq_wqebbs;  // done_head must reach this
  uint64_t done = arch::load_acquire_gpu(&qp->done_head);
  if (done >= need) return true;
  Spin spin;
  while (done < need) {
    if (arch::atomic_load(&qp->errored)) return false;
    poll_cq(qp, w);
    done = arch::load_acquire_gpu(&qp->done_head);
    if (done >= need) break;
    if (!spin.keep_going(w, done, qpd::on_qp(qp, SITE_SQ_SPACE, base, need))) return false;
  }
  return true;
}
GPUNET_DEVICE bool reserve(QpDesc* qp, const Waiter& w, uint32_t n, uint64_t& base) {
  return reserve(qp, w, n, base, arch::atomic_load(&qp->done_head));
}

// Step 4 for the WQE(s) [base, base+n) whose words (and slot_nbb) are already stored by this
// thread (or by lanes that then passed a syncwarp with it). `last_word0` is the doorbell word of
// the last WQE. Returns once they are rung or handed to the doorbell lock's holder.
GPUNET_DEVICE bool publish(QpDesc* qp, const Waiter& w, uint64_t base, uint32_t n,
                           uint64_t last_word0) {
  const uint64_t mask = qp->sq_wqebbs - 1;
  uint64_t* tags = qpd::u64p(qp->slot_ready);
  arch::store_relaxed(&qpd::u64p(qp->slot_db)[(base + n) & mask], last_word0);
  GPUNET_DELAY_POINT();
  // The lock attempt and the holder's first two reads go out together (one round trip). Read
  // before the lock is acquired, ready_head may be stale, but only low: it cannot pass our
  // untagged reservation, so reading `base` means it IS base. A stale "not ready" tag at base + n
  // only leaves that reservation to its own publish (its CAS then finds the lock held, or free).
  const uint64_t old = arch::atomic_cas(&qp->db_lock, qpd::kDbFree, qpd::kDbHeld);
  const uint64_t r_seen = arch::atomic_load(&qp->ready_head);
  const uint64_t t_next = arch::load_relaxed(&tags[(base + n) & mask]);
  if (old == qpd::kDbFree) {
    // The previous holder's DBR is ordered before ours by its fence_sys before its release and
    // ours (ring_to) after the CAS that read it.
    if (r_seen == base) {  // next in line: ours needs no tag
      if (t_next > base + n) qpd::hold_and_ring(qp, base, t_next, 0, true);
      else qpd::hold_and_ring(qp, base, base + n, last_word0, false);
      return true;
    }
    arch::fence_gpu();  // acquire: ready_head as the last holder left it
    const uint64_t r0 = arch::atomic_load(&qp->ready_head);
    if (r0 == base) {
      qpd::hold_and_ring(qp, base, base + n, last_word0, true);
      return true;
    }
    // Behind a reservation not yet ready: tag ours; the scan (now, or that reservation's own
    // publish after our release) covers it.
    arch::store_release_gpu(&tags[base & mask], base + n);
    qpd::hold_and_ring(qp, r0, r0, 0, true);
    return true;
  }
#if defined(GPUNET_TEST_RELAXED_PUBLISH)
  arch::store_relaxed(&tags[base & mask], base + n);
#else
  arch::store_release_gpu(&tags[base & mask], base + n);  // the WQEs, slot_nbb, slot_db first
#endif
  GPUNET_DELAY_POINT();
#if !defined(GPUNET_TEST_DROP_PUBLISH_FENCE)
  arch::fence_gpu();  // SC: the tag before the lock attempt (the holder's release reads the lock)
#endif
  if (old == qpd::kDbRescan) {  // still asked? then the holder scans after our tag
    if (arch::atomic_load(&qp->db_lock) == qpd::kDbRescan) return true;
  }
  return qpd::take_or_hand_over(qp, w);
}

// The ctrl segment of WQE `q` at producer index `pi` on this QP (mlx5.cuh's ctrl_seg).
GPUNET_DEVICE mlx5::Seg16 ctrl_of(const QpDesc* qp, uint64_t pi, const Wqe& q) {
  return mlx5::ctrl_seg(uint32_t(pi), q.opcode, 0, qp->qpn, q.fm_ce_se, q.ds, 0, 0);
}

// Write a built WQE at counter `base` with its ctrl segment `ctrl` (ctrl_of: this thread's stores,
// one 16-byte store per segment, wrapping per WQEBB) and record its size. Returns its doorbell word.
GPUNET_DEVICE uint64_t write_wqe(const QpDesc* qp, uint64_t base, const Wqe& q,
                                 const mlx5::Seg16& ctrl) {
  const uint64_t mask = qp->sq_wqebbs - 1;
  uint64_t* bb = qpd::u64p(qp->sq + (base & mask) * mlx5::WQEBB);
  arch::store_relaxed_v2(bb, ctrl.w[0], ctrl.w[1]);
  if (q.nbb == 1) {  // the common case (RDMA, atomic, short inline): one WQEBB, no wrap
    for (uint32_t i = 1; i < 4; ++i) arch::store_relaxed_v2(bb + 2 * i, q.seg[i].w[0], q.seg[i].w[1]);
  } else {
    for (uint32_t i = 1; i < q.nbb * 4; ++i) {
      uint64_t* p = qpd::u64p(qp->sq + ((base + i / 4) & mask) * mlx5::WQEBB + (i % 4) * mlx5::DS_UNIT);
      arch::store_relaxed_v2(p, q.seg[i].w[0], q.seg[i].w[1]);
    }
  }
  arch::store_relaxed(&qpd::u32p(qp->slot_nbb)[base & mask], q.nbb);
  GPUNET_DELAY_POINT();
  return mlx5::doorbell_word(ctrl);
}
GPUNET_DEVICE uint64_t write_wqe(const QpDesc* qp, uint64_t base, const Wqe& q) {
  return write_wqe(qp, base, q, ctrl_of(qp, base, q));
}

// Post `count` (1 or 2) WQEs as one reservation, in order (put_signal: WRITE then ATOMIC).
// `end` (optional) receives the counter just past the last WQE (for wait_done).
GPUNET_DEVICE bool post(QpDesc* qp, const Waiter& w, Wqe* wqes, uint32_t count,
                        uint64_t* end = nullptr) {
  if (failed(w)) return false;
  if (arch::atomic_load(&qp->errored)) {
    Failure f(STATUS_QP_ERROR, SITE_POST_ARG);
    f.qpn = qp->qpn;
    f.peer = qp->peer;
    record_failure(w.st, f);
    return false;
  }
  uint32_t n = 0;
  for (uint32_t i = 0; i < count; ++i) n += wqes[i].nbb;
  if (n > qp->sq_wqebbs) {
    record_bad_argument(w, SITE_POST_ARG, qp->qpn, qp->peer, qp->sq_wqebbs, n);
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
  // Offsets of each lane's WQE: an exclusive prefix sum of nbb over lanes. Every posting lane
  // with one WQEBB (the common case, one vote): lane i at base + i. Otherwise a log-step scan.
  const uint32_t my_nbb = mine ? q.nbb : 0;
  const uint32_t ws = arch::warp_size();
  uint32_t off, total;
  if (arch::all(!mine || my_nbb == 1)) {
    total = nposts < ws ? nposts : ws;
    off = lane;
  } else {
    uint32_t incl = my_nbb;  // inclusive scan: after step d, the sum of lanes (lane - 2d, lane]
    for (uint32_t d = 1; d < ws; d <<= 1) {
      const uint32_t v = arch::shfl(incl, lane >= d ? lane - d : lane);
      if (lane >= d) incl += v;
    }
    off = incl - my_nbb;
    total = arch::shfl(incl, ws - 1);
  }
  // Three independent loads in flight at once (no short-circuit between them).
  const bool st_failed = failed(w);
  const bool qp_errored = arch::atomic_load(&qp->errored) != 0;
  const uint64_t done0 = lane == 0 ? arch::atomic_load(&qp->done_head) : 0;
  bool ok = !st_failed && !qp_errored && total <= qp->sq_wqebbs;
  ok = arch::all(ok);
  if (!ok && lane == 0 && !st_failed && !qp_errored && total > qp->sq_wqebbs)
    record_bad_argument(w, SITE_POST_ARG, qp->qpn, qp->peer, qp->sq_wqebbs, total);
  uint64_t base = 0;
  bool lane0_ok = true;
  if (ok && lane == 0) lane0_ok = reserve(qp, w, total, base, done0);
  base = arch::shfl(base, 0);
  ok = arch::shfl(uint32_t(ok && lane0_ok), 0) != 0;
  // The last posting lane's doorbell word goes to lane 0 BEFORE the WQE stores: after them the
  // only collective is the syncwarp whose ordering the publish relies on (and tests check).
  const mlx5::Seg16 ctrl = ctrl_of(qp, base + off, q);
  uint64_t word = mine ? mlx5::doorbell_word(ctrl) : 0;
  const uint32_t last_lane = nposts ? (nposts < ws ? nposts : ws) - 1 : 0;
  word = arch::shfl(word, last_lane);
  if (ok && mine) write_wqe(qp, base + off, q, ctrl);
  arch::syncwarp();  // lanes' WQE stores happen-before lane 0's release below (cumulative)
  uint32_t res = 1;
  if (lane == 0 && total > 0) res = ok && publish(qp, w, base, total, word);
  res = arch::shfl(res, 0);
  return ok && res != 0;
}

// Warp-cooperative posting of warp_size * k single-WQEBB WQEs with ONE reservation and ONE
// publish (fewer publishes per WQE: bench/RESULTS.md measured k = 8 at 108 M WQE/s on 32 QPs
// when each publish cost a system-scope release). Lane l builds WQE j
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
  const bool st_failed = failed(w);
  const bool qp_errored = arch::atomic_load(&qp->errored) != 0;
  const uint64_t done0 = lane == 0 ? arch::atomic_load(&qp->done_head) : 0;
  bool ok = !st_failed && !qp_errored && k >= 1 && total <= qp->sq_wqebbs && last.nbb == 1;
  ok = arch::all(ok);
  if (!ok) {
    if (lane == 0 && !failed(w) && !arch::atomic_load(&qp->errored))
      record_bad_argument(w, SITE_POST_ARG, qp->qpn, qp->peer, qp->sq_wqebbs, total);
    return false;
  }
  uint64_t base = 0;
  bool lane0_ok = true;
  if (lane == 0) lane0_ok = reserve(qp, w, uint32_t(total), base, done0);
  base = arch::shfl(base, 0);
  ok = arch::shfl(uint32_t(lane0_ok), 0) != 0;
  const mlx5::Seg16 last_ctrl = ctrl_of(qp, base + total - ws + lane, last);
  const uint64_t word = arch::shfl(mlx5::doorbell_word(last_ctrl), ws - 1);
  for (uint32_t j = 0; ok && j < k; ++j) {
    if (j + 1 == k) {
      write_wqe(qp, base + uint64_t(j) * ws + lane, last, last_ctrl);
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
// It rings nothing: every publish sees to its own ring (the doorbell lock), and a helping ring
// here would hide a lost hand-over from tests/test_device_qp.py's weak-memory test.
GPUNET_DEVICE bool wait_done(QpDesc* qp, const Waiter& w, uint64_t end, uint32_t site) {
  Spin spin;
  uint64_t done = arch::load_acquire_sys(&qp->done_head);
  while (done < end) {
    poll_cq(qp, w);
    done = arch::load_acquire_sys(&qp->done_head);
    if (done >= end) break;
    if (arch::atomic_load(&qp->errored)) return false;
    if (!spin.keep_going(w, done, qpd::on_qp(qp, site, end, end))) return false;
  }
  return !arch::atomic_load(&qp->errored);
}

// Wait until every WQE posted on this QP before the call has completed: everything reserved by
// then (a post returns once its WQEs are handed over, maybe before ready_head covers them, so
// ready_head is not the bound; a reservation of another thread still being written is waited
// for too). true: they all completed successfully; false: a failure is recorded in the Status.
GPUNET_DEVICE bool quiet(QpDesc* qp, const Waiter& w) {
  return wait_done(qp, w, arch::atomic_load(&qp->resv_head), SITE_QUIET) && !failed(w);
}

}  // namespace gpunet
