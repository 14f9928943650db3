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
//   Why ready_head and not db_head bounds s: the NIC completes a WQE before its ringer stores
//   db_head, so a bound by db_head refuses a valid newest CQE until that store shows, and with
//   every poster waiting for space no newer CQE comes to replace it (test_device_qp.py
//   test_collapsed_cq_credits_the_newest_cqe_exactly[rung_before_db_head]).
//
// Memory orders (arch.cuh's atomics are RELAXED, like CUDA's): locks are CAS then fence_sys;
// credits to done_head follow a fence_sys, so a thread that reads done_head with acquire also
// sees what the NIC wrote for those WQEs (READ data, atomic results) — the CQE was read with
// acquire, the NIC publishes op_own / the CQE's last 4 bytes with a release store.
//
// Failures: every wait is a status.cuh Spin (bounded, first failure wins, the grid drains).
//
// Test-only switches (tests/test_device_qp.py builds them to prove its fence test can fail):
//   GPUNET_TEST_DROP_DOORBELL_FENCE   no fence between the DBR store and the doorbell store
//   GPUNET_TEST_RELAXED_PUBLISH       ready_head published with a relaxed store, not a release
//   GPUNET_TEST_DELAY_POINTS          status.cuh's GPUNET_DELAY_POINT(): a stall where real
//                                     hardware may stall a thread (widens the weak model's windows)
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
        arch::store_relaxed(qpd::u32p(qp->dbrec + 4 * mlx5::DBREC_SND), mlx5::sq_dbrec_value(r));
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
    if (!spin.keep_going(w, seen, qpd::on_qp(qp, SITE_DOORBELL, target, target))) return false;
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
    if (!spin.keep_going(w, done, qpd::on_qp(qp, SITE_SQ_SPACE, base, need))) return false;
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
    if (!spin.keep_going(w, ready, qpd::on_qp(qp, SITE_READY, base, base))) return false;
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
      record_bad_argument(w, SITE_POST_ARG, qp->qpn, qp->peer, qp->sq_wqebbs, total);
    return false;
  }
  uint64_t base = 0;
  bool lane0_ok = true;
  if (lane == 0) lane0_ok = reserve(qp, w, uint32_t(total), base);
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
GPUNET_DEVICE bool wait_done(QpDesc* qp, const Waiter& w, uint64_t end, uint32_t site) {
  if (!flush_doorbell(qp, w)) return false;
  Spin spin;
  uint64_t done = arch::load_acquire_sys(&qp->done_head);
  while (done < end) {
    poll_cq(qp, w);
    done = arch::load_acquire_sys(&qp->done_head);
    if (done >= end) break;
    if (arch::atomic_load(&qp->errored)) return false;
    if (!spin.keep_going(w, done, qpd::on_qp(qp, site, end, end))) return false;
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
