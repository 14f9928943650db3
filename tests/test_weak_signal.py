"""Signal-implies-payload of a p2p put_signal under the HOST arm's weak-memory model.

One writer thread runs gpunet::put_signal_nbi to a p2p peer whose heap is mapped here (two
buffers in this process standing for the two ranks' heaps; transport/p2p.cuh stores into the
peer's). The writer's stores go through its weak store buffer (host_simt.h); hypothesis draws the
script that picks EVERY pop (inside fence_sys, at spin points, at kernel exit), and an observer
(WeakConfig::on_pop) looks at the peer's memory after each pop and once right after the call:
whenever the signal word is visible, the whole payload must be.

- The real p2p.cuh (payload, fence_sys, release store of the signal; or the CAS of an ADD after
  the fence) never violates it, for every generated script, size, alignment and signal op.
- The fence-removal variant (p2p.cuh built with GPUNET_TEST_P2P_NO_SIGNAL_RELEASE: no release
  between payload and signal) MUST violate it for some script: the test searches for one with
  hypothesis and asserts it is found, and that it replays. A test that cannot fail proves nothing.

Kernel: gpunet/device/testing/kernels/weak_signal.cu.
"""
import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from gpunet.device import abi, loader, testing
from gpunet.device.descriptors import DeviceContext

KERNEL = testing.kernels_dir() / "weak_signal.cu"
HEAP = 1 << 16
PEER = 1
SIG_OFF = 8192                     # the signal word's heap offset (8-byte aligned)
P = ctypes.c_void_p


def _bind(lib):
    f = lib.test_weak_put_signal
    f.argtypes = [P, P, P, ctypes.c_uint64, P, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32,
                  P, P, P, ctypes.c_uint32, ctypes.c_uint64, P, P]
    f.restype = ctypes.c_int
    return lib


@pytest.fixture(scope="module")
def libs():
    """The kernel with p2p.cuh as it is, and with its release compiled out."""
    return {"real": _bind(loader.build([KERNEL], arch="host")),
            "no_release": _bind(loader.build([KERNEL], arch="host",
                                             defines={"GPUNET_TEST_P2P_NO_SIGNAL_RELEASE": None}))}


def _aligned(n, align=4096):
    raw = np.zeros(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n]


class World:
    """This rank's heap and the peer's heap (mapped here), a DevCtx whose PE 1 is p2p."""

    def __init__(self):
        self.local = _aligned(HEAP)
        self.peer = _aligned(HEAP)
        base = self.local.ctypes.data
        self.dev = DeviceContext(base, HEAP, 0, 2, 0, base + 4096, 16, base + 4096 + 128, 5.0)
        self.dev.set_peer_p2p(PEER, self.peer.ctypes.data, False)


@pytest.fixture(scope="module")
def world():
    return World()


def run(lib, w, nbytes, src_off, dst_off, op, value, script, seed=1, same_device=False):
    """One put_signal of ``nbytes`` (local src at 256 + src_off, peer dst at 512 + dst_off, signal
    at SIG_OFF) with the drain script, the peer flagged P2P_SAME_DEVICE (device-scope release) or
    not; returns (ok, states, signalled, violations) after checking the final state (kernel exit
    made every store visible: payload and signal in place)."""
    w.dev.set_peer_p2p(PEER, w.peer.ctypes.data, False, same_device=same_device)
    w.local[:] = 0
    w.peer[:] = 0
    src = 256 + src_off
    dst = 512 + dst_off
    w.local[src:src + nbytes] = (np.arange(nbytes) * 37 + 11) % 255 + 1     # never 0
    base = w.local.ctypes.data
    scr = (ctypes.c_uint32 * max(1, len(script)))(*script)
    ok = ctypes.c_uint32(0)
    out = (ctypes.c_uint64 * 3)()
    rc = lib.test_weak_put_signal(ctypes.addressof(w.dev.ctx), base + dst, base + src, nbytes,
                                  base + SIG_OFF, value, op, PEER, w.peer.ctypes.data + dst,
                                  w.peer.ctypes.data + SIG_OFF, scr, len(script), seed,
                                  ctypes.byref(ok), out)
    assert rc == 0, "the weak-mode launch threw (stderr has it)"
    abi.raise_for_status(w.dev.status, "weak put_signal")
    assert np.array_equal(w.peer[dst:dst + nbytes], w.local[src:src + nbytes]), "payload lost"
    assert w.peer[SIG_OFF:SIG_OFF + 8].any(), "the signal never arrived"
    return ok.value, out[0], out[1], out[2]


CASES = st.fixed_dictionaries({
    "nbytes": st.one_of(st.integers(1, 48), st.integers(49, 600)),
    "src_off": st.integers(0, 40),
    "dst_off": st.integers(0, 40),
    "op": st.sampled_from([abi.SIGNAL_SET, abi.SIGNAL_ADD]),
    "value": st.integers(1, (1 << 62)),
    "script": st.lists(st.integers(0, (1 << 32) - 1), max_size=96),
    "seed": st.integers(0, 1 << 30),
    "same_device": st.booleans(),
})


@settings(max_examples=settings().max_examples * 4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
def test_signal_implies_payload_for_every_drain_order(libs, world, case):
    """Generated: payload size 1..600 bytes, source and destination offsets 0..40 (so the copy
    mixes 16/8/4/2/1-byte stores), SET or ADD signal, a peer on another GPU or on this one
    (P2P_SAME_DEVICE: the device-scope release), and the script choosing every pop of the
    writer's store buffer. Invariant: in every state the observer sees (after each pop and right
    after the call), a visible signal comes with the whole payload; the signal does arrive."""
    ok, states, signalled, violations = run(libs["real"], world, **case)
    assert ok == 1
    assert states >= 1 and signalled >= 1
    assert violations == 0, case


def test_fence_removal_variant_is_caught(libs, world):
    """The same put_signal with the release between payload and signal compiled out: hypothesis
    searches the same space for a case in which the observer sees the signal before the whole
    payload, and finds one; the found case replays deterministically (the script fixes every
    pop), and the real build passes that very case."""
    def violates(case):
        return run(libs["no_release"], world, **case)[3] > 0

    # generate only: the first violating case is the evidence; shrinking it costs minutes
    found = find(CASES, violates, settings=settings(
        max_examples=max(200, settings().max_examples * 4), deadline=None, database=None,
        phases=[Phase.generate]))
    assert run(libs["no_release"], world, **found)[3] > 0, found
    assert run(libs["real"], world, **found)[3] == 0, found


@pytest.mark.parametrize("op", [abi.SIGNAL_SET, abi.SIGNAL_ADD])
def test_fence_removal_variant_shows_the_signal_first_for_a_known_order(libs, world, op):
    """64 bytes, both ends 16-byte aligned: the payload is 4 vector stores, 8 buffered 8-byte
    entries. SET: the signal is the 9th entry, and script [8] pops it first, so the variant shows
    the signal with no payload; ADD: the CAS acts on memory at once (a relaxed RMW, as CUDA's
    atomicCAS) while the payload is still buffered, so the state right after the call shows it.
    The real build, with the same scripts: never."""
    script = [8] if op == abi.SIGNAL_SET else []
    _, _, signalled, bad = run(libs["no_release"], world, 64, 0, 0, op, 5, script)
    assert bad > 0 and signalled >= bad
    assert run(libs["real"], world, 64, 0, 0, op, 5, script)[3] == 0
