// Kernels of gpunet.ep's low-latency mode: one kernel runs an LlParams (dispatch or combine, send
// and/or receive phase, or the clean barrier) written in <gpunet/ep/ll.cuh>; gpunet/device/ep.py binds the
// extern "C" launcher. One source for every arm: g++ -x c++ (HOST) and nvcc (CUDA).
#include <gpunet/ep/ll.cuh>

namespace {

GPUNET_GLOBAL void k_ep_ll(const gpunet::ep::LlParams P) { gpunet::ep::run(P); }

// f32 -> e4m3 the way the dispatch kernel's quantiser converts (ll.cuh f32x2_to_e4m3x2: the
// hardware instruction on sm_89+), one pair of values per thread.
GPUNET_GLOBAL void k_e4m3(const float* in, uint8_t* out, uint64_t n) {
  const uint64_t i = 2 * gpunet::arch::global_thread_rank();
  if (i >= n) return;
  const float hi = i + 1 < n ? in[i + 1] : 0.0f;
  const uint16_t r = gpunet::ep::f32x2_to_e4m3x2(in[i], hi);
  out[i] = uint8_t(r);
  if (i + 1 < n) out[i + 1] = uint8_t(r >> 8);
}

}  // namespace

extern "C" {

// Sizes of the mirrored structs (gpunet/device/ep.py checks them at load).
uint32_t gpunet_ep_abi_size(uint32_t which) {
  switch (which) {
    case 0: return sizeof(gpunet::ep::LlParams);
    case 1: return sizeof(gpunet::ep::EpStatus);
    case 2: return sizeof(gpunet::DevCtx);
    default: return 0;
  }
}

// The most threads a block of k_ep_ll may have: on CUDA what the runtime says (its registers
// bound it: gpunet.ep.Buffer refuses a larger block_threads with that number instead of a failed
// launch); the HOST emulator takes up to 1024; 0 = not known (MACA: unverified, not asked).
uint32_t gpunet_ep_ll_max_block() {
#if defined(GPUNET_ARM_CUDA)
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, k_ep_ll) == cudaSuccess ? uint32_t(a.maxThreadsPerBlock) : 0;
#elif defined(GPUNET_ARM_HOST)
  return 1024;
#else
  return 0;
#endif
}

// Launch k_ep_ll on grid x block threads with the LlParams at `params` (host memory: passed by
// value, so a CUDA graph captures it). ws: the HOST arm's warp size (GPUs use theirs). stream: a
// cudaStream_t (0 = legacy default; HOST: ignored, synchronous). sync != 0: GPUs wait for the
// kernel and report its error. Returns 0 or the launch error.
int gpunet_ep_ll_launch(const void* params, uint32_t grid, uint32_t block, uint32_t ws, void* stream,
                        uint32_t sync) {
  namespace ep = gpunet::ep;
  const ep::LlParams P = *static_cast<const ep::LlParams*>(params);
  // shared memory: the blocks' copies of the peer mask and the controllers' per-peer words
  // (ll.cuh smem_view_bytes, smem_ctl_bytes)
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = ws;
  s.shared_bytes = ep::smem_view_bytes(P.nranks) + ep::smem_ctl_bytes(P.nranks);
  s.stream = stream;
  s.sync = sync != 0;
  return gpunet::launch_kernel(s, k_ep_ll, P);
}

// The numerics of ll.cuh for the tests (n values, host memory): bf16 <-> f32, f32 -> e4m3,
// the FP8 group scale.
void gpunet_ep_f32_to_e4m3(const float* in, uint8_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) out[i] = gpunet::ep::f32_to_e4m3(in[i]);
}
// The same on the device (in / out: device memory on GPUs, host memory on the HOST arm; n <= 2048
// there, the emulator's grid), waiting for the kernel. Returns 0 or the launch error.
int gpunet_ep_f32_to_e4m3_device(const float* in, uint8_t* out, uint64_t n) {
  gpunet::LaunchSpec s;
  s.block = 256;
  s.grid = uint32_t((n + 2 * s.block - 1) / (2 * s.block));
  if (s.grid == 0) return 0;
  s.sync = true;
  return gpunet::launch_kernel(s, k_e4m3, in, out, n);
}
void gpunet_ep_f32_to_bf16(const float* in, uint16_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) out[i] = gpunet::ep::f32_to_bf16(in[i]);
}
void gpunet_ep_group_scale(const float* amax, float* out, uint64_t n, uint32_t round) {
  for (uint64_t i = 0; i < n; ++i) out[i] = gpunet::ep::group_scale(amax[i], round != 0);
}

}  // extern "C"
