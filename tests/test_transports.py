"""gpunet/transports.py: per-peer transport wiring across ranks (spawned rank processes, gloo).

The jobs below run in the rank processes (tests/mp_ranks.py, "test_transports:<job>"). The
"auto" rule on CUDA (p2p between ranks of one node, the NIC across nodes) runs a real
gpunet.init in those processes on tests/cuda_standin.py's stand-in CUDA platform (no GPU
needed); two nodes are faked by giving one rank another node identity.
"""
import socket

import pytest
import torch

import gpunet
from mp_ranks import Ranks

N = 1024


def _pair_proxy_01(a, b):
    """Ranks 0 and 1 reach each other through the proxy; every other pair (and every rank to
    itself) by ibgda: rank 2 never uses the proxy at all."""
    return "proxy" if {a, b} == {0, 1} else "ibgda"


def job_exchange_all_pairs(state):
    """Every rank puts N int32 (its rank * 1000 + peer) into its slot on every peer with a
    signal, waits for every peer's signal, and returns what landed and the transports."""
    with gpunet.init(transport=_pair_proxy_01, heap_bytes=4 << 20, timeout_s=20.0) as ctx:
        me, n = ctx.rank, ctx.world_size
        src = ctx.alloc((n, N), torch.int32)
        dst = ctx.alloc((n, N), torch.int32)
        sig = ctx.alloc((1,), torch.int64)
        for p in range(n):
            src[p] = me * 1000 + p
        ctx.barrier()
        for p in range(n):
            gpunet.put_signal(ctx.remote(p, dst, me * N), src[p], ctx.remote(p, sig))
        gpunet.wait_until(sig, n)
        gpunet.quiet()
        landed = [int(v) for v in dst[:, 0]]
        whole = all(bool((dst[r] == r * 1000 + me).all()) for r in range(n))
        ctx.barrier()
        return {"transports": dict(ctx.transports), "landed": landed, "whole": whole,
                "ranks_on_gpu": ctx.ranks_on_gpu}


@pytest.fixture(scope="module")
def three():
    r = Ranks(3)
    yield r
    r.close()


def test_a_rank_that_never_uses_the_proxy_beside_one_that_does(three):
    """3 ranks: 0 <-> 1 over the proxy, every pair with rank 2 over ibgda, so rank 2 makes no
    proxy QPs while ranks 0 and 1 make one towards it. Init connects only QPs whose peer made a
    partner (before: KeyError on ranks 0 and 1), and every pair exchanges data over its kind.
    Without a GPU no rank shares one (Context.ranks_on_gpu: the rank itself)."""
    res = three.run("test_transports:job_exchange_all_pairs")
    assert [r["transports"] for r in res] == [
        {0: "ibgda", 1: "proxy", 2: "ibgda"}, {0: "proxy", 1: "ibgda", 2: "ibgda"},
        {0: "ibgda", 1: "ibgda", 2: "ibgda"}]
    for me, r in enumerate(res):
        assert r["landed"] == [s * 1000 + me for s in range(3)], (me, r["landed"])
        assert r["whole"], me
        assert r["ranks_on_gpu"] == (me,), (me, r["ranks_on_gpu"])


# --- "auto" on CUDA: p2p on the same node, the NIC across nodes (gpunet/transports.py) -------------
NODE_A, NODE_B = ("node-a", "0123456789abcdef"), ("node-b", "fedcba9876543210")


def test_settle_auto_is_p2p_on_one_node_and_the_nic_across_nodes():
    """settle_auto: the same node identity -> p2p, the reason naming the host and CUDA IPC (this
    rank itself: its own heap); another node -> the NIC's choice, the reason naming both hosts
    and the NIC's own reason; an unknown node is another node."""
    from gpunet.transports import settle_auto
    nic = ("ibgda", "auto: the soft NIC's doorbell word is host memory registered with the GPU")
    kind, why = settle_auto(nic, NODE_A, NODE_A)
    assert kind == "p2p" and why.startswith("auto: same node (host node-a") and "CUDA IPC" in why
    kind, why = settle_auto(nic, NODE_A, NODE_A, itself=True)
    assert kind == "p2p" and why.startswith("auto: this rank itself (host node-a"), why
    kind, why = settle_auto(nic, NODE_A, NODE_B)
    assert kind == "ibgda" and "another node (host node-b" in why and "node-a" in why, why
    assert why.endswith("the NIC: the soft NIC's doorbell word is host memory registered with the "
                        "GPU") and why.count("auto:") == 1, why
    assert settle_auto(("proxy", "auto: refused"), NODE_A, None)[0] == "proxy"
    assert settle_auto(("ibgda", "x"), None, None)[0] == "ibgda"


def _infos(nodes, asked):
    """Hand-made info() dicts of len(nodes) ranks: rank r on nodes[r], asking asked(r, p) for
    peer p ("auto" is left to settle: its kind before the exchange is ibgda)."""
    out = []
    for r, node in enumerate(nodes):
        kinds = {p: ("ibgda" if asked(r, p) == "auto" else asked(r, p)) for p in range(len(nodes))}
        out.append({"transports": kinds, "node": node,
                    "auto": sorted(p for p in range(len(nodes)) if asked(r, p) == "auto")})
    return out


def test_ranks_on_gpu_count_every_process_of_the_same_gpu_on_the_same_node():
    """ranks_on_gpu (gpunet.ep's grid splits a GPU's SMs among them): the ranks whose info names
    this rank's GPU on this node, whatever their transport; the same GPU id on another node is
    another GPU; without a GPU identity (the CPU platform) only the rank itself."""
    from gpunet.transports import ranks_on_gpu
    infos = [{"node": NODE_A, "gpu": "GPU-0"}, {"node": NODE_A, "gpu": "GPU-1"},
             {"node": NODE_A, "gpu": "GPU-0"}, {"node": NODE_B, "gpu": "GPU-0"},
             {"node": NODE_A, "gpu": None}]
    assert ranks_on_gpu(infos, 0) == (0, 2) and ranks_on_gpu(infos, 2) == (0, 2)
    assert ranks_on_gpu(infos, 1) == (1,) and ranks_on_gpu(infos, 3) == (3,)
    assert ranks_on_gpu(infos, 4) == (4,)


def test_settled_kinds_agree_on_both_ends_of_every_pair():
    """settled_kinds over 4 ranks on two nodes (0, 1, 2 on A, 3 on B), all "auto": p2p within a
    node (and to itself), ibgda across; kinds[i][j] == kinds[j][i] for every pair. A rank asking
    "ibgda" by name for a same-node peer stays ibgda there (only "auto" settles)."""
    from gpunet.transports import settled_kinds
    everyone = _infos([NODE_A, NODE_A, NODE_A, NODE_B], lambda a, b: "auto")
    kinds = [settled_kinds(everyone, r) for r in range(4)]
    for i in range(4):
        for j in range(4):
            same = (i == 3) == (j == 3)
            assert kinds[i][j] == ("p2p" if same else "ibgda"), (i, j, kinds[i])
            assert kinds[i][j] == kinds[j][i]
    named = _infos([NODE_A, NODE_A], lambda a, b: "ibgda" if a != b else "auto")
    assert [settled_kinds(named, r) for r in range(2)] == [{0: "p2p", 1: "ibgda"},
                                                           {0: "ibgda", 1: "p2p"}]


def test_auto_on_the_cpu_platform_stays_the_soft_nic():
    """CPU platform: "auto" is the NIC for every peer, this rank too (the CPU maps no peer's
    arena under auto): ibgda, nothing left to settle, nothing exported."""
    from gpunet.host.platform import Platform
    from gpunet.host.softnic import SoftNic
    from gpunet.transports import Transports
    with SoftNic(arena_bytes=8 << 20) as nic:
        buf = nic.alloc(1 << 16, 4096)
        t = Transports(nic, Platform("cpu"), 0, 2, "auto", lambda: "mapped",
                       heap=(buf.ctypes.data, buf.nbytes))
        info = t.info()
        assert t.kinds == {0: "ibgda", 1: "ibgda"} and info["auto"] == [] and info["p2p"] is None
        assert info["node"] == t.node and t.reasons[1] == "auto: mapped"
        t.close()


def job_standin_init(state, transport, node=None, refuse=None, heap_bytes=1 << 20):
    """gpunet.init on tests/cuda_standin.py's stand-in CUDA platform (``node``: {rank: node
    identity} for the ranks that look as if on another machine; ``refuse``: {rank: [peers]} whose
    heap that rank's ipc_open refuses). Returns how it raised, or the transports and what the
    heap is; the Context stays in ``state`` for job_standin_close."""
    import time

    import torch.distributed as dist
    from cuda_standin import StandInCudaPlatform, standin_cuda

    me = dist.get_rank()
    plat = StandInCudaPlatform(me, refuse=(refuse or {}).get(me, ()))
    t0 = time.monotonic()
    try:
        with standin_cuda(plat, node=(node or {}).get(me)):
            ctx = gpunet.init(transport=transport, nic="soft", heap_bytes=heap_bytes,
                              timeout_s=5.0)
    except gpunet.GpunetError as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    state["ctx"] = ctx
    return {"raised": None, "transports": dict(ctx.transports), "reasons": dict(ctx.reasons),
            "platform": ctx.platform.name, "device_heap": ctx._device_heap,
            "heap_is_device_memory": any(a.base == ctx.heap_base for a in plat.allocations),
            "heap_in_nic_arena": any(b <= ctx.heap_base < b + n
                                     for b, n in ctx.nic.mapped_ranges()),
            "p2p_peers": sorted(ctx._transports.peer_heaps),
            "nic_mapped_peers": sorted(ctx._transports.dma_heaps)}


def job_standin_close(state):
    """Close the stand-in Context (the close barrier with the peers that map its heap); returns
    the seconds it took."""
    import time
    ctx = state.pop("ctx")
    t0 = time.monotonic()
    ctx.close()
    return time.monotonic() - t0


def _standin(three, transport, node=None, refuse=None):
    """job_standin_init on the pool's 3 ranks; the Contexts made are closed again (together, so
    each close barrier hears from its peers within the bound)."""
    out = three.run("test_transports:job_standin_init", transport, node, refuse)
    if all(o["raised"] is None for o in out):
        closes = three.run("test_transports:job_standin_close")
        assert all(s < 4.0 for s in closes), closes      # every peer answered (bound: 5 s)
    return out


def test_auto_on_cuda_is_p2p_between_ranks_of_one_node(three):
    """Stand-in CUDA, 3 ranks on this node, transport="auto": every pair (and each rank to
    itself) is p2p, the reason says same node / itself and the host; each rank opened both
    peers' heaps for p2p and none for the NIC; the heap is device memory, not the NIC's arena."""
    out = _standin(three, "auto")
    for me, o in enumerate(out):
        assert o["raised"] is None, o
        assert o["platform"] == "cuda" and o["transports"] == {0: "p2p", 1: "p2p", 2: "p2p"}, o
        for p, why in o["reasons"].items():
            want = ("auto: this rank itself" if p == me
                    else "auto: same node (host %s" % socket.gethostname())
            assert why.startswith(want), (me, p, why)
        assert "CUDA IPC" in o["reasons"][(me + 1) % 3], o["reasons"]
        assert o["p2p_peers"] == [p for p in range(3) if p != me] and o["nic_mapped_peers"] == []
        assert o["heap_is_device_memory"] and not o["heap_in_nic_arena"], o


def test_auto_on_cuda_reaches_a_rank_on_another_node_through_the_nic(three):
    """Stand-in CUDA, rank 2 with another node identity (a mixed world: two nodes), "auto": 0
    and 1 are p2p to each other, each rank p2p to itself, and every pair with rank 2 ibgda on
    BOTH ends, the reason naming the other node; the soft NIC of each end maps the other's device
    heap for its copy engine."""
    out = _standin(three, "auto", node={2: NODE_B})
    kinds = [o["transports"] for o in out]
    assert kinds == [{0: "p2p", 1: "p2p", 2: "ibgda"}, {0: "p2p", 1: "p2p", 2: "ibgda"},
                     {0: "ibgda", 1: "ibgda", 2: "p2p"}], out
    for i in range(3):
        for j in range(3):
            assert kinds[i][j] == kinds[j][i]
    assert "another node (host node-b" in out[0]["reasons"][2], out[0]["reasons"]
    assert "another node (host %s" % socket.gethostname() in out[2]["reasons"][0], out[2]
    assert out[0]["p2p_peers"] == [1] and out[0]["nic_mapped_peers"] == [2]
    assert out[2]["p2p_peers"] == [] and out[2]["nic_mapped_peers"] == [0, 1]


def test_a_nic_only_cuda_world_keeps_the_host_mapped_heap(three):
    """Stand-in CUDA, transport="ibgda" (no p2p and no auto anywhere): every heap stays in the
    soft NIC's host-mapped arena (gpunet/context.py: the device heap goes with p2p / auto), so no
    rank maps a peer's heap for its copy engine."""
    out = _standin(three, "ibgda")
    for me, o in enumerate(out):
        assert o["raised"] is None and set(o["transports"].values()) == {"ibgda"}, o
        assert not o["device_heap"] and not o["heap_is_device_memory"] and o["heap_in_nic_arena"], o
        assert o["p2p_peers"] == [] and o["nic_mapped_peers"] == [], o


def test_a_heap_auto_cannot_open_raises_naming_the_peer_on_every_rank(three):
    """Stand-in CUDA, "auto", rank 0's ipc_open refuses rank 2's heap (no peer access between
    the GPUs): init raises ConfigError on every rank, promptly, each message naming peer 2 and
    saying to pass 'ibgda' or 'proxy' for it (rank 0 its own error, the others the collective's
    naming rank 0)."""
    out = _standin(three, "auto", refuse={0: [2]})
    for me, o in enumerate(out):
        assert o["raised"] == "ConfigError", (me, o)
        assert "transport='auto' to peer 2" in o["message"] and "error 217" in o["message"], o
        assert "pass transport='ibgda' or 'proxy' for peer 2" in o["message"], o
        assert o["seconds"] < 30, o
    assert "failed on rank 0" in out[1]["message"] and "failed on rank 0" in out[2]["message"]


def test_a_pair_asked_by_name_stays_and_a_pair_asked_two_ways_is_refused(three):
    """Stand-in CUDA, per-peer choices: ranks 0 and 1 ask "ibgda" for each other, "auto" for
    everyone else: that pair stays ibgda on both ends (only "auto" settles), every other pair is
    p2p. Then only rank 0 asks "ibgda" for rank 2, whose "auto" settles p2p: ConfigError on every
    rank naming both ends' kinds."""
    out = _standin(three, _Pair01())
    assert [o["transports"] for o in out] == [{0: "p2p", 1: "ibgda", 2: "p2p"},
                                              {0: "ibgda", 1: "p2p", 2: "p2p"},
                                              {0: "p2p", 1: "p2p", 2: "p2p"}], out
    assert out[0]["reasons"][1].startswith("per-peer choice 'ibgda'"), out[0]["reasons"]
    assert out[0]["reasons"][2].startswith("per-peer choice 'auto'; auto: same node"), out[0]
    for o in _standin(three, _OnlyRank0AsksIbgdaFor2()):
        assert o["raised"] == "ConfigError", o
        assert "rank 0 reaches rank 2 by ibgda, but rank 2 reaches rank 0 by p2p (auto)" \
            in o["message"], o


class _Pair01:
    """(rank, peer) -> "ibgda" between ranks 0 and 1, else "auto" (picklable: a class)."""

    def __call__(self, a, b):
        return "ibgda" if {a, b} == {0, 1} else "auto"


class _OnlyRank0AsksIbgdaFor2:
    """Asymmetric on purpose: rank 0 asks "ibgda" for rank 2, everyone else "auto"."""

    def __call__(self, a, b):
        return "ibgda" if (a, b) == (0, 2) else "auto"
