"""Unit tests of gpunet.mlx5 on its own: WQEBB arithmetic, ring wrap, parser round trips, names.

Byte-level agreement with rdma-core's header is tests/test_mlx5_oracle.py's job; here each
builder is read back by gpunet's own parsers and the arithmetic is checked against its definition.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunet import mlx5

SETTINGS = settings(deadline=None)  # the first example pays numba's compile time
U64 = np.uint64  # numpy scalars are typed exactly; plain ints work as well (rawmem.wire_njit)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)


# --- WQEBB arithmetic ---------------------------------------------------------------------------

def test_wqebb_count_small_cases():
    """ds 1..4 fit one 64-byte WQEBB, 5..8 two; the fixed WQEs take one WQEBB each."""
    assert [mlx5.wqebb_count(ds) for ds in range(1, 10)] == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert mlx5.wqebb_count(mlx5.DS_RDMA) == 1
    assert mlx5.wqebb_count(mlx5.DS_ATOMIC) == 1
    assert mlx5.wqebb_count(mlx5.DS_NOP) == 1
    assert mlx5.wqebb_count(mlx5.MAX_DS) == 16


@pytest.mark.parametrize("ds", range(0, mlx5.MAX_DS + 1))
def test_wqebb_count_is_the_smallest_cover(ds):
    """wqebb_count(ds) WQEBBs hold ds 16-byte units and one WQEBB fewer would not."""
    n = mlx5.wqebb_count(ds)
    assert n * mlx5.WQEBB >= ds * mlx5.DS_UNIT
    assert n == 0 or (n - 1) * mlx5.WQEBB < ds * mlx5.DS_UNIT


def test_inline_ds_boundaries():
    """ctrl + raddr + a 4-byte inline header: 12 payload bytes fill the third unit, 13 spill."""
    assert mlx5.inline_ds(0) == 3
    assert mlx5.inline_ds(12) == 3
    assert mlx5.inline_ds(13) == 4
    assert mlx5.inline_ds(28) == 4
    assert mlx5.inline_ds(29) == 5
    # the largest payload that still fits one WQEBB: 64 - 16 - 16 - 4
    assert mlx5.wqebb_count(mlx5.inline_ds(28)) == 1
    assert mlx5.wqebb_count(mlx5.inline_ds(29)) == 2


@given(n=st.integers(0, 4096))
def test_inline_ds_is_the_smallest_cover(n):
    """For any payload, inline_ds(n) units hold ctrl + raddr + header + n bytes, one fewer not."""
    need = mlx5.CTRL_SEG_SIZE + mlx5.RADDR_SEG_SIZE + mlx5.INLINE_HDR_SIZE + n
    ds = mlx5.inline_ds(n)
    assert ds * mlx5.DS_UNIT >= need > (ds - 1) * mlx5.DS_UNIT


# --- inline WRITE into a ring, wrapping per WQEBB -------------------------------------------------

RING_WQEBBS = 8
SENTINEL = 0x5A
# the largest inline payload whose WQE fits an 8-WQEBB ring: ds <= 32
MAX_INLINE_FOR_RING = (RING_WQEBBS * mlx5.WQEBB - mlx5.CTRL_SEG_SIZE - mlx5.RADDR_SEG_SIZE
                       - mlx5.INLINE_HDR_SIZE)


def _linear_inline_wqe(pi, qpn, opcode, fm_ce_se, raddr, rkey, data, imm):
    """The inline WRITE as it would lie in an unbounded buffer, built from the segment setters."""
    n = len(data)
    ds = mlx5.inline_ds(n)
    w = np.zeros(mlx5.wqebb_count(ds) * mlx5.WQEBB, dtype=np.uint8)
    mlx5.set_ctrl_seg(w, 0, pi, opcode, 0, qpn, fm_ce_se, ds, 0, imm)
    mlx5.set_raddr_seg(w, 16, U64(raddr), rkey)
    mlx5.set_inline_hdr(w, 32, n)
    w[36:36 + n] = data
    return w


@SETTINGS
@given(pi=u32, qpn=u24, opcode=st.sampled_from([mlx5.OPCODE_RDMA_WRITE, mlx5.OPCODE_RDMA_WRITE_IMM]),
       fm_ce_se=u8, raddr=u64, rkey=u32, imm=u32,
       data=st.binary(min_size=0, max_size=MAX_INLINE_FOR_RING))
def test_build_write_inline_wraps_at_ring_end(pi, qpn, opcode, fm_ce_se, raddr, rkey, imm, data):
    """Generates any 32-bit pi (so every start slot of an 8-WQEBB ring, including the last) and a
    payload of 0..476 bytes. Invariant: build_write_inline returns wqebb_count(inline_ds(n)); WQEBB
    b of the WQE lies at ring slot (pi + b) % 8, equal to the linearly built WQE's block b; every
    other slot keeps its old bytes; the ctrl segment parses back to pi & 0xffff, qpn, ds, opcode."""
    payload = np.frombuffer(data, dtype=np.uint8).copy()
    ring = np.full(RING_WQEBBS * mlx5.WQEBB, SENTINEL, dtype=np.uint8)
    nbb = mlx5.build_write_inline(ring, RING_WQEBBS, pi, qpn, opcode, fm_ce_se, U64(raddr), rkey,
                                  payload, imm)
    ds = mlx5.inline_ds(len(data))
    assert nbb == mlx5.wqebb_count(ds)
    linear = _linear_inline_wqe(pi, qpn, opcode, fm_ce_se, raddr, rkey, payload, imm)
    used = set()
    for b in range(nbb):
        slot = (pi + b) % RING_WQEBBS
        used.add(slot)
        got = ring[slot * mlx5.WQEBB:(slot + 1) * mlx5.WQEBB]
        assert np.array_equal(got, linear[b * mlx5.WQEBB:(b + 1) * mlx5.WQEBB]), (b, slot)
    for slot in set(range(RING_WQEBBS)) - used:
        assert (ring[slot * mlx5.WQEBB:(slot + 1) * mlx5.WQEBB] == SENTINEL).all(), slot
    first = (pi % RING_WQEBBS) * mlx5.WQEBB
    assert mlx5.ctrl_wqe_index(ring, first) == pi & 0xFFFF
    assert mlx5.ctrl_qpn(ring, first) == qpn
    assert mlx5.ctrl_ds(ring, first) == ds
    assert mlx5.ctrl_opcode(ring, first) == opcode
    assert mlx5.ctrl_fm_ce_se(ring, first) == fm_ce_se
    assert mlx5.get_be32(linear, 32) == len(data) | mlx5.INLINE_SEG
    assert bytes(linear[36:36 + len(data)]) == data
    assert not linear[36 + len(data):].any(), "padding after the payload is zero"


def test_build_write_inline_last_slot_example():
    """A concrete wrap: 100 bytes at pi = 7 of an 8-WQEBB ring take slots 7, 0, 1 (ds 9)."""
    ring = np.full(RING_WQEBBS * mlx5.WQEBB, SENTINEL, dtype=np.uint8)
    data = np.arange(100, dtype=np.uint8)
    nbb = mlx5.build_write_inline(ring, RING_WQEBBS, 7, 0x1234, mlx5.OPCODE_RDMA_WRITE,
                                  mlx5.WQE_CTRL_CQ_UPDATE, U64(0x1000), 0x77, data, 0)
    assert nbb == 3
    assert mlx5.ctrl_ds(ring, 7 * 64) == 9 and mlx5.ctrl_wqe_index(ring, 7 * 64) == 7
    assert mlx5.get_be32(ring, 7 * 64 + 32) == 100 | mlx5.INLINE_SEG
    assert np.array_equal(ring[7 * 64 + 36:8 * 64], data[:28])     # first WQEBB: 28 payload bytes
    assert np.array_equal(ring[0:64], data[28:92])                  # wrapped to slot 0
    assert np.array_equal(ring[64:72], data[92:100])                # slot 1: the last 8 bytes
    assert not ring[72:128].any()                                   # then zero padding
    assert (ring[128:7 * 64] == SENTINEL).all()                     # slots 2..6 untouched


@given(pi=u32, nbb=st.integers(1, RING_WQEBBS))
def test_write_wqe_wrapped_places_each_wqebb(pi, nbb):
    """Block b of a WQE of nbb WQEBBs lands in slot (pi + b) % depth; nothing else changes."""
    wqe = np.repeat(np.arange(1, nbb + 1, dtype=np.uint8), mlx5.WQEBB)
    ring = np.zeros(RING_WQEBBS * mlx5.WQEBB, dtype=np.uint8)
    mlx5.write_wqe_wrapped(ring, RING_WQEBBS, pi, wqe, nbb)
    slots = ring.reshape(RING_WQEBBS, mlx5.WQEBB)
    for b in range(nbb):
        assert (slots[(pi + b) % RING_WQEBBS] == b + 1).all()
    assert sum(int((s != 0).any()) for s in slots) == nbb


# --- parsers read back what the builders wrote -------------------------------------------------------

@SETTINGS
@given(pi=u32, opcode=u8, opmod=u8, qpn=u32, fm_ce_se=u8, ds=st.integers(0, mlx5.MAX_DS),
       signature=u8, imm=u32)
def test_ctrl_seg_round_trip(pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm):
    """Generates every ctrl field over its full argument width. Invariant: the ctrl_* parsers
    return the field as the segment keeps it (pi & 0xffff, qpn & 0xffffff, the rest whole); the
    doorbell word of the segment carries the same WQE index."""
    b = np.zeros(16, dtype=np.uint8)
    mlx5.set_ctrl_seg(b, 0, pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm)
    assert mlx5.ctrl_opcode(b, 0) == opcode
    assert mlx5.ctrl_opmod(b, 0) == opmod
    assert mlx5.ctrl_wqe_index(b, 0) == pi & 0xFFFF
    assert mlx5.ctrl_qpn(b, 0) == qpn & 0xFFFFFF
    assert mlx5.ctrl_ds(b, 0) == ds
    assert mlx5.ctrl_fm_ce_se(b, 0) == fm_ce_se
    assert b[mlx5.CTRL_SIGNATURE] == signature
    assert mlx5.get_le32(b, mlx5.CTRL_IMM) == imm, "imm is stored as given (host order)"
    word = mlx5.doorbell_word(b, 0)
    assert int(mlx5.doorbell_wqe_index(U64(word))) == pi & 0xFFFF


@SETTINGS
@given(raddr=u64, rkey=u32, laddr=u64, lkey=u32, nbytes=u32, swap_add=u64, compare=u64)
def test_rdma_and_atomic_segments_round_trip(raddr, rkey, laddr, lkey, nbytes, swap_add, compare):
    """build_rdma / build_atomic: each field reads back big-endian at its segment offset, the
    atomic's data segment is 8 bytes long, and each returns one WQEBB."""
    w = np.zeros(64, dtype=np.uint8)
    assert mlx5.build_rdma(w, 0, 1, 2, mlx5.OPCODE_RDMA_WRITE, 0, U64(raddr), rkey, U64(laddr),
                           lkey, nbytes, 0) == 1
    assert mlx5.ctrl_ds(w, 0) == mlx5.DS_RDMA
    assert (int(mlx5.get_be64(w, 16)), mlx5.get_be32(w, 24), mlx5.get_be32(w, 28)) == (raddr, rkey, 0)
    assert (mlx5.get_be32(w, 32), mlx5.get_be32(w, 36), int(mlx5.get_be64(w, 40))) == (
        nbytes, lkey, laddr)
    w[:] = 0
    assert mlx5.build_atomic(w, 0, 1, 2, mlx5.OPCODE_ATOMIC_CS, 0, U64(raddr), rkey, U64(laddr),
                             lkey, U64(swap_add), U64(compare)) == 1
    assert mlx5.ctrl_ds(w, 0) == mlx5.DS_ATOMIC
    assert (int(mlx5.get_be64(w, 32)), int(mlx5.get_be64(w, 40))) == (swap_add, compare)
    assert (mlx5.get_be32(w, 48), mlx5.get_be32(w, 52), int(mlx5.get_be64(w, 56))) == (8, lkey, laddr)


@SETTINGS
@given(opcode=st.integers(0, 14), qpn=u24, wc=u32, byte_cnt=u32, imm=u32, owner=st.integers(0, 1),
       synd=u8, vsynd=u8, wop=u8)
def test_write_cqe_round_trip(opcode, qpn, wc, byte_cnt, imm, owner, synd, vsynd, wop):
    """Generates every CQE opcode but INVALID and all write_cqe fields. Invariant: the cqe_*
    parsers return them (wqe_counter & 0xffff); error fields are set only for error CQEs."""
    b = np.full(64, 0xEE, dtype=np.uint8)
    mlx5.write_cqe(b, 0, opcode, qpn, wc, byte_cnt, imm, owner, synd, vsynd, wop)
    err = opcode in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR)
    assert (mlx5.cqe_opcode(b, 0), mlx5.cqe_owner(b, 0)) == (opcode, owner)
    assert mlx5.cqe_qpn(b, 0) == qpn
    assert mlx5.cqe_wqe_counter(b, 0) == wc & 0xFFFF
    assert mlx5.cqe_byte_cnt(b, 0) == byte_cnt
    assert mlx5.cqe_imm_raw(b, 0) == imm
    assert mlx5.cqe_syndrome(b, 0) == (synd if err else 0)
    assert mlx5.cqe_vendor_syndrome(b, 0) == (vsynd if err else 0)
    assert b[mlx5.CQE_SOP_DROP_QPN] == (wop if err else 0)


@given(v=u64)
def test_byte_order_helpers_round_trip(v):
    """put_be*/get_be* and put_le32/get_le32 invert each other; bswap32 is htobe32 on this host."""
    b = np.zeros(8, dtype=np.uint8)
    mlx5.put_be64(b, 0, U64(v))
    assert bytes(b) == v.to_bytes(8, "big") and int(mlx5.get_be64(b, 0)) == v
    v32, v16 = v & 0xFFFFFFFF, v & 0xFFFF
    mlx5.put_be32(b, 0, v32)
    assert bytes(b[:4]) == v32.to_bytes(4, "big") and mlx5.get_be32(b, 0) == v32
    mlx5.put_le32(b, 0, v32)
    assert bytes(b[:4]) == v32.to_bytes(4, "little") and mlx5.get_le32(b, 0) == v32
    mlx5.put_be16(b, 0, v16)
    assert bytes(b[:2]) == v16.to_bytes(2, "big") and mlx5.get_be16(b, 0) == v16
    assert mlx5.bswap32(v32) == int.from_bytes(v32.to_bytes(4, "big"), "little")


@given(pi=u32, ci=u32)
def test_doorbell_records_round_trip(pi, ci):
    """The SQ record keeps pi & 0xffff in word 1, the CQ record ci & 0xffffff in word 0, and
    setting one leaves the other word alone."""
    d = np.zeros(8, dtype=np.uint8)
    mlx5.set_sq_dbrec(d, 0, pi)
    assert mlx5.get_sq_dbrec(d, 0) == pi & 0xFFFF and not d[:4].any()
    mlx5.set_cq_dbrec(d, 0, ci)
    assert mlx5.get_cq_dbrec(d, 0) == ci & 0xFFFFFF and mlx5.get_sq_dbrec(d, 0) == pi & 0xFFFF


# --- CQ ownership across passes --------------------------------------------------------------------

@pytest.mark.parametrize("cqe_cnt", [1, 2, 8, 64])
def test_owner_bit_marks_each_pass(cqe_cnt):
    """A NIC writing CQE number k with owner bit !!(k & cqe_cnt): the consumer at ci == k sees
    it valid; a consumer one pass behind or ahead (ci = k +- cqe_cnt) sees it invalid; a fresh CQ
    (init_cq) is invalid to every consumer index of the first two passes."""
    cq = np.full(cqe_cnt * 64, 0x33, dtype=np.uint8)
    mlx5.init_cq(cq, cqe_cnt)
    assert all(cq[i * 64 + 63] == mlx5.CQE_OP_OWN_INIT for i in range(cqe_cnt))
    assert (cq.reshape(cqe_cnt, 64)[:, :63] == 0x33).all(), "init_cq touches only op_own"
    assert not any(mlx5.cqe_is_valid(cq, (ci % cqe_cnt) * 64, ci, cqe_cnt)
                   for ci in range(2 * cqe_cnt))
    for k in range(4 * cqe_cnt):
        off = (k % cqe_cnt) * 64
        mlx5.write_cqe(cq, off, mlx5.CQE_REQ, 5, k, 0, 0, 1 if k & cqe_cnt else 0, 0, 0, 0)
        assert mlx5.cqe_is_valid(cq, off, k, cqe_cnt)
        assert not mlx5.cqe_is_valid(cq, off, k + cqe_cnt, cqe_cnt)
        if k >= cqe_cnt:
            assert not mlx5.cqe_is_valid(cq, off, k - cqe_cnt, cqe_cnt)


# --- syndrome names ---------------------------------------------------------------------------------

def test_syndrome_name_known_and_unknown():
    """Every SYNDROME_* constant has a name; unknown values say so with their hex value;
    numpy integers (as parsers return them) work as keys."""
    consts = {v for k, v in vars(mlx5).items() if k.startswith("SYNDROME_") and k != "SYNDROME_NAMES"}
    assert consts == set(mlx5.SYNDROME_NAMES)
    assert mlx5.syndrome_name(mlx5.SYNDROME_REMOTE_ACCESS_ERR) == "remote access error"
    assert mlx5.syndrome_name(mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR) == \
        "transport retry counter exceeded"
    assert mlx5.syndrome_name(np.uint8(0x05)) == "work request flushed"
    assert mlx5.syndrome_name(0x99) == "unknown syndrome 0x99"
    assert len(set(mlx5.SYNDROME_NAMES.values())) == len(mlx5.SYNDROME_NAMES)
