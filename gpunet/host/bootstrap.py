"""Rank exchange for gpunet's setup over torch.distributed: allgather / alltoall of small objects.

gpunet exchanges only small, picklable control data at setup: per-peer QP info dicts, MR addresses
and rkeys, shared-memory names. All of it goes through torch.distributed's object collectives
(``all_gather_object``) on whatever group and backend the application already uses (gloo on the
CPU, nccl on a GPU) — no rendezvous of our own.

Misuse is detected collectively: each rank pickles and checks its contribution locally and sends a
marker instead when it is bad, so a bad call on one rank raises ``ConfigError`` on *every* rank
(naming the rank at fault) rather than leaving the others waiting for the group timeout.
``collective(what, fn)`` is that rule for every collective step of gpunet (init, alloc, free): a
rank runs its local part, then exactly one exchange carries its result or its failure, and every
rank returns together or raises together.
"""
import datetime
import os
import pickle
import socket

from gpunet.errors import ClosedError, ConfigError, GpunetError
from gpunet.resource import Resource

# torchrun's variables; all four are needed to join a group from the environment.
_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

# How long a collective may wait for the slowest rank before torch raises. Setup exchanges are
# small; a rank that has not arrived in this time has died or is stuck in a different call.
DEFAULT_TIMEOUT_S = 300

# The default process group that from_env started (None when it started none, or it is gone) and
# how many open Bootstraps hold it. Every Bootstrap from_env makes while that group is the default
# one holds it, not only the one that started it: two gpunet.init() in one torchrun process share
# the group, and closing the first destroyed it under the second. The last holder to close
# destroys it.
# tests/test_api_adversarial.py::test_contexts_sharing_the_group_gpunet_started_keep_it_until_the_last_closes
_own_group = None
_own_group_holders = 0


def free_port():
    """A TCP port on 127.0.0.1 free right now: the rendezvous port of a one-machine process group
    (tests, the demo). Loopback only."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Bad:
    """Sent in place of a contribution a rank could not make; every rank then raises.

    ``kind``: the name of the gpunet error class the failing rank raised (the others raise the
    same class, so a full heap on one rank is a ConfigError everywhere); other failures travel as
    GpunetError.
    """

    def __init__(self, reason, kind="ConfigError"):
        self.reason = reason
        self.kind = kind


def _error_class(kind):
    from gpunet import errors
    cls = getattr(errors, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, errors.GpunetError) else GpunetError


def _raise_bad(bad, what="bootstrap exchange"):
    """Raise, for [(rank, _Bad), ...], the error of the first failing rank naming every one."""
    first = bad[0][1]
    raise _error_class(first.kind)(
        "%s failed on rank%s %s: %s" % (what, "s" if len(bad) > 1 else "",
                                        ", ".join(str(r) for r, _ in bad),
                                        "; ".join("rank %d: %s" % (r, b.reason) for r, b in bad)
                                        if len(bad) > 1 else first.reason))


class Bootstrap(Resource):
    """Setup-time exchange among the ranks of a torch.distributed group.

    Args:
        group: a ``torch.distributed`` process group, or None for the default (WORLD) group.
            torch.distributed must already be initialised; ``Bootstrap.from_env()`` initialises
            it from torchrun's environment.

    Attributes: ``rank`` (this process's rank in ``group``), ``world_size`` (ranks in ``group``).
    A gpunet.resource.Resource (a context manager; ``close()`` is idempotent): closing destroys
    the process group only if ``from_env`` created it and no other Bootstrap from ``from_env``
    still holds it.
    """

    def __init__(self, group=None, _owns_group=False):
        import torch.distributed as dist
        if not dist.is_available():
            raise ConfigError("this torch build has no torch.distributed; gpunet needs it for "
                              "multi-rank setup (Bootstrap.from_env() without torchrun variables "
                              "gives a single-process bootstrap)")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ConfigError(f"group must be a torch.distributed process group (or None for the "
                              f"default group), not {type(group).__name__}")
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call "
                              "torch.distributed.init_process_group(...) first, or use "
                              "Bootstrap.from_env() (torchrun variables or a single process)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ConfigError("this process is not a member of the given process group")
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self._owns_group = _owns_group
        if _owns_group:              # last: a constructor that raised is never closed
            global _own_group, _own_group_holders
            _own_group = dist.group.WORLD
            _own_group_holders += 1

    @classmethod
    def from_env(cls, backend=None, timeout_s=DEFAULT_TIMEOUT_S):
        """A Bootstrap for this process, initialising torch.distributed if needed.

        - torch.distributed already initialised: the default group (as ``Bootstrap()``); when
          an earlier ``from_env`` started it, this one holds it too.
        - torchrun variables set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): initialise with
          ``init_method="env://"`` and ``backend`` (default gloo on the CPU, nccl when torch sees
          a GPU; on MACA torch's "nccl" is its own collective library — *unverified*). On a GPU,
          sets the current device to LOCAL_RANK first (nccl's object collectives use the current
          device). The group is destroyed when the last Bootstrap holding it closes.
        - none of them set: a single-process bootstrap (rank 0, world_size 1) that does not touch
          torch.distributed at all: allgather_obj returns ``[obj]``, alltoall_obj a copy of its
          list, barrier returns at once.
        - only some set: ConfigError naming the missing ones.
        """
        import torch
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return cls(_owns_group=_own_group is not None and dist.group.WORLD is _own_group)
        present = [v for v in _ENV_VARS if os.environ.get(v)]
        if not present:
            return LocalBootstrap()
        missing = [v for v in _ENV_VARS if v not in present]
        if missing:
            raise ConfigError(f"torchrun environment is incomplete: {', '.join(present)} set but "
                              f"{', '.join(missing)} missing; launch with torchrun, set all of "
                              f"{', '.join(_ENV_VARS)}, or unset them for a single process")
        if not dist.is_available():
            raise ConfigError("this torch build has no torch.distributed")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend=backend, init_method="env://",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise GpunetError(f"torch.distributed.init_process_group(backend={backend!r}, "
                              f"env://) failed: {e}. Check MASTER_ADDR/MASTER_PORT are reachable "
                              f"from every rank and RANK < WORLD_SIZE.") from e
        return cls(_owns_group=True)

    def _check_open(self):
        if self.closed:
            raise ClosedError("this Bootstrap is closed")

    def _exchange(self, payload):
        """all_gather_object of one payload per rank; a torch.distributed failure (a rank died,
        the group timed out) becomes a GpunetError naming the call."""
        out = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, payload, group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo / nccl raise RuntimeError and friends
            raise GpunetError(f"bootstrap exchange over torch.distributed ({self.backend}) failed: "
                              f"{type(e).__name__}: {e}. A rank died, or is stuck in a different "
                              f"call, or the group timed out.") from e
        return out

    def _gather_pickled(self, payload):
        """all_gather_object of a locally pickled payload (or a _Bad); unpickles, raises on _Bad."""
        out = self._exchange(payload)
        bad = [(r, item) for r, item in enumerate(out) if isinstance(item, _Bad)]
        if bad:
            _raise_bad(bad)
        return [pickle.loads(item) for item in out]

    def collective(self, what, fn, *args, undo=None):
        """One collective step: ``fn(*args)`` on this rank, then ONE exchange of its outcome.

        Returns every rank's result (a list by rank; results must be picklable). If ``fn``
        raised on any rank, every rank raises promptly instead of waiting in a later call: the
        failing rank its own exception after the exchange (a GpunetError wrapping it if it was
        not one), every other rank the same gpunet error class naming the failing rank(s) and why; ``undo(result)`` first takes back what a
        successful ``fn`` did on those other ranks, and what it did here when the exchange itself
        raises (its error then propagates). ``what`` names the step in messages.
        Collective: every rank of the group calls it, in the same order as other collectives.
        tests/test_api_adversarial.py::test_a_collective_that_fails_on_one_rank_raises_on_every_rank.
        """
        self._check_open()
        err = res = None
        try:
            res = fn(*args)
            payload = pickle.dumps(res)
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
            err = e
            kind = type(e).__name__ if isinstance(e, GpunetError) else "GpunetError"
            payload = _Bad(f"{type(e).__name__}: {e}" if kind == "GpunetError" else str(e), kind)
        try:
            out = self._exchange(payload)
        except BaseException:
            # this rank never learned that every rank succeeded, so it keeps nothing of fn: a
            # range alloc kept here alone would put every later alloc at another offset than the
            # peers'. tests/test_api_adversarial.py::test_an_alloc_whose_exchange_fails_gives_its_range_back
            if err is None and undo is not None:
                undo(res)
            raise
        if isinstance(err, GpunetError):
            raise err
        if err is not None:
            raise GpunetError(f"{what} failed on rank {self.rank}: {type(err).__name__}: "
                              f"{err}") from err
        bad = [(r, item) for r, item in enumerate(out) if isinstance(item, _Bad)]
        if bad:
            if undo is not None:
                undo(res)
            _raise_bad(bad, what)
        return [pickle.loads(item) for item in out]

    def allgather_obj(self, obj):
        """Every rank's ``obj``, as a list indexed by rank (``len == world_size``).

        ``obj``: any picklable object (e.g. this rank's QP info dict). Collective: every rank of
        the group must call it, in the same order as the other collectives.
        """
        self._check_open()
        try:
            payload = pickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - pickling can raise almost anything
            payload = _Bad(f"allgather_obj: object of type {type(obj).__name__} is not "
                           f"picklable ({e})")
        return self._gather_pickled(payload)

    def alltoall_obj(self, objs):
        """Personalised exchange: ``objs[j]`` goes to rank ``j``; returns ``out`` with ``out[i]``
        what rank ``i`` meant for this rank.

        ``objs``: a list (or tuple) of ``world_size`` picklable objects (e.g. the QPN of the QP
        this rank created for each peer). Built on one all_gather_object of the whole lists, so
        each rank receives ``world_size`` lists: fine for setup-sized objects, not for data.
        """
        self._check_open()
        if not isinstance(objs, (list, tuple)):
            payload = _Bad(f"alltoall_obj wants a list of {self.world_size} objects, one per "
                           f"rank, not {type(objs).__name__}")
        elif len(objs) != self.world_size:
            payload = _Bad(f"alltoall_obj got {len(objs)} objects, but the group has "
                           f"{self.world_size} ranks (one object per destination rank)")
        else:
            try:
                payload = pickle.dumps(list(objs))
            except Exception as e:  # noqa: BLE001
                payload = _Bad(f"alltoall_obj: an object is not picklable ({e})")
        lists = self._gather_pickled(payload)
        return [lists[src][self.rank] for src in range(self.world_size)]

    def broadcast_obj(self, obj=None, src=0):
        """``obj`` from rank ``src`` (a rank of this group), returned on every rank."""
        self._check_open()
        if not 0 <= src < self.world_size:
            raise ConfigError(f"src={src} is not a rank of this group (world_size "
                              f"{self.world_size})")
        return self.allgather_obj(obj if self.rank == src else None)[src]

    def barrier(self):
        """Wait until every rank of the group has called barrier()."""
        self._check_open()
        try:
            self._dist.barrier(group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo / nccl errors
            raise GpunetError(f"bootstrap barrier over torch.distributed ({self.backend}) failed: "
                              f"{type(e).__name__}: {e}") from e

    def _release(self):
        """Destroy the process group if ``from_env`` created it and this is its last holder."""
        global _own_group, _own_group_holders
        if not self._owns_group:
            return
        _own_group_holders -= 1
        if _own_group_holders == 0:
            # the application may have destroyed it and started its own since: not ours to end
            if self._dist.is_initialized() and self._dist.group.WORLD is _own_group:
                self._dist.destroy_process_group()
            _own_group = None

    def __repr__(self):
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"backend={getattr(self, 'backend', None)!r})")


class LocalBootstrap(Bootstrap):
    """The single-process bootstrap (rank 0 of 1) that ``from_env`` returns without torchrun.

    It never touches torch.distributed; its collectives still pickle, so an object that would
    fail to cross processes fails here too.
    """

    def __init__(self):  # noqa: D107 - no torch.distributed group behind it
        self.group = None
        self.rank = 0
        self.world_size = 1
        self.backend = None
        self._owns_group = False

    def _exchange(self, payload):
        return [payload]

    def barrier(self):
        self._check_open()
