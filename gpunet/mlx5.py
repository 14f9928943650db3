"""The mlx5 wire format: WQE segments, CQEs and doorbell records. The single source of truth.

Names and values are those of the mlx5 PRM as rdma-core spells them (providers/mlx5/mlx5dv.h,
installed by Debian's libibverbs-dev as /usr/include/infiniband/mlx5dv.h); tests/test_mlx5_oracle.py
compiles a C program against that header and checks every offset, value and builder byte for byte.
``gpunet/device/include/gpunet/mlx5.cuh`` mirrors this module for device code.

Every builder and parser takes ``(buf, off, ...)`` where ``buf`` is a 1-D ``np.uint8`` array and
``off`` a byte offset, and is a numba function (``host/rawmem.wire_njit``): callable from Python
and from nopython code (the soft NIC and the proxy engine use the very same functions). From
Python every field takes its full unsigned range (a 64-bit field any int in 0 .. 2**64 - 1, a
narrower one its low bits), whatever was called before in the process. All multi-byte fields are
big-endian unless a comment says otherwise.
"""
import numpy as np

from gpunet.host.rawmem import wire_njit   # Python calls pass ints as 64-bit patterns (see there)

# --- sizes -------------------------------------------------------------------------------------
WQEBB = 64                 # WQE basic block: the unit of the send queue ring
DS_UNIT = 16               # ds counts 16-byte units
CTRL_SEG_SIZE = 16
RADDR_SEG_SIZE = 16
DATA_SEG_SIZE = 16
ATOMIC_SEG_SIZE = 16
INLINE_HDR_SIZE = 4        # the inline segment's byte_count word; data follows it directly
CQE_SIZE = 64
MAX_DS = 63                # ds is 6 bits wide in qpn_ds' low byte usage (<= 63 * 16 = 1008 B)

# --- WQE opcodes (MLX5_OPCODE_*) ----------------------------------------------------------------
OPCODE_NOP = 0x00
OPCODE_RDMA_WRITE = 0x08
OPCODE_RDMA_WRITE_IMM = 0x09
OPCODE_SEND = 0x0A
OPCODE_SEND_IMM = 0x0B
OPCODE_RDMA_READ = 0x10
OPCODE_ATOMIC_CS = 0x11
OPCODE_ATOMIC_FA = 0x12
OPCODE_ATOMIC_MASKED_CS = 0x14
OPCODE_ATOMIC_MASKED_FA = 0x15

# --- ctrl segment fm_ce_se flags (MLX5_WQE_CTRL_*) -------------------------------------------------
WQE_CTRL_CQ_UPDATE = 0x08
WQE_CTRL_SOLICITED = 0x02
WQE_CTRL_FENCE = 0x80
WQE_CTRL_INITIATOR_SMALL_FENCE = 0x20

INLINE_SEG = 0x80000000    # MLX5_INLINE_SEG: set in an inline segment's byte_count

# --- ctrl segment field offsets (struct mlx5_wqe_ctrl_seg, packed) ------------------------------
CTRL_OPMOD_IDX_OPCODE = 0
CTRL_QPN_DS = 4
CTRL_SIGNATURE = 8
CTRL_DCI_STREAM_CHANNEL_ID = 9
CTRL_FM_CE_SE = 11
CTRL_IMM = 12

# --- CQE (struct mlx5_cqe64 / struct mlx5_err_cqe) --------------------------------------------
CQE_SRQN_UIDX = 32
CQE_IMM_INVAL_PKEY = 36
CQE_BYTE_CNT = 44
CQE_TIMESTAMP = 48
CQE_VENDOR_ERR_SYND = 54   # mlx5_err_cqe
CQE_SYNDROME = 55          # mlx5_err_cqe
CQE_SOP_DROP_QPN = 56      # mlx5_cqe64; in mlx5_err_cqe the same word is s_wqe_opcode_qpn
CQE_WQE_COUNTER = 60
CQE_SIGNATURE = 62
CQE_OP_OWN = 63

CQE_REQ = 0
CQE_RESP_WR_IMM = 1
CQE_RESP_SEND = 2
CQE_RESP_SEND_IMM = 3
CQE_REQ_ERR = 13
CQE_RESP_ERR = 14
CQE_INVALID = 15
CQE_OP_OWN_INIT = 0xF0     # rdma-core fills every op_own with this at CQ creation

# --- error CQE syndromes (MLX5_CQE_SYNDROME_*) ----------------------------------------------------
SYNDROME_LOCAL_LENGTH_ERR = 0x01
SYNDROME_LOCAL_QP_OP_ERR = 0x02
SYNDROME_LOCAL_PROT_ERR = 0x04
SYNDROME_WR_FLUSH_ERR = 0x05
SYNDROME_MW_BIND_ERR = 0x06
SYNDROME_BAD_RESP_ERR = 0x10
SYNDROME_LOCAL_ACCESS_ERR = 0x11
SYNDROME_REMOTE_INVAL_REQ_ERR = 0x12
SYNDROME_REMOTE_ACCESS_ERR = 0x13
SYNDROME_REMOTE_OP_ERR = 0x14
SYNDROME_TRANSPORT_RETRY_EXC_ERR = 0x15
SYNDROME_RNR_RETRY_EXC_ERR = 0x16
SYNDROME_REMOTE_ABORTED_ERR = 0x22

SYNDROME_NAMES = {
    SYNDROME_LOCAL_LENGTH_ERR: "local length error",
    SYNDROME_LOCAL_QP_OP_ERR: "local QP operation error",
    SYNDROME_LOCAL_PROT_ERR: "local protection error",
    SYNDROME_WR_FLUSH_ERR: "work request flushed",
    SYNDROME_MW_BIND_ERR: "memory window bind error",
    SYNDROME_BAD_RESP_ERR: "bad response",
    SYNDROME_LOCAL_ACCESS_ERR: "local access error",
    SYNDROME_REMOTE_INVAL_REQ_ERR: "remote invalid request",
    SYNDROME_REMOTE_ACCESS_ERR: "remote access error",
    SYNDROME_REMOTE_OP_ERR: "remote operation error",
    SYNDROME_TRANSPORT_RETRY_EXC_ERR: "transport retry counter exceeded",
    SYNDROME_RNR_RETRY_EXC_ERR: "RNR retry counter exceeded",
    SYNDROME_REMOTE_ABORTED_ERR: "remote aborted",
}

# --- doorbell records and the UAR ---------------------------------------------------------------
DBREC_RCV = 0              # dbrec[0]: receive queue counter (and the CQ consumer index for a CQ)
DBREC_SND = 1              # dbrec[1]: send queue producer index, 16 bits, big-endian
DBREC_SIZE = 8             # two 32-bit words
UAR_BF_REG_OFFSET = 0x800  # the doorbell register: UAR page base + 0x800 (rdma-core reg_addr)
BF_SIZE = 256              # rdma-core alternates reg_addr ^= bf size between doorbells

# per-opcode ds (16-byte units) for the fixed-size WQEs
DS_RDMA = 3                # ctrl + raddr + data
DS_ATOMIC = 4              # ctrl + raddr + atomic + data(8 B)
DS_NOP = 1


def syndrome_name(syndrome):
    """A readable name for an error-CQE syndrome."""
    return SYNDROME_NAMES.get(int(syndrome), "unknown syndrome 0x%02x" % int(syndrome))


# --- byte-order helpers (numba and Python) ------------------------------------------------------
@wire_njit(cache=True, inline="always")
def put_be16(buf, off, v):
    buf[off] = (v >> 8) & 0xFF
    buf[off + 1] = v & 0xFF


@wire_njit(cache=True, inline="always")
def put_be32(buf, off, v):
    buf[off] = (v >> 24) & 0xFF
    buf[off + 1] = (v >> 16) & 0xFF
    buf[off + 2] = (v >> 8) & 0xFF
    buf[off + 3] = v & 0xFF


@wire_njit(cache=True, inline="always")
def put_be64(buf, off, v):
    v = np.uint64(v)
    for i in range(8):
        buf[off + i] = np.uint8((v >> np.uint64(56 - 8 * i)) & np.uint64(0xFF))


@wire_njit(cache=True, inline="always")
def put_le32(buf, off, v):
    buf[off] = v & 0xFF
    buf[off + 1] = (v >> 8) & 0xFF
    buf[off + 2] = (v >> 16) & 0xFF
    buf[off + 3] = (v >> 24) & 0xFF


@wire_njit(cache=True, inline="always")
def get_be16(buf, off):
    return (np.uint32(buf[off]) << 8) | np.uint32(buf[off + 1])


@wire_njit(cache=True, inline="always")
def get_be32(buf, off):
    return ((np.uint32(buf[off]) << 24) | (np.uint32(buf[off + 1]) << 16)
            | (np.uint32(buf[off + 2]) << 8) | np.uint32(buf[off + 3]))


@wire_njit(cache=True, inline="always")
def get_be64(buf, off):
    v = np.uint64(0)
    for i in range(8):
        v = (v << np.uint64(8)) | np.uint64(buf[off + i])
    return v


@wire_njit(cache=True, inline="always")
def get_le32(buf, off):
    return ((np.uint32(buf[off + 3]) << 24) | (np.uint32(buf[off + 2]) << 16)
            | (np.uint32(buf[off + 1]) << 8) | np.uint32(buf[off]))


@wire_njit(cache=True, inline="always")
def bswap32(v):
    """Byte-swap a 32-bit value (htobe32 on a little-endian host)."""
    v = np.uint32(v)
    return np.uint32(((v & np.uint32(0xFF)) << np.uint32(24)) | ((v & np.uint32(0xFF00)) << np.uint32(8))
                     | ((v >> np.uint32(8)) & np.uint32(0xFF00)) | (v >> np.uint32(24)))


# --- WQE arithmetic -----------------------------------------------------------------------------
@wire_njit(cache=True, inline="always")
def wqebb_count(ds):
    """WQEBBs a WQE of ``ds`` 16-byte units occupies: the producer-index advance."""
    return (ds * DS_UNIT + WQEBB - 1) // WQEBB


@wire_njit(cache=True, inline="always")
def inline_ds(nbytes):
    """ds of an RDMA WRITE whose payload of ``nbytes`` is carried inline (ctrl + raddr + inline)."""
    return 2 + (INLINE_HDR_SIZE + nbytes + DS_UNIT - 1) // DS_UNIT


# --- segment builders ----------------------------------------------------------------------------
@wire_njit(cache=True, inline="always")
def set_ctrl_seg(buf, off, pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm):
    """struct mlx5_wqe_ctrl_seg, as mlx5dv_set_ctrl_seg fills it.

    ``pi`` is the WQE index (16 bits are kept); ``imm`` is stored as the four bytes given, in host
    (little-endian) order, exactly like rdma-core: pass ``bswap32(v)`` to carry immediate ``v``.
    dci_stream_channel_id is left as it was (rdma-core does not touch it either).
    """
    put_be32(buf, off + CTRL_OPMOD_IDX_OPCODE,
             ((opmod & 0xFF) << 24) | ((pi & 0xFFFF) << 8) | (opcode & 0xFF))
    put_be32(buf, off + CTRL_QPN_DS, ((qpn & 0xFFFFFF) << 8) | (ds & 0xFF))
    buf[off + CTRL_SIGNATURE] = signature & 0xFF
    buf[off + CTRL_FM_CE_SE] = fm_ce_se & 0xFF
    put_le32(buf, off + CTRL_IMM, imm)


@wire_njit(cache=True, inline="always")
def set_raddr_seg(buf, off, raddr, rkey):
    """struct mlx5_wqe_raddr_seg: raddr be64, rkey be32, reserved."""
    put_be64(buf, off, raddr)
    put_be32(buf, off + 8, rkey)
    put_be32(buf, off + 12, 0)


@wire_njit(cache=True, inline="always")
def set_data_seg(buf, off, byte_count, lkey, addr):
    """struct mlx5_wqe_data_seg, as mlx5dv_set_data_seg fills it."""
    put_be32(buf, off, byte_count)
    put_be32(buf, off + 4, lkey)
    put_be64(buf, off + 8, addr)


@wire_njit(cache=True, inline="always")
def set_atomic_seg(buf, off, swap_add, compare):
    """struct mlx5_wqe_atomic_seg: fetch-add puts the addend in swap_add."""
    put_be64(buf, off, swap_add)
    put_be64(buf, off + 8, compare)


@wire_njit(cache=True)
def set_inline_hdr(buf, off, nbytes):
    """struct mlx5_wqe_inl_data_seg: byte_count = len | MLX5_INLINE_SEG; the data follows it."""
    put_be32(buf, off, (nbytes & 0x7FFFFFFF) | INLINE_SEG)


# --- whole WQEs ---------------------------------------------------------------------------------
# Each returns the WQEBBs written. ``off`` is the byte offset of the WQE's first WQEBB in ``buf``;
# callers that post into a ring make sure the WQE does not cross the ring's end (mlx5 rings wrap
# per WQEBB: use ``write_wqe_wrapped`` for WQEs of more than one WQEBB).

# build_rdma / build_atomic and their segment setters are inline="always": the proxy's drain
# (gpunet/host/proxy.py) builds one WQE per command, and a numba call costs more than the build.
@wire_njit(cache=True, inline="always")
def build_rdma(buf, off, pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey, nbytes, imm):
    """RDMA WRITE / WRITE_WITH_IMM / READ with one data segment (ds = 3, one WQEBB)."""
    set_ctrl_seg(buf, off, pi, opcode, 0, qpn, fm_ce_se, DS_RDMA, 0, imm)
    set_raddr_seg(buf, off + CTRL_SEG_SIZE, raddr, rkey)
    set_data_seg(buf, off + CTRL_SEG_SIZE + RADDR_SEG_SIZE, nbytes, lkey, laddr)
    return 1


@wire_njit(cache=True, inline="always")
def build_atomic(buf, off, pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey, swap_add, compare):
    """8-byte ATOMIC fetch-add (OPCODE_ATOMIC_FA) or compare-swap (OPCODE_ATOMIC_CS), ds = 4.

    The old remote value is written to ``laddr`` (8 bytes, big-endian as the wire carries it).
    """
    set_ctrl_seg(buf, off, pi, opcode, 0, qpn, fm_ce_se, DS_ATOMIC, 0, 0)
    set_raddr_seg(buf, off + CTRL_SEG_SIZE, raddr, rkey)
    set_atomic_seg(buf, off + CTRL_SEG_SIZE + RADDR_SEG_SIZE, swap_add, compare)
    set_data_seg(buf, off + CTRL_SEG_SIZE + RADDR_SEG_SIZE + ATOMIC_SEG_SIZE, 8, lkey, laddr)
    return 1


@wire_njit(cache=True)
def build_nop(buf, off, pi, qpn, fm_ce_se):
    """NOP (ds = 1): completes without moving data; useful to request a CQE."""
    set_ctrl_seg(buf, off, pi, OPCODE_NOP, 0, qpn, fm_ce_se, DS_NOP, 0, 0)
    return 1


@wire_njit(cache=True)
def build_write_inline(ring, ring_wqebbs, pi, qpn, opcode, fm_ce_se, raddr, rkey, data, imm):
    """RDMA WRITE (or WRITE_WITH_IMM) carrying ``data`` (uint8 array) inline, into a ring.

    ``ring`` is the whole SQ (ring_wqebbs * 64 bytes); the WQE starts at WQEBB ``pi`` and wraps
    per WQEBB at the ring's end. Returns the WQEBBs used.
    """
    n = data.shape[0]
    ds = inline_ds(n)
    nbb = wqebb_count(ds)
    tmp = np.zeros(nbb * WQEBB, dtype=np.uint8)
    set_ctrl_seg(tmp, 0, pi, opcode, 0, qpn, fm_ce_se, ds, 0, imm)
    set_raddr_seg(tmp, CTRL_SEG_SIZE, raddr, rkey)
    set_inline_hdr(tmp, CTRL_SEG_SIZE + RADDR_SEG_SIZE, n)
    base = CTRL_SEG_SIZE + RADDR_SEG_SIZE + INLINE_HDR_SIZE
    for i in range(n):
        tmp[base + i] = data[i]
    write_wqe_wrapped(ring, ring_wqebbs, pi, tmp, nbb)
    return nbb


@wire_njit(cache=True)
def write_wqe_wrapped(ring, ring_wqebbs, pi, wqe, nbb):
    """Copy ``nbb`` WQEBBs of ``wqe`` into the ring at producer index ``pi``, wrapping per WQEBB."""
    mask = ring_wqebbs - 1
    for b in range(nbb):
        dst = ((pi + b) & mask) * WQEBB
        for i in range(WQEBB):
            ring[dst + i] = wqe[b * WQEBB + i]


# --- WQE parsing (the NIC side) -----------------------------------------------------------------
@wire_njit(cache=True, inline="always")
def ctrl_opcode(buf, off):
    return buf[off + 3]


@wire_njit(cache=True, inline="always")
def ctrl_opmod(buf, off):
    return buf[off]


@wire_njit(cache=True, inline="always")
def ctrl_wqe_index(buf, off):
    return get_be16(buf, off + 1)


@wire_njit(cache=True, inline="always")
def ctrl_qpn(buf, off):
    return get_be32(buf, off + CTRL_QPN_DS) >> 8


@wire_njit(cache=True, inline="always")
def ctrl_ds(buf, off):
    return buf[off + CTRL_QPN_DS + 3]


@wire_njit(cache=True, inline="always")
def ctrl_fm_ce_se(buf, off):
    return buf[off + CTRL_FM_CE_SE]


@wire_njit(cache=True, inline="always")
def ctrl_imm_raw(buf, off):
    """The ctrl segment's immediate as stored (a CQE's imm_raw carries it unchanged)."""
    return get_le32(buf, off + CTRL_IMM)


@wire_njit(cache=True, inline="always")
def raddr_seg_raddr(buf, off):
    """struct mlx5_wqe_raddr_seg at ``off``: the remote address."""
    return get_be64(buf, off)


@wire_njit(cache=True, inline="always")
def raddr_seg_rkey(buf, off):
    return get_be32(buf, off + 8)


@wire_njit(cache=True, inline="always")
def data_seg_byte_count(buf, off):
    """struct mlx5_wqe_data_seg at ``off``: byte_count (an inline segment's header word has the
    same place and INLINE_SEG set)."""
    return get_be32(buf, off)


@wire_njit(cache=True, inline="always")
def data_seg_lkey(buf, off):
    return get_be32(buf, off + 4)


@wire_njit(cache=True, inline="always")
def data_seg_addr(buf, off):
    return get_be64(buf, off + 8)


@wire_njit(cache=True, inline="always")
def atomic_seg_swap_add(buf, off):
    """struct mlx5_wqe_atomic_seg at ``off``: swap_add (the fetch-add's addend)."""
    return get_be64(buf, off)


@wire_njit(cache=True, inline="always")
def atomic_seg_compare(buf, off):
    return get_be64(buf, off + 8)


# --- CQEs --------------------------------------------------------------------------------------
@wire_njit(cache=True)
def init_cq(cq_buf, cqe_cnt):
    """Initialise a CQ ring as rdma-core does: every op_own = 0xF0 (opcode INVALID, owner 0)."""
    for i in range(cqe_cnt):
        cq_buf[i * CQE_SIZE + CQE_OP_OWN] = CQE_OP_OWN_INIT


@wire_njit(cache=True)
def write_cqe(buf, off, opcode, qpn, wqe_counter, byte_cnt, imm_raw, owner,
              syndrome, vendor_syndrome, wqe_opcode):
    """Fill one 64-byte CQE and publish it: every field first, op_own (opcode | owner) last.

    For an error CQE (CQE_REQ_ERR / CQE_RESP_ERR) the syndrome bytes are set and the QPN word is
    ``s_wqe_opcode_qpn`` (the failed WQE's opcode in its top byte); ``imm_raw`` is the ctrl
    segment's imm word copied as is (responder-with-immediate CQEs carry it in imm_inval_pkey).
    """
    for i in range(CQE_SIZE - 1):
        buf[off + i] = 0
    put_le32(buf, off + CQE_IMM_INVAL_PKEY, imm_raw)
    put_be32(buf, off + CQE_BYTE_CNT, byte_cnt)
    if opcode == CQE_REQ_ERR or opcode == CQE_RESP_ERR:
        buf[off + CQE_VENDOR_ERR_SYND] = vendor_syndrome & 0xFF
        buf[off + CQE_SYNDROME] = syndrome & 0xFF
        put_be32(buf, off + CQE_SOP_DROP_QPN, ((wqe_opcode & 0xFF) << 24) | (qpn & 0xFFFFFF))
    else:
        put_be32(buf, off + CQE_SOP_DROP_QPN, qpn & 0xFFFFFF)
    put_be16(buf, off + CQE_WQE_COUNTER, wqe_counter & 0xFFFF)
    buf[off + CQE_OP_OWN] = ((opcode & 0xF) << 4) | (owner & 1)


@wire_njit(cache=True, inline="always")
def cqe_opcode(buf, off):
    return buf[off + CQE_OP_OWN] >> 4


@wire_njit(cache=True, inline="always")
def cqe_owner(buf, off):
    return buf[off + CQE_OP_OWN] & 1


@wire_njit(cache=True, inline="always")
def cqe_qpn(buf, off):
    return get_be32(buf, off + CQE_SOP_DROP_QPN) & 0xFFFFFF


@wire_njit(cache=True, inline="always")
def cqe_wqe_counter(buf, off):
    return get_be16(buf, off + CQE_WQE_COUNTER)


@wire_njit(cache=True, inline="always")
def cqe_byte_cnt(buf, off):
    return get_be32(buf, off + CQE_BYTE_CNT)


@wire_njit(cache=True, inline="always")
def cqe_syndrome(buf, off):
    return buf[off + CQE_SYNDROME]


@wire_njit(cache=True, inline="always")
def cqe_vendor_syndrome(buf, off):
    return buf[off + CQE_VENDOR_ERR_SYND]


@wire_njit(cache=True, inline="always")
def cqe_imm_raw(buf, off):
    """The immediate as the ctrl segment carried it (host order of the wire bytes)."""
    return get_le32(buf, off + CQE_IMM_INVAL_PKEY)


@wire_njit(cache=True, inline="always")
def cqe_is_valid(buf, off, ci, cqe_cnt):
    """Owner-bit CQ: the CQE at consumer index ``ci`` is the NIC's new entry.

    Valid iff opcode != INVALID and owner bit == !!(ci & cqe_cnt) (rdma-core's rule).
    """
    op_own = buf[off + CQE_OP_OWN]
    owner_expected = 1 if (ci & cqe_cnt) != 0 else 0
    return (op_own >> 4) != CQE_INVALID and (op_own & 1) == owner_expected


# --- doorbell records ---------------------------------------------------------------------------
@wire_njit(cache=True, inline="always")
def set_sq_dbrec(dbrec, off, sq_pi):
    """Send doorbell record: dbrec[1] = htobe32(sq_pi & 0xffff)."""
    put_be32(dbrec, off + 4 * DBREC_SND, sq_pi & 0xFFFF)


@wire_njit(cache=True, inline="always")
def get_sq_dbrec(dbrec, off):
    return get_be32(dbrec, off + 4 * DBREC_SND) & 0xFFFF


@wire_njit(cache=True, inline="always")
def set_cq_dbrec(dbrec, off, ci):
    """CQ doorbell record: dbrec[0] = htobe32(ci & 0xffffff)."""
    put_be32(dbrec, off + 4 * DBREC_RCV, ci & 0xFFFFFF)


@wire_njit(cache=True, inline="always")
def get_cq_dbrec(dbrec, off):
    return get_be32(dbrec, off + 4 * DBREC_RCV) & 0xFFFFFF


@wire_njit(cache=True, inline="always")
def doorbell_word(buf, off):
    """The 64-bit value rung on the UAR: the first 8 bytes of the WQE's ctrl segment, as bytes.

    Returned as the little-endian integer those 8 bytes form in memory, so that storing it with a
    plain 64-bit store on the host reproduces the bytes.
    """
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(buf[off + i]) << np.uint64(8 * i)
    return v


@wire_njit(cache=True, inline="always")
def doorbell_wqe_index(word):
    """The WQE index carried by a doorbell word (bytes 1..2 of the ctrl segment, big-endian)."""
    return ((word >> np.uint64(8)) & np.uint64(0xFF)) << np.uint64(8) | ((word >> np.uint64(16)) & np.uint64(0xFF))
