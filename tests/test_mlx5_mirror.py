"""gpunet/device/include/gpunet/mlx5.cuh mirrors gpunet.mlx5 byte for byte; nvcc compiles it.

A session fixture compiles tests/oracle/mlx5_mirror.cpp (g++ -std=c++17 -DGPUNET_ARCH_HOST, the
HOST arm, so arch.cuh's swaps are the ones used) and keeps one process running; hypothesis
batches go to it over stdin. Every constant, writer, value builder and parser of the header is
compared with gpunet.mlx5, which tests/test_mlx5_oracle.py ties to rdma-core's header.
"""
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

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "gpunet" / "device" / "include"
HEADER = INCLUDE / "gpunet" / "mlx5.cuh"
HARNESS = Path(__file__).parent / "oracle" / "mlx5_mirror.cpp"

BATCH = 24                          # requests per example, all to the one harness process
SETTINGS = settings(deadline=None)  # the first example pays numba's compile time
U64 = np.uint64                     # numba types Python ints as int64: 64-bit values as np.uint64

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)


@pytest.fixture(scope="session")
def mirror_exe(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ not found: the HOST arm of the device headers is built with g++ "
                    "(Debian package g++)")
    exe = tmp_path_factory.mktemp("mlx5_mirror") / "mlx5_mirror"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-pthread",
                        "-DGPUNET_ARCH_HOST", "-I", str(INCLUDE), "-o", str(exe), str(HARNESS)],
                       capture_output=True, text=True)
    assert r.returncode == 0, "g++ could not build the mlx5.cuh harness:\n" + r.stderr
    # warnings from other headers (arch.cuh, host_simt.h) are their owners' business
    assert "mlx5.cuh" not in r.stderr, "g++ warns about mlx5.cuh:\n" + r.stderr
    return exe


@pytest.fixture(scope="session")
def mirror(mirror_exe):
    p = LineProcess([str(mirror_exe)], "mirror harness")
    yield p
    p.close()


def _hex(buf):
    return buf.tobytes().hex()


# --- constants -----------------------------------------------------------------------------------

def test_every_constant_equals_gpunet_mlx5(mirror_exe):
    """Each constexpr the header defines has gpunet.mlx5's name and value, and every upper-case
    integer constant of gpunet.mlx5 is in the header."""
    out = subprocess.run([str(mirror_exe), "consts"], capture_output=True, text=True, check=True)
    header = {k: int(v) for k, v in (line.split() for line in out.stdout.splitlines())}
    ours = {k: v for k, v in vars(mlx5).items() if re.fullmatch(r"[A-Z][A-Z0-9_]*", k)
            and isinstance(v, int)}
    assert set(ours) - set(header) == set(), "in gpunet.mlx5, missing from mlx5.cuh"
    assert set(header) - set(ours) == set(), "in mlx5.cuh, missing from gpunet.mlx5"
    assert {k: header[k] for k in ours if header[k] != ours[k]} == {}


def test_syndrome_names_match(mirror):
    """syndrome_name gives gpunet.mlx5's text for every known syndrome, and says "unknown"."""
    codes = sorted(mlx5.SYNDROME_NAMES) + [0, 0x99]
    for code, name in zip(codes, mirror.ask(["synd %d" % c for c in codes])):
        assert name == mlx5.SYNDROME_NAMES.get(code, "unknown syndrome"), code


# --- segments and WQEs: writers and values ---------------------------------------------------------

def _filled(n, fill):
    return np.full(n, fill, dtype=np.uint8)


def _req_ctrl(pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm):
    args = "%d %d %d %d %d %d %d %d" % (pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm)
    return args, 16, lambda b: mlx5.set_ctrl_seg(b, 0, pi, opcode, opmod, qpn, fm_ce_se, ds,
                                                 signature, imm)


SEG_KINDS = {  # request name -> (strategy of argument tuples, gpunet.mlx5 writer, length)
    "ctrl": (st.tuples(u32, u8, u8, u32, u8, u8, u8, u32),
             lambda b, a: mlx5.set_ctrl_seg(b, 0, *a), 16),
    "data": (st.tuples(u32, u32, u64),
             lambda b, a: mlx5.set_data_seg(b, 0, a[0], a[1], U64(a[2])), 16),
    "raddr": (st.tuples(u64, u32), lambda b, a: mlx5.set_raddr_seg(b, 0, U64(a[0]), a[1]), 16),
    "atom": (st.tuples(u64, u64), lambda b, a: mlx5.set_atomic_seg(b, 0, U64(a[0]), U64(a[1])), 16),
    "inl": (st.tuples(u32), lambda b, a: mlx5.set_inline_hdr(b, 0, a[0]), 4),
}
opcodes = st.sampled_from([mlx5.OPCODE_RDMA_WRITE, mlx5.OPCODE_RDMA_WRITE_IMM,
                           mlx5.OPCODE_RDMA_READ, mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS])
WQE_KINDS = {
    "rdma": (st.tuples(u32, u24, opcodes, u8, u64, u32, u64, u32, u32, u32),
             lambda b, a: mlx5.build_rdma(b, 0, *a[:4], U64(a[4]), a[5], U64(a[6]), *a[7:]), 64),
    "amo": (st.tuples(u32, u24, opcodes, u8, u64, u32, u64, u32, u64, u64),
            lambda b, a: mlx5.build_atomic(b, 0, *a[:4], U64(a[4]), a[5], U64(a[6]), a[7],
                                           U64(a[8]), U64(a[9])), 64),
    "nop": (st.tuples(u32, u24, u8), lambda b, a: mlx5.build_nop(b, 0, *a), 64),
}
KINDS = {**SEG_KINDS, **WQE_KINDS}
requests = st.one_of(*[st.tuples(st.just(k), s) for k, (s, _, _) in KINDS.items()])


@SETTINGS
@given(fill=u8, reqs=st.lists(requests, min_size=1, max_size=BATCH))
def test_writers_and_value_builders_match_gpunet_mlx5(mirror, fill, reqs):
    """Generates ctrl / data / raddr / atomic / inline-header segments and RDMA / atomic / NOP
    WQEs over each argument's full width, and a pre-fill byte. Invariants: each mlx5.cuh writer
    leaves the same bytes as gpunet.mlx5's function of the same name on the same pre-filled
    buffer (untouched bytes included); each value builder (ctrl_seg, ..., rdma_wqe, atomic_wqe,
    nop_wqe, inline_hdr), stored in memory order, equals gpunet.mlx5's bytes on a zeroed buffer."""
    lines = ["fill %d" % fill]
    for kind, args in reqs:
        a = " ".join(str(x) for x in args)
        lines += ["%s %s" % (kind, a), "v%s %s" % (kind, a)]
    answers = mirror.ask(lines)[1:]
    for i, (kind, args) in enumerate(reqs):
        _, build, n = KINDS[kind]
        written, value = answers[2 * i], answers[2 * i + 1]
        b = _filled(n, fill)
        build(b, args)
        assert written == _hex(b), "%s%r: mlx5.cuh writer vs gpunet.mlx5" % (kind, args)
        z = _filled(n, 0)
        build(z, args)
        assert value == _hex(z), "v%s%r: mlx5.cuh value builder vs gpunet.mlx5" % (kind, args)


RING_DEPTHS = st.sampled_from([1, 2, 4, 8, 16])


@SETTINGS
@given(fill=u8, cases=st.lists(
    st.tuples(RING_DEPTHS, u32, u24, opcodes, u8, u64, u32, u32, st.binary(max_size=200)),
    min_size=1, max_size=8))
def test_build_write_inline_matches_including_wrap(mirror, fill, cases):
    """Generates inline WRITEs (payload 0..200 bytes) at any pi into pre-filled rings of 1..16
    WQEBBs (a WQE longer than its ring overwrites itself, the same way on both sides).
    Invariant: mlx5.cuh's build_write_inline returns the same WQEBB count and leaves the same ring
    bytes as gpunet.mlx5's."""
    lines = ["fill %d" % fill]
    for depth, pi, qpn, op, fm, raddr, rkey, imm, data in cases:
        lines.append("wi %d %d %d %d %d %d %d %d %s" % (depth, pi, qpn, op, fm, raddr, rkey, imm,
                                                       data.hex() or "-"))
    for (depth, pi, qpn, op, fm, raddr, rkey, imm, data), got in zip(cases, mirror.ask(lines)[1:]):
        ring = _filled(depth * mlx5.WQEBB, fill)
        nbb = mlx5.build_write_inline(ring, depth, pi, qpn, op, fm, U64(raddr), rkey,
                                      np.frombuffer(data, dtype=np.uint8).copy(), imm)
        assert got == "%d %s" % (nbb, _hex(ring))


@SETTINGS
@given(cases=st.lists(st.tuples(u32, u24, opcodes, u8, u64, u32, u32, st.binary(max_size=220)),
                      min_size=1, max_size=8))
def test_write_inline_wqe_values_match_build_write_inline(mirror, cases):
    """Generates inline WRITEs (payload 0..220 bytes: up to the 4 WQEBBs device WQEs hold) over
    each argument's full width. Invariant: mlx5.cuh's write_inline_wqe (the value builder qp.cuh
    posts) returns gpunet.mlx5.build_write_inline's WQEBB count, and its segments, stored in memory
    order, are the bytes build_write_inline leaves at pi in a zeroed 4-WQEBB ring, read from pi on."""
    lines = ["vwi %d %d %d %d %d %d %d %s" % (pi, qpn, op, fm, raddr, rkey, imm, data.hex() or "-")
             for pi, qpn, op, fm, raddr, rkey, imm, data in cases]
    for (pi, qpn, op, fm, raddr, rkey, imm, data), got in zip(cases, mirror.ask(lines)):
        ring = _filled(4 * mlx5.WQEBB, 0)
        nbb = mlx5.build_write_inline(ring, 4, pi, qpn, op, fm, U64(raddr), rkey,
                                      np.frombuffer(data, dtype=np.uint8).copy(), imm)
        in_order = np.roll(ring, -(pi & 3) * mlx5.WQEBB)[:nbb * mlx5.WQEBB]   # unwrap from pi
        assert got == "%d %s" % (nbb, _hex(in_order))


@SETTINGS
@given(fill=u8, cases=st.lists(st.tuples(RING_DEPTHS, u32, st.integers(1, 16)), min_size=1,
                               max_size=8))
def test_write_wqe_wrapped_matches(mirror, fill, cases):
    """Generates (ring depth, pi, nbb) with a WQE of distinct bytes. Invariant: mlx5.cuh's
    write_wqe_wrapped leaves the same ring as gpunet.mlx5's."""
    lines, wqes = ["fill %d" % fill], []
    for depth, pi, nbb in cases:
        wqe = (np.arange(nbb * mlx5.WQEBB) * 7 + 1).astype(np.uint8)
        wqes.append(wqe)
        lines.append("ww %d %d %d %s" % (depth, pi, nbb, _hex(wqe)))
    for (depth, pi, nbb), wqe, got in zip(cases, wqes, mirror.ask(lines)[1:]):
        ring = _filled(depth * mlx5.WQEBB, fill)
        mlx5.write_wqe_wrapped(ring, depth, pi, wqe, nbb)
        assert got == _hex(ring)


# --- parsers -------------------------------------------------------------------------------------

FIELD = re.compile(r"(\w+)=(\d+)")


def _fields(line):
    return {k: int(v) for k, v in FIELD.findall(line)}


@SETTINGS
@given(fill=u8, cqes=st.lists(st.tuples(st.integers(0, 15), u32, u32, u32, u32, u8, u8, u8, u8),
                              min_size=1, max_size=BATCH))
def test_write_cqe_matches(mirror, fill, cqes):
    """Generates write_cqe arguments over their full widths (owner any byte, qpn 32 bits).
    Invariant: mlx5.cuh's write_cqe leaves the same 64 bytes as gpunet.mlx5's."""
    answers = mirror.ask(["fill %d" % fill] + ["cqe " + " ".join(map(str, c)) for c in cqes])[1:]
    for c, got in zip(cqes, answers):
        b = _filled(64, fill)
        mlx5.write_cqe(b, 0, *c)
        assert got == _hex(b), c


@SETTINGS
@given(raw=st.lists(st.binary(min_size=64, max_size=64), min_size=1, max_size=BATCH))
def test_cqe_and_wqe_parsers_match_on_any_bytes(mirror, raw):
    """Generates arbitrary 64 bytes, read as a CQE, as a ctrl segment (bytes 0..15) and as a
    raddr / data / atomic segment (bytes 16..31). Invariant: every cqe_*, ctrl_* and *_seg_*
    parser of mlx5.cuh returns gpunet.mlx5's value (the soft NIC reads WQEs with the latter), and
    the tail decoders (a little-endian load of bytes 60..63) agree with cqe_opcode/owner and
    cqe_wqe_counter."""
    answers = mirror.ask([x for r in raw for x in ("parse " + r.hex(), "pctrl " + r[:16].hex(),
                                                   "pseg " + r[16:32].hex())])
    for i, r in enumerate(raw):
        b = np.frombuffer(r, dtype=np.uint8)
        c, p, g = (_fields(answers[3 * i]), _fields(answers[3 * i + 1]),
                   _fields(answers[3 * i + 2]))
        ours = {"opcode": mlx5.cqe_opcode(b, 0), "owner": mlx5.cqe_owner(b, 0),
                "qpn": mlx5.cqe_qpn(b, 0), "wqe_counter": mlx5.cqe_wqe_counter(b, 0),
                "byte_cnt": mlx5.cqe_byte_cnt(b, 0), "imm_raw": mlx5.cqe_imm_raw(b, 0),
                "syndrome": mlx5.cqe_syndrome(b, 0),
                "vendor_err_synd": mlx5.cqe_vendor_syndrome(b, 0)}
        assert {k: c[k] for k in ours} == {k: int(v) for k, v in ours.items()}
        assert c["tail_op_own"] == b[mlx5.CQE_OP_OWN]
        assert c["tail_wqe_counter"] == c["wqe_counter"]
        ctrl = {"opcode": mlx5.ctrl_opcode(b, 0), "opmod": mlx5.ctrl_opmod(b, 0),
                "wqe_index": mlx5.ctrl_wqe_index(b, 0), "qpn": mlx5.ctrl_qpn(b, 0),
                "ds": mlx5.ctrl_ds(b, 0), "fm_ce_se": mlx5.ctrl_fm_ce_se(b, 0),
                "imm_raw": mlx5.ctrl_imm_raw(b, 0)}
        assert p == {k: int(v) for k, v in ctrl.items()}
        segs = {"raddr": mlx5.raddr_seg_raddr(b, 16), "rkey": mlx5.raddr_seg_rkey(b, 16),
                "byte_count": mlx5.data_seg_byte_count(b, 16), "lkey": mlx5.data_seg_lkey(b, 16),
                "addr": mlx5.data_seg_addr(b, 16), "swap_add": mlx5.atomic_seg_swap_add(b, 16),
                "compare": mlx5.atomic_seg_compare(b, 16)}
        assert g == {k: int(v) for k, v in segs.items()}


@SETTINGS
@given(cases=st.lists(st.tuples(u8, u32, st.integers(0, 24).map(lambda k: 1 << k)),
                      min_size=1, max_size=BATCH))
def test_cqe_ownership_rule_matches(mirror, cases):
    """Generates (op_own, 32-bit ci, power-of-two cqe_cnt). Invariant: mlx5.cuh's cqe_is_valid
    and op_own_is_valid both equal mlx5.cqe_is_valid."""
    for (op_own, ci, cnt), got in zip(cases, mirror.ask(["valid %d %d %d" % c for c in cases])):
        b = np.zeros(64, dtype=np.uint8)
        b[mlx5.CQE_OP_OWN] = op_own
        assert int(got) == int(bool(mlx5.cqe_is_valid(b, 0, ci, cnt))), (op_own, ci, cnt)


@SETTINGS
@given(fill=u8, counters=st.lists(st.integers(0, 2**40), min_size=1, max_size=BATCH))
def test_doorbell_records_and_word_match(mirror, fill, counters):
    """Generates 40-bit producer / consumer counters. Invariants: set_sq_dbrec / set_cq_dbrec
    leave gpunet.mlx5's bytes on a pre-filled record; get_* read back gpunet's value; the
    *_dbrec_value words, stored little-endian, are the bytes the setters write; doorbell_word and
    doorbell_wqe_index of a ctrl segment built at that counter equal gpunet.mlx5's."""
    ctrls = []
    for c in counters:
        b = np.zeros(16, dtype=np.uint8)
        mlx5.set_ctrl_seg(b, 0, c & 0xFFFFFFFF, mlx5.OPCODE_RDMA_WRITE, 0, c & 0xFFFFFF, 0,
                          mlx5.DS_RDMA, 0, 0)
        ctrls.append(b)
    lines = ["fill %d" % fill]
    for c, b in zip(counters, ctrls):
        lines += ["sqdb %d" % c, "cqdb %d" % c, "dbw " + b[:8].tobytes().hex()]
    answers = mirror.ask(lines)[1:]
    for i, (c, b) in enumerate(zip(counters, ctrls)):
        sq_line, cq_line, dbw_line = answers[3 * i:3 * i + 3]
        sq, cq = _filled(8, fill), _filled(8, fill)
        mlx5.set_sq_dbrec(sq, 0, c)
        mlx5.set_cq_dbrec(cq, 0, c)
        assert sq_line == "%s %d %s" % (_hex(sq), mlx5.get_sq_dbrec(sq, 0), _hex(sq[4:8]))
        assert cq_line == "%s %d %s" % (_hex(cq), mlx5.get_cq_dbrec(cq, 0), _hex(cq[0:4]))
        word = mlx5.doorbell_word(b, 0)
        assert dbw_line == "%d %d" % (word, mlx5.doorbell_wqe_index(U64(word)))


@given(cases=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 1 << 20)), min_size=1,
                      max_size=BATCH))
def test_wqe_arithmetic_matches(mirror, cases):
    """wqebb_count and inline_ds (constexpr in the header) equal gpunet.mlx5's for any ds and
    payload size."""
    for (ds, n), got in zip(cases, mirror.ask(["ar %d %d" % c for c in cases])):
        assert got == "%d %d" % (mlx5.wqebb_count(ds), mlx5.inline_ds(n))


def test_init_cq_matches(mirror):
    """init_cq sets exactly the op_own bytes, as gpunet.mlx5's does."""
    for cnt in (1, 4, 16):
        got = mirror.ask(["fill 51", "init %d" % cnt])[1]
        cq = _filled(cnt * 64, 51)
        mlx5.init_cq(cq, cnt)
        assert got == _hex(cq)


# --- the CUDA arm compiles ----------------------------------------------------------------------

CU_PROBE = r"""
#include "gpunet/mlx5.cuh"
namespace m = gpunet::mlx5;
// Values stored as the QP code stores them (64-bit words), a writer, the parsers, on the device.
__global__ void probe(unsigned long long* sq, unsigned char* cq, unsigned* out) {
  const m::Wqebb w = m::rdma_wqe(threadIdx.x, 7, m::OPCODE_RDMA_WRITE, m::WQE_CTRL_CQ_UPDATE,
                                 0x1000, 1, 0x2000, 2, 64, 0);
  for (int i = 0; i < 4; ++i) { sq[2 * i] = w.seg[i].w[0]; sq[2 * i + 1] = w.seg[i].w[1]; }
  const unsigned char d[4] = {1, 2, 3, 4};
  out[0] = m::build_write_inline(reinterpret_cast<unsigned char*>(sq), 8, 7, 1,
                                 m::OPCODE_RDMA_WRITE, 0, 1, 2, d, 4, 0);
  out[1] = m::cqe_is_valid(cq, 3, 16) + m::cqe_wqe_counter(cq) +
           m::doorbell_wqe_index(m::doorbell_word(w.seg[0]));
  out[2] = m::sq_dbrec_value(5) ^ m::inline_hdr(3) ^ m::atomic_seg(1, 2).w[0];
  out[3] = m::syndrome_name(cq[m::CQE_SYNDROME])[0];
  m::Seg16 segs[8];
  out[0] += m::write_inline_wqe(segs, 1, 7, m::OPCODE_RDMA_WRITE, 0, 1, 2, d, 4, 0) +
            m::data_seg_lkey(cq) + m::raddr_seg_rkey(cq) + m::ctrl_imm_raw(cq);
}
static_assert(m::wqebb_count(m::inline_ds(100)) == 3, "constexpr on the host side of nvcc");
"""


def test_header_compiles_with_nvcc(tmp_path):
    """nvcc -std=c++17 -x cu -c compiles a kernel that uses mlx5.cuh's value builders (the inline
    WQE's too), writers and parsers (compile only: no GPU needed)."""
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/bin/nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or at /usr/local/bin/nvcc: the CUDA arm of "
                    "mlx5.cuh is not compiled here")
    src = tmp_path / "probe.cu"
    src.write_text(CU_PROBE)
    r = subprocess.run([nvcc, "-std=c++17", "-x", "cu", "-c", "-I", str(INCLUDE), str(src),
                        "-o", str(tmp_path / "probe.o")], capture_output=True, text=True)
    assert r.returncode == 0, "nvcc could not compile mlx5.cuh:\n" + r.stdout + r.stderr
