"""gpunet.mlx5 against an oracle that is not our own reading: rdma-core's header, compiled.

A session fixture compiles tests/oracle/mlx5_oracle.c with gcc against the system's
<infiniband/mlx5dv.h> (Debian package libibverbs-dev) and keeps one oracle process running;
hypothesis-generated inputs go to it in batches over stdin, one answer line each. The oracle takes
every offset, size and constant from the header's structs and enums, fills segments with the
header's own mlx5dv_set_ctrl_seg / mlx5dv_set_data_seg (and the other segments field by field with
htobe*, as rdma-core's post path does), parses CQEs through struct mlx5_cqe64 / mlx5_err_cqe, and
implements the CQE owner-bit rule and the doorbell records as FACTS.md states rdma-core's.

A missing header is a failure, not a skip: without it there is no oracle, and the wire format
would rest on our reading alone.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunet import mlx5
from lineproc import LineProcess

ORACLE_SRC = Path(__file__).parent / "oracle" / "mlx5_oracle.c"
HEADER_PACKAGE = "libibverbs-dev"

# Every example carries a batch of up to BATCH requests to the one oracle process, so the
# profile's max_examples (tests/conftest.py: "ci" 50, "deep" 2000) times ~BATCH/2 inputs are
# checked per test for the price of max_examples pipe round trips.
BATCH = 24
SETTINGS = settings(deadline=None)  # the first example pays numba's compile time

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
# numba's dispatcher types every Python int as int64 and raises OverflowError at >= 2**63, so
# 64-bit wire values (addresses, atomic operands) go into gpunet.mlx5 as np.uint64, as callers do.
U64 = np.uint64


def _compile_oracle(out_dir):
    """gcc the oracle against <infiniband/mlx5dv.h>; fail with what to install if we cannot."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        pytest.fail("no C compiler: the mlx5 oracle needs gcc (Debian package gcc) and the "
                    "rdma-core header (Debian package %s)" % HEADER_PACKAGE)
    exe = out_dir / "mlx5_oracle"
    r = subprocess.run([cc, "-std=gnu11", "-O1", "-Wall", "-o", str(exe), str(ORACLE_SRC)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        if "mlx5dv.h" in r.stderr or "verbs.h" in r.stderr:
            pytest.fail("infiniband/mlx5dv.h not found: install the Debian package %s "
                        "(apt-get install %s); the mlx5 wire-format oracle is built against it.\n%s"
                        % (HEADER_PACKAGE, HEADER_PACKAGE, r.stderr))
        pytest.fail("compiling %s failed:\n%s" % (ORACLE_SRC, r.stderr))
    return exe


@pytest.fixture(scope="session")
def oracle_exe(tmp_path_factory):
    return _compile_oracle(tmp_path_factory.mktemp("mlx5_oracle"))


@pytest.fixture(scope="session")
def layout(oracle_exe):
    """{name: value} of every offset, size and constant the oracle prints."""
    out = subprocess.run([str(oracle_exe), "layout"], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in (line.split() for line in out.stdout.splitlines())}


@pytest.fixture(scope="session")
def oracle(oracle_exe):
    o = LineProcess([str(oracle_exe)], "oracle process")
    yield o
    o.close()


def _filled(n, fill):
    return np.full(n, fill, dtype=np.uint8)


# --- layout and constants ------------------------------------------------------------------------

LAYOUT = {  # header name -> gpunet.mlx5's value
    "sizeof.mlx5_wqe_ctrl_seg": mlx5.CTRL_SEG_SIZE,
    "mlx5_wqe_ctrl_seg.opmod_idx_opcode": mlx5.CTRL_OPMOD_IDX_OPCODE,
    "mlx5_wqe_ctrl_seg.qpn_ds": mlx5.CTRL_QPN_DS,
    "mlx5_wqe_ctrl_seg.signature": mlx5.CTRL_SIGNATURE,
    "mlx5_wqe_ctrl_seg.dci_stream_channel_id": mlx5.CTRL_DCI_STREAM_CHANNEL_ID,
    "mlx5_wqe_ctrl_seg.fm_ce_se": mlx5.CTRL_FM_CE_SE,
    "mlx5_wqe_ctrl_seg.imm": mlx5.CTRL_IMM,
    "sizeof.mlx5_wqe_raddr_seg": mlx5.RADDR_SEG_SIZE,
    "mlx5_wqe_raddr_seg.raddr": 0,
    "mlx5_wqe_raddr_seg.rkey": 8,
    "mlx5_wqe_raddr_seg.reserved": 12,
    "sizeof.mlx5_wqe_data_seg": mlx5.DATA_SEG_SIZE,
    "mlx5_wqe_data_seg.byte_count": 0,
    "mlx5_wqe_data_seg.lkey": 4,
    "mlx5_wqe_data_seg.addr": 8,
    "sizeof.mlx5_wqe_atomic_seg": mlx5.ATOMIC_SEG_SIZE,
    "mlx5_wqe_atomic_seg.swap_add": 0,
    "mlx5_wqe_atomic_seg.compare": 8,
    "sizeof.mlx5_wqe_inl_data_seg": mlx5.INLINE_HDR_SIZE,
    "mlx5_wqe_inl_data_seg.byte_count": 0,
    "sizeof.mlx5_cqe64": mlx5.CQE_SIZE,
    "mlx5_cqe64.srqn_uidx": mlx5.CQE_SRQN_UIDX,
    "mlx5_cqe64.imm_inval_pkey": mlx5.CQE_IMM_INVAL_PKEY,
    "mlx5_cqe64.byte_cnt": mlx5.CQE_BYTE_CNT,
    "mlx5_cqe64.timestamp": mlx5.CQE_TIMESTAMP,
    "mlx5_cqe64.sop_drop_qpn": mlx5.CQE_SOP_DROP_QPN,
    "mlx5_cqe64.wqe_counter": mlx5.CQE_WQE_COUNTER,
    "mlx5_cqe64.signature": mlx5.CQE_SIGNATURE,
    "mlx5_cqe64.op_own": mlx5.CQE_OP_OWN,
    "sizeof.mlx5_err_cqe": mlx5.CQE_SIZE,
    "mlx5_err_cqe.vendor_err_synd": mlx5.CQE_VENDOR_ERR_SYND,
    "mlx5_err_cqe.syndrome": mlx5.CQE_SYNDROME,
    "mlx5_err_cqe.s_wqe_opcode_qpn": mlx5.CQE_SOP_DROP_QPN,
    "mlx5_err_cqe.wqe_counter": mlx5.CQE_WQE_COUNTER,
    "mlx5_err_cqe.signature": mlx5.CQE_SIGNATURE,
    "mlx5_err_cqe.op_own": mlx5.CQE_OP_OWN,
    "MLX5_SEND_WQE_BB": mlx5.WQEBB,
    "MLX5_INLINE_SEG": mlx5.INLINE_SEG,
    "MLX5_RCV_DBR": mlx5.DBREC_RCV,
    "MLX5_SND_DBR": mlx5.DBREC_SND,
    "MLX5_CQE_OWNER_MASK": 1,
}

# header prefix -> gpunet.mlx5 prefix, for the named constants (every header name must map)
PREFIXES = [
    ("MLX5_OPCODE_", "OPCODE_"),
    ("MLX5_WQE_CTRL_", "WQE_CTRL_"),
    ("MLX5_CQE_SYNDROME_", "SYNDROME_"),
    ("MLX5_CQE_", "CQE_"),
]


def test_struct_layout_matches_header(layout):
    """Every field offset and struct size gpunet.mlx5 uses equals offsetof/sizeof in mlx5dv.h."""
    wrong = {k: (layout[k], v) for k, v in LAYOUT.items() if layout[k] != v}
    assert not wrong, "name: (header, gpunet.mlx5): %r" % wrong


def test_named_constants_match_header(layout):
    """Each MLX5_* opcode, fm_ce_se flag, CQE opcode and syndrome the oracle prints exists in
    gpunet.mlx5 under the rdma-core name (prefix mapped) with the header's value."""
    checked = 0
    for name, value in layout.items():
        if name in LAYOUT or name.startswith("sizeof.") or "." in name:
            continue
        for hp, gp in PREFIXES:
            if name.startswith(hp):
                ours = name[len(hp):]
                if gp == "SYNDROME_":
                    ours = ours  # MLX5_CQE_SYNDROME_X -> SYNDROME_X
                assert hasattr(mlx5, gp + ours), "gpunet.mlx5 lacks %s (header %s = %#x)" % (
                    gp + ours, name, value)
                assert getattr(mlx5, gp + ours) == value, "%s: header %#x, gpunet.mlx5 %#x" % (
                    name, value, getattr(mlx5, gp + ours))
                checked += 1
                break
        else:
            pytest.fail("oracle printed %s, which no test maps to gpunet.mlx5" % name)
    assert checked >= 30
    syndromes = {v for k, v in layout.items() if k.startswith("MLX5_CQE_SYNDROME_")}
    assert set(mlx5.SYNDROME_NAMES) == syndromes, "every header syndrome has a readable name"


def test_fixed_wqe_sizes_follow_from_header(layout):
    """DS_RDMA / DS_ATOMIC / DS_NOP are the header's segment sizes summed, in 16-byte units."""
    c, r = layout["sizeof.mlx5_wqe_ctrl_seg"], layout["sizeof.mlx5_wqe_raddr_seg"]
    d, a = layout["sizeof.mlx5_wqe_data_seg"], layout["sizeof.mlx5_wqe_atomic_seg"]
    assert mlx5.DS_RDMA * mlx5.DS_UNIT == c + r + d
    assert mlx5.DS_ATOMIC * mlx5.DS_UNIT == c + r + a + d
    assert mlx5.DS_NOP * mlx5.DS_UNIT == c


# --- segments, byte for byte ---------------------------------------------------------------------

def _ctrl(pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm):
    req = "ctrl %d %d %d %d %d %d %d %d" % (pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm)
    return req, 16, lambda b: mlx5.set_ctrl_seg(b, 0, pi, opcode, opmod, qpn, fm_ce_se, ds,
                                                signature, imm)


def _data(byte_count, lkey, addr):
    return ("data %d %d %d" % (byte_count, lkey, addr), 16,
            lambda b: mlx5.set_data_seg(b, 0, byte_count, lkey, U64(addr)))


def _raddr(raddr, rkey):
    return "raddr %d %d" % (raddr, rkey), 16, lambda b: mlx5.set_raddr_seg(b, 0, U64(raddr), rkey)


def _atomic(swap_add, compare):
    return ("atom %d %d" % (swap_add, compare), 16,
            lambda b: mlx5.set_atomic_seg(b, 0, U64(swap_add), U64(compare)))


def _inline(nbytes):
    return "inl %d" % nbytes, 4, lambda b: mlx5.set_inline_hdr(b, 0, nbytes)


# pi is a 32-bit producer counter (the segment keeps 16 bits, as mlx5dv_set_ctrl_seg's uint16_t);
# qpn is 24 bits; ds, opcode, opmod, fm_ce_se, signature are whole bytes.
segment_requests = st.one_of(
    st.builds(_ctrl, u32, u8, u8, u24, u8, u8, u8, u32),
    st.builds(_data, u32, u32, u64),
    st.builds(_raddr, u64, u32),
    st.builds(_atomic, u64, u64),
    st.builds(_inline, st.integers(0, 0x7FFFFFFF)),
)


def _check_against_oracle(oracle, fill, requests):
    answers = oracle.ask(["fill %d" % fill] + [r for r, _, _ in requests])[1:]
    for (req, n, build), want in zip(requests, answers):
        buf = _filled(n, fill)
        build(buf)
        assert buf.tobytes().hex() == want, "request %r: gpunet %s, rdma-core %s" % (
            req, buf.tobytes().hex(), want)


@SETTINGS
@given(fill=u8, requests=st.lists(segment_requests, min_size=1, max_size=BATCH))
def test_segments_are_byte_identical_to_rdma_core(oracle, fill, requests):
    """Generates ctrl / data / raddr / atomic / inline-header segments over the full width of each
    argument, on a buffer pre-filled with a random byte. Invariant: gpunet.mlx5's set_*_seg leaves
    exactly the bytes mlx5dv_set_ctrl_seg / mlx5dv_set_data_seg / rdma-core's field stores leave,
    including the bytes neither writes (dci_stream_channel_id keeps the fill byte)."""
    _check_against_oracle(oracle, fill, requests)


def _rdma(pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey, nbytes, imm):
    req = "rdma %d %d %d %d %d %d %d %d %d %d" % (pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr,
                                                  lkey, nbytes, imm)
    return req, 64, lambda b: mlx5.build_rdma(b, 0, pi, qpn, opcode, fm_ce_se, U64(raddr), rkey,
                                              U64(laddr), lkey, nbytes, imm)


def _amo(pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey, swap_add, compare):
    req = "amo %d %d %d %d %d %d %d %d %d %d" % (pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr,
                                                 lkey, swap_add, compare)
    return req, 64, lambda b: mlx5.build_atomic(b, 0, pi, qpn, opcode, fm_ce_se, U64(raddr), rkey,
                                                U64(laddr), lkey, U64(swap_add), U64(compare))


def _nop(pi, qpn, fm_ce_se):
    return "nop %d %d %d" % (pi, qpn, fm_ce_se), 64, lambda b: mlx5.build_nop(b, 0, pi, qpn,
                                                                            fm_ce_se)


rdma_opcodes = st.sampled_from([mlx5.OPCODE_RDMA_WRITE, mlx5.OPCODE_RDMA_WRITE_IMM,
                                mlx5.OPCODE_RDMA_READ])
atomic_opcodes = st.sampled_from([mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS])
fm_ce_se_flags = st.sets(st.sampled_from([mlx5.WQE_CTRL_CQ_UPDATE, mlx5.WQE_CTRL_SOLICITED,
                                          mlx5.WQE_CTRL_FENCE,
                                          mlx5.WQE_CTRL_INITIATOR_SMALL_FENCE])).map(sum)
wqe_requests = st.one_of(
    st.builds(_rdma, u32, u24, rdma_opcodes, fm_ce_se_flags, u64, u32, u64, u32, u32, u32),
    st.builds(_amo, u32, u24, atomic_opcodes, fm_ce_se_flags, u64, u32, u64, u32, u64, u64),
    st.builds(_nop, u32, u24, fm_ce_se_flags),
)


@SETTINGS
@given(fill=u8, requests=st.lists(wqe_requests, min_size=1, max_size=BATCH))
def test_whole_wqes_are_byte_identical_to_rdma_core(oracle, fill, requests):
    """Generates RDMA WRITE / WRITE_IMM / READ, ATOMIC FA / CS and NOP WQEs (any pi, qpn, keys,
    addresses, flag combination), each into a pre-filled 64-byte WQEBB. Invariant: build_rdma /
    build_atomic / build_nop write the same 64 bytes as the header's helpers composed the way
    rdma-core's post path composes them (ds from the header's sizeof), and nothing past the WQE."""
    _check_against_oracle(oracle, fill, requests)


# --- CQEs ---------------------------------------------------------------------------------------

CQE_FIELD = re.compile(r"(\w+)=(\d+)")


def _parse_fields(line):
    return {k: int(v) for k, v in CQE_FIELD.findall(line)}


cqe_opcodes = st.sampled_from([mlx5.CQE_REQ, mlx5.CQE_RESP_WR_IMM, mlx5.CQE_RESP_SEND,
                               mlx5.CQE_RESP_SEND_IMM, mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR])
cqe_inputs = st.tuples(cqe_opcodes, u24, u16, u32, u32, st.integers(0, 1), u8, u8, u8)


@SETTINGS
@given(cqes=st.lists(cqe_inputs, min_size=1, max_size=BATCH))
def test_write_cqe_reads_back_through_header_structs(oracle, cqes):
    """Generates CQEs (each CQE opcode gpunet writes, qpn 24 bits, wqe_counter 16, byte_cnt, raw
    immediate, owner bit, syndrome, vendor syndrome, failed WQE opcode) written by
    mlx5.write_cqe. Invariant: read through struct mlx5_cqe64 and struct mlx5_err_cqe in C, every
    field is the value given (error fields only on error CQEs, s_wqe_opcode_qpn's top byte the WQE
    opcode), and gpunet.mlx5's cqe_* parsers return the same values as the C struct reads."""
    bufs, reqs = [], []
    for opcode, qpn, wc, byte_cnt, imm, owner, synd, vsynd, wop in cqes:
        b = np.full(64, 0xA5, dtype=np.uint8)
        mlx5.write_cqe(b, 0, opcode, qpn, wc, byte_cnt, imm, owner, synd, vsynd, wop)
        bufs.append(b)
        reqs.append("cqe " + b.tobytes().hex())
    for (opcode, qpn, wc, byte_cnt, imm, owner, synd, vsynd, wop), b, line in zip(
            cqes, bufs, oracle.ask(reqs)):
        c = _parse_fields(line)
        err = opcode in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR)
        assert (c["opcode"], c["owner"]) == (opcode, owner)
        assert c["qpn"] == c["err_qpn"] == qpn
        assert c["wqe_counter"] == c["err_wqe_counter"] == wc
        assert c["byte_cnt"] == byte_cnt and c["imm_raw"] == imm
        assert c["signature"] == 0 and c["srqn_uidx"] == 0
        # mlx5_err_cqe's vendor_err_synd / syndrome (@54, @55) alias mlx5_cqe64.timestamp's low
        # two bytes (@48..55): write_cqe leaves the timestamp zero but for them
        assert c["timestamp"] == ((vsynd << 8 | synd) if err else 0)
        assert c["err_wqe_opcode"] == (wop if err else 0)
        assert c["syndrome"] == (synd if err else 0)
        assert c["vendor_err_synd"] == (vsynd if err else 0)
        _assert_parsers_agree(b, c)


def _assert_parsers_agree(b, c):
    ours = {
        "opcode": mlx5.cqe_opcode(b, 0), "owner": mlx5.cqe_owner(b, 0),
        "qpn": mlx5.cqe_qpn(b, 0), "wqe_counter": mlx5.cqe_wqe_counter(b, 0),
        "byte_cnt": mlx5.cqe_byte_cnt(b, 0), "imm_raw": mlx5.cqe_imm_raw(b, 0),
        "syndrome": mlx5.cqe_syndrome(b, 0), "vendor_err_synd": mlx5.cqe_vendor_syndrome(b, 0),
    }
    theirs = {k: c[k] for k in ours}
    assert {k: int(v) for k, v in ours.items()} == theirs


@SETTINGS
@given(raw=st.lists(st.binary(min_size=64, max_size=64), min_size=1, max_size=BATCH))
def test_cqe_parsers_match_header_structs_on_any_bytes(oracle, raw):
    """Generates arbitrary 64-byte CQEs. Invariant: each gpunet.mlx5 cqe_* parser returns what the
    corresponding struct mlx5_cqe64 / mlx5_err_cqe field (byte-swapped as the wire requires)
    holds, whatever the other bytes are."""
    answers = oracle.ask(["cqe " + r.hex() for r in raw])
    for r, line in zip(raw, answers):
        _assert_parsers_agree(np.frombuffer(r, dtype=np.uint8), _parse_fields(line))


@SETTINGS
@given(cases=st.lists(st.tuples(u8, u32, st.integers(0, 24).map(lambda k: 1 << k)),
                      min_size=1, max_size=BATCH))
def test_cqe_ownership_rule_matches_rdma_core(oracle, cases):
    """Generates (op_own byte, 32-bit consumer index, power-of-two cqe_cnt up to 2^24).
    Invariant: mlx5.cqe_is_valid says "new" exactly when the C rule does: opcode != INVALID
    (header's mlx5dv_get_cqe_opcode) and owner bit (MLX5_CQE_OWNER_MASK) == !!(ci & cqe_cnt)."""
    answers = oracle.ask(["valid %d %d %d" % c for c in cases])
    for (op_own, ci, cnt), want in zip(cases, answers):
        b = np.zeros(64, dtype=np.uint8)
        b[mlx5.CQE_OP_OWN] = op_own
        assert int(bool(mlx5.cqe_is_valid(b, 0, ci, cnt))) == int(want), (op_own, ci, cnt)


def test_fresh_cq_has_no_valid_cqe_in_either_pass(oracle):
    """init_cq's op_own (0xF0) is invalid to the C rule and to cqe_is_valid for every consumer
    index of the first two passes over a 16-entry CQ."""
    cq = np.zeros(16 * 64, dtype=np.uint8)
    mlx5.init_cq(cq, 16)
    answers = oracle.ask(["valid %d %d 16" % (cq[(ci % 16) * 64 + 63], ci) for ci in range(32)])
    assert answers == ["0"] * 32
    assert not any(mlx5.cqe_is_valid(cq, (ci % 16) * 64, ci, 16) for ci in range(32))


# --- doorbell records and the doorbell word ---------------------------------------------------------

@SETTINGS
@given(fill=u8, pis=st.lists(u32, min_size=1, max_size=BATCH))
def test_doorbell_records_match_rdma_core(oracle, fill, pis):
    """Generates 32-bit producer / consumer counters and a pre-fill byte. Invariant: set_sq_dbrec
    writes exactly dbrec[MLX5_SND_DBR] = htobe32(pi & 0xffff) and set_cq_dbrec exactly
    dbrec[MLX5_RCV_DBR] = htobe32(ci & 0xffffff) (the other word untouched), and the get_*
    readers return the masked counters."""
    answers = oracle.ask(["fill %d" % fill] + ["sqdb %d" % p for p in pis]
                         + ["cqdb %d" % p for p in pis])[1:]
    for p, want_sq, want_cq in zip(pis, answers[:len(pis)], answers[len(pis):]):
        sq = _filled(8, fill)
        mlx5.set_sq_dbrec(sq, 0, p)
        assert sq.tobytes().hex() == want_sq
        assert mlx5.get_sq_dbrec(sq, 0) == p & 0xFFFF
        cq = _filled(8, fill)
        mlx5.set_cq_dbrec(cq, 0, p)
        assert cq.tobytes().hex() == want_cq
        assert mlx5.get_cq_dbrec(cq, 0) == p & 0xFFFFFF


@SETTINGS
@given(ctrls=st.lists(st.tuples(u32, u8, u24, u8), min_size=1, max_size=BATCH))
def test_doorbell_word_is_the_ctrl_segments_first_8_bytes(oracle, ctrls):
    """Generates ctrl segments (pi, opcode, qpn, ds). Invariant: mlx5.doorbell_word equals a
    host-order 64-bit load of the segment's first 8 bytes (what rdma-core stores to the UAR), and
    doorbell_wqe_index recovers pi & 0xffff from it."""
    bufs = []
    for pi, opcode, qpn, ds in ctrls:
        b = np.zeros(16, dtype=np.uint8)
        mlx5.set_ctrl_seg(b, 0, pi, opcode, 0, qpn, mlx5.WQE_CTRL_CQ_UPDATE, ds, 0, 0)
        bufs.append(b)
    answers = oracle.ask(["dbw " + b[:8].tobytes().hex() for b in bufs])
    for (pi, _, _, _), b, want in zip(ctrls, bufs, answers):
        word = mlx5.doorbell_word(b, 0)
        assert int(word) == int(want)
        assert int(mlx5.doorbell_wqe_index(U64(word))) == pi & 0xFFFF
