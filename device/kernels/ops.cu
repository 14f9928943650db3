// Kernels over gpunet.cuh for the host wrappers and the tests: an explicit op-list kernel (each
// thread runs its own OpDesc list, then quiet) and the ordering-test SCHEDULE kernel (each thread
// expands a seed into its own operation sequence with a stateless hash that tests/ordering_ref.py
// mirrors). One source for every arm: g++ -x c++ (HOST) and nvcc (CUDA).
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;
using gpunet::DevCtx;

namespace {

// ---- explicit op lists -------------------------------------------------------------------------
// Mirrored in device/abi.py (OpDesc, OP_*).
enum : uint32_t {
  OP_NOP = 0, OP_PUT = 1, OP_PUT_INLINE = 2, OP_GET = 3, OP_PUT_SIGNAL = 4, OP_ATOMIC_ADD = 5,
  OP_QUIET = 6, OP_FENCE = 7, OP_WAIT_UNTIL = 8, OP_PUT_WARP = 9,
};

struct OpDesc {       // 64 B
  uint32_t kind;
  int32_t pe;
  uint64_t dst;       // put: symmetric dst; get: local dst; atomic: symmetric word; wait: local word
  uint64_t src;       // put: local src; get: symmetric src
  uint64_t nbytes;
  uint64_t sig;       // put_signal: symmetric signal word
  uint64_t value;     // put_signal / atomic: addend; wait_until: value
  uint32_t cmp;       // wait_until: CMP_*; put_signal: SIGNAL_* (0: ADD)
  uint32_t ok;        // out: 1 if the op returned true
  uint64_t result;    // out: atomic_fetch_add's old value
};
static_assert(sizeof(OpDesc) == 64, "OpDesc layout is mirrored in device/abi.py");

GPUNET_DEVICE uint64_t global_tid() {
  const arch::Dim3 b = arch::block_idx(), g = arch::grid_dim(), bd = arch::block_dim();
  return uint64_t(b.x + g.x * (b.y + g.y * b.z)) * (bd.x * bd.y * bd.z) + arch::thread_rank();
}

GPUNET_DEVICE bool run_op(const DevCtx& ctx, OpDesc& op) {
  switch (op.kind) {
    case OP_PUT:
      return gpunet::put_nbi(ctx, reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src),
                             op.nbytes, op.pe);
    case OP_PUT_INLINE:
      return gpunet::put_inline_nbi(ctx, reinterpret_cast<void*>(op.dst),
                                    reinterpret_cast<const void*>(op.src), uint32_t(op.nbytes), op.pe);
    case OP_GET:
      return gpunet::get_nbi(ctx, reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src),
                             op.nbytes, op.pe);
    case OP_PUT_SIGNAL:
      return gpunet::put_signal_nbi(ctx, reinterpret_cast<void*>(op.dst),
                                    reinterpret_cast<const void*>(op.src), op.nbytes,
                                    reinterpret_cast<uint64_t*>(op.sig), op.value, op.pe, op.cmp);
    case OP_ATOMIC_ADD: {
      bool ok = false;
      op.result = gpunet::atomic_fetch_add(ctx, reinterpret_cast<uint64_t*>(op.dst), op.value, op.pe, &ok);
      return ok;
    }
    case OP_QUIET: return gpunet::quiet(ctx);
    case OP_FENCE: return gpunet::fence(ctx);
    case OP_WAIT_UNTIL:
      return gpunet::wait_until(ctx, reinterpret_cast<const uint64_t*>(op.dst), op.cmp, op.value);
    default: return true;
  }
}

// Thread g runs ops[g * per_thread + i] in order, stops at its first failure, then quiets.
// OP_PUT_WARP is collective: every lane of a warp must have one at the same index (same args).
GPUNET_GLOBAL void k_ops(const DevCtx* ctx, OpDesc* ops, uint32_t per_thread) {
  OpDesc* mine = ops + global_tid() * per_thread;
  bool ok = true;
  for (uint32_t i = 0; i < per_thread; ++i) {
    OpDesc& op = mine[i];
    if (op.kind == OP_PUT_WARP) {
      // Collective: lanes agree to skip it once any lane has failed (no divergent collectives).
      const bool all_ok = arch::all(ok);
      if (all_ok)
        ok = gpunet::put_nbi_warp(*ctx, reinterpret_cast<void*>(op.dst),
                                  reinterpret_cast<const void*>(op.src), op.nbytes, op.pe);
      else
        ok = false;
      op.ok = ok;
      continue;
    }
    if (!ok) continue;
    ok = run_op(*ctx, op);
    op.ok = ok;
  }
  if (ok) gpunet::quiet(*ctx);
}

// ---- the ordering schedule -------------------------------------------------------------------
// Mirrored in device/abi.py (SchedParams) and tests/ordering_ref.py (the expansion).
struct SchedParams {
  uint64_t seed;
  uint32_t rounds;       // schedules run back to back by each thread (quiet between), own memory
  uint32_t ops;          // operations per thread per round
  uint32_t nthreads;     // grid * block
  uint32_t region;       // bytes of each thread's put / get / source region
  uint32_t max_size;     // largest put / get (<= region)
  uint32_t mix;          // enabled kinds: bit k = kind k of the table in expand()
  uint32_t ncounters;    // shared atomic counters
  uint32_t warp_region;  // bytes of each warp's region (warp puts)
  uint32_t check_every;  // put_signal: the thread waits for its own signal and checks the payload
                         // when hash % check_every == 0 (0: never)
  uint32_t pe;
  uint64_t src;          // local: nthreads * region bytes of pattern (never written)
  uint64_t wsrc;         // local: nwarps * warp_region bytes of pattern
  uint64_t get_src;      // symmetric: nthreads * region, pattern on the peer
  uint64_t get_dst;      // local: rounds * nthreads * region
  uint64_t put_dst;      // symmetric: rounds * nthreads * region
  uint64_t warp_dst;     // symmetric: rounds * nwarps * warp_region
  uint64_t sig;          // symmetric: rounds * nthreads uint64 signal words
  uint64_t counters;     // symmetric: ncounters uint64 words
  uint64_t results;      // plain: rounds * nthreads * ops uint64 (atomic old values, else ~0)
  uint64_t violations;   // plain: nthreads uint64 (payload checks that failed)
  uint64_t peer_view;    // the peer heap's base as THIS process sees it (receiver-side checks)
};
static_assert(sizeof(SchedParams) == 136, "SchedParams layout is mirrored in device/abi.py");

// Kinds of the table (a thread's op i of round r): h = mix64(seed, r, gtid, i), kind = h % 16.
enum : uint32_t { K_PUT = 0, K_INLINE = 1, K_GET = 2, K_SIGNAL = 3, K_ATOMIC = 4, K_QUIET = 5,
                  K_FENCE = 6, K_WARP = 7 };

GPUNET_HOST_DEVICE uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
GPUNET_HOST_DEVICE uint64_t mix64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return splitmix64(seed ^ splitmix64(a ^ splitmix64(b ^ splitmix64(c))));
}
// kind of a per-thread op: 16 buckets -> kinds (table mirrored in ordering_ref.py)
GPUNET_HOST_DEVICE uint32_t bucket_kind(uint32_t b) {
  // put 5, inline 2, get 3, signal 3, atomic 2, quiet 1 (fence shares the quiet bucket's odd half)
  const uint8_t table[16] = {0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5};
  return table[b & 15];
}

GPUNET_GLOBAL void k_schedule(const DevCtx* ctxp, const SchedParams* pp) {
  const DevCtx& ctx = *ctxp;
  const SchedParams& p = *pp;
  const uint64_t g = global_tid();
  const uint32_t ws = arch::warp_size();
  const uint64_t gwarp = g / ws;
  const uint64_t nwarps = (uint64_t(p.nthreads) + ws - 1) / ws;
  uint64_t* results = reinterpret_cast<uint64_t*>(p.results);
  uint64_t* violations = reinterpret_cast<uint64_t*>(p.violations);
  bool ok = true;
  for (uint32_t r = 0; r < p.rounds; ++r) {
    uint64_t nsig = 0;
    for (uint32_t i = 0; i < p.ops; ++i) {
      results[(uint64_t(r) * p.nthreads + g) * p.ops + i] = ~uint64_t(0);
      // Warp-level decision first: uniform over the warp (same hash on every lane).
      const uint64_t wh = mix64(p.seed, 0x1000 + r, gwarp, i);
      if ((p.mix >> K_WARP) & 1 && (wh & 7) == 0) {
        const uint64_t size = (wh >> 8) % (p.warp_region + 1);
        const uint64_t off = (wh >> 32) % (p.warp_region - size + 1);
        const uint64_t dst = p.warp_dst + (uint64_t(r) * nwarps + gwarp) * p.warp_region + off;
        const uint64_t src = p.wsrc + gwarp * p.warp_region + off;
        const bool all_ok = arch::all(ok);
        ok = all_ok && gpunet::put_nbi_warp(ctx, reinterpret_cast<void*>(dst),
                                            reinterpret_cast<const void*>(src), size, int(p.pe));
        continue;
      }
      if (!ok) continue;
      const uint64_t h = mix64(p.seed, r, g, i);
      uint32_t kind = bucket_kind(uint32_t(h & 15));
      if (kind == K_QUIET && ((h >> 4) & 1)) kind = K_FENCE;
      if (!((p.mix >> kind) & 1)) kind = K_PUT;  // disabled kinds become puts
      uint64_t size = (h >> 8) % (p.max_size + 1);
      if (kind == K_INLINE && size > gpunet::kMaxInline) size = gpunet::kMaxInline;
      const uint64_t off = (h >> 24) % (p.region - size + 1);
      const uint64_t soff = (h >> 44) % (p.region - size + 1);
      const uint64_t src = p.src + g * p.region + soff;
      const uint64_t dst = p.put_dst + (uint64_t(r) * p.nthreads + g) * p.region + off;
      switch (kind) {
        case K_PUT:
          ok = gpunet::put_nbi(ctx, reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size,
                               int(p.pe));
          break;
        case K_INLINE:
          ok = gpunet::put_inline_nbi(ctx, reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                      uint32_t(size), int(p.pe));
          break;
        case K_GET: {
          const uint64_t ldst = p.get_dst + (uint64_t(r) * p.nthreads + g) * p.region + off;
          const uint64_t rsrc = p.get_src + g * p.region + soff;
          ok = gpunet::get_nbi(ctx, reinterpret_cast<void*>(ldst), reinterpret_cast<const void*>(rsrc), size,
                               int(p.pe));
          break;
        }
        case K_SIGNAL: {
          const uint64_t sig = p.sig + (uint64_t(r) * p.nthreads + g) * 8;
          ok = gpunet::put_signal_nbi(ctx, reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                      size, reinterpret_cast<uint64_t*>(sig), 1, int(p.pe));
          ++nsig;
          if (ok && p.check_every && ((h >> 56) % p.check_every) == 0) {
            // Receiver role (the peer's memory is in this process): once the signal reads >= nsig,
            // the payload of this put_signal must be there.
            const uint64_t* rsig = reinterpret_cast<const uint64_t*>(p.peer_view + (sig - ctx.local_base));
            ok = gpunet::wait_until(ctx, rsig, gpunet::CMP_GE, nsig);
            if (ok) {
              const uint8_t* got = reinterpret_cast<const uint8_t*>(p.peer_view + (dst - ctx.local_base));
              const uint8_t* want = reinterpret_cast<const uint8_t*>(src);
              for (uint64_t k = 0; k < size; ++k)
                if (arch::load_relaxed(&got[k]) != want[k]) {
                  violations[g] += 1;
                  break;
                }
            }
          }
          break;
        }
        case K_ATOMIC: {
          const uint64_t c = p.counters + ((h >> 20) % p.ncounters) * 8;
          const uint64_t add = 1 + ((h >> 32) % 1000);
          bool aok = false;
          const uint64_t old = gpunet::atomic_fetch_add(ctx, reinterpret_cast<uint64_t*>(c), add, int(p.pe), &aok);
          ok = aok;
          if (ok) results[(uint64_t(r) * p.nthreads + g) * p.ops + i] = old;
          break;
        }
        case K_QUIET: ok = gpunet::quiet(ctx); break;
        case K_FENCE: ok = gpunet::fence(ctx); break;
      }
    }
    if (ok) ok = gpunet::quiet(ctx);
  }
}

GPUNET_GLOBAL void k_poll_once(gpunet::QpDesc* qp, gpunet::Status* st) {
  gpunet::poll_cq(qp, gpunet::Waiter{st, 1000000000ull});
}

inline gpunet::LaunchSpec spec(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t seed,
                               uint32_t order, uint32_t sleep_ns) {
  gpunet::LaunchSpec s;
  s.grid = grid;
  s.block = block;
  s.warp_size = ws;
  s.weak = weak != 0;
  s.weak_seed = seed;
  s.weak_order = order;
  s.weak_spin_sleep_ns = sleep_ns;
  return s;
}

}  // namespace

extern "C" {

// Sizes of the mirrored structs (device/abi.py checks them at load).
uint32_t gpunet_ops_abi_size(uint32_t which) {
  switch (which) {
    case 0: return sizeof(gpunet::Status);
    case 1: return sizeof(gpunet::CqDesc);
    case 2: return sizeof(gpunet::QpDesc);
    case 3: return sizeof(gpunet::PeerDesc);
    case 4: return sizeof(gpunet::DevCtx);
    case 5: return sizeof(OpDesc);
    case 6: return sizeof(SchedParams);
    default: return 0;
  }
}

// Every thread of grid x block runs its op list (per_thread ops), then quiet. HOST: weak/seed/
// order/sleep_ns select the weak-memory model; GPUs ignore them. Returns 0 or a launch error.
// OpDesc / SchedParams travel as void*: they live in the anonymous namespace, and nvcc gives an
// extern "C" function whose signature names such a type internal linkage (the symbol vanished
// from the CUDA build).
int gpunet_ops_launch(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t seed,
                      uint32_t order, uint32_t sleep_ns, const DevCtx* ctx, void* ops, uint32_t per_thread) {
  return gpunet::launch_kernel(spec(grid, block, ws, weak, seed, order, sleep_ns), k_ops, ctx,
                               static_cast<OpDesc*>(ops), per_thread);
}

// The Python API's launcher: one op list on ``stream`` (a cudaStream_t; 0 = the legacy default
// stream; HOST: ignored, the launch is synchronous). sync = 0: enqueue and return (GPUs report
// only launch errors); sync != 0: also wait for the kernel and report its error.
int gpunet_ops_launch_stream(uint32_t grid, uint32_t block, uint32_t ws, const DevCtx* ctx, void* ops,
                             uint32_t per_thread, void* stream, uint32_t sync) {
  gpunet::LaunchSpec s = spec(grid, block, ws, 0, 0, 0, 0);
  s.stream = stream;
  s.sync = sync != 0;
  return gpunet::launch_kernel(s, k_ops, ctx, static_cast<OpDesc*>(ops), per_thread);
}

int gpunet_schedule_launch(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t seed,
                           uint32_t order, uint32_t sleep_ns, const DevCtx* ctx, const void* p) {
  return gpunet::launch_kernel(spec(grid, block, ws, weak, seed, order, sleep_ns), k_schedule, ctx,
                               static_cast<const SchedParams*>(p));
}

uint64_t gpunet_mix64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) { return mix64(seed, a, b, c); }

// One poll of qp's CQ by one thread (tests/test_device_qp.py drives the collapsed-CQ
// reconstruction from hand-made QP states and CQE slots). Returns 0 or a launch error.
int gpunet_poll_cq_once(gpunet::QpDesc* qp, gpunet::Status* st) {
  gpunet::LaunchSpec s = spec(1, 1, 32, 0, 0, 0, 0);
  return gpunet::launch_kernel(s, k_poll_once, qp, st);
}

}  // extern "C"
