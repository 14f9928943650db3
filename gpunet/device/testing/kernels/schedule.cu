// Test and benchmark support, not the API: the kernels the device tests and bench/device_post.py
// drive directly (gpunet/device/testing/schedule.py binds them).
//   k_schedule   the ordering SCHEDULE kernel: each thread expands a seed into its own operation
//                sequence with a stateless hash that gpunet/device/testing/ordering_ref.py mirrors, and
//                runs it through gpunet.cuh's verbs (tests/test_ordering.py, bench/device_post.py).
//   k_poll_once  one CQ poll on a hand-made QP state (tests/test_device_qp.py).
// One source for every arm: g++ -x c++ (HOST) and nvcc (CUDA).
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;
using gpunet::DevCtx;

namespace {

// ---- the ordering schedule ---------------------------------------------------------------------
// Mirrored in gpunet/device/testing/schedule.py (SchedParams, K_*) and gpunet/device/testing/ordering_ref.py
// (the expansion).
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
static_assert(sizeof(SchedParams) == 136, "SchedParams layout is mirrored in gpunet/device/testing/schedule.py");

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
  const uint64_t g = arch::global_thread_rank();
  const uint32_t ws = arch::warp_size();
  const uint64_t gwarp = g / ws;
  const uint64_t nwarps = (uint64_t(p.nthreads) + ws - 1) / ws;
  uint64_t* results = reinterpret_cast<uint64_t*>(p.results);
  uint64_t* violations = reinterpret_cast<uint64_t*>(p.violations);
  bool ok = true;
  // Each op names the peer by number or by this PeerRef (hash bit 7; warp puts: odd rounds), so
  // every schedule runs both forms of every verb (gpunet.cuh peer_ref).
  const gpunet::PeerRef ref = gpunet::peer_ref(ctx, int(p.pe));
  auto with_pe = [&](bool held, auto f) { return held ? f(ref) : f(int(p.pe)); };
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
        ok = all_ok && with_pe(r & 1, [&](const auto& pe) {
               return gpunet::put_nbi_warp(ctx, reinterpret_cast<void*>(dst),
                                           reinterpret_cast<const void*>(src), size, pe);
             });
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
      const bool held = (h >> 7) & 1;
      switch (kind) {
        case K_PUT:
          ok = with_pe(held, [&](const auto& pe) {
            return gpunet::put_nbi(ctx, reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                   size, pe);
          });
          break;
        case K_INLINE:
          ok = with_pe(held, [&](const auto& pe) {
            return gpunet::put_inline_nbi(ctx, reinterpret_cast<void*>(dst),
                                          reinterpret_cast<const void*>(src), uint32_t(size), pe);
          });
          break;
        case K_GET: {
          const uint64_t ldst = p.get_dst + (uint64_t(r) * p.nthreads + g) * p.region + off;
          const uint64_t rsrc = p.get_src + g * p.region + soff;
          ok = with_pe(held, [&](const auto& pe) {
            return gpunet::get_nbi(ctx, reinterpret_cast<void*>(ldst),
                                   reinterpret_cast<const void*>(rsrc), size, pe);
          });
          break;
        }
        case K_SIGNAL: {
          const uint64_t sig = p.sig + (uint64_t(r) * p.nthreads + g) * 8;
          ok = with_pe(held, [&](const auto& pe) {
            return gpunet::put_signal_nbi(ctx, reinterpret_cast<void*>(dst),
                                          reinterpret_cast<const void*>(src), size,
                                          reinterpret_cast<uint64_t*>(sig), 1, pe);
          });
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
          const uint64_t old = with_pe(held, [&](const auto& pe) {
            return gpunet::atomic_fetch_add(ctx, reinterpret_cast<uint64_t*>(c), add, pe, &aok);
          });
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

// ---- one CQ poll -------------------------------------------------------------------------------
// One poll_cq by one thread on a hand-made QP state (tests/test_device_qp.py's collapsed-CQ credit
// cases).
GPUNET_GLOBAL void k_poll_once(gpunet::QpDesc* qp, gpunet::Status* st) {
  gpunet::poll_cq(qp, gpunet::Waiter{st, 1000000000ull});
}

// ---- one late leave ----------------------------------------------------------------------------
// The doorbell turn's owner at r, with everything below `rung` rung, by one thread, its tag hint
// `t` (tests/test_device_qp.py's late-leave cases: qp.cuh "The late leave").
GPUNET_GLOBAL void k_own_once(gpunet::QpDesc* qp, uint64_t rung, uint64_t r, uint64_t t) {
  gpunet::qpd::own_and_ring(gpunet::qp_ref(qp), rung, r, 0, t);
}

}  // namespace

extern "C" {

// sizeof(SchedParams) (gpunet/device/testing/schedule.py checks it at load).
uint32_t gpunet_schedule_params_size() { return sizeof(SchedParams); }

// Every thread of grid x block runs p->rounds schedules, quiet after each. HOST: weak/seed/order/
// sleep_ns select the weak-memory model; GPUs ignore them. Returns 0 or a launch error.
// SchedParams travels as void*: it lives in the anonymous namespace, and nvcc gives an extern "C"
// function whose signature names such a type internal linkage (the symbol would be missing from
// the CUDA library).
int gpunet_schedule_launch(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t seed,
                           uint32_t order, uint32_t sleep_ns, const DevCtx* ctx, const void* p) {
  const gpunet::LaunchSpec s{grid, block, ws, 0, nullptr, true, weak != 0, seed, order, sleep_ns};
  return gpunet::launch_kernel(s, k_schedule, ctx, static_cast<const SchedParams*>(p));
}

// One poll of qp's CQ by one thread. Returns 0 or a launch error.
int gpunet_poll_cq_once(gpunet::QpDesc* qp, gpunet::Status* st) {
  return gpunet::launch_kernel(gpunet::LaunchSpec{}, k_poll_once, qp, st);
}

// qpd::own_and_ring(qp, rung, r, word 0, hint t) by one thread. Returns 0 or a launch error.
int gpunet_own_once(gpunet::QpDesc* qp, uint64_t rung, uint64_t r, uint64_t t) {
  return gpunet::launch_kernel(gpunet::LaunchSpec{}, k_own_once, qp, rung, r, t);
}

}  // extern "C"
