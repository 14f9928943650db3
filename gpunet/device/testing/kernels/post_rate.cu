// Test and benchmark support, not the API.
// Post-rate kernels for bench/device_post.py: how fast GPU warps put RDMA-WRITE WQEs into a
// host-mapped send queue through qp.cuh's warp-cooperative path (post_warp: one reservation per
// warp, lane i writes WQE i, lane 0 publishes: rings when the doorbell turn is its own, else tags).
//
//   k_post   warp w posts `iters` rounds of warp_size * per_lane 64-byte RDMA WRITEs on
//            qps[w % nqps] (post_warp, or post_warp_k when per_lane > 1), then lane 0 quiets that
//            QP (every WQE completed, as the consumer reports it).
//            mixed = 1 (tests/test_device_post.py): lane l posts an inline WRITE of 8 / 40 / 100 /
//            200 bytes (1 to 4 WQEBBs) into its own 256-byte slot, on nposts = ws - (w + it) % 3
//            lanes, so reservations differ in size and warps' WQEs interleave on the ring.
//   k_store  the ceiling: the same 64-byte WQE stores into the same kind of ring with no protocol
//            (no reservation, publish, doorbell or completion), as FACTS.md's 200 M/s row.
//
// Launchers time the kernel with CUDA events (HOST arm: steady_clock) and return 0 or the error.
//
// GPUNET_BENCH_PHASES (bench/device_post.py --phases): lane 0 of every warp clocks the posting
// path at qp.cuh's GPUNET_POST_STAMP(k) points (k = the phase that ENDS there; kPhases below) and
// k_post adds its warp's sums to g_phase; gpunet_bench_phases reads and clears them. Off by
// default: the stamps cost a clock read and a shared-memory add each.
#include <gpunet/arch.cuh>

#if defined(GPUNET_BENCH_PHASES) && defined(GPUNET_ARM_HOST)
#include <atomic>
#endif
#if defined(GPUNET_BENCH_PHASES)
namespace bench_phases {
constexpr int kPhases = 8;
#if defined(GPUNET_ARM_HOST)
thread_local uint64_t t_last, t_acc[kPhases];
std::atomic<uint64_t> g_phase[kPhases];
GPUNET_DEVICE uint64_t* acc() { return t_acc; }
GPUNET_DEVICE uint64_t* last() { return &t_last; }
GPUNET_DEVICE uint64_t clock() { return gpunet::arch::now_ns(); }
GPUNET_DEVICE void flush() {
  for (int k = 0; k < kPhases; ++k) g_phase[k] += t_acc[k];
}
#else
constexpr int kMaxWarps = 32;  // per block
__shared__ unsigned long long s_acc[kMaxWarps][kPhases];
__shared__ unsigned long long s_last[kMaxWarps];
__device__ unsigned long long g_phase[kPhases];
GPUNET_DEVICE uint64_t* acc() {
  return reinterpret_cast<uint64_t*>(s_acc[gpunet::arch::warp_id() % kMaxWarps]);
}
GPUNET_DEVICE uint64_t* last() {
  return reinterpret_cast<uint64_t*>(&s_last[gpunet::arch::warp_id() % kMaxWarps]);
}
GPUNET_DEVICE uint64_t clock() { return uint64_t(clock64()); }
GPUNET_DEVICE void flush() {
  for (int k = 0; k < kPhases; ++k) atomicAdd(&g_phase[k], (unsigned long long)acc()[k]);
}
#endif
GPUNET_DEVICE void start() {
  if (gpunet::arch::lane_id() != 0) return;
  for (int k = 0; k < kPhases; ++k) acc()[k] = 0;
  *last() = clock();
}
GPUNET_DEVICE void stamp(int k) {
  if (gpunet::arch::lane_id() != 0) return;
  const uint64_t now = clock();
  acc()[k] += now - *last();
  *last() = now;
}
}  // namespace bench_phases
#define GPUNET_POST_STAMP(k) ::bench_phases::stamp(k)
#endif

#include <gpunet/qp.cuh>

#if defined(GPUNET_ARM_HOST)
#include <chrono>
#endif

namespace arch = gpunet::arch;

namespace {

struct PostArgs {          // mirrored in bench/device_post.py (PostArgs)
  uint64_t qps;            // QpDesc[nqps], device memory
  uint64_t status;         // Status, device memory
  uint64_t timeout_ns;
  uint64_t raddr;          // WRITE destination base (the consumer never reads it in sink mode)
  uint64_t laddr;          // WRITE source base
  uint64_t span;           // bytes of the src/dst regions the WQEs cycle through (multiple of 64)
  uint32_t nqps;
  uint32_t iters;          // warp posts per warp (each warp_size WQEs)
  uint32_t rkey;
  uint32_t lkey;
  uint32_t nbytes;         // bytes per WRITE
  uint32_t do_quiet;       // 1: lane 0 quiets its QP at the end
  uint32_t per_lane;       // WQEs per lane per warp post: 1 = post_warp, k > 1 = post_warp_k
  uint32_t mixed;          // 1: inline WRITEs of mixed sizes (1-4 WQEBBs), 256-byte slots
};
static_assert(sizeof(PostArgs) == 80, "PostArgs is mirrored in bench/device_post.py");

// Inline WRITE sizes of mixed mode: 1, 2, 3, 4 WQEBBs.
GPUNET_DEVICE uint32_t mixed_bytes(uint32_t sel) { return sel == 0 ? 8 : sel == 1 ? 40 : sel == 2 ? 100 : 200; }

GPUNET_GLOBAL void k_post(PostArgs a) {
  const uint32_t ws = arch::warp_size(), lane = arch::lane_id();
  const arch::Dim3 b = arch::block_idx(), bd = arch::block_dim();
  const uint64_t gwarp = uint64_t(b.x) * ((bd.x + ws - 1) / ws) + arch::warp_id();
  // The QP's constants taken once, as a caller that posts in a loop does (qp.cuh QpRef).
  const gpunet::QpRef qp =
      gpunet::qp_ref(reinterpret_cast<gpunet::QpDesc*>(uintptr_t(a.qps)) + (gwarp % a.nqps));
  const gpunet::Waiter w{reinterpret_cast<gpunet::Status*>(uintptr_t(a.status)), a.timeout_ns};
  const uint64_t slots = a.span / 64 ? a.span / 64 : 1;
#if defined(GPUNET_BENCH_PHASES)
  bench_phases::start();
#endif
  bool ok = true;
  const uint32_t per = a.per_lane ? a.per_lane : 1;
  for (uint32_t it = 0; it < a.iters && ok; ++it) {
    if (a.mixed) {
      // Slot of WQE (warp, it, lane) is unique while iters * warps * ws * 256 <= span.
      const uint32_t nposts = ws - uint32_t((gwarp + it) % 3);
      const uint64_t k = ((gwarp * a.iters + it) * ws + lane) % (slots / 4 ? slots / 4 : 1);
      const uint32_t nb = lane < nposts ? mixed_bytes((lane + it) % 4) : 8;
      gpunet::Wqe q;
      gpunet::wqe_write_inline(q, a.raddr + k * 256, a.rkey,
                               reinterpret_cast<const uint8_t*>(uintptr_t(a.laddr + k * 256)), nb);
      ok = gpunet::post_warp(qp, w, q, nposts);
    } else if (per == 1) {
      const uint64_t k = ((gwarp * a.iters + it) * ws + lane) % slots;
      gpunet::Wqe q;
      gpunet::wqe_rdma(q, gpunet::mlx5::OPCODE_RDMA_WRITE, a.raddr + k * 64, a.rkey, a.laddr + k * 64,
                       a.lkey, a.nbytes);
      ok = gpunet::post_warp(qp, w, q, ws);
    } else {
      const uint64_t first = (gwarp * a.iters + it) * ws * per;
      ok = gpunet::post_warp_k(qp, w, per, [&](uint32_t j, gpunet::Wqe& q) {
        const uint64_t k = (first + uint64_t(j) * ws + lane) % slots;
        gpunet::wqe_rdma(q, gpunet::mlx5::OPCODE_RDMA_WRITE, a.raddr + k * 64, a.rkey,
                         a.laddr + k * 64, a.lkey, a.nbytes);
      });
    }
  }
#if defined(GPUNET_BENCH_PHASES)
  if (lane == 0) bench_phases::flush();
#endif
  if (a.do_quiet && lane == 0 && ok) gpunet::quiet(qp.qp, w);
  arch::syncwarp();
}

// Lane i of warp w stores 64-byte record (w * iters + it) * ws + i (mod ring) — 8 relaxed u64
// stores, like write_wqe — and nothing else; one fence_sys at the end.
GPUNET_GLOBAL void k_store(uint64_t ring, uint32_t ring_slots, uint32_t iters) {
  const uint32_t ws = arch::warp_size(), lane = arch::lane_id();
  const arch::Dim3 b = arch::block_idx(), bd = arch::block_dim();
  const uint64_t gwarp = uint64_t(b.x) * ((bd.x + ws - 1) / ws) + arch::warp_id();
  for (uint32_t it = 0; it < iters; ++it) {
    const uint64_t k = ((gwarp * iters + it) * ws + lane) & (ring_slots - 1);
    uint64_t* p = reinterpret_cast<uint64_t*>(uintptr_t(ring + k * 64));
    for (int i = 0; i < 8; ++i) arch::store_relaxed(p + i, k * 8 + i);
  }
  arch::fence_sys();
}

template <class K, class... Args>
int timed(uint32_t grid, uint32_t block, float* ms, K kernel, Args... args) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
#if defined(GPUNET_ARM_HOST)
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = gpunet::launch_kernel(s, kernel, args...);
  *ms = std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return rc;
#else
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  s.sync = false;
  cudaEventRecord(e0, 0);
  int rc = gpunet::launch_kernel(s, kernel, args...);
  cudaEventRecord(e1, 0);
  cudaError_t err = cudaEventSynchronize(e1);
  if (rc == 0) rc = int(err);
  if (rc == 0) rc = int(cudaGetLastError());
  cudaEventElapsedTime(ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return rc;
#endif
}

}  // namespace

extern "C" {

uint32_t gpunet_bench_post_args_size() { return sizeof(PostArgs); }

// grid x block threads (block a multiple of the warp size); *ms = kernel time. 0 or an error code.
// (PostArgs travels as void*: a type of the anonymous namespace in an extern "C" signature
// makes nvcc drop the symbol.)
int gpunet_bench_post(uint32_t grid, uint32_t block, const void* a, float* ms) {
  return timed(grid, block, ms, k_post, *static_cast<const PostArgs*>(a));
}

// k_post with the HOST arm's weak-memory model (ignored on GPUs): for tests. 0 or an error code.
int gpunet_test_post(uint32_t grid, uint32_t block, uint32_t warp_size, uint32_t weak, uint64_t seed,
                     const void* a) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = warp_size;
  s.weak = weak != 0;
  s.weak_seed = seed;
  s.weak_spin_sleep_ns = weak ? 2000 : 0;
  return gpunet::launch_kernel(s, k_post, *static_cast<const PostArgs*>(a));
}

// GPUNET_BENCH_PHASES builds: out[k] = the summed clock of phase k over every warp's lane 0
// since the last call (cycles on GPUs, ns on the HOST arm), then cleared. 0, or -1 when the build
// has no phase stamps.
int gpunet_bench_phases(uint64_t* out) {
#if defined(GPUNET_BENCH_PHASES)
#if defined(GPUNET_ARM_HOST)
  for (int k = 0; k < bench_phases::kPhases; ++k) out[k] = bench_phases::g_phase[k].exchange(0);
  return 0;
#else
  unsigned long long v[bench_phases::kPhases] = {};
  int rc = int(cudaMemcpyFromSymbol(v, bench_phases::g_phase, sizeof(v)));
  const unsigned long long zero[bench_phases::kPhases] = {};
  if (rc == 0) rc = int(cudaMemcpyToSymbol(bench_phases::g_phase, zero, sizeof(zero)));
  for (int k = 0; k < bench_phases::kPhases; ++k) out[k] = v[k];
  return rc;
#endif
#else
  (void)out;
  return -1;
#endif
}

int gpunet_bench_store(uint32_t grid, uint32_t block, uint64_t ring, uint32_t ring_slots, uint32_t iters,
                       float* ms) {
  return timed(grid, block, ms, k_store, ring, ring_slots, iters);
}

}  // extern "C"
