"""A device-memory heap's new allocation is zero before any peer can store into it.

Context.alloc is collective: right after its exchange a peer may put (NIC or p2p) into the new
range. On a host-mapped heap the zeroing is a CPU memset before the exchange; on a device heap
(CUDA) it is a fill on the current stream, which must have RUN by then, else it lands after the
peer's first rows and signals and erases them. Runs on the CPU: gpunet/heap.py's CUDA leaves
(the device view and the current stream) are replaced by recorders.
"""
import torch

from gpunet import heap as H


class _Recorder:
    def __init__(self):
        self.events = []


def test_a_device_heap_alloc_waits_for_its_zero_fill_before_it_returns(monkeypatch):
    """SymmetricHeap.make on a device heap (buf None, device "cuda"): the zero fill is enqueued,
    then the current stream is synchronized, both before make returns (so before Context.alloc's
    exchange hands the range to the peers)."""
    rec = _Recorder()
    backing = torch.full((1 << 17,), 7, dtype=torch.uint8)

    class View(torch.Tensor):
        def zero_(self):
            rec.events.append("zero")
            return super().zero_()

    def cuda_view(addr, size, owner):
        off = addr - base
        return backing[off:off + size].as_subclass(View)

    class Stream:
        def synchronize(self):
            rec.events.append("sync")

    base = 1 << 30
    monkeypatch.setattr(H, "_cuda_view", cuda_view)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    heap = H.SymmetricHeap(None, base, backing.numel(), "cuda", owner=None)
    t, a = heap.make((100,), torch.float32)
    rec.events.append("returned")
    assert rec.events == ["zero", "sync", "returned"], rec.events
    assert int(backing[a.off:a.off + a.size].sum()) == 0


def test_a_host_mapped_heap_alloc_zeroes_on_the_cpu_without_a_stream_wait(monkeypatch):
    """The CPU heap (buf given, device "cpu"): the bytes are zeroed by the CPU before make returns;
    no stream is touched."""
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("stream touched")))
    buf = torch.full((1 << 17,), 7, dtype=torch.uint8).numpy()
    heap = H.SymmetricHeap(buf, buf.ctypes.data, buf.size, "cpu", owner=None)
    t, a = heap.make((100,), torch.float32)
    assert not buf[a.off:a.off + a.size].any() and t.is_cpu
