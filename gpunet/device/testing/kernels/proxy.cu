// Kernels of the CPU-proxy transport (gpunet/proxy.cuh) for tests/test_proxy.py (HOST arm, warps
// of 32 and 64) and bench/proxy.py --gpu (CUDA arm): producers pushing PUT / put_signal commands,
// a one-thread round-trip probe, and the layout / encoding reference the Python mirror is checked
// against. Written once; the launchers are extern "C" for ctypes (gpunet/device/loader.py).
#include <gpunet/arch.cuh>
#include <gpunet/proxy.cuh>

namespace arch = gpunet::arch;
namespace px = gpunet::proxy;

namespace {

inline gpunet::LaunchSpec spec(uint32_t grid, uint32_t block, uint32_t warp_size) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = warp_size;
  return s;
}

enum : uint32_t {
  MODE_PUSH = 0,        // every thread proxy_push()es its own PUTs
  MODE_PUSH_WARP = 1,   // proxy_push_warp: one reservation per warp; some lanes inactive
  MODE_PUT_SIGNAL = 2,  // proxy_put_signal: PUT then SIGNAL_ADD(+1) on peer[sig_base + 8 * g]
};

// Thread g (global) issues commands idx = g * per_thread + i, i < per_thread: a PUT of `size`
// bytes from local[idx * stride] to peer (idx % npeers) at the same offset, on channel
// (global warp) % nch. In MODE_PUSH_WARP the lane is active iff active_mod < 2 or
// idx % active_mod != active_mod - 1. Ends with a quiet on everything it issued.
GPUNET_GLOBAL void k_produce(const px::ProxyChannel* chs, uint32_t nch, gpunet::Status* st,
                             uint64_t timeout_ns, uint32_t mode, uint32_t npeers,
                             uint32_t per_thread, uint32_t size, uint32_t stride,
                             uint64_t sig_base, uint32_t active_mod) {
  const uint32_t g = arch::block_idx().x * arch::block_dim().x + arch::thread_idx().x;
  const uint32_t gwarp = g / arch::warp_size();
  const px::ProxyChannel ch = chs[gwarp % nch];
  const gpunet::Waiter w{st, timeout_ns};
  uint64_t issued = 0;
  bool ok = true;
  for (uint32_t i = 0; i < per_thread; ++i) {
    const uint64_t idx = uint64_t(g) * per_thread + i;
    const uint32_t peer = uint32_t(idx % npeers);
    const uint64_t off = idx * stride;
    if (mode == MODE_PUSH_WARP) {
      const bool active = active_mod < 2 || (idx % active_mod) != active_mod - 1;
      uint64_t is = 0;
      ok = px::proxy_push_warp(ch, w, px::encode(px::OP_PUT, peer, size, off, off), active, &is);
      if (active) issued = is;
    } else if (mode == MODE_PUT_SIGNAL) {
      ok = px::proxy_put_signal(ch, w, peer, off, off, size, sig_base + 8ull * g, 1, true, &issued);
    } else {
      ok = px::proxy_push(ch, w, px::encode(px::OP_PUT, peer, size, off, off), &issued);
    }
    if (!ok) break;  // uniform across the warp in MODE_PUSH_WARP (lane 0's answer)
  }
  if (ok && issued) px::proxy_quiet(ch, w, issued);
}

// One thread: `iters` times { t0; push one PUT of `size` bytes; wait until it completed; t1 },
// out_ns[i] = t1 - t0: the device -> proxy -> NIC -> completion -> device round trip.
GPUNET_GLOBAL void k_roundtrip(px::ProxyChannel ch, gpunet::Status* st, uint64_t timeout_ns,
                               uint32_t iters, uint32_t size, uint64_t* out_ns) {
  if (arch::thread_rank() != 0 || arch::block_idx().x != 0) return;
  const gpunet::Waiter w{st, timeout_ns};
  for (uint32_t i = 0; i < iters; ++i) {
    const uint64_t t0 = arch::now_ns();
    uint64_t issued = 0;
    if (!px::proxy_push(ch, w, px::encode(px::OP_PUT, 0, size, 0, 0), &issued)) return;
    if (!px::proxy_quiet(ch, w, issued)) return;
    out_ns[i] = arch::now_ns() - t0;
  }
}

}  // namespace

extern "C" {

// Layout and encoding reference for the Python mirror. out: 16 words (see tests/test_proxy.py).
void proxy_layout(uint64_t* out) {
  out[0] = sizeof(px::Command);
  out[1] = sizeof(px::HostCtrl);
  out[2] = offsetof(px::HostCtrl, tail);
  out[3] = offsetof(px::HostCtrl, completed);
  out[4] = offsetof(px::HostCtrl, error);
  out[5] = offsetof(px::HostCtrl, err_seq);
  out[6] = sizeof(px::DevCtrl);
  out[7] = offsetof(px::DevCtrl, head);
  out[8] = offsetof(px::DevCtrl, cached_tail);
  out[9] = sizeof(px::ProxyChannel);
  out[10] = offsetof(px::ProxyChannel, depth);
  out[11] = px::OP_MAX;
  out[12] = px::MAX_OFFSET;
  out[13] = px::MAX_PEERS;
  out[14] = gpunet::SITE_PROXY_FIFO;
  out[15] = gpunet::SITE_PROXY_QUIET;
}

void proxy_encode(uint32_t op, uint32_t peer, uint64_t arg, uint64_t local_off, uint64_t remote_off,
                  uint64_t* out) {
  const px::Command c = px::encode(op, peer, arg, local_off, remote_off);
  out[0] = c.w0;
  out[1] = c.w1;
}

void proxy_encode_signal(uint32_t op, uint32_t peer, uint64_t value, uint64_t remote_off,
                         uint64_t* out) {
  const px::Command c = px::encode_signal(op, peer, value, remote_off);
  out[0] = c.w0;
  out[1] = c.w1;
}

void proxy_encode_operand(uint32_t peer, uint64_t value, uint64_t* out) {
  const px::Command c = px::encode_operand(peer, value);
  out[0] = c.w0;
  out[1] = c.w1;
}

int proxy_produce(uint32_t grid, uint32_t block, uint32_t warp_size, const void* chs, uint32_t nch,
                  void* st, uint64_t timeout_ns, uint32_t mode, uint32_t npeers,
                  uint32_t per_thread, uint32_t size, uint32_t stride, uint64_t sig_base,
                  uint32_t active_mod) {
  return gpunet::launch_kernel(spec(grid, block, warp_size), k_produce,
                               static_cast<const px::ProxyChannel*>(chs), nch,
                               static_cast<gpunet::Status*>(st), timeout_ns, mode, npeers,
                               per_thread, size, stride, sig_base, active_mod);
}

int proxy_roundtrip(const void* ch_desc, void* st, uint64_t timeout_ns, uint32_t iters,
                    uint32_t size, uint64_t* out_ns) {
  // ch_desc: a host pointer to the 32-byte descriptor; the kernel gets it by value
  const px::ProxyChannel ch = *static_cast<const px::ProxyChannel*>(ch_desc);
  return gpunet::launch_kernel(spec(1, 1, 32), k_roundtrip, ch, static_cast<gpunet::Status*>(st),
                               timeout_ns, iters, size, out_ns);
}

}  // extern "C"
