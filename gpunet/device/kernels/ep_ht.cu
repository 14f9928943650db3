// Kernels of gpunet.ep's high-throughput mode: one kernel runs an HtParams (dispatch notify and /
// or data, or combine) written in <gpunet/ep/ht.cuh>; gpunet/device/ep.py binds the extern "C" launcher.
// One source for every arm: g++ -x c++ (HOST) and nvcc (CUDA).
#include <gpunet/ep/ht.cuh>

namespace {

// CUDA: at most 128 registers a thread, so blocks of up to 16 warps launch (65536 registers an
// SM; bench/ep_ht.py sweeps 8 and 16). Without the bound nvcc took 198 (-Xptxas -v), and a
// 512-thread block could not launch at all.
#if defined(GPUNET_ARM_CUDA)
#define GPUNET_EP_HT_BOUNDS __launch_bounds__(512, 1)
#else
#define GPUNET_EP_HT_BOUNDS
#endif

// Two kernels: k_ep_ht<true> runs the launches that may split their in-place combine (F_HT_SPLIT),
// k_ep_ht<false> the others, without the split's code (ht.cuh run_ht).
template <bool kSplit>
GPUNET_GLOBAL void GPUNET_EP_HT_BOUNDS k_ep_ht(const gpunet::ep::HtParams P) {
  gpunet::ep::run_ht(P, kSplit);
}

}  // namespace

extern "C" {

// Sizes of the mirrored structs (gpunet/device/ep.py checks them at load).
uint32_t gpunet_ep_ht_abi_size(uint32_t which) {
  switch (which) {
    case 0: return sizeof(gpunet::ep::HtParams);
    case 1: return sizeof(gpunet::ep::EpStatus);
    case 2: return sizeof(gpunet::DevCtx);
    default: return 0;
  }
}

// Launch k_ep_ht on grid x block threads with the HtParams at `params` (host memory, passed by
// value). ws: the HOST arm's warp size. stream: a cudaStream_t (HOST: ignored, synchronous).
int gpunet_ep_ht_launch(const void* params, uint32_t grid, uint32_t block, uint32_t ws, void* stream,
                        uint32_t sync) {
  const gpunet::ep::HtParams& P = *static_cast<const gpunet::ep::HtParams*>(params);
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = ws;
  s.shared_bytes = size_t(gpunet::ep::ht_smem_bytes(P.base.nranks));  // the peer mask, ht_recv_words
  const bool split = (P.base.flags & gpunet::ep::F_HT_SPLIT) && P.base.op == gpunet::ep::OP_HT_COMBINE;
  const auto kernel = split ? k_ep_ht<true> : k_ep_ht<false>;
#if defined(GPUNET_ARM_CUDA)
  // ht.cuh "bulk copies": the warps' shared buffers where the GPU has the TMA (sm_90+) and can
  // give the bytes (above 48 KB a kernel must opt in); otherwise the kernel copies without them.
  // The device's answer is read once per device, not at every launch.
  const size_t bulk = size_t(gpunet::ep::ht_bulk_smem_bytes(P.base.nranks, block / 32));
  constexpr int kDevs = 64;
  static int optin_of[kDevs];  // 0: not read yet; -1: no TMA; else the opt-in shared bytes
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < kDevs && optin_of[dev] == 0) {
    int major = 0, optin = 0;
    const bool read = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess;
    optin_of[dev] = read && major >= 9 && optin > 0 ? optin : -1;
  }
  if (dev >= 0 && dev < kDevs && optin_of[dev] > 0 && size_t(optin_of[dev]) >= bulk) {
    static size_t granted_of[2][kDevs];  // the attribute (per kernel and device): the largest set
    size_t& granted = granted_of[split][dev];
    if (bulk > granted) {
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bulk)) == cudaSuccess)
        granted = bulk;
      else
        (void)cudaGetLastError();  // a refused attribute leaves no error for the launch's check
    }
    if (bulk <= granted) s.shared_bytes = bulk;
  }
#elif defined(GPUNET_ARM_HOST)
  // the HOST arm emulates the bulk copies (arch.cuh): warps of 32 take that path (as CUDA sm_90+
  // does), warps of 64 the loads and stores (as MACA does), so CI runs both
  if (ws == 32) s.shared_bytes = size_t(gpunet::ep::ht_bulk_smem_bytes(P.base.nranks, block / ws));
#endif
  s.stream = stream;
  s.sync = sync != 0;
  return gpunet::launch_kernel(s, kernel, P);
}

}  // extern "C"
