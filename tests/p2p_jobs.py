"""Jobs of tests/test_p2p.py, run on every rank by mp_ranks.py ("p2p_jobs:<name>"). The API jobs
of mp_jobs.py (init, exchange, atomics, signal_order, close) serve p2p as they serve the NIC
transports; these add what only p2p needs: a mixed world, warp puts at chosen warp sizes,
the store-only rule, and the mappings a Context leaves behind."""


import gpunet
import mp_jobs
from gpunet.device import abi
from gpunet.device.ops import Launch, run_ops, run_put_bulk


def mixed(a, b):
    """A transport per pair, symmetric: p2p, ibgda or proxy by (a + b) % 3 (a rank reaches
    itself by p2p when 2a % 3 == 0, ...): every kind appears in a world of 3 or more ranks."""
    return ("p2p", "ibgda", "proxy")[(a + b) % 3]


def init_mixed(state, heap_bytes=8 << 20, timeout_s=10.0):
    return mp_jobs.init(state, mixed, heap_bytes, timeout_s)


def warp_put(state, warp_size, rows, round_):
    """Each rank puts, with ONE warp of ``warp_size`` lanes (put_nbi_warp), every row (peer,
    src_off, dst_off, nbytes) whose peer is (rank + 1) % world into dst slot ``rank`` there;
    quiet, barrier. Returns the dst bytes that landed here."""
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    src, dst = state["src"], state["dst"]
    src[:] = mp_jobs._pattern(me, round_, mp_jobs.SLOT_ELEMS)
    dst.zero_()
    ctx.barrier()
    peer = (me + 1) % n
    for s_off, d_off, nbytes in rows:
        ops = (abi.OpDesc * warp_size)()
        for o in ops:
            o.kind, o.pe, o.nbytes = abi.OP_PUT_WARP, peer, nbytes
            o.src = src.data_ptr() + s_off
            o.dst = dst.data_ptr() + me * mp_jobs.SLOT_ELEMS + d_off
        run_ops(ctx._launcher.lib, ctx._dev, ops, 1,
                Launch(grid=1, block=warp_size, warp_size=warp_size))
        assert all(o.ok for o in ops), "a lane's put_nbi_warp returned false"
    gpunet.quiet()
    ctx.barrier()
    return dst.clone()


def block_put(state, warp_size, block, grid, chunk, rows, round_):
    """Each rank puts every row (src_off, dst_off, nbytes) to (rank + 1) % world, into dst slot
    ``rank`` there, with ops.cu's bulk put: ``grid`` blocks of ``block`` threads (warps of
    ``warp_size``) share the row list, cut in ``chunk``-byte pieces, each piece moved by one
    block's put_nbi_block; quiet, barrier. Returns the dst bytes that landed here and the ok flags."""
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    src, dst = state["src"], state["dst"]
    src[:] = mp_jobs._pattern(me, round_, mp_jobs.SLOT_ELEMS)
    dst.zero_()
    ctx.barrier()
    peer = (me + 1) % n
    ops = (abi.OpDesc * len(rows))()
    for o, (s_off, d_off, nbytes) in zip(ops, rows):
        o.kind, o.pe, o.nbytes = abi.OP_PUT, peer, nbytes
        o.src = src.data_ptr() + s_off
        o.dst = dst.data_ptr() + me * mp_jobs.SLOT_ELEMS + d_off
    run_put_bulk(ctx._launcher.lib, ctx._dev, ops, chunk,
                 Launch(grid=grid, block=block, warp_size=warp_size))
    oks = [int(o.ok) for o in ops]
    gpunet.quiet()
    ctx.barrier()
    return {"dst": dst.clone(), "ok": oks}


def big_put(state, nbytes, rnd, batch):
    """Each rank puts ``nbytes`` (batch: as ``batch`` put_batch pieces in one call) from a fresh
    heap tensor to the next rank, through the Python API; records the launches' bulk geometry
    (gpunet/_launch.py Launcher.run's ``bulk``); quiet, barrier. Returns what landed here (as a
    digest and the bytes that differ from the sender's pattern), the geometries, and the next
    rank's transport."""
    import torch

    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    nxt, prv = (me + 1) % n, (me - 1) % n
    src = ctx.alloc((nbytes,), torch.uint8)
    dst = ctx.alloc((nbytes,), torch.uint8)
    seen = []
    real = ctx._launcher.run

    def spy(ops, what, blocking=True, bulk=None):
        seen.append((what, bulk, len(ops)))
        return real(ops, what, blocking, bulk)

    try:
        src.copy_(mp_jobs._pattern(me, rnd, nbytes))
        dst.zero_()
        ctx.barrier()
        ctx._launcher.run = spy
        if batch:
            cuts = [nbytes * i // batch for i in range(batch + 1)]
            gpunet.put_batch([(ctx.remote(nxt, dst, cuts[i]), src[cuts[i]:cuts[i + 1]])
                              for i in range(batch)])
        else:
            gpunet.put(ctx.remote(nxt, dst), src)
        ctx._launcher.run = real
        gpunet.quiet()
        ctx.barrier()
        wrong = int((dst != mp_jobs._pattern(prv, rnd, nbytes)).sum())
        return {"wrong": wrong, "launches": seen, "kind": ctx.transports[nxt]}
    finally:
        ctx._launcher.run = real
        ctx.barrier()
        ctx.free(dst)
        ctx.free(src)


def store_only(state):
    """On a store-only (c500) p2p world, rank 0 tries each refused operation on rank 1 and each
    allowed one: returns {what: outcome}, and whether rank 1's bytes the refused ones aimed at
    stayed untouched."""
    ctx = state["ctx"]
    me = ctx.rank
    src, dst, sig, ctr = state["src"], state["dst"], state["sig"], state["ctr"]
    dst.zero_()
    src[:] = 7
    ctr.zero_()
    ctx.barrier()
    out = {}
    if me == 0:
        out["get"] = mp_jobs._outcome(lambda: (gpunet.get(dst[:64], ctx.remote(1, src)),
                                               gpunet.quiet()))
        out["get_untouched"] = bool((dst[:64] == 0).all())
        out["atomic_add"] = mp_jobs._outcome(lambda: gpunet.atomic_add(ctx.remote(1, ctr), 5))
        out["signal_add"] = mp_jobs._outcome(
            lambda: (gpunet.put_signal(ctx.remote(1, dst), src[:64], ctx.remote(1, sig, 0)),
                     gpunet.quiet()))
        out["signal_set"] = mp_jobs._outcome(
            lambda: (gpunet.put_signal(ctx.remote(1, dst, 128), src[:64], ctx.remote(1, sig, 0),
                                       41, op="set"), gpunet.quiet()))
        out["put"] = mp_jobs._outcome(lambda: (gpunet.put(ctx.remote(1, dst, 256), src[:32]),
                                               gpunet.quiet()))
    out["barrier"] = mp_jobs._outcome(ctx.barrier)
    if me == 1:
        out["wait_set"] = mp_jobs._outcome(lambda: gpunet.wait_until(sig, 41, "eq", index=0))
        out["ctr"] = int(ctr[0])
        out["dst"] = dst[:512].clone()
    ctx.barrier()
    return out


def _maps_naming(names):
    with open("/proc/self/maps") as f:
        text = f.read()
    return {n: text.count("/dev/shm/" + n) for n in names}


def maps_naming(state, names):
    """How many of this process's mappings name each arena file in ``names``."""
    return _maps_naming(names)


def close_and_count_mappings(state, peer_arenas):
    """Counts this process's mappings of every other rank's arena file before and after
    ctx.close() (/proc/self/maps)."""
    ctx = state["ctx"]
    others = [a for r, a in enumerate(peer_arenas) if r != ctx.rank]
    before = _maps_naming(others)
    heaps = {p: hex(m.base) for p, m in ctx._transports.peer_heaps.items()}
    ctx.close()
    state.pop("ctx")
    return {"before": before, "after": _maps_naming(others), "heaps": heaps}


def after_peer_died(state, peer, peer_arena):
    """``peer`` has exited without closing anything. This rank puts to it (a store into its heap
    still mapped here), then joins a barrier it can never complete; then closes. Returns what the
    put and the barrier did and the mappings of the peer's arena before and after close."""
    ctx = state["ctx"]
    out = {"put": mp_jobs._outcome(lambda: (gpunet.put(ctx.remote(peer, state["dst"]),
                                                       state["src"][:64]), gpunet.quiet())),
           "barrier": mp_jobs._outcome(ctx.barrier),
           "before": _maps_naming([peer_arena])[peer_arena]}
    ctx.close()
    state.pop("ctx")
    out["after"] = _maps_naming([peer_arena])[peer_arena]
    return out


def init_with_unmappable(state, bad_rank):
    """Every rank asks for p2p; ``bad_rank`` exports a heap in an arena that does not exist (as a
    peer on another machine, or one that has gone, would look). Returns what init raised."""
    from gpunet.host import softnic

    real = softnic.SoftNic.export_heap

    def gone(self, addr, nbytes):
        d = real(self, addr, nbytes)
        return dict(d, arena=d["arena"] + "-not-here")

    if mp_jobs._my_rank() == bad_rank:
        softnic.SoftNic.export_heap = gone
    try:
        return mp_jobs._outcome(lambda: gpunet.init(transport="p2p", heap_bytes=4 << 20).close())
    finally:
        softnic.SoftNic.export_heap = real


def p2p_and_proxy(a, b):
    """Symmetric per pair: p2p when a + b is even (each rank to itself too), else the proxy."""
    return "proxy" if (a + b) % 2 else "p2p"


class _Warnings:
    """Collects the gpunet logger's warnings while open (a context manager)."""

    def __enter__(self):
        import logging
        self.records = []
        self._h = logging.Handler(logging.WARNING)
        self._h.emit = self.records.append
        logging.getLogger("gpunet").addHandler(self._h)
        return self

    def __exit__(self, *exc):
        import logging
        logging.getLogger("gpunet").removeHandler(self._h)

    def text(self):
        return [r.getMessage() for r in self.records]


def close_while_peer_works(state, hold_s):
    """Rank 0 puts a pattern into rank 1's heap, signals it, and closes at once (timed). Rank 1,
    once the signal came, spends ``hold_s`` reading rank 0's heap (get of rank 0's src through its
    mapping) and putting into it (then getting that back), checking every byte, and only then
    closes. Returns the times (time.time) and what rank 1 saw, and the close warnings."""
    import time
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    src, dst, sig = state["src"], state["dst"], state["sig"]
    nbytes = 4096
    out = {"rank": me}
    if me == 0:
        src[:nbytes] = mp_jobs._pattern(0, 7, nbytes)
        gpunet.put_signal(ctx.remote(1, dst, 0), src[:nbytes], ctx.remote(1, sig, 0), 1)
        gpunet.quiet()
        with _Warnings() as w:
            out["close_start"] = time.time()
            ctx.close()
            out["close_end"] = time.time()
        state.pop("ctx")
        out["warnings"] = w.text()
        return out
    gpunet.wait_until(sig, 1, "ge", index=0)
    out["landed"] = bool((dst[:nbytes] == mp_jobs._pattern(0, 7, nbytes)).all())
    mine = src[:nbytes]
    mine[:] = mp_jobs._pattern(1, 7, nbytes)
    rounds = bad = 0
    end = time.time() + hold_s
    while time.time() < end or rounds == 0:
        back = dst[n * mp_jobs.SLOT_ELEMS:n * mp_jobs.SLOT_ELEMS + nbytes]
        back.zero_()
        gpunet.get(back, ctx.remote(0, src, 0))                # rank 0's heap, read here
        gpunet.quiet()
        bad += int(not (back == mp_jobs._pattern(0, 7, nbytes)).all())
        gpunet.put(ctx.remote(0, dst, mp_jobs.SLOT_ELEMS), mine)   # into rank 0's heap
        gpunet.quiet()
        back.zero_()
        gpunet.get(back, ctx.remote(0, dst, mp_jobs.SLOT_ELEMS))
        gpunet.quiet()
        bad += int(not (back == mine).all())
        rounds += 1
    out.update(rounds=rounds, bad=bad)
    with _Warnings() as w:
        out["close_start"] = time.time()
        ctx.close()
        out["close_end"] = time.time()
    state.pop("ctx")
    out["warnings"] = w.text()
    return out


def close_alone(state, closer, later_s):
    """Rank ``closer`` closes (timed, its close warnings kept) while the other ranks stay open
    for ``later_s`` seconds (alive, not closing), then close too (timed)."""
    import time
    ctx = state["ctx"]
    out = {"rank": ctx.rank}
    if ctx.rank != closer:
        time.sleep(later_s)
    with _Warnings() as w:
        t0 = time.monotonic()
        ctx.close()
        out["close_s"] = time.monotonic() - t0
    state.pop("ctx")
    out["warnings"] = w.text()
    return out


# --- a dead peer, then a new world (test_p2p.py / test_p2p_cuda.py ..._a_new_world_...) ----------
def _mapped_ranges(ctx):
    """{peer: (base, nbytes, name)} of this Context's p2p mappings (name: the arena on the CPU,
    None for a CUDA IPC mapping)."""
    return {p: (int(m.base), int(m.nbytes), getattr(m, "arena", None))
            for p, m in ctx._transports.peer_heaps.items()}


def survive_dead_peer(state, peer):
    """``peer`` has exited without closing anything. This rank joins a barrier it can never
    complete (bounded: a gpunet error naming the peer), then closes its Context (the close
    barrier skips or waits out the dead peer; every mapping is closed). Nothing is stored into the
    dead peer's heap (on a GPU under MPS its memory may be gone). Returns the barrier's outcome,
    the close's, and the mappings before."""
    ctx = state["ctx"]
    before = _mapped_ranges(ctx)
    out = {"barrier": mp_jobs._outcome(ctx.barrier), "before": before}

    def close():
        state.pop("ctx").close()
    out["close"] = mp_jobs._outcome(close)
    return out


def rejoin(state, port, world, rank):
    """Leave this process's torch.distributed group (a member died) and join a new one of
    ``world`` ranks on 127.0.0.1:``port`` as ``rank`` (the new members are new processes)."""
    import torch.distributed as dist
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    return "joined"


def put_both_ways(state, rnd):
    """Every rank puts its pattern ``rnd`` (1000 bytes, then 600 KiB: the bulk kernel on both
    arms) into the next rank's dst slot ``me`` and quiets; after a barrier each checks what landed
    from the previous rank. Returns the wrong byte counts and this rank's p2p mappings."""
    import torch
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    nxt, prv = (me + 1) % n, (me - 1) % n
    src, dst = state["src"], state["dst"]
    slot = src.numel()
    dev = src.device
    wrong = {}
    for nbytes in (1000, min(slot, 600 << 10)):
        dst.zero_()
        ctx.barrier()
        src[:nbytes] = mp_jobs._pattern(me, rnd + nbytes, nbytes).to(dev)
        gpunet.put(ctx.remote(nxt, dst, me * slot), src[:nbytes])
        gpunet.quiet()
        ctx.barrier()
        want = mp_jobs._pattern(prv, rnd + nbytes, nbytes)
        got = dst[prv * slot: prv * slot + nbytes].cpu()
        wrong[nbytes] = int((got != want).sum())
        ctx.barrier()
    return {"wrong": wrong, "mapped": _mapped_ranges(ctx), "pid": __import__("os").getpid()}
