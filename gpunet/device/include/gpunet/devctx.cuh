// gpunet/devctx.cuh — what the verbs and every transport read: the device context (DevCtx), one
// PeerDesc per PE with its explicit transport kind, and the small address helpers. gpunet/device/abi.py
// mirrors DevCtx, PeerDesc and the TRANSPORT_* kinds (tests/test_device_qp.py
// test_abi_layout_matches_cpp); gpunet/device/descriptors.py fills them.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "status.cuh"

namespace gpunet {

// How a PE is reached (PeerDesc::kind). abi.py: TRANSPORT_*. gpunet.cuh's dispatch() is the one
// switch over it; a new transport adds a kind here, a header under transport/ and a case there.
enum : uint32_t {
  TRANSPORT_NONE = 0,   // unreachable: every verb to it records a bad argument (SITE_PEER_KIND)
  TRANSPORT_IBGDA = 1,  // GPU-initiated posting on an RC QP (transport/ibgda.cuh; PeerDesc::qp)
  TRANSPORT_PROXY = 2,  // a CPU proxy posts for us (transport/proxy.cuh; PeerDesc::proxy)
  TRANSPORT_P2P = 3,    // stores into the PE's heap mapped here (transport/p2p.cuh; remote_base)
};

// The transports compiled into this translation unit: bit k for kind k (default: all three).
// A kernel built for fewer (e.g. -DGPUNET_TRANSPORTS=8u, p2p only: gpunet.ep's kernels for a
// world of p2p peers, gpunet/device/ep.py load_ep) carries no code of the others, which makes it half
// the size (ep_ll.cu: 23 k PTX lines against 45 k), and every verb to a PE of a kind left out
// records a bad argument (SITE_PEER_KIND) instead of posting
// (tests/test_device_qp.py test_a_build_without_a_transport_refuses_its_peers).
#ifndef GPUNET_TRANSPORTS
#define GPUNET_TRANSPORTS 14u
#endif
GPUNET_DEVICE constexpr bool transport_built(uint32_t kind) {
  return kind < 32 && ((uint32_t(GPUNET_TRANSPORTS) >> kind) & 1u) != 0;
}

// PeerDesc::rkey of a TRANSPORT_P2P peer: flags (a mapping needs no key). abi.py: P2P_*.
enum : uint32_t {
  P2P_STORE_ONLY = 1u,  // stores only: no remote loads, no remote atomics (the c500 profile)
  P2P_SAME_DEVICE = 2u, // the PE's heap is on this GPU (ranks sharing it): a signal's release
                        // needs device scope only (transport/p2p.cuh signal_store)
};

// put_signal's signal operation (gpunet.cuh put_signal_nbi). abi.py: SIGNAL_*.
enum : uint32_t {
  SIGNAL_ADD = 0,  // atomic add of the value (any number of signallers)
  SIGNAL_SET = 1,  // store of the value (one writer per word: the store-only form)
};

// How one PE is reached. 32 B. abi.py: PeerDesc.
struct PeerDesc {
  uint64_t qp;           // ibgda: QpDesc* (device memory) of the QP connected to this PE
  uint64_t remote_base;  // the PE's symmetric heap base, as its NIC resolves addresses (p2p: as
                         // mapped in this process)
  uint32_t rkey;         // the PE's heap rkey (p2p: P2P_* flags)
  uint32_t kind;         // TRANSPORT_*
  uint64_t proxy;        // proxy: proxy::ProxyChannel* (device memory) serving this PE
};
static_assert(sizeof(PeerDesc) == 32, "PeerDesc layout is mirrored in gpunet/device/abi.py");

// DevCtx::flags. abi.py: DEVCTX_*.
enum : uint32_t {
  // Signal words (and atomic results) are big-endian numbers: the NICs' 8-byte atomics run in the
  // IB wire order (Nic.atomic_endianness "big"). Clear: native order, the mlx5 HCA's host-endian
  // atomic mode (atomic_req_8B_endianness_mode), the default, so a host or torch reads sig[0].
  // One flag for the whole world (every rank's NIC agrees, gpunet.init checks): p2p stores and
  // NIC atomics can then share one word. api::signal_order (below) is the one conversion.
  DEVCTX_SIGNAL_BE = 1u,
};

// A device context: the symmetric heap, the peers, the status block. 128 B. abi.py: DevCtx.
struct DevCtx {
  uint64_t local_base;     // this PE's symmetric heap base
  uint64_t heap_bytes;
  uint32_t lkey;           // the local heap's lkey
  uint32_t npes;
  uint32_t my_pe;
  uint32_t scratch_slots;  // number of 8-byte atomic result slots at `scratch`
  uint64_t peers;          // PeerDesc[npes] (device memory)
  uint64_t status;         // Status* (device memory)
  uint64_t timeout_ns;     // bound of every device wait
  uint64_t scratch;        // atomic result slots, inside the local heap (the NIC writes them)
  uint64_t discard;        // 8 bytes inside the local heap the NIC may write and nobody reads
  uint64_t max_wqe_bytes;  // split puts/gets larger than this into several WQEs (0: 1 GiB)
  uint32_t flags;          // DEVCTX_*
  uint32_t pad;
  uint64_t reserved[5];
};
static_assert(sizeof(DevCtx) == 128, "DevCtx layout is mirrored in gpunet/device/abi.py");

// wait_until comparisons (Status::cmp records one). abi.py: CMP_*.
enum : uint32_t { CMP_EQ = 0, CMP_NE = 1, CMP_GE = 2, CMP_GT = 3, CMP_LE = 4, CMP_LT = 5 };

constexpr uint64_t kDefaultMaxWqeBytes = uint64_t(1) << 30;  // data segment byte_count is 31 bits

namespace api {

GPUNET_DEVICE Waiter waiter(const DevCtx& ctx) {
  return Waiter{reinterpret_cast<Status*>(uintptr_t(ctx.status)), ctx.timeout_ns};
}
GPUNET_DEVICE const PeerDesc* peers(const DevCtx& ctx) {
  return reinterpret_cast<const PeerDesc*>(uintptr_t(ctx.peers));
}
// The PeerDesc of `pe` if a verb may use it: pe in range and a transport to it. Otherwise a bad
// argument is recorded (SITE_PEER_RANGE: expected = npes, observed = pe; SITE_PEER_KIND: observed
// = the kind) and nullptr returned. `record` = false checks without recording (warp variants:
// one lane records).
GPUNET_DEVICE const PeerDesc* peer(const DevCtx& ctx, const Waiter& w, int pe, bool record = true) {
  if (pe < 0 || uint32_t(pe) >= ctx.npes) {
    if (record) record_bad_argument(w, SITE_PEER_RANGE, 0, uint32_t(pe), ctx.npes, uint32_t(pe));
    return nullptr;
  }
  const PeerDesc* p = peers(ctx) + pe;
  if ((p->kind != TRANSPORT_IBGDA && p->kind != TRANSPORT_PROXY && p->kind != TRANSPORT_P2P) ||
      !transport_built(p->kind)) {
    if (record) record_bad_argument(w, SITE_PEER_KIND, 0, uint32_t(pe), TRANSPORT_P2P, p->kind);
    return nullptr;
  }
  return p;
}
}  // namespace api

// A PE's descriptor held by the caller (gpunet.cuh peer_ref): every verb that names a PE also
// takes one instead of the number, and then reads no PeerDesc from memory. Valid for the kernel
// that took it (the host writes the descriptors only before a launch). pe < 0: not a usable PE
// (the bad argument was recorded when it was taken).
struct PeerRef {
  PeerDesc desc;
  int pe;
};

namespace api {
// What a verb resolves its PE argument to: the descriptor (nullptr: not usable) and the number.
struct PeerArg {
  const PeerDesc* p;
  int pe;
};
GPUNET_DEVICE PeerArg take(const DevCtx& ctx, const Waiter& w, int pe, bool record = true) {
  return PeerArg{peer(ctx, w, pe, record), pe};
}
// A held descriptor: checked when peer_ref took it, so nothing is loaded or recorded here.
GPUNET_DEVICE PeerArg take(const DevCtx&, const Waiter&, const PeerRef& r, bool = true) {
  return PeerArg{r.pe >= 0 ? &r.desc : nullptr, r.pe};
}
GPUNET_DEVICE uint64_t heap_off(const DevCtx& ctx, const void* local) {
  return uint64_t(uintptr_t(local)) - ctx.local_base;
}
// The address of symmetric `sym` on the PE `p` describes, as its NIC resolves it.
GPUNET_DEVICE uint64_t remote(const DevCtx& ctx, const PeerDesc& p, const void* sym) {
  return p.remote_base + (uint64_t(uintptr_t(sym)) - ctx.local_base);
}
GPUNET_DEVICE uint64_t max_wqe(const DevCtx& ctx) {
  return ctx.max_wqe_bytes ? ctx.max_wqe_bytes : kDefaultMaxWqeBytes;
}
// A signal word's value from its bytes in memory, or the bytes to store for a value: the identity
// in native mode, a byte swap with DEVCTX_SIGNAL_BE (an involution, so one function serves both
// directions). Every signal read, signal store, p2p atomic and fetched atomic result goes
// through it (tests/test_signal_endian.py runs both modes).
GPUNET_DEVICE uint64_t signal_order(const DevCtx& ctx, uint64_t v) {
  return (ctx.flags & DEVCTX_SIGNAL_BE) ? arch::bswap64(v) : v;
}
// This thread's 8-byte atomic result slot (global thread id modulo ctx.scratch_slots).
GPUNET_DEVICE uint64_t* result_slot(const DevCtx& ctx) {
  const arch::Dim3 b = arch::block_idx(), g = arch::grid_dim(), bd = arch::block_dim();
  const uint64_t gtid =
      uint64_t(b.x + g.x * (b.y + g.y * b.z)) * (bd.x * bd.y * bd.z) + arch::thread_rank();
  const uint64_t slots = ctx.scratch_slots ? ctx.scratch_slots : 1;
  return reinterpret_cast<uint64_t*>(uintptr_t(ctx.scratch)) + (gtid % slots);
}

}  // namespace api
}  // namespace gpunet
