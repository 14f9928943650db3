// Test and benchmark support, not the API.
// Test kernels for gpunet/arch.cuh (tests/test_device_arch.py): ids, barriers, warp collectives,
// atomics, the HOST weak-memory model's litmus tests, and one kernel that uses every primitive
// (the CUDA arm's compile check). Written once; the launchers are extern "C" for ctypes and
// take a LaunchSpec's fields as plain arguments.
#include <gpunet/arch.cuh>

namespace arch = gpunet::arch;

namespace {

inline gpunet::LaunchSpec spec(uint32_t grid, uint32_t block, uint32_t warp_size, size_t smem) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = warp_size;
  s.shared_bytes = smem;
  return s;
}

constexpr uint32_t kIdFields = 8;

// Every thread records who it thinks it is.
GPUNET_GLOBAL void k_ids(uint32_t* out) {
  const uint32_t g = arch::block_idx().x * arch::block_dim().x + arch::thread_idx().x;
  uint32_t* r = out + size_t(g) * kIdFields;
  r[0] = arch::thread_idx().x;
  r[1] = arch::block_idx().x;
  r[2] = arch::block_dim().x;
  r[3] = arch::grid_dim().x;
  r[4] = arch::lane_id();
  r[5] = arch::warp_id();
  r[6] = arch::warp_size();
  r[7] = arch::thread_rank();
}

// Each round, thread t writes slot t of shared memory, the block syncs, and every thread reads
// its neighbour's slot; a second sync keeps the next round's writes after this round's reads.
GPUNET_GLOBAL void k_syncthreads(uint32_t rounds, uint32_t* errors) {
  uint32_t* smem = reinterpret_cast<uint32_t*>(arch::shared_mem());
  const uint32_t n = arch::block_dim().x, t = arch::thread_idx().x;
  uint32_t bad = 0;
  for (uint32_t r = 0; r < rounds; ++r) {
    smem[t] = r * 100000u + t;
    arch::syncthreads();
    const uint32_t peer = (t + 1 + r) % n;
    if (smem[peer] != r * 100000u + peer) ++bad;
    arch::syncthreads();
  }
  if (bad) arch::atomic_add(errors, bad);
}

// Threads with thread_rank >= n_live exit at once; the rest run the warp collectives.
GPUNET_GLOBAL void k_warp(uint32_t n_live, const uint32_t* vals, const uint8_t* preds,
                          const uint32_t* src, uint32_t* shfl_out, uint64_t* shfl64_out,
                          uint64_t* ballot_out, uint8_t* any_out, uint8_t* all_out,
                          uint8_t* block_any_out) {
  const uint32_t t = arch::thread_rank();
  if (t >= n_live) return;
  const uint32_t g = arch::block_idx().x * arch::block_dim().x + t;
  const bool p = preds[g] != 0;
  shfl_out[g] = arch::shfl(vals[g], src[g]);
  shfl64_out[g] = arch::shfl((uint64_t(vals[g]) << 32) | g, src[g]);
  ballot_out[g] = arch::ballot(p);
  any_out[g] = arch::any(p);
  all_out[g] = arch::all(p);
  arch::syncwarp();
  block_any_out[g] = arch::block_any(p);
}

// Exact sums from contention: fetch-add, and a CAS increment loop.
GPUNET_GLOBAL void k_atomics(uint32_t iters, uint32_t* c32, uint64_t* c64, uint32_t* cas32,
                             uint64_t* cas64, uint32_t* olds_seen) {
  for (uint32_t i = 0; i < iters; ++i) {
    uint32_t old = arch::atomic_add(c32, 1u);
    if (old < 1u << 20) arch::atomic_add(&olds_seen[old], 1u);  // each old value exactly once
    arch::atomic_add(c64, uint64_t(1) << 33);
    uint32_t cur = arch::atomic_load(cas32);
    for (;;) {
      uint32_t prev = arch::atomic_cas(cas32, cur, cur + 1);
      if (prev == cur) break;
      cur = prev;
    }
    uint64_t cur64 = arch::atomic_load(cas64);
    for (;;) {
      uint64_t prev = arch::atomic_cas(cas64, cur64, cur64 + 3);
      if (prev == cur64) break;
      cur64 = prev;
    }
  }
}

// Fetch-or from many threads: thread g sets bit g % 64 of words[g / 64] and bit g % 32 of
// words32[g / 32], each twice; the first old value must not have the bit (nobody else sets it),
// the second must (its own first or). seen[g]: bit 0 the 64-bit word held that, bit 1 the 32-bit.
GPUNET_GLOBAL void k_atomic_or(uint64_t* words, uint32_t* words32, uint32_t* seen) {
  const uint32_t g = arch::block_idx().x * arch::block_dim().x + arch::thread_rank();
  const uint64_t bit = uint64_t(1) << (g % 64);
  const uint64_t first = arch::atomic_or(&words[g / 64], bit);
  const uint64_t again = arch::atomic_or(&words[g / 64], bit);
  const uint32_t bit32 = 1u << (g % 32);
  const uint32_t first32 = arch::atomic_or(&words32[g / 32], bit32);
  const uint32_t again32 = arch::atomic_or(&words32[g / 32], bit32);
  seen[g] = (((first & bit) == 0 && (again & bit) != 0) ? 1u : 0u) |
            (((first32 & bit32) == 0 && (again32 & bit32) != 0) ? 2u : 0u);
}

// Message passing, writer in block 0 and observer in block 1 (one thread each).
//   mode 0: data relaxed, flag relaxed (NO fence)     — may be seen flag=1, data=0
//   mode 1: data relaxed, fence_sys, flag relaxed      — never
//   mode 2: data relaxed, flag store_release_sys       — never
enum MpMode : uint32_t { kMpNoFence = 0, kMpFence = 1, kMpRelease = 2 };

GPUNET_DEVICE void mp_write(uint32_t mode, uint32_t* data, uint32_t* flag) {
  arch::store_relaxed(data, 1u);
  if (mode == kMpFence) arch::fence_sys();
  if (mode == kMpRelease)
    arch::store_release_sys(flag, 1u);
  else
    arch::store_relaxed(flag, 1u);
}

// The writer's side of the doorbell litmus tests: a WQE word, the DBR (release-stored or relaxed),
// an optional fence, then the doorbell, in program order.
GPUNET_DEVICE void post_and_ring(uint32_t fence_before_db, uint32_t release_dbr, uint64_t* wqe,
                                 uint32_t* dbr, uint64_t* db) {
  arch::store_relaxed(wqe, uint64_t(0x1122334455667788ull));
  if (release_dbr)
    arch::store_release_sys(dbr, arch::bswap32(1u));
  else
    arch::store_relaxed(dbr, arch::bswap32(1u));
  if (fence_before_db) arch::fence_sys();
  arch::doorbell_store64(db, uint64_t(0xabcdull));
}

#if defined(GPUNET_ARM_HOST)
// Test harness channel outside the memory model, so the observer looks exactly once, at the
// moment the writer has made one pending store visible (host::weak_drain_partial).
std::atomic<uint32_t> g_mp_step{0};

GPUNET_GLOBAL void k_mp_step(uint32_t mode, uint32_t* data, uint32_t* flag, uint32_t* seen) {
  if (arch::block_idx().x == 0) {
    mp_write(mode, data, flag);
    gpunet::host::weak_drain_partial(1);
    g_mp_step.store(1);
    while (g_mp_step.load() != 2) std::this_thread::yield();
  } else {
    while (g_mp_step.load() != 1) std::this_thread::yield();
    seen[0] = arch::load_acquire_sys(flag);
    seen[1] = arch::load_relaxed(data);
    seen[2] = 1;
    g_mp_step.store(2);
  }
}
// The doorbell litmus, deterministic: after each single pop of the writer's store buffer the
// observer inspects memory (harness channel outside the model). seen[0] counts states in which
// the doorbell was visible but the DBR or the WQE word was not; seen[1] counts states checked.
GPUNET_GLOBAL void k_doorbell_step(uint32_t fence_before_db, uint32_t release_dbr, uint64_t* wqe,
                                   uint32_t* dbr, uint64_t* db, uint32_t* seen) {
  constexpr uint32_t kDone = 0xffffffffu;
  if (arch::block_idx().x == 0) {
    post_and_ring(fence_before_db, release_dbr, wqe, dbr, db);
    uint32_t step = 0;
    for (;;) {
      const bool last = gpunet::host::weak_pending() == 0;
      gpunet::host::weak_drain_partial(1);
      g_mp_step.store(2 * step + 1);
      while (g_mp_step.load() != 2 * step + 2) std::this_thread::yield();
      ++step;
      if (last) break;
    }
    g_mp_step.store(kDone);
  } else {
    uint32_t step = 0;
    for (;;) {
      uint32_t s;
      while (((s = g_mp_step.load()) & 1) == 0) std::this_thread::yield();
      if (s == kDone) break;
      const bool db_seen = arch::load_acquire_sys(const_cast<const uint64_t*>(db)) != 0;
      const bool dbr_ok = arch::load_acquire_sys(dbr) == arch::bswap32(1u);
      const bool wqe_ok = arch::load_relaxed(wqe) == 0x1122334455667788ull;
      if (db_seen && !(dbr_ok && wqe_ok)) ++seen[0];
      ++seen[1];
      g_mp_step.store(2 * step + 2);
      ++step;
    }
  }
}
#endif

// Both litmus threads are running before the writer stores anything: thread start-up on a
// loaded CI machine can otherwise take longer than the whole drain. RMWs act on memory (F3).
GPUNET_DEVICE void rendezvous(uint32_t* start, uint64_t deadline) {
  arch::atomic_add(start, 1u);
  while (arch::atomic_load(start) < 2 && arch::now_ns() < deadline) arch::spin_pause();
}

// The same litmus with no test hook: the writer spins (popping one pending store per turn) until
// the observer acknowledges; the observer polls the flag and then reads the data. Bounded.
// seen: [flag, data, done, start counter].
GPUNET_GLOBAL void k_mp_spin(uint32_t mode, uint32_t* data, uint32_t* flag, uint32_t* ack,
                             uint32_t* seen) {
  const uint64_t deadline = arch::now_ns() + 2000000000ull;
  rendezvous(seen + 3, deadline);
  if (arch::block_idx().x == 0) {
    mp_write(mode, data, flag);
    while (!arch::load_acquire_sys(ack) && arch::now_ns() < deadline) arch::spin_pause();
  } else {
    uint32_t f = 0;
    while (!(f = arch::load_acquire_sys(flag)) && arch::now_ns() < deadline) {
    }
    seen[0] = f;
    seen[1] = arch::load_relaxed(data);
    seen[2] = 1;
    arch::store_release_sys(ack, 1u);
  }
}

// Doorbell ordering: WQE word, DBR (release or relaxed), doorbell (with or without a fence before
// it), the shape qp.cuh will use. The observer waits for the doorbell and records what it sees.
// seen: [doorbell seen, DBR visible, WQE visible, done, start counter].
GPUNET_GLOBAL void k_doorbell(uint32_t fence_before_db, uint32_t release_dbr, uint64_t* wqe,
                              uint32_t* dbr, uint64_t* db, uint32_t* seen) {
  const uint64_t deadline = arch::now_ns() + 2000000000ull;
  rendezvous(seen + 4, deadline);
  if (arch::block_idx().x == 0) {
    post_and_ring(fence_before_db, release_dbr, wqe, dbr, db);
    while (!arch::load_acquire_sys(reinterpret_cast<const uint32_t*>(seen + 3)) && arch::now_ns() < deadline)
      arch::spin_pause();
  } else {
    uint64_t d = 0;
    while (!(d = arch::load_acquire_sys(const_cast<const uint64_t*>(db))) && arch::now_ns() < deadline) {
    }
    seen[0] = d != 0;
    seen[1] = arch::load_acquire_sys(dbr) == arch::bswap32(1u);
    seen[2] = arch::load_relaxed(wqe) == 0x1122334455667788ull;
    arch::store_release_sys(seen + 3, 1u);
  }
}

// Uses every primitive once (the CUDA/MACA compile check) and writes checkable results.
GPUNET_GLOBAL void k_every_primitive(uint64_t* out, uint32_t* u32, uint64_t* u64) {
  const uint32_t lane = arch::lane_id();
  if (arch::thread_rank() == 0) {
    out[0] = arch::bswap16(uint16_t(0x1234));
    out[1] = arch::bswap32(0x11223344u);
    out[2] = arch::bswap64(0x0102030405060708ull);
    arch::store_relaxed(&u32[0], 5u);
    arch::store_relaxed(reinterpret_cast<uint8_t*>(&u32[1]), uint8_t(7));
    arch::store_relaxed(reinterpret_cast<uint16_t*>(&u32[2]), uint16_t(9));
    arch::store_relaxed(&u64[0], uint64_t(11));
    arch::fence_sys();
    arch::store_release_sys(&u32[3], 13u);
    arch::store_release_sys(&u64[1], uint64_t(15));
    out[3] = arch::load_acquire_sys(&u32[3]) + arch::load_acquire_sys(&u64[1]) + arch::load_relaxed(&u32[0]) +
             arch::load_relaxed(reinterpret_cast<const uint8_t*>(&u32[1]));
    out[4] = arch::atomic_add(&u32[4], 2u) + arch::atomic_add(&u64[2], uint64_t(3)) +
             arch::atomic_cas(&u32[4], 2u, 4u) + arch::atomic_cas(&u64[2], uint64_t(3), uint64_t(6));
    arch::atomic_store(&u32[5], 17u);
    arch::atomic_store(&u64[3], uint64_t(19));
    out[5] = arch::atomic_load(&u32[5]) + arch::atomic_load(&u64[3]);
    arch::doorbell_store64(reinterpret_cast<volatile uint64_t*>(&u64[4]), uint64_t(21));
    arch::store_relaxed_v2(&u64[6], uint64_t(23), uint64_t(25));  // 16-byte aligned when u64 is
    const uint64_t t0 = arch::now_ns();
    arch::spin_pause();
    out[6] = arch::now_ns() >= t0;
    const arch::Dim3 g = arch::grid_dim(), b = arch::block_dim(), bi = arch::block_idx(), ti = arch::thread_idx();
    out[7] = g.x * b.x + bi.x + ti.x + arch::warp_id();
  }
  arch::shared_mem()[arch::thread_rank()] = uint8_t(lane);
  arch::syncthreads();
  arch::syncwarp();
  const uint32_t v = arch::shfl(lane * 2u, 0u);
  const uint64_t bal = arch::ballot(lane % 2 == 0);
  const bool a = arch::any(lane == 1), al = arch::all(true);
  const bool ba = arch::block_any(arch::thread_rank() == 0);
  if (arch::thread_rank() == 0) out[8] = v + (bal & 1) + a + al + ba + arch::warp_size() + arch::shared_mem()[1];
}

}  // namespace

extern "C" {

int test_ids(uint32_t grid, uint32_t block, uint32_t ws, uint32_t* out) {
  return gpunet::launch_kernel(spec(grid, block, ws, 0), k_ids, out);
}

int test_syncthreads(uint32_t grid, uint32_t block, uint32_t ws, uint32_t rounds, uint32_t* errors) {
  return gpunet::launch_kernel(spec(grid, block, ws, block * sizeof(uint32_t)), k_syncthreads, rounds, errors);
}

int test_warp(uint32_t grid, uint32_t block, uint32_t ws, uint32_t n_live, const uint32_t* vals,
              const uint8_t* preds, const uint32_t* src, uint32_t* shfl_out, uint64_t* shfl64_out,
              uint64_t* ballot_out, uint8_t* any_out, uint8_t* all_out, uint8_t* block_any_out) {
  return gpunet::launch_kernel(spec(grid, block, ws, 0), k_warp, n_live, vals, preds, src, shfl_out,
                               shfl64_out, ballot_out, any_out, all_out, block_any_out);
}

int test_atomics(uint32_t grid, uint32_t block, uint32_t ws, uint32_t iters, uint32_t* c32, uint64_t* c64,
                 uint32_t* cas32, uint64_t* cas64, uint32_t* olds_seen) {
  return gpunet::launch_kernel(spec(grid, block, ws, 0), k_atomics, iters, c32, c64, cas32, cas64, olds_seen);
}

int test_atomic_or(uint32_t grid, uint32_t block, uint32_t ws, uint64_t* words, uint32_t* words32,
                   uint32_t* seen) {
  return gpunet::launch_kernel(spec(grid, block, ws, 0), k_atomic_or, words, words32, seen);
}

#if defined(GPUNET_ARM_HOST)
int test_mp_step(uint32_t mode, uint32_t weak, uint64_t seed, uint32_t order, uint32_t* data, uint32_t* flag,
                 uint32_t* seen) {
  gpunet::LaunchSpec s = spec(2, 1, 32, 0);
  s.weak = weak != 0;
  s.weak_seed = seed;
  s.weak_order = order;
  g_mp_step.store(0);
  return gpunet::launch_kernel(s, k_mp_step, mode, data, flag, seen);
}
int test_doorbell_step(uint32_t fence_before_db, uint32_t release_dbr, uint64_t seed, uint32_t order,
                       uint64_t* wqe, uint32_t* dbr, uint64_t* db, uint32_t* seen) {
  gpunet::LaunchSpec s = spec(2, 1, 32, 0);
  s.weak = true;
  s.weak_seed = seed;
  s.weak_order = order;
  g_mp_step.store(0);
  return gpunet::launch_kernel(s, k_doorbell_step, fence_before_db, release_dbr, wqe, dbr, db, seen);
}
#endif

int test_mp_spin(uint32_t mode, uint32_t weak, uint64_t seed, uint32_t spin_sleep_ns, uint32_t* data,
                 uint32_t* flag, uint32_t* ack, uint32_t* seen) {
  gpunet::LaunchSpec s = spec(2, 1, 32, 0);
  s.weak = weak != 0;
  s.weak_seed = seed;
  s.weak_spin_sleep_ns = spin_sleep_ns;
  return gpunet::launch_kernel(s, k_mp_spin, mode, data, flag, ack, seen);
}

int test_doorbell(uint32_t fence_before_db, uint32_t release_dbr, uint64_t seed, uint32_t order,
                  uint32_t spin_sleep_ns, uint64_t* wqe, uint32_t* dbr, uint64_t* db, uint32_t* seen) {
  gpunet::LaunchSpec s = spec(2, 1, 32, 0);
  s.weak = true;
  s.weak_seed = seed;
  s.weak_order = order;
  s.weak_spin_sleep_ns = spin_sleep_ns;
  return gpunet::launch_kernel(s, k_doorbell, fence_before_db, release_dbr, wqe, dbr, db, seen);
}

int test_every_primitive(uint32_t block, uint32_t ws, uint64_t* out, uint32_t* u32, uint64_t* u64) {
  return gpunet::launch_kernel(spec(1, block, ws, block), k_every_primitive, out, u32, u64);
}

}  // extern "C"
