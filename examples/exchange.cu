// examples/exchange.cu — a user kernel on gpunet's device API, built by gpunet.build_extension
// for the platform's arm (the HOST arm's emulated warps on a CPU, nvcc on CUDA) and launched from
// its own extern "C" host wrapper. examples/exchange.py drives it; tests/test_examples.py runs it.
//
// Every rank sends `n` floats to the next rank and hears from the previous one:
//   1. the whole warp puts src[0, n) into dst on `peer` (put_nbi_warp: one WQE per lane, one
//      reservation of the peer's send queue);
//   2. lane 0 adds 1 to the peer's signal word (put_signal_nbi with 0 payload bytes: after the
//      warp's put on the same QP or proxy channel, so a peer that sees the signal sees the data);
//   3. lane 0 waits until its own signal word reaches `expect` (the previous rank's put_signal of
//      this round arrived, with its payload) and completes its own operations (quiet).
// Every call is bounded by the Context's timeout and returns false after recording a failure in
// the Status block; the host raises it with ctx.check() (the kernel does not trap).
#include <gpunet/gpunet.cuh>

namespace {

GPUNET_GLOBAL void exchange(const gpunet::DevCtx* ctx, float* dst_sym, const float* src_sym,
                            uint64_t n, uint64_t* sig_sym, uint64_t expect, int peer) {
  const gpunet::DevCtx& c = *ctx;
  bool ok = gpunet::put_nbi_warp(c, dst_sym, src_sym, n * sizeof(float), peer);
  if (gpunet::arch::lane_id() == 0 && ok) {
    ok = gpunet::put_signal_nbi(c, dst_sym, src_sym, 0, sig_sym, 1, peer) &&
         gpunet::wait_until(c, sig_sym, gpunet::CMP_GE, expect) && gpunet::quiet(c);
  }
  (void)ok;  // a failure is in the Status block: ctx.check() raises it on the host
}

}  // namespace

extern "C" {

// One warp of `warp_size` threads on `stream` (CUDA: a cudaStream_t, torch's current stream, so
// the kernel is ordered with the Context's own launches; HOST arm: ignored, the launch runs to
// completion before this returns). Returns 0 or the launch error. Does not wait on CUDA: the
// caller's ctx.check() synchronizes the stream and raises what the kernel recorded.
int example_exchange(const void* ctx, float* dst_sym, const float* src_sym, uint64_t n,
                     uint64_t* sig_sym, uint64_t expect, int peer, uint32_t warp_size,
                     void* stream) {
  gpunet::LaunchSpec s;
  s.grid = 1;
  s.block = warp_size;
  s.warp_size = warp_size;
  s.stream = stream;
  s.sync = false;
  return gpunet::launch_kernel(s, exchange, static_cast<const gpunet::DevCtx*>(ctx), dst_sym,
                               src_sym, n, sig_sym, expect, peer);
}

}  // extern "C"
