"""Signal words in the NICs' atomic order (issue 9 item 4): native-endian by default, big-endian
(the IB wire order) selectable, Nic.atomic_endianness; devctx.cuh api::signal_order is the one
conversion on the device.

- The soft NIC's fetch-add / compare-swap read the word in its owner's order and write the old
  value in the requester's (both modes, and a pair whose NICs differ).
- The proxy's SIGNAL_SET stores the value in the NIC's order (both modes), so a SET and later
  ADDs on one word agree.
- Through the API in both modes, a world of 3 where rank 0 is reached by p2p (itself), ibgda
  (rank 1) and the proxy (rank 2): put_signal ADDs from all three into ONE word, SETs by each
  transport followed by the others' ADDs, atomic_add's returned old values exactly once, and
  wait_until / torch's ``sig[i]`` (native mode) / read_signal seeing the totals.
- gpunet.init refuses ranks whose NICs disagree.
"""
import sys

import numpy as np
import pytest

from gpunet.errors import ConfigError
from gpunet.host import proxy as P
from gpunet.host.softnic import SoftNic
from gpunet.host.wq import SendQueue, CompletionQueue
from mp_ranks import Ranks

MODES = ["host", "big"]
ORDER = {"host": sys.byteorder, "big": "big"}
ENV = "GPUNET_SOFTNIC_ATOMIC_ENDIANNESS"


def _word(buf, off, order):
    return int.from_bytes(bytes(buf[off:off + 8]), order)


def _qp_pair(a, b):
    cqa, cqb = a.create_cq(64), b.create_cq(64)
    qa, qb = a.create_qp(cqa, sq_wqebbs=64), b.create_qp(cqb, sq_wqebbs=64)
    a.connect(qa, qb.info())
    b.connect(qb, qa.info())
    return qa, cqa


@pytest.mark.parametrize("requester", MODES)
@pytest.mark.parametrize("responder", MODES)
def test_soft_nic_atomics_follow_the_owner_order_and_return_in_the_requester_order(requester,
                                                                                   responder):
    """ATOMIC_FA +5, FA -1, CS hit, CS miss on one word of the responder NIC, the word stored in
    the responder's order and the old values written in the requester's: the four old values
    read in the requester's order are 1000, 1005, 1004, 77 and the word reads 77 in the
    responder's, for every pair of modes."""
    with SoftNic(atomic_endianness=requester, retry_timeout_s=0.5) as a, \
            SoftNic(atomic_endianness=responder, retry_timeout_s=0.5) as b:
        assert (a.atomic_endianness, b.atomic_endianness) == (requester, responder)
        lbuf, rbuf = a.alloc(4096), b.alloc(4096)
        lmr, rmr = a.reg_mr(lbuf), b.reg_mr(rbuf)
        qa, cqa = _qp_pair(a, b)
        sq = SendQueue(qa, CompletionQueue(cqa))
        rbuf[0:8] = np.frombuffer((1000).to_bytes(8, ORDER[responder]), np.uint8)
        la, ra = lmr.addr, rmr.addr
        sq.post_atomic_fa(la, lmr.lkey, ra, rmr.rkey, 5)
        sq.post_atomic_fa(la + 8, lmr.lkey, ra, rmr.rkey, (1 << 64) - 1)
        sq.post_atomic_cs(la + 16, lmr.lkey, ra, rmr.rkey, 1004, 77)
        sq.post_atomic_cs(la + 24, lmr.lkey, ra, rmr.rkey, 1004, 99, signaled=True)
        sq.quiet(5.0)
        assert [_word(lbuf, 8 * i, ORDER[requester]) for i in range(4)] == [1000, 1005, 1004, 77]
        assert _word(rbuf, 0, ORDER[responder]) == 77


def test_soft_nic_refuses_an_unknown_atomic_endianness():
    """SoftNic(atomic_endianness=) takes "host" or "big" only (ConfigError naming both)."""
    with pytest.raises(ConfigError, match="'host' or 'big'"):
        SoftNic(atomic_endianness="little")


@pytest.mark.parametrize("mode", MODES)
def test_proxy_signal_set_and_add_share_a_word_in_the_nic_order(mode):
    """Through the proxy engine: SIGNAL_SET 1000 then SIGNAL_ADD 5 and 2**40 on one word, and an
    ATOMIC_FA of -3 on it: the word reads 1000 + 5 + 2**40 - 3 and the fetched old value
    1000 + 5 + 2**40, both in the NIC's order (a SET written in the other order would not add
    up)."""
    with SoftNic(atomic_endianness=mode, retry_timeout_s=0.5, name="endian-a") as a, \
            SoftNic(atomic_endianness=mode, retry_timeout_s=0.5, name="endian-b") as b:
        lh, rh = a.alloc(1 << 16, 4096), b.alloc(1 << 16, 4096)
        lmr, rmr = a.reg_mr(lh), b.reg_mr(rh)
        qa, cqa = _qp_pair(a, b)
        ch = P.ProxyChannel(16)
        with P.ProxyEngine(a, [ch], [[(qa, cqa)]], lmr, [rmr]) as eng:
            eng.quiet(ch, ch.push([P.encode_signal(P.OP_SIGNAL_SET, 0, 1000, 64)]))
            issued = ch.push([P.encode_signal(P.OP_SIGNAL_ADD, 0, 5, 64),
                              P.encode_signal(P.OP_SIGNAL_ADD, 0, 1 << 40, 64)]
                             + P.atomic_fa_commands(0, -3, 128, 64))
            eng.quiet(ch, issued)
        assert _word(rh, 64, ORDER[mode]) == 1000 + 5 + (1 << 40) - 3
        assert _word(lh, 128, ORDER[mode]) == 1000 + 5 + (1 << 40)


@pytest.fixture(scope="module", params=MODES)
def world(request):
    r = Ranks(3, env={ENV: request.param})
    try:
        info = r.run("signal_endian_jobs:init", timeout=400)   # generous: a loaded 2-core CI
        assert [i["atomic_endianness"] for i in info] == [request.param] * 3
        # rank 0 is reached by all three transports: itself by p2p, rank 1 ibgda, rank 2 proxy
        assert [i["transports"][0] for i in info] == ["p2p", "ibgda", "proxy"], info
        r.mode = request.param
        yield r
    finally:
        r.close()


@pytest.mark.parametrize("k", [1, 6])
def test_every_transport_updates_one_signal_word_in_the_nic_order(world, k):
    """k put_signal ADDs per rank into one word of rank 0 over p2p, ibgda and proxy at once; SETs
    by each transport then the others' ADDs on three more words; k atomic_adds per rank on a
    counter. Rank 0's wait_until (eq) sees every total; read_signal reads them; in native mode
    torch's sig[i] is the value (in big-endian mode the raw bytes are the big-endian value);
    the atomics' old values are 0 .. 3k-1 exactly once; each payload landed."""
    out = world.run("signal_endian_jobs:mixed_word", k, timeout=400)
    r0 = out[0]
    expect = [r0["expect"][w] for w in range(5)]
    assert r0["read"] == expect, r0
    raw = [int.from_bytes(r0["raw"][8 * w:8 * w + 8], ORDER[world.mode]) for w in range(5)]
    assert raw == expect, (world.mode, raw, expect)
    if world.mode == "host":
        assert r0["torch"] == expect, "torch's sig[i] must read a native signal word as is"
    olds = sorted(o for rank in out for o in rank["olds"])
    assert olds == list(range(3 * k)), olds
    for r in range(3):
        assert bool((r0["payload"][r * 64:(r + 1) * 64] == r + 1).all()), r


def test_init_refuses_ranks_whose_nics_disagree_on_the_order():
    """Rank 1's soft NIC runs big-endian atomics, rank 0's native ones: gpunet.init raises
    ConfigError on both ranks, naming the knob (device code reads every word in one order)."""
    r = Ranks(2)
    try:
        out = r.run("signal_endian_jobs:init_with_order", {1: "big"}, timeout=400)
        for o in out:
            assert o["raised"] == "ConfigError", o
            assert "byte orders" in o["msg"] and ENV in o["msg"], o["msg"]
    finally:
        r.close()
