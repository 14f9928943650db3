// gpunet/gpunet.cuh — the user device API: one-sided puts, gets, signals and atomics on a
// symmetric heap, from inside any kernel (DESIGN.md "C++ device API").
//
//   #include <gpunet/gpunet.cuh>
//   __global__ void k(gpunet::DevCtx* ctx, ...) {
//     gpunet::put_nbi(*ctx, dst_sym, src, nbytes, pe);
//     gpunet::quiet(*ctx);
//   }
//
// Addresses: `*_sym` arguments are addresses in the LOCAL symmetric heap [local_base, local_base +
// heap_bytes); the same offset on PE `pe` is remote_base[pe] + (sym - local_base). Local source /
// destination buffers of puts and gets must lie in the local heap as well (its lkey covers it).
//
// Completion and ordering (every function says which it gives):
//   - *_nbi returns once the operation is queued (WQEs written, published, and rung or left for a
//     later ring that is guaranteed to happen, see qp.cuh). The source of a put must not change,
//     and the destination of a get must not be read, until quiet().
//   - quiet(ctx): every operation this CALLING THREAD issued before it (and everything any thread
//     published on the same QPs before it) has completed at the NIC: puts are visible at the
//     target, gets have landed, signals and atomics are done.
//   - fence(ctx): puts, put_signals and atomics to the SAME PE are delivered in issue order
//     whether or not fence is called: one RC QP per PE, executed in order, signalled WQEs
//     completing in order. fence therefore posts nothing; it only orders this thread's earlier
//     device stores (e.g. to a put's source) before its later posts (a fence_sys). Across PEs
//     there is no ordering short of quiet().
//   - Signals: a signal word is an 8-byte number updated by the NIC's ATOMIC fetch-add (p2p: a
//     device CAS) in the NICs' atomic order (Nic.atomic_endianness): NATIVE by default (the mlx5
//     host-endian atomic mode), so a host or torch reads sig[0] as is; big-endian (the IB wire
//     order) when the context has DEVCTX_SIGNAL_BE. wait_until / signal_read / atomic_fetch_add
//     convert per the context (api::signal_order); gpunet.read_signal on the host does too.
//     Initialise signal words to 0 (the same in both orders).
//   - Every call returns bool (or a value plus `ok`): false means a failure was recorded in the
//     context's Status block (first failure wins); the host raises it after the kernel. Once any
//     failure is recorded every later call returns false quickly, so the grid drains.
//   - Size 0: put_nbi / get_nbi / put_nbi_warp post nothing and return true (after the same
//     argument checks). put_signal_nbi with 0 bytes posts only the signal's atomic.
//
// Transports: each PE has one explicit kind (PeerDesc::kind, devctx.cuh). Every verb that names a
// PE (by number, or by a PeerRef: peer_ref below) checks it (api::take) and then dispatches ONCE
// (dispatch() below, one switch) to the transport's function of the same name:
// transport/ibgda.cuh (GPU-initiated posting) or transport/proxy.cuh (a CPU proxy posts) or
// transport/p2p.cuh (stores into the PE's heap mapped here; on the c500 profile stores only:
// get, atomics and ADD signals to such a PE fail). Code above this header — ops kernels, EP
// kernels, user kernels — includes gpunet.cuh only (tests/test_include_rule.py), so the
// transports can change beneath it.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "devctx.cuh"
#include "status.cuh"
#include "transport/ibgda.cuh"
#include "transport/p2p.cuh"
#include "transport/proxy.cuh"

namespace gpunet {

// The one transport dispatch: op(T{}) for the transport T of `kind`. api::peer admits only the
// kinds listed here that this unit was built with (devctx.cuh GPUNET_TRANSPORTS), so the final
// return is never taken. A new transport adds a case here and a line in
// all_transports.
template <class Op>
GPUNET_DEVICE auto dispatch(uint32_t kind, Op op) -> decltype(op(transport::Ibgda{})) {
  switch (kind) {
    case TRANSPORT_IBGDA:
      if constexpr (transport_built(TRANSPORT_IBGDA)) return op(transport::Ibgda{});
      break;
    case TRANSPORT_PROXY:
      if constexpr (transport_built(TRANSPORT_PROXY)) return op(transport::Proxy{});
      break;
    case TRANSPORT_P2P:
      if constexpr (transport_built(TRANSPORT_P2P)) return op(transport::P2p{});
      break;
    default: break;
  }
  return decltype(op(transport::Ibgda{}))();
}
// op(T{}) for every transport (verbs without a peer: quiet); true iff all returned true.
template <class Op>
GPUNET_DEVICE bool all_transports(Op op) {
  bool ok = true;
  if constexpr (transport_built(TRANSPORT_IBGDA)) ok = op(transport::Ibgda{}) && ok;
  if constexpr (transport_built(TRANSPORT_PROXY)) ok = op(transport::Proxy{}) && ok;
  if constexpr (transport_built(TRANSPORT_P2P)) ok = op(transport::P2p{}) && ok;
  return ok;
}

// ---- peers -----------------------------------------------------------------------------------

// Every verb below that names a PE takes its number `pe` or a PeerRef from peer_ref(ctx, pe): the
// PE's descriptor copied into the caller's registers, once. With the number, each call loads the
// PeerDesc from device memory before anything else it does, and after a wait's acquire (which
// empties L1) that load is one more L2 round trip in front of the source's: a kernel that waits
// and then puts, over and over, takes the PeerRef once (bench/p2p.py's ping-pong, mode 8). The
// PeerRef is valid for the kernel that took it. A bad pe is recorded here (as a verb records it)
// and the PeerRef's verbs then return false.
GPUNET_DEVICE PeerRef peer_ref(const DevCtx& ctx, int pe) {
  PeerRef r{};
  const PeerDesc* p = api::peer(ctx, api::waiter(ctx), pe);
  r.pe = p ? pe : -1;
  if (p) r.desc = *p;
  return r;
}

// ---- puts and gets ---------------------------------------------------------------------------

// RDMA WRITE of [src, src+nbytes) (local heap) to dst_sym on `pe`. Non-blocking: complete at
// quiet(); src must stay unchanged until then. In order with earlier ops to the same pe.
template <class PE>
GPUNET_DEVICE bool put_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  return p && dispatch(p->kind, [&](auto t) { return t.put_nbi(ctx, w, *p, a.pe, dst_sym, src, nbytes); });
}

// RDMA WRITE with the payload copied into the WQE (nbytes <= kMaxInline): src may be reused as
// soon as it returns. Delivery: at quiet(), in order with earlier ops to the same pe.
template <class PE>
GPUNET_DEVICE bool put_inline_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint32_t nbytes,
                                  const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  return p && dispatch(p->kind, [&](auto t) {
           return t.put_inline_nbi(ctx, w, *p, a.pe, dst_sym, src, nbytes);
         });
}

// RDMA READ of src_sym on `pe` into [dst, dst+nbytes) (local heap). Non-blocking: dst holds the
// data after quiet().
template <class PE>
GPUNET_DEVICE bool get_nbi(const DevCtx& ctx, void* dst, const void* src_sym, uint64_t nbytes, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  return p && dispatch(p->kind, [&](auto t) { return t.get_nbi(ctx, w, *p, a.pe, dst, src_sym, nbytes); });
}

// put then signal: the payload, then the signal on the 8-byte word sig_sym on `pe`: SIGNAL_ADD
// adds `value` (ATOMIC fetch-add; p2p: a device CAS), SIGNAL_SET stores it (an 8-byte RDMA WRITE;
// p2p: a release store; one writer per word, the store-only form c500 p2p peers allow). The NIC
// transports post both as one reservation on the pe's QP (or channel). A receiver that sees the
// signal reach k (wait_until) sees every payload put to it before that signal (in-order RC
// execution; p2p: a system fence between payload and signal). Non-blocking.
template <class PE>
GPUNET_DEVICE bool put_signal_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes,
                                  uint64_t* sig_sym, uint64_t value, const PE& pe,
                                  uint32_t sig_op = SIGNAL_ADD) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  return p && dispatch(p->kind, [&](auto t) {
           return t.put_signal_nbi(ctx, w, *p, a.pe, dst_sym, src, nbytes, sig_sym, value, sig_op);
         });
}

// ---- atomics and signals ---------------------------------------------------------------------

// Blocking 8-byte fetch-add of any 64-bit `v` (two's complement: -1 decrements) on sym_addr at
// `pe` (a number in the NICs' atomic order there, see the header comment). Returns the old value;
// *ok = false (and 0 returned) on failure. Ordered after earlier ops to
// the same pe; complete (and visible) when it returns. Uses the result slot of this thread
// (global thread id modulo ctx.scratch_slots): the context needs at least as many slots as
// threads that may call it at the same time.
template <class PE>
GPUNET_DEVICE uint64_t atomic_fetch_add(const DevCtx& ctx, uint64_t* sym_addr, uint64_t v, const PE& pe,
                                        bool* ok = nullptr) {
  const Waiter w = api::waiter(ctx);
  if (ok) *ok = false;
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  if (!p) return 0;
  uint64_t* result = api::result_slot(ctx);
  uint64_t old = 0;
  if (!dispatch(p->kind, [&](auto t) {
        return t.atomic_fetch_add(ctx, w, *p, a.pe, sym_addr, v, result, &old);
      }))
    return 0;
  if (ok) *ok = true;
  return old;
}

// The value of a signal word (in the NICs' atomic order in memory, see the header comment), with
// acquire: data the signalling peer put before the signal is visible after it.
GPUNET_DEVICE uint64_t signal_read(const DevCtx& ctx, const uint64_t* sig_addr) {
  return api::signal_order(ctx, arch::load_acquire_sys(sig_addr));
}

namespace api {
GPUNET_DEVICE bool compare(uint64_t v, uint32_t cmp, uint64_t value) {
  switch (cmp) {
    case CMP_EQ: return v == value;
    case CMP_NE: return v != value;
    case CMP_GE: return v >= value;
    case CMP_GT: return v > value;
    case CMP_LE: return v <= value;
    default: return v < value;
  }
}
}  // namespace api

// Polls of a wait_until before it pauses between polls (status.cuh Spin::fast): about 0.3-0.5 ms
// on a GPU (a poll is one round trip to L2), so a signal that comes within a round trip's
// latency is seen at once; a longer wait backs off and leaves issue slots to other warps.
// HOST arm: 0, a pause from the first poll: there a pause is where the waiting CPU thread runs
// the progress hooks and yields its core to the thread that will write the word (on 2 cores the
// peer rank's caller; bench/cpu_put.py's ping-pong).
#if defined(GPUNET_ARM_HOST)
constexpr uint32_t kWaitFastPolls = 0;
#else
constexpr uint32_t kWaitFastPolls = 1024;
#endif

namespace api {
// What a timed-out wait_until records (the host names the word by its heap offset). Also used by
// waits built on signal_read with their own bound (ep/ll.cuh wait_peer).
GPUNET_DEVICE void describe_wait(Failure& f, const DevCtx& ctx, const uint64_t* sig_addr,
                                 uint32_t cmp, uint64_t value) {
  f.site = SITE_WAIT_UNTIL;
  f.addr = uint64_t(uintptr_t(sig_addr));
  const uint64_t off = heap_off(ctx, sig_addr);
  f.heap_off = off < ctx.heap_bytes ? off : NO_HEAP_OFF;
  f.cmp = cmp;
  f.expected = value;
}
}  // namespace api

// Wait (bounded by ctx.timeout_ns) until signal_read(ctx, sig_addr) `cmp` value holds. true when it
// holds; false on timeout or an earlier failure. A timeout records what waited: SITE_WAIT_UNTIL,
// the word's address and heap offset, the comparison, expected = value, observed = the last value
// read, no QP and no peer. After true, everything the signaller put before the signal is visible
// to this thread (acquire). A local word: no transport is involved.
GPUNET_DEVICE bool wait_until(const DevCtx& ctx, const uint64_t* sig_addr, uint32_t cmp, uint64_t value) {
  const Waiter w = api::waiter(ctx);
  Spin spin;
  spin.progress = false;  // a user's word under any comparison: a plain bound (status.cuh Spin)
  spin.fast = kWaitFastPolls;
  uint64_t v = signal_read(ctx, sig_addr);
  while (!api::compare(v, cmp, value)) {
    if (!spin.keep_going(w, v, [&](Failure& f) { api::describe_wait(f, ctx, sig_addr, cmp, value); }))
      return false;
    v = signal_read(ctx, sig_addr);
  }
  return true;
}

// ---- completion and ordering -----------------------------------------------------------------

// Complete every operation issued before it to every PE (see the header comment): each transport
// quiets all of its peers. Blocking, bounded. true iff all completed without error.
GPUNET_DEVICE bool quiet(const DevCtx& ctx) {
  const Waiter w = api::waiter(ctx);
  const bool ok = all_transports([&](auto t) { return t.quiet_all(ctx, w); });
  return ok && !failed(w);
}

// Complete every operation issued before it to `pe` only.
template <class PE>
GPUNET_DEVICE bool quiet_pe(const DevCtx& ctx, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe);
  const PeerDesc* p = a.p;
  return p && dispatch(p->kind, [&](auto t) { return t.quiet_pe(ctx, w, *p, pe); });
}

// Ordering point for later puts after earlier ones (see the header comment: per-PE order already
// holds; this orders the thread's own earlier device stores before its later posts).
GPUNET_DEVICE bool fence(const DevCtx& ctx) {
  arch::fence_sys();
  return !failed(api::waiter(ctx));
}

// ---- direct access (NVSHMEM's nvshmem_ptr) ---------------------------------------------------

namespace api {
template <class T>
struct maps_peer {  // the transports whose PE heap is mapped into this process
  static constexpr bool value = false;
};
template <>
struct maps_peer<transport::P2p> {
  static constexpr bool value = true;
};
// ptr()'s address of `sym` on the peer p resolved to (nullptr: none, or not mapped here)
GPUNET_DEVICE void* mapped(const DevCtx& ctx, const PeerDesc* p, const void* sym) {
  if (!p || heap_off(ctx, sym) >= ctx.heap_bytes) return nullptr;
  return dispatch(p->kind, [&](auto t) -> void* {
    if constexpr (maps_peer<decltype(t)>::value)
      return reinterpret_cast<void*>(uintptr_t(remote(ctx, *p, sym)));
    else
      return nullptr;
  });
}
}  // namespace api

// The address at which this thread may store to symmetric `sym` on `pe` itself (and load from it,
// except on a P2P_STORE_ONLY peer), when that PE's heap is mapped here (a p2p peer); nullptr for a
// NIC peer (only the verbs reach it), a bad pe or an address outside the heap (nothing recorded).
// Plain stores through it are like a p2p put's: visible at the PE after fence / quiet / a signal
// to it. Kernels that move rows use it to skip staging: the source need not be in the heap.
template <class PE>
GPUNET_DEVICE void* ptr(const DevCtx& ctx, const void* sym, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  return api::mapped(ctx, api::take(ctx, w, pe, false).p, sym);
}

// The address at which this thread may LOAD from symmetric `sym` on `pe` (nvshmem_ptr's use):
// ptr()'s, except nullptr on a P2P_STORE_ONLY peer (the c500 profile: remote loads are what
// faulted there). Plain loads through it see what the PE made visible to this one (its signal
// after its stores, or its kernel boundary) and nothing newer is promised.
template <class PE>
GPUNET_DEVICE const void* ptr_load(const DevCtx& ctx, const void* sym, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe, false);
  if (!a.p || (a.p->kind == TRANSPORT_P2P && (a.p->rkey & P2P_STORE_ONLY))) return nullptr;
  return api::mapped(ctx, a.p, sym);
}

// ---- warp and block variants -----------------------------------------------------------------

// Every lane of the warp calls it with the same arguments (converged). ibgda: the put is split in
// up to warp_size chunks of >= GPUNET_WARP_MIN_CHUNK bytes, one WQE per lane, posted with ONE
// reservation (qp.cuh post_warp); proxy: lane 0 pushes one command. Same guarantees as put_nbi;
// returns the same bool on all lanes.
template <class PE>
GPUNET_DEVICE bool put_nbi_warp(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes, const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe, false);
  const PeerDesc* p = a.p;
  if (!p) {
    if (arch::lane_id() == 0) api::take(ctx, w, pe);  // records the bad argument once
    arch::syncwarp();
    return false;
  }
  if (nbytes == 0) return arch::all(!failed(w));
  return dispatch(p->kind, [&](auto t) { return t.put_nbi_warp(ctx, w, *p, a.pe, dst_sym, src, nbytes); });
}

// Every thread of the block calls it with the same arguments (converged; it contains a block
// barrier). p2p: the block's threads copy together with 16-byte stores (the bulk form the host
// wrapper's large puts and EP-style kernels use); ibgda: one piece per warp, each posted with
// put_nbi_warp; proxy: thread 0 pushes one command. Same guarantees as put_nbi; returns the same
// bool on every thread of the block.
template <class PE>
GPUNET_DEVICE bool put_nbi_block(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes,
                                 const PE& pe) {
  const Waiter w = api::waiter(ctx);
  const api::PeerArg a = api::take(ctx, w, pe, false);
  const PeerDesc* p = a.p;
  if (!p) {
    if (arch::thread_rank() == 0) api::take(ctx, w, pe);  // records the bad argument once
    return !arch::block_any(true);
  }
  if (nbytes == 0) return !arch::block_any(failed(w));
  return dispatch(p->kind, [&](auto t) { return t.put_nbi_block(ctx, w, *p, a.pe, dst_sym, src, nbytes); });
}

}  // namespace gpunet
