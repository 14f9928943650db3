"""Both transports through the Python API, 2 ranks: the full 64-bit atomic addend and failure
messages that name what failed (issue 7: "over the proxy, atomic_add with an addend >= 2**31
raises"; "error messages name the wrong thing").

One rank pool per transport (mp_ranks.py), a short device timeout so the timeout cases are quick.
"""
import re

import pytest

from mp_ranks import Ranks

M64 = (1 << 64) - 1
TIMEOUT_S = 2.0


@pytest.fixture(scope="module", params=["ibgda", "proxy"])
def ranks(request):
    r = Ranks(2)
    try:
        info = r.run("init", request.param, 8 << 20, TIMEOUT_S)
        assert all(set(i["transports"].values()) == {request.param} for i in info)
        r.transport = request.param
        yield r
    finally:
        r.close()


def test_atomic_add_takes_any_64bit_addend(ranks):
    """Rank 0 adds 2**31, 2**63, 2**64 - 1 and -1 to its own and rank 1's counter (over the
    proxy the addend travels in a second 16-byte command slot): each returns the running sum mod
    2**64 before it and the word ends at the total; then both ranks add -1 three times to rank
    0's counter and it ends 6 lower."""
    addends = [2**31, 2**63, 2**64 - 1, -1]
    out = ranks.run("atomic_add_signed", addends, 3)
    for target in (0, 1):
        run, olds = out[target]["start"], []
        for a in addends:
            olds.append(run)
            run = (run + a) & M64
        assert out[0]["olds"][target] == olds, (ranks.transport, target)
        assert out[target]["after_seq"] == run
    assert out[0]["final"] == (out[0]["after_seq"] - 6) & M64


@pytest.mark.parametrize("what", ["wait_until", "barrier"])
def test_wait_timeout_names_the_signal_word(ranks, what):
    """Rank 1 times out in a wait_until nobody signals, or in a barrier rank 0 never joins: the
    TimeoutError names the signal word (heap offset), the comparison, expected and last-read
    values, and no QP, peer or WQEBB."""
    out = ranks.run("failure_message", what, 1, timeout=60)
    assert out[0] is None
    r = out[1]
    assert r["raised"] == "TimeoutError", r
    msg, f = r["msg"], r["failure"]
    assert msg.startswith(what) and "in wait_until on the signal word at heap offset" in msg, msg
    assert not re.search(r"QP \d|peer \d|WQEBB", msg), msg
    if what == "wait_until":
        assert f["heap_off"] == r["sig_off"] and "value >= 5, last read 0" in msg, msg
    else:
        # the barrier waits on one slot per rank (heap head word 1 + rank): rank 0's never came
        assert f["heap_off"] == 8 and f["observed"] < f["expected"], (msg, f)


def test_error_completion_names_the_dead_peer(ranks):
    """Rank 1 dies; rank 0's put to it fails (retry exceeded, or a timeout): an error completion
    names peer 1, never peer 0 (the proxy's used to say "peer 0": its channel index). Runs last
    in the module: the pool has one rank left afterwards (the way tests/test_api.py kills one)."""
    for q in ranks.inboxes:
        q.put(("die_if", (1,)))
    assert ranks.outboxes[0].get(timeout=60) == ("ok", "alive")
    ranks.procs[1].join(timeout=30)
    ranks.inboxes[0].put(("put_to", (1, TIMEOUT_S)))
    status, res = ranks.outboxes[0].get(timeout=60)
    ranks.lose(1)
    assert status == "ok", res
    assert res["raised"] in ("CompletionError", "TimeoutError"), res
    assert not re.search(r"peer 0\b", res["msg"]), res["msg"]
    if res["raised"] == "CompletionError":
        assert "peer 1" in res["msg"], res["msg"]
