// Harness for tests/test_mlx5_mirror.py: drives gpunet/device/include/gpunet/mlx5.cuh on the HOST arm.
//
// Built with g++ -std=c++17 -DGPUNET_ARCH_HOST. `mlx5_mirror consts` prints every constant as
// "NAME VALUE"; otherwise it answers one request per stdin line with one stdout line (flushed):
//   fill B                                         pre-fill byte for the writers' buffers
//   ctrl|data|raddr|atom|inl ARGS                  the writer's bytes on a pre-filled buffer (hex)
//   vctrl|vdata|vraddr|vatom ARGS                  the value builder's 16 bytes (hex)
//   vinl nbytes                                    inline_hdr's word in memory order (hex, 4 B)
//   rdma|amo|nop ARGS                              build_* into a pre-filled WQEBB (hex, 64 B)
//   vrdma|vamo|vnop ARGS                           rdma_wqe/atomic_wqe/nop_wqe (hex, 64 B)
//   wi depth pi qpn opcode fm_ce_se raddr rkey imm HEX|-   build_write_inline into a pre-filled
//                                                  ring: "nbb HEXRING"
//   ww depth pi nbb HEX                            write_wqe_wrapped into a pre-filled ring (hex)
//   cqe opcode qpn wc byte_cnt imm owner synd vsynd wop    write_cqe on a pre-filled CQE (hex)
//   parse HEX64B                                   cqe_* parsers and the tail decoders (k=v ...)
//   pctrl HEX16B                                   ctrl_* parsers (k=v ...)
//   pseg HEX16B                                    raddr_seg_* / data_seg_* / atomic_seg_* parsers
//   vwi pi qpn opcode fm_ce_se raddr rkey imm HEX|-   write_inline_wqe: "nbb HEX(nbb WQEBBs)"
//   valid op_own ci cqe_cnt                        cqe_is_valid (and op_own_is_valid must agree)
//   sqdb pi | cqdb ci                              set_*_dbrec on a pre-filled record: "HEX get value"
//   dbw HEX16B                                     "doorbell_word doorbell_wqe_index"
//   ar ds nbytes                                   "wqebb_count(ds) inline_ds(nbytes)"
//   synd s                                         syndrome_name(s)
//   init cnt                                       init_cq on a pre-filled CQ (hex)
// Arguments are decimal or 0x-hex.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpunet/mlx5.cuh"

namespace m = gpunet::mlx5;

static uint8_t fill_byte = 0;

static void hex(const uint8_t* p, size_t n, const char* end = "\n") {
  for (size_t i = 0; i < n; ++i) std::printf("%02x", p[i]);
  std::printf("%s", end);
}

static bool unhex(const char* s, std::vector<uint8_t>& out) {
  out.clear();
  if (std::strcmp(s, "-") == 0) return true;
  size_t n = std::strlen(s);
  if (n % 2) return false;
  for (size_t i = 0; i < n; i += 2) {
    unsigned v;
    if (std::sscanf(s + i, "%2x", &v) != 1) return false;
    out.push_back(uint8_t(v));
  }
  return true;
}

static void seg(const m::Seg16& s) {
  uint8_t b[16];
  m::store_seg(b, s);
  hex(b, 16);
}

static void wqebb(const m::Wqebb& w) {
  uint8_t b[64];
  for (int i = 0; i < 4; ++i) m::store_seg(b + 16 * i, w.seg[i]);
  hex(b, 64);
}

static void consts() {
#define C(name) std::printf(#name " %llu\n", (unsigned long long)m::name)
  C(WQEBB); C(DS_UNIT); C(CTRL_SEG_SIZE); C(RADDR_SEG_SIZE); C(DATA_SEG_SIZE); C(ATOMIC_SEG_SIZE);
  C(INLINE_HDR_SIZE); C(CQE_SIZE); C(MAX_DS);
  C(OPCODE_NOP); C(OPCODE_RDMA_WRITE); C(OPCODE_RDMA_WRITE_IMM); C(OPCODE_SEND); C(OPCODE_SEND_IMM);
  C(OPCODE_RDMA_READ); C(OPCODE_ATOMIC_CS); C(OPCODE_ATOMIC_FA); C(OPCODE_ATOMIC_MASKED_CS);
  C(OPCODE_ATOMIC_MASKED_FA);
  C(WQE_CTRL_CQ_UPDATE); C(WQE_CTRL_SOLICITED); C(WQE_CTRL_FENCE); C(WQE_CTRL_INITIATOR_SMALL_FENCE);
  C(INLINE_SEG);
  C(CTRL_OPMOD_IDX_OPCODE); C(CTRL_QPN_DS); C(CTRL_SIGNATURE); C(CTRL_DCI_STREAM_CHANNEL_ID);
  C(CTRL_FM_CE_SE); C(CTRL_IMM);
  C(CQE_SRQN_UIDX); C(CQE_IMM_INVAL_PKEY); C(CQE_BYTE_CNT); C(CQE_TIMESTAMP); C(CQE_VENDOR_ERR_SYND);
  C(CQE_SYNDROME); C(CQE_SOP_DROP_QPN); C(CQE_WQE_COUNTER); C(CQE_SIGNATURE); C(CQE_OP_OWN);
  C(CQE_REQ); C(CQE_RESP_WR_IMM); C(CQE_RESP_SEND); C(CQE_RESP_SEND_IMM); C(CQE_REQ_ERR);
  C(CQE_RESP_ERR); C(CQE_INVALID); C(CQE_OP_OWN_INIT);
  C(SYNDROME_LOCAL_LENGTH_ERR); C(SYNDROME_LOCAL_QP_OP_ERR); C(SYNDROME_LOCAL_PROT_ERR);
  C(SYNDROME_WR_FLUSH_ERR); C(SYNDROME_MW_BIND_ERR); C(SYNDROME_BAD_RESP_ERR);
  C(SYNDROME_LOCAL_ACCESS_ERR); C(SYNDROME_REMOTE_INVAL_REQ_ERR); C(SYNDROME_REMOTE_ACCESS_ERR);
  C(SYNDROME_REMOTE_OP_ERR); C(SYNDROME_TRANSPORT_RETRY_EXC_ERR); C(SYNDROME_RNR_RETRY_EXC_ERR);
  C(SYNDROME_REMOTE_ABORTED_ERR);
  C(DBREC_RCV); C(DBREC_SND); C(DBREC_SIZE); C(UAR_BF_REG_OFFSET); C(BF_SIZE);
  C(DS_RDMA); C(DS_ATOMIC); C(DS_NOP);
#undef C
  // compile-time use, as device code sizes its buffers
  static_assert(m::wqebb_count(m::DS_ATOMIC) == 1, "constexpr wqebb_count");
  static_assert(m::inline_ds(12) == 3 && m::inline_ds(13) == 4, "constexpr inline_ds");
}

static int serve(char* line) {
  std::vector<char*> tok;
  for (char* t = std::strtok(line, " \t\r\n"); t; t = std::strtok(nullptr, " \t\r\n")) tok.push_back(t);
  if (tok.empty()) return std::printf("ERR empty request\n");
  const std::string cmd = tok[0];
  const int argc = int(tok.size()) - 1;
  auto a = [&](int i) { return (unsigned long long)std::strtoull(tok[1 + i], nullptr, 0); };
  auto need = [&](int k) {
    if (argc == k) return true;
    std::printf("ERR %s wants %d arguments\n", cmd.c_str(), k);
    return false;
  };
  uint8_t b[64];
  std::memset(b, fill_byte, sizeof b);
  std::vector<uint8_t> bytes;

  if (cmd == "fill") {
    if (!need(1)) return 0;
    fill_byte = uint8_t(a(0));
    std::printf("ok\n");
  } else if (cmd == "ctrl") {
    if (!need(8)) return 0;
    m::set_ctrl_seg(b, a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7));
    hex(b, 16);
  } else if (cmd == "data") {
    if (!need(3)) return 0;
    m::set_data_seg(b, a(0), a(1), a(2));
    hex(b, 16);
  } else if (cmd == "raddr") {
    if (!need(2)) return 0;
    m::set_raddr_seg(b, a(0), a(1));
    hex(b, 16);
  } else if (cmd == "atom") {
    if (!need(2)) return 0;
    m::set_atomic_seg(b, a(0), a(1));
    hex(b, 16);
  } else if (cmd == "inl") {
    if (!need(1)) return 0;
    m::set_inline_hdr(b, a(0));
    hex(b, 4);
  } else if (cmd == "vctrl") {
    if (!need(8)) return 0;
    seg(m::ctrl_seg(a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7)));
  } else if (cmd == "vdata") {
    if (!need(3)) return 0;
    seg(m::data_seg(a(0), a(1), a(2)));
  } else if (cmd == "vraddr") {
    if (!need(2)) return 0;
    seg(m::raddr_seg(a(0), a(1)));
  } else if (cmd == "vatom") {
    if (!need(2)) return 0;
    seg(m::atomic_seg(a(0), a(1)));
  } else if (cmd == "vinl") {
    if (!need(1)) return 0;
    const uint32_t w = m::inline_hdr(a(0));
    m::put_le32(b, w);
    hex(b, 4);
  } else if (cmd == "rdma" || cmd == "vrdma") {
    if (!need(10)) return 0;
    if (cmd == "rdma") {
      if (m::build_rdma(b, a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9)) != 1)
        return std::printf("ERR build_rdma did not return 1\n");
      hex(b, 64);
    } else {
      wqebb(m::rdma_wqe(a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9)));
    }
  } else if (cmd == "amo" || cmd == "vamo") {
    if (!need(10)) return 0;
    if (cmd == "amo") {
      if (m::build_atomic(b, a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9)) != 1)
        return std::printf("ERR build_atomic did not return 1\n");
      hex(b, 64);
    } else {
      wqebb(m::atomic_wqe(a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9)));
    }
  } else if (cmd == "nop" || cmd == "vnop") {
    if (!need(3)) return 0;
    if (cmd == "nop") {
      m::build_nop(b, a(0), a(1), a(2));
      hex(b, 64);
    } else {
      wqebb(m::nop_wqe(a(0), a(1), a(2)));
    }
  } else if (cmd == "wi") {
    if (!need(9)) return 0;
    if (!unhex(tok[9], bytes)) return std::printf("ERR bad hex\n");
    std::vector<uint8_t> ring(a(0) * m::WQEBB, fill_byte);
    const uint32_t nbb = m::build_write_inline(ring.data(), a(0), a(1), a(2), a(3), a(4), a(5),
                                               a(6), bytes.data(), uint32_t(bytes.size()), a(7));
    std::printf("%u ", nbb);
    hex(ring.data(), ring.size());
  } else if (cmd == "ww") {
    if (!need(4)) return 0;
    if (!unhex(tok[4], bytes)) return std::printf("ERR bad hex\n");
    std::vector<uint8_t> ring(a(0) * m::WQEBB, fill_byte);
    m::write_wqe_wrapped(ring.data(), a(0), a(1), bytes.data(), a(2));
    hex(ring.data(), ring.size());
  } else if (cmd == "cqe") {
    if (!need(9)) return 0;
    m::write_cqe(b, a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8));
    hex(b, 64);
  } else if (cmd == "parse") {
    if (!need(1)) return 0;
    if (!unhex(tok[1], bytes) || bytes.size() != 64) return std::printf("ERR parse wants 64 B\n");
    const uint8_t* p = bytes.data();
    const uint32_t tail = uint32_t(m::get_le64(p + 56) >> 32);
    std::printf("opcode=%u owner=%u qpn=%u wqe_counter=%u byte_cnt=%u imm_raw=%u syndrome=%u "
                "vendor_err_synd=%u tail_op_own=%u tail_wqe_counter=%u\n",
                m::cqe_opcode(p), m::cqe_owner(p), m::cqe_qpn(p), m::cqe_wqe_counter(p),
                m::cqe_byte_cnt(p), m::cqe_imm_raw(p), m::cqe_syndrome(p),
                m::cqe_vendor_syndrome(p), m::cqe_tail_op_own(tail),
                m::cqe_tail_wqe_counter(tail));
  } else if (cmd == "pctrl") {
    if (!need(1)) return 0;
    if (!unhex(tok[1], bytes) || bytes.size() != 16) return std::printf("ERR pctrl wants 16 B\n");
    const uint8_t* p = bytes.data();
    std::printf("opcode=%u opmod=%u wqe_index=%u qpn=%u ds=%u fm_ce_se=%u imm_raw=%u\n",
                m::ctrl_opcode(p), m::ctrl_opmod(p), m::ctrl_wqe_index(p), m::ctrl_qpn(p),
                m::ctrl_ds(p), m::ctrl_fm_ce_se(p), m::ctrl_imm_raw(p));
  } else if (cmd == "pseg") {
    if (!need(1)) return 0;
    if (!unhex(tok[1], bytes) || bytes.size() != 16) return std::printf("ERR pseg wants 16 B\n");
    const uint8_t* p = bytes.data();
    std::printf("raddr=%llu rkey=%u byte_count=%u lkey=%u addr=%llu swap_add=%llu compare=%llu\n",
                (unsigned long long)m::raddr_seg_raddr(p), m::raddr_seg_rkey(p),
                m::data_seg_byte_count(p), m::data_seg_lkey(p),
                (unsigned long long)m::data_seg_addr(p),
                (unsigned long long)m::atomic_seg_swap_add(p),
                (unsigned long long)m::atomic_seg_compare(p));
  } else if (cmd == "vwi") {
    if (!need(8)) return 0;
    if (!unhex(tok[8], bytes)) return std::printf("ERR bad hex\n");
    m::Seg16 segs[4 * 16];
    const uint32_t nbb = m::write_inline_wqe(segs, a(0), a(1), a(2), a(3), a(4), a(5),
                                             bytes.data(), uint32_t(bytes.size()), a(6));
    std::printf("%u ", nbb);
    std::vector<uint8_t> out(nbb * m::WQEBB);
    for (uint32_t i = 0; i < 4 * nbb; ++i) m::store_seg(out.data() + 16 * i, segs[i]);
    hex(out.data(), out.size());
  } else if (cmd == "valid") {
    if (!need(3)) return 0;
    std::memset(b, 0, sizeof b);
    b[m::CQE_OP_OWN] = uint8_t(a(0));
    const bool v = m::cqe_is_valid(b, a(1), uint32_t(a(2)));
    if (v != m::op_own_is_valid(uint32_t(a(0)), a(1), uint32_t(a(2))))
      return std::printf("ERR cqe_is_valid and op_own_is_valid disagree\n");
    std::printf("%d\n", v ? 1 : 0);
  } else if (cmd == "sqdb" || cmd == "cqdb") {
    if (!need(1)) return 0;
    uint32_t got, value;
    if (cmd == "sqdb") {
      m::set_sq_dbrec(b, a(0));
      got = m::get_sq_dbrec(b);
      value = m::sq_dbrec_value(a(0));
    } else {
      m::set_cq_dbrec(b, a(0));
      got = m::get_cq_dbrec(b);
      value = m::cq_dbrec_value(a(0));
    }
    hex(b, 8, " ");
    uint8_t v[4];
    m::put_le32(v, value);
    std::printf("%u ", got);
    hex(v, 4);
  } else if (cmd == "dbw") {
    if (!need(1)) return 0;
    if (!unhex(tok[1], bytes) || bytes.size() != 8) return std::printf("ERR dbw wants 8 B\n");
    const uint64_t w = m::doorbell_word(bytes.data());
    std::printf("%llu %u\n", (unsigned long long)w, m::doorbell_wqe_index(w));
  } else if (cmd == "ar") {
    if (!need(2)) return 0;
    std::printf("%u %u\n", m::wqebb_count(uint32_t(a(0))), m::inline_ds(uint32_t(a(1))));
  } else if (cmd == "synd") {
    if (!need(1)) return 0;
    std::printf("%s\n", m::syndrome_name(uint32_t(a(0))));
  } else if (cmd == "init") {
    if (!need(1)) return 0;
    std::vector<uint8_t> cq(a(0) * m::CQE_SIZE, fill_byte);
    m::init_cq(cq.data(), uint32_t(a(0)));
    hex(cq.data(), cq.size());
  } else {
    std::printf("ERR unknown request %s\n", cmd.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "consts") == 0) {
    consts();
    return 0;
  }
  static char line[1 << 16];
  while (std::fgets(line, sizeof line, stdin)) {
    serve(line);
    std::fflush(stdout);
  }
  return 0;
}
