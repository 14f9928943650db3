// gpunet/transport/proxy.cuh — the verbs through a CPU proxy: each PE is served by a proxy channel
// (PeerDesc::proxy), a FIFO of 16-byte commands a CPU thread turns into WQEs on its own QP to that
// PE (proxy.cuh; gpunet/host/proxy.py). Used where the NIC's doorbell cannot be mapped into the GPU.
//
// The same function set as transport/ibgda.cuh (see there); the same guarantees, because one
// channel's commands to one PE stay in order on one QP (proxy.cuh "Completion"). Offsets, not
// addresses, travel in commands: the proxy adds the heap bases and keys.
#pragma once

#include <stdint.h>

#include "../arch.cuh"
#include "../devctx.cuh"
#include "../proxy.cuh"
#include "../status.cuh"

namespace gpunet {
namespace transport {

struct Proxy {
  static GPUNET_DEVICE const proxy::ProxyChannel& channel(const PeerDesc& p) {
    return *reinterpret_cast<const proxy::ProxyChannel*>(uintptr_t(p.proxy));
  }

  static GPUNET_DEVICE bool put_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst_sym, const void* src, uint64_t nbytes) {
    if (nbytes == 0) return !failed(w);
    return proxy::proxy_put(channel(p), w, uint32_t(pe), api::heap_off(ctx, src),
                            api::heap_off(ctx, dst_sym), nbytes);
  }

  // The proxy reads the source later: keep the inline promise (src reusable on return) by waiting
  // for this channel's commands to complete.
  static GPUNET_DEVICE bool put_inline_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src,
                                           uint32_t nbytes) {
    if (nbytes == 0) return !failed(w);
    uint64_t issued = 0;
    return proxy::proxy_put(channel(p), w, uint32_t(pe), api::heap_off(ctx, src),
                            api::heap_off(ctx, dst_sym), nbytes, &issued) &&
           proxy::proxy_quiet(channel(p), w, issued, uint32_t(pe));
  }

  static GPUNET_DEVICE bool get_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe,
                                    void* dst, const void* src_sym, uint64_t nbytes) {
    if (nbytes == 0) return !failed(w);
    return proxy::proxy_get(channel(p), w, uint32_t(pe), api::heap_off(ctx, dst),
                            api::heap_off(ctx, src_sym), nbytes);
  }

  // Payload beyond one command first; the last chunk and the signal are one reservation.
  static GPUNET_DEVICE bool put_signal_nbi(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                           int pe, void* dst_sym, const void* src, uint64_t nbytes,
                                           uint64_t* sig_sym, uint64_t add, uint32_t sig_op) {
    const proxy::ProxyChannel& ch = channel(p);
    const bool is_add = sig_op != SIGNAL_SET;
    const uint64_t cmax = proxy::MAX_CMD_SIZE;
    const uint64_t head = nbytes > cmax ? ((nbytes - 1) / cmax) * cmax : 0;
    if (head && !proxy::proxy_put(ch, w, uint32_t(pe), api::heap_off(ctx, src),
                                  api::heap_off(ctx, dst_sym), head))
      return false;
    if (nbytes == head)
      return proxy::proxy_signal(ch, w, uint32_t(pe), api::heap_off(ctx, sig_sym), add, is_add);
    return proxy::proxy_put_signal(ch, w, uint32_t(pe), api::heap_off(ctx, src) + head,
                                   api::heap_off(ctx, dst_sym) + head, nbytes - head,
                                   api::heap_off(ctx, sig_sym), add, is_add);
  }

  static GPUNET_DEVICE bool atomic_fetch_add(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                             int pe, uint64_t* sym_addr, uint64_t v,
                                             uint64_t* result, uint64_t* old) {
    uint64_t raw = 0;
    if (!proxy::proxy_atomic_fetch_add(channel(p), w, uint32_t(pe), api::heap_off(ctx, sym_addr), v,
                                       api::heap_off(ctx, result),
                                       reinterpret_cast<const uint8_t*>(uintptr_t(ctx.local_base)),
                                       &raw))
      return false;
    *old = api::signal_order(ctx, raw);  // the NIC wrote it in its atomic order
    return true;
  }

  static GPUNET_DEVICE bool quiet_pe(const DevCtx& ctx, const Waiter& w, const PeerDesc& p, int pe) {
    (void)ctx;
    return proxy::proxy_quiet_all(channel(p), w, uint32_t(pe));
  }

  // Every proxy peer's channel, each channel once (peers often share one: it is quieted at the
  // first peer that uses it).
  static GPUNET_DEVICE bool quiet_all(const DevCtx& ctx, const Waiter& w) {
    const PeerDesc* peers = api::peers(ctx);
    bool ok = true;
    for (uint32_t pe = 0; pe < ctx.npes; ++pe) {
      if (peers[pe].kind != TRANSPORT_PROXY) continue;
      bool first = true;
      for (uint32_t q = 0; q < pe && first; ++q)
        first = peers[q].kind != TRANSPORT_PROXY || peers[q].proxy != peers[pe].proxy;
      if (first) ok = proxy::proxy_quiet_all(channel(peers[pe]), w) && ok;
    }
    return ok;
  }

  // Collective: one command carries the whole put (the proxy splits it into WQEs); lane 0 pushes.
  static GPUNET_DEVICE bool put_nbi_warp(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                         int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    bool ok = true;
    if (arch::lane_id() == 0) ok = put_nbi(ctx, w, p, pe, dst_sym, src, nbytes);
    return arch::shfl(uint32_t(ok), 0) != 0;
  }

  // Collective (every thread of the block): thread 0 pushes one command, as put_nbi_warp's lane 0
  // does (the proxy thread splits nothing; the NIC moves the bytes). Same bool on every thread.
  static GPUNET_DEVICE bool put_nbi_block(const DevCtx& ctx, const Waiter& w, const PeerDesc& p,
                                          int pe, void* dst_sym, const void* src, uint64_t nbytes) {
    bool ok = true;
    if (arch::thread_rank() == 0) ok = put_nbi(ctx, w, p, pe, dst_sym, src, nbytes);
    return !arch::block_any(!ok || failed(w));
  }
};

}  // namespace transport
}  // namespace gpunet
