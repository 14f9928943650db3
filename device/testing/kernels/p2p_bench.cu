// Test and benchmark support, not the API.
// bench/p2p.py's device-side put_signal ping-pong between two ranks, written on gpunet.cuh's verbs
// only (so it measures what a user kernel gets over whatever transport the peer has).
//
//   k_pingpong  one thread per rank. The ping rank, for i = 1 .. iters: put_signal_nbi of
//               `nbytes` from `buf` to the peer's `buf`, SET of base + i on the peer's word
//               sig[0]; then wait_until its own sig[1] >= base + i. The pong rank: wait_until its
//               sig[0] >= base + i, then put_signal_nbi back with SET of base + i on the peer's
//               sig[1]. SET: one writer per word, the form store-only (c500) p2p peers allow.
//               The ping rank times round trips warmup + 1 .. iters with arch::now_ns()
//               (%globaltimer on CUDA) and writes out[0] = ns, out[1] = round trips timed,
//               out[2] = 1 when every call returned true.
//
// The launcher is synchronous (it returns when the kernel has finished) and returns 0 or the
// launch error; a failed wait is recorded in the context's Status block, which the caller checks.
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;
using gpunet::DevCtx;

namespace {

GPUNET_GLOBAL void k_pingpong(const DevCtx* ctx, uint8_t* buf, uint64_t* sig, uint64_t base,
                              uint32_t iters, uint32_t warmup, uint32_t nbytes, int32_t peer,
                              uint32_t ping, uint64_t* out) {
  bool ok = true;
  uint64_t t0 = arch::now_ns();
  for (uint32_t i = 1; i <= iters && ok; ++i) {
    if (ping && i == warmup + 1) t0 = arch::now_ns();
    if (ping) {
      ok = gpunet::put_signal_nbi(*ctx, buf, buf, nbytes, &sig[0], base + i, peer, gpunet::SIGNAL_SET) &&
           gpunet::wait_until(*ctx, &sig[1], gpunet::CMP_GE, base + i);
    } else {
      ok = gpunet::wait_until(*ctx, &sig[0], gpunet::CMP_GE, base + i) &&
           gpunet::put_signal_nbi(*ctx, buf, buf, nbytes, &sig[1], base + i, peer, gpunet::SIGNAL_SET);
    }
  }
  const uint64_t t1 = arch::now_ns();
  if (ok) ok = gpunet::quiet(*ctx);
  out[0] = t1 - t0;
  out[1] = iters > warmup ? iters - warmup : 0;
  out[2] = ok ? 1 : 0;
}

}  // namespace

extern "C" {

int gpunet_bench_pingpong(uint32_t warp_size, const DevCtx* ctx, void* buf, uint64_t* sig,
                          uint64_t base, uint32_t iters, uint32_t warmup, uint32_t nbytes,
                          int32_t peer, uint32_t ping, uint64_t* out, void* stream) {
  gpunet::LaunchSpec s;
  s.warp_size = warp_size;
  s.stream = stream;
  s.sync = true;
  return gpunet::launch_kernel(s, k_pingpong, ctx, static_cast<uint8_t*>(buf), sig, base, iters,
                               warmup, nbytes, peer, ping, out);
}

}  // extern "C"
