// gpunet/transport/ibgda.cuh — the verbs over GPU-initiated posting (IBGDA): each PE has an RC QP
// of ours (PeerDesc::qp) whose WQEs device threads write and ring themselves (qp.cuh).
//
// The transport function set (every transport under transport/ has the same names and
// signatures; gpunet.cuh's dispatch() calls the one of the peer's kind, and its verbs document
// the guarantees):
//   put_nbi, put_inline_nbi, get_nbi, put_signal_nbi, atomic_fetch_add, quiet_pe, put_nbi_warp,
//   put_nbi_block (per peer) and quiet_all (every peer of this transport).
// Arguments are checked by the verb (pe in range, kind matches) before the call.
#pragma once

#include <stdint.h>

#include "../arch.cuh"
#include "../devctx.cuh"
#include "../mlx5.cuh"
#include "../qp.cuh"
#include "../status.cuh"

// Smallest chunk put_nbi_warp gives one lane: below this, fewer lanes post (a WQE per 64 bytes
// would cost more NIC work than it saves GPU time).
#ifndef GPUNET_WARP_MIN_CHUNK
#define GPUNET_WARP_MIN_CHUNK 256
#endif

namespace gpunet {
namespace transport {

struct Ibgda {
  static GPUNET_DEVICE QpDesc* qp_of(const PeerDesc& p) {
    return reinterpret_cast<QpDesc*>(uintptr_t(p.qp));
  }

  // One RDMA WRITE / READ per max_wqe bytes.
  static GPUNET_DEVICE bool rdma(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                 uint32_t opcode, uint64_t raddr, uint64_t laddr, uint64_t nbytes) {
    if (nbytes == 0) return !failed(w);
    const uint64_t step = api::max_wqe(ctx);
    const QpRef qp = qp_ref(qp_of(p));  // once for every WQE of the loop
    for (uint64_t off = 0; off < nbytes; off += step) {
      const uint64_t len = nbytes - off < step ? nbytes - off : step;
      Wqe q;
      wqe_rdma(q, opcode, raddr + off, p.rkey, laddr + off, ctx.lkey, uint32_t(len));
      if (!post(qp, w, &q, 1)) return false;
    }
    return true;
  }

  static GPUNET_DEVICE bool put_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst_sym, const void* src, uint64_t nbytes) {
    (void)pe;
    return rdma(ctx, w, p, mlx5::OPCODE_RDMA_WRITE, api::remote(ctx, p, dst_sym),
                uint64_t(uintptr_t(src)), nbytes);
  }

  static GPUNET_DEVICE bool put_inline_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src,
                                           uint32_t nbytes) {
    if (nbytes == 0) return !failed(w);
    QpDesc* qp = qp_of(p);
    if (nbytes > kMaxInline || nbytes > qp->max_inline) return put_nbi(ctx, w, p, pe, dst_sym, src, nbytes);
    Wqe q;
    wqe_write_inline(q, api::remote(ctx, p, dst_sym), p.rkey, static_cast<const uint8_t*>(src),
                     nbytes);
    return post(qp, w, &q, 1);
  }

  static GPUNET_DEVICE bool get_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst, const void* src_sym, uint64_t nbytes) {
    (void)pe;
    return rdma(ctx, w, p, mlx5::OPCODE_RDMA_READ, api::remote(ctx, p, src_sym),
                uint64_t(uintptr_t(dst)), nbytes);
  }

  // Payload beyond one WQE goes first; the last chunk and the signal (ADD: ATOMIC fetch-add; SET:
  // an inline 8-byte WRITE of the value in the NIC's atomic order, api::signal_order) are one
  // reservation on the QP, so they execute in that order (RC in-order execution).
  static GPUNET_DEVICE bool put_signal_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src, uint64_t nbytes,
                                           uint64_t* sig_sym, uint64_t add, uint32_t sig_op) {
    const uint64_t step = api::max_wqe(ctx);
    const uint64_t head = nbytes > step ? ((nbytes - 1) / step) * step : 0;
    if (head && !put_nbi(ctx, w, p, pe, dst_sym, src, head)) return false;
    Wqe q[2];
    uint32_t k = 0;
    if (nbytes > head) {
      wqe_rdma(q[k++], mlx5::OPCODE_RDMA_WRITE, api::remote(ctx, p, dst_sym) + head, p.rkey,
               uint64_t(uintptr_t(src)) + head, ctx.lkey, uint32_t(nbytes - head));
    }
    if (sig_op == SIGNAL_SET) {
      const uint64_t word = api::signal_order(ctx, add);
      wqe_write_inline(q[k++], api::remote(ctx, p, sig_sym), p.rkey,
                       reinterpret_cast<const uint8_t*>(&word), 8);
    } else {
      wqe_atomic_fa(q[k++], api::remote(ctx, p, sig_sym), p.rkey, ctx.discard, ctx.lkey, add);
    }
    return post(qp_of(p), w, q, k);
  }

  // The old value lands in `result` (this thread's slot, in the NIC's atomic order); waits for
  // its completion.
  static GPUNET_DEVICE bool atomic_fetch_add(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                             int pe, uint64_t* sym_addr, uint64_t v,
                                             uint64_t* result, uint64_t* old) {
    (void)pe;
    QpDesc* qp = qp_of(p);
    Wqe q;
    wqe_atomic_fa(q, api::remote(ctx, p, sym_addr), p.rkey, uint64_t(uintptr_t(result)), ctx.lkey,
                  v);
    uint64_t end = 0;
    if (!post(qp, w, &q, 1, &end)) return false;
    if (!wait_done(qp, w, end, SITE_ATOMIC)) return false;
    // done_head was read with acquire after the CQE (which follows the NIC's result write).
    *old = api::signal_order(ctx, arch::load_acquire_sys(result));
    return true;
  }

  static GPUNET_DEVICE bool quiet_pe(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe) {
    (void)ctx, (void)pe;
    return quiet(qp_of(p), w);
  }

  // Every ibgda peer's QP.
  static GPUNET_DEVICE bool quiet_all(const DevCtx& ctx, const Waiter& w) {
    const PeerDesc* peers = api::peers(ctx);
    bool ok = true;
    for (uint32_t pe = 0; pe < ctx.npes; ++pe)
      if (peers[pe].kind == TRANSPORT_IBGDA) ok = quiet(qp_of(peers[pe]), w) && ok;
    return ok;
  }

  // Collective (every lane, same arguments): up to warp_size chunks of >= GPUNET_WARP_MIN_CHUNK
  // bytes, one WQE per lane, posted with ONE reservation per round (qp.cuh post_warp).
  static GPUNET_DEVICE bool put_nbi_warp(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                         int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    (void)pe;
    const uint32_t ws = arch::warp_size(), lane = arch::lane_id();
    const uint64_t step_max = api::max_wqe(ctx);
    const uint64_t round_bytes = step_max * ws;
    const uint64_t raddr = api::remote(ctx, p, dst_sym);
    const uint64_t laddr = uint64_t(uintptr_t(src));
    const QpRef qp = qp_ref(qp_of(p));  // once: the rounds' posts load no constant (qp.cuh QpRef)
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
      wqe_rdma(q, mlx5::OPCODE_RDMA_WRITE, raddr + off, p.rkey, laddr + off, ctx.lkey, uint32_t(my));
      ok = post_warp(qp, w, q, nposts);
    }
    return ok;
  }

  // Collective (every thread of the block, same arguments): the bytes are cut into one piece per
  // full warp of the block (64-byte multiples, at least GPUNET_WARP_MIN_CHUNK per lane's worth),
  // and each warp posts its piece with put_nbi_warp (one reservation per warp). A block smaller
  // than a warp posts from thread 0. Returns the same bool on every thread (one block_any).
  static GPUNET_DEVICE bool put_nbi_block(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                          int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    const arch::Dim3 bd = arch::block_dim();
    const uint32_t ws = arch::warp_size(), nwarps = (bd.x * bd.y * bd.z) / ws;
    bool ok = true;
    if (nwarps == 0) {
      if (arch::thread_rank() == 0) ok = put_nbi(ctx, w, p, pe, dst_sym, src, nbytes);
    } else if (arch::warp_id() < nwarps) {
      uint64_t piece = (nbytes + nwarps - 1) / nwarps;
      if (piece < uint64_t(GPUNET_WARP_MIN_CHUNK) * ws) piece = uint64_t(GPUNET_WARP_MIN_CHUNK) * ws;
      piece = (piece + 63) & ~uint64_t(63);
      const uint64_t off = uint64_t(arch::warp_id()) * piece;
      const uint64_t len = off < nbytes ? (nbytes - off < piece ? nbytes - off : piece) : 0;
      if (len)
        ok = put_nbi_warp(ctx, w, p, pe, static_cast<uint8_t*>(dst_sym) + off,
                          static_cast<const uint8_t*>(src) + off, len);
    }
    return !arch::block_any(!ok || failed(w));
  }
};

}  // namespace transport
}  // namespace gpunet
