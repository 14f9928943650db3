// The op-list kernel over gpunet.cuh behind the Python API's host wrappers (gpunet/_launch.py):
// each thread runs its own OpDesc list, then quiet; the bulk put (k_put_bulk), where the whole
// grid shares one list of puts; and one put to a p2p peer (k_put_p2p), a plain copy kernel. One
// source for every arm: g++ -x c++ (HOST) and nvcc (CUDA). The test kernels are in gpunet/device/testing/kernels/.
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;
using gpunet::DevCtx;

namespace {

// ---- explicit op lists -------------------------------------------------------------------------
// Mirrored in gpunet/device/abi.py (OpDesc, OP_*).
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
static_assert(sizeof(OpDesc) == 64, "OpDesc layout is mirrored in gpunet/device/abi.py");

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
  OpDesc* mine = ops + arch::global_thread_rank() * per_thread;
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

// The bulk put behind the host wrappers' large puts and put lists (gpunet/_launch.py
// bulk_geometry): every thread of the grid reads the same `nops` OP_PUT descriptors. Each put is
// cut into chunks of `chunk` bytes (the last one shorter; a 0-byte put is one empty chunk);
// counting chunks over the list in order, chunk k goes to block k % blocks, whose threads move it
// together (put_nbi_block: on p2p the threads' 16-byte stores, on ibgda a WQE per lane, on the
// proxy one command). A block stops at its first failure (recorded in the Status block; every
// block agrees on its own `ok`, so no barrier diverges) and clears `ok` of the put it failed on;
// the host sets every `ok` to 1 before the launch. Then the block syncs and its thread 0 quiets:
// the block's puts are complete when the kernel ends, as k_ops' are.
// The list lives where the host wrote it (on a GPU: host-mapped memory, a PCIe read per load), so
// thread 0 stages each put's fields in shared memory (kBulkSmem bytes of the launch) and the
// block reads them there: one read per block, not one per thread.
constexpr size_t kBulkSmem = 32;

// This block's chunks of one put (dst, src, n, pe), whose first chunk is chunk number k of the
// list; false once a chunk failed (the same on every thread of the block).
GPUNET_DEVICE bool put_chunks(const DevCtx& ctx, uint64_t dst, uint64_t src, uint64_t n, int pe,
                              uint64_t chunk, uint64_t k) {
  const arch::Dim3 g = arch::grid_dim(), b = arch::block_idx();
  const uint64_t blocks = uint64_t(g.x) * g.y * g.z;
  const uint64_t me = b.x + uint64_t(g.x) * (b.y + uint64_t(g.y) * b.z);
  const uint64_t nchunks = n == 0 ? 1 : (n + chunk - 1) / chunk;
  bool ok = true;
  for (uint64_t j = (me + blocks - k % blocks) % blocks; j < nchunks && ok; j += blocks) {
    const uint64_t off = j * chunk, len = n - off < chunk ? n - off : chunk;
    ok = gpunet::put_nbi_block(ctx, reinterpret_cast<uint8_t*>(dst) + off,
                               reinterpret_cast<const uint8_t*>(src) + off, n ? len : 0, pe);
  }
  return ok;
}

GPUNET_GLOBAL void k_put_bulk(const DevCtx* ctx, OpDesc* ops, uint32_t nops, uint64_t chunk) {
  uint64_t* staged = reinterpret_cast<uint64_t*>(arch::shared_mem());  // dst, src, nbytes, pe
  bool ok = true;
  uint64_t k = 0;  // chunks of the puts before op i
  for (uint32_t i = 0; i < nops && ok; ++i) {
    if (arch::thread_rank() == 0) {
      staged[0] = ops[i].dst;
      staged[1] = ops[i].src;
      staged[2] = ops[i].nbytes;
      staged[3] = uint64_t(uint32_t(ops[i].pe));
    }
    arch::syncthreads();
    const uint64_t dst = staged[0], src = staged[1], n = staged[2];
    const int pe = int32_t(uint32_t(staged[3]));
    arch::syncthreads();  // every thread has its copy before thread 0 stages the next put
    ok = put_chunks(*ctx, dst, src, n, pe, chunk, k);
    if (!ok && arch::thread_rank() == 0) ops[i].ok = 0;
    k += n == 0 ? 1 : (n + chunk - 1) / chunk;
  }
  arch::syncthreads();
  if (ok && arch::thread_rank() == 0) gpunet::quiet(*ctx);
}

// One put to a p2p peer whose mapping the host resolved: `dst` is the peer's bytes as mapped in
// this process (PeerDesc::remote_base + offset), the range checked on the host (gpunet/_launch.py
// Launcher). The grid copies it (transport/p2p.cuh P2p::copy_grid: nothing read but the source,
// no fence; complete at the kernel's end). Unroll: 16-byte loads in flight per thread; Plain:
// weak vector stores (bench/p2p.py's copy sweep measures the four).
// It names P2p below the verbs on purpose: a verb would read the DevCtx, the PeerDesc and the
// Status first, three dependent memory round trips for what the host already knows.
template <uint32_t Unroll, bool Plain>
GPUNET_GLOBAL void k_put_p2p(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t chunk) {
  // Launched overlapping the kernel before it (gpunet_put_p2p_launch): the next put may start
  // its blocks now, and this one touches no byte before the previous kernel has ended.
  arch::launch_dependents();
  arch::wait_previous_grid();
  gpunet::transport::P2p::copy_grid<Unroll, Plain>(reinterpret_cast<uint8_t*>(dst),
                                                   reinterpret_cast<const uint8_t*>(src), nbytes,
                                                   chunk);
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

// Sizes of the mirrored structs (gpunet/device/abi.py checks them at load).
uint32_t gpunet_ops_abi_size(uint32_t which) {
  switch (which) {
    case 0: return sizeof(gpunet::Status);
    case 1: return sizeof(gpunet::CqDesc);
    case 2: return sizeof(gpunet::QpDesc);
    case 3: return sizeof(gpunet::PeerDesc);
    case 4: return sizeof(gpunet::DevCtx);
    case 5: return sizeof(OpDesc);
    default: return 0;
  }
}

// Every thread of grid x block runs its op list (per_thread ops), then quiet. HOST: weak/seed/
// order/sleep_ns select the weak-memory model; GPUs ignore them. Returns 0 or a launch error.
// OpDesc travels as void*: it lives in the anonymous namespace, and nvcc gives an extern "C"
// function whose signature names such a type internal linkage (the symbol would be missing from
// the CUDA library).
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

// k_put_bulk on grid x block threads (see there): `ops` holds `nops` OP_PUT descriptors, cut in
// chunks of `chunk` bytes (> 0). HOST: weak/seed/order/sleep_ns as gpunet_ops_launch; GPUs:
// `stream` (a cudaStream_t) and `sync` as gpunet_ops_launch_stream. Returns 0 or a launch error.
int gpunet_put_bulk_launch(uint32_t grid, uint32_t block, uint32_t ws, uint32_t weak, uint64_t seed,
                           uint32_t order, uint32_t sleep_ns, const DevCtx* ctx, void* ops,
                           uint32_t nops, uint64_t chunk, void* stream, uint32_t sync) {
  if (chunk == 0) return -1;
  gpunet::LaunchSpec s = spec(grid, block, ws, weak, seed, order, sleep_ns);
  s.shared_bytes = kBulkSmem;
  s.stream = stream;
  s.sync = sync != 0;
  return gpunet::launch_kernel(s, k_put_bulk, ctx, static_cast<OpDesc*>(ops), nops, chunk);
}

// k_put_p2p (see there) on grid x block threads: `dst` mapped, `src` local, chunk > 0 bytes (a
// multiple of 256). variant: bit 0 Unroll 8 (else 4), bit 1 weak stores (else volatile).
// HOST: ws = the emulated warp; GPUs: `stream` and `sync` as gpunet_ops_launch_stream.
int gpunet_put_p2p_launch(uint32_t grid, uint32_t block, uint32_t ws, uint64_t dst, uint64_t src,
                          uint64_t nbytes, uint64_t chunk, uint32_t variant, void* stream,
                          uint32_t sync) {
  if (chunk == 0 || (chunk & 255) != 0 || variant > 3) return -1;
  gpunet::LaunchSpec s = spec(grid, block, ws, 0, 0, 0, 0);
  s.stream = stream;
  s.sync = sync != 0;
  s.overlap_previous = true;  // k_put_p2p waits for the previous kernel itself
  switch (variant) {
    case 0: return gpunet::launch_kernel(s, k_put_p2p<4, false>, dst, src, nbytes, chunk);
    case 1: return gpunet::launch_kernel(s, k_put_p2p<8, false>, dst, src, nbytes, chunk);
    case 2: return gpunet::launch_kernel(s, k_put_p2p<4, true>, dst, src, nbytes, chunk);
    default: return gpunet::launch_kernel(s, k_put_p2p<8, true>, dst, src, nbytes, chunk);
  }
}

}  // extern "C"
