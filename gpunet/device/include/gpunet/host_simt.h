// gpunet HOST arm: a SIMT emulator that runs device code on CPU threads, and an optional
// weak-memory model for the stores the NIC reads.
//
// Included only by arch.cuh, only when GPUNET_ARCH_HOST is defined (g++ -std=c++17).
// Device code never includes it directly and never names anything in it except through
// gpunet::arch (primitives) and gpunet::host::launch (host-side launchers).
//
// ---------------------------------------------------------------------------------------------
// Execution model
//
//   host::launch(opts, kernel, args...) runs grid x block logical threads as std::threads (a
//   launch of one thread runs on the calling thread: see launch()).
//   A block's threads are all live together (syncthreads needs that). Blocks run in waves of
//   at most opts.max_threads OS threads (default 1024, env GPUNET_HOST_MAX_THREADS); a kernel
//   that waits on a block of a *later* wave deadlocks, as it would on a GPU with fewer
//   resident blocks: bounded waits then time out, which is the behaviour we want to see.
//
//   Lanes: the linear thread index within the block, tid, gives lane = tid % warp_size and
//   warp = tid / warp_size. warp_size is 32 or 64, chosen at launch.
//
//   Barriers (syncthreads, syncwarp) and warp collectives (shfl, ballot, any, all) complete
//   when every *live* thread of the group has arrived: a thread that returned from the kernel
//   no longer counts (CUDA's rule for exited threads). The rule for device code is the one of
//   CUDA's `*_sync(0xffffffff, ...)`: every non-exited lane of the warp reaches the same
//   collective; lanes that diverge around a collective deadlock here (and are undefined on a
//   GPU). A shfl from an exited lane returns the caller's own value.
//
//   Waits block on condition variables, spin_pause() yields: 2-core CI machines are not starved
//   by threads of the emulator spinning, and the soft NIC's engine thread gets to run.
//
// ---------------------------------------------------------------------------------------------
// Weak-memory model (opts.weak.enabled). x86 is TSO and g++ does not reorder our atomics, so
// without this a missing fence never shows on the CPU. Only stores made through arch.cuh
// primitives take part; plain C++ assignments in device code bypass it (keep NIC-visible stores
// on the primitives).
//
//   Buffered: store_relaxed, doorbell_store64, atomic_store, and store_release_sys go into the
//   calling thread's store buffer instead of memory. An entry becomes visible ("pops") later,
//   written to memory with one atomic store of its size.
//   Allowed reorderings (what can pop before what):
//     R1. Relaxed stores (store_relaxed, doorbell_store64, atomic_store) to different addresses
//         pop in any order relative to each other, including the doorbell before the DBR and
//         the WQE words it announces.
//     R2. A store_release_sys entry pops only after every older entry of the same thread
//         (including entries that thread handed to its block at a barrier, see B1). Younger
//         relaxed stores may pop BEFORE an older release (a release orders what precedes it,
//         not what follows): DBR-release then doorbell still needs a fence between them.
//     R3. Two stores to overlapping bytes never reorder (per-location coherence): a store to
//         exactly the same address and size as a buffered relaxed one replaces its value in
//         place (coalescing; the older value may never be seen); any other overlap makes the
//         older entry pop first.
//   Forbidden / ordering points:
//     F1. fence_sys() pops every entry of the thread and of its block's pool (B1) before
//         returning. Nothing stored before a fence becomes visible after a store that follows it.
//     F2. Kernel exit pops the thread's entries; block exit pops the block's pool.
//     F3. Atomic RMWs (atomic_add, atomic_cas) act on memory directly and are RELAXED, as
//         CUDA's atomicAdd/atomicCAS are: they do not wait for older buffered stores, except
//         ones to overlapping bytes, which pop first. WeakConfig::atomics_drain = true makes
//         them drain the whole buffer first (a stronger, non-CUDA model), for comparison.
//   Block-scope handoff:
//     B1. syncthreads / syncwarp / block_any move the caller's pending entries into a per-block
//         pool before arriving. After the barrier every thread of the block forwards loads
//         from the pool (bar.sync orders memory for the block's threads), but the NIC and other
//         blocks still see them only when they pop. A fence_sys or store_release_sys by ANY
//         thread of the block pops the whole pool first (fences are cumulative: stores that
//         happen-before a fence are ordered before what follows it). So "lanes write WQEs;
//         syncwarp; lane 0 fences and rings" is correct here, and "... lane 0 rings without a
//         fence" is caught.
//   Loads:
//     L1. Loads of the calling thread forward from its own buffer (newest exact match), then
//         from its block's pool; a partial overlap pops the overlapping entries and reads
//         memory. Single-thread semantics hold.
//     L2. Loads are NOT reordered among themselves or with stores of other threads: a missing
//         *acquire* is not detected by this model, only missing release/fence on stores.
//   Progress (real hardware makes stores visible eventually, fences or not):
//     P1. spin_pause() pops one entry (own buffer first, else the block pool), then yields or
//         sleeps WeakConfig::spin_sleep_ns. A spin loop therefore drains one entry per turn,
//         which leaves windows in which an observer (the soft NIC) sees a partial state.
//     P2. Every load_drain_period-th load primitive pops one entry; with
//         spontaneous_per_mille > 0 each store/load primitive also pops one entry with that
//         probability. The buffer holds at most `capacity` entries; a full buffer pops one.
//     P3. A warp collective that is not a barrier (shfl, ballot, any, all) pops every entry of the
//         caller first: the caller may block there until its lane-mates arrive, and hardware
//         drains a blocked thread's stores (arch.cuh host_warp_collective says why it matters).
//   Choice: which eligible entry pops is chosen by WeakConfig::order: Random (a xorshift per
//   thread seeded from seed + global thread id, so a seed replays the same choices given the
//   same interleaving), Fifo (program order: TSO-like), Lifo (newest eligible first: the most
//   adversarial fixed order).
//
//   Test hooks: host::weak_drain_partial(n) pops n entries of the calling thread (chosen as
//   above), for litmus tests that want a deterministic half-visible state.
//   WeakConfig::script (script_len words): the Random choices come from the test, not the
//   xorshift: each choice among k eligible entries takes the next script word modulo k (then the
//   xorshift once the script is used up), so hypothesis picks drain orders, including those of
//   the pops inside fence_sys and at kernel exit. WeakConfig::on_pop(on_pop_arg) is called after
//   every pop of a launch's thread (own buffer or block pool), with the store just made
//   visible: an observer there sees every intermediate state. tests/test_weak_signal.py.
// ---------------------------------------------------------------------------------------------
#pragma once

#if !defined(GPUNET_ARCH_HOST)
#error "host_simt.h is the HOST arm's emulator: include <gpunet/arch.cuh> with GPUNET_ARCH_HOST"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpunet::host {

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
  Dim3() = default;
  Dim3(uint32_t x_, uint32_t y_ = 1, uint32_t z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT: implicit like dim3
  uint64_t count() const { return uint64_t(x) * y * z; }
};

enum class DrainOrder : uint32_t { Random = 0, Fifo = 1, Lifo = 2 };

struct WeakConfig {
  bool enabled = false;
  uint64_t seed = 0;
  DrainOrder order = DrainOrder::Random;
  uint32_t spontaneous_per_mille = 0;  // P2: chance per primitive of one early pop
  uint32_t load_drain_period = 64;     // P2: every Nth load pops one entry (0: never)
  uint32_t spin_sleep_ns = 0;          // P1: 0 = yield; >0 = sleep, widening observer windows
  uint32_t capacity = 256;             // P2: buffer bound (a WQE batch is far below this)
  bool atomics_drain = false;          // F3
  const uint32_t* script = nullptr;    // test hook: the Random choices, in order (see above)
  uint32_t script_len = 0;
  void (*on_pop)(void*) = nullptr;     // test hook: called after every pop (see above)
  void* on_pop_arg = nullptr;
};

struct LaunchOptions {
  Dim3 grid, block;
  uint32_t warp_size = 32;
  size_t shared_bytes = 0;
  uint32_t max_threads = 0;  // 0: $GPUNET_HOST_MAX_THREADS or 1024
  WeakConfig weak;
};

namespace detail {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t s = 1;
  const uint32_t* script = nullptr;  // WeakConfig::script: below() takes these first
  uint32_t script_len = 0, script_pos = 0;
  void seed(uint64_t v) { s = splitmix64(v) | 1; }
  uint64_t next() {  // xorshift64*
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545f4914f6cdd1dull;
  }
  uint32_t below(uint32_t n) {
    if (!n) return 0;
    if (script_pos < script_len) return script[script_pos++] % n;
    return uint32_t(next() % n);
  }
  void use_script(const WeakConfig& w) {
    script = w.script;
    script_len = w.script ? w.script_len : 0;
    script_pos = 0;
  }
};

// The on_pop hook of the launch the calling OS thread runs (null outside one, or without it).
inline thread_local const WeakConfig* tl_pop_cfg = nullptr;

// ---- raw memory access of 1/2/4/8 bytes --------------------------------------------------------
inline void mem_store(uintptr_t a, uint32_t size, uint64_t v, int mo) {
  switch (size) {
    case 1: __atomic_store_n(reinterpret_cast<uint8_t*>(a), uint8_t(v), mo); break;
    case 2: __atomic_store_n(reinterpret_cast<uint16_t*>(a), uint16_t(v), mo); break;
    case 4: __atomic_store_n(reinterpret_cast<uint32_t*>(a), uint32_t(v), mo); break;
    default: __atomic_store_n(reinterpret_cast<uint64_t*>(a), v, mo); break;
  }
}
inline uint64_t mem_load(uintptr_t a, uint32_t size, int mo) {
  switch (size) {
    case 1: return __atomic_load_n(reinterpret_cast<const uint8_t*>(a), mo);
    case 2: return __atomic_load_n(reinterpret_cast<const uint16_t*>(a), mo);
    case 4: return __atomic_load_n(reinterpret_cast<const uint32_t*>(a), mo);
    default: return __atomic_load_n(reinterpret_cast<const uint64_t*>(a), mo);
  }
}

// ---- store buffer ------------------------------------------------------------------------------
struct Entry {
  uintptr_t addr;
  uint32_t size;
  bool release;
  uint32_t origin;  // global linear id of the storing thread (R2 is per origin)
  uint64_t seq;     // program order within origin
  uint64_t value;
};

inline bool overlaps(const Entry& e, uintptr_t a, uint32_t size) {
  return e.addr < a + size && a < e.addr + e.size;
}

// A list of pending entries with the pop rules R2/R3. Not locked: the owner locks if shared.
struct EntryList {
  std::vector<Entry> v;

  bool eligible(size_t i) const {
    const Entry& e = v[i];
    if (!e.release) return true;
    for (const Entry& o : v)
      if (o.origin == e.origin && o.seq < e.seq) return false;  // R2
    return true;
  }
  void pop_at(size_t i) {
    Entry e = v[i];
    v.erase(v.begin() + ptrdiff_t(i));
    // RELEASE so that an observer that sees this entry also sees every earlier pop.
    mem_store(e.addr, e.size, e.value, __ATOMIC_RELEASE);
    if (tl_pop_cfg && tl_pop_cfg->on_pop) tl_pop_cfg->on_pop(tl_pop_cfg->on_pop_arg);
  }
  // Pop one eligible entry chosen by `order`. The oldest entry is always eligible.
  bool pop_one(Rng& rng, DrainOrder order) {
    if (v.empty()) return false;
    size_t pick = 0;
    if (order == DrainOrder::Fifo) {
      pick = 0;
    } else if (order == DrainOrder::Lifo) {
      pick = v.size() - 1;
      while (!eligible(pick)) --pick;
    } else {
      std::vector<size_t> ok;
      for (size_t i = 0; i < v.size(); ++i)
        if (eligible(i)) ok.push_back(i);
      pick = ok[rng.below(uint32_t(ok.size()))];
    }
    pop_at(pick);
    return true;
  }
  void drain(Rng& rng, DrainOrder order) {
    while (pop_one(rng, order)) {
    }
  }
  // Pop, in program order, entry i and every entry that must precede it (R2): used when a
  // later access to overlapping bytes needs it visible now (early visibility is always allowed).
  void pop_with_prereqs(size_t i) {
    const Entry e = v[i];
    if (!e.release) {
      pop_at(i);
      return;
    }
    // A release: every older entry of its origin first (R2), in program order, then itself.
    for (;;) {
      size_t best = SIZE_MAX;
      for (size_t k = 0; k < v.size(); ++k)
        if (v[k].origin == e.origin && v[k].seq <= e.seq && (best == SIZE_MAX || v[k].seq < v[best].seq))
          best = k;
      if (best == SIZE_MAX) return;
      pop_at(best);
    }
  }
  void pop_overlapping(uintptr_t a, uint32_t size) {
    for (;;) {
      size_t hit = SIZE_MAX;
      for (size_t k = 0; k < v.size(); ++k)
        if (overlaps(v[k], a, size)) { hit = k; break; }
      if (hit == SIZE_MAX) return;
      pop_with_prereqs(hit);
    }
  }
  // Newest entry with exactly this address and size, or null.
  const Entry* forward(uintptr_t a, uint32_t size) const {
    const Entry* best = nullptr;
    for (const Entry& e : v)
      if (e.addr == a && e.size == size && (!best || e.seq > best->seq)) best = &e;
    return best;
  }
  bool any_partial_overlap(uintptr_t a, uint32_t size) const {
    for (const Entry& e : v)
      if (overlaps(e, a, size) && !(e.addr == a && e.size == size)) return true;
    return false;
  }
};

// ---- barriers ------------------------------------------------------------------------------------
// A reusable generation barrier over a set of live participants, carrying per-lane values and
// an OR for collectives. Completes when `arrived == live`; retire() removes an exited thread.
class SyncGroup {
 public:
  struct Result {
    uint64_t mask;         // lanes that arrived in this generation
    uint64_t any;          // OR of the predicates
    uint64_t all;          // AND of the predicates (over arrived lanes)
    const uint64_t* vals;  // per-lane values; valid until the caller arrives again
  };
  explicit SyncGroup(uint32_t live) : live_(live) {}

  Result arrive(uint32_t lane, uint64_t value, bool pred) {
    std::unique_lock<std::mutex> lk(m_);
    const uint64_t gen = gen_;
    if (lane < 64) {
      pend_vals_[lane] = value;
      pend_mask_ |= uint64_t(1) << lane;
    }
    pend_any_ |= pred ? 1 : 0;
    pend_all_ &= pred ? 1 : 0;
    if (++arrived_ == live_) {
      complete_locked();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    const Published& p = pub_[gen & 1];
    return Result{p.mask, p.any, p.all, p.vals};
  }
  void retire() {
    std::lock_guard<std::mutex> lk(m_);
    --live_;
    if (arrived_ > 0 && arrived_ == live_) complete_locked();
  }

 private:
  struct Published {
    uint64_t vals[64];
    uint64_t mask, any, all;
  };
  void complete_locked() {
    Published& p = pub_[gen_ & 1];
    std::memcpy(p.vals, pend_vals_, sizeof p.vals);
    p.mask = pend_mask_;
    p.any = pend_any_;
    p.all = pend_all_;
    pend_mask_ = 0;
    pend_any_ = 0;
    pend_all_ = 1;
    arrived_ = 0;
    ++gen_;
    cv_.notify_all();
  }
  std::mutex m_;
  std::condition_variable cv_;
  uint32_t live_;
  uint32_t arrived_ = 0;
  uint64_t gen_ = 0;
  uint64_t pend_vals_[64] = {};
  uint64_t pend_mask_ = 0, pend_any_ = 0, pend_all_ = 1;
  Published pub_[2] = {};
};

struct Block {
  Dim3 idx;
  std::vector<uint8_t> smem;
  std::unique_ptr<SyncGroup> bar;
  std::vector<std::unique_ptr<SyncGroup>> warps;
  // B1: entries handed over at barriers; visible to the block, not yet to the system.
  std::mutex pool_m;
  EntryList pool;
  std::atomic<size_t> pool_n{0};
  std::atomic<uint64_t> exited{0};  // F2: the last thread to exit pops the pool
};

struct ThreadCtx {
  Dim3 tid, bid, bdim, gdim;
  uint32_t linear_tid = 0, lane = 0, warp = 0, warp_size = 32;
  uint32_t origin = 0;  // global linear thread id
  Block* block = nullptr;
  SyncGroup* warpg = nullptr;
  // weak memory
  const WeakConfig* weak = nullptr;  // null or !enabled: strong mode
  EntryList buf;
  Rng rng;
  uint64_t seq = 0;
  uint32_t loads = 0;
};

inline thread_local ThreadCtx* tl_ctx = nullptr;

inline ThreadCtx* weak_ctx() {
  ThreadCtx* c = tl_ctx;
  return (c && c->weak && c->weak->enabled) ? c : nullptr;
}

// Pop one entry: the own buffer first, else the block pool (P1, P2).
inline void pop_some(ThreadCtx* c) {
  if (c->buf.pop_one(c->rng, c->weak->order)) return;
  Block* b = c->block;
  if (b && b->pool_n.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(b->pool_m);
    b->pool.pop_one(c->rng, c->weak->order);
    b->pool_n.store(b->pool.v.size(), std::memory_order_release);
  }
}

inline void maybe_spontaneous(ThreadCtx* c) {
  uint32_t p = c->weak->spontaneous_per_mille;
  if (p && c->rng.below(1000) < p) pop_some(c);
}

// F1: everything of this thread and of its block's pool becomes visible, in a chosen order
// (entries of both interleave).
inline void drain_all(ThreadCtx* c) {
  Block* b = c->block;
  if (b && b->pool_n.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(b->pool_m);
    while (!b->pool.v.empty() || !c->buf.v.empty()) {
      bool from_pool = c->buf.v.empty() || (!b->pool.v.empty() && (c->rng.next() & 1));
      (from_pool ? b->pool : c->buf).pop_one(c->rng, c->weak->order);
    }
    b->pool_n.store(0, std::memory_order_release);
    return;
  }
  c->buf.drain(c->rng, c->weak->order);
}

inline void drain_pool(ThreadCtx* c) {
  Block* b = c->block;
  if (!b || !b->pool_n.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lk(b->pool_m);
  b->pool.drain(c->rng, c->weak->order);
  b->pool_n.store(0, std::memory_order_release);
}

// Pop what overlaps [a, a+size) in the block pool (R3 across a barrier handoff).
inline void pool_pop_overlapping(ThreadCtx* c, uintptr_t a, uint32_t size) {
  Block* b = c->block;
  if (!b || !b->pool_n.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lk(b->pool_m);
  b->pool.pop_overlapping(a, size);
  b->pool_n.store(b->pool.v.size(), std::memory_order_release);
}

// B1: hand the thread's pending entries to its block before a barrier.
inline void handoff_to_block(ThreadCtx* c) {
  if (c->buf.v.empty() || !c->block) return;
  Block* b = c->block;
  std::lock_guard<std::mutex> lk(b->pool_m);
  for (Entry& e : c->buf.v) {
    b->pool.pop_overlapping(e.addr, e.size);  // R3 against other threads' handed-over stores
    b->pool.v.push_back(e);
  }
  c->buf.v.clear();
  b->pool_n.store(b->pool.v.size(), std::memory_order_release);
}

inline void weak_store(ThreadCtx* c, uintptr_t a, uint32_t size, uint64_t v, bool release) {
  maybe_spontaneous(c);
  if (release) drain_pool(c);  // B1: a release is cumulative over the block's handed-over stores
  else pool_pop_overlapping(c, a, size);  // R3
  if (!release) {
    for (Entry& e : c->buf.v)
      if (e.addr == a && e.size == size && !e.release) {
        // R3 coalescing, only if this is the newest entry to those bytes.
        bool newer = false;
        for (const Entry& o : c->buf.v)
          if (o.seq > e.seq && overlaps(o, a, size)) newer = true;
        if (!newer) {
          e.value = v;
          return;
        }
      }
  }
  c->buf.pop_overlapping(a, size);  // R3
  c->buf.v.push_back(Entry{a, size, release, c->origin, ++c->seq, v});
  if (c->buf.v.size() > c->weak->capacity) c->buf.pop_one(c->rng, c->weak->order);
}

inline uint64_t weak_load(ThreadCtx* c, uintptr_t a, uint32_t size, int mo) {
  maybe_spontaneous(c);
  uint32_t period = c->weak->load_drain_period;
  if (period && ++c->loads % period == 0) pop_some(c);
  if (c->buf.any_partial_overlap(a, size)) c->buf.pop_overlapping(a, size);
  if (const Entry* e = c->buf.forward(a, size)) return e->value;  // L1
  Block* b = c->block;
  if (b && b->pool_n.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(b->pool_m);
    if (b->pool.any_partial_overlap(a, size)) b->pool.pop_overlapping(a, size);
    if (const Entry* e = b->pool.forward(a, size)) return e->value;
    b->pool_n.store(b->pool.v.size(), std::memory_order_release);
  }
  return mem_load(a, size, mo);
}

// Before an atomic RMW on [a, a+size): F3.
inline void weak_before_rmw(ThreadCtx* c, uintptr_t a, uint32_t size) {
  maybe_spontaneous(c);
  if (c->weak->atomics_drain) {
    drain_all(c);
    return;
  }
  c->buf.pop_overlapping(a, size);
  pool_pop_overlapping(c, a, size);
}

inline uint32_t default_max_threads() {
  if (const char* s = std::getenv("GPUNET_HOST_MAX_THREADS")) {
    long v = std::strtol(s, nullptr, 10);
    if (v > 0) return uint32_t(v);
  }
  return 1024;  // ~1k OS threads start in a few ms and fit default limits
}

}  // namespace detail

// Test hook (see the model above): pop n pending entries of the calling thread.
inline void weak_drain_partial(uint32_t n) {
  detail::ThreadCtx* c = detail::weak_ctx();
  if (!c) return;
  for (uint32_t i = 0; i < n; ++i) c->buf.pop_one(c->rng, c->weak->order);
}

// Number of stores the calling thread holds back (0 in strong mode).
inline uint32_t weak_pending() {
  detail::ThreadCtx* c = detail::weak_ctx();
  return c ? uint32_t(c->buf.v.size()) : 0;
}

// Run `kernel(args...)` on opts.grid x opts.block emulated threads. Blocks until all are done.
// Rethrows the first exception a kernel thread threw (that thread counts as exited).
template <class Kernel, class... Args>
void launch(const LaunchOptions& opts, Kernel kernel, Args... args) {
  using namespace detail;
  const uint32_t ws = opts.warp_size;
  if (ws != 32 && ws != 64) throw std::invalid_argument("gpunet host launch: warp_size must be 32 or 64");
  const uint64_t nthreads = opts.block.count();
  const uint64_t nblocks = opts.grid.count();
  if (nthreads == 0 || nblocks == 0) return;
  if (nthreads > 1024) throw std::invalid_argument("gpunet host launch: at most 1024 threads per block");
  const uint32_t cap = opts.max_threads ? opts.max_threads : default_max_threads();
  const uint64_t per_wave = std::max<uint64_t>(1, cap / nthreads);
  const uint32_t nwarps = uint32_t((nthreads + ws - 1) / ws);

  // A launch of ONE thread runs on the calling thread: starting and joining an OS thread cost
  // ~30 us here (measured by bench/cpu_put.py's breakdown on the 2-core CI machine), most of a
  // host wrapper's put (gpunet/context.py launches one thread per call). Nothing can tell the
  // difference: the launch blocks until the kernel is done either way, the thread's context is
  // installed and removed exactly as below, and no collective can wait on a second thread.
  // tests/test_host_launch.py::test_single_thread_launch_runs_inline_and_restores_context
  // guards it.
  if (nblocks == 1 && nthreads == 1) {
    auto blk = std::make_unique<Block>();
    blk->idx = Dim3(0, 0, 0);
    blk->smem.assign(opts.shared_bytes ? opts.shared_bytes : 1, 0);
    blk->bar = std::make_unique<SyncGroup>(1u);
    blk->warps.push_back(std::make_unique<SyncGroup>(1u));
    ThreadCtx ctx;
    ctx.tid = Dim3(0, 0, 0);
    ctx.bid = blk->idx;
    ctx.bdim = opts.block;
    ctx.gdim = opts.grid;
    ctx.warp_size = ws;
    ctx.block = blk.get();
    ctx.warpg = blk->warps[0].get();
    ctx.weak = &opts.weak;
    ctx.rng.seed(opts.weak.seed * 0x100000001b3ull);
    ctx.rng.use_script(opts.weak);
    ThreadCtx* const outer = tl_ctx;  // a launch from inside a kernel thread keeps its context
    const WeakConfig* const outer_pop = tl_pop_cfg;
    tl_ctx = &ctx;
    tl_pop_cfg = opts.weak.enabled ? &opts.weak : nullptr;
    std::exception_ptr err;
    try {
      kernel(args...);
    } catch (...) {
      err = std::current_exception();
    }
    if (opts.weak.enabled) {  // F2: the thread's entries, then the block's pool
      ctx.buf.drain(ctx.rng, opts.weak.order);
      Rng rng;
      rng.seed(opts.weak.seed ^ 0xb10cull);
      blk->pool.drain(rng, opts.weak.order);
    }
    tl_ctx = outer;
    tl_pop_cfg = outer_pop;
    if (err) std::rethrow_exception(err);
    return;
  }

  std::mutex err_m;
  std::exception_ptr first_err;

  for (uint64_t b0 = 0; b0 < nblocks; b0 += per_wave) {
    const uint64_t b1 = std::min(nblocks, b0 + per_wave);
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<std::thread> threads;
    threads.reserve(size_t((b1 - b0) * nthreads));
    for (uint64_t bl = b0; bl < b1; ++bl) {
      auto blk = std::make_unique<Block>();
      blk->idx = Dim3(uint32_t(bl % opts.grid.x), uint32_t((bl / opts.grid.x) % opts.grid.y),
                      uint32_t(bl / (uint64_t(opts.grid.x) * opts.grid.y)));
      blk->smem.assign(opts.shared_bytes ? opts.shared_bytes : 1, 0);
      blk->bar = std::make_unique<SyncGroup>(uint32_t(nthreads));
      for (uint32_t w = 0; w < nwarps; ++w) {
        uint32_t lanes = uint32_t(std::min<uint64_t>(ws, nthreads - uint64_t(w) * ws));
        blk->warps.push_back(std::make_unique<SyncGroup>(lanes));
      }
      blocks.push_back(std::move(blk));
    }
    for (uint64_t bl = b0; bl < b1; ++bl) {
      Block* blk = blocks[size_t(bl - b0)].get();
      for (uint64_t t = 0; t < nthreads; ++t) {
        threads.emplace_back([&, blk, bl, t]() {
          ThreadCtx ctx;
          ctx.bdim = opts.block;
          ctx.gdim = opts.grid;
          ctx.bid = blk->idx;
          ctx.tid = Dim3(uint32_t(t % opts.block.x), uint32_t((t / opts.block.x) % opts.block.y),
                         uint32_t(t / (uint64_t(opts.block.x) * opts.block.y)));
          ctx.linear_tid = uint32_t(t);
          ctx.lane = uint32_t(t % ws);
          ctx.warp = uint32_t(t / ws);
          ctx.warp_size = ws;
          ctx.origin = uint32_t(bl * nthreads + t);
          ctx.block = blk;
          ctx.warpg = blk->warps[ctx.warp].get();
          ctx.weak = &opts.weak;
          ctx.rng.seed(opts.weak.seed * 0x100000001b3ull + ctx.origin);
          ctx.rng.use_script(opts.weak);
          tl_ctx = &ctx;
          tl_pop_cfg = opts.weak.enabled ? &opts.weak : nullptr;
          try {
            kernel(args...);
          } catch (...) {
            std::lock_guard<std::mutex> lk(err_m);
            if (!first_err) first_err = std::current_exception();
          }
          if (opts.weak.enabled) ctx.buf.drain(ctx.rng, opts.weak.order);  // F2
          // F2 at the block's exit, not the wave's: a finished block's stores (a lock's release)
          // must not stay hidden from blocks still running (tests/test_device_post.py).
          if (opts.weak.enabled && blk->exited.fetch_add(1) + 1 == nthreads) {
            std::lock_guard<std::mutex> lk(blk->pool_m);
            Rng rng;
            rng.seed(opts.weak.seed ^ (0xb10cull + bl));
            blk->pool.drain(rng, opts.weak.order);
            blk->pool_n.store(0, std::memory_order_release);
          }
          tl_ctx = nullptr;
          tl_pop_cfg = nullptr;
          ctx.warpg->retire();
          blk->bar->retire();
        });
      }
    }
    for (std::thread& th : threads) th.join();
    if (opts.weak.enabled) {  // F2: the block's pool
      const WeakConfig* const outer_pop = tl_pop_cfg;
      tl_pop_cfg = &opts.weak;
      for (size_t i = 0; i < blocks.size(); ++i) {
        Rng rng;
        rng.seed(opts.weak.seed ^ (0xb10cull + b0 + i));
        blocks[i]->pool.drain(rng, opts.weak.order);
      }
      tl_pop_cfg = outer_pop;
    }
  }
  if (first_err) std::rethrow_exception(first_err);
}

// ---------------------------------------------------------------------------------------------
// Progress hooks: while a device thread spins (arch::spin_pause, strong mode), each registered
// hook gets one call before the thread yields. Rule: a hook is `int64_t fn(uint64_t arg)`, safe
// to call from any thread at any time, returning the work it did (> 0: the spinner looks again at
// once instead of yielding); the soft NIC registers its engine pass (gpunet/host/progress.py; under the
// NIC's executor try-lock), so a caller waiting for its own completion executes its NIC's WQEs on
// its own thread. Why: on the 2-core CI machine the caller,
// each NIC's engine thread and the other ranks' threads all poll, and every hand-off to an engine
// thread cost a context switch behind the others or a sleep (bench/cpu_put.py --diag: a run of
// put + quiet at 33 us instead of 12 us with caller and engine on one CPU). Not in weak mode, so
// the weak model's interleavings stay those its tests choose. The table is per library (hidden):
// a library runs hooks only where Python added it (gpunet/host/progress.py add_library; gpunet/_launch.py:
// the Context's ops library). tests/test_cpu_put.py::test_a_waiting_caller_executes_its_nics_work.
namespace detail {
constexpr int kProgressSlots = 64;    // engines per process (a NIC each, ...)
struct ProgressSlot {
  std::atomic<int64_t (*)(uint64_t)> fn{nullptr};
  std::atomic<uint64_t> arg{0};
  std::atomic<uint32_t> busy{0};  // callers inside fn: remove waits for 0
};
struct ProgressTable {
  std::mutex m;                    // add / remove
  std::atomic<uint32_t> top{0};    // slots [0, top) may be in use
  ProgressSlot slot[kProgressSlots];
};
__attribute__((visibility("hidden"))) inline ProgressTable progress_table;

// One call of every registered hook; returns the work they did.
inline int64_t run_progress() {
  ProgressTable& t = progress_table;
  const uint32_t top = t.top.load(std::memory_order_acquire);
  int64_t did = 0;
  for (uint32_t i = 0; i < top; ++i) {
    ProgressSlot& s = t.slot[i];
    if (!s.fn.load(std::memory_order_relaxed)) continue;
    s.busy.fetch_add(1, std::memory_order_seq_cst);
    if (auto fn = s.fn.load(std::memory_order_seq_cst)) did += fn(s.arg.load(std::memory_order_relaxed));
    s.busy.fetch_sub(1, std::memory_order_release);
  }
  return did;
}
}  // namespace detail

// The short form: a 1-D or dim3 launch with no shared memory and strong memory.
template <class Kernel, class... Args>
void launch(Dim3 grid, Dim3 block, uint32_t warp_size, Kernel kernel, Args... args) {
  LaunchOptions o;
  o.grid = grid;
  o.block = block;
  o.warp_size = warp_size;
  launch(o, kernel, args...);
}

}  // namespace gpunet::host

// Registration of progress hooks (see above), bound by gpunet/host/progress.py. Returns the slot, or -1
// when all kProgressSlots are taken (the caller then relies on its engine thread alone).
extern "C" __attribute__((used, visibility("default"))) inline int gpunet_host_progress_add(
    int64_t (*fn)(uint64_t), uint64_t arg) {
  auto& t = gpunet::host::detail::progress_table;
  std::lock_guard<std::mutex> g(t.m);
  for (int i = 0; i < gpunet::host::detail::kProgressSlots; ++i) {
    auto& s = t.slot[i];
    if (s.fn.load(std::memory_order_relaxed)) continue;
    s.arg.store(arg, std::memory_order_relaxed);
    s.fn.store(fn, std::memory_order_seq_cst);
    if (uint32_t(i) >= t.top.load(std::memory_order_relaxed)) t.top.store(i + 1, std::memory_order_release);
    return i;
  }
  return -1;
}

// Unregister slot `i`; returns once no thread is inside its hook (0), or -1 for a bad slot. A
// hook call is one bounded pass, so the wait ends; after it the hook's memory may be freed.
extern "C" __attribute__((used, visibility("default"))) inline int gpunet_host_progress_remove(int i) {
  auto& t = gpunet::host::detail::progress_table;
  if (i < 0 || i >= gpunet::host::detail::kProgressSlots) return -1;
  std::lock_guard<std::mutex> g(t.m);
  auto& s = t.slot[i];
  s.fn.store(nullptr, std::memory_order_seq_cst);
  while (s.busy.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  s.arg.store(0, std::memory_order_relaxed);
  return 0;
}
