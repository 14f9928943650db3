// gpunet/arch.cuh — the one file that knows which arm device code is compiled for.
//
// Every other device header is written once against gpunet::arch. Three arms:
//   CUDA  nvcc (__CUDACC__, and not MACA)                        — compiled here (nvcc 13, sm_90)
//   MACA  mxcc / cu-bridge (__MACA__ or GPUNET_ARCH_MACA)        — NEVER compiled or run here
//   HOST  g++ -std=c++17 -DGPUNET_ARCH_HOST: device code on CPU threads, with the SIMT emulator
//         and the weak-memory model of host_simt.h                — what CI runs
// The arms stand side by side per primitive so a reader sees the whole difference at once
// (DESIGN.md "One device source, three arms").
//
// Vocabulary used by the rest of the device code:
//   *_sys      system scope: orders against the CPU and the NIC (host-mapped rings, DBRs, UAR).
//   relaxed    no ordering; for NIC-visible plain stores (WQE words, payload, doorbell) that a
//              later fence_sys / store_release_sys publishes.
//   atomic_*   device-scope atomics on counters only GPU threads touch (slot reservation,
//              ready heads). They are RELAXED (as CUDA's atomicAdd/atomicCAS are): a publish
//              protocol fences before them when it needs ordering.
//
// Primitives (T in {u8,u16,u32,u64} where templated):
//   u32/u64 load_acquire_sys(const u32*/u64*)       void store_release_sys(u32*/u64*, v)
//   u64 load_acquire_gpu(const u64*)                 void store_release_gpu(u64*, v)
//              (device scope: for words only GPU threads exchange; see qp.cuh's publish)
//   T load_relaxed(const T*)                         void store_relaxed(T*, T)
//   u32/u64 load_const(const u32*/u64*)   (a word nobody writes while a kernel runs, e.g. a
//              descriptor's constants: the read-only cache path)
//   void store_relaxed_v2(u64* p, u64 w0, u64 w1)    (16 bytes at a 16-byte aligned p: one
//              vector store on the GPUs; a WQE segment is written with one of them)
//   void store_weak_v2(u64* p, u64 w0, u64 w1)       (the same 16 bytes as a WEAK vector store:
//              a bulk copy's, visible at the kernel's end or a later fence; never for words
//              another thread polls)
//   void fence_sys()
//   u32/u64 atomic_add(p, v) -> old                  u32/u64 atomic_cas(p, expected, desired) -> old
//   u32 atomic_max(p, v) -> old      (native on shared memory)
//   u32/u64 atomic_or(p, v) -> old   (32-bit: native on shared memory; the 64-bit one is a CAS
//              loop there on CUDA sm_90, ATOMS.CAST.SPIN.64)
//   u32/u64 atomic_load(const p)                     void atomic_store(p, v)
//   bswap16/32/64                                    void doorbell_store64(volatile u64* reg, u64)
//   u64 now_ns()                                     void spin_pause()
//   void wait_previous_grid()  void launch_dependents()   (a launch with
//              LaunchSpec::overlap_previous: see there)
//   lane_id() warp_size() warp_id() thread_rank() thread_idx() block_idx() block_dim() grid_dim()
//   u64 global_thread_rank()   (rank in the whole launch: blocks in x, y, z order)
//   syncthreads() syncwarp() shfl(v, src) ballot(pred)->u64 any(pred) all(pred) block_any(pred)
//   uint8_t* shared_mem()   (dynamic shared memory: the launch's shared size)
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(GPUNET_ARCH_HOST)
#define GPUNET_ARM_HOST 1
#elif defined(__MACA__) || defined(GPUNET_ARCH_MACA)
#define GPUNET_ARM_MACA 1
#elif defined(__CUDACC__)
#define GPUNET_ARM_CUDA 1
#else
#error "gpunet/arch.cuh: compile with nvcc (CUDA), mxcc/cucc with GPUNET_ARCH_MACA, or g++ -DGPUNET_ARCH_HOST"
#endif

#if defined(GPUNET_ARM_HOST)
#include <time.h>
#include <cstdio>
#include <cstring>
#include <thread>
#include "host_simt.h"
#define GPUNET_DEVICE inline
#define GPUNET_HOST_DEVICE inline
#define GPUNET_GLOBAL
#else
#define GPUNET_DEVICE __device__ __forceinline__
#define GPUNET_HOST_DEVICE __host__ __device__ __forceinline__
#define GPUNET_GLOBAL __global__
#endif

namespace gpunet::arch {

struct Dim3 {
  uint32_t x, y, z;
};

#if defined(GPUNET_ARM_CUDA)
// ================================================================================================
// CUDA arm (sm_70+; built for sm_90 here). PTX memory-model instructions, system scope where the
// observer is the CPU or the NIC. Compiled in CI with nvcc 13 (tests/test_device_arch.py) and
// run on the H200 by scripts/gpu-check.sh; the fence/acquire/release choices follow DESIGN.md's
// table.
// ================================================================================================
constexpr uint32_t kMaxWarpSize = 32;

GPUNET_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
GPUNET_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
GPUNET_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
GPUNET_DEVICE void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
GPUNET_DEVICE uint64_t load_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
GPUNET_DEVICE void store_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Relaxed NIC-visible stores/loads: volatile so the compiler neither drops, merges nor caches
// them; the ordering comes from the fence/release that follows.
template <class T>
GPUNET_DEVICE void store_relaxed(T* p, T v) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  *const_cast<volatile T*>(p) = v;
}
template <class T>
GPUNET_DEVICE T load_relaxed(const T* p) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  return *const_cast<const volatile T*>(p);
}
// ld.global.nc through __ldg: the read-only path, and a load the compiler treats as a load (it
// neither speculates it past a branch nor hoists it out of a loop with fences in it). A pure
// asm (no volatile, no memory clobber) was hoisted, which took a one-warp post from 14.7-14.9 to
// 16.0 M WQE/s, but the compiler may also run such an asm on paths the code does not take, and
// with it bench/p2p.py's ping-pong kernel faulted with an illegal address on the H200 (the site
// was not pinned down; bench/RESULTS.md, sixteenth session). Guard: tests/test_device_arch.py
// test_load_const_is_not_speculated_past_a_branch.
GPUNET_DEVICE uint32_t load_const(const uint32_t* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
GPUNET_DEVICE uint64_t load_const(const uint64_t* p) {
  return __ldg(reinterpret_cast<const unsigned long long*>(p));
}
GPUNET_DEVICE void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Sequentially consistent at device scope: a release / acquire for words only this GPU's threads
// exchange (qp.cuh's publish tag, p2p peers on one GPU); costs no wait for the host or the NIC.
GPUNET_DEVICE void fence_gpu() { asm volatile("fence.sc.gpu;" ::: "memory"); }
// One 16-byte vector store (st.volatile.v2.u64): a WQE segment in one instruction. Volatile like
// store_relaxed; p must be 16-byte aligned (SQ slots are).
GPUNET_DEVICE void store_relaxed_v2(uint64_t* p, uint64_t w0, uint64_t w1) {
  asm volatile("st.volatile.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(w0), "l"(w1) : "memory");
}
// A weak (non-volatile) st.global.v2.u64: what a copy kernel stores; the asm stays in place for
// the compiler (memory clobber), the hardware may combine it like any weak store.
GPUNET_DEVICE void store_weak_v2(uint64_t* p, uint64_t w0, uint64_t w1) {
  asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(w0), "l"(w1) : "memory");
}

GPUNET_DEVICE uint32_t atomic_add(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }
GPUNET_DEVICE uint64_t atomic_add(uint64_t* p, uint64_t v) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
GPUNET_DEVICE uint32_t atomic_or(uint32_t* p, uint32_t v) { return atomicOr(p, v); }
GPUNET_DEVICE uint32_t atomic_max(uint32_t* p, uint32_t v) { return atomicMax(p, v); }
GPUNET_DEVICE uint64_t atomic_or(uint64_t* p, uint64_t v) {
  return atomicOr(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
GPUNET_DEVICE uint32_t atomic_cas(uint32_t* p, uint32_t expected, uint32_t desired) {
  return atomicCAS(p, expected, desired);
}
GPUNET_DEVICE uint64_t atomic_cas(uint64_t* p, uint64_t expected, uint64_t desired) {
  return atomicCAS(reinterpret_cast<unsigned long long*>(p), (unsigned long long)expected,
                   (unsigned long long)desired);
}
GPUNET_DEVICE uint32_t atomic_load(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
GPUNET_DEVICE uint64_t atomic_load(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
GPUNET_DEVICE void atomic_store(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
GPUNET_DEVICE void atomic_store(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// prmt (__byte_perm) selectors: result byte n takes source byte selector[n]; 4 = a zero byte of y.
GPUNET_DEVICE uint16_t bswap16(uint16_t x) { return uint16_t(__byte_perm(x, 0u, 0x4401)); }
GPUNET_DEVICE uint32_t bswap32(uint32_t x) { return __byte_perm(x, 0u, 0x0123); }
GPUNET_DEVICE uint64_t bswap64(uint64_t x) {
  return (uint64_t(bswap32(uint32_t(x))) << 32) | bswap32(uint32_t(x >> 32));
}

// The UAR doorbell: one 64-bit MMIO store (FACTS.md "ringing a send doorbell"). Volatile keeps it
// a single st.u64 the compiler cannot split or drop; ordering before it is the caller's fence.
GPUNET_DEVICE void doorbell_store64(volatile uint64_t* reg, uint64_t v) { *reg = v; }

// %globaltimer: a ns-resolution global clock (updates every ~µs), good enough for bounds in ms.
GPUNET_DEVICE uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Back off a little so a spinning warp leaves issue slots (and PCIe) to others (FACTS.md: FIFO
// producers spinning on a host-memory tail collapsed throughput 10x).
GPUNET_DEVICE void spin_pause() { __nanosleep(64); }
// Programmatic dependent launch (sm_90+; LaunchSpec::overlap_previous). wait_previous_grid:
// returns once the kernel before this one in the stream has completed and its memory operations
// are visible (at once when there is none, or the launch did not overlap). launch_dependents:
// the next overlapping kernel in the stream may start now (it still waits in its own
// wait_previous_grid for this one to end).
GPUNET_DEVICE void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
GPUNET_DEVICE void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

GPUNET_DEVICE Dim3 thread_idx() { return Dim3{threadIdx.x, threadIdx.y, threadIdx.z}; }
GPUNET_DEVICE Dim3 block_idx() { return Dim3{blockIdx.x, blockIdx.y, blockIdx.z}; }
GPUNET_DEVICE Dim3 block_dim() { return Dim3{blockDim.x, blockDim.y, blockDim.z}; }
GPUNET_DEVICE Dim3 grid_dim() { return Dim3{gridDim.x, gridDim.y, gridDim.z}; }
GPUNET_DEVICE uint32_t thread_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
GPUNET_DEVICE uint32_t warp_size() { return 32; }
GPUNET_DEVICE uint32_t lane_id() {
  uint32_t l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}
GPUNET_DEVICE uint32_t warp_id() { return thread_rank() / 32; }

GPUNET_DEVICE void syncthreads() { __syncthreads(); }
GPUNET_DEVICE void syncwarp() { __syncwarp(); }
// Full mask: every non-exited lane must take part (CUDA's *_sync rule; exited lanes are fine).
template <class T>
GPUNET_DEVICE T shfl(T v, uint32_t src_lane) { return __shfl_sync(0xffffffffu, v, int(src_lane)); }
GPUNET_DEVICE uint64_t ballot(bool pred) { return uint64_t(__ballot_sync(0xffffffffu, pred)); }
GPUNET_DEVICE bool any(bool pred) { return __any_sync(0xffffffffu, pred) != 0; }
GPUNET_DEVICE bool all(bool pred) { return __all_sync(0xffffffffu, pred) != 0; }
// One bar.red.or: the whole block gets the same answer, so it can leave a wait together
// (DESIGN.md "Waits are bounded": no divergent __syncthreads).
GPUNET_DEVICE bool block_any(bool pred) { return __syncthreads_or(pred) != 0; }

GPUNET_DEVICE uint8_t* shared_mem() {
  extern __shared__ __align__(16) uint8_t gpunet_dynamic_smem[];
  return gpunet_dynamic_smem;
}

// Bulk copies through the Tensor Memory Accelerator (sm_90+: cp.async.bulk, no tensor map):
// global -> shared completes on an mbarrier (expected bytes), shared -> global in bulk groups.
// A warp's lane issues a whole piece of a row at once, so the bytes in flight do not cost
// registers (ht.cuh "bulk copies" says where and why). Only where GPUNET_ARCH_HAS_BULK_COPY is
// defined: the device pass for sm_90+, and the HOST arm's emulation (below, for CI); MACA and
// older GPUs copy with loads and stores.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GPUNET_ARCH_HAS_BULK_COPY 1
GPUNET_DEVICE uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// The launch's dynamic shared memory in bytes (the kernel checks a launcher asked for enough).
GPUNET_DEVICE uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
// One arrival (the thread that arms it with the bytes it expects) completes a phase.
GPUNET_DEVICE void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
GPUNET_DEVICE bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return done != 0;
}
// bar's one arrival for its current phase, which then completes when `bytes` more have landed
// through bulk_load_tx (several loads into one phase: arm it with their sum first).
GPUNET_DEVICE void bulk_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// bytes (a multiple of 16, both ends 16-byte aligned) from global src into shared dst, counted
// on bar's armed phase.
GPUNET_DEVICE void bulk_load_tx(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// One load that is a phase of its own: bar's phase completes when the bytes have landed.
GPUNET_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  bulk_expect(bar, bytes);
  bulk_load_tx(dst, src, bytes, bar);
}
// bytes from shared src to global dst, as one bulk group.
GPUNET_DEVICE void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)),
               "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Every bulk store of this thread has read its shared source (the buffer may be written again).
GPUNET_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Every bulk store of this thread is complete; then generic-proxy accesses are ordered after it.
GPUNET_DEVICE void bulk_wait_done() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// What this thread's generic-proxy accesses saw or wrote (an acquired tail or credit, the
// stores before a block barrier) is ordered before its next bulk copy (the async proxy).
GPUNET_DEVICE void bulk_fence_proxy() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// The same for shared memory: the warp's reads of a bulk buffer (after a syncwarp) before the
// next bulk load into it.
GPUNET_DEVICE void bulk_fence_proxy_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

// Two floats to float8 e4m3fn in one instruction (sm_89+): round to nearest even, finite results
// saturate to +-448; `lo` lands in the low byte. Only where GPUNET_ARCH_HAS_E4M3X2 is defined (the
// device pass for sm_89+); the other arms and older GPUs convert in software (gpunet/ep/ll.cuh
// f32_to_e4m3, bit-identical: tests/test_ep_cuda.py compares the two on every code and midpoint).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define GPUNET_ARCH_HAS_E4M3X2 1
GPUNET_DEVICE uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

#elif defined(GPUNET_ARM_MACA)
// ================================================================================================
// MACA arm (MetaX C500). NEVER compiled or run here: no MACA toolchain or C500 is available.
// It rests on FACTS.md "MetaX C500 / MACA":
//   - the MACA compiler does not reliably compile PTX acquire/release, so there is no inline PTX;
//     acquire = volatile load THEN __threadfence_system() (later accesses cannot move above the
//     load), release = __threadfence_system() THEN volatile store (earlier accesses cannot move
//     below it). Mooncake fences *before* its acquire load; that is not an acquire.
//   - byte swaps with shifts and masks (no prmt).
//   - warp size 64 on C500 (a UCCL windowed publish that assumed 32 broke).
// Unverified, kept here and nowhere else: the warp intrinsic names (HIP-style __shfl/__ballot/
// __any/__all, 64-bit ballot), __syncthreads_or, __syncwarp, the 32- and 64-bit atomicOr (HIP
// and CUDA both have them), and the clock64() rate used by
// now_ns(). Check them on the first C500 build.
// ================================================================================================
constexpr uint32_t kMaxWarpSize = 64;

GPUNET_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v = *const_cast<const volatile uint32_t*>(p);
  __threadfence_system();
  return v;
}
GPUNET_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v = *const_cast<const volatile uint64_t*>(p);
  __threadfence_system();
  return v;
}
GPUNET_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  __threadfence_system();
  *const_cast<volatile uint32_t*>(p) = v;
}
GPUNET_DEVICE void store_release_sys(uint64_t* p, uint64_t v) {
  __threadfence_system();
  *const_cast<volatile uint64_t*>(p) = v;
}
GPUNET_DEVICE uint64_t load_acquire_gpu(const uint64_t* p) {
  uint64_t v = *const_cast<const volatile uint64_t*>(p);
  __threadfence();
  return v;
}
GPUNET_DEVICE void store_release_gpu(uint64_t* p, uint64_t v) {
  __threadfence();
  *const_cast<volatile uint64_t*>(p) = v;
}
template <class T>
GPUNET_DEVICE void store_relaxed(T* p, T v) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  *const_cast<volatile T*>(p) = v;
}
template <class T>
GPUNET_DEVICE T load_relaxed(const T* p) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  return *const_cast<const volatile T*>(p);
}
// A plain load (UNVERIFIED on MACA whether a read-only cache path exists; the CUDA arm's reason).
GPUNET_DEVICE uint32_t load_const(const uint32_t* p) { return *p; }
GPUNET_DEVICE uint64_t load_const(const uint64_t* p) { return *p; }
GPUNET_DEVICE void fence_sys() { __threadfence_system(); }
GPUNET_DEVICE void fence_gpu() { __threadfence(); }
// UNVERIFIED on MACA: two 8-byte volatile stores; a 16-byte vector store intrinsic is to be
// confirmed on the first C500 build (the publish protocol does not rely on the store's width).
GPUNET_DEVICE void store_relaxed_v2(uint64_t* p, uint64_t w0, uint64_t w1) {
  store_relaxed(p, w0);
  store_relaxed(p + 1, w1);
}
GPUNET_DEVICE void store_weak_v2(uint64_t* p, uint64_t w0, uint64_t w1) { store_relaxed_v2(p, w0, w1); }

GPUNET_DEVICE uint32_t atomic_add(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }
GPUNET_DEVICE uint64_t atomic_add(uint64_t* p, uint64_t v) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
GPUNET_DEVICE uint32_t atomic_or(uint32_t* p, uint32_t v) { return atomicOr(p, v); }
GPUNET_DEVICE uint32_t atomic_max(uint32_t* p, uint32_t v) { return atomicMax(p, v); }
GPUNET_DEVICE uint64_t atomic_or(uint64_t* p, uint64_t v) {
  return atomicOr(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
GPUNET_DEVICE uint32_t atomic_cas(uint32_t* p, uint32_t expected, uint32_t desired) {
  return atomicCAS(p, expected, desired);
}
GPUNET_DEVICE uint64_t atomic_cas(uint64_t* p, uint64_t expected, uint64_t desired) {
  return atomicCAS(reinterpret_cast<unsigned long long*>(p), (unsigned long long)expected,
                   (unsigned long long)desired);
}
// Aligned volatile accesses of <= 8 bytes are assumed single-copy atomic (unverified on C500).
GPUNET_DEVICE uint32_t atomic_load(const uint32_t* p) { return *const_cast<const volatile uint32_t*>(p); }
GPUNET_DEVICE uint64_t atomic_load(const uint64_t* p) { return *const_cast<const volatile uint64_t*>(p); }
GPUNET_DEVICE void atomic_store(uint32_t* p, uint32_t v) { *const_cast<volatile uint32_t*>(p) = v; }
GPUNET_DEVICE void atomic_store(uint64_t* p, uint64_t v) { *const_cast<volatile uint64_t*>(p) = v; }

GPUNET_DEVICE uint16_t bswap16(uint16_t x) { return uint16_t((x >> 8) | (x << 8)); }
GPUNET_DEVICE uint32_t bswap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0x0000ff00u) | ((x << 8) & 0x00ff0000u) | (x << 24);
}
GPUNET_DEVICE uint64_t bswap64(uint64_t x) {
  return (uint64_t(bswap32(uint32_t(x))) << 32) | bswap32(uint32_t(x >> 32));
}
GPUNET_DEVICE void doorbell_store64(volatile uint64_t* reg, uint64_t v) { *reg = v; }

// UNVERIFIED: clock64() counts core cycles at an unknown, possibly varying rate on C500.
// GPUNET_MACA_CLOCK_MHZ converts it; a wrong value scales every device timeout by the same
// factor (bounded waits stay bounded). Replace with a wall clock once one is confirmed.
#ifndef GPUNET_MACA_CLOCK_MHZ
#define GPUNET_MACA_CLOCK_MHZ 1500
#endif
GPUNET_DEVICE uint64_t now_ns() { return uint64_t(clock64()) * 1000u / GPUNET_MACA_CLOCK_MHZ; }
GPUNET_DEVICE void spin_pause() {}  // no sleep intrinsic known on MACA
// No programmatic dependent launch on MACA (launch_kernel ignores overlap_previous there).
GPUNET_DEVICE void wait_previous_grid() {}
GPUNET_DEVICE void launch_dependents() {}

GPUNET_DEVICE Dim3 thread_idx() { return Dim3{threadIdx.x, threadIdx.y, threadIdx.z}; }
GPUNET_DEVICE Dim3 block_idx() { return Dim3{blockIdx.x, blockIdx.y, blockIdx.z}; }
GPUNET_DEVICE Dim3 block_dim() { return Dim3{blockDim.x, blockDim.y, blockDim.z}; }
GPUNET_DEVICE Dim3 grid_dim() { return Dim3{gridDim.x, gridDim.y, gridDim.z}; }
GPUNET_DEVICE uint32_t thread_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
GPUNET_DEVICE uint32_t warp_size() { return 64; }
GPUNET_DEVICE uint32_t lane_id() { return thread_rank() % 64; }
GPUNET_DEVICE uint32_t warp_id() { return thread_rank() / 64; }

GPUNET_DEVICE void syncthreads() { __syncthreads(); }
GPUNET_DEVICE void syncwarp() { __syncwarp(); }  // UNVERIFIED name on MACA
template <class T>
GPUNET_DEVICE T shfl(T v, uint32_t src_lane) { return __shfl(v, int(src_lane)); }  // UNVERIFIED
GPUNET_DEVICE uint64_t ballot(bool pred) { return uint64_t(__ballot(pred)); }       // UNVERIFIED
GPUNET_DEVICE bool any(bool pred) { return __any(pred) != 0; }                      // UNVERIFIED
GPUNET_DEVICE bool all(bool pred) { return __all(pred) != 0; }                      // UNVERIFIED
GPUNET_DEVICE bool block_any(bool pred) { return __syncthreads_or(pred) != 0; }     // UNVERIFIED

GPUNET_DEVICE uint8_t* shared_mem() {
  extern __shared__ __align__(16) uint8_t gpunet_dynamic_smem[];
  return gpunet_dynamic_smem;
}

#else  // GPUNET_ARM_HOST
// ================================================================================================
// HOST arm: g++ atomics on CPU threads, run by host_simt.h's emulator. In strong mode every
// primitive is the C++ atomic of the named order; in weak mode (LaunchOptions::weak) NIC-visible
// stores go through a per-thread store buffer with the rules written at the top of host_simt.h.
// ================================================================================================
constexpr uint32_t kMaxWarpSize = 64;

namespace hd = ::gpunet::host::detail;

template <class T>
GPUNET_DEVICE T host_load(const T* p, int mo) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  if (hd::ThreadCtx* c = hd::weak_ctx())
    return T(hd::weak_load(c, reinterpret_cast<uintptr_t>(p), sizeof(T), mo));
  return __atomic_load_n(p, mo);
}
template <class T>
GPUNET_DEVICE void host_store(T* p, T v, int mo) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "1/2/4/8 bytes");
  using U = std::conditional_t<sizeof(T) == 1, uint8_t,
            std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>;
  if (hd::ThreadCtx* c = hd::weak_ctx()) {
    hd::weak_store(c, reinterpret_cast<uintptr_t>(p), sizeof(T), uint64_t(U(v)), mo == __ATOMIC_RELEASE);
    return;
  }
  __atomic_store_n(p, v, mo);
}

GPUNET_DEVICE uint32_t load_acquire_sys(const uint32_t* p) { return host_load(p, __ATOMIC_ACQUIRE); }
GPUNET_DEVICE uint64_t load_acquire_sys(const uint64_t* p) { return host_load(p, __ATOMIC_ACQUIRE); }
GPUNET_DEVICE void store_release_sys(uint32_t* p, uint32_t v) { host_store(p, v, __ATOMIC_RELEASE); }
GPUNET_DEVICE void store_release_sys(uint64_t* p, uint64_t v) { host_store(p, v, __ATOMIC_RELEASE); }
// One memory on the HOST arm: device scope is system scope (the weak model buffers it the same).
GPUNET_DEVICE uint64_t load_acquire_gpu(const uint64_t* p) { return host_load(p, __ATOMIC_ACQUIRE); }
GPUNET_DEVICE void store_release_gpu(uint64_t* p, uint64_t v) { host_store(p, v, __ATOMIC_RELEASE); }
template <class T>
GPUNET_DEVICE void store_relaxed(T* p, T v) { host_store(p, v, __ATOMIC_RELAXED); }
template <class T>
GPUNET_DEVICE T load_relaxed(const T* p) { return host_load(p, __ATOMIC_RELAXED); }
// A word nobody writes while the kernel runs: a plain load (no weak-memory buffering to model).
GPUNET_DEVICE uint32_t load_const(const uint32_t* p) { return *p; }
GPUNET_DEVICE uint64_t load_const(const uint64_t* p) { return *p; }
// Two relaxed 8-byte stores: in weak mode they enter the store buffer separately and may become
// visible in either order, which is weaker than one vector store, so every protocol that passes
// here (the NIC reads WQE segments only after a release) passes with the real store too.
GPUNET_DEVICE void store_relaxed_v2(uint64_t* p, uint64_t w0, uint64_t w1) {
  host_store(p, w0, __ATOMIC_RELAXED);
  host_store(p + 1, w1, __ATOMIC_RELAXED);
}
// Weak or relaxed is one thing in the model: two buffered relaxed stores.
GPUNET_DEVICE void store_weak_v2(uint64_t* p, uint64_t w0, uint64_t w1) { store_relaxed_v2(p, w0, w1); }
GPUNET_DEVICE void fence_sys() {
  if (hd::ThreadCtx* c = hd::weak_ctx()) hd::drain_all(c);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
// One memory on the HOST arm: a device-scope fence is a system-scope one.
GPUNET_DEVICE void fence_gpu() { fence_sys(); }

template <class T>
GPUNET_DEVICE void host_before_rmw(T* p) {
  if (hd::ThreadCtx* c = hd::weak_ctx()) hd::weak_before_rmw(c, reinterpret_cast<uintptr_t>(p), sizeof(T));
}
GPUNET_DEVICE uint32_t atomic_add(uint32_t* p, uint32_t v) {
  host_before_rmw(p);
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
GPUNET_DEVICE uint64_t atomic_add(uint64_t* p, uint64_t v) {
  host_before_rmw(p);
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
GPUNET_DEVICE uint32_t atomic_or(uint32_t* p, uint32_t v) {
  host_before_rmw(p);
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
GPUNET_DEVICE uint32_t atomic_max(uint32_t* p, uint32_t v) {
  host_before_rmw(p);
  uint32_t old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
GPUNET_DEVICE uint64_t atomic_or(uint64_t* p, uint64_t v) {
  host_before_rmw(p);
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
GPUNET_DEVICE uint32_t atomic_cas(uint32_t* p, uint32_t expected, uint32_t desired) {
  host_before_rmw(p);
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;  // the old value either way
}
GPUNET_DEVICE uint64_t atomic_cas(uint64_t* p, uint64_t expected, uint64_t desired) {
  host_before_rmw(p);
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
GPUNET_DEVICE uint32_t atomic_load(const uint32_t* p) { return host_load(p, __ATOMIC_RELAXED); }
GPUNET_DEVICE uint64_t atomic_load(const uint64_t* p) { return host_load(p, __ATOMIC_RELAXED); }
GPUNET_DEVICE void atomic_store(uint32_t* p, uint32_t v) { host_store(p, v, __ATOMIC_RELAXED); }
GPUNET_DEVICE void atomic_store(uint64_t* p, uint64_t v) { host_store(p, v, __ATOMIC_RELAXED); }

GPUNET_DEVICE uint16_t bswap16(uint16_t x) { return __builtin_bswap16(x); }
GPUNET_DEVICE uint32_t bswap32(uint32_t x) { return __builtin_bswap32(x); }
GPUNET_DEVICE uint64_t bswap64(uint64_t x) { return __builtin_bswap64(x); }

// In weak mode the doorbell is one more relaxed store in the buffer (R1): without a fence before
// it, it can become visible before the DBR and WQEs it announces — the bug the model exists for.
GPUNET_DEVICE void doorbell_store64(volatile uint64_t* reg, uint64_t v) {
  host_store(const_cast<uint64_t*>(reg), v, __ATOMIC_RELAXED);
}

GPUNET_DEVICE uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}
// Launches are synchronous on the HOST arm: the previous kernel has always ended.
GPUNET_DEVICE void wait_previous_grid() {}
GPUNET_DEVICE void launch_dependents() {}
// Yield so spin loops do not starve the emulator's other threads or the soft NIC (P1 in weak
// mode: one pending store becomes visible per turn). In strong mode the registered progress
// hooks (host_simt.h: the soft NIC's engine pass) run first; when they did work, no yield.
GPUNET_DEVICE void spin_pause() {
  if (hd::ThreadCtx* c = hd::weak_ctx()) {
    hd::pop_some(c);
    if (c->weak->spin_sleep_ns) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(c->weak->spin_sleep_ns));
      return;
    }
  } else if (hd::run_progress() > 0) {
    return;
  }
  std::this_thread::yield();
}

// Outside a launch a caller is a lone thread: block and grid of one, lane 0 of a 32-lane warp
// whose other lanes have exited.
GPUNET_DEVICE Dim3 thread_idx() {
  const hd::ThreadCtx* c = hd::tl_ctx;
  return c ? Dim3{c->tid.x, c->tid.y, c->tid.z} : Dim3{0, 0, 0};
}
GPUNET_DEVICE Dim3 block_idx() {
  const hd::ThreadCtx* c = hd::tl_ctx;
  return c ? Dim3{c->bid.x, c->bid.y, c->bid.z} : Dim3{0, 0, 0};
}
GPUNET_DEVICE Dim3 block_dim() {
  const hd::ThreadCtx* c = hd::tl_ctx;
  return c ? Dim3{c->bdim.x, c->bdim.y, c->bdim.z} : Dim3{1, 1, 1};
}
GPUNET_DEVICE Dim3 grid_dim() {
  const hd::ThreadCtx* c = hd::tl_ctx;
  return c ? Dim3{c->gdim.x, c->gdim.y, c->gdim.z} : Dim3{1, 1, 1};
}
GPUNET_DEVICE uint32_t thread_rank() { return hd::tl_ctx ? hd::tl_ctx->linear_tid : 0; }
GPUNET_DEVICE uint32_t warp_size() { return hd::tl_ctx ? hd::tl_ctx->warp_size : 32; }
GPUNET_DEVICE uint32_t lane_id() { return hd::tl_ctx ? hd::tl_ctx->lane : 0; }
GPUNET_DEVICE uint32_t warp_id() { return hd::tl_ctx ? hd::tl_ctx->warp : 0; }

// A barrier hands the caller's pending weak stores to its block first (B1).
GPUNET_DEVICE hd::SyncGroup::Result host_warp_collective(uint64_t value, bool pred, bool is_barrier) {
  hd::ThreadCtx* c = hd::tl_ctx;
  if (!c) {
    static thread_local uint64_t lone[64];
    lone[0] = value;
    return hd::SyncGroup::Result{1, pred ? 1u : 0u, pred ? 1u : 0u, lone};
  }
  if (is_barrier && hd::weak_ctx()) hd::handoff_to_block(c);
  // P3 (host_simt.h): a non-barrier collective first makes the caller's own buffered stores
  // visible (barriers keep B1). Reason: the caller may block here until its lane-mates arrive, and
  // hardware drains a blocked thread's stores; without the drain a lock released by a buffered
  // store_release_sys before a shfl/all would stay held, and lane-mates spinning on it would never
  // arrive (a deadlock no GPU has). Early visibility is always legal. Exercised by the weak-mode
  // warp posts of tests/test_ordering.py and tests/test_device_qp.py.
  if (!is_barrier && hd::weak_ctx()) c->buf.drain(c->rng, c->weak->order);
  return c->warpg->arrive(c->lane, value, pred);
}
GPUNET_DEVICE bool host_block_barrier(bool pred) {
  hd::ThreadCtx* c = hd::tl_ctx;
  if (!c) return pred;
  if (hd::weak_ctx()) hd::handoff_to_block(c);
  return c->block->bar->arrive(c->linear_tid, 0, pred).any != 0;
}

GPUNET_DEVICE void syncthreads() { host_block_barrier(false); }
GPUNET_DEVICE void syncwarp() { host_warp_collective(0, false, true); }
// Every non-exited lane must call it; a source lane that has exited yields the caller's value.
template <class T>
GPUNET_DEVICE T shfl(T v, uint32_t src_lane) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shfl moves up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  auto r = host_warp_collective(bits, false, false);
  const uint32_t src = src_lane % warp_size();
  if (!((r.mask >> src) & 1)) return v;
  T out;
  std::memcpy(&out, &r.vals[src], sizeof(T));
  return out;
}
GPUNET_DEVICE uint64_t ballot(bool pred) {
  auto r = host_warp_collective(pred ? 1 : 0, pred, false);
  uint64_t m = 0;
  for (uint32_t l = 0; l < 64; ++l)
    if (((r.mask >> l) & 1) && r.vals[l]) m |= uint64_t(1) << l;
  return m;
}
GPUNET_DEVICE bool any(bool pred) { return host_warp_collective(0, pred, false).any != 0; }
GPUNET_DEVICE bool all(bool pred) { return host_warp_collective(0, pred, false).all != 0; }
GPUNET_DEVICE bool block_any(bool pred) { return host_block_barrier(pred); }

GPUNET_DEVICE uint8_t* shared_mem() {
  static thread_local uint8_t lone[16];
  return hd::tl_ctx ? hd::tl_ctx->block->smem.data() : lone;
}

// Bulk copies (the CUDA arm's TMA primitives, same names and contract), emulated so that the
// code paths that use them (ht.cuh "bulk copies") run in CI: a load lands at once, a store is a
// copy. The barrier word's low 32 bits count completed phases, its high 32 the bytes its armed
// phase still waits for: a phase completes when its arrival has come (bulk_expect) and its bytes
// have landed, whichever is last. Their bytes are plain memory accesses, outside the weak model,
// as the loads and stores of warp_copy are.
#define GPUNET_ARCH_HAS_BULK_COPY 1
GPUNET_DEVICE uint32_t dynamic_smem_bytes() {
  return hd::tl_ctx ? uint32_t(hd::tl_ctx->block->smem.size()) : 0;
}
GPUNET_DEVICE void mbar_init(uint64_t* bar) { __atomic_store_n(bar, uint64_t(0), __ATOMIC_RELEASE); }
GPUNET_DEVICE bool mbar_test(uint64_t* bar, uint32_t parity) {
  return (__atomic_load_n(bar, __ATOMIC_ACQUIRE) & 1) != parity;  // (several lanes may wait)
}
GPUNET_DEVICE void bulk_expect(uint64_t* bar, uint32_t bytes) {
  // the bytes to wait for, which the loads that land take back to 0 (they land as they are
  // issued, after their bulk_expect: the CUDA arm's order too); none: the arrival completes it
  if (__atomic_add_fetch(bar, uint64_t(bytes) << 32, __ATOMIC_ACQ_REL) >> 32 == 0)
    __atomic_fetch_add(bar, uint64_t(1), __ATOMIC_RELEASE);
}
GPUNET_DEVICE void bulk_load_tx(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  std::memcpy(dst, src, bytes);
  if (__atomic_sub_fetch(bar, uint64_t(bytes) << 32, __ATOMIC_ACQ_REL) >> 32 == 0)
    __atomic_fetch_add(bar, uint64_t(1), __ATOMIC_RELEASE);
}
GPUNET_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  bulk_expect(bar, bytes);
  bulk_load_tx(dst, src, bytes, bar);
}
GPUNET_DEVICE void bulk_store(void* dst, const void* src, uint32_t bytes) { std::memcpy(dst, src, bytes); }
GPUNET_DEVICE void bulk_wait_read() {}
GPUNET_DEVICE void bulk_wait_done() {}
GPUNET_DEVICE void bulk_fence_proxy() {}
GPUNET_DEVICE void bulk_fence_proxy_shared() {}
#endif

// ---- every arm, from the primitives above ------------------------------------------------------
// The thread's rank in the whole launch: blocks in x, y, z order, threads by thread_rank().
GPUNET_DEVICE uint64_t global_thread_rank() {
  const Dim3 b = block_idx(), g = grid_dim(), bd = block_dim();
  return uint64_t(b.x + g.x * (b.y + g.y * b.z)) * (bd.x * bd.y * bd.z) + thread_rank();
}

}  // namespace gpunet::arch

// ================================================================================================
// Host-side kernel launch, for the extern "C" launchers that gpunet/device/loader.py binds.
// One spelling for every arm: kernels/*.cu stay arm-free.
// ================================================================================================
namespace gpunet {

struct LaunchSpec {
  uint32_t grid = 1, block = 1;
  uint32_t warp_size = 32;          // HOST: 32 or 64, the emulated warp. GPUs: ignored (hardware's).
  size_t shared_bytes = 0;          // dynamic shared memory, arch::shared_mem()
  void* stream = nullptr;           // GPUs: a cudaStream_t / mcStream_t; HOST: ignored
  bool sync = true;                 // GPUs: wait for the kernel and report its error
  // CUDA: programmatic stream serialization. The kernel may start while the kernel before it in
  // the stream still runs, so it MUST call arch::wait_previous_grid() before it touches memory
  // (what the previous kernel wrote, or read: a WAR hazard too). What it saves: the launch and
  // block scheduling, hidden under the previous kernel (back-to-back puts). HOST, MACA: ignored.
  bool overlap_previous = false;
  // HOST weak-memory model (host_simt.h); ignored on GPUs.
  bool weak = false;
  uint64_t weak_seed = 0;
  uint32_t weak_order = 0;          // 0 random, 1 fifo, 2 lifo
  uint32_t weak_spin_sleep_ns = 0;
};

#if defined(GPUNET_ARM_HOST)
// Returns 0, or -1 if the kernel threw (message on stderr): exceptions must not cross extern "C".
template <class Kernel, class... Args>
int launch_kernel(const LaunchSpec& s, Kernel kernel, Args... args) {
  host::LaunchOptions o;
  o.grid = s.grid;
  o.block = s.block;
  o.warp_size = s.warp_size;
  o.shared_bytes = s.shared_bytes;
  o.weak.enabled = s.weak;
  o.weak.seed = s.weak_seed;
  o.weak.order = host::DrainOrder(s.weak_order);
  o.weak.spin_sleep_ns = s.weak_spin_sleep_ns;
  try {
    host::launch(o, kernel, args...);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpunet host launch failed: %s\n", e.what());
    return -1;
  } catch (...) {
    std::fprintf(stderr, "gpunet host launch failed: unknown exception\n");
    return -1;
  }
  return 0;
}
#elif !defined(GPUNET_SYNTAX_CHECK_ONLY)  // (set by the test that type-checks the MACA arm with g++)
// Returns 0 or the runtime's error code (cudaError_t; MACA via cu-bridge: unverified).
template <class Kernel, class... Args>
int launch_kernel(const LaunchSpec& s, Kernel kernel, Args... args) {
  cudaStream_t st = static_cast<cudaStream_t>(s.stream);
#if defined(GPUNET_ARM_CUDA)
  if (s.overlap_previous) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(s.grid);
    cfg.blockDim = dim3(s.block);
    cfg.dynamicSmemBytes = s.shared_bytes;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (e == cudaSuccess && s.sync) e = cudaStreamSynchronize(st);
    return int(e);
  }
#endif
  kernel<<<s.grid, s.block, s.shared_bytes, st>>>(args...);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && s.sync) err = cudaStreamSynchronize(st);
  return int(err);
}
#endif

}  // namespace gpunet

