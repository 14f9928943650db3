"""Jobs of tests/test_signal_endian.py, run on every rank by mp_ranks.py ("signal_endian_jobs:<name>"):
signal words updated by every transport at once, read back in the NICs' atomic order."""
import torch

import gpunet
import mp_jobs

# Word w of rank 0's signal tensor is first SET by the transport SETTER[w] names (by rank: in the
# world of 3 p2p_jobs.mixed makes, rank 0 reaches itself by p2p, rank 1 reaches rank 0 by ibgda,
# rank 2 by the proxy), then ADDed to by the other two ranks. Values above 255 so that a word
# written in one byte order and read in the other cannot pass.
SET_VALUES = {1: 1000, 2: 2000, 3: 3000}
SETTER = {1: 1, 2: 2, 3: 0}          # word -> the rank that SETs it (ibgda, proxy, p2p)
ADD_VALUES = {0: 3, 1: 5, 2: 7}      # rank -> what it adds to every word it does not SET


def init(state):
    """A world of 3 over p2p_jobs.mixed (p2p, ibgda and proxy all reach rank 0) and 8 signal words."""
    import p2p_jobs
    info = p2p_jobs.init_mixed(state)
    state["words"] = state["ctx"].alloc((8,), torch.int64)
    state["ctx"].barrier()
    return dict(info, atomic_endianness=state["ctx"].atomic_endianness)


def mixed_word(state, k):
    """Word 0 of rank 0: every rank does ``k`` put_signal ADDs of ADD_VALUES[rank] with a 64-byte
    payload. Words 1..3: SETTER SETs SET_VALUES (put_signal op="set"), barrier, then every other
    rank ADDs. Counter word 4: every rank does ``k`` atomic_add(+1), keeping the old values.
    Rank 0 waits (wait_until eq) for each expected total, then reports the words as torch reads
    them (``sig[i]``), as read_signal reads them, and their raw bytes."""
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    words, src, dst = state["words"], state["src"], state["dst"]
    words.zero_()
    src[:64] = me + 1
    ctx.barrier()
    for _ in range(k):
        gpunet.put_signal(ctx.remote(0, dst, me * 64), src[:64], ctx.remote(0, words, 0),
                          ADD_VALUES[me])
    for w, setter in SETTER.items():
        if setter == me:
            gpunet.put_signal(ctx.remote(0, dst, 1024 + me * 64), src[:64],
                              ctx.remote(0, words, w), SET_VALUES[w], op="set")
    gpunet.quiet()
    ctx.barrier()
    for w, setter in SETTER.items():
        if setter != me:
            gpunet.put_signal(ctx.remote(0, dst, 2048 + me * 64), src[:64],
                              ctx.remote(0, words, w), ADD_VALUES[me])
    olds = [gpunet.atomic_add(ctx.remote(0, words, 4), 1) for _ in range(k)]
    gpunet.quiet()
    out = {"olds": olds}
    if me == 0:
        expect = {0: k * sum(ADD_VALUES[r] for r in range(n)), 4: k * n}
        for w, setter in SETTER.items():
            expect[w] = SET_VALUES[w] + sum(ADD_VALUES[r] for r in range(n) if r != setter)
        for w, v in expect.items():
            gpunet.wait_until(words, v, "eq", index=w)
        out.update(expect=expect, torch=[int(x) for x in words[:5]],
                   read=[gpunet.read_signal(words, w) for w in range(5)],
                   raw=bytes(words[:5].numpy().view("u1")),
                   payload=dst[:n * 64].clone())
    ctx.barrier()
    return out


def close(state):
    return mp_jobs.close(state)


def init_with_order(state, orders):
    """gpunet.init (ibgda) with this rank's soft NIC in ``orders.get(rank, "host")``; returns what
    init raised (a Context made is closed)."""
    import os
    me = mp_jobs._my_rank()
    os.environ["GPUNET_SOFTNIC_ATOMIC_ENDIANNESS"] = orders.get(me, "host")
    return mp_jobs._outcome(lambda: gpunet.init(transport="ibgda", heap_bytes=4 << 20).close())
