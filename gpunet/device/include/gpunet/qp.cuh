// gpunet/qp.cuh — GPU-initiated operations on one mlx5 RC queue pair: reserve, write, publish,
// ring, poll, quiet: the mechanism under transport/ibgda.cuh. The device-visible descriptors
// (QpDesc, CqDesc) are defined here once; gpunet/device/abi.py mirrors them byte for byte and
// tests/test_device_qp.py checks the layout. WQEs are mlx5.cuh's segment values (the builders
// tests/test_mlx5_mirror.py checks byte for byte against gpunet/mlx5.py), written as whole 16-byte
// stores (arch::store_relaxed_v2); failures use status.cuh's vocabulary.
//
// ------------------------------------------------------------------------------------------------
// The posting protocol (every counter is a 64-bit, monotonically increasing WQEBB count; the ring
// slot of counter c is c & (sq_wqebbs - 1), the WQE index in the ctrl segment c & 0xffff):
//
//   post(n WQEBBs)
//     1. base = atomic_add(resv_head, n), with db_head (and the Status, errored, done_head) read
//        in the same round trip; turn = (db_head read == base)
//     2. wait until base + n - done_head <= sq_wqebbs          space; the waiter polls the CQ
//     3. write the WQE words with arch::store_relaxed          the NIC reads them
//        slot_nbb[base & mask] = n (per WQE); slot_db[(base+n) & mask] = doorbell word of the last
//     4. publish: ring [base, base+n) if the doorbell turn is ours, else hand it to the turn's
//        owner with a tag (below). A post never waits for another post's publish.
//
//   The doorbell turn. Only its owner moves ready_head / db_head and writes the DBR and the
//   doorbell, so the DBR never goes back. The turn sits at the first position not yet rung; the
//   publisher of the reservation starting there owns it, unless the owner before it takes that
//   reservation over (its tag seen). slot_ready[p & mask] holds, for position p: a tag p + n
//   (that reservation is written: release at device scope) or the marker p | kLeft (the turn left
//   at p, for p's publisher).
//     publisher (its WQEs written):
//       turn (db_head == base at step 1): own at base, no tag
//       else: fence_gpu (release); CAS(slot_ready[base], e, base + n) with e the slot as read
//             (retried while e was stale): if the slot holds base | kLeft, own at base; else the
//             tag is in and the post returns
//     owner at r (everything below `rung` rung, [rung, r) ready):
//       while slot_ready[r] is a tag t > r: r = t                                  (scan)
//       if r > rung: ready_head = r; fence_sys; DBR[1] = htobe32(r & 0xffff); fence_sys;
//                    doorbell_store64(db, slot_db[r & mask]); db_head += r - rung   (ONE ring)
//       leave: CAS(slot_ready[r], t, r | kLeft): done if it held t, else the tag found is
//              taken over (scan on, ring again)
//   Why no ready WQE is left unrung: a reservation at p is either owned by its publisher (fast
//   path, or the marker found) or its tag CAS came before the owner's leave-CAS at p (both RMWs
//   on one word: one of them is first), and an owner reaching p takes a tag it finds, by its scan
//   or by that CAS failing. An owner leaves only through the CAS that put the marker at p, and
//   p's publisher then owns p. Exactly one owner: the marker is the only hand-over besides the
//   fast path, and the fast path is taken only by p's publisher when db_head == p, i.e. after the
//   owner before it rang up to p; that owner's leave-CAS at p then finds no tag (a fast-path
//   publisher never tags) and leaves. db_head is stored after the doorbell's fence, so a
//   fast-path owner's fence_sys (before its DBR) comes after the last DBR; a marker's reader
//   likewise (fence_sys, the leave-CAS, the publisher's CAS reading it, its fence_sys).
//   Why a tag is exact: for a position r, a value written in an earlier lap is a tag <= r or a
//   marker of a position below r; a reservation of the current lap starting at r writes r + n
//   (r < r + n <= r + sq_wqebbs); no later lap can start at r + sq_wqebbs before r completes,
//   i.e. before r is rung. So while r is not rung, "ready at r" is exactly a tag in
//   (r, r + sq_wqebbs] without kLeft.
//   The late leave: an owner's db_head add hands the fast path to r's publisher before the
//   owner's leave-CAS at r; if the owner stalls there (a descheduled warp), r's publisher can
//   ring r, the ring can go round, and the slot can hold a later lap's tag (> r + sq_wqebbs)
//   or marker (of a position > r) when the CAS finally runs. Taking that tag rang a lap twice
//   (db_head 19 past resv_head on a 16-deep ring: the CI run of stop 40, b3684ea); overwriting a
//   later marker would strand its publisher. So a failed leave-CAS that finds a later lap's value
//   just returns (qpd::passed): the turn went on, nothing is the late owner's any more. A leave-CAS
//   that succeeds late over an earlier lap's value leaves a marker nobody reads (harmless: an
//   older position's marker). Test: test_device_qp.py test_a_late_leave_*.
//   The tag follows a release fence: an owner that reads
//   it (scan load or CAS) and fences (fence_sys before the DBR) has the WQEs, slot_nbb and slot_db
//   it covers. The doorbell word is a wake-up: the NIC reads the producer index from the DBR,
//   which only owners write, after a fence_sys, in increasing order; two owners' doorbell stores
//   may land in either order (the soft NIC re-reads the DBR on any doorbell change).
//   One warp alone on a QP (the turn always its own): one round trip to reserve, the WQE stores,
//   two system fences, one round trip to leave (the leave-CAS); the tag slots that CAS and the
//   scan compare with are read while the WQEs are written.
//
//   Posting modes (QpDesc::post_mode, set by the host per QP). POST_BATCHED is the protocol
//   above. POST_SERIAL has no tags and no hand-over: a publisher whose turn is not its own at
//   step 1 waits (bounded, SITE_DOORBELL_TURN) until db_head reaches its base, then rings its own
//   reservation and stores db_head = end. One warp alone on the QP never waits, and pays one
//   round trip (the reservation) and the ring's two system fences: no tag loads, no leave-CAS.
//   Several posters are still correct (each rings in reservation order) but ring one at a
//   time, so a QP shared by many warps keeps POST_BATCHED (bench/device_post.py has both).
//   Why the DBR still only grows: db_head == base is read (acquire) before the fence_sys that
//   precedes our DBR, and the poster before us stored it after its own DBR's fence.
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
// fence_sys; the doorbell turn's hand-overs are RMWs on the tag slots ordered by the fences named
// above (a release fence before a tag, fence_sys before every DBR); credits to done_head follow a fence_sys, so a thread that reads done_head with acquire also
// sees what the NIC wrote for those WQEs (READ data, atomic results) — the CQE was read with
// acquire, the NIC publishes op_own / the CQE's last 4 bytes with a release store.
//
// Failures: every wait is a status.cuh Spin (bounded, first failure wins, the grid drains).
//
// Test-only switches (tests/test_device_qp.py builds them to prove its fence test can fail):
//   GPUNET_TEST_DROP_DOORBELL_FENCE   no fence between the DBR store and the doorbell store
//   GPUNET_TEST_RELAXED_PUBLISH       no release fence before a publisher's tag (slot_ready)
//   GPUNET_TEST_PLAIN_HANDOFF         an owner leaves the turn with a plain store of the marker,
//                                     not the CAS (a tag stored meanwhile is never rung)
//   GPUNET_TEST_NO_LAP_CHECK          a failed leave-CAS takes a later lap's tag as its own and
//                                     overwrites a later marker (the bug "The late leave" tells)
//   GPUNET_TEST_DELAY_POINTS          status.cuh's GPUNET_DELAY_POINT(): a stall where real
//                                     hardware may stall a thread (widens the weak model's windows)
//
// Warp-cooperative posting (post_warp): one reservation per warp (lane 0's atomic_add, shfl of
// the base), lane i writes WQE i, syncwarp, lane 0 publishes (and rings if the turn is its own).
// Correct for warps of 32 and 64; every lane of the warp must call it (arch's *_sync rule).
//
// Per-thread posting from divergent lanes of one warp needs independent thread scheduling
// (CUDA sm_70+, the HOST arm): lane B may wait for ring space that lane A's posts hold. Where lanes of one warp do
// not make independent progress (assumed for MACA until verified) use the warp variants.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "mlx5.cuh"
#include "status.cuh"

// A phase stamp of the posting path (bench/device_post.py --phases defines it to read the clock;
// nothing by default).
#ifndef GPUNET_POST_STAMP
#define GPUNET_POST_STAMP(k) ((void)0)
#endif

namespace gpunet {

// ------------------------------------------------------------------------------------------------
// Descriptors (device memory). Plain structs, fixed-width fields, explicit padding: the Python
// mirror is gpunet/device/abi.py (ctypes), checked by tests/test_device_qp.py::test_abi_layout_matches_cpp.
// ------------------------------------------------------------------------------------------------

// A CQ as the device polls it. 32 B.
struct CqDesc {
  uint64_t buf;        // CQE ring (cqe_cnt * 64 B), host-mapped
  uint64_t dbrec;      // CQ doorbell record (dbrec[0] = consumer index)
  uint32_t cqe_cnt;    // power of two; 1 when collapsed
  uint32_t collapsed;  // 1: one slot, overwritten, read by wqe_counter
  uint64_t ci;         // owner-bit mode: consumer index (written under QpDesc::poll_lock only)
};
static_assert(sizeof(CqDesc) == 32, "CqDesc layout is mirrored in gpunet/device/abi.py");

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
  uint32_t max_inline;  // bytes of inline payload the QP accepts
  uint32_t post_mode;   // POST_BATCHED or POST_SERIAL (the header's "Posting modes")
  uint32_t pad0;
  CqDesc cq;            // at 64
  uint64_t slot_ready;  // device memory, uint64[sq_wqebbs]: end of the reservation STARTING there
  uint64_t pad1[3];     // to 128
  // ---- state (device memory; only device threads touch it), at 128 ----
  uint64_t resv_head;   // WQEBBs reserved
  uint64_t ready_head;  // WQEBBs handed to the NIC, stored before the DBR (the turn's owner)
  uint64_t db_head;     // WQEBBs rung, stored after the doorbell (the turn's owner): the turn
  uint64_t done_head;   // WQEBBs completed (credited from CQEs)
  uint64_t poll_lock;   // 0 free, 1 held: the one CQ poller (either mode)
  uint64_t errored;     // 1 once an error CQE was seen: posts fail fast
  uint64_t pad2[2];
};
static_assert(sizeof(QpDesc) == 192, "QpDesc layout is mirrored in gpunet/device/abi.py");

// QpDesc::post_mode (gpunet/device/abi.py POST_*): how a publisher gets the doorbell turn.
constexpr uint32_t POST_BATCHED = 0;  // hand-over by tags: one ring covers several posts
constexpr uint32_t POST_SERIAL = 1;   // wait until db_head reaches the reservation: no tags
static_assert(__builtin_offsetof(QpDesc, resv_head) == 128, "QpDesc state at 128");

// ------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------
namespace qpd {

GPUNET_DEVICE uint64_t* u64p(uint64_t addr) { return reinterpret_cast<uint64_t*>(uintptr_t(addr)); }
GPUNET_DEVICE uint32_t* u32p(uint64_t addr) { return reinterpret_cast<uint32_t*>(uintptr_t(addr)); }

// The QP's constants (the first 128 B: the host writes them before a launch, never during one),
// read with arch::load_const (arch.cuh says why that is __ldg and not an asm the compiler may
// hoist). A caller that posts in a loop holds them in a QpRef instead (below).
GPUNET_DEVICE uint32_t wqebbs(const QpDesc* qp) { return arch::load_const(&qp->sq_wqebbs); }
GPUNET_DEVICE uint32_t mode(const QpDesc* qp) { return arch::load_const(&qp->post_mode); }
GPUNET_DEVICE uint64_t sq(const QpDesc* qp) { return arch::load_const(&qp->sq); }
GPUNET_DEVICE uint64_t dbrec(const QpDesc* qp) { return arch::load_const(&qp->dbrec); }
GPUNET_DEVICE uint64_t db(const QpDesc* qp) { return arch::load_const(&qp->db); }
GPUNET_DEVICE uint64_t slot_db(const QpDesc* qp) { return arch::load_const(&qp->slot_db); }
GPUNET_DEVICE uint64_t slot_nbb(const QpDesc* qp) { return arch::load_const(&qp->slot_nbb); }
GPUNET_DEVICE uint64_t slot_ready(const QpDesc* qp) { return arch::load_const(&qp->slot_ready); }
GPUNET_DEVICE uint32_t qpn(const QpDesc* qp) { return arch::load_const(&qp->qpn); }
// The CQ's constants (CqDesc less its consumer index).
struct CqConst {
  uint64_t buf, dbrec;
  uint32_t cqe_cnt, collapsed;
};
GPUNET_DEVICE CqConst cq_const(const QpDesc* qp) {
  return CqConst{arch::load_const(&qp->cq.buf), arch::load_const(&qp->cq.dbrec),
                 arch::load_const(&qp->cq.cqe_cnt), arch::load_const(&qp->cq.collapsed)};
}

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

// The QP's constants as a poster holds them (the first 128 B of QpDesc, read once through
// arch::load_const), with the descriptor for its state. A caller that posts over and over on one
// QP takes it once (qp_ref) and passes it to every post, so the constants stay in registers: a
// post that reads them itself does so after the previous post's system fences, an L1 miss in
// front of its reservation (bench/RESULTS.md, sixteenth session). Valid for the kernel that took
// it: the host writes the constants before a launch, never during one. Guard:
// tests/test_device_arch.py test_a_posting_loop_on_a_qp_ref_loads_no_constant_before_its_reservation.
struct QpRef {
  QpDesc* qp;
  uint64_t sq;          // QpDesc::sq
  uint64_t dbrec;       // QpDesc::dbrec
  uint64_t db;          // QpDesc::db
  uint64_t slot_db;     // QpDesc::slot_db
  uint64_t slot_nbb;    // QpDesc::slot_nbb
  uint64_t slot_ready;  // QpDesc::slot_ready
  uint32_t mask;        // sq_wqebbs - 1
  uint32_t qpn;
  uint32_t mode;        // QpDesc::post_mode
  GPUNET_DEVICE uint32_t wqebbs() const { return mask + 1; }
};
GPUNET_DEVICE QpRef qp_ref(QpDesc* qp) {
  return QpRef{qp,
               qpd::sq(qp),
               qpd::dbrec(qp),
               qpd::db(qp),
               qpd::slot_db(qp),
               qpd::slot_nbb(qp),
               qpd::slot_ready(qp),
               qpd::wqebbs(qp) - 1,
               qpd::qpn(qp),
               qpd::mode(qp)};
}

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
  if (d >= qpd::wqebbs(qp)) return UINT64_MAX;          // credited already (or never posted)
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
  const qpd::CqConst cq = qpd::cq_const(qp);
  const uint64_t mask = qpd::wqebbs(qp) - 1;
  const uint32_t* slot_nbb = qpd::u32p(qpd::slot_nbb(qp));
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
// The doorbell turn (the protocol: header comment, "The doorbell turn")
// ------------------------------------------------------------------------------------------------
namespace qpd {
// slot_ready marker: the turn left at position p is stored there as p | kLeft (a tag never has
// bit 63: counters stay below 2^63).
constexpr uint64_t kLeft = uint64_t(1) << 63;

// "The reservation starting at r is written and handed over": tags[r & mask] read as t while r
// is not rung (header: "Why a tag is exact").
GPUNET_DEVICE bool tagged(uint64_t t, uint64_t r) { return (t & kLeft) == 0 && t > r; }
// "tags[r & mask] holds a value of a later lap than r's": a tag ending past r + sq_wqebbs or a
// marker of a position past r. Only after the turn moved past r (header: "The late leave").
GPUNET_DEVICE bool passed(uint64_t t, uint64_t r, uint32_t nbbs) {
  return (t & kLeft) ? (t & ~kLeft) > r : t > r + nbbs;
}

// Owner only: ready_head = r, then ONE ring for everything below r. `word`: the doorbell word of
// the WQE ending at r when the caller has it, else 0 (read from slot_db; a doorbell word is never
// 0: ds >= 1). Two system fences: the WQEs (ours, or others' through their tags), slot_db and
// ready_head before the DBR; the DBR before the doorbell (the NIC reads the DBR when it sees the
// doorbell; tests/test_device_qp.py test_fence_test_weak_memory[drop_doorbell_fence-*]).
GPUNET_DEVICE void ring_to(const QpRef& c, uint64_t r, uint64_t word) {
  // The addresses come from the QpRef, loaded BEFORE the first fence: the compiler may not move a
  // load across a fence, and a load after a system fence misses L1, so reading them after it put
  // two dependent L2 round trips on the ring's chain (about 0.3 us a post; bench/RESULTS.md, tenth
  // session). Guard: tests/test_device_arch.py test_ring_to_reads_no_descriptor_after_its_fences.
  const uint64_t* const word_at = &u64p(c.slot_db)[r & c.mask];
  uint32_t* const dbr = u32p(c.dbrec + 4 * mlx5::DBREC_SND);
  volatile uint64_t* const db = reinterpret_cast<volatile uint64_t*>(uintptr_t(c.db));
  arch::atomic_store(&c.qp->ready_head, r);  // before the DBR: bounds collapsed-CQ credits (poll_cq)
  arch::fence_sys();
  GPUNET_POST_STAMP(3);
  if (word == 0) word = arch::load_relaxed(word_at);  // after the fence: another publisher's word
  arch::store_relaxed(dbr, mlx5::sq_dbrec_value(r));
  // A fence, not a release store of the doorbell: the fence also orders the DBR before the
  // db_head update that hands the turn on (a relaxed RMW or store after a release may overtake
  // it, and the next owner's DBR could land first: the DBR would go back; the weak-memory model
  // fails tests/test_device_qp.py test_collapsed_cq_many_threads_past_65536[weak-*] that way).
#if !defined(GPUNET_TEST_DROP_DOORBELL_FENCE)
  arch::fence_sys();
#endif
  arch::doorbell_store64(db, word);
  GPUNET_POST_STAMP(4);
  GPUNET_DELAY_POINT();
}

// The turn's owner, with everything below `rung` rung and [rung, r) ready (`word` as ring_to's,
// for r). `t`: a value of tags[r & mask] read earlier, of any age (a stale one costs one more
// CAS). Takes every tagged reservation from r on, rings once, stores db_head, then leaves the
// turn at the first position not tagged with ONE CAS on its tag slot: the CAS that finds a tag
// instead (its publisher tagged after our read) keeps the turn and rings on.
GPUNET_DEVICE void own_and_ring(const QpRef& c, uint64_t rung, uint64_t r, uint64_t word,
                                uint64_t t) {
  const uint32_t nbbs = c.wqebbs();
  const uint64_t mask = c.mask;
  uint64_t* tags = u64p(c.slot_ready);
  for (;;) {
    // Each step moves r past one reservation; r - rung <= sq_wqebbs (ring space bounds what is
    // reserved ahead of the turn), so the scan ends within sq_wqebbs steps.
    for (uint32_t i = 0; tagged(t, r) && i < nbbs; ++i) {
      r = t;
      word = 0;
      t = arch::load_relaxed(&tags[r & mask]);
    }
    GPUNET_POST_STAMP(2);
    if (r > rung) {
      ring_to(c, r, word);
      // After the doorbell's fence, so an owner that reads db_head == its base (post's fast
      // path) rings after our DBR. An add of what we rang, not a store: nothing orders it before
      // our leave-CAS, so the next owner's update may land first; with adds db_head only grows
      // and reaches a pending reservation's base only once every earlier ring's add landed.
      // (tests/test_ordering.py: heads equal at the end; a store left db_head behind there.)
      arch::atomic_add(&c.qp->db_head, r - rung);
      rung = r;
    }
    GPUNET_DELAY_POINT();
#if defined(GPUNET_TEST_PLAIN_HANDOFF)
    arch::atomic_store(&tags[r & mask], r | kLeft);  // broken on purpose: misses a tag stored now
    GPUNET_POST_STAMP(5);
    return;
#else
    const uint64_t old = arch::atomic_cas(&tags[r & mask], t, r | kLeft);
    GPUNET_POST_STAMP(5);
    if (old == t) return;  // left: the publisher at r finds the marker and takes the turn
#if !defined(GPUNET_TEST_NO_LAP_CHECK)
    // The turn went on without us (header: "The late leave"): what we found belongs to a later
    // lap, and neither taking it as a tag nor overwriting it is ours to do.
    if (passed(old, r, nbbs)) return;
#endif
    t = old;               // tagged meanwhile (ring on), or t was stale (CAS again)
#endif
  }
}
}  // namespace qpd

// ------------------------------------------------------------------------------------------------
// Posting
// ------------------------------------------------------------------------------------------------

// A reservation: [base, base + n) of the ring, and whether its publisher owns the doorbell turn.
struct Resv {
  uint64_t base = 0;
  uint32_t n = 0;
  bool turn = false;    // db_head read == base: every earlier WQE is rung and the turn is ours
  uint64_t t_base = 0;  // tags[base], tags[base + n]: read while the WQEs are written (hints)
  uint64_t t_next = 0;
};

// Step 1: reserve n WQEBBs. The atomic goes out with the load of db_head (one round trip): a
// db_head read before the atomic is at most base (ours is not rung), so reading base means it IS
// base, and nobody else takes the turn at a position whose publisher never tags (the fast path).
GPUNET_DEVICE Resv reserve_start(QpDesc* qp, uint32_t n) {
  Resv v;
  const uint64_t dh = arch::atomic_load(&qp->db_head);
  v.base = arch::atomic_add(&qp->resv_head, uint64_t(n));
  v.n = n;
  v.turn = dh == v.base;
  return v;
}

// Step 2: wait for the reservation's space. `done0`: a done_head read before (relaxed, issued with
// the reservation): a stale one only sends us to the exact check. false only when a failure is
// recorded: the caller then writes and publishes nothing (its slots may still be the NIC's), so
// [base, base + n) stays a hole that nothing after it passes; the host resets the QP
// (QpDescriptor.needs_reset: resv_head != ready_head). A failure seen with room is what post's
// NOP fill is for.
GPUNET_DEVICE bool wait_room(const QpRef& c, const Waiter& w, const Resv& v, uint64_t done0) {
  QpDesc* const qp = c.qp;
  // The WQE stores that follow need the slots' old WQEs read by the NIC: it read them before the
  // CQE that credited done_head (credit_done fences first). A store that depends on the compared
  // value (its address, the branch) is not issued before the load returns.
  const uint32_t nbbs = c.wqebbs();
  if (v.base + v.n <= done0 + nbbs) return true;
  const uint64_t need = v.base + v.n - nbbs;  // done_head must reach this
  uint64_t done = arch::load_acquire_gpu(&qp->done_head);
  if (done >= need) return true;
  Spin spin;
  while (done < need) {
    if (arch::atomic_load(&qp->errored)) return false;
    poll_cq(qp, w);
    done = arch::load_acquire_gpu(&qp->done_head);
    if (done >= need) break;
    if (!spin.keep_going(w, done, qpd::on_qp(qp, SITE_SQ_SPACE, v.base, need))) return false;
  }
  return true;
}

// The tag slots publish() reads, loaded while the WQEs are written (their age does not matter;
// a POST_SERIAL QP has none).
GPUNET_DEVICE void read_hints(const QpRef& c, Resv& v) {
  if (c.mode == POST_SERIAL) return;
  const uint64_t mask = c.mask;
  const uint64_t* tags = qpd::u64p(c.slot_ready);
  v.t_base = arch::load_relaxed(&tags[v.base & mask]);
  v.t_next = arch::load_relaxed(&tags[(v.base + v.n) & mask]);
}

// Step 4 on a POST_SERIAL QP: wait for the turn (bounded; a failure leaves [base, end) unrung,
// and every later wait gives up), ring [base, end) alone, pass the turn on through db_head.
GPUNET_DEVICE void publish_serial(const QpRef& c, const Waiter& w, const Resv& v,
                                  uint64_t last_word0) {
  QpDesc* const qp = c.qp;
  const uint64_t end = v.base + v.n;
  if (!v.turn) {
    Spin spin;
    uint64_t dh = arch::load_acquire_gpu(&qp->db_head);
    while (dh < v.base) {
      if (!spin.keep_going(w, dh, qpd::on_qp(qp, SITE_DOORBELL_TURN, v.base, v.base))) return;
      dh = arch::load_acquire_gpu(&qp->db_head);
    }
  }
  qpd::ring_to(c, end, last_word0);
  arch::atomic_store(&qp->db_head, end);  // after the doorbell's fence (ring_to): the next turn
}

// Step 4 for the reservation v whose WQE words (and slot_nbb) are already stored by this thread
// (or by lanes that then passed a syncwarp with it). `last_word0` is the doorbell word of the
// last WQE. Returns once they are rung or handed to the turn's owner; never waits for another
// thread (POST_BATCHED; a POST_SERIAL QP waits for the posts reserved before it: publish_serial).
GPUNET_DEVICE void publish(const QpRef& c, const Waiter& w, const Resv& v, uint64_t last_word0) {
  if (c.mode == POST_SERIAL) {
    publish_serial(c, w, v, last_word0);
    return;
  }
  const uint64_t mask = c.mask;
  uint64_t* tags = qpd::u64p(c.slot_ready);
  const uint64_t end = v.base + v.n;
  arch::store_relaxed(&qpd::u64p(c.slot_db)[end & mask], last_word0);
  GPUNET_DELAY_POINT();
  if (v.turn) {  // fast path: no tag (nobody looks for one at base), ring
    qpd::own_and_ring(c, v.base, end, last_word0, v.t_next);
    return;
  }
#if !defined(GPUNET_TEST_RELAXED_PUBLISH)
  arch::fence_gpu();  // release: the WQEs, slot_nbb, slot_db before the tag
#endif
  uint64_t e = v.t_base;
  for (;;) {
    if (e == (v.base | qpd::kLeft)) {  // the turn left at base: ours
      qpd::own_and_ring(c, v.base, end, last_word0, v.t_next);
      return;
    }
    const uint64_t old = arch::atomic_cas(&tags[v.base & mask], e, end);
    if (old == e) return;  // tagged before the owner left at base: the owner rings it
    e = old;               // the marker (loop: ours), or e was stale (CAS again)
    GPUNET_DELAY_POINT();
  }
}

// The ctrl segment of WQE `q` at producer index `pi` on this QP (mlx5.cuh's ctrl_seg).
GPUNET_DEVICE mlx5::Seg16 ctrl_of(const QpRef& qr, uint64_t pi, const Wqe& q) {
  return mlx5::ctrl_seg(uint32_t(pi), q.opcode, 0, qr.qpn, q.fm_ce_se, q.ds, 0, 0);
}

// Write a built WQE at counter `base` with its ctrl segment `ctrl` (ctrl_of: this thread's stores,
// one 16-byte store per segment, wrapping per WQEBB) and record its size. Returns its doorbell word.
GPUNET_DEVICE uint64_t write_wqe(const QpRef& qr, uint64_t base, const Wqe& q,
                                 const mlx5::Seg16& ctrl) {
  const uint64_t mask = qr.mask;
  uint64_t* bb = qpd::u64p(qr.sq + (base & mask) * mlx5::WQEBB);
  arch::store_relaxed_v2(bb, ctrl.w[0], ctrl.w[1]);
  if (q.nbb == 1) {  // the common case (RDMA, atomic, short inline): one WQEBB, no wrap
    for (uint32_t i = 1; i < 4; ++i) arch::store_relaxed_v2(bb + 2 * i, q.seg[i].w[0], q.seg[i].w[1]);
  } else {
    for (uint32_t i = 1; i < q.nbb * 4; ++i) {
      uint64_t* p = qpd::u64p(qr.sq + ((base + i / 4) & mask) * mlx5::WQEBB + (i % 4) * mlx5::DS_UNIT);
      arch::store_relaxed_v2(p, q.seg[i].w[0], q.seg[i].w[1]);
    }
  }
  arch::store_relaxed(&qpd::u32p(qr.slot_nbb)[base & mask], q.nbb);
  GPUNET_DELAY_POINT();
  return mlx5::doorbell_word(ctrl);
}
GPUNET_DEVICE uint64_t write_wqe(const QpRef& qr, uint64_t base, const Wqe& q) {
  return write_wqe(qr, base, q, ctrl_of(qr, base, q));
}

// A post that saw a failure after reserving fills its WQEBBs [base + from, base + to) with
// signalled NOPs, `step` apart (1 per thread, warp_size per lane), and still publishes, so the
// ring stays whole and the turn moves on. Returns the doorbell word of the NOP at base + to - 1.
GPUNET_DEVICE uint64_t fill_nops(const QpRef& qr, uint64_t base, uint64_t from, uint64_t to,
                                 uint32_t step) {
  Wqe nop;
  wqe_nop(nop);
  for (uint64_t i = from; i < to; i += step) write_wqe(qr, base + i, nop);
  return mlx5::doorbell_word(ctrl_of(qr, base + to - 1, nop));
}

// What a post checks against the Status and the QP, read with its reservation in flight: records
// posting on a QP in error; true when the post may go on.
GPUNET_DEVICE bool post_allowed(const QpDesc* qp, const Waiter& w, bool st_failed, bool errored,
                                bool record) {
  if (st_failed) return false;
  if (errored) {
    if (record) {
      Failure f(STATUS_QP_ERROR, SITE_POST_ARG);
      f.qpn = qp->qpn;
      f.peer = qp->peer;
      record_failure(w.st, f);
    }
    return false;
  }
  return true;
}

// Post `count` (1 or 2) WQEs as one reservation, in order (put_signal: WRITE then ATOMIC).
// `end` (optional) receives the counter just past the last WQE (for wait_done). A failure seen
// (in the Status, or the QP in error) makes it return false having posted NOPs, or nothing when
// seen before reserving.
GPUNET_DEVICE bool post(const QpRef& qr, const Waiter& w, Wqe* wqes, uint32_t count,
                        uint64_t* end = nullptr) {
  QpDesc* const qp = qr.qp;
  uint32_t n = 0;
  for (uint32_t i = 0; i < count; ++i) n += wqes[i].nbb;
  if (n > qr.wqebbs()) {
    if (!failed(w)) record_bad_argument(w, SITE_POST_ARG, qr.qpn, qp->peer, qr.wqebbs(), n);
    return false;
  }
  // One round trip: the Status, errored, done_head, db_head and the reservation together.
  const bool st_failed = failed(w);
  const bool qp_errored = arch::atomic_load(&qp->errored) != 0;
  const uint64_t done0 = arch::atomic_load(&qp->done_head);
  Resv v = reserve_start(qp, n);
  if (!wait_room(qr, w, v, done0)) return false;  // recorded: every wait gives up, [base, +n) a hole
  read_hints(qr, v);
  const bool ok = post_allowed(qp, w, st_failed, qp_errored, true);
  uint64_t word;
  if (ok) {
    uint64_t at = v.base;
    for (uint32_t i = 0; i < count; ++i) {
      word = write_wqe(qr, at, wqes[i]);
      at += wqes[i].nbb;
    }
  } else {
    word = fill_nops(qr, v.base, 0, n, 1);
  }
  if (end) *end = v.base + n;
  publish(qr, w, v, word);
  return ok;
}
// The same, reading the QP's constants first (a caller that posts once).
GPUNET_DEVICE bool post(QpDesc* qp, const Waiter& w, Wqe* wqes, uint32_t count,
                        uint64_t* end = nullptr) {
  return post(qp_ref(qp), w, wqes, count, end);
}

// The warp's reservation of `total` WQEBBs (post_warp, post_warp_k; all lanes, converged). Lane 0
// makes one round trip for the Status, errored, done_head, db_head and the reservation, and keeps
// `v` for its publish; every lane gets `base` and `ok` (false: a failure was seen, the warp fills
// its reservation with NOPs). Returns false when there is no room: a failure is recorded and every
// wait gives up; [base, +total) stays a hole (its slots may still be the NIC's, so nothing is
// written there).
GPUNET_DEVICE bool reserve_warp(const QpRef& c, const Waiter& w, uint32_t total, Resv& v,
                                uint64_t& base, bool& ok) {
  QpDesc* const qp = c.qp;
  const uint32_t lane = arch::lane_id();
  bool st_failed = false, qp_errored = false, room = true;
  if (lane == 0) {
    st_failed = failed(w);
    qp_errored = arch::atomic_load(&qp->errored) != 0;
    const uint64_t done0 = arch::atomic_load(&qp->done_head);
    v = reserve_start(qp, total);
    room = wait_room(c, w, v, done0);
    read_hints(c, v);
  }
  base = arch::shfl(v.base, 0);
  if (arch::shfl(uint32_t(room), 0) == 0) return false;
  ok = arch::shfl(uint32_t(lane != 0 || post_allowed(qp, w, st_failed, qp_errored, true)), 0) != 0;
  return true;
}

// Warp-cooperative post: every lane of the warp calls it (converged); lane i < nposts posts
// wqe (its own), lanes >= nposts pass a dummy. One reservation for the warp; returns the same
// answer on every lane. Lane 0's chain (one warp alone on the QP, the turn its own): one round
// trip for the reservation (with the Status, errored, done_head, db_head), the WQE stores, the
// ring's two system fences, one round trip for leaving the turn (own_and_ring's CAS).
// A caller that posts in a loop passes a QpRef taken once (qp_ref): no constant is loaded here.
GPUNET_DEVICE bool post_warp(const QpRef& qr, const Waiter& w, Wqe& q, uint32_t nposts) {
  GPUNET_POST_STAMP(7);
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
  if (total == 0) return !failed(w);
  if (total > qr.wqebbs()) {  // warp-uniform; refused before reserving
    if (lane == 0 && !failed(w))
      record_bad_argument(w, SITE_POST_ARG, qr.qpn, qr.qp->peer, qr.wqebbs(), total);
    return false;
  }
  Resv v;
  uint64_t base;
  bool ok;
  if (!reserve_warp(qr, w, total, v, base, ok)) return false;
  GPUNET_POST_STAMP(0);
  uint64_t word;
  if (ok) {
    // The last posting lane's doorbell word goes to lane 0 BEFORE the WQE stores: after them the
    // only collective is the syncwarp whose ordering the publish relies on (and tests check).
    const mlx5::Seg16 ctrl = ctrl_of(qr, base + off, q);
    word = mine ? mlx5::doorbell_word(ctrl) : 0;
    const uint32_t last_lane = (nposts < ws ? nposts : ws) - 1;
    word = arch::shfl(word, last_lane);
    if (mine) write_wqe(qr, base + off, q, ctrl);
  } else {
    word = fill_nops(qr, base, lane, total, ws);
  }
  arch::syncwarp();  // lanes' WQE stores happen-before lane 0's publish (cumulative fences)
  GPUNET_POST_STAMP(1);
  if (lane == 0) publish(qr, w, v, word);
  arch::syncwarp();
  GPUNET_POST_STAMP(6);
  return ok;
}
GPUNET_DEVICE bool post_warp(QpDesc* qp, const Waiter& w, Wqe& q, uint32_t nposts) {
  return post_warp(qp_ref(qp), w, q, nposts);
}

// Warp-cooperative posting of warp_size * k single-WQEBB WQEs with ONE reservation and ONE
// publish (fewer publishes per WQE). Lane l builds WQE j (0 <= j < k) with make(j, wqe) and
// writes it at base + j * warp_size + l, so every store instruction of the warp covers warp_size
// consecutive WQEBBs. All lanes call it converged with the same k (1 <= k, warp_size * k <=
// sq_wqebbs); a WQE of more than one WQEBB is a bad argument.
template <class Make>
GPUNET_DEVICE bool post_warp_k(const QpRef& qr, const Waiter& w, uint32_t k, Make make) {
  const uint32_t lane = arch::lane_id(), ws = arch::warp_size();
  const uint64_t total = uint64_t(ws) * k;
  // The last WQE's doorbell word travels to lane 0 before any WQE store (see post_warp).
  Wqe last;
  make(k - 1, last);
  const bool args_ok = arch::all(k >= 1 && total <= qr.wqebbs() && last.nbb == 1);
  if (!args_ok) {
    if (lane == 0 && !failed(w))
      record_bad_argument(w, SITE_POST_ARG, qr.qpn, qr.qp->peer, qr.wqebbs(), total);
    return false;
  }
  Resv v;
  uint64_t base;
  bool ok;
  if (!reserve_warp(qr, w, uint32_t(total), v, base, ok)) return false;
  uint64_t word;
  if (ok) {
    const mlx5::Seg16 last_ctrl = ctrl_of(qr, base + total - ws + lane, last);
    word = arch::shfl(mlx5::doorbell_word(last_ctrl), ws - 1);
    for (uint32_t j = 0; j < k; ++j) {
      if (j + 1 == k) {
        write_wqe(qr, base + uint64_t(j) * ws + lane, last, last_ctrl);
      } else {
        Wqe q;
        make(j, q);
        write_wqe(qr, base + uint64_t(j) * ws + lane, q);
      }
    }
  } else {
    word = fill_nops(qr, base, lane, total, ws);
  }
  arch::syncwarp();  // every lane's WQE stores happen-before lane 0's publish (cumulative)
  if (lane == 0) publish(qr, w, v, word);
  arch::syncwarp();
  return ok;
}
template <class Make>
GPUNET_DEVICE bool post_warp_k(QpDesc* qp, const Waiter& w, uint32_t k, Make make) {
  return post_warp_k(qp_ref(qp), w, k, make);
}

// ------------------------------------------------------------------------------------------------
// Completion
// ------------------------------------------------------------------------------------------------

// Wait until the WQEBB counter `end` is completed (a specific post: atomic results, reads).
// It rings nothing: every publish sees to its own ring (the doorbell turn), and a helping ring
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
