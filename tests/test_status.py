"""The failure vocabulary: one registry (status.cuh), mirrored once (gpunet/device/abi.py), one decoder
(abi.failure_error).

- Every STATUS_* / SITE_* value of status.cuh and TRANSPORT_* / CMP_* value of devctx.cuh equals
  gpunet/device/abi.py's, no other header or package module defines them, every site has a name.
- Device-level (HOST arm, ops kernel): a wait_until timeout names the signal word (heap offset,
  comparison, expected vs observed) and no QP or peer; a proxy completion error on peer 1 names
  peer 1, on the device path (Status) and on the host path (ProxyChannel.raise_if_error) alike;
  a pe out of range and a pe without a transport are named as such.
"""
import ctypes
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from gpunet import errors, mlx5
from gpunet.device import abi
from gpunet.device import ops as dops
from gpunet.device.testing import loopback as L
from gpunet.host import proxy as P
from gpunet.device.descriptors import DeviceContext, proxy_channel_desc
from gpunet.host.softnic import SoftNic

ROOT = Path(__file__).resolve().parents[1]
HEADERS = ROOT / "gpunet" / "device" / "include" / "gpunet"
ENUM_VALUE = re.compile(r"\b((?:STATUS|SITE|TRANSPORT|CMP)_[A-Z0-9_]+)\s*=\s*(\d+)")


def _defined(path):
    text = re.sub(r"//[^\n]*", "", path.read_text())
    return dict((k, int(v)) for k, v in ENUM_VALUE.findall(text))


def test_registry_is_mirrored_once():
    """status.cuh's codes and sites and devctx.cuh's transports and comparisons equal abi.py's
    constants; no other header under gpunet/device/include defines one of them; no package module but
    abi.py assigns a STATUS_ / SITE_ / TRANSPORT_ / CMP_ constant; every SITE_ has a SITE_NAMES
    entry."""
    status, devctx = _defined(HEADERS / "status.cuh"), _defined(HEADERS / "devctx.cuh")
    assert {k for k in status if k.startswith("SITE_")} >= {"SITE_WAIT_UNTIL", "SITE_PROXY_FIFO"}
    for name, value in {**status, **devctx}.items():
        assert getattr(abi, name) == value, name
    for k in status:
        assert k.split("_")[0] in ("STATUS", "SITE"), k
    for k in devctx:
        assert k.split("_")[0] in ("TRANSPORT", "CMP"), k
    py_sites = {k for k in dir(abi) if k.startswith("SITE_") and k != "SITE_NAMES"}
    assert py_sites == {k for k in status if k.startswith("SITE_")}
    assert set(abi.SITE_NAMES) == {getattr(abi, k) for k in py_sites}
    for h in HEADERS.rglob("*"):
        if h.is_file() and h.name not in ("status.cuh", "devctx.cuh"):
            assert not _defined(h), "%s defines %s: the registry is status.cuh" % (h, _defined(h))
    assign = re.compile(r"^(STATUS|SITE|TRANSPORT|CMP)_[A-Z0-9_]+\s*[,=]", re.M)
    for py in (ROOT / "gpunet").rglob("*.py"):
        rel = py.relative_to(ROOT).as_posix()
        for m in assign.finditer(py.read_text()):
            assert rel == "gpunet/device/abi.py", "%s defines %s" % (rel, m.group(0))


# ---- device-level -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    return dops.load_ops()


def test_wait_until_timeout_names_the_signal_word(lib):
    """A wait_until nobody satisfies times out naming the signal word by heap offset, the
    comparison, expected and last-read values, and no QP, peer or WQEBB (the old message said
    "QP 0 (peer 0) ... WQEBB <address>")."""
    with SoftNic() as nic:
        lb = L.Loopback(nic, sq_wqebbs=8, timeout_s=0.2, heap_bytes=1 << 16)
        off = lb.sym(64) + 8
        lb.local[off:off + 8] = np.frombuffer((2).to_bytes(8, sys.byteorder), np.uint8)  # reads 2 (native)
        arr = dops.op_list(dict(kind=abi.OP_WAIT_UNTIL, pe=0, dst=lb.local_base + off, cmp=abi.CMP_GE,
                        value=5))
        with pytest.raises(errors.TimeoutError) as ei:
            dops.run_ops(lib, lb, arr, 1, dops.Launch())
    e, msg = ei.value, str(ei.value)
    assert "wait_until" in msg and "heap offset %d " % off in msg, msg
    assert "value >= 5, last read 2" in msg, msg
    assert not re.search(r"QP \d|peer \d|WQEBB", msg), msg
    f = e.failure
    assert (f.site, f.peer, f.qpn, f.heap_off, f.addr, f.expected, f.observed) == (
        abi.SITE_WAIT_UNTIL, abi.PEER_NONE, 0, off, lb.local_base + off, 5, 2)


def test_bad_pe_and_missing_transport_are_named(lib):
    """A pe outside [0, npes) and a pe whose PeerDesc has no transport (Loopback sets only PE 1)
    each raise ConfigError saying which."""
    with SoftNic() as nic:
        lb = L.Loopback(nic, sq_wqebbs=8, heap_bytes=1 << 16)
        b = lb.local_base
        with pytest.raises(errors.ConfigError, match=r"pe 7 is out of range \[0, 2\)"):
            dops.run_ops(lib, lb, dops.op_list(dict(kind=abi.OP_PUT, pe=7, dst=b, src=b, nbytes=8)), 1,
                         dops.Launch())
        lb.clear_status()
        with pytest.raises(errors.ConfigError, match=r"pe 0 has no transport \(PeerDesc.kind 0"):
            dops.run_ops(lib, lb, dops.op_list(dict(kind=abi.OP_PUT, pe=0, dst=b, src=b, nbytes=8)), 1,
                         dops.Launch())


class _ProxyWorld:
    """PE 0 of a 2-PE world whose peers are both reached through one proxy channel: QPs of NIC
    ``a`` to NIC ``b``; peer 1's rkey is wrong, so every command to peer 1 fails at the NIC."""

    def __init__(self, a, b, timeout_s=5.0, heap=1 << 16):
        self.local, self.remote = a.alloc(heap), b.alloc(heap)
        lmr, rmr = a.reg_mr(self.local), b.reg_mr(self.remote)
        qps = []
        for _ in range(2):
            qa = a.create_qp(a.create_cq(64), sq_wqebbs=64)
            qb = b.create_qp(b.create_cq(64), sq_wqebbs=64)
            a.connect(qa, qb.info())
            b.connect(qb, qa.info())
            qps.append([qa])
        self.ch = P.ProxyChannel(16)
        remotes = [(rmr.addr, rmr.rkey), (rmr.addr, rmr.rkey ^ 0x100)]
        self.eng = P.ProxyEngine(a, [self.ch], qps, lmr, remotes)
        self.local_base = int(lmr.addr)
        self.dev = DeviceContext(self.local_base, heap, lmr.lkey, 2, 0, self.local_base + 1024, 16,
                                 self.local_base + 2048, timeout_s)
        desc = self.dev.place(proxy_channel_desc(self.ch))
        for pe in range(2):
            self.dev.set_peer_proxy(pe, desc, remotes[pe][0], remotes[pe][1])
        self.ctx, self.status = self.dev.ctx, self.dev.status

    def close(self):
        self.eng.close()
        self.ch.close()


@pytest.mark.parametrize("op", ["put", "atomic"])
def test_proxy_completion_error_names_the_failing_peer(lib, op):
    """A put (or a 64-bit fetch-add) to peer 1 through the proxy fails with remote access error:
    the CompletionError from the device's Status and the one from the channel on the host both
    name peer 1 (the old message named the channel index as "peer 0"), the proxy channel and
    the failed command, with the same fields."""
    with SoftNic(name="st-a") as a, SoftNic(name="st-b") as b:
        w = _ProxyWorld(a, b)
        try:
            base = w.local_base
            row = (dict(kind=abi.OP_PUT, pe=1, dst=base + 4096, src=base + 8192, nbytes=64)
                   if op == "put" else
                   dict(kind=abi.OP_ATOMIC_ADD, pe=1, dst=base + 4096, value=2**64 - 1))
            with pytest.raises(errors.CompletionError) as ei:
                dops.run_ops(lib, w, dops.op_list(dict(kind=abi.OP_PUT, pe=0, dst=base + 4096,
                                               src=base + 8192, nbytes=64), row), 2, dops.Launch())
            with pytest.raises(errors.CompletionError) as hi:
                w.ch.raise_if_error()
        finally:
            w.close()
    for e in (ei.value, hi.value):
        msg = str(e)
        assert "peer 1" in msg and "peer 0" not in msg and "proxy channel 0" in msg, msg
        assert "command #1" in msg, msg
        assert e.syndrome == mlx5.SYNDROME_REMOTE_ACCESS_ERR
        assert (e.failure.peer, e.failure.channel, e.failure.seq) == (1, 0, 1)
    d, h = ei.value.failure, hi.value.failure
    assert (d.code, d.site, d.qpn, d.syndrome, d.wqe_counter) == (h.code, h.site, h.qpn,
                                                                  h.syndrome, h.wqe_counter)


def test_decoder_names_every_code_and_keeps_the_record():
    """failure_error gives each code its exception class, attaches the Failure, and returns None
    for no failure; an unpublished Status (valid == 0) says its details are missing."""
    cases = {abi.STATUS_TIMEOUT: errors.TimeoutError,
             abi.STATUS_COMPLETION_ERROR: errors.CompletionError,
             abi.STATUS_BAD_ARGUMENT: errors.ConfigError, abi.STATUS_QP_ERROR: errors.CompletionError,
             abi.FAILURE_COHERENCE: errors.CoherenceViolation, 77: errors.GpunetError}
    for code, cls in cases.items():
        f = abi.Failure(code, abi.SITE_QUIET, qpn=3, peer=2, extra=dict(
            opcode=8, key=1, length=8, is_write=True, pid=1, owner="x"))
        e = abi.failure_error(f, "what")
        assert type(e) is cls and e.failure is f, code
    assert abi.failure_error(abi.Failure(abi.STATUS_OK)) is None
    st = abi.Status()
    st.code = abi.STATUS_TIMEOUT
    assert "not published" in str(abi.status_error(st))
    assert ctypes.sizeof(abi.Status) == 128
