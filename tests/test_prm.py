"""gpunet.host.prm: set/get over command buffers, the table's own consistency, and the command
encodings the DevX NIC sends, decoded field by field.

The layouts themselves are checked against the kernel header and rdma-core in
tests/test_prm_oracle.py; here a second, deliberately different implementation of the bit
placement (a string of '0'/'1' characters, bit 0 first) says where set() must put each value.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunet.errors import ConfigError
from gpunet.host import prm

N = settings().max_examples

PLAIN = sorted(k for k in prm.FIELDS if k not in prm.NESTED)


def _bits(buf):
    return "".join(format(b, "08b") for b in bytes(buf))


def _from_bits(s):
    return bytearray(int(s[i:i + 8], 2) for i in range(0, len(s), 8))


def _place(buf, bit_off, width, value):
    """The reference: ``buf`` with bits [bit_off, bit_off + width) replaced by ``value``."""
    s = _bits(buf)
    return _from_bits(s[:bit_off] + format(value, "0%db" % width) + s[bit_off + width:])


@st.composite
def field_value_buffer(draw):
    struct, field = draw(st.sampled_from(PLAIN))
    off, width = prm.FIELDS[(struct, field)]
    value = draw(st.integers(0, (1 << width) - 1))
    base = draw(st.sampled_from([0, 8, 0x40, 0xc0]))
    nbytes = prm.SIZES[struct] // 8 + base // 8
    background = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return struct, field, value, base, bytearray(background)


@settings(max_examples=4 * N)
@given(field_value_buffer())
def test_set_places_the_value_and_leaves_every_other_bit(case):
    """Generated: any plain field of any struct, a value within its width, a struct start bit
    (base_bits) and random background bytes. Invariant: set() changes exactly the field's bits
    (big-endian bit order, bit 0 = MSB of byte 0) to the value, and get() reads it back."""
    struct, field, value, base, buf = case
    off, width = prm.FIELDS[(struct, field)]
    want = _place(buf, base + off, width, value)
    prm.set(buf, struct, field, value, base_bits=base)
    assert buf == want
    assert prm.get(buf, struct, field, base_bits=base) == value


@settings(max_examples=N)
@given(st.sampled_from(PLAIN), st.data())
def test_values_beyond_the_width_are_refused(key, data):
    """Generated: any plain field and a value of 2**width or more, or negative. Invariant: set()
    raises ConfigError naming the field and leaves the buffer untouched."""
    struct, field = key
    width = prm.FIELDS[key][1]
    value = data.draw(st.one_of(st.integers(1 << width, 1 << (width + 8)), st.integers(-8, -1)))
    buf = prm.alloc(struct)
    with pytest.raises(ConfigError, match=field):
        prm.set(buf, struct, field, value)
    assert buf == prm.alloc(struct)


def test_unknown_names_and_misuse_are_config_errors():
    """Unknown structs and fields, a path through a plain field, setting a nested struct as an
    int, and a field beyond the buffer each raise ConfigError."""
    buf = prm.alloc("create_qp_in")
    for call in (lambda: prm.alloc("no_such_in"),
                 lambda: prm.set(buf, "create_qp_in", "no_such_field", 1),
                 lambda: prm.set(buf, "create_qp_in", "qpn.x", 1),
                 lambda: prm.set(buf, "create_qp_in", "qpc", 1),
                 lambda: prm.get(buf, "create_qp_in", "qpc.primary_address_path"),
                 lambda: prm.set(bytearray(4), "create_qp_in", "qpc.pd", 1),
                 lambda: prm.fill(buf, "create_qp_in", {"qpc": 3}),
                 lambda: prm.set_bytes(buf, "create_qp_in", "qpc.mtu", b"\0")):
        with pytest.raises(ConfigError):
            call()


def test_nested_paths_add_the_offsets():
    """offset() of a dotted path is the sum of the offsets along it, with the last field's
    width; get/set through the path and through base_bits address the same bits."""
    off, width, inner = prm.offset("init2rtr_qp_in", "qpc.primary_address_path.rlid")
    assert inner is None and width == 16
    assert off == (prm.FIELDS[("init2rtr_qp_in", "qpc")][0]
                   + prm.FIELDS[("qpc", "primary_address_path")][0] + prm.FIELDS[("ads", "rlid")][0])
    buf = prm.alloc("init2rtr_qp_in")
    prm.set(buf, "init2rtr_qp_in", "qpc.primary_address_path.rlid", 0xBEEF)
    base = off - prm.FIELDS[("ads", "rlid")][0]
    assert prm.get(buf, "ads", "rlid", base_bits=base) == 0xBEEF
    assert prm.offset("create_qp_in", ("qpc", "remote_qpn"))[:2] == (
        prm.FIELDS[("create_qp_in", "qpc")][0] + prm.FIELDS[("qpc", "remote_qpn")][0], 24)


@settings(max_examples=N)
@given(st.binary(min_size=16, max_size=16), st.binary(min_size=0x110, max_size=0x110))
def test_gid_bytes_round_trip_in_wire_order(gid, background):
    """Generated: a 16-byte GID and random background. Invariant: set_bytes puts the GID's bytes
    in order at ads.rgid_rip (byte-aligned) and nowhere else; get_bytes returns them; a wrong
    length is a ConfigError."""
    buf = bytearray(background)
    off = prm.offset("init2rtr_qp_in", "qpc.primary_address_path.rgid_rip")[0]
    assert off % 8 == 0
    want = bytearray(buf)
    want[off // 8:off // 8 + 16] = gid
    prm.set_bytes(buf, "init2rtr_qp_in", "qpc.primary_address_path.rgid_rip", gid)
    assert buf == want
    assert prm.get_bytes(buf, "init2rtr_qp_in", "qpc.primary_address_path.rgid_rip") == gid
    with pytest.raises(ConfigError, match="16 bytes"):
        prm.set_bytes(buf, "ads", "rgid_rip", gid[:15])


# --- the table's own consistency ---------------------------------------------------------------
def test_nested_fields_are_as_wide_as_their_struct():
    """A NESTED field's width is its struct's size, and every struct a NESTED entry names has a
    size (so offset() can walk into it)."""
    for (struct, field), inner in prm.NESTED.items():
        assert prm.FIELDS[(struct, field)][1] == prm.SIZES[inner], (struct, field, inner)


def test_fields_of_a_struct_do_not_overlap():
    """Within each struct (unions excepted: their members share bit 0), no two fields share a
    bit, so setting one never changes another."""
    by_struct = {}
    for (struct, field), (off, width) in prm.FIELDS.items():
        by_struct.setdefault(struct, []).append((off, width, field))
    for struct, fields in by_struct.items():
        if struct in prm.UNIONS:
            assert all(off == 0 for off, _, _ in fields), struct
            continue
        fields.sort()
        for (o1, w1, f1), (o2, _, f2) in zip(fields, fields[1:]):
            assert o1 + w1 <= o2, "%s: %s overlaps %s" % (struct, f1, f2)


def test_every_struct_has_its_header_and_every_field_a_struct():
    """Every FIELDS struct has a SIZES entry; every command input starts with opcode (bits 0-15)
    and op_mod (bits 0x30-0x3f); every output with status (bits 0-7) and syndrome (0x20-0x3f)."""
    assert {s for s, _ in prm.FIELDS} <= set(prm.SIZES)
    for struct in prm.SIZES:
        if struct.endswith("_in"):
            assert prm.FIELDS[(struct, "opcode")] == (0, 16), struct
            assert prm.FIELDS[(struct, "op_mod")] == (0x30, 16), struct
        if struct.endswith("_out"):
            assert prm.FIELDS[(struct, "status")] == (0, 8), struct
            assert prm.FIELDS[(struct, "syndrome")] == (0x20, 32), struct


# --- command encodings -------------------------------------------------------------------------
def _decode_all(buf, struct, base=0, prefix=""):
    """{dotted path: value} of every plain field of ``struct`` in ``buf``, recursing into NESTED."""
    out = {}
    for (s, field), (off, width) in prm.FIELDS.items():
        if s != struct:
            continue
        inner = prm.NESTED.get((s, field))
        if inner is not None:
            out.update(_decode_all(buf, inner, base + off, prefix + field + "."))
        elif (s, field) in prm.BYTE_ARRAYS:
            out[prefix + field] = prm.get_bytes(buf, s, field, base)
        else:
            out[prefix + field] = prm.get(buf, s, field, base)
    return out


def _nonzero(decoded):
    """The entries that are not zero (a byte array: not all zero bytes)."""
    return {k: v for k, v in decoded.items() if (any(v) if isinstance(v, bytes) else v)}


u24 = st.integers(0, (1 << 24) - 1)
u32 = st.integers(0, (1 << 32) - 1)
u64 = st.integers(0, (1 << 64) - 1)


@settings(max_examples=N)
@given(log_cq_size=st.integers(0, 31), uar_page=u24, c_eqn=u32, cq_umem_id=u32, dbr_umem_id=u32,
       cq_umem_offset=u64, dbr_addr=u64, collapsed=st.booleans(), oi=st.booleans(),
       uid=st.integers(0, 0xFFFF))
def test_create_cq_encodes_exactly_its_arguments(log_cq_size, uar_page, c_eqn, cq_umem_id,
                                                 dbr_umem_id, cq_umem_offset, dbr_addr, collapsed,
                                                 oi, uid):
    """Generated: every cmd_create_cq argument over its field's range. Invariant: decoding the
    buffer field by field gives opcode CREATE_CQ, the arguments, both UMEM valid bits, and zero
    in every other field (so nothing stray reaches the firmware)."""
    buf = prm.cmd_create_cq(log_cq_size=log_cq_size, uar_page=uar_page, c_eqn=c_eqn,
                            cq_umem_id=cq_umem_id, dbr_umem_id=dbr_umem_id,
                            cq_umem_offset=cq_umem_offset, dbr_addr=dbr_addr,
                            collapsed=collapsed, oi=oi, uid=uid)
    assert len(buf) == prm.SIZES["create_cq_in"] // 8
    want = {"opcode": prm.MLX5_CMD_OP_CREATE_CQ, "uid": uid, "cq_umem_valid": 1,
            "cq_umem_id": cq_umem_id, "cq_umem_offset": cq_umem_offset,
            "cq_context.log_cq_size": log_cq_size, "cq_context.uar_page": uar_page,
            "cq_context.c_eqn_or_apu_element": c_eqn, "cq_context.cc": int(collapsed),
            "cq_context.oi": int(oi), "cq_context.dbr_umem_valid": 1,
            "cq_context.dbr_umem_id": dbr_umem_id, "cq_context.dbr_addr": dbr_addr}
    assert _nonzero(_decode_all(buf, "create_cq_in")) == _nonzero(want)


def test_create_cq_known_bytes():
    """Bytes a reader can check against the PRM / rdma-core's DEVX_SET by hand: the opcode in the
    first two bytes (0x0400, big-endian), cqc at byte 0x10 with log_cq_size in byte 0x1c's low 5
    bits and uar_page in bytes 0x1d-0x1f, cq_umem_valid the top bit of byte 0x5c."""
    buf = prm.cmd_create_cq(log_cq_size=10, uar_page=0x123456, c_eqn=7, cq_umem_id=0xA1B2C3D4,
                            dbr_umem_id=5)
    assert bytes(buf[0:8]) == bytes([0x04, 0x00, 0, 0, 0, 0, 0, 0])
    assert bytes(buf[0x1c:0x20]) == bytes([10, 0x12, 0x34, 0x56])
    assert bytes(buf[0x10 + 0x14:0x10 + 0x18]) == bytes([0, 0, 0, 7])        # c_eqn, cqc dword 5
    assert bytes(buf[0x58:0x5c]) == bytes([0xA1, 0xB2, 0xC3, 0xD4])          # cq_umem_id
    assert buf[0x5c] == 0x80
    assert prm.cmd_create_cq(log_cq_size=1, uar_page=0, c_eqn=0, cq_umem_id=0, dbr_umem_id=0,
                             collapsed=True)[0x11] & 0x10                     # cc: cqc bit 11


@settings(max_examples=N)
@given(pd=u24, uar_page=u24, cqn_snd=u24, cqn_rcv=u24, log_sq_size=st.integers(0, 15),
       wq_umem_id=u32, dbr_umem_id=u32, wq_umem_offset=u64, dbr_addr=u64, user_index=u24,
       ts_format=st.integers(0, 3))
def test_create_qp_encodes_exactly_its_arguments(pd, uar_page, cqn_snd, cqn_rcv, log_sq_size,
                                                 wq_umem_id, dbr_umem_id, wq_umem_offset, dbr_addr,
                                                 user_index, ts_format):
    """Generated: every cmd_create_qp argument over its range, plus one extra qpc field by name.
    Invariant: decoding gives opcode CREATE_QP, RC, migrated path state, a zero-length RQ, the
    arguments and the UMEM valid bits, and zero everywhere else."""
    buf = prm.cmd_create_qp(pd=pd, uar_page=uar_page, cqn_snd=cqn_snd, cqn_rcv=cqn_rcv,
                            log_sq_size=log_sq_size, wq_umem_id=wq_umem_id,
                            dbr_umem_id=dbr_umem_id, wq_umem_offset=wq_umem_offset,
                            dbr_addr=dbr_addr, user_index=user_index, ts_format=ts_format)
    want = {"opcode": prm.MLX5_CMD_OP_CREATE_QP, "wq_umem_valid": 1, "wq_umem_id": wq_umem_id,
            "wq_umem_offset": wq_umem_offset, "qpc.st": prm.MLX5_QPC_ST_RC,
            "qpc.pm_state": prm.MLX5_QPC_PM_STATE_MIGRATED, "qpc.pd": pd,
            "qpc.uar_page": uar_page, "qpc.cqn_snd": cqn_snd, "qpc.cqn_rcv": cqn_rcv,
            "qpc.log_sq_size": log_sq_size, "qpc.rq_type": prm.MLX5_ZERO_LEN_RQ,
            "qpc.user_index": user_index, "qpc.dbr_umem_valid": 1,
            "qpc.dbr_umem_id": dbr_umem_id, "qpc.dbr_addr": dbr_addr, "qpc.ts_format": ts_format}
    assert _nonzero(_decode_all(buf, "create_qp_in")) == _nonzero(want)


def test_create_qp_known_bytes():
    """Hand-checkable bytes: opcode 0x0500 first; qpc at byte 0x18 with st in byte 0x19 (RC = 0)
    and pm_state (migrated, 3) in bits 0x13-0x14 of qpc (byte 0x1a = 0b0001_1000); pd in bytes
    0x1d-0x1f; wq_umem_valid the top bit of byte 0x10c (bit 0x860)."""
    buf = prm.cmd_create_qp(pd=0xABCDEF, uar_page=1, cqn_snd=2, cqn_rcv=2, log_sq_size=6,
                            wq_umem_id=3, dbr_umem_id=4)
    assert bytes(buf[0:4]) == bytes([0x05, 0x00, 0, 0])
    assert buf[0x19] == 0 and buf[0x1a] == 0x18
    assert bytes(buf[0x1d:0x20]) == bytes([0xAB, 0xCD, 0xEF])
    assert buf[0x10c] == 0x80


IB_PATH = dict(rlid=0x1234, sl=3, vhca_port_num=1, ack_timeout=14, grh=0)
ROCE_PATH = dict(rgid_rip=bytes([0xfe, 0x80] + [0] * 6 + list(range(8))), grh=1, hop_limit=64,
                 src_addr_index=3, udp_sport=0xC000, vhca_port_num=1, dscp=26, ack_timeout=14)


@pytest.mark.parametrize("path", [IB_PATH, ROCE_PATH], ids=["ib", "roce"])
def test_init2rtr_encodes_peer_and_path(path):
    """INIT2RTR with the peer's QPN and PSN, MTU, responder resources and an IB (LID) or RoCE v2
    (GID) primary path: every given field decodes back, everything else is zero."""
    buf = prm.cmd_modify_qp("INIT2RTR", 0x000ABC, remote_qpn=0x123456, next_rcv_psn=0x654321,
                            mtu=prm.MLX5_QPC_MTU_4K_BYTES, log_rra_max=4, min_rnr_nak=12,
                            rre=1, rwe=1, rae=1, atomic_mode=prm.MLX5_ATOMIC_MODE_IB_COMP,
                            primary_address_path=path)
    assert buf == prm.cmd_modify_qp(prm.MLX5_CMD_OP_INIT2RTR_QP, 0x000ABC, remote_qpn=0x123456,
                                    next_rcv_psn=0x654321, mtu=prm.MLX5_QPC_MTU_4K_BYTES,
                                    log_rra_max=4, min_rnr_nak=12, rre=1, rwe=1, rae=1,
                                    atomic_mode=prm.MLX5_ATOMIC_MODE_IB_COMP,
                                    primary_address_path=path)
    want = {"opcode": prm.MLX5_CMD_OP_INIT2RTR_QP, "qpn": 0xABC, "qpc.remote_qpn": 0x123456,
            "qpc.next_rcv_psn": 0x654321, "qpc.mtu": 5, "qpc.log_rra_max": 4,
            "qpc.min_rnr_nak": 12, "qpc.rre": 1, "qpc.rwe": 1, "qpc.rae": 1,
            "qpc.atomic_mode": prm.MLX5_ATOMIC_MODE_IB_COMP}
    want.update({"qpc.primary_address_path." + k: v for k, v in path.items()})
    assert _nonzero(_decode_all(buf, "init2rtr_qp_in")) == _nonzero(want)
    assert bytes(buf[0:2]) == bytes([0x05, 0x03]) and bytes(buf[8:12]) == bytes([0, 0, 0x0A, 0xBC])


def test_rst2init_and_rtr2rts_encode_their_fields():
    """RST2INIT (port, access bits, pkey) and RTR2RTS (send PSN, retry counts, initiator depth)
    decode back to their arguments with their opcodes (0x502, 0x504)."""
    buf = prm.cmd_modify_qp("RST2INIT", 7, rre=1, rwe=1, rae=1,
                            primary_address_path=dict(vhca_port_num=1, pkey_index=0))
    assert _nonzero(_decode_all(buf, "rst2init_qp_in")) == {
        "opcode": 0x502, "qpn": 7, "qpc.rre": 1, "qpc.rwe": 1, "qpc.rae": 1,
        "qpc.primary_address_path.vhca_port_num": 1}
    buf = prm.cmd_modify_qp("RTR2RTS", 7, next_send_psn=0xFFFFFF, retry_count=7, rnr_retry=7,
                            log_sra_max=3, log_ack_req_freq=0,
                            primary_address_path=dict(ack_timeout=14))
    assert _nonzero(_decode_all(buf, "rtr2rts_qp_in")) == {
        "opcode": 0x504, "qpn": 7, "qpc.next_send_psn": 0xFFFFFF, "qpc.retry_count": 7,
        "qpc.rnr_retry": 7, "qpc.log_sra_max": 3, "qpc.primary_address_path.ack_timeout": 14}


@pytest.mark.parametrize("op,opcode,struct", [("2ERR", 0x507, "qp_2err_in"),
                                              ("2RST", 0x50a, "qp_2rst_in")])
def test_to_error_and_reset_carry_only_the_qpn(op, opcode, struct):
    """2ERR / 2RST: opcode and qpn, 16 bytes, nothing else; a qpc field is a ConfigError."""
    buf = prm.cmd_modify_qp(op, 0xFEDCBA)
    assert len(buf) == 16
    assert bytes(buf) == bytes([opcode >> 8, opcode & 0xFF, 0, 0, 0, 0, 0, 0,
                                0, 0xFE, 0xDC, 0xBA, 0, 0, 0, 0])
    assert _nonzero(_decode_all(buf, struct)) == {"opcode": opcode, "qpn": 0xFEDCBA}
    with pytest.raises(ConfigError, match="carries no qpc"):
        prm.cmd_modify_qp(op, 1, remote_qpn=2)


def test_modify_qp_refuses_unknown_moves_and_fields():
    """A move that is not a QP state move, or a qpc field prm does not know, is a ConfigError."""
    with pytest.raises(ConfigError, match="not a QP state move"):
        prm.cmd_modify_qp("RTS2SQD", 1)
    with pytest.raises(ConfigError, match="not a QP state move"):
        prm.cmd_modify_qp(prm.MLX5_CMD_OP_CREATE_QP, 1)
    with pytest.raises(ConfigError, match="remote_qpm"):
        prm.cmd_modify_qp("INIT2RTR", 1, remote_qpm=2)
    with pytest.raises(ConfigError):
        prm.cmd_modify_qp("INIT2RTR", 1 << 24)


def test_query_hca_cap_op_mod_and_reply_layout():
    """QUERY_HCA_CAP: opcode 0x100 in bytes 0-1, op_mod = cap type << 1 | current in bytes 6-7
    (atomic caps, current: 0x0007); the reply is 16 bytes of header + the 4 KiB capability union,
    whose atomic_caps.atomic_req_8B_endianness_mode is the top 2 bits of the union's byte 8
    (after 64 reserved bits): reply byte 0x18."""
    op_mod = prm.hca_cap_op_mod(prm.MLX5_SET_HCA_CAP_OP_MOD_ATOMIC, current=True)
    assert op_mod == 7
    assert prm.hca_cap_op_mod(prm.MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE, current=False) == 0
    buf = prm.cmd_query_hca_cap(op_mod)
    assert bytes(buf) == bytes([0x01, 0x00, 0, 0, 0, 0, 0x00, 0x07] + [0] * 8)
    assert prm.out_size(prm.MLX5_CMD_OP_QUERY_HCA_CAP) == 16 + 4096
    out = bytearray(prm.out_size(prm.MLX5_CMD_OP_QUERY_HCA_CAP))
    path = "capability.atomic_caps.atomic_req_8B_endianness_mode"
    off, width, _ = prm.offset("query_hca_cap_out", path)
    assert (off, width) == (0x80 + 0x40, 2)
    out[0x18] = 0x40                                    # mode 1 = host endianness
    assert prm.get(out, "query_hca_cap_out", path) == prm.ATOMIC_REQ_8B_ENDIANNESS_HOST


def test_command_status_and_output_sizes():
    """cmd_status reads status (byte 0) and syndrome (bytes 4-7) of any output; out_size gives
    each command's output length; an opcode without one is a ConfigError."""
    out = bytearray(prm.out_size(prm.MLX5_CMD_OP_CREATE_QP))
    assert len(out) == 16 and prm.cmd_status(out) == (prm.MLX5_CMD_STAT_OK, 0)
    out[0] = 0x03
    out[4:8] = bytes([0x12, 0x34, 0x56, 0x78])
    out[9:12] = bytes([0, 0x01, 0x02])
    assert prm.cmd_status(out) == (3, 0x12345678)
    assert prm.get(out, "create_qp_out", "qpn") == 0x102
    assert prm.out_size(prm.MLX5_CMD_OP_QUERY_QP) == prm.SIZES["query_qp_out"] // 8
    with pytest.raises(ConfigError):
        prm.out_size(0x7FF)


def test_small_commands():
    """QUERY_QP / QUERY_CQ / DESTROY_* / ALLOC_PD / DEALLOC_PD: opcode and object number only."""
    cases = [(prm.cmd_query_qp(0x42), "query_qp_in", 0x50b, "qpn"),
             (prm.cmd_query_cq(0x42), "query_cq_in", 0x402, "cqn"),
             (prm.cmd_destroy_qp(0x42), "destroy_qp_in", 0x501, "qpn"),
             (prm.cmd_destroy_cq(0x42), "destroy_cq_in", 0x401, "cqn"),
             (prm.cmd_dealloc_pd(0x42), "dealloc_pd_in", 0x801, "pd")]
    for buf, struct, opcode, field in cases:
        assert _nonzero(_decode_all(buf, struct)) == {"opcode": opcode, field: 0x42}, struct
    assert _nonzero(_decode_all(prm.cmd_alloc_pd(uid=5), "alloc_pd_in")) == {"opcode": 0x800,
                                                                              "uid": 5}
