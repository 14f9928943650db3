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
//   - Signals: a signal word is updated by the NIC's 8-byte ATOMIC fetch-add, which treats memory
//     as a BIG-ENDIAN number (as on the IB wire and real HCAs). wait_until / signal_read convert;
//     a host reading a signal must bswap too. Initialise signal words to 0 (same in both orders).
//   - Every call returns bool (or a value plus `ok`): false means a failure was recorded in the
//     context's Status block (first failure wins); the host raises it after the kernel. Once any
//     failure is recorded every later call returns false quickly, so the grid drains.
//   - Size 0: put_nbi / get_nbi / put_nbi_warp post nothing and return true (after the same
//     argument checks). put_signal_nbi with 0 bytes posts only the signal's atomic.
#pragma once

#include <stdint.h>

#include "proxy.cuh"
#include "qp.cuh"

namespace gpunet {

// How one PE is reached: by GPU-initiated posting on a QP (ibgda) or through a CPU proxy
// channel (proxy) — DESIGN.md "Transports under one device API". Exactly one of `qp` / `proxy`
// is set; both 0: unreachable. 32 B. abi.py: PeerDesc.
struct PeerDesc {
  uint64_t qp;           // QpDesc* (device memory) of the QP connected to this PE (ibgda)
  uint64_t remote_base;  // the PE's symmetric heap base, as its NIC resolves addresses
  uint32_t rkey;         // the PE's heap rkey
  uint32_t pad0;
  uint64_t proxy;        // proxy::ProxyChannel* (device memory) serving this PE (proxy)
};
static_assert(sizeof(PeerDesc) == 32, "PeerDesc layout is mirrored in device/abi.py");

// A device context: the symmetric heap, the peers, the status block. 128 B. abi.py: DevCtx.
struct DevCtx {
  uint64_t local_base;     // this PE's symmetric heap base
  uint64_t heap_bytes;
  uint32_t lkey;           // the local heap's lkey
  uint32_t npes;
  uint32_t my_pe;
  uint32_t scratch_slots;  // number of 8-byte atomic result slots at `scratch`
  uint64_t peers;          // PeerDesc[npes] (device memory)
  uint64_t status;         // Status* (device memory)
  uint64_t timeout_ns;     // bound of every device wait
  uint64_t scratch;        // atomic result slots, inside the local heap (the NIC writes them)
  uint64_t discard;        // 8 bytes inside the local heap the NIC may write and nobody reads
  uint64_t max_wqe_bytes;  // split puts/gets larger than this into several WQEs (0: 1 GiB)
  uint64_t reserved[6];
};
static_assert(sizeof(DevCtx) == 128, "DevCtx layout is mirrored in device/abi.py");

// wait_until comparisons. abi.py: CMP_*.
enum : uint32_t { CMP_EQ = 0, CMP_NE = 1, CMP_GE = 2, CMP_GT = 3, CMP_LE = 4, CMP_LT = 5 };

// Smallest chunk put_nbi_warp gives one lane: below this, fewer lanes post (a WQE per 64 bytes
// would cost more NIC work than it saves GPU time).
#ifndef GPUNET_WARP_MIN_CHUNK
#define GPUNET_WARP_MIN_CHUNK 256
#endif
constexpr uint64_t kDefaultMaxWqeBytes = uint64_t(1) << 30;  // data segment byte_count is 31 bits

namespace api {

GPUNET_DEVICE Waiter waiter(const DevCtx& ctx) {
  return Waiter{reinterpret_cast<Status*>(uintptr_t(ctx.status)), ctx.timeout_ns};
}

GPUNET_DEVICE const PeerDesc* peer(const DevCtx& ctx, const Waiter& w, int pe) {
  if (pe < 0 || uint32_t(pe) >= ctx.npes) {
    record_failure(w.st, STATUS_BAD_ARGUMENT, SITE_POST_ARG, 0, uint32_t(pe), 0, ctx.npes,
                   uint32_t(pe), 0);
    return nullptr;
  }
  const PeerDesc* p = reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers)) + pe;
  if (p->qp == 0 && p->proxy == 0) {
    record_failure(w.st, STATUS_BAD_ARGUMENT, SITE_POST_ARG, 0, uint32_t(pe), 0, 1, 0, 0);
    return nullptr;
  }
  return p;
}

GPUNET_DEVICE QpDesc* qp_of(const PeerDesc* p) { return reinterpret_cast<QpDesc*>(uintptr_t(p->qp)); }

// The proxy transport: the peer has no QP of ours, a CPU thread posts for us (proxy.cuh).
GPUNET_DEVICE const proxy::ProxyChannel* proxy_of(const PeerDesc* p) {
  return p->qp ? nullptr : reinterpret_cast<const proxy::ProxyChannel*>(uintptr_t(p->proxy));
}
GPUNET_DEVICE uint64_t heap_off(const DevCtx& ctx, const void* local) {
  return uint64_t(uintptr_t(local)) - ctx.local_base;
}

GPUNET_DEVICE uint64_t remote(const DevCtx& ctx, const PeerDesc* p, const void* sym) {
  return p->remote_base + (uint64_t(uintptr_t(sym)) - ctx.local_base);
}

GPUNET_DEVICE uint64_t max_wqe(const DevCtx& ctx) {
  return ctx.max_wqe_bytes ? ctx.max_wqe_bytes : kDefaultMaxWqeBytes;
}

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

// One RDMA WRITE / READ per max_wqe bytes.
GPUNET_DEVICE bool rdma(const DevCtx& ctx, uint32_t opcode, uint64_t raddr, uint64_t laddr,
                        uint64_t nbytes, int pe) {
  const Waiter w = waiter(ctx);
  const PeerDesc* p = peer(ctx, w, pe);
  if (!p) return false;
  if (nbytes == 0) return !failed(w);
  const uint64_t step = max_wqe(ctx);
  for (uint64_t off = 0; off < nbytes; off += step) {
    const uint64_t len = nbytes - off < step ? nbytes - off : step;
    Wqe q;
    wqe_rdma(q, opcode, raddr + off, p->rkey, laddr + off, ctx.lkey, uint32_t(len));
    if (!post(qp_of(p), w, &q, 1)) return false;
  }
  return true;
}

}  // namespace api

// ---- puts and gets ---------------------------------------------------------------------------

// RDMA WRITE of [src, src+nbytes) (local heap) to dst_sym on `pe`. Non-blocking: complete at
// quiet(); src must stay unchanged until then. In order with earlier ops to the same pe.
GPUNET_DEVICE bool put_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes, int pe) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (!p) return false;
  if (const proxy::ProxyChannel* ch = api::proxy_of(p)) {
    if (nbytes == 0) return !failed(w);
    return proxy::proxy_put(*ch, w, uint32_t(pe), api::heap_off(ctx, src),
                            api::heap_off(ctx, dst_sym), nbytes);
  }
  return api::rdma(ctx, mlx5::OPCODE_RDMA_WRITE, api::remote(ctx, p, dst_sym),
                   uint64_t(uintptr_t(src)), nbytes, pe);
}

// RDMA WRITE with the payload copied into the WQE (nbytes <= kMaxInline): src may be reused as
// soon as it returns. Delivery: at quiet(), in order with earlier ops to the same pe.
GPUNET_DEVICE bool put_inline_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint32_t nbytes,
                                  int pe) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (!p) return false;
  if (nbytes == 0) return !failed(w);
  if (const proxy::ProxyChannel* ch = api::proxy_of(p)) {
    // The proxy reads the source later: keep the inline promise (src reusable on return) by
    // waiting for this channel's commands to complete.
    const Waiter& pw = w;
    uint64_t issued = 0;
    return proxy::proxy_put(*ch, pw, uint32_t(pe), api::heap_off(ctx, src),
                            api::heap_off(ctx, dst_sym), nbytes, &issued) &&
           proxy::proxy_quiet(*ch, pw, issued);
  }
  QpDesc* qp = api::qp_of(p);
  if (nbytes > kMaxInline || nbytes > qp->max_inline)
    return api::rdma(ctx, mlx5::OPCODE_RDMA_WRITE, api::remote(ctx, p, dst_sym),
                     uint64_t(uintptr_t(src)), nbytes, pe);
  Wqe q;
  wqe_write_inline(q, api::remote(ctx, p, dst_sym), p->rkey, static_cast<const uint8_t*>(src), nbytes);
  return post(qp, w, &q, 1);
}

// RDMA READ of src_sym on `pe` into [dst, dst+nbytes) (local heap). Non-blocking: dst holds the
// data after quiet().
GPUNET_DEVICE bool get_nbi(const DevCtx& ctx, void* dst, const void* src_sym, uint64_t nbytes, int pe) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (!p) return false;
  if (const proxy::ProxyChannel* ch = api::proxy_of(p)) {
    if (nbytes == 0) return !failed(w);
    return proxy::proxy_get(*ch, w, uint32_t(pe), api::heap_off(ctx, dst),
                            api::heap_off(ctx, src_sym), nbytes);
  }
  return api::rdma(ctx, mlx5::OPCODE_RDMA_READ, api::remote(ctx, p, src_sym),
                   uint64_t(uintptr_t(dst)), nbytes, pe);
}

// put then signal: RDMA WRITE of the payload, then ATOMIC fetch-add of `add` on the 8-byte signal
// word sig_sym on `pe`, posted as one reservation on the pe's QP. A receiver that sees the signal
// reach k (wait_until) sees every payload put to it from this QP before the k-th signal (in-order
// RC execution; the payload's WRITE completes before the atomic executes). Non-blocking.
GPUNET_DEVICE bool put_signal_nbi(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes,
                                  uint64_t* sig_sym, uint64_t add, int pe) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (!p) return false;
  if (const proxy::ProxyChannel* ch = api::proxy_of(p)) {
    // Same order through the proxy: the channel keeps a peer's commands on one QP, in order.
    const Waiter& pw = w;
    const uint64_t cmax = proxy::MAX_CMD_SIZE;
    const uint64_t head = nbytes > cmax ? ((nbytes - 1) / cmax) * cmax : 0;
    if (head && !proxy::proxy_put(*ch, pw, uint32_t(pe), api::heap_off(ctx, src),
                                  api::heap_off(ctx, dst_sym), head))
      return false;
    if (nbytes == head)
      return proxy::proxy_signal(*ch, pw, uint32_t(pe), api::heap_off(ctx, sig_sym), add, true);
    return proxy::proxy_put_signal(*ch, pw, uint32_t(pe), api::heap_off(ctx, src) + head,
                                   api::heap_off(ctx, dst_sym) + head, nbytes - head,
                                   api::heap_off(ctx, sig_sym), add, true);
  }
  const uint64_t step = api::max_wqe(ctx);
  // Payload beyond one WQE goes first, the last chunk travels with the signal.
  uint64_t head = nbytes > step ? ((nbytes - 1) / step) * step : 0;
  if (head && !put_nbi(ctx, dst_sym, src, head, pe)) return false;
  Wqe q[2];
  uint32_t k = 0;
  if (nbytes > head) {
    wqe_rdma(q[k++], mlx5::OPCODE_RDMA_WRITE, api::remote(ctx, p, dst_sym) + head, p->rkey,
             uint64_t(uintptr_t(src)) + head, ctx.lkey, uint32_t(nbytes - head));
  }
  wqe_atomic_fa(q[k++], api::remote(ctx, p, sig_sym), p->rkey, ctx.discard, ctx.lkey, add);
  return post(api::qp_of(p), w, q, k);
}

// ---- atomics and signals ---------------------------------------------------------------------

// Blocking 8-byte fetch-add on sym_addr at `pe` (the word is a big-endian number there, see the
// header comment). Returns the old value (converted to host order); *ok = false (and 0 returned)
// on failure. Ordered after earlier ops to the same pe; complete (and visible) when it returns.
// Uses the result slot of this thread (global thread id modulo ctx.scratch_slots): the context
// needs at least as many slots as threads that may call it at the same time.
GPUNET_DEVICE uint64_t atomic_fetch_add(const DevCtx& ctx, uint64_t* sym_addr, uint64_t v, int pe,
                                        bool* ok = nullptr) {
  const Waiter w = api::waiter(ctx);
  if (ok) *ok = false;
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (!p) return 0;
  const arch::Dim3 b = arch::block_idx(), g = arch::grid_dim(), bd = arch::block_dim();
  const uint64_t gtid = uint64_t(b.x + g.x * (b.y + g.y * b.z)) * (bd.x * bd.y * bd.z) + arch::thread_rank();
  const uint64_t slots = ctx.scratch_slots ? ctx.scratch_slots : 1;
  uint64_t* result = reinterpret_cast<uint64_t*>(uintptr_t(ctx.scratch)) + (gtid % slots);
  if (const proxy::ProxyChannel* ch = api::proxy_of(p)) {
    // Through the proxy the addend travels in 32 bits (signed): larger ones are a bad argument.
    uint64_t old = 0;
    if (!proxy::proxy_atomic_fetch_add(*ch, w, uint32_t(pe),
                                       api::heap_off(ctx, sym_addr), int64_t(v),
                                       api::heap_off(ctx, result),
                                       reinterpret_cast<const uint8_t*>(uintptr_t(ctx.local_base)),
                                       &old))
      return 0;
    if (ok) *ok = true;
    return old;
  }
  QpDesc* qp = api::qp_of(p);
  Wqe q;
  wqe_atomic_fa(q, api::remote(ctx, p, sym_addr), p->rkey, uint64_t(uintptr_t(result)), ctx.lkey, v);
  uint64_t end = 0;
  if (!post(qp, w, &q, 1, &end)) return 0;
  if (!wait_done(qp, w, end, SITE_ATOMIC)) return 0;
  // done_head was read with acquire after the CQE (which follows the NIC's result write).
  const uint64_t old = arch::bswap64(arch::load_acquire_sys(result));
  if (ok) *ok = true;
  return old;
}

// The value of a signal word (big-endian in memory, as the NIC's atomics leave it), with acquire:
// data the signalling peer put before the signal is visible after it.
GPUNET_DEVICE uint64_t signal_read(const uint64_t* sig_addr) {
  return arch::bswap64(arch::load_acquire_sys(sig_addr));
}

// Wait (bounded by ctx.timeout_ns) until signal_read(sig_addr) `cmp` value holds. true when it
// holds; false on timeout or an earlier failure (recorded: SITE_WAIT_UNTIL, expected = value,
// observed = the last value read). After true, everything the signaller put before the signal
// is visible to this thread (acquire).
GPUNET_DEVICE bool wait_until(const DevCtx& ctx, const uint64_t* sig_addr, uint32_t cmp, uint64_t value) {
  const Waiter w = api::waiter(ctx);
  Spin spin;
  spin.progress = false;  // a user's word under any comparison: a plain bound (qp.cuh Spin)
  uint64_t v = signal_read(sig_addr);
  while (!api::compare(v, cmp, value)) {
    if (!spin.keep_going(w, SITE_WAIT_UNTIL, nullptr, uint64_t(uintptr_t(sig_addr)), value, v)) return false;
    v = signal_read(sig_addr);
  }
  return true;
}

// ---- completion and ordering -----------------------------------------------------------------

// Complete every operation issued before it on every QP of the context (see the header comment).
// Blocking, bounded. true iff all completed without error.
GPUNET_DEVICE bool quiet(const DevCtx& ctx) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* peers = reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers));
  bool ok = true;
  for (uint32_t pe = 0; pe < ctx.npes; ++pe) {
    if (peers[pe].qp) {
      ok = quiet(reinterpret_cast<QpDesc*>(uintptr_t(peers[pe].qp)), w) && ok;
    } else if (peers[pe].proxy) {
      // Peers often share a channel: quiet it once, at the first peer that uses it.
      bool first = true;
      for (uint32_t q = 0; q < pe && first; ++q) first = peers[q].qp || peers[q].proxy != peers[pe].proxy;
      if (first)
        ok = proxy::proxy_quiet_all(*api::proxy_of(&peers[pe]), w) && ok;
    }
  }
  return ok && !failed(w);
}

// Complete every operation issued before it to `pe` only.
GPUNET_DEVICE bool quiet_pe(const DevCtx& ctx, int pe) {
  const Waiter w = api::waiter(ctx);
  const PeerDesc* p = api::peer(ctx, w, pe);
  if (p && api::proxy_of(p)) return proxy::proxy_quiet_all(*api::proxy_of(p), w);
  return p && quiet(api::qp_of(p), w);
}

// Ordering point for later puts after earlier ones (see the header comment: per-PE order already
// holds; this orders the thread's own earlier device stores before its later posts).
GPUNET_DEVICE bool fence(const DevCtx& ctx) {
  arch::fence_sys();
  return !failed(api::waiter(ctx));
}

// ---- warp variants ---------------------------------------------------------------------------

// Every lane of the warp calls it with the same arguments (converged). The put is split in up to
// warp_size chunks of >= GPUNET_WARP_MIN_CHUNK bytes, one WQE per lane, posted with ONE
// reservation (qp.cuh post_warp). Same guarantees as put_nbi; returns the same bool on all lanes.
GPUNET_DEVICE bool put_nbi_warp(const DevCtx& ctx, void* dst_sym, const void* src, uint64_t nbytes, int pe) {
  const Waiter w = api::waiter(ctx);
  const uint32_t ws = arch::warp_size(), lane = arch::lane_id();
  const PeerDesc* p = nullptr;
  if (pe < 0 || uint32_t(pe) >= ctx.npes ||
      (reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers))[pe].qp == 0 &&
       reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers))[pe].proxy == 0)) {
    if (lane == 0) api::peer(ctx, w, pe);  // records the bad argument
    arch::syncwarp();
    return false;
  }
  p = reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers)) + pe;
  if (nbytes == 0) return arch::all(!failed(w));
  if (api::proxy_of(p)) {
    // One command carries the whole put (the proxy splits it into WQEs): lane 0 pushes it.
    bool ok = true;
    if (lane == 0) ok = put_nbi(ctx, dst_sym, src, nbytes, pe);
    return arch::shfl(uint32_t(ok), 0) != 0;
  }
  const uint64_t step_max = api::max_wqe(ctx);
  const uint64_t round_bytes = step_max * ws;
  const uint64_t raddr = api::remote(ctx, p, dst_sym);
  const uint64_t laddr = uint64_t(uintptr_t(src));
  bool ok = true;
  for (uint64_t r0 = 0; r0 < nbytes && ok; r0 += round_bytes) {
    const uint64_t len = nbytes - r0 < round_bytes ? nbytes - r0 : round_bytes;
    uint64_t chunk = (len + ws - 1) / ws;
    if (chunk < GPUNET_WARP_MIN_CHUNK) chunk = GPUNET_WARP_MIN_CHUNK;
    chunk = (chunk + 63) & ~uint64_t(63);  // cache-line multiples
    if (chunk > step_max) chunk = step_max;
    const uint32_t nposts = uint32_t((len + chunk - 1) / chunk);
    Wqe q;
    const uint64_t off = r0 + uint64_t(lane) * chunk;
    const uint64_t my = lane < nposts ? ((r0 + len - off) < chunk ? (r0 + len - off) : chunk) : 0;
    wqe_rdma(q, mlx5::OPCODE_RDMA_WRITE, raddr + off, p->rkey, laddr + off, ctx.lkey, uint32_t(my));
    ok = post_warp(api::qp_of(p), w, q, nposts);
  }
  return ok;
}

}  // namespace gpunet
