"""The DevX NIC (gpunet/host/devx.py) without a NIC: DevxNic driven through tests/fake_devx.py, a
recording stand-in for rdma-core (a test double: not a model of a NIC, never used outside tests).

What these tests establish: the sequence of PRM commands DevxNic sends and every field it writes
(decoded with gpunet/host/prm.py, whose layouts tests/test_prm_oracle.py checks against the kernel's
mlx5_ifc.h) for CQ and QP creation and the three connection moves on IB and RoCE paths; the
release order; the factory's choices and errors; the fall-backs (UMEM refused in GPU memory, a
non-cached UAR refused, dma-buf refused, the UAR page not mappable into the GPU -> the proxy).
What they cannot establish: that a real ConnectX accepts these commands, or that its rings work.
None of this has run on a NIC.
"""
import logging
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fake_devx import GPU_BASE, MAC, ROCE_GIDS, FakeCudaPlatform, FakeDevx, fake_nic
from gpunet import mlx5
from gpunet.errors import ConfigError, GpunetError, ToolchainError
from gpunet.host import devx, prm
from gpunet.host.nic import Access, open_nic
from gpunet.host.platform import VendorRuntimeError
from gpunet.host.verbs import NoRdmaDeviceError


def qpc(buf, struct, field):
    return prm.get(buf, struct, "qpc." + field)


def path(buf, struct, field):
    return prm.get(buf, struct, "qpc.primary_address_path." + field)


def umem_at(fake, addr):
    """The UMEM id the fake registered at ``addr`` (exactly one)."""
    ids = [i for i, (a, _) in fake.umems.items() if a == addr]
    assert len(ids) == 1, (hex(addr), fake.umems)
    return ids[0]


def connected_pair(**kw):
    """Two fake DevX NICs, a CQ and a QP each, connected both ways: (a, fa, qa, b, fb, qb)."""
    a, fa = fake_nic(**kw)
    b, fb = fake_nic(**kw)
    qa = a.create_qp(a.create_cq(64), sq_wqebbs=64)
    qb = b.create_qp(b.create_cq(64), sq_wqebbs=64)
    a.connect(qa, qb.info())
    b.connect(qb, qa.info())
    return a, fa, qa, b, fb, qb


# --- opening: capabilities, atomic endianness, UAR -------------------------------------------------
@pytest.mark.parametrize("mode,name", [(prm.ATOMIC_REQ_8B_ENDIANNESS_HOST, "host"),
                                       (prm.ATOMIC_REQ_8B_ENDIANNESS_BIG, "big")])
def test_atomic_endianness_comes_from_the_current_atomic_caps(mode, name, caplog):
    """QUERY_HCA_CAP is sent for the general and the atomic caps with op_mod 'current'
    ((type << 1) | 1); atomic_req_8B_endianness_mode 1 -> nic.atomic_endianness "host", 0 ->
    "big", and a big-endian NIC says so in the log."""
    with caplog.at_level(logging.WARNING, logger="gpunet.devx"):
        nic, fake = fake_nic(fake_endianness=mode)
    with nic:
        ops = [prm.get(b, "query_hca_cap_in", "op_mod")
               for b in fake.sent(prm.MLX5_CMD_OP_QUERY_HCA_CAP)]
        assert ops[:2] == [prm.MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE << 1 | 1,
                           prm.MLX5_SET_HCA_CAP_OP_MOD_ATOMIC << 1 | 1]
        assert nic.atomic_endianness == name
        assert nic.caps["log_max_qp_sz"] == 15 and nic.caps["log_max_msg"] == 30
        said = "big-endian" in caplog.text
        assert said == (name == "big"), caplog.text


def test_a_non_cached_uar_is_tried_first_and_blueflame_when_it_is_refused(caplog):
    """uar="auto": NC first; where it is refused the NIC takes a BlueFlame UAR and logs why;
    uar="nc" refused is a clear UarError; "bf" asks for BlueFlame only."""
    nic, fake = fake_nic()
    with nic:
        assert nic.uar_type == "nc" and [c for c in fake.calls if c[0] == "alloc_uar"] == \
            [("alloc_uar", "NC")]
    with caplog.at_level(logging.INFO, logger="gpunet.devx"):
        nic, fake = fake_nic(fake_refuse_nc_uar=True)
    with nic:
        assert nic.uar_type == "bf" and "non-cached UAR was refused" in caplog.text
    with pytest.raises(devx.UarError, match="no UAR could be allocated"):
        fake_nic(uar="nc", fake_refuse_nc_uar=True)
    with pytest.raises(devx.UarError):
        fake_nic(fake_refuse_uar=True)
    nic, fake = fake_nic(uar="bf")
    with nic:
        assert nic.uar_type == "bf"


def test_a_failed_open_releases_what_it_made():
    """A UAR refusal after the context and PD were made: both are released (PD first), nothing
    leaks."""
    fake = FakeDevx(refuse_uar=True)
    from gpunet.host.platform import Platform
    with pytest.raises(devx.UarError):
        devx.DevxNic(backend=fake, platform=Platform("cpu"), arena_bytes=1 << 20)
    assert [k for k, _ in fake.closed] == ["pd", "ctx"]


# --- CREATE_CQ ----------------------------------------------------------------------------------
def test_create_cq_owner_bit_mode_fields():
    """CREATE_CQ for an owner-bit CQ: opcode, UMEM ids of the ring and of the doorbell record
    (each registered at exactly the address the CQ object reports), log size, the UAR page, the
    EQN, 64-byte CQEs, cc = oi = 0; every op_own of the ring is 0xF0 before the NIC sees it."""
    nic, fake = fake_nic()
    with nic:
        cq = nic.create_cq(cqe_cnt=256)
        (cmd,) = fake.sent(prm.MLX5_CMD_OP_CREATE_CQ)
        g = lambda f: prm.get(cmd, "create_cq_in", f)            # noqa: E731
        c = lambda f: prm.get(cmd, "create_cq_in", "cq_context." + f)  # noqa: E731
        assert g("opcode") == prm.MLX5_CMD_OP_CREATE_CQ
        assert g("cq_umem_valid") == 1 and g("cq_umem_id") == umem_at(fake, cq.buf_addr)
        assert g("cq_umem_offset") == 0
        assert c("dbr_umem_valid") == 1 and c("dbr_umem_id") == umem_at(fake, cq.dbrec_addr)
        assert c("dbr_addr") == 0
        assert c("log_cq_size") == 8 and c("uar_page") == nic.uar.page_id and \
            c("c_eqn_or_apu_element") == 5
        assert c("cqe_sz") == prm.MLX5_CQC_CQE_SZ_64_BYTES and c("cc") == 0 and c("oi") == 0
        assert c("log_page_size") == 0 and cq.buf_addr % devx.PAGE == 0
        assert cq.cqn == 0x40 and cq.cqe_cnt == 256 and not cq.collapsed
        assert (cq.buf[mlx5.CQE_OP_OWN::mlx5.CQE_SIZE] == mlx5.CQE_OP_OWN_INIT).all()
        base, size = nic.mapped_ranges()[0]
        for addr, n in ((cq.buf_addr, 256 * 64), (cq.dbrec_addr, 8)):
            assert base <= addr and addr + n <= base + size


def test_create_cq_collapsed_sets_cc_and_oi_on_one_slot():
    """A collapsed CQ: one 64-byte slot (log_cq_size 0), cc = 1 (every CQE in entry 0) and oi = 1
    (overrun is not an error); a NIC without cq_oi refuses it with ConfigError."""
    nic, fake = fake_nic()
    with nic:
        cq = nic.create_cq(collapsed=True)
        (cmd,) = fake.sent(prm.MLX5_CMD_OP_CREATE_CQ)
        c = lambda f: prm.get(cmd, "create_cq_in", "cq_context." + f)  # noqa: E731
        assert (c("cc"), c("oi"), c("log_cq_size")) == (1, 1, 0)
        assert cq.collapsed and cq.cqe_cnt == 1 and cq.buf[mlx5.CQE_OP_OWN] == 0xF0
    nic, fake = fake_nic(fake_cq_oi=0)
    with nic, pytest.raises(ConfigError, match="overrun-ignore"):
        nic.create_cq(collapsed=True)


def test_queue_sizes_are_checked_against_the_caps():
    """A CQ or SQ larger than the HCA's log_max_*_sz, or not a power of two, is a ConfigError."""
    nic, _ = fake_nic(fake_log_max_cq_sz=6, fake_log_max_qp_sz=7)
    with nic:
        with pytest.raises(ConfigError, match="exceeds"):
            nic.create_cq(128)
        with pytest.raises(ConfigError, match="power of two"):
            nic.create_cq(100)
        cq = nic.create_cq(64)
        with pytest.raises(ConfigError, match="sq_wqebbs"):
            nic.create_qp(cq, sq_wqebbs=256)
        nic.create_qp(cq, sq_wqebbs=128)


# --- CREATE_QP ----------------------------------------------------------------------------------
def test_create_qp_fields_rc_our_ring_no_rq():
    """CREATE_QP: RC, migrated, the PD number, the UAR page, log_sq_size, a zero-length RQ and an
    SQ, both CQNs, log_msg_max from the caps, the ring's and the doorbell record's UMEM ids, the
    QP timestamp format the kernel would pick (DEFAULT where RoCE caps name one); the QP's
    doorbell is the UAR's register."""
    nic, fake = fake_nic()
    with nic:
        scq, rcq = nic.create_cq(64), nic.create_cq(64)
        qp = nic.create_qp(scq, rcq, sq_wqebbs=512)
        (cmd,) = fake.sent(prm.MLX5_CMD_OP_CREATE_QP)
        s = "create_qp_in"
        assert prm.get(cmd, s, "opcode") == prm.MLX5_CMD_OP_CREATE_QP
        assert qpc(cmd, s, "st") == prm.MLX5_QPC_ST_RC
        assert qpc(cmd, s, "pm_state") == prm.MLX5_QPC_PM_STATE_MIGRATED
        assert qpc(cmd, s, "pd") == nic.default_pd.pdn == 0x11
        assert qpc(cmd, s, "uar_page") == nic.uar.page_id
        assert qpc(cmd, s, "log_sq_size") == 9 and qpc(cmd, s, "no_sq") == 0
        assert qpc(cmd, s, "rq_type") == prm.MLX5_ZERO_LEN_RQ and qpc(cmd, s, "log_rq_size") == 0
        assert (qpc(cmd, s, "cqn_snd"), qpc(cmd, s, "cqn_rcv")) == (scq.cqn, rcq.cqn)
        assert qpc(cmd, s, "log_msg_max") == 30
        assert qpc(cmd, s, "ts_format") == prm.MLX5_TIMESTAMP_FORMAT_DEFAULT
        assert prm.get(cmd, s, "wq_umem_valid") == 1
        assert prm.get(cmd, s, "wq_umem_id") == umem_at(fake, qp.sq_addr)
        assert qpc(cmd, s, "dbr_umem_valid") == 1
        assert qpc(cmd, s, "dbr_umem_id") == umem_at(fake, qp.dbrec_addr)
        assert qp.qpn == 0x200 and qp.db_addr == nic.uar.reg_addr
        assert qp.sq.nbytes == 512 * 64 and qp.sq_addr % devx.PAGE == 0
        assert nic.qp_state(qp) == "RESET"
    nic, fake = fake_nic(fake_qp_ts_format=0)
    with nic:
        nic.create_qp(nic.create_cq(64))
        (cmd,) = fake.sent(prm.MLX5_CMD_OP_CREATE_QP)
        assert qpc(cmd, "create_qp_in", "ts_format") == prm.MLX5_TIMESTAMP_FORMAT_FREE_RUNNING


# --- connection: the three moves --------------------------------------------------------------
def test_connect_on_infiniband_sends_the_three_moves_with_the_peers_lid_qpn_psn():
    """IB: RST2INIT (port, rre / rwe / rae, the atomic mode), INIT2RTR (MTU = the smaller port
    MTU, the peer's QPN and PSN as next_rcv_psn, its LID, no GRH, log_msg_max, min_rnr_nak,
    log_rra_max), RTR2RTS (our PSN, retry counts 7, the ACK timeout from retry_timeout_s,
    log_sra_max); QUERY_QP then says RTS. info() pickles."""
    a, fa = fake_nic(retry_timeout_s=1.0)
    b, fb = fake_nic(fake_lid=9, fake_active_mtu=3)
    with a, b:
        qa, qb = a.create_qp(a.create_cq(64)), b.create_qp(b.create_cq(64))
        info = pickle.loads(pickle.dumps(qb.info()))
        a.connect(qa, info)
        ops = [op for _, op, _ in fa.commands if op not in (prm.MLX5_CMD_OP_QUERY_HCA_CAP,)]
        assert ops == [prm.MLX5_CMD_OP_CREATE_CQ, prm.MLX5_CMD_OP_CREATE_QP,
                       prm.MLX5_CMD_OP_RST2INIT_QP, prm.MLX5_CMD_OP_INIT2RTR_QP,
                       prm.MLX5_CMD_OP_RTR2RTS_QP]
        (r2i,) = fa.sent(prm.MLX5_CMD_OP_RST2INIT_QP)
        s = "rst2init_qp_in"
        assert prm.get(r2i, s, "qpn") == qa.qpn
        assert (qpc(r2i, s, "rre"), qpc(r2i, s, "rwe"), qpc(r2i, s, "rae")) == (1, 1, 1)
        assert qpc(r2i, s, "atomic_mode") == prm.MLX5_ATOMIC_MODE_IB_COMP
        assert path(r2i, s, "vhca_port_num") == 1
        (i2r,) = fa.sent(prm.MLX5_CMD_OP_INIT2RTR_QP)
        s = "init2rtr_qp_in"
        assert prm.get(i2r, s, "qpn") == qa.qpn
        assert qpc(i2r, s, "mtu") == prm.MLX5_QPC_MTU_1K_BYTES        # min(4096, 1024)
        assert qpc(i2r, s, "remote_qpn") == qb.qpn
        assert qpc(i2r, s, "next_rcv_psn") == qb.psn
        assert qpc(i2r, s, "log_msg_max") == 30 and qpc(i2r, s, "min_rnr_nak") == devx.MIN_RNR_NAK
        assert qpc(i2r, s, "log_rra_max") == 4
        assert path(i2r, s, "rlid") == 9 and path(i2r, s, "grh") == 0
        assert path(i2r, s, "vhca_port_num") == 1
        assert prm.get_bytes(i2r, "init2rtr_qp_in", "qpc.primary_address_path.rgid_rip") == \
            bytes(16)
        (r2r,) = fa.sent(prm.MLX5_CMD_OP_RTR2RTS_QP)
        s = "rtr2rts_qp_in"
        assert qpc(r2r, s, "next_send_psn") == qa.psn
        assert (qpc(r2r, s, "retry_count"), qpc(r2r, s, "rnr_retry")) == (7, 7)
        assert qpc(r2r, s, "log_sra_max") == 4
        assert path(r2r, s, "ack_timeout") == devx.ack_timeout_for(1.0) == 14
        assert a.qp_state(qa) == "RTS"


def test_connect_on_roce_uses_the_v2_gid_the_mac_and_grh():
    """RoCE: the NIC picks the IPv4-mapped RoCE v2 GID (index 3 of the fake table); INIT2RTR's
    path carries the peer's GID bytes, its MAC (rmac_47_32 / rmac_31_0), our GID index, GRH, hop
    limit 64 and a UDP source port in 0xC000-0xFFFF; no LID."""
    a, fa, qa, b, fb, qb = connected_pair(fake_link_layer="Ethernet")
    with a, b:
        assert a.gid_index == 3 and a.gid == ROCE_GIDS[3][1] and a.mac == MAC
        (i2r,) = fa.sent(prm.MLX5_CMD_OP_INIT2RTR_QP)
        s = "init2rtr_qp_in"
        assert prm.get_bytes(i2r, s, "qpc.primary_address_path.rgid_rip") == b.gid
        mac = int.from_bytes(MAC, "big")
        assert path(i2r, s, "rmac_47_32") == mac >> 32
        assert path(i2r, s, "rmac_31_0") == mac & 0xFFFFFFFF
        assert path(i2r, s, "src_addr_index") == 3 and path(i2r, s, "grh") == 1
        assert path(i2r, s, "hop_limit") == devx.HOP_LIMIT and path(i2r, s, "rlid") == 0
        assert 0xC000 <= path(i2r, s, "udp_sport") <= 0xFFFF
        assert a.qp_state(qa) == b.qp_state(qb) == "RTS"


def test_connect_refuses_a_foreign_or_mismatched_peer():
    """connect() with something that is not a DevX QP's info(), or a peer on the other link
    layer, is a ConfigError before any command is sent."""
    a, fa = fake_nic()
    b, _ = fake_nic(fake_link_layer="Ethernet")
    with a, b:
        qa, qb = a.create_qp(a.create_cq(64)), b.create_qp(b.create_cq(64))
        with pytest.raises(ConfigError, match="info"):
            a.connect(qa, {"arena": "x", "qpn": 1})
        with pytest.raises(ConfigError, match="link layer"):
            a.connect(qa, qb.info())
        assert fa.sent(prm.MLX5_CMD_OP_RST2INIT_QP) == []


def test_atomic_mode_follows_the_caps_like_the_kernel():
    """Extended atomics with 8-byte QP atomics -> atomic_mode 8B; plain CS + FA -> IB_COMP; no
    atomics -> 0 and rae 0, logged."""
    for ops, mode in ((0xF, prm.MLX5_ATOMIC_MODE_8B), (0x3, prm.MLX5_ATOMIC_MODE_IB_COMP)):
        nic, _ = fake_nic(fake_atomic_operations=ops)
        with nic:
            assert nic.atomic_mode == mode
    a, fa, qa, b, fb, qb = connected_pair(fake_atomic=0)
    with a, b:
        (r2i,) = fa.sent(prm.MLX5_CMD_OP_RST2INIT_QP)
        assert a.atomic_mode == 0 and qpc(r2i, "rst2init_qp_in", "rae") == 0


def test_ack_timeout_keeps_all_tries_within_the_retry_timeout():
    """For retry timeouts 5 ms .. 60 s: (retry_count + 1) tries of 4.096 us * 2**t fit in the
    timeout, and t is the largest such (down to the floor of 8)."""
    for s in (0.005, 0.05, 0.5, 1.0, 2.0, 10.0, 60.0):
        t = devx.ack_timeout_for(s)
        total = lambda t: (devx.RETRY_COUNT + 1) * 4.096e-6 * 2 ** t  # noqa: E731
        assert 8 <= t <= 31
        assert t == 8 or (total(t) <= s < total(t + 1)), (s, t)


# --- errors and reset -----------------------------------------------------------------------------
def test_error_syndrome_is_read_from_the_error_cqe_in_the_send_cq():
    """In ERR, qp_error_syndrome is the syndrome of the QP's first non-flush REQ_ERR CQE in the send
    CQ (flush CQEs of the same QP and other QPs' errors ignored); 0 while RTS."""
    a, fa, qa, b, fb, qb = connected_pair()
    with a, b:
        assert a.qp_error_syndrome(qa) == 0
        buf = qa.send_cq.buf
        mlx5.write_cqe(buf, 0, mlx5.CQE_REQ_ERR, qa.qpn + 1, 0, 0, 0, 0,
                       mlx5.SYNDROME_REMOTE_ACCESS_ERR, 0, 0)
        mlx5.write_cqe(buf, 64, mlx5.CQE_REQ_ERR, qa.qpn, 1, 0, 0, 0,
                       mlx5.SYNDROME_LOCAL_PROT_ERR, 0, 0)
        mlx5.write_cqe(buf, 128, mlx5.CQE_REQ_ERR, qa.qpn, 2, 0, 0, 0,
                       mlx5.SYNDROME_WR_FLUSH_ERR, 0, 0)
        fa.qp_state[qa.qpn] = prm.MLX5_QPC_STATE_ERR
        assert a.qp_state(qa) == "ERR"
        assert a.qp_error_syndrome(qa) == mlx5.SYNDROME_LOCAL_PROT_ERR


def test_reset_qp_moves_to_error_resets_and_reconnects_returning_the_cq_producer_index():
    """reset_qp from RTS: 2ERR, then (the CQ quiet) 2RST, the doorbell record cleared, and
    RST2INIT / INIT2RTR / RTR2RTS with the same peer; it returns the send CQ's producer index as the
    ring shows it (3 CQEs written from consumer index 0 -> 3) and the QP is RTS again."""
    a, fa, qa, b, fb, qb = connected_pair()
    with a, b:
        buf = qa.send_cq.buf
        for i in range(3):
            mlx5.write_cqe(buf, i * 64, mlx5.CQE_REQ, qa.qpn, i, 0, 0, 0, 0, 0, 0)
        qa.dbrec[:] = 0xAB
        n0 = len(fa.commands)
        assert a.reset_qp(qa, timeout_s=5.0) == 3
        ops = [op for _, op, _ in fa.commands[n0:] if op != prm.MLX5_CMD_OP_QUERY_QP]
        assert ops == [prm.MLX5_CMD_OP_2ERR_QP, prm.MLX5_CMD_OP_2RST_QP,
                       prm.MLX5_CMD_OP_RST2INIT_QP, prm.MLX5_CMD_OP_INIT2RTR_QP,
                       prm.MLX5_CMD_OP_RTR2RTS_QP]
        assert (qa.dbrec == 0).all() and a.qp_state(qa) == "RTS"
        r2i = fa.sent(prm.MLX5_CMD_OP_INIT2RTR_QP)[-1]
        assert qpc(r2i, "init2rtr_qp_in", "remote_qpn") == qb.qpn
        # a reset that failed part-way (here: after RST2INIT) is retried from where it stopped
        fa.qp_state[qa.qpn] = prm.MLX5_QPC_STATE_INIT
        n0 = len(fa.commands)
        assert a.reset_qp(qa, timeout_s=5.0) == 3
        ops = [op for _, op, _ in fa.commands[n0:] if op != prm.MLX5_CMD_OP_QUERY_QP]
        assert ops == [prm.MLX5_CMD_OP_2RST_QP, prm.MLX5_CMD_OP_RST2INIT_QP,
                       prm.MLX5_CMD_OP_INIT2RTR_QP, prm.MLX5_CMD_OP_RTR2RTS_QP]
        assert a.qp_state(qa) == "RTS"
        fa.qp_state[qa.qpn] = prm.MLX5_QPC_STATE_SQD
        with pytest.raises(ConfigError, match="not RTS or ERR"):
            a.reset_qp(qa)


def test_a_failed_command_raises_with_its_opcode_and_errno():
    """A modify the firmware refuses (the fake: a move from the wrong state) raises
    DevxCommandError naming the command and the errno; nothing is retried silently."""
    a, fa, qa, b, fb, qb = connected_pair()
    with a, b:
        with pytest.raises(devx.DevxCommandError, match="RST2INIT_QP") as ei:
            a.connect(qa, qb.info())                # already RTS
        assert ei.value.opcode == prm.MLX5_CMD_OP_RST2INIT_QP and ei.value.errno == 121


# --- release order ------------------------------------------------------------------------------
def test_close_releases_in_rdma_cores_devx_order():
    """close(): every QP, then every CQ, then the UAR, the UMEMs, the MRs, the PD, the context
    (rdma-core's Mlx5DevxRcResources order, then the verbs objects); a second close does
    nothing; a closed NIC refuses work with ClosedError."""
    nic, fake = fake_nic()
    cqs = [nic.create_cq(64) for _ in range(2)]
    for cq in cqs:
        nic.create_qp(cq)
    nic.reg_mr(nic.alloc(4096), access=Access.ALL)
    nic.close()
    kinds = [k for k, _ in fake.closed]
    order = ["qp", "cq", "uar", "umem", "mr", "pd", "ctx"]
    assert kinds == sorted(kinds, key=order.index), kinds
    assert kinds.count("qp") == 2 and kinds.count("cq") == 2 and kinds.count("umem") == 8
    nic.close()
    assert len(fake.closed) == len(kinds)
    with pytest.raises(GpunetError, match="closed"):
        nic.create_cq(64)


# --- the factory ----------------------------------------------------------------------------------
@pytest.fixture
def backend(monkeypatch):
    """Point open_nic's DevX layer at a FakeDevx built from the test's options."""
    made = []

    def use(**kw):
        monkeypatch.setattr(devx, "BACKEND", lambda: made.append(FakeDevx(**kw)) or made[-1])
        return made
    return use


def test_open_nic_verbs_returns_a_devx_nic_and_auto_prefers_it(backend):
    """open_nic("verbs") and ("auto") return the DevX NIC when the layer below sees a device
    DevX opens."""
    backend()
    for kind in ("verbs", "auto"):
        with open_nic(kind, arena_bytes=1 << 20) as nic:
            assert isinstance(nic, devx.DevxNic) and nic.device == "mlx5_0"


def test_open_nic_without_a_device(backend):
    """No device: "verbs" raises NoRdmaDeviceError saying use nic='soft'; "auto" opens the soft
    NIC."""
    backend(devices=())
    with pytest.raises(NoRdmaDeviceError, match="use nic='soft'"):
        open_nic("verbs")
    with open_nic("auto", arena_bytes=1 << 20) as nic:
        assert not isinstance(nic, devx.DevxNic)


def test_open_nic_on_a_device_without_devx(backend, caplog):
    """A device DevX cannot open: "verbs" raises NoDevxError explaining what DevX needs; "auto"
    warns and opens the soft NIC."""
    backend(devx=False)
    with pytest.raises(devx.NoDevxError, match="mlx5 DevX failed.*use nic='soft'"):
        open_nic("verbs")
    with caplog.at_level(logging.WARNING, logger="gpunet"):
        with open_nic("auto", arena_bytes=1 << 20) as nic:
            assert not isinstance(nic, devx.DevxNic)
    assert "using the soft NIC" in caplog.text and "DevX" in caplog.text


def test_open_nic_without_pyverbs(monkeypatch):
    """pyverbs missing: "verbs" raises the ToolchainError naming python3-pyverbs, "auto" is
    quietly soft."""
    def missing():
        raise ToolchainError("pyverbs (rdma-core's Python bindings) is missing: install "
                             "python3-pyverbs")
    monkeypatch.setattr(devx, "BACKEND", missing)
    with pytest.raises(ToolchainError, match="python3-pyverbs"):
        open_nic("verbs")
    with open_nic("auto", arena_bytes=1 << 20) as nic:
        assert not isinstance(nic, devx.DevxNic)


def test_device_choice():
    """A named device that is absent is a NoRdmaDeviceError listing those present."""
    with pytest.raises(NoRdmaDeviceError, match="mlx5_0, mlx5_1"):
        fake_nic(device="mlx5_7", fake_devices=("mlx5_0", "mlx5_1"))
    nic, fake = fake_nic(device="mlx5_1", fake_devices=("mlx5_0", "mlx5_1"))
    with nic:
        assert ("open", "mlx5_1") in fake.calls


# --- rings in GPU memory --------------------------------------------------------------------------
def test_umem_refused_in_gpu_memory_moves_the_ring_to_host_memory_and_logs_why(caplog):
    """CUDA, rings asked for in device memory, DevX refusing UMEM at GPU addresses: the CQ ring
    and its doorbell record live in host memory (host views exist, inside mapped_ranges), the GPU
    allocations are freed, the log and ring_placement say why."""
    plat = FakeCudaPlatform()
    with caplog.at_level(logging.WARNING, logger="gpunet.devx"):
        nic, fake = fake_nic(platform=plat, ring_kind="device", fake_refuse_gpu_umem=True)
        with nic:
            cq = nic.create_cq(64)
            (base, size), = nic.mapped_ranges()
            for addr in (cq.buf_addr, cq.dbrec_addr):
                assert base <= addr < base + size
            assert cq.buf is not None and cq.dbrec is not None
            assert nic.ring_placement["cq"][0] == "host"
            assert "refused UMEM in device memory" in nic.ring_placement["cq"][1]
            assert len(plat.freed) == 2 and set(plat.mem) == set(plat.freed)
            refused = [c for c in fake.calls if c[0] == "umem_reg" and c[1] in plat.mem]
            assert len(refused) == 2
    assert "refused UMEM in device memory" in caplog.text


def test_umem_accepted_in_gpu_memory_keeps_the_ring_there():
    """Where DevX accepts GPU UMEM the CQ ring is GPU memory (no host view), initialised to
    op_own 0xF0 through the platform's memcpy, and registered as UMEM at its GPU address."""
    plat = FakeCudaPlatform()
    nic, fake = fake_nic(platform=plat, ring_kind="device")
    with nic:
        cq = nic.create_cq(16)
        assert cq.buf is None and cq.buf_addr in plat.mem
        ring = plat.mem[cq.buf_addr]
        assert all(ring[i * 64 + 63] == 0xF0 for i in range(16))
        assert umem_at(fake, cq.buf_addr) > 0
        assert nic.ring_placement["cq"] == ("device", "accepted by DevX")
    assert cq.buf_addr in plat.freed


def test_rings_stay_in_host_memory_on_the_c500_profile():
    """The c500 profile refuses GPU rings outright (Mooncake's finding), before trying DevX."""
    nic, fake = fake_nic(platform=FakeCudaPlatform(profile="c500"), ring_kind="device")
    with nic, pytest.raises(ConfigError, match="Mooncake"):
        nic.create_cq(16)


# --- registration -----------------------------------------------------------------------------
def test_reg_mr_host_memory_is_plain_ibv_reg_mr():
    """Host memory (the arena, or any kind on the CPU platform) registers with ibv_reg_mr at its
    address, length and access flags; dereg_mr releases it once."""
    nic, fake = fake_nic()
    with nic:
        buf = nic.alloc(8192, 4096)
        mr = nic.reg_mr(buf, access=Access.LOCAL_WRITE | Access.REMOTE_WRITE, kind="device")
        assert ("reg_mr", buf.ctypes.data, 8192, 3) in fake.calls and mr.how == "ibv_reg_mr"
        assert (mr.lkey, mr.rkey) != (0, 0)
        nic.dereg_mr(mr)
        nic.dereg_mr(mr)
        assert [k for k, _ in fake.closed] == ["mr"]


def test_reg_mr_gpu_memory_uses_dma_buf_then_peer_memory_then_a_clear_error():
    """GPU memory on CUDA: a dma-buf export and ibv_reg_dmabuf_mr at iova = the GPU address and
    the export's offset (the fd closed afterwards); export refused -> plain ibv_reg_mr (a
    peer-memory driver); both refused -> RegistrationError naming both."""
    import os
    plat = FakeCudaPlatform()
    nic, fake = fake_nic(platform=plat)
    with nic:
        a = plat.alloc("device", 1 << 16)
        mr = nic.reg_mr(a.ptr + 100, 4000, kind="device")
        (call,) = [c for c in fake.calls if c[0] == "reg_dmabuf_mr"]
        fd = plat.dmabufs[0][0]
        assert call[1:4] == (100, 4000, a.ptr + 100) and call[4] == fd and mr.how == "dma-buf"
        with pytest.raises(OSError):
            os.fstat(fd)                                 # closed after registration
        plat.refuse_dmabuf = True
        mr = nic.reg_mr(a.ptr, 4096, kind="finegrained")
        assert mr.how == "peer memory" and ("reg_mr", a.ptr, 4096, 15) in fake.calls

        def refuse(*args):
            raise devx.DevxCallError("ibv_reg_mr", 14)
        fake.reg_mr = refuse
        with pytest.raises(devx.RegistrationError, match="dma-buf export.*ibv_reg_mr"):
            nic.reg_mr(a.ptr, 4096, kind="device")


def test_reg_mr_of_device_memory_takes_the_gpu_path_or_a_clear_error():
    """``device_memory=True`` (the Context's CUDA heap) registers as GPU memory whatever the kind
    says: dma-buf (iova = the GPU address), even with kind "host"; where nothing accepts it,
    RegistrationError, a ConfigError; a range inside the NIC's host arena or on the CPU platform
    is a ConfigError, never a plain host registration."""
    plat = FakeCudaPlatform()
    nic, fake = fake_nic(platform=plat)
    with nic:
        a = plat.alloc("device", 1 << 16)
        mr = nic.reg_mr(a.ptr, 1 << 16, kind="host", device_memory=True)
        (call,) = [c for c in fake.calls if c[0] == "reg_dmabuf_mr"]
        assert call[3] == a.ptr and mr.how == "dma-buf", (call, mr)
        plat.refuse_dmabuf = True

        def refuse(*args):
            raise devx.DevxCallError("ibv_reg_mr", 14)
        fake.reg_mr = refuse
        with pytest.raises(ConfigError, match="dma-buf export.*ibv_reg_mr") as e:
            nic.reg_mr(a.ptr, 1 << 16, kind="device", device_memory=True)
        assert isinstance(e.value, devx.RegistrationError)
        buf = nic.alloc(8192, 4096)
        with pytest.raises(ConfigError, match="inside the NIC's host arena"):
            nic.reg_mr(buf.ctypes.data, 8192, kind="device", device_memory=True)
    cpu_nic, _ = fake_nic()
    with cpu_nic, pytest.raises(ConfigError, match="on the CPU platform"):
        cpu_nic.reg_mr(0x7f0000000000, 4096, kind="device", device_memory=True)


# --- the doorbell in the GPU's reach -------------------------------------------------------------
def test_uar_not_mappable_makes_auto_pick_the_proxy_with_the_reason():
    """map_doorbell registers the UAR page with the GPU as IoMemory; a driver refusing it (error
    800) raises VendorRuntimeError, and choose_transport("auto") then picks the proxy and says
    why; transport="ibgda" is a ConfigError."""
    from gpunet.transports import choose_transport
    plat = FakeCudaPlatform(refuse_io=True)
    nic, _ = fake_nic(platform=plat)
    with nic:
        with pytest.raises(VendorRuntimeError):
            nic.map_doorbell(plat)
        page = nic.uar.base_addr & ~(devx.PAGE - 1)
        assert plat.registered[-1] == (page, devx.PAGE, True)
        kind, why = choose_transport("auto", lambda: nic.map_doorbell(plat))
        assert kind == "proxy" and "code 800" in why and "cudaHostRegister" in why
        with pytest.raises(ConfigError, match="driver refused"):
            choose_transport("ibgda", lambda: nic.map_doorbell(plat))
        assert nic.io_ranges() == []


def test_uar_mapped_makes_auto_pick_ibgda_and_close_unregisters_it_first():
    """A mappable UAR page: auto picks ibgda, the description names the doorbell's device
    address (page mapping + reg_addr offset), io_ranges lists the page; close unregisters it
    before any rdma-core object is released."""
    from gpunet.transports import choose_transport
    plat = FakeCudaPlatform()
    nic, fake = fake_nic(platform=plat)
    kind, why = choose_transport("auto", lambda: nic.map_doorbell(plat))
    page = nic.uar.base_addr & ~(devx.PAGE - 1)
    (rng,) = nic.io_ranges()
    assert kind == "ibgda" and hex(rng[2] + nic.uar.reg_addr - page) in why
    assert rng[:2] == (page, devx.PAGE)
    nic.map_doorbell(plat)
    assert len(plat.registered) == 1                     # mapped once
    nic.close()
    assert plat.unregistered == [page]
    assert nic.map_doorbell.__doc__ and fake.closed      # everything released after


def test_a_descriptor_built_after_the_mapping_reaches_the_uar():
    """The Context's order on a GPU over a DevX NIC (gpunet/context.py: NicMapping of the NIC's
    arena first, then Transports, whose doorbell probe maps the UAR page, then the ibgda
    descriptors in device memory): every QpDesc's ``db`` is the UAR register's device address
    (the page's mapping + reg_addr's offset in it) and its rings translate through the arena's
    registration. Before map_doorbell the same address raises ValueError naming map_doorbell
    (the UAR is not in mapped_ranges); close unregisters the arena and the UAR page once each."""
    from gpunet.device.abi import QpDesc
    from gpunet.device.descriptors import DeviceContext, DeviceMemory, NicMapping
    from gpunet.transports import Transports
    plat = FakeCudaPlatform()
    nic, _ = fake_nic(platform=plat)
    with nic:
        mapping = NicMapping(plat, nic)
        mem = DeviceMemory(plat)
        uar_page = nic.uar.base_addr & ~(devx.PAGE - 1)
        with pytest.raises(ValueError, match="map_doorbell"):
            mapping.g(nic.uar.reg_addr)
        # ibgda by name: "auto" on CUDA would settle on p2p for this rank itself
        t = Transports(nic, plat, 0, 1, "ibgda", lambda: nic.map_doorbell(plat))
        assert t.kinds == {0: "ibgda"}, t.reasons
        heap = nic.alloc(1 << 16, 4096)
        mr = nic.reg_mr(heap)
        dev = DeviceContext(heap.ctypes.data, heap.nbytes, mr.lkey, 1, 0, heap.ctypes.data + 4096,
                            16, heap.ctypes.data + 8192, 1.0, mem=mem)
        everyone = [dict(t.info(), heap=heap.ctypes.data, rkey=mr.rkey)]
        t.connect(everyone, dev, (heap.ctypes.data, mr.lkey), mem=mem, mapping=mapping)
        (io_page, io_n, io_dptr), = nic.io_ranges()
        assert (io_page, io_n) == (uar_page, devx.PAGE)
        (arena, arena_n, arena_dptr), = mapping.ranges
        qpd = t.qpds[0]
        d = mem.get(QpDesc(), qpd.addr)                  # what the device reads
        qp = qpd.qp
        assert qp.db_addr == nic.uar.reg_addr
        assert d.db == io_dptr + (nic.uar.reg_addr - uar_page) != nic.uar.reg_addr
        assert d.sq == arena_dptr + (qp.sq_addr - arena) and arena <= qp.sq_addr < arena + arena_n
        assert d.dbrec == arena_dptr + (qp.dbrec_addr - arena)
        assert d.cq.buf == arena_dptr + (qp.send_cq.buf_addr - arena)
        with pytest.raises(ValueError, match="not inside"):
            mapping.g(uar_page + devx.PAGE)              # one past the UAR page
        t.close()
        mem.close()
        mapping.close()
    assert sorted(plat.unregistered) == sorted([arena, uar_page])
    assert [r for r in plat.registered if r[2]] == [(uar_page, devx.PAGE, True)]


def test_cpu_platform_doorbell_needs_no_mapping():
    """On the CPU platform map_doorbell maps nothing (rdma-core mapped the page into this
    process) and says so."""
    from gpunet.host.platform import Platform
    nic, _ = fake_nic()
    with nic:
        assert "mapped into this process" in nic.map_doorbell(Platform("cpu"))
        assert nic.io_ranges() == []


# --- the real layer's names -------------------------------------------------------------------------
def test_the_pyverbs_layer_names_exist_in_the_installed_pyverbs():
    """Every pyverbs class, method and enum PyverbsDevx calls exists in the installed pyverbs
    (Debian's python3-pyverbs, rdma-core 44), and libibverbs exports ibv_reg_dmabuf_mr: the part
    of the real path that can be checked without a NIC."""
    import ctypes
    import ctypes.util
    from gpunet.host import verbs
    if not verbs.have_pyverbs():
        pytest.skip("pyverbs is not installed (python3-pyverbs)")
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.providers.mlx5 import mlx5_enums as dve
    from pyverbs.providers.mlx5 import mlx5dv as dv
    from pyverbs.providers.mlx5.mlx5dv_objects import Mlx5DvObj
    import pyverbs.enums as e
    for cls, names in ((dv.Mlx5Context, ("devx_general_cmd", "devx_query_eqn", "query_port",
                                         "query_gid", "query_gid_type", "close")),
                       (dv.Mlx5DevxObj, ("modify", "query", "out_view", "close")),
                       (dv.Mlx5UAR, ("page_id", "reg_addr", "base_addr", "close")),
                       (dv.Mlx5UMEM, ("umem_id", "close")), (Mlx5DvObj, ("dvpd",)),
                       (MR, ("lkey", "rkey", "close")), (PD, ("pd", "close"))):
        for n in names:
            assert hasattr(cls, n), (cls, n)
    assert dv.Mlx5DVContextAttr and dve.MLX5DV_CONTEXT_FLAGS_DEVX and dve.MLX5DV_OBJ_PD
    assert (dve._MLX5DV_UAR_ALLOC_TYPE_BF, dve._MLX5DV_UAR_ALLOC_TYPE_NC) == (0, 1)
    assert e.IBV_LINK_LAYER_ETHERNET and e.IBV_GID_TYPE_SYSFS_ROCE_V2 is not None
    lib = ctypes.CDLL(ctypes.util.find_library("ibverbs") or "libibverbs.so.1")
    assert lib.ibv_reg_dmabuf_mr and lib.ibv_dereg_mr


def test_the_real_layer_reports_no_device_here():
    """PyverbsDevx for real on this host (no RDMA device): DevxNic raises NoRdmaDeviceError."""
    from gpunet.host import verbs
    if not verbs.have_pyverbs():
        pytest.skip("pyverbs is not installed (python3-pyverbs)")
    if verbs.available_devices():
        pytest.skip("this host has an RDMA device")
    with pytest.raises(NoRdmaDeviceError, match="use nic='soft'"):
        devx.DevxNic(arena_bytes=1 << 20)


def test_wqes_posted_by_the_host_land_in_the_devx_ring_as_in_the_soft_nics():
    """gpunet/host/wq.py posts into a DevX QP's ring exactly the bytes gpunet/mlx5.py builds: the ring is
    ordinary memory at sq_addr with the QP's number (nothing above the Nic interface differs)."""
    from gpunet.host import wq
    nic, _ = fake_nic()
    with nic:
        qp = nic.create_qp(nic.create_cq(64), sq_wqebbs=64)
        assert wq.post_rdma(qp.sq_addr, qp.sq_wqebbs, 5, qp.qpn, mlx5.OPCODE_RDMA_WRITE,
                            mlx5.WQE_CTRL_CQ_UPDATE, 0x1000, 7, 0x2000, 9, 64, 0) == 1
        ref = np.zeros(64, np.uint8)
        mlx5.build_rdma(ref, 0, 5, qp.qpn, mlx5.OPCODE_RDMA_WRITE, mlx5.WQE_CTRL_CQ_UPDATE,
                        0x1000, 7, 0x2000, 9, 64, 0)
        assert (qp.sq[5 * 64:6 * 64] == ref).all()


def test_gpu_umem_probe_reports_what_devx_says():
    """umem_in_gpu_memory (what gpunet doctor shows): None on the CPU platform; on CUDA a probe
    that registers 4 KiB of device memory as UMEM once and frees it: True where accepted, False
    where refused."""
    nic, _ = fake_nic()
    with nic:
        assert nic.devx is True and nic.umem_in_gpu_memory is None
    for refuse in (False, True):
        plat = FakeCudaPlatform()
        nic, fake = fake_nic(platform=plat, fake_refuse_gpu_umem=refuse)
        with nic:
            assert nic.umem_in_gpu_memory is (not refuse)
            assert nic.umem_in_gpu_memory is (not refuse)          # probed once
            assert len([c for c in fake.calls if c[0] == "umem_reg" and c[1] in plat.mem]) == 1
            assert set(plat.freed) == set(plat.mem)


_peer = st.fixed_dictionaries({
    "qpn": st.integers(1, (1 << 24) - 1), "psn": st.integers(0, (1 << 24) - 1),
    "lid": st.integers(1, 0xBFFF), "mtu": st.integers(1, 5),
    "gid": st.binary(min_size=16, max_size=16).map(bytes.hex),
    "mac": st.binary(min_size=6, max_size=6).map(bytes.hex)})


@pytest.mark.parametrize("link", ["IB", "Ethernet"])
def test_init2rtr_and_rtr2rts_carry_any_peer_exactly(link):
    """Generated: peers with any 24-bit QPN and PSN, any unicast LID, MTU code, GID and MAC, and
    retry timeouts 1 ms .. 100 s. Invariant: the INIT2RTR / RTR2RTS commands decode (prm.get) to
    exactly the peer's QPN, PSN, MTU (min with ours), LID (IB) or GID + MAC (RoCE), our PSN and
    the ACK timeout ack_timeout_for gives; the fake QP ends in RTS."""
    nic, fake = fake_nic(fake_link_layer=link, arena_bytes=16 << 20)
    cq = nic.create_cq(16)

    @settings(max_examples=max(10, settings().max_examples // 2))
    @given(peer=_peer, retry=st.floats(1e-3, 100.0))
    def check(peer, retry):
        nic.retry_timeout_s = retry
        qp = nic.create_qp(cq, sq_wqebbs=8)
        nic.connect(qp, dict(peer, link_layer=link))
        i2r = fake.sent(prm.MLX5_CMD_OP_INIT2RTR_QP)[-1]
        r2r = fake.sent(prm.MLX5_CMD_OP_RTR2RTS_QP)[-1]
        s = "init2rtr_qp_in"
        assert prm.get(i2r, s, "qpn") == prm.get(r2r, "rtr2rts_qp_in", "qpn") == qp.qpn
        assert qpc(i2r, s, "remote_qpn") == peer["qpn"]
        assert qpc(i2r, s, "next_rcv_psn") == peer["psn"]
        assert qpc(i2r, s, "mtu") == min(peer["mtu"], nic.active_mtu)
        if link == "IB":
            assert path(i2r, s, "rlid") == peer["lid"] and path(i2r, s, "grh") == 0
        else:
            assert prm.get_bytes(i2r, s, "qpc.primary_address_path.rgid_rip").hex() == peer["gid"]
            mac = int(peer["mac"], 16)
            assert (path(i2r, s, "rmac_47_32") << 32 | path(i2r, s, "rmac_31_0")) == mac
            assert path(i2r, s, "rlid") == 0 and path(i2r, s, "grh") == 1
        assert qpc(r2r, "rtr2rts_qp_in", "next_send_psn") == qp.psn
        assert path(r2r, "rtr2rts_qp_in", "ack_timeout") == devx.ack_timeout_for(retry)
        assert nic.qp_state(qp) == "RTS"

    with nic:
        check()
