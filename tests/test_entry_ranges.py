"""Every Python entry into numba code takes the full unsigned range of its field, whatever was
called before it in the process (gpunet/host/rawmem.py's wire_njit rule), and the API's atomics take
negative operands.

numba compiles one specialization per argument type, in the order calls arrive, and keeps them in
a per-process table and an on-disk cache: so each order runs in a FRESH process, once with an
empty numba cache and once with the cache the other order left behind (a warm cache must not
hide, or create, an order dependence). Each entry is called with the boundary values
0, 2**31, 2**32 - 1, 2**63, 2**64 - 1 in every integer field it has, and what it wrote or returned
is checked against a plain-Python reference of the wire format (mod the field's width).

Run as a script (what the tests do): ``python tests/test_entry_ranges.py asc|desc`` prints a JSON
list of failures.
"""
import json
import os
import subprocess
import sys

import pytest

BOUNDARY = [0, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
M16, M24, M32, M64 = (1 << 16) - 1, (1 << 24) - 1, (1 << 32) - 1, (1 << 64) - 1


# ---- plain-Python references of the wire format (mod the field width) --------------------------
def be(v, n):
    return list((v % (1 << (8 * n))).to_bytes(n, "big"))


def le(v, n):
    return list((v % (1 << (8 * n))).to_bytes(n, "little"))


def ref_ctrl(pi, opcode, opmod, qpn, fm, ds, signature, imm):
    """struct mlx5_wqe_ctrl_seg (mlx5dv_set_ctrl_seg); dci_stream_channel_id left zero."""
    return (be(((opmod & 0xFF) << 24) | ((pi & M16) << 8) | (opcode & 0xFF), 4)
            + be(((qpn & M24) << 8) | (ds & 0xFF), 4) + [signature & 0xFF, 0, 0, fm & 0xFF]
            + le(imm, 4))


def ref_raddr(raddr, rkey):
    return be(raddr, 8) + be(rkey, 4) + [0] * 4


def ref_data(byte_count, lkey, addr):
    return be(byte_count, 4) + be(lkey, 4) + be(addr, 8)


def ref_rdma(pi, qpn, opcode, fm, raddr, rkey, laddr, lkey, nbytes, imm):
    return (ref_ctrl(pi, opcode, 0, qpn, fm, 3, 0, imm) + ref_raddr(raddr, rkey)
            + ref_data(nbytes, lkey, laddr))


def ref_atomic(pi, qpn, opcode, fm, raddr, rkey, laddr, lkey, swap_add, compare):
    return (ref_ctrl(pi, opcode, 0, qpn, fm, 4, 0, 0) + ref_raddr(raddr, rkey)
            + be(swap_add, 8) + be(compare, 8) + ref_data(8, lkey, laddr))


# ---- the entries: each returns (what the entry produced, what the reference says) ---------------
def entries():
    """name -> check(v): every integer field of the entry gets v (fields that size or index a
    buffer get a valid value instead: those are lengths, not wire fields)."""
    import numpy as np

    from gpunet import mlx5
    from gpunet.host import proxy as P
    from gpunet.host import rawmem, wq

    def buf(n=64):
        return np.zeros(n, np.uint8)

    def wrote(fn, n, *args):
        b = buf(n)
        fn(b, 0, *args)
        return b.tolist()

    ring = rawmem.aligned_zeros(4 * mlx5.WQEBB)
    src = rawmem.aligned_zeros(64)
    src[:8] = np.arange(1, 9, dtype=np.uint8)

    def posted(fn, *args):
        ring[:] = 0
        fn(ring.ctypes.data, 4, *args)
        return ring.tolist()

    def slot(pi, wqe):          # the ring after one WQE at producer index pi (4-WQEBB ring)
        r = [0] * (4 * mlx5.WQEBB)
        o = (pi % 4) * mlx5.WQEBB
        r[o:o + len(wqe)] = wqe
        return r

    def cqe(v):
        b = buf()
        mlx5.write_cqe(b, 0, mlx5.CQE_REQ_ERR, v, v, v, v, v, v, v, v)
        c = wq.decode_cqe(b)
        return ((c.qpn, c.wqe_counter, c.byte_cnt, c.imm_raw, c.syndrome, c.vendor_syndrome,
                 c.wqe_opcode, b[63] & 1),
                (v & M24, v & M16, v & M32, v & M32, v & 0xFF, v & 0xFF, v & 0xFF, v & 1))

    def dbrec(v):
        b = buf(8)
        mlx5.set_sq_dbrec(b, 0, v)
        mlx5.set_cq_dbrec(b, 0, v)
        return (int(mlx5.get_sq_dbrec(b, 0)), int(mlx5.get_cq_dbrec(b, 0))), (v & M16, v & M24)

    def inline(v):
        ring[:] = 0
        n = wq.post_write_inline(ring.ctypes.data, 4, v, v, mlx5.OPCODE_RDMA_WRITE, v, v, v,
                                 src.ctypes.data, 8, v)
        # ctrl + raddr + 4-byte inline header + 8 bytes = 44: ds 3 (48 bytes, 4 zero bytes of pad)
        body = ref_ctrl(v, mlx5.OPCODE_RDMA_WRITE, 0, v, v, 3, 0, v) + ref_raddr(v, v) \
            + be(8 | mlx5.INLINE_SEG, 4) + list(range(1, 9)) + [0] * 4
        return (int(n), ring.tolist()), (1, slot(v, body))

    def decoded(w0, w1):
        d = P.decode(w0, w1)
        return d

    def encode(v):
        w0, w1 = P.encode(P.OP_PUT, v, v, v, v)
        d = decoded(w0, w1)
        return ((d["op"], d["peer"], d["arg"], d["local_off"], d["remote_off"], int(w0) >> 63),
                (P.OP_PUT, v & P.PEER_MASK, v & M32, v & P.MAX_OFFSET, v & P.MAX_OFFSET, 0))

    def encode_signal(v):
        w0, w1 = P.encode_signal(P.OP_SIGNAL_ADD, v, v, v)
        d = decoded(w0, w1)
        return ((d["peer"], d["value"], d["remote_off"]),
                (v & P.PEER_MASK, v, v & P.MAX_OFFSET))

    def cmd_fields(v):
        got = (int(P.cmd_op(v)), int(P.cmd_peer(v)), int(P.cmd_arg(v)), int(P.cmd_local_off(v, v)),
               int(P.cmd_remote_off(v, v)), int(P.cmd_signal_value(v, v)), int(P.valid_bit(v, 3)))
        d = P.decode(v, v)
        want = (d["op"], d["peer"], d["arg"], d["local_off"], d["remote_off"],
                ((v << 32) | (v & M32)) & M64, ((v >> 3) & 1) ^ 1)
        return got, want

    def pack_error(v):
        return (P.unpack_error(P.pack_error(v, v, v, v, v)),
                (v & 0xFF, v & 0xFF, v & 0xFF, v & M16, v & M24))

    return {
        "mlx5.put_be16": lambda v: (wrote(mlx5.put_be16, 2, v), be(v, 2)),
        "mlx5.put_be32": lambda v: (wrote(mlx5.put_be32, 4, v), be(v, 4)),
        "mlx5.put_be64": lambda v: (wrote(mlx5.put_be64, 8, v), be(v, 8)),
        "mlx5.put_le32": lambda v: (wrote(mlx5.put_le32, 4, v), le(v, 4)),
        "mlx5.bswap32": lambda v: (int(mlx5.bswap32(v)), int.from_bytes(le(v, 4), "big")),
        "mlx5.set_ctrl_seg": lambda v: (wrote(mlx5.set_ctrl_seg, 16, v, v, v, v, v, v, v, v),
                                        ref_ctrl(v, v, v, v, v, v, v, v)),
        "mlx5.set_raddr_seg": lambda v: (wrote(mlx5.set_raddr_seg, 16, v, v), ref_raddr(v, v)),
        "mlx5.set_data_seg": lambda v: (wrote(mlx5.set_data_seg, 16, v, v, v), ref_data(v, v, v)),
        "mlx5.set_atomic_seg": lambda v: (wrote(mlx5.set_atomic_seg, 16, v, v), be(v, 8) * 2),
        "mlx5.set_inline_hdr": lambda v: (wrote(mlx5.set_inline_hdr, 4, v),
                                          be((v & 0x7FFFFFFF) | mlx5.INLINE_SEG, 4)),
        "mlx5.build_rdma": lambda v: (
            wrote(mlx5.build_rdma, 48, v, v, mlx5.OPCODE_RDMA_WRITE, v, v, v, v, v, v, v),
            ref_rdma(v, v, mlx5.OPCODE_RDMA_WRITE, v, v, v, v, v, v, v)),
        "mlx5.build_atomic": lambda v: (
            wrote(mlx5.build_atomic, 64, v, v, mlx5.OPCODE_ATOMIC_FA, v, v, v, v, v, v, v),
            ref_atomic(v, v, mlx5.OPCODE_ATOMIC_FA, v, v, v, v, v, v, v)),
        "mlx5.build_nop": lambda v: (wrote(mlx5.build_nop, 16, v, v, v),
                                     ref_ctrl(v, mlx5.OPCODE_NOP, 0, v, v, 1, 0, 0)),
        "mlx5.write_cqe": cqe,
        "mlx5.set_sq_dbrec/set_cq_dbrec": dbrec,
        "mlx5.doorbell_wqe_index": lambda v: (int(mlx5.doorbell_wqe_index(v)),
                                              ((v >> 8) & 0xFF) << 8 | ((v >> 16) & 0xFF)),
        "rawmem.bswap64": lambda v: (int(rawmem.bswap64(v)), int.from_bytes(le(v, 8), "big")),
        "wq.post_rdma": lambda v: (
            posted(wq.post_rdma, v, v, mlx5.OPCODE_RDMA_WRITE, v, v, v, v, v, v, v),
            slot(v, ref_rdma(v, v, mlx5.OPCODE_RDMA_WRITE, v, v, v, v, v, v, v))),
        "wq.post_atomic": lambda v: (
            posted(wq.post_atomic, v, v, mlx5.OPCODE_ATOMIC_CS, v, v, v, v, v, v, v),
            slot(v, ref_atomic(v, v, mlx5.OPCODE_ATOMIC_CS, v, v, v, v, v, v, v))),
        "wq.post_nop": lambda v: (posted(wq.post_nop, v, v, v),
                                  slot(v, ref_ctrl(v, mlx5.OPCODE_NOP, 0, v, v, 1, 0, 0))),
        "wq.post_write_inline": inline,
        "proxy.encode": encode,
        "proxy.encode_signal": encode_signal,
        "proxy.cmd_* / valid_bit": cmd_fields,
        "proxy.pack_error": pack_error,
    }


def run_order(order):
    """Call every entry with every boundary value in ``order``; returns the failures."""
    vals = BOUNDARY if order == "asc" else BOUNDARY[::-1]
    checks = entries()
    bad = []
    for v in vals:                      # value-major: each entry's FIRST call gets vals[0]
        for name, check in checks.items():
            try:
                got, want = check(v)
                if got != want:
                    bad.append({"entry": name, "value": v, "got": repr(got)[:200],
                                "want": repr(want)[:200]})
            except Exception as e:  # noqa: BLE001 - reported to the test
                bad.append({"entry": name, "value": v, "error": "%s: %s" % (type(e).__name__, e)})
    return bad


def _fresh(order, cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), order], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first,second", [("asc", "desc"), ("desc", "asc")])
def test_entries_take_full_range_in_either_order_fresh_process(tmp_path, first, second):
    """Fresh process, empty numba cache: every entry called with 0, 2**31, 2**32 - 1, 2**63,
    2**64 - 1 in ``first`` order writes / returns exactly the reference's bytes (no OverflowError,
    no wrong specialization). Then a fresh process in the other order on the cache the first one
    left: the same."""
    assert _fresh(first, tmp_path) == []
    assert _fresh(second, tmp_path) == []


def test_int_outside_64_bits_raises_config_error():
    """An int that fits no 64-bit field (2**64, -2**63 - 1) is refused with a gpunet ConfigError
    naming the function and the argument, not a numba ValueError / OverflowError."""
    import numpy as np

    from gpunet import mlx5
    from gpunet.errors import ConfigError

    b = np.zeros(16, np.uint8)
    for bad in (2**64, -2**63 - 1):
        with pytest.raises(ConfigError, match="set_data_seg: argument 4"):
            mlx5.set_data_seg(b, 0, 8, 1, bad)
    mlx5.set_data_seg(b, 0, 8, 1, -1)         # -1 is the two's complement 2**64 - 1
    assert b[8:].tolist() == [0xFF] * 8


# ---- the API: negative atomic operands --------------------------------------------------------
@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
def test_atomic_add_negative_operands_across_ranks(transport):
    """2 ranks, ``transport``: rank 0 adds +5, -1, -3, 2**64 - 1 (== -1), -2**31, +2**31 - 1 to its
    own counter and rank 1's (old values are the running sums mod 2**64, each add lands once);
    then both ranks add -1 k times to rank 0's counter: it ends 2k lower (mod 2**64)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mp_ranks import Ranks

    addends = [5, -1, -3, 2**64 - 1, -2**31, 2**31 - 1]
    k = 20
    r = Ranks(2)
    try:
        r.run("init", transport)
        out = r.run("atomic_add_signed", addends, k)
    finally:
        r.close()
    seq = out[0]["olds"]
    for target in (0, 1):
        run, olds = out[target]["start"], []
        for a in addends:
            olds.append(run)
            run = (run + a) & M64
        assert seq[target] == olds, (target, seq[target], olds)
        assert out[target]["after_seq"] == run
    assert out[0]["final"] == (out[0]["after_seq"] - 2 * k) & M64


if __name__ == "__main__":
    print(json.dumps(run_order(sys.argv[1])))
