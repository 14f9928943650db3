// pool_alloc.cpp: a first-fit sub-allocator over byte regions of gpunet's symmetric heap, with the
// entry points of torch's CUDAPluggableAllocator.
//
// WHY: the MoE high-throughput dispatch wants its receive tensors to be ordinary torch tensors the
// caller owns (like torch.empty) AND to lie inside this rank's symmetric heap, because peer GPUs map
// that heap and store rows straight into it; a receive tensor outside the heap would cost one more
// copy per row. gpunet/ep/_pool.py (RecvPool) is the only user: on CPU it calls gp_alloc_in /
// gp_free_at itself; on CUDA torch's caching allocator calls gp_torch_alloc / gp_torch_free for whole
// segments of a torch.cuda.MemPool and sub-allocates inside them in stream order.
//
// Plain C++17, no CUDA or torch headers: it only does address arithmetic on ranges it is given, so
// one build (loader.build(..., arch="host")) serves both platforms; the memory is never touched here.
//
// Policy: first fit over a free list kept in address order, blocks a multiple of kPage long and
// kPage-aligned (absolute addresses), neighbours coalesced on free. First fit because the callers
// are few and large (5 receive tensors per dispatch on CPU; torch's 2 MiB / 20 MiB segments on CUDA),
// so a list of a handful of free ranges is walked, and lower addresses are reused first, which keeps
// the region's tail in one piece for the next big request.

#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <mutex>
#include <sys/types.h>

namespace {

// Every block starts on a 4 KiB boundary and is a multiple of 4 KiB long: page granularity is what
// the NIC registration and the GPU's vectorised row stores (16 B) need at most, and whole pages keep
// two tensors from ever sharing a cache line that peers write concurrently.
constexpr uint64_t kPage = 4096;
// Regions live at once. A process has one symmetric heap per Buffer and one RecvPool per heap;
// 64 leaves room for tests that open many pools.
constexpr int kMaxRegions = 64;

// An allocated block and what its allocation was asked with. torch's CUDAPluggableAllocator hands
// gp_torch_free back exactly the (size, device, stream) it gave gp_torch_alloc for the pointer (c10
// raw_delete keeps them per pointer), so a free that disagrees is not this block's: freeing it anyway
// would let the next allocation hand out bytes a live tensor still uses.
struct Block {
    uint64_t len;                          // bytes taken: size rounded up to kPage
    uint64_t size;                         // bytes asked for
    int device;                            // torch's device index; -1: gp_alloc_in's (the CPU path)
    void* stream;                          // torch's stream; nullptr for gp_alloc_in's
};

struct Region {
    int id = -1;                           // -1: slot unused
    uint64_t lo = 0, hi = 0;               // usable [lo, hi): the page-aligned part of [base, base+size)
    uint64_t used = 0;                     // bytes in allocated blocks
    std::map<uint64_t, uint64_t> free_;    // start -> length, address order, never adjacent
    std::map<uint64_t, Block> taken;       // start -> allocated block
};

std::mutex g_mu;                           // guards everything below
Region g_regions[kMaxRegions];
// Ids are never reused in a process: a stale id (a closed pool's finaliser, a stale gp_select) then
// names no region instead of silently naming a new one that reuses the slot.
int g_next_id = 0;
uint64_t g_bad_frees = 0;

// The current region of this thread for gp_torch_alloc. Thread-local because torch's allocator
// callbacks carry no user context (only size, device, stream): RecvPool selects its region right
// before torch.empty and clears it right after, on the thread that allocates, and torch calls the
// alloc callback synchronously on that same thread.
thread_local int tl_selected = -1;

Region* find_id(int id) {
    if (id < 0) return nullptr;
    for (auto& r : g_regions)
        if (r.id == id) return &r;
    return nullptr;
}

Region* find_addr(uint64_t addr) {
    for (auto& r : g_regions)
        if (r.id >= 0 && addr >= r.lo && addr < r.hi) return &r;
    return nullptr;
}

uint64_t alloc_locked(Region& r, uint64_t size, int device, void* stream) {
    if (size == 0 || size > UINT64_MAX - (kPage - 1)) return 0;
    const uint64_t len = (size + kPage - 1) & ~(kPage - 1);
    for (auto it = r.free_.begin(); it != r.free_.end(); ++it) {
        if (it->second < len) continue;
        const uint64_t at = it->first, rest = it->second - len;
        r.free_.erase(it);
        if (rest) r.free_.emplace(at + len, rest);
        r.taken.emplace(at, Block{len, size, device, stream});
        r.used += len;
        return at;
    }
    return 0;
}

// Return block t of r to its free list, merged with its free neighbours.
void release_locked(Region& r, std::map<uint64_t, Block>::iterator t) {
    uint64_t at = t->first, len = t->second.len;
    r.taken.erase(t);
    r.used -= len;
    auto next = r.free_.lower_bound(at);
    if (next != r.free_.end() && next->first == at + len) {        // merge with the range after
        len += next->second;
        next = r.free_.erase(next);
    }
    if (next != r.free_.begin()) {                                  // merge with the range before
        auto prev = std::prev(next);
        if (prev->first + prev->second == at) {
            prev->second += len;
            return;
        }
    }
    r.free_.emplace(at, len);
}

// Returns false if addr is not the start of an allocated block of r.
bool free_locked(Region& r, uint64_t addr) {
    auto t = r.taken.find(addr);
    if (t == r.taken.end()) return false;
    release_locked(r, t);
    return true;
}

}  // namespace

extern "C" {

// Register [base, base+size) as a region; returns its id (>= 0), or -1 when the range is empty, holds
// no whole aligned page, wraps around, overlaps a registered region, or kMaxRegions are registered.
int gp_region_add(uint64_t base, uint64_t size) {
    if (base == 0 || size == 0 || size > UINT64_MAX - base) return -1;
    const uint64_t lo = (base + kPage - 1) & ~(kPage - 1);
    const uint64_t hi = (base + size) & ~(kPage - 1);
    if (lo < base || hi <= lo) return -1;
    std::lock_guard<std::mutex> g(g_mu);
    Region* slot = nullptr;
    for (auto& r : g_regions) {
        if (r.id < 0) {
            if (!slot) slot = &r;
        } else if (lo < r.hi && r.lo < hi) {
            return -1;     // overlapping regions would make gp_free_at's address lookup ambiguous
        }
    }
    if (!slot || g_next_id == INT32_MAX) return -1;
    slot->id = g_next_id++;
    slot->lo = lo;
    slot->hi = hi;
    slot->used = 0;
    slot->free_.clear();
    slot->taken.clear();
    slot->free_.emplace(lo, hi - lo);
    return slot->id;
}

// Forget region `id` and every block in it (unknown id: nothing). Frees that arrive later for its
// blocks find no region and are counted by gp_bad_frees.
void gp_region_remove(int id) {
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_id(id);
    if (!r) return;
    r->id = -1;
    r->free_.clear();
    r->taken.clear();
    r->used = 0;
    if (tl_selected == id) tl_selected = -1;
}

// Bytes in allocated blocks of region `id` (rounded sizes); 0 for an unknown id.
uint64_t gp_region_used(int id) {
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_id(id);
    return r ? r->used : 0;
}

// Select the region gp_torch_alloc allocates in, for the calling thread only (-1: none).
void gp_select(int id) { tl_selected = id; }

// First-fit allocation of `size` bytes (rounded up to kPage) in region `id`: the block's address, or 0
// when size is 0, the id is unknown, or no free range is large enough.
uint64_t gp_alloc_in(int id, uint64_t size) {
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_id(id);
    return r ? alloc_locked(*r, size, -1, nullptr) : 0;
}

// Free the block starting at `addr`, in whichever region holds it. An address that starts no
// allocated block (never allocated, freed twice, its region removed) is ignored and counted.
void gp_free_at(uint64_t addr) {
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_addr(addr);
    if (!r || !free_locked(*r, addr)) ++g_bad_frees;
}

// Free the block at `addr` only if it belongs to region `id`. RecvPool's CPU finalisers use this one:
// if the region was removed and a new one registered over the same addresses (a heap freed and mapped
// again), a late finaliser of an old tensor must not free a block of the new region. Counted like
// gp_free_at when it frees nothing.
void gp_free_in(int id, uint64_t addr) {
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_id(id);
    if (!r || !free_locked(*r, addr)) ++g_bad_frees;
}

// Frees that freed nothing, since the library was loaded.
uint64_t gp_bad_frees() {
    std::lock_guard<std::mutex> g(g_mu);
    return g_bad_frees;
}

// torch.cuda.memory.CUDAPluggableAllocator's allocation entry point (c10 calls it with the size of a
// whole caching-allocator segment): a block in this thread's selected region, or nullptr when no region
// is selected or none has room, which torch reports as torch.OutOfMemoryError. The block keeps size,
// device and stream for gp_torch_free to check.
void* gp_torch_alloc(ssize_t size, int device, void* stream) {
    const int id = tl_selected;
    if (id < 0 || size <= 0) return nullptr;
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_id(id);
    return r ? reinterpret_cast<void*>(alloc_locked(*r, static_cast<uint64_t>(size), device, stream))
             : nullptr;
}

// CUDAPluggableAllocator's free entry point. Found by pointer (torch may free a segment from any thread,
// empty_cache or pool destruction, where no region is selected), and freed only if the pointer starts a
// block that gp_torch_alloc handed out with this very size, device and stream. Anything else (a foreign
// pointer, a second free, a stale free landing on a new region over the same addresses with another
// size, a CPU block) means torch and this pool disagree: the block stays taken (leaked, never handed
// out twice), gp_bad_frees counts it and stderr says so, since torch has no way to hear of it.
void gp_torch_free(void* ptr, ssize_t size, int device, void* stream) {
    if (!ptr) return;
    const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
    std::lock_guard<std::mutex> g(g_mu);
    Region* r = find_addr(addr);
    auto t = r ? r->taken.find(addr) : std::map<uint64_t, Block>::iterator();
    if (r && t != r->taken.end()) {
        const Block& b = t->second;
        if (b.size == static_cast<uint64_t>(size) && b.device == device && b.stream == stream) {
            release_locked(*r, t);
            return;
        }
        std::fprintf(stderr, "gpunet pool_alloc: gp_torch_free(0x%" PRIx64 ", size %zd, device %d, "
                     "stream %p) refused: the block there was allocated with size %" PRIu64
                     ", device %d, stream %p; it stays allocated\n",
                     addr, size, device, stream, b.size, b.device, b.stream);
    } else {
        std::fprintf(stderr, "gpunet pool_alloc: gp_torch_free(0x%" PRIx64 ", size %zd, device %d, "
                     "stream %p) refused: %s\n", addr, size, device, stream,
                     r ? "no allocated block starts there (freed twice?)"
                       : "the pointer is in no region of this pool");
    }
    ++g_bad_frees;
}

}  // extern "C"
