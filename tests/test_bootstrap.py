"""Bootstrap over torch.distributed (gloo, 127.0.0.1 only): object collectives, barrier, misuse.

Multi-rank tests start 2 and 4 processes with torch.multiprocessing (fork); every check runs inside the
ranks, and a failed assertion on any rank fails the test.
"""
import os

import pytest
import torch.multiprocessing as mp

from gpunet.errors import ClosedError, ConfigError, GpunetError
from gpunet.host.bootstrap import Bootstrap, LocalBootstrap, free_port

_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _expect_config_error_everywhere(fn, fragment):
    try:
        fn()
    except ConfigError as e:
        assert fragment in str(e), str(e)
    else:
        raise AssertionError(f"expected ConfigError containing {fragment!r}")


def _rank_main(rank, world_size, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")
    with Bootstrap.from_env(backend="gloo", timeout_s=30) as bs:
        assert (bs.rank, bs.world_size) == (rank, world_size)

        # allgather_obj: list indexed by rank, objects intact (dicts as QP info would be).
        info = {"rank": rank, "qpn": 0x100 + rank, "shm": f"gpunet-{rank}", "rkey": rank << 8}
        got = bs.allgather_obj(info)
        assert got == [{"rank": r, "qpn": 0x100 + r, "shm": f"gpunet-{r}", "rkey": r << 8}
                       for r in range(world_size)]

        # alltoall_obj: out[i] is what rank i meant for me.
        out = bs.alltoall_obj([("from", rank, "to", j) for j in range(world_size)])
        assert out == [("from", i, "to", rank) for i in range(world_size)]

        assert bs.broadcast_obj({"root": rank} if rank == world_size - 1 else None,
                                src=world_size - 1) == {"root": world_size - 1}

        # barrier: after it, every rank has done what it did before it.
        open(os.path.join(tmpdir, f"before-{rank}"), "w").close()
        bs.barrier()
        assert sorted(os.listdir(tmpdir)) == sorted(f"before-{r}" for r in range(world_size))

        # misuse on one rank raises on every rank (no rank left waiting).
        bad = 1
        objs = list(range(world_size + (1 if rank == bad else 0)))
        _expect_config_error_everywhere(lambda: bs.alltoall_obj(objs), f"rank {bad}")
        unpicklable = (lambda: 0) if rank == 0 else 0
        _expect_config_error_everywhere(lambda: bs.allgather_obj(unpicklable), "rank 0")

        # collective(): a step that fails on one rank raises on EVERY rank, with the failing
        # rank's error class and naming it; the ranks where the step succeeded undo it
        undone = []

        def step():
            if rank == bad:
                raise ConfigError("no room here")
            return rank * 2

        _expect_config_error_everywhere(lambda: bs.collective("step", step, undo=undone.append),
                                        "no room here")
        assert undone == ([] if rank == bad else [rank * 2])

        def boom():                       # not a gpunet error: GpunetError everywhere
            if rank == 0:
                raise ValueError("boom")
            return 1
        try:
            bs.collective("boom step", boom)
        except GpunetError as e:
            assert "boom step failed on rank 0" in str(e) and "ValueError: boom" in str(e), str(e)
            assert not isinstance(e, ConfigError)
        else:
            raise AssertionError("collective() must raise on every rank")
        assert bs.collective("ok step", lambda: rank + 1) == list(range(1, world_size + 1))

        # the Bootstrap still works after collective misuse errors
        assert bs.allgather_obj(rank) == list(range(world_size))

        if world_size == 4:   # a subgroup: ranks are group-relative
            import torch.distributed as dist
            sub = dist.new_group([1, 3])
            if rank in (1, 3):
                sb = Bootstrap(group=sub)
                assert sb.world_size == 2 and sb.rank == (0 if rank == 1 else 1)
                assert sb.allgather_obj(rank * 10) == [10, 30]
                assert sb.alltoall_obj([f"{rank}->0", f"{rank}->1"]) == \
                    [f"1->{sb.rank}", f"3->{sb.rank}"]
            bs.barrier()
    assert bs.closed
    try:
        bs.allgather_obj(1)
    except ClosedError:
        pass
    else:
        raise AssertionError("a closed Bootstrap must raise ClosedError")


@pytest.mark.parametrize("world_size", [2, 4])
def test_object_collectives_and_barrier_across_ranks(world_size, tmp_path):
    """allgather_obj / alltoall_obj / broadcast_obj / barrier are correct on 2 and 4 gloo ranks,
    a misuse on one rank raises ConfigError on all of them, and collective() raises a step's
    failure on one rank on every rank (its class, naming the rank) after undoing it elsewhere."""
    # fork, not spawn: the ranks inherit the imported torch instead of importing it again (seconds
    # per rank on a loaded 2-core CI box); the parent has no process group or CUDA state to copy.
    # (After CUDA was initialised in this process a forked child could not use it: spawn then.)
    import torch
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_rank_main, args=(world_size, free_port(), str(tmp_path)),
                       nprocs=world_size, join=True, start_method=method)


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for v in _TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)


def test_from_env_without_torchrun_is_single_process(no_torchrun_env):
    """No torchrun variables: rank 0 of 1; collectives are identities; misuse still raises."""
    bs = Bootstrap.from_env()
    assert isinstance(bs, LocalBootstrap)
    assert (bs.rank, bs.world_size) == (0, 1)
    assert bs.allgather_obj({"qpn": 7}) == [{"qpn": 7}]
    assert bs.alltoall_obj(["me"]) == ["me"]
    assert bs.broadcast_obj("x") == "x"
    bs.barrier()
    assert bs.collective("step", lambda: 5) == [5]
    with pytest.raises(ConfigError, match="nope"):
        bs.collective("step", lambda: (_ for _ in ()).throw(ConfigError("nope")))
    with pytest.raises(ConfigError, match="group must be a torch.distributed process group"):
        Bootstrap(group="world")
    with pytest.raises(ConfigError, match="got 2 objects"):
        bs.alltoall_obj([1, 2])
    with pytest.raises(ConfigError, match="not picklable"):
        bs.allgather_obj(lambda: 0)
    bs.close()
    with pytest.raises(ClosedError):
        bs.barrier()


def test_from_env_with_partial_torchrun_env_names_missing_vars(no_torchrun_env, monkeypatch):
    """Some torchrun variables but not all: ConfigError naming the missing ones."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="MASTER_PORT, WORLD_SIZE missing"):
        Bootstrap.from_env()


def test_bootstrap_without_init_process_group_says_what_to_do():
    """Bootstrap() before init_process_group raises ConfigError pointing at from_env."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this test process")
    with pytest.raises(ConfigError, match="init_process_group"):
        Bootstrap()
