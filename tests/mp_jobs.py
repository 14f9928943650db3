"""Jobs the multi-process API tests run on every rank (see mp_ranks.py). Each takes the rank's
``state`` dict first; what it returns goes back to the test."""
import os
import threading
import time

import torch

import gpunet
from gpunet.device import abi

SLOT_ELEMS = 1 << 14          # per-rank slot of the exchange buffer, in bytes (uint8 elements)


def init(state, transport, heap_bytes=8 << 20, timeout_s=10.0):
    ctx = gpunet.init(transport=transport, heap_bytes=heap_bytes, timeout_s=timeout_s)
    state["ctx"] = ctx
    n = ctx.world_size
    state["src"] = ctx.alloc((SLOT_ELEMS,), torch.uint8)
    state["dst"] = ctx.alloc((2 * n * SLOT_ELEMS,), torch.uint8)  # slot r: puts of rank r,
    # slot n + r: this rank's gets from rank r (one issuer per slot, so issue order decides)
    state["sig"] = ctx.alloc((n,), torch.int64)               # word r: signalled by rank r
    state["ctr"] = ctx.alloc((1,), torch.int64)               # a shared atomic counter
    ctx.barrier()
    modes = {v: k for k, v in abi.POST_MODES.items()}
    return {"rank": ctx.rank, "transports": dict(ctx.transports), "pid": os.getpid(),
            "arena": ctx.nic.arena_name,
            "post_modes": [modes[int(q.desc.post_mode)] for _, q in sorted(ctx._transports.qpds.items())]}


def _pattern(rank, round_, n):
    g = torch.Generator().manual_seed(rank * 1000003 + round_)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


def exchange(state, ops, round_):
    """Every rank runs ``ops``: a list of (kind, src_rank, dst_rank, nbytes, offset) the test
    generated; the rows whose src_rank is this rank are issued by it. Returns what landed here.

    put: src[0:n] of src_rank -> dst slot src_rank at ``offset`` on dst_rank;
    put_signal: the same, then +1 on dst_rank's sig word src_rank;
    get: dst_rank reads src_rank's src[0:n] into its slot world + src_rank at ``offset``.
    Each slot has one issuer, whose operations to one peer execute in issue order (one RC QP).
    """
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    src, dst, sig = state["src"], state["dst"], state["sig"]
    src[:] = _pattern(me, round_, SLOT_ELEMS)
    dst.zero_()
    ctx.barrier()
    for kind, s, d, nbytes, off in ops:
        if kind in ("put", "put_signal") and s == me:
            remote = ctx.remote(d, dst, s * SLOT_ELEMS + off)
            if kind == "put":
                gpunet.put(remote, src[:nbytes])
            else:
                gpunet.put_signal(remote, src[:nbytes], ctx.remote(d, sig, s))
        elif kind == "get" and d == me:
            g = (n + s) * SLOT_ELEMS + off
            gpunet.get(dst[g:g + nbytes],
                       ctx.remote(s, src))
    gpunet.quiet()
    ctx.barrier()
    sigs = [gpunet.read_signal(sig, r) for r in range(n)]
    return {"dst": dst.clone(), "sigs": sigs}


def atomics(state, k):
    """Every rank adds 1 to rank 0's counter k times; returns the old values it saw."""
    ctx = state["ctx"]
    ctx.barrier()
    olds = [gpunet.atomic_add(ctx.remote(0, state["ctr"]), 1) for _ in range(k)]
    ctx.barrier()
    return {"olds": olds, "final": gpunet.read_signal(state["ctr"]) if ctx.rank == 0 else None}


def signal_order(state, rounds, nbytes):
    """Rank 1 streams put_signal(payload_i, +1) to rank 0; rank 0 polls its signal word and, each
    time it sees k, checks payload slot k-1 arrived whole. Returns rank 0's violations."""
    ctx = state["ctx"]
    me = ctx.rank
    dst, sig, src = state["dst"], state["sig"], state["src"]
    base = gpunet.read_signal(sig, 1)      # earlier jobs ended with a barrier: this is stable
    ctx.barrier()
    bad = 0
    if me == 1:
        for i in range(rounds):
            src[:nbytes] = (i + 1) % 251 + 1
            gpunet.put_signal(ctx.remote(0, dst, i * nbytes), src[:nbytes], ctx.remote(0, sig, 1))
            gpunet.quiet()       # src is reused next round
    elif me == 0:
        seen = base
        deadline = time.monotonic() + 60
        while seen < base + rounds and time.monotonic() < deadline:
            k = gpunet.read_signal(sig, 1)
            for j in range(seen, k):
                i = j - base
                if not bool((dst[i * nbytes:(i + 1) * nbytes] == (i + 1) % 251 + 1).all()):
                    bad += 1
            seen = max(seen, k)
        bad += base + rounds - seen            # signals that never came count as violations
    ctx.barrier()
    return bad


def die_if(state, rank):
    """The given rank exits at once, without closing anything (a crash)."""
    if state["ctx"].rank == rank:
        os._exit(0)
    return "alive"


def put_to(state, peer, timeout_s):
    """Put to ``peer`` and wait: returns the exception type name it raised, and the time taken."""
    ctx = state["ctx"]
    t0 = time.monotonic()
    try:
        gpunet.put(ctx.remote(peer, state["dst"]), state["src"][:64])
        gpunet.quiet()
        gpunet.barrier()
        return {"raised": None, "seconds": time.monotonic() - t0}
    except gpunet.GpunetError as e:
        return {"raised": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - t0}


def atomic_add_signed(state, addends, k):
    """Rank 0 adds each of ``addends`` (negative ones too) to rank 0's and to rank 1's counter
    ("olds": the old values it saw, per target rank); then every rank adds -1 ``k`` times to rank
    0's counter. Returns, per rank, its counter at the start, after rank 0's sequence, and at the
    end."""
    ctx = state["ctx"]
    ctr = state["ctr"]
    ctx.barrier()
    start = gpunet.read_signal(ctr)
    ctx.barrier()
    olds = None
    if ctx.rank == 0:
        olds = [[gpunet.atomic_add(ctx.remote(t, ctr), a) for a in addends] for t in (0, 1)]
    ctx.barrier()
    after = gpunet.read_signal(ctr)
    ctx.barrier()
    for _ in range(k):
        gpunet.atomic_add(ctx.remote(0, ctr), -1)
    ctx.barrier()
    return {"start": start, "olds": olds, "after_seq": after, "final": gpunet.read_signal(ctr)}

def failure_message(state, what, rank):
    """Rank ``rank`` makes ``what`` time out ("wait_until": its signal word ``sig[rank]``, which
    nobody signals; "barrier": a barrier no other rank joins); the other ranks return None at
    once. Returns the exception's type, message and decoded failure fields, and the signal
    word's heap offset."""
    ctx = state["ctx"]
    if ctx.rank != rank:
        return None
    sig = state["sig"]
    try:
        if what == "wait_until":
            gpunet.wait_until(sig, 5, index=rank)
        else:
            gpunet.barrier()
    except gpunet.GpunetError as e:
        f = getattr(e, "failure", None)
        return {"raised": type(e).__name__, "msg": str(e),
                "failure": {k: v for k, v in vars(f).items() if k != "extra"} if f else None,
                "sig_off": sig.data_ptr() + 8 * rank - ctx.heap_base}
    return {"raised": None}


def close(state):
    ctx = state.pop("ctx", None)
    arena = ctx.nic.arena_name if ctx else None
    if ctx is not None:
        ctx.close()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()
            and ("gpunet" in t.name.lower() or "softnic" in t.name.lower())]
    return {"arena_left": bool(arena) and os.path.exists("/dev/shm/" + arena), "threads": left}


def teardown(state):
    ctx = state.pop("ctx", None)
    if ctx is not None:
        try:
            ctx.close()
        except Exception:  # noqa: BLE001 - tearing down anyway
            pass


# --- adversarial jobs (tests/test_api_adversarial.py) ------------------------------------------
def _outcome(fn):
    """What ``fn()`` did: {"raised": gpunet error class name or None, "msg", "seconds"}. Any
    other exception propagates (the test then fails with it: only gpunet errors are allowed)."""
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "msg": "", "seconds": time.monotonic() - t0}
    except gpunet.GpunetError as e:
        return {"raised": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0,
                "syndrome": getattr(e, "syndrome", None)}


def init_variants(state, variants):
    """For each (bad_rank, kwargs) in ``variants``: every rank calls gpunet.init, the bad rank
    with ``kwargs`` on top of good ones. Returns each call's outcome (a Context made is closed)."""
    out = []
    for bad_rank, kwargs in variants:
        made = []

        def call():
            args = dict(transport="ibgda", heap_bytes=4 << 20, timeout_s=10.0)
            if _my_rank() == bad_rank:
                args.update(kwargs)
            made.append(gpunet.init(**args))

        out.append(_outcome(call))
        for c in made:
            c.close()
    return out


def _my_rank():
    import torch.distributed as dist
    return dist.get_rank()


def collective_misuse(state, bad_rank):
    """On a good Context: alloc / free that fail their local check on ``bad_rank`` only. Every
    rank must raise, and the heap must stay symmetric and usable afterwards. Returns outcomes and
    the offsets the following good allocs got on this rank."""
    me = _my_rank()
    ctx = gpunet.init(transport="ibgda", heap_bytes=4 << 20, timeout_s=10.0)
    try:
        first = ctx.alloc((16,), torch.uint8)
        off0 = first.data_ptr() - ctx.heap_base
        ctx.free(first)
        res = {}
        res["alloc_full"] = _outcome(
            lambda: ctx.alloc((1 << 40,) if me == bad_rank else (16,), torch.uint8))
        res["alloc_bad_shape"] = _outcome(
            lambda: ctx.alloc((-1,) if me == bad_rank else (16,), torch.uint8))
        res["alloc_overflow"] = _outcome(
            lambda: ctx.alloc((1 << 62, 8) if me == bad_rank else (16,), torch.float64))
        res["alloc_mismatch"] = _outcome(
            lambda: ctx.alloc((4096,) if me == bad_rank else (16,), torch.uint8))
        x = ctx.alloc((16,), torch.uint8)          # the range every failed alloc gave back
        res["off_after"] = x.data_ptr() - ctx.heap_base
        res["off_before"] = off0
        x.fill_(me + 1)
        res["free_empty"] = _outcome(lambda: ctx.free(torch.empty(0) if me == bad_rank else x))
        res["free_part"] = _outcome(lambda: ctx.free(x[1:] if me == bad_rank else x))
        res["x_intact"] = bool((x == me + 1).all())
        res["free_good"] = _outcome(lambda: ctx.free(x))
        res["barrier"] = _outcome(ctx.barrier)
        return res
    finally:
        ctx.close()


def inject_bad_put(ctx, peer, src):
    """Post a put whose destination lies past the end of ``peer``'s heap, bypassing the API's
    checks (ctx._run): the NIC answers with a remote access error, the case the checks exist to
    prevent. Returns nothing; the error surfaces here or at the next synchronizing call."""
    from gpunet.device import abi
    ctx._run(ctx._ops(dict(kind=abi.OP_PUT, pe=peer, dst=ctx.heap_base + ctx.heap_bytes + 4096,
                           src=src.data_ptr(), nbytes=64)), "put (injected past the heap)",
             blocking=False)


def bad_put_then_good(state, bad_from, peer, rounds):
    """Rank ``bad_from`` posts a put outside ``peer``'s heap and quiets (it must raise a
    CompletionError naming the reset), then every rank barriers and ``bad_from`` puts a pattern
    into ``peer``'s dst slot, quiets, barriers; ``peer`` checks it. ``rounds`` times."""
    ctx = state["ctx"]
    me = ctx.rank
    src, dst = state["src"], state["dst"]
    out = {"errors": [], "landed": []}
    for r in range(rounds):
        dst.zero_()
        ctx.barrier()
        if me == bad_from:
            def bad():
                inject_bad_put(ctx, peer, src)
                gpunet.quiet()
            out["errors"].append(_outcome(bad))
        ctx.barrier()
        if me == bad_from:
            src[:] = _pattern(me, 7000 + r, SLOT_ELEMS)
            gpunet.put(ctx.remote(peer, dst, me * SLOT_ELEMS), src)
            gpunet.quiet()
        ctx.barrier()
        if me == peer:
            want = _pattern(bad_from, 7000 + r, SLOT_ELEMS)
            got = dst[bad_from * SLOT_ELEMS:(bad_from + 1) * SLOT_ELEMS]
            out["landed"].append(bool(torch.equal(got, want)))
    return out
