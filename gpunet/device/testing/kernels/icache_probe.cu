// Test and benchmark support, not the API. bench/icache.py: what straight-line code costs the
// first time an SM runs it in a launch (instruction fetch from L2 / HBM) against the second time
// (instruction caches warm). The EP kernels are hundreds of KB of SASS whose phases each run once
// per launch, so a cold fetch per KB of code is a fixed cost of every phase (bench/RESULTS.md).
//
//   k_icache<N>  one thread: for pass 0 and 1, read the SM clock, run N steps that each read
//                %clock into a register and xor it into an accumulator (a read of a special
//                register that ptxas can neither fold nor drop: 3 SASS instructions, ~48 B a
//                step), read the clock; out[pass] = cycles; out[2] = the accumulator (kept live).
//                The end read takes the accumulator as an input, so it cannot move above the
//                steps.
// CUDA arm only (the HOST arm has no instruction cache to measure).
#include <gpunet/gpunet.cuh>

#if defined(GPUNET_ARM_CUDA)
namespace {

template <uint32_t N>
__global__ void k_icache(unsigned long long* out) {
  uint32_t acc = threadIdx.x;
#pragma unroll 1
  for (uint32_t pass = 0; pass < 2; ++pass) {  // one copy of the code, run twice
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0) : "r"(acc) : "memory");
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) {
      uint32_t c;
      asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
      acc ^= c + i;
    }
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1) : "r"(acc) : "memory");
    out[pass] = t1 - t0;
  }
  out[2] = acc;
}

template <uint32_t N>
int run(unsigned long long* out) {
  k_icache<N><<<1, 1>>>(out);
  return cudaDeviceSynchronize() == cudaSuccess ? 0 : 1;
}

}  // namespace

extern "C" {
// Steps per pass: 256, 1024, 4096 (12, 48, 192 KB of SASS with nvcc 13.0, sm_90). out: 3 device words.
int gpunet_icache_probe(uint32_t n, unsigned long long* out) {
  switch (n) {
    case 1024: return run<1024>(out);
    case 4096: return run<4096>(out);
    case 256: return run<256>(out);
    default: return -1;
  }
}
}
#endif
