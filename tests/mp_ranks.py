"""A pool of rank processes for multi-process tests: started once, fed jobs, torn down at the end.

Each rank is a process forked by a ``forkserver`` that imported torch once (numba threads and fork
do not mix, so never a fork of the test process; a ``spawn``-ed rank imported torch itself, seconds
a rank on the 2-core CI machine, for every world of every test). It takes the test process's
environment and working directory as they are when the rank starts, joins a gloo group on
127.0.0.1, then runs jobs the test sends: a job is the name of a function in ``tests/mp_jobs.py``
(or ``"module:function"`` for a function of another module in tests/, e.g. ``"ep_jobs:init"``)
plus arguments, run on every rank at once; each rank answers ("ok", result) or ("err", repr).
Every wait is bounded, so a broken rank fails the test instead of hanging it.
"""
import multiprocessing as mp
import os
import traceback

from gpunet.host.bootstrap import free_port

JOB_TIMEOUT_S = 120
# What the forkserver imports before it forks ranks: torch's and numba's imports were most of a
# rank's start (a 3-rank world and one job on this idle 2-core machine: 3.5-3.9 s spawned, 0.15-0.17
# s forked, 1.9 s for the first, which starts the server). numba starts no thread at import; numpy's
# BLAS pool has its fork handlers (as torch's DataLoader relies on).
_PRELOAD = ["numpy", "torch", "torch.distributed", "numba"]
_ctx = None


def _context():
    """The process's forkserver context, its preload set before the server starts (once)."""
    global _ctx
    if _ctx is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _ctx = ctx
    return _ctx


def _worker(rank, world, port, inbox, outbox, env, cwd):
    # the server's environment is the test process's when the server started: take the one
    # start_rank passed (the test process's now)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                                world_size=world)
        import mp_jobs
        state = {}
        while True:
            job = inbox.get()
            if job is None:
                break
            name, args = job
            try:
                mod, _, fn = name.rpartition(":")
                jobs = __import__(mod) if mod else mp_jobs
                outbox.put(("ok", getattr(jobs, fn)(state, *args)))
            except BaseException as e:  # noqa: BLE001 - reported to the test
                outbox.put(("err", "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc())))
        mp_jobs.teardown(state)
        outbox.put(("ok", "bye"))
    except BaseException as e:  # noqa: BLE001
        outbox.put(("err", "rank %d died: %r\n%s" % (rank, e, traceback.format_exc())))


def start_rank(rank, world, port, env=None):
    """Start rank ``rank`` of a ``world``-rank gloo group on ``port`` (this process's environment
    plus ``env``): returns (process, inbox, outbox)."""
    ctx = _context()
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, **(env or {}))   # PYTHONPATH: processes a rank starts import from tests/
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_worker, args=(rank, world, port, inbox, outbox, env, os.getcwd()),
                       daemon=True)
    proc.start()
    return proc, inbox, outbox


class Ranks:
    """``world`` rank processes. ``run(name, *args)`` -> list of per-rank results (raises on error)."""

    def __init__(self, world, env=None):
        port = free_port()
        self.world = world
        started = [start_rank(r, world, port, env) for r in range(world)]
        self.procs = [s[0] for s in started]
        self.inboxes = [s[1] for s in started]
        self.outboxes = [s[2] for s in started]

    @classmethod
    def start(cls, world, init_job, *args, env=None, timeout=JOB_TIMEOUT_S):
        """A pool of ``world`` ranks that ran ``init_job(*args)`` on every rank (closed again if
        that fails); ``pool.info`` holds the ranks' answers. End it with close_with."""
        r = cls(world, env=env)
        try:
            r.info = r.run(init_job, *args, timeout=timeout)
        except BaseException:
            r.close()
            raise
        return r

    def close_with(self, job, timeout=60):
        """Run ``job`` (a rank's teardown, e.g. "ep_jobs:close") on every rank, then close, even
        when the job fails."""
        try:
            self.run(job, timeout=timeout)
        finally:
            self.close()

    def run(self, name, *args, timeout=JOB_TIMEOUT_S):
        for q in self.inboxes:
            q.put((name, args))
        return self.collect(timeout)

    def collect(self, timeout=JOB_TIMEOUT_S):
        out, errs = [], []
        for r, q in enumerate(self.outboxes):
            try:
                status, val = q.get(timeout=timeout)
            except Exception:  # noqa: BLE001 - queue.Empty
                status, val = "err", "rank %d gave no answer within %d s" % (r, timeout)
            out.append(val)
            if status != "ok":
                errs.append("rank %d: %s" % (r, val))
        if errs:
            raise AssertionError("\n".join(errs))
        return out

    def run_losing(self, victim, name, *args, timeout=JOB_TIMEOUT_S):
        """Run a job in which rank ``victim`` (any rank of a full pool) exits (a killed-rank
        test): the survivors' (status, value) pairs in rank order, unchecked; the victim is joined
        (bounded) and the pool keeps only the survivors' queues (later runs answer in the
        survivors' rank order). End it with close_losing."""
        assert len(self.inboxes) == self.world, "run_losing takes a pool that lost no rank yet"
        for q in self.inboxes:
            q.put((name, args))
        outs = [self.outboxes[i].get(timeout=timeout) for i in range(self.world) if i != victim]
        self.procs[victim].join(timeout=30)
        keep = lambda xs: [x for i, x in enumerate(xs) if i != victim]  # noqa: E731
        self.inboxes, self.outboxes = keep(self.inboxes), keep(self.outboxes)
        return outs

    def close_losing(self, victim, close_job):
        """After run_losing: run ``close_job`` on the survivors, kill the victim if it is still
        there, and close the pool."""
        if self.procs[victim].is_alive():
            self.procs[victim].kill()
        self.procs = [p for i, p in enumerate(self.procs) if i != victim]
        self.close_with(close_job)

    def lose(self, victim):
        """The last rank, ``victim``, is gone (a test made it exit; killed here if it is still
        there): later stops (close) go to the survivors only."""
        assert victim == len(self.inboxes) - 1, "the victim must be the last rank"
        if self.procs[victim].is_alive():
            self.procs[victim].kill()
        self.inboxes = self.inboxes[:victim]

    def close(self):
        for q in self.inboxes:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
