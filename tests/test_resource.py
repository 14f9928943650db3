"""One lifecycle contract (gpunet/resource.py), checked once for every Resource subclass.

For each resource owner of gpunet (the Context, the soft NIC, the proxy engine and channel, a
platform allocation, the bootstraps, the DevX NIC, device-memory copies, the NIC's GPU mapping,
the transports, the launcher), made for real on the CPU platform:
- it uses the base's close / __enter__ / __exit__ (one meaning of close everywhere);
- close is idempotent, and ``with`` closes it, also when the block raises (the block's exception
  propagates);
- children close before the object's own release, last adopted first, and every failure is
  collected: one CloseError naming it, after everything else was still released.
A last test finds every Resource subclass in the package, so a new resource owner must join the
table below.
"""
import importlib
import types

import numpy as np
import pytest

from gpunet.errors import CloseError
from gpunet.resource import Resource
from test_layers import MODULES


def _soft_nic():
    from gpunet.host.softnic import SoftNic
    return SoftNic(arena_bytes=8 << 20)


def _platform():
    from gpunet.host.platform import Platform
    return Platform("cpu", detected_by="tests/test_resource.py")


def make_context(cleanup):
    import gpunet
    return gpunet.init(heap_bytes=1 << 20, timeout_s=10.0)


def make_soft_nic(cleanup):
    return _soft_nic()


def make_proxy_channel(cleanup):
    from gpunet.host.proxy import ProxyChannel
    return ProxyChannel(8)


def make_proxy_engine(cleanup):
    from gpunet.host.proxy import ProxyChannel, ProxyEngine
    ch = ProxyChannel(8)
    cleanup.append(ch.close)
    heap = np.zeros(4096, np.uint8)
    cleanup.append(lambda: heap)
    return ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True)


def make_allocation(cleanup):
    return _platform().alloc("host", 4096)


def make_bootstrap(cleanup, tmp_path_factory=None):
    """A one-rank torch.distributed group of its own (gloo, file store): the Bootstrap owns it."""
    import torch.distributed as dist

    from gpunet.host.bootstrap import Bootstrap
    if dist.is_initialized():       # another test's group: the Bootstrap must not destroy it
        return Bootstrap()
    import tempfile
    store = dist.FileStore(tempfile.mktemp(prefix="gpunet-test-resource-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return Bootstrap(_owns_group=True)


def make_local_bootstrap(cleanup):
    from gpunet.host.bootstrap import LocalBootstrap
    return LocalBootstrap()


def make_devx_nic(cleanup):
    """The DevX NIC (gpunet/host/devx.py) over tests/fake_devx.py's recording stand-in for rdma-core (no
    RDMA device here): ``nic.fake.closed`` records what its close released, in order."""
    from fake_devx import fake_nic
    nic, fake = fake_nic(arena_bytes=1 << 20)
    nic.create_qp(nic.create_cq(16))
    nic.fake = fake
    return nic


def make_device_memory(cleanup):
    from gpunet.device.descriptors import DeviceMemory
    m = DeviceMemory(_platform())
    m.put(np.arange(16, dtype=np.uint64))
    m.zeros(64)
    return m


def make_nic_mapping(cleanup):
    from gpunet.device.descriptors import NicMapping
    nic = _soft_nic()
    cleanup.append(nic.close)
    return NicMapping(_platform(), nic)


def make_transports(cleanup):
    from gpunet.transports import Transports
    nic = _soft_nic()
    cleanup.append(nic.close)
    return Transports(nic, _platform(), 0, 1, "ibgda", lambda: "probed by the test")


def make_launcher(cleanup):
    from gpunet._launch import Launcher
    nic = _soft_nic()
    cleanup.append(nic.close)
    return Launcher(nic, False, 32)


def make_peer_heap(cleanup):
    """A PeerHeap: another soft NIC's heap range mapped here (the p2p transport's mapping)."""
    owner = _soft_nic()
    cleanup.append(owner.close)
    buf = owner.alloc(4096, 4096)
    return _soft_nic_for(cleanup).map_peer_heap(owner.export_heap(buf.ctypes.data, 4096))


def make_ipc_mapping(cleanup):
    """An IpcMapping (a peer's device heap opened by CUDA IPC) over a runtime stand-in that
    records cudaIpcCloseMemHandle: no GPU here (tests/test_p2p_cuda.py opens real ones)."""
    from gpunet.host.platform import IpcMapping, _CUDA_API
    calls = []
    rt = types.SimpleNamespace(api=_CUDA_API, call=lambda name, *a: calls.append(name))
    return IpcMapping(types.SimpleNamespace(runtime=lambda: rt), 0x7f0000000000, 4096)


def make_copy_engine(cleanup):
    """A CopyEngine (the soft NIC's way into device memory) over a stream-destroy stand-in: no
    GPU here (tests/test_p2p_cuda.py attaches real ones through gpunet.init on CUDA)."""
    from gpunet.host.platform import CopyEngine
    return CopyEngine(types.SimpleNamespace(name="cuda"), 1, 2, 4, 0x10, destroy=lambda: None)


def _soft_nic_for(cleanup):
    nic = _soft_nic()
    cleanup.append(nic.close)
    return nic


FACTORIES = {
    "Context": make_context, "SoftNic": make_soft_nic, "ProxyChannel": make_proxy_channel,
    "ProxyEngine": make_proxy_engine, "Allocation": make_allocation, "Bootstrap": make_bootstrap,
    "LocalBootstrap": make_local_bootstrap, "DevxNic": make_devx_nic,
    "DeviceMemory": make_device_memory, "NicMapping": make_nic_mapping,
    "Transports": make_transports, "Launcher": make_launcher, "PeerHeap": make_peer_heap,
    "IpcMapping": make_ipc_mapping, "CopyEngine": make_copy_engine,
}
ABSTRACT = {"Nic"}              # gpunet/host/nic.py's interface: its implementations are in FACTORIES


@pytest.fixture
def made(request):
    """(the resource made by FACTORIES[param], its cleanup list run after the test)."""
    cleanup = []
    obj = FACTORIES[request.param](cleanup)
    yield obj
    try:
        obj.close()
    except CloseError:
        pass
    for fn in reversed(cleanup):
        fn()


ALL = pytest.mark.parametrize("made", sorted(FACTORIES), indirect=True)


@ALL
def test_uses_the_base_lifecycle(made):
    """close, __enter__ and __exit__ are the base's: one meaning of close for every owner."""
    cls = type(made)
    assert isinstance(made, Resource)
    for name in ("close", "__enter__", "__exit__"):
        assert getattr(cls, name) is getattr(Resource, name), "%s overrides %s" % (cls.__name__, name)
    assert not made.closed


@ALL
def test_close_is_idempotent_and_with_closes_it(made):
    """``with x as y`` gives x back and closes it; a second and third close do nothing."""
    with made as got:
        assert got is made and not made.closed
    assert made.closed
    made.close()
    made.close()
    assert made.closed


@ALL
def test_with_closes_when_the_block_raises_and_the_block_error_propagates(made):
    """An exception in the block propagates unchanged, and the resource is closed."""
    with pytest.raises(KeyError, match="from the block"):
        with made:
            raise KeyError("from the block")
    assert made.closed


@ALL
def test_children_close_first_last_adopted_first_and_errors_are_collected(made):
    """Three children adopted on top of the object's own: the last adopted closes first, a
    failing one does not stop the others nor the object's own release, and close raises ONE
    CloseError naming the failure; a second close raises nothing."""
    order = []
    own = made._release
    made._release = lambda: (order.append("own release"), own())
    made._adopt(lambda: order.append("first"), "first child")
    made._adopt(lambda: (order.append("failing"), 1 / 0), "failing child")
    made._adopt(lambda: order.append("last"), "last child")
    with pytest.raises(CloseError) as ei:
        made.close()
    assert order == ["last", "failing", "first", "own release"]
    assert [what for what, _ in ei.value.errors] == ["failing child"]
    assert isinstance(ei.value.errors[0][1], ZeroDivisionError)
    assert "failing child" in str(ei.value) and made.closed
    made.close()


def test_the_context_closes_its_children_in_the_stated_order():
    """Context: launcher first (no kernel still running), then the close barrier with the peers
    that map its heap (while the transports still map theirs), then the transports (proxy
    engine, then its channels), the NIC, the bootstrap last; all closed afterwards."""
    import gpunet
    ctx = gpunet.init(transport="proxy", heap_bytes=1 << 20)
    names = [n for n, _ in ctx._children]
    assert names == ["bootstrap", "NIC", "transports",
                     "close barrier with the peers that map this heap", "launcher"], names
    t = ctx._transports
    assert [n for n, _ in t._children] == ["proxy channel 0", "proxy engine"]
    engine, channel, nic = t.engine, t.channels[0], ctx.nic
    ctx.close()
    assert engine.closed and channel.closed and nic.closed and ctx._boot.closed
    assert engine.alive_threads() == []


def test_devx_nic_releases_queues_before_memory_and_the_context_last():
    """DevxNic (over the rdma-core stand-in): the QP before its CQ, UMEMs after both, the PD and
    the device context last (tests/test_devx.py checks the whole order)."""
    nic = make_devx_nic([])
    nic.close()
    kinds = [k for k, _ in nic.fake.closed]
    assert kinds[:2] == ["qp", "cq"] and kinds[-2:] == ["pd", "ctx"], kinds


def test_every_resource_subclass_is_checked():
    """Every Resource subclass defined in gpunet/, host/ or device/ is in FACTORIES (or is an
    abstract interface whose implementations are)."""
    for name in MODULES:
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)
    found, todo = set(), [Resource]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("gpunet"):
                found.add(sub.__name__)
            todo.append(sub)
    assert found - ABSTRACT == set(FACTORIES), (found - ABSTRACT) ^ set(FACTORIES)
