// gpunet/transport/p2p.cuh — the verbs over a peer mapping (P2P): this rank mapped the PE's
// symmetric heap into its own address space (CUDA IPC on a GPU; on the CPU the soft NIC's arena
// by name), and device threads store into it directly. PeerDesc::remote_base is the PE's heap
// base AS MAPPED IN THIS PROCESS; PeerDesc::rkey carries the P2P_* flags below (a mapping needs
// no key).
//
// The same function set as transport/ibgda.cuh (see there for the list); the guarantees of
// gpunet.cuh's verbs, reached this way:
//   - put: the calling thread (put_nbi), warp (put_nbi_warp) or block (put_nbi_block) copies the
//     bytes itself with 16-byte vector stores where source and destination share 16-byte
//     alignment (else the widest common unit). The data is written when the call returns, so
//     src is reusable at once; visibility at the PE needs the release below (quiet / fence / a
//     signal).
//   - put_signal: payload, then the release (every payload store becomes visible before the
//     signal), then the signal. ADD: fence_sys, then a device CAS loop on the signal word in
//     the NICs' atomic order (api::signal_order: native by default, big-endian with
//     DEVCTX_SIGNAL_BE), so P2P and NIC updates of one word stay atomic with respect to each
//     other; SET: one release store of the value in that order (the release itself; the
//     store-only form the c500 profile allows).
//   - quiet / quiet_pe / fence: fence_sys, the system-scope fence that orders every earlier
//     store of this thread before anything it does later (CUDA fence.acq_rel.sys; MACA
//     __threadfence_system; HOST drains the weak store buffer); quiet to peers whose heaps are
//     all on this GPU: fence_gpu (device scope).
//   - get and atomics: loads / CAS on the peer's memory, allowed only without P2P_STORE_ONLY.
//
// The store-only rule (P2P_STORE_ONLY, set for every p2p peer on the c500 profile): the seed's
// C500 all-reduce doing sustained remote loads over MetaXLink produced AER completion timeouts
// that left GPUs unusable (FACTS.md), so on c500 a p2p peer gets stores only. get_nbi,
// atomic_fetch_add and an ADD signal to such a peer record SITE_P2P_STORE_ONLY (a bad argument,
// raised on the host as ConfigError naming the way out: SET signals, or a NIC transport for that
// peer) and touch nothing. tests/test_p2p.py::test_c500_store_only_rule_refuses_get_and_add.
//
// Bounds: every access is checked against the symmetric heap's size (all heaps have the same
// size, gpunet/context.py checks it), since no NIC checks a key here; an access outside records
// SITE_P2P_RANGE and touches nothing.
#pragma once

#include <stdint.h>

#include "../arch.cuh"
#include "../devctx.cuh"
#include "../status.cuh"

namespace gpunet {

namespace transport {

struct P2p {
  // The PE's copy of symmetric `sym`, in this process.
  static GPUNET_DEVICE uint8_t* mapped(const DevCtx& ctx, const PeerDesc& p, const void* sym) {
    return reinterpret_cast<uint8_t*>(uintptr_t(api::remote(ctx, p, sym)));
  }

  // [sym, sym + nbytes) inside the symmetric heap (8-byte aligned when `word`), else record it.
  static GPUNET_DEVICE bool in_heap(const DevCtx& ctx, const Waiter& w, int pe, const void* sym,
                                    uint64_t nbytes, bool word = false) {
    const uint64_t off = api::heap_off(ctx, sym);
    if (off <= ctx.heap_bytes && nbytes <= ctx.heap_bytes - off && !(word && (off & 7))) return true;
    Failure f(STATUS_BAD_ARGUMENT, SITE_P2P_RANGE);
    f.peer = uint32_t(pe);
    f.addr = uint64_t(uintptr_t(sym));
    f.expected = ctx.heap_bytes;
    f.observed = off;
    record_failure(w.st, f);
    return false;
  }

  // The store-only rule: false (and recorded) for a load or an atomic to a P2P_STORE_ONLY peer.
  // `what`: 1 get, 2 atomic_fetch_add, 3 ADD signal (lands in Status::observed).
  static GPUNET_DEVICE bool may_load(const Waiter& w, const PeerDesc& p, int pe, uint32_t what) {
    if (!(p.rkey & P2P_STORE_ONLY)) return true;
    record_bad_argument(w, SITE_P2P_STORE_ONLY, 0, uint32_t(pe), 0, what);
    return false;
  }

  // Thread `me` of `count` cooperating threads copies its share of [src, src + n) to dst, in
  // units of U bytes (dst and src both U-aligned at `head`): thread i takes units i, i + count,
  // ... so a warp's stores are contiguous.
  struct alignas(16) V2 {
    uint64_t a, b;
  };
  // Plain = false: the stores are store_relaxed(_v2) (volatile: strong at system scope on CUDA);
  // Plain = true: store_weak_v2 for the 16-byte units, the weak vector store a copy kernel uses
  // (only the host-resolved bulk put, whose visibility is the kernel's end, takes it; which one
  // is faster is measured by bench/p2p.py's copy sweep).
  template <bool Plain = false, class T>
  static GPUNET_DEVICE void store_unit(uint8_t* dst, uint64_t i, const T& v) {
    if constexpr (sizeof(T) == 16 && Plain)
      arch::store_weak_v2(reinterpret_cast<uint64_t*>(dst) + 2 * i, v.a, v.b);
    else if constexpr (sizeof(T) == 16)
      arch::store_relaxed_v2(reinterpret_cast<uint64_t*>(dst) + 2 * i, v.a, v.b);
    else
      arch::store_relaxed(reinterpret_cast<T*>(dst) + i, v);
  }
  // Rounds of Unroll units per thread: the loads of a round are issued before its stores, so a
  // thread has Unroll loads in flight instead of one (the stores are volatile asm with a memory
  // clobber: nothing moves across them, and one load per store would expose the whole load
  // latency per unit; bench/p2p.py measures the bandwidth this buys, and its copy sweep the
  // bulk put's Unroll 4 vs 8).
  static constexpr uint32_t kUnroll = 4;
  template <class T, uint32_t Unroll = kUnroll, bool Plain = false>
  static GPUNET_DEVICE void copy_units(uint8_t* dst, const uint8_t* src, uint64_t n, uint32_t me,
                                       uint32_t count) {
    const uint64_t units = n / sizeof(T);
    const T* s = reinterpret_cast<const T*>(src);
    uint64_t i = me;
    for (; i + (Unroll - 1) * uint64_t(count) < units; i += Unroll * uint64_t(count)) {
      T v[Unroll];
#pragma unroll
      for (uint32_t u = 0; u < Unroll; ++u) v[u] = s[i + u * uint64_t(count)];
#pragma unroll
      for (uint32_t u = 0; u < Unroll; ++u) store_unit<Plain>(dst, i + u * uint64_t(count), v[u]);
    }
    // the last partial round (fewer than Unroll units left for this thread): guarded, but still
    // every load before the first store
    if (i < units) {
      T v[Unroll];
#pragma unroll
      for (uint32_t u = 0; u < Unroll; ++u)
        if (i + u * uint64_t(count) < units) v[u] = s[i + u * uint64_t(count)];
#pragma unroll
      for (uint32_t u = 0; u < Unroll; ++u)
        if (i + u * uint64_t(count) < units) store_unit<Plain>(dst, i + u * uint64_t(count), v[u]);
    }
  }
  static GPUNET_DEVICE void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n, uint32_t me,
                                       uint32_t count) {
    for (uint64_t i = me; i < n; i += count) arch::store_relaxed(dst + i, src[i]);
  }
  // The cooperative copy every put and get uses: bytes up to dst's alignment of the widest unit
  // dst and src share that is not wider than n, that unit (16 bytes when they share 16-byte
  // alignment: one vector store), then the tail bytes.
  template <uint32_t Unroll = kUnroll, bool Plain = false>
  static GPUNET_DEVICE void copy(uint8_t* dst, const uint8_t* src, uint64_t n, uint32_t me,
                                 uint32_t count) {
    // One thread, one or two 8-byte-aligned words (a flag, a value, an index: the small puts a
    // kernel makes between waits): both loads, then both stores, without the alignment ladder
    // below, whose integer work sits between a wait's acquire and the signal.
    if (count == 1 && (n == 8 || n == 16) && ((uintptr_t(dst) | uintptr_t(src)) & 7) == 0) {
      const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
      uint64_t* d = reinterpret_cast<uint64_t*>(dst);
      const uint64_t a = s[0], b = n == 16 ? s[1] : 0;
      arch::store_relaxed(d, a);
      if (n == 16) arch::store_relaxed(d + 1, b);
      return;
    }
    const uintptr_t mis = uintptr_t(dst) ^ uintptr_t(src);
    uint32_t unit = (mis & 15) == 0 ? 16 : (mis & 7) == 0 ? 8 : (mis & 3) == 0 ? 4
                    : (mis & 1) == 0 ? 2 : 1;
    while (unit > n && unit > 1) unit >>= 1;  // 8 bytes are one 8-byte store, not 8 byte stores
    uint64_t head = (unit - (uintptr_t(dst) & (unit - 1))) & (unit - 1);
    if (head > n) head = n;
    const uint64_t body = (n - head) & ~uint64_t(unit - 1);
    copy_bytes(dst, src, head, me, count);
    uint8_t* d = dst + head;
    const uint8_t* s = src + head;
    switch (unit) {
      case 16: copy_units<V2, Unroll, Plain>(d, s, body, me, count); break;
      case 8: copy_units<uint64_t>(d, s, body, me, count); break;
      case 4: copy_units<uint32_t>(d, s, body, me, count); break;
      case 2: copy_units<uint16_t>(d, s, body, me, count); break;
      default: copy_bytes(d, s, body, me, count); break;
    }
    copy_bytes(d + body, s + body, n - head - body, me, count);
  }

  // The Status word is read FIRST and its value used last: its load is in flight with the
  // source's, not one more memory round trip after the stores (a p2p put's latency is a chain
  // of such round trips: bench/p2p.py's ping-pong). A failure recorded meanwhile by another
  // thread is seen by this thread's next call or wait.
  // The bulk put whose peer mapping the HOST resolved (ops.cu k_put_p2p; gpunet/_launch.py
  // checked the range against the peer's live allocation and took `dst` from the PeerDesc's
  // remote_base): block b of the grid copies chunks b, b + blocks, ... of `chunk` bytes (a
  // multiple of 256, so every chunk keeps the put's alignment) of [src, src + n) to dst, its
  // threads together (copy). It reads nothing but the source: no DevCtx, no PeerDesc, no Status
  // (a copy between two valid ranges cannot fail), and it ends without a fence: a grid's
  // memory operations are performed before its stream sees it complete, and that completion is
  // what quiet (a stream synchronisation) waits for. Each of those reads or a fence was one more
  // memory round trip per put in the H200's 4.3 us vs 2.2 us for cudaMemcpyAsync of 4 KiB.
  template <uint32_t Unroll, bool Plain>
  static GPUNET_DEVICE void copy_grid(uint8_t* dst, const uint8_t* src, uint64_t n,
                                      uint64_t chunk) {
    const arch::Dim3 g = arch::grid_dim(), b = arch::block_idx(), bd = arch::block_dim();
    const uint64_t blocks = uint64_t(g.x) * g.y * g.z;
    const uint64_t me = b.x + uint64_t(g.x) * (b.y + uint64_t(g.y) * b.z);
    const uint32_t threads = bd.x * bd.y * bd.z, t = arch::thread_rank();
    for (uint64_t off = me * chunk; off < n; off += blocks * chunk) {
      const uint64_t len = n - off < chunk ? n - off : chunk;
      copy<Unroll, Plain>(dst + off, src + off, len, t, threads);
    }
  }

  static GPUNET_DEVICE bool put_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst_sym, const void* src, uint64_t nbytes) {
    const bool was_failed = failed(w);
    if (!in_heap(ctx, w, pe, dst_sym, nbytes)) return false;
    copy(mapped(ctx, p, dst_sym), static_cast<const uint8_t*>(src), nbytes, 0, 1);
    return !was_failed;
  }

  // Every put reads its source before it returns: the inline promise holds as is.
  static GPUNET_DEVICE bool put_inline_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src,
                                           uint32_t nbytes) {
    return put_nbi(ctx, w, p, pe, dst_sym, src, nbytes);
  }

  // Loads from the peer's memory (nvidia profile); dst holds the data on return.
  static GPUNET_DEVICE bool get_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst, const void* src_sym, uint64_t nbytes) {
    if (!may_load(w, p, pe, 1) || !in_heap(ctx, w, pe, src_sym, nbytes)) return false;
    copy(static_cast<uint8_t*>(dst), mapped(ctx, p, src_sym), nbytes, 0, 1);
    return !failed(w);
  }

  // `add` on the word at `word`, a number in the NICs' atomic order (api::signal_order), by CAS
  // (atomic with the NIC's atomics on it, which use CAS as well); returns the old value. A retry
  // is progress elsewhere, so the loop is bounded like any wait (a word that changes forever
  // records a timeout).
  static GPUNET_DEVICE bool add_word(const DevCtx& ctx, const Waiter& w, int pe, uint64_t* word,
                                     uint64_t add, uint64_t* old) {
    uint64_t cur = arch::atomic_load(word);
    Spin spin;
    spin.progress = false;
    for (;;) {
      const uint64_t next = api::signal_order(ctx, api::signal_order(ctx, cur) + add);
      const uint64_t got = arch::atomic_cas(word, cur, next);
      if (got == cur) break;
      cur = got;
      if (!spin.keep_going(w, api::signal_order(ctx, cur), [&](Failure& f) {
            f.site = SITE_ATOMIC;
            f.peer = uint32_t(pe);
            f.addr = uint64_t(uintptr_t(word));
          }))
        return false;
    }
    *old = api::signal_order(ctx, cur);
    return true;
  }

  // The release between a put_signal's payload and its signal (SET: the signal is a release
  // store; ADD: a fence before the CAS). Rule: a peer that sees the signal sees the whole
  // payload, for every order in which the weak model drains the payload stores
  // (tests/test_weak_signal.py, with hypothesis choosing each pop). Scope: system, or device
  // for a PE whose heap is on this GPU (P2P_SAME_DEVICE: ranks sharing one GPU, where the
  // device's L2 is the point of coherence for both; a system-scope release cost ~1.3 us on the
  // H200, two per round trip: bench/p2p.py). GPUNET_TEST_P2P_NO_SIGNAL_RELEASE compiles the
  // release out, for that test's fence-removal variant ONLY, which must then show the signal
  // before the payload.
#if defined(GPUNET_TEST_P2P_NO_SIGNAL_RELEASE)
  static GPUNET_DEVICE void signal_release(const PeerDesc&) {}
  static GPUNET_DEVICE void signal_store(const PeerDesc&, uint64_t* sig, uint64_t v) {
    arch::store_relaxed(sig, v);
  }
#else
  static GPUNET_DEVICE void signal_release(const PeerDesc& p) {
    if (p.rkey & P2P_SAME_DEVICE)
      arch::fence_gpu();
    else
      arch::fence_sys();
  }
  static GPUNET_DEVICE void signal_store(const PeerDesc& p, uint64_t* sig, uint64_t v) {
    if (p.rkey & P2P_SAME_DEVICE)
      arch::store_release_gpu(sig, v);
    else
      arch::store_release_sys(sig, v);
  }
#endif

  static GPUNET_DEVICE bool put_signal_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src, uint64_t nbytes,
                                           uint64_t* sig_sym, uint64_t value, uint32_t sig_op) {
    const bool was_failed = failed(w);  // read first, used before the signal (see put_nbi)
    if (sig_op != SIGNAL_SET && !may_load(w, p, pe, 3)) return false;
    if (!in_heap(ctx, w, pe, sig_sym, 8, true) || !in_heap(ctx, w, pe, dst_sym, nbytes))
      return false;
    copy(mapped(ctx, p, dst_sym), static_cast<const uint8_t*>(src), nbytes, 0, 1);
    if (was_failed) return false;  // no signal once the context failed: the waiter fails too
    uint64_t* sig = reinterpret_cast<uint64_t*>(mapped(ctx, p, sig_sym));
    if (sig_op == SIGNAL_SET) {
      // a release store: the payload stores before it (and, being cumulative, those other
      // threads made before a barrier with this one) are visible before it; one release per
      // signal, not a fence and then a release, and no Status read after it (bench/p2p.py's
      // round trip)
      signal_store(p, sig, api::signal_order(ctx, value));
      return true;
    }
    signal_release(p);  // the CAS is a relaxed RMW: this fence orders the payload before it
    uint64_t old = 0;
    return add_word(ctx, w, pe, sig, value, &old);
  }

  static GPUNET_DEVICE bool atomic_fetch_add(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                             int pe, uint64_t* sym_addr, uint64_t v,
                                             uint64_t* result, uint64_t* old) {
    (void)result;  // the old value comes back from the CAS itself
    if (!may_load(w, p, pe, 2) || !in_heap(ctx, w, pe, sym_addr, 8, true)) return false;
    arch::fence_sys();  // ordered after this thread's earlier stores to the PE, as on a QP
    return add_word(ctx, w, pe, reinterpret_cast<uint64_t*>(mapped(ctx, p, sym_addr)), v, old);
  }

  // quiet's fence has the scope the peers need: device scope when every p2p peer's heap is on
  // this GPU (P2P_SAME_DEVICE, as for signals), else system scope.
  static GPUNET_DEVICE bool quiet_pe(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe) {
    (void)ctx, (void)pe;
    if (p.rkey & P2P_SAME_DEVICE)
      arch::fence_gpu();
    else
      arch::fence_sys();
    return !failed(w);
  }

  // One fence covers every p2p peer (only when there is one: other worlds pay nothing).
  static GPUNET_DEVICE bool quiet_all(const DevCtx& ctx, const Waiter& w) {
    const PeerDesc* peers = api::peers(ctx);
    bool any = false, other_device = false;
    for (uint32_t pe = 0; pe < ctx.npes && !other_device; ++pe) {
      if (peers[pe].kind == TRANSPORT_P2P) {
        any = true;
        other_device = !(peers[pe].rkey & P2P_SAME_DEVICE);
      }
    }
    if (other_device)
      arch::fence_sys();
    else if (any)
      arch::fence_gpu();
    return !failed(w);
  }

  // Collective (every thread of the block, same arguments): the block's threads copy together,
  // thread t of T taking 16-byte units t, t + T, ... (contiguous stores per round, kUnroll rounds
  // of loads in flight). Returns the same bool on every thread (one block_any).
  static GPUNET_DEVICE bool put_nbi_block(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                          int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    const arch::Dim3 bd = arch::block_dim();
    const uint64_t off = api::heap_off(ctx, dst_sym);
    const bool ok = off <= ctx.heap_bytes && nbytes <= ctx.heap_bytes - off;
    if (!ok) {
      if (arch::thread_rank() == 0) in_heap(ctx, w, pe, dst_sym, nbytes);
    } else {
      copy(mapped(ctx, p, dst_sym), static_cast<const uint8_t*>(src), nbytes, arch::thread_rank(),
           bd.x * bd.y * bd.z);
    }
    return !arch::block_any(failed(w));
  }

  // Collective (every lane, same arguments): the lanes copy together, lane i taking 16-byte
  // units i, i + warp_size, ... (contiguous stores per round).
  static GPUNET_DEVICE bool put_nbi_warp(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                         int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    const uint64_t off = api::heap_off(ctx, dst_sym);
    const bool ok = off <= ctx.heap_bytes && nbytes <= ctx.heap_bytes - off;
    if (!ok) {
      if (arch::lane_id() == 0) in_heap(ctx, w, pe, dst_sym, nbytes);
      arch::syncwarp();
      return false;
    }
    copy(mapped(ctx, p, dst_sym), static_cast<const uint8_t*>(src), nbytes, arch::lane_id(),
         arch::warp_size());
    return arch::all(!failed(w));
  }
};

}  // namespace transport
}  // namespace gpunet
