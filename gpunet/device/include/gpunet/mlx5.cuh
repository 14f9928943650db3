// gpunet/mlx5.cuh — the mlx5 wire format for device code: the mirror of gpunet/mlx5.py.
//
// gpunet/mlx5.py is the single source of truth (checked byte for byte against rdma-core's
// <infiniband/mlx5dv.h> by tests/test_mlx5_oracle.py); this header repeats its names and values in
// C++ and tests/test_mlx5_mirror.py checks every builder and parser here against it, byte for byte
// (HOST arm, g++), and that nvcc compiles it (CUDA arm). Change both files together.
//
// Two kinds of builders:
//   * value builders (ctrl_seg, raddr_seg, data_seg, atomic_seg, inline_hdr, rdma_wqe,
//     write_inline_wqe, ...) return a segment's 16 bytes as a Seg16 of two 64-bit words in memory
//     order: storing w[0] then w[1] with plain little-endian 64-bit stores at a 16-byte aligned
//     address reproduces the bytes. These are what the device posts: qp.cuh stores each Seg16 with
//     one 16-byte arch::store_relaxed_v2, so that the HOST arm's weak-memory model sees (and may
//     hold back) every store the NIC reads.
//   * writers (set_ctrl_seg, set_data_seg, build_rdma, build_write_inline, ...) fill a byte buffer
//     exactly as gpunet/mlx5.py's functions of the same name do (same bytes, same untouched bytes),
//     for code that needs no ordering model: host-side tools, tests, the proxy's staging buffers.
// Every target (x86-64, NVIDIA, MetaX) is little-endian; the value builders assume it.
//
// Python passes (buf, off); here the pointer is buf + off. All multi-byte wire fields big-endian.
#pragma once

#include <stdint.h>

#if defined(__has_include)
#if __has_include("arch.cuh")
#include "arch.cuh"
#define GPUNET_MLX5_HAVE_ARCH 1
#endif
#endif

// Fallbacks for a build without arch.cuh (it defines both for every arm).
#ifndef GPUNET_DEVICE
#if defined(__CUDACC__) || defined(__MACA__)
#define GPUNET_DEVICE __device__ __forceinline__
#else
#define GPUNET_DEVICE inline
#endif
#endif
#ifndef GPUNET_HOST_DEVICE
#if defined(__CUDACC__) || defined(__MACA__)
#define GPUNET_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GPUNET_HOST_DEVICE inline
#endif
#endif

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "gpunet/mlx5.cuh: the value builders assume a little-endian target");
#endif

namespace gpunet {
namespace mlx5 {

// --- sizes --------------------------------------------------------------------------------------
constexpr uint32_t WQEBB = 64;           // WQE basic block: the unit of the send queue ring
constexpr uint32_t DS_UNIT = 16;         // ds counts 16-byte units
constexpr uint32_t CTRL_SEG_SIZE = 16;
constexpr uint32_t RADDR_SEG_SIZE = 16;
constexpr uint32_t DATA_SEG_SIZE = 16;
constexpr uint32_t ATOMIC_SEG_SIZE = 16;
constexpr uint32_t INLINE_HDR_SIZE = 4;  // the inline segment's byte_count word; data follows it
constexpr uint32_t CQE_SIZE = 64;
constexpr uint32_t MAX_DS = 63;          // ds is 6 bits (<= 63 * 16 = 1008 B)

// --- WQE opcodes (MLX5_OPCODE_*) ----------------------------------------------------------------
constexpr uint32_t OPCODE_NOP = 0x00;
constexpr uint32_t OPCODE_RDMA_WRITE = 0x08;
constexpr uint32_t OPCODE_RDMA_WRITE_IMM = 0x09;
constexpr uint32_t OPCODE_SEND = 0x0A;
constexpr uint32_t OPCODE_SEND_IMM = 0x0B;
constexpr uint32_t OPCODE_RDMA_READ = 0x10;
constexpr uint32_t OPCODE_ATOMIC_CS = 0x11;
constexpr uint32_t OPCODE_ATOMIC_FA = 0x12;
constexpr uint32_t OPCODE_ATOMIC_MASKED_CS = 0x14;
constexpr uint32_t OPCODE_ATOMIC_MASKED_FA = 0x15;

// --- ctrl segment fm_ce_se flags (MLX5_WQE_CTRL_*) ----------------------------------------------
constexpr uint32_t WQE_CTRL_CQ_UPDATE = 0x08;
constexpr uint32_t WQE_CTRL_SOLICITED = 0x02;
constexpr uint32_t WQE_CTRL_FENCE = 0x80;
constexpr uint32_t WQE_CTRL_INITIATOR_SMALL_FENCE = 0x20;

constexpr uint32_t INLINE_SEG = 0x80000000u;  // MLX5_INLINE_SEG, in an inline segment's byte_count

// --- ctrl segment field offsets (struct mlx5_wqe_ctrl_seg, packed) ------------------------------
constexpr uint32_t CTRL_OPMOD_IDX_OPCODE = 0;
constexpr uint32_t CTRL_QPN_DS = 4;
constexpr uint32_t CTRL_SIGNATURE = 8;
constexpr uint32_t CTRL_DCI_STREAM_CHANNEL_ID = 9;
constexpr uint32_t CTRL_FM_CE_SE = 11;
constexpr uint32_t CTRL_IMM = 12;

// --- CQE (struct mlx5_cqe64 / struct mlx5_err_cqe) ------------------------------------------------
constexpr uint32_t CQE_SRQN_UIDX = 32;
constexpr uint32_t CQE_IMM_INVAL_PKEY = 36;
constexpr uint32_t CQE_BYTE_CNT = 44;
constexpr uint32_t CQE_TIMESTAMP = 48;
constexpr uint32_t CQE_VENDOR_ERR_SYND = 54;  // mlx5_err_cqe (aliases the timestamp's byte 6)
constexpr uint32_t CQE_SYNDROME = 55;         // mlx5_err_cqe (aliases the timestamp's byte 7)
constexpr uint32_t CQE_SOP_DROP_QPN = 56;     // in mlx5_err_cqe: s_wqe_opcode_qpn
constexpr uint32_t CQE_WQE_COUNTER = 60;
constexpr uint32_t CQE_SIGNATURE = 62;
constexpr uint32_t CQE_OP_OWN = 63;

constexpr uint32_t CQE_REQ = 0;
constexpr uint32_t CQE_RESP_WR_IMM = 1;
constexpr uint32_t CQE_RESP_SEND = 2;
constexpr uint32_t CQE_RESP_SEND_IMM = 3;
constexpr uint32_t CQE_REQ_ERR = 13;
constexpr uint32_t CQE_RESP_ERR = 14;
constexpr uint32_t CQE_INVALID = 15;
constexpr uint32_t CQE_OP_OWN_INIT = 0xF0;  // rdma-core fills every op_own with this at creation

// --- error CQE syndromes (MLX5_CQE_SYNDROME_*) --------------------------------------------------
constexpr uint32_t SYNDROME_LOCAL_LENGTH_ERR = 0x01;
constexpr uint32_t SYNDROME_LOCAL_QP_OP_ERR = 0x02;
constexpr uint32_t SYNDROME_LOCAL_PROT_ERR = 0x04;
constexpr uint32_t SYNDROME_WR_FLUSH_ERR = 0x05;
constexpr uint32_t SYNDROME_MW_BIND_ERR = 0x06;
constexpr uint32_t SYNDROME_BAD_RESP_ERR = 0x10;
constexpr uint32_t SYNDROME_LOCAL_ACCESS_ERR = 0x11;
constexpr uint32_t SYNDROME_REMOTE_INVAL_REQ_ERR = 0x12;
constexpr uint32_t SYNDROME_REMOTE_ACCESS_ERR = 0x13;
constexpr uint32_t SYNDROME_REMOTE_OP_ERR = 0x14;
constexpr uint32_t SYNDROME_TRANSPORT_RETRY_EXC_ERR = 0x15;
constexpr uint32_t SYNDROME_RNR_RETRY_EXC_ERR = 0x16;
constexpr uint32_t SYNDROME_REMOTE_ABORTED_ERR = 0x22;

// --- doorbell records and the UAR ---------------------------------------------------------------
constexpr uint32_t DBREC_RCV = 0;              // dbrec[0]: receive counter / CQ consumer index
constexpr uint32_t DBREC_SND = 1;              // dbrec[1]: send producer index, 16 bits, big-endian
constexpr uint32_t DBREC_SIZE = 8;             // two 32-bit words
constexpr uint32_t UAR_BF_REG_OFFSET = 0x800;  // the doorbell register: UAR page base + 0x800
constexpr uint32_t BF_SIZE = 256;              // rdma-core alternates reg_addr ^= bf size

// per-opcode ds (16-byte units) for the fixed-size WQEs
constexpr uint32_t DS_RDMA = 3;    // ctrl + raddr + data
constexpr uint32_t DS_ATOMIC = 4;  // ctrl + raddr + atomic + data(8 B)
constexpr uint32_t DS_NOP = 1;

// A readable name for an error-CQE syndrome ("unknown syndrome" otherwise: the Python side adds
// the hex value, which device code records separately in its status block).
GPUNET_HOST_DEVICE const char* syndrome_name(uint32_t syndrome) {
  switch (syndrome) {
    case SYNDROME_LOCAL_LENGTH_ERR: return "local length error";
    case SYNDROME_LOCAL_QP_OP_ERR: return "local QP operation error";
    case SYNDROME_LOCAL_PROT_ERR: return "local protection error";
    case SYNDROME_WR_FLUSH_ERR: return "work request flushed";
    case SYNDROME_MW_BIND_ERR: return "memory window bind error";
    case SYNDROME_BAD_RESP_ERR: return "bad response";
    case SYNDROME_LOCAL_ACCESS_ERR: return "local access error";
    case SYNDROME_REMOTE_INVAL_REQ_ERR: return "remote invalid request";
    case SYNDROME_REMOTE_ACCESS_ERR: return "remote access error";
    case SYNDROME_REMOTE_OP_ERR: return "remote operation error";
    case SYNDROME_TRANSPORT_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case SYNDROME_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case SYNDROME_REMOTE_ABORTED_ERR: return "remote aborted";
    default: return "unknown syndrome";
  }
}

// --- byte order ---------------------------------------------------------------------------------
// arch.cuh's per-arm swaps where it is present (prmt on CUDA, shifts on MACA, builtins on HOST);
// portable shifts otherwise.
#if defined(GPUNET_MLX5_HAVE_ARCH)
GPUNET_DEVICE uint16_t bswap16(uint16_t v) { return ::gpunet::arch::bswap16(v); }
GPUNET_DEVICE uint32_t bswap32(uint32_t v) { return ::gpunet::arch::bswap32(v); }
GPUNET_DEVICE uint64_t bswap64(uint64_t v) { return ::gpunet::arch::bswap64(v); }
#else
GPUNET_DEVICE uint16_t bswap16(uint16_t v) { return uint16_t((v >> 8) | (v << 8)); }
GPUNET_DEVICE uint32_t bswap32(uint32_t v) {
  return (v << 24) | ((v & 0xFF00u) << 8) | ((v >> 8) & 0xFF00u) | (v >> 24);
}
GPUNET_DEVICE uint64_t bswap64(uint64_t v) {
  return (uint64_t(bswap32(uint32_t(v))) << 32) | bswap32(uint32_t(v >> 32));
}
#endif

GPUNET_DEVICE void put_be16(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 8);
  p[1] = uint8_t(v);
}
GPUNET_DEVICE void put_be32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24);
  p[1] = uint8_t(v >> 16);
  p[2] = uint8_t(v >> 8);
  p[3] = uint8_t(v);
}
GPUNET_DEVICE void put_be64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (56 - 8 * i));
}
GPUNET_DEVICE void put_le32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
  p[2] = uint8_t(v >> 16);
  p[3] = uint8_t(v >> 24);
}
GPUNET_DEVICE void put_le64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
GPUNET_DEVICE uint32_t get_be16(const uint8_t* p) { return (uint32_t(p[0]) << 8) | p[1]; }
GPUNET_DEVICE uint32_t get_be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}
GPUNET_DEVICE uint64_t get_be64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}
GPUNET_DEVICE uint32_t get_le32(const uint8_t* p) {
  return (uint32_t(p[3]) << 24) | (uint32_t(p[2]) << 16) | (uint32_t(p[1]) << 8) | p[0];
}
GPUNET_DEVICE uint64_t get_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// --- WQE arithmetic -----------------------------------------------------------------------------
// WQEBBs a WQE of `ds` 16-byte units occupies: the producer-index advance.
GPUNET_HOST_DEVICE constexpr uint32_t wqebb_count(uint32_t ds) {
  return (ds * DS_UNIT + WQEBB - 1) / WQEBB;
}
// ds of an RDMA WRITE whose `nbytes` payload is carried inline (ctrl + raddr + inline segment).
GPUNET_HOST_DEVICE constexpr uint32_t inline_ds(uint32_t nbytes) {
  return 2 + (INLINE_HDR_SIZE + nbytes + DS_UNIT - 1) / DS_UNIT;
}

// --- segments as values -------------------------------------------------------------------------
// 16 wire bytes as two words in memory order (w[0] = bytes 0..7 as a little-endian load).
struct Seg16 {
  uint64_t w[2];
};
// The 32-bit word `i` (0..3) of a segment, in memory order (bytes 4i..4i+3, little-endian load).
GPUNET_DEVICE uint32_t seg_u32(const Seg16& s, int i) {
  return uint32_t(s.w[i >> 1] >> (32 * (i & 1)));
}
GPUNET_DEVICE uint64_t pack_u32(uint32_t lo, uint32_t hi) { return uint64_t(lo) | (uint64_t(hi) << 32); }

// struct mlx5_wqe_ctrl_seg as mlx5dv_set_ctrl_seg fills it, with dci_stream_channel_id = 0.
// `pi` keeps 16 bits, `qpn` 24; `imm` is stored as given (pass bswap32(v) to carry immediate v).
GPUNET_DEVICE Seg16 ctrl_seg(uint32_t pi, uint32_t opcode, uint32_t opmod, uint32_t qpn,
                             uint32_t fm_ce_se, uint32_t ds, uint32_t signature, uint32_t imm) {
  const uint32_t w0 = bswap32(((opmod & 0xFF) << 24) | ((pi & 0xFFFF) << 8) | (opcode & 0xFF));
  const uint32_t w1 = bswap32(((qpn & 0xFFFFFF) << 8) | (ds & 0xFF));
  const uint32_t w2 = (signature & 0xFF) | ((fm_ce_se & 0xFF) << 24);  // bytes 8, (9, 10) = 0, 11
  return Seg16{{pack_u32(w0, w1), pack_u32(w2, imm)}};
}
// struct mlx5_wqe_raddr_seg: raddr be64, rkey be32, reserved 0.
GPUNET_DEVICE Seg16 raddr_seg(uint64_t raddr, uint32_t rkey) {
  return Seg16{{bswap64(raddr), pack_u32(bswap32(rkey), 0)}};
}
// struct mlx5_wqe_data_seg as mlx5dv_set_data_seg fills it.
GPUNET_DEVICE Seg16 data_seg(uint32_t byte_count, uint32_t lkey, uint64_t addr) {
  return Seg16{{pack_u32(bswap32(byte_count), bswap32(lkey)), bswap64(addr)}};
}
// struct mlx5_wqe_atomic_seg: fetch-add puts the addend in swap_add.
GPUNET_DEVICE Seg16 atomic_seg(uint64_t swap_add, uint64_t compare) {
  return Seg16{{bswap64(swap_add), bswap64(compare)}};
}
// The inline segment's byte_count word (len | MLX5_INLINE_SEG), in memory order.
GPUNET_DEVICE uint32_t inline_hdr(uint32_t nbytes) {
  return bswap32((nbytes & 0x7FFFFFFFu) | INLINE_SEG);
}

// One 64-byte WQEBB as values; segments a WQE does not use are zero.
struct Wqebb {
  Seg16 seg[4];
};
// RDMA WRITE / WRITE_WITH_IMM / READ with one data segment (ds = 3).
GPUNET_DEVICE Wqebb rdma_wqe(uint32_t pi, uint32_t qpn, uint32_t opcode, uint32_t fm_ce_se,
                             uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey,
                             uint32_t nbytes, uint32_t imm) {
  return Wqebb{{ctrl_seg(pi, opcode, 0, qpn, fm_ce_se, DS_RDMA, 0, imm), raddr_seg(raddr, rkey),
                data_seg(nbytes, lkey, laddr), Seg16{{0, 0}}}};
}
// 8-byte ATOMIC fetch-add / compare-swap (ds = 4); the old value lands at laddr (8 B, big-endian).
GPUNET_DEVICE Wqebb atomic_wqe(uint32_t pi, uint32_t qpn, uint32_t opcode, uint32_t fm_ce_se,
                               uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey,
                               uint64_t swap_add, uint64_t compare) {
  return Wqebb{{ctrl_seg(pi, opcode, 0, qpn, fm_ce_se, DS_ATOMIC, 0, 0), raddr_seg(raddr, rkey),
                atomic_seg(swap_add, compare), data_seg(8, lkey, laddr)}};
}
// NOP (ds = 1).
GPUNET_DEVICE Wqebb nop_wqe(uint32_t pi, uint32_t qpn, uint32_t fm_ce_se) {
  return Wqebb{{ctrl_seg(pi, OPCODE_NOP, 0, qpn, fm_ce_se, DS_NOP, 0, 0), Seg16{{0, 0}},
                Seg16{{0, 0}}, Seg16{{0, 0}}}};
}

// RDMA WRITE (or WRITE_WITH_IMM) carrying `nbytes` of `data` inline, as values: segs[0 .. 4 * nbb)
// are the WQE's whole WQEBBs (ctrl, raddr, inline header + payload, zero padding) in memory
// order, so that storing them contiguously gives build_write_inline's bytes (at pi, unwrapped).
// Returns nbb = wqebb_count(inline_ds(nbytes)); `segs` must hold 4 * nbb segments.
GPUNET_DEVICE uint32_t write_inline_wqe(Seg16* segs, uint32_t pi, uint32_t qpn, uint32_t opcode,
                                        uint32_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                        const uint8_t* data, uint32_t nbytes, uint32_t imm) {
  const uint32_t ds = inline_ds(nbytes);
  const uint32_t nbb = wqebb_count(ds);
  segs[0] = ctrl_seg(pi, opcode, 0, qpn, fm_ce_se, ds, 0, imm);
  segs[1] = raddr_seg(raddr, rkey);
  // The inline segment runs on through the later segments: header word, payload, zeros.
  uint8_t* b = reinterpret_cast<uint8_t*>(&segs[2]);  // (a byte view may alias any object)
  const uint32_t hdr = inline_hdr(nbytes);
  for (uint32_t i = 0; i < INLINE_HDR_SIZE; ++i) b[i] = uint8_t(hdr >> (8 * i));
  const uint32_t room = nbb * WQEBB - CTRL_SEG_SIZE - RADDR_SEG_SIZE - INLINE_HDR_SIZE;
  for (uint32_t i = 0; i < room; ++i) b[INLINE_HDR_SIZE + i] = i < nbytes ? data[i] : 0;
  return nbb;
}

// --- writers (gpunet/mlx5.py's functions of the same name, byte for byte) -------------------------
// Plain byte stores: no alignment needed, no ordering implied.
GPUNET_DEVICE void store_seg(uint8_t* p, const Seg16& s) {
  put_le64(p, s.w[0]);
  put_le64(p + 8, s.w[1]);
}

// Leaves dci_stream_channel_id (bytes 9..10) as it was, as rdma-core does.
GPUNET_DEVICE void set_ctrl_seg(uint8_t* p, uint32_t pi, uint32_t opcode, uint32_t opmod,
                                uint32_t qpn, uint32_t fm_ce_se, uint32_t ds, uint32_t signature,
                                uint32_t imm) {
  put_be32(p + CTRL_OPMOD_IDX_OPCODE, ((opmod & 0xFF) << 24) | ((pi & 0xFFFF) << 8) | (opcode & 0xFF));
  put_be32(p + CTRL_QPN_DS, ((qpn & 0xFFFFFF) << 8) | (ds & 0xFF));
  p[CTRL_SIGNATURE] = uint8_t(signature);
  p[CTRL_FM_CE_SE] = uint8_t(fm_ce_se);
  put_le32(p + CTRL_IMM, imm);
}
GPUNET_DEVICE void set_raddr_seg(uint8_t* p, uint64_t raddr, uint32_t rkey) {
  put_be64(p, raddr);
  put_be32(p + 8, rkey);
  put_be32(p + 12, 0);
}
GPUNET_DEVICE void set_data_seg(uint8_t* p, uint32_t byte_count, uint32_t lkey, uint64_t addr) {
  put_be32(p, byte_count);
  put_be32(p + 4, lkey);
  put_be64(p + 8, addr);
}
GPUNET_DEVICE void set_atomic_seg(uint8_t* p, uint64_t swap_add, uint64_t compare) {
  put_be64(p, swap_add);
  put_be64(p + 8, compare);
}
GPUNET_DEVICE void set_inline_hdr(uint8_t* p, uint32_t nbytes) {
  put_be32(p, (nbytes & 0x7FFFFFFFu) | INLINE_SEG);
}

// Whole WQEs into one WQEBB at `p`; each returns the WQEBBs written (1) and leaves bytes past the
// WQE's ds untouched.
GPUNET_DEVICE uint32_t build_rdma(uint8_t* p, uint32_t pi, uint32_t qpn, uint32_t opcode,
                                  uint32_t fm_ce_se, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                                  uint32_t lkey, uint32_t nbytes, uint32_t imm) {
  set_ctrl_seg(p, pi, opcode, 0, qpn, fm_ce_se, DS_RDMA, 0, imm);
  set_raddr_seg(p + CTRL_SEG_SIZE, raddr, rkey);
  set_data_seg(p + CTRL_SEG_SIZE + RADDR_SEG_SIZE, nbytes, lkey, laddr);
  return 1;
}
GPUNET_DEVICE uint32_t build_atomic(uint8_t* p, uint32_t pi, uint32_t qpn, uint32_t opcode,
                                    uint32_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                    uint64_t laddr, uint32_t lkey, uint64_t swap_add,
                                    uint64_t compare) {
  set_ctrl_seg(p, pi, opcode, 0, qpn, fm_ce_se, DS_ATOMIC, 0, 0);
  set_raddr_seg(p + CTRL_SEG_SIZE, raddr, rkey);
  set_atomic_seg(p + CTRL_SEG_SIZE + RADDR_SEG_SIZE, swap_add, compare);
  set_data_seg(p + CTRL_SEG_SIZE + RADDR_SEG_SIZE + ATOMIC_SEG_SIZE, 8, lkey, laddr);
  return 1;
}
GPUNET_DEVICE uint32_t build_nop(uint8_t* p, uint32_t pi, uint32_t qpn, uint32_t fm_ce_se) {
  set_ctrl_seg(p, pi, OPCODE_NOP, 0, qpn, fm_ce_se, DS_NOP, 0, 0);
  return 1;
}

// Byte `j` of a WQE that starts at WQEBB `pi` of a ring of `ring_wqebbs` (a power of two),
// wrapping per WQEBB as mlx5 send queues do.
GPUNET_DEVICE uint8_t* ring_byte(uint8_t* ring, uint32_t ring_wqebbs, uint32_t pi, uint32_t j) {
  return ring + ((pi + j / WQEBB) & (ring_wqebbs - 1)) * WQEBB + j % WQEBB;
}

// Copy `nbb` WQEBBs of `wqe` into the ring at producer index `pi`, wrapping per WQEBB.
GPUNET_DEVICE void write_wqe_wrapped(uint8_t* ring, uint32_t ring_wqebbs, uint32_t pi,
                                     const uint8_t* wqe, uint32_t nbb) {
  for (uint32_t j = 0; j < nbb * WQEBB; ++j) *ring_byte(ring, ring_wqebbs, pi, j) = wqe[j];
}

// RDMA WRITE (or WRITE_WITH_IMM) carrying `nbytes` of `data` inline, into the ring at WQEBB `pi`,
// wrapping per WQEBB; the rest of the last WQEBB is zeroed. Returns the WQEBBs used. Written in
// place (no staging copy: device stacks are small).
GPUNET_DEVICE uint32_t build_write_inline(uint8_t* ring, uint32_t ring_wqebbs, uint32_t pi,
                                          uint32_t qpn, uint32_t opcode, uint32_t fm_ce_se,
                                          uint64_t raddr, uint32_t rkey, const uint8_t* data,
                                          uint32_t nbytes, uint32_t imm) {
  const uint32_t ds = inline_ds(nbytes);
  const uint32_t nbb = wqebb_count(ds);
  uint8_t* first = ring_byte(ring, ring_wqebbs, pi, 0);  // ctrl, raddr, header: one WQEBB
  set_ctrl_seg(first, pi, opcode, 0, qpn, fm_ce_se, ds, 0, imm);
  first[CTRL_DCI_STREAM_CHANNEL_ID] = 0;  // mlx5.py builds in a zeroed staging buffer
  first[CTRL_DCI_STREAM_CHANNEL_ID + 1] = 0;
  set_raddr_seg(first + CTRL_SEG_SIZE, raddr, rkey);
  set_inline_hdr(first + CTRL_SEG_SIZE + RADDR_SEG_SIZE, nbytes);
  const uint32_t base = CTRL_SEG_SIZE + RADDR_SEG_SIZE + INLINE_HDR_SIZE;
  for (uint32_t j = base; j < nbb * WQEBB; ++j)
    *ring_byte(ring, ring_wqebbs, pi, j) = j - base < nbytes ? data[j - base] : 0;
  return nbb;
}

// --- WQE parsing (the NIC side) -----------------------------------------------------------------
GPUNET_DEVICE uint32_t ctrl_opcode(const uint8_t* p) { return p[3]; }
GPUNET_DEVICE uint32_t ctrl_opmod(const uint8_t* p) { return p[0]; }
GPUNET_DEVICE uint32_t ctrl_wqe_index(const uint8_t* p) { return get_be16(p + 1); }
GPUNET_DEVICE uint32_t ctrl_qpn(const uint8_t* p) { return get_be32(p + CTRL_QPN_DS) >> 8; }
GPUNET_DEVICE uint32_t ctrl_ds(const uint8_t* p) { return p[CTRL_QPN_DS + 3]; }
GPUNET_DEVICE uint32_t ctrl_fm_ce_se(const uint8_t* p) { return p[CTRL_FM_CE_SE]; }
GPUNET_DEVICE uint32_t ctrl_imm_raw(const uint8_t* p) { return get_le32(p + CTRL_IMM); }
GPUNET_DEVICE uint64_t raddr_seg_raddr(const uint8_t* p) { return get_be64(p); }
GPUNET_DEVICE uint32_t raddr_seg_rkey(const uint8_t* p) { return get_be32(p + 8); }
GPUNET_DEVICE uint32_t data_seg_byte_count(const uint8_t* p) { return get_be32(p); }
GPUNET_DEVICE uint32_t data_seg_lkey(const uint8_t* p) { return get_be32(p + 4); }
GPUNET_DEVICE uint64_t data_seg_addr(const uint8_t* p) { return get_be64(p + 8); }
GPUNET_DEVICE uint64_t atomic_seg_swap_add(const uint8_t* p) { return get_be64(p); }
GPUNET_DEVICE uint64_t atomic_seg_compare(const uint8_t* p) { return get_be64(p + 8); }

// --- CQEs ---------------------------------------------------------------------------------------
// Initialise a CQ ring as rdma-core does: every op_own = 0xF0 (opcode INVALID, owner 0).
GPUNET_DEVICE void init_cq(uint8_t* cq, uint32_t cqe_cnt) {
  for (uint32_t i = 0; i < cqe_cnt; ++i) cq[i * CQE_SIZE + CQE_OP_OWN] = uint8_t(CQE_OP_OWN_INIT);
}

// Fill one 64-byte CQE: every field, then op_own (opcode | owner) last. Plain stores: a producer
// that others poll must order the op_own store itself (the soft NIC does, in Python).
GPUNET_DEVICE void write_cqe(uint8_t* p, uint32_t opcode, uint32_t qpn, uint32_t wqe_counter,
                             uint32_t byte_cnt, uint32_t imm_raw, uint32_t owner,
                             uint32_t syndrome, uint32_t vendor_syndrome, uint32_t wqe_opcode) {
  for (uint32_t i = 0; i < CQE_SIZE - 1; ++i) p[i] = 0;
  put_le32(p + CQE_IMM_INVAL_PKEY, imm_raw);
  put_be32(p + CQE_BYTE_CNT, byte_cnt);
  if (opcode == CQE_REQ_ERR || opcode == CQE_RESP_ERR) {
    p[CQE_VENDOR_ERR_SYND] = uint8_t(vendor_syndrome);
    p[CQE_SYNDROME] = uint8_t(syndrome);
    put_be32(p + CQE_SOP_DROP_QPN, ((wqe_opcode & 0xFF) << 24) | (qpn & 0xFFFFFF));
  } else {
    put_be32(p + CQE_SOP_DROP_QPN, qpn & 0xFFFFFF);
  }
  put_be16(p + CQE_WQE_COUNTER, wqe_counter & 0xFFFF);
  p[CQE_OP_OWN] = uint8_t(((opcode & 0xF) << 4) | (owner & 1));
}

GPUNET_DEVICE uint32_t cqe_opcode(const uint8_t* p) { return p[CQE_OP_OWN] >> 4; }
GPUNET_DEVICE uint32_t cqe_owner(const uint8_t* p) { return p[CQE_OP_OWN] & 1; }
GPUNET_DEVICE uint32_t cqe_qpn(const uint8_t* p) { return get_be32(p + CQE_SOP_DROP_QPN) & 0xFFFFFF; }
GPUNET_DEVICE uint32_t cqe_wqe_counter(const uint8_t* p) { return get_be16(p + CQE_WQE_COUNTER); }
GPUNET_DEVICE uint32_t cqe_byte_cnt(const uint8_t* p) { return get_be32(p + CQE_BYTE_CNT); }
GPUNET_DEVICE uint32_t cqe_syndrome(const uint8_t* p) { return p[CQE_SYNDROME]; }
GPUNET_DEVICE uint32_t cqe_vendor_syndrome(const uint8_t* p) { return p[CQE_VENDOR_ERR_SYND]; }
// The immediate as the ctrl segment carried it (host order of the wire bytes).
GPUNET_DEVICE uint32_t cqe_imm_raw(const uint8_t* p) { return get_le32(p + CQE_IMM_INVAL_PKEY); }

// Owner-bit CQ: the CQE whose op_own byte was read at consumer index `ci` is the NIC's new entry
// iff opcode != INVALID and owner bit == !!(ci & cqe_cnt) (rdma-core's rule).
GPUNET_HOST_DEVICE constexpr bool op_own_is_valid(uint32_t op_own, uint64_t ci, uint32_t cqe_cnt) {
  return ((op_own & 0xFF) >> 4) != CQE_INVALID && (op_own & 1) == ((ci & cqe_cnt) ? 1u : 0u);
}
GPUNET_DEVICE bool cqe_is_valid(const uint8_t* p, uint64_t ci, uint32_t cqe_cnt) {
  return op_own_is_valid(p[CQE_OP_OWN], ci, cqe_cnt);
}

// A CQE's last 32-bit word (wqe_counter be16 @60, signature @62, op_own @63), as one little-endian
// load at offset 60 returns it: poll loops load it with an acquire and decode it with these.
GPUNET_DEVICE uint32_t cqe_tail_op_own(uint32_t tail) { return tail >> 24; }
GPUNET_DEVICE uint32_t cqe_tail_wqe_counter(uint32_t tail) {
  return ((tail & 0xFF) << 8) | ((tail >> 8) & 0xFF);
}

// --- doorbell records ---------------------------------------------------------------------------
// Record words in memory order, for a store primitive: dbrec[DBREC_SND] / dbrec[DBREC_RCV].
GPUNET_DEVICE uint32_t sq_dbrec_value(uint64_t sq_pi) { return bswap32(uint32_t(sq_pi & 0xFFFF)); }
GPUNET_DEVICE uint32_t cq_dbrec_value(uint64_t ci) { return bswap32(uint32_t(ci & 0xFFFFFF)); }

// Send doorbell record: dbrec[1] = htobe32(sq_pi & 0xffff).
GPUNET_DEVICE void set_sq_dbrec(uint8_t* dbrec, uint64_t sq_pi) {
  put_be32(dbrec + 4 * DBREC_SND, uint32_t(sq_pi & 0xFFFF));
}
GPUNET_DEVICE uint32_t get_sq_dbrec(const uint8_t* dbrec) { return get_be32(dbrec + 4 * DBREC_SND) & 0xFFFF; }
// CQ doorbell record: dbrec[0] = htobe32(ci & 0xffffff).
GPUNET_DEVICE void set_cq_dbrec(uint8_t* dbrec, uint64_t ci) {
  put_be32(dbrec + 4 * DBREC_RCV, uint32_t(ci & 0xFFFFFF));
}
GPUNET_DEVICE uint32_t get_cq_dbrec(const uint8_t* dbrec) { return get_be32(dbrec + 4 * DBREC_RCV) & 0xFFFFFF; }

// The 64-bit value rung on the UAR: the first 8 bytes of the WQE's ctrl segment, as the
// little-endian integer they form in memory (a plain 64-bit store reproduces the bytes).
GPUNET_DEVICE uint64_t doorbell_word(const uint8_t* ctrl) { return get_le64(ctrl); }
GPUNET_DEVICE uint64_t doorbell_word(const Seg16& ctrl) { return ctrl.w[0]; }
// The WQE index a doorbell word carries (bytes 1..2 of the ctrl segment, big-endian).
GPUNET_DEVICE uint32_t doorbell_wqe_index(uint64_t word) {
  return uint32_t(((word >> 8) & 0xFF) << 8 | ((word >> 16) & 0xFF));
}

}  // namespace mlx5
}  // namespace gpunet
