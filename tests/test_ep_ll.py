"""gpunet.ep low-latency dispatch / combine across rank processes (HOST arm, soft NIC), checked
DeepEP's way (EP-ANCHORS.md §B) against gpunet.ep.reference: exact packed rows, counts against the
gathered routing, layout ranges, self-describing rows, combine within calc_diff bounds, the mode
matrix, same-seed reruns, two LL calls in flight, and killed ranks (masked or raised).

Each world (ranks x transport x warp size) is one pool of rank processes (tests/mp_ranks.py) that
runs "ep_jobs:*" jobs (tests/ep_jobs.py); every rank regenerates every rank's inputs from the seed
and compares its own results with the reference, returning findings and hashes.
"""
import pytest

from gpunet.ep import Buffer
from mp_ranks import Ranks

# Small shapes: the HOST arm runs every device thread as an OS thread on the CI machine's 2 cores.
BASE = dict(t_max=8, hidden=256, topk=4, holes=3)
BF16_BOUND = 1e-5          # DeepEP's calc_diff bounds for combine
FP8_BOUND = 9e-4


def _bytes(world, t_max=BASE["t_max"], hidden=BASE["hidden"], experts_per_rank=4):
    return Buffer.get_low_latency_rdma_size_hint(t_max, hidden, world, experts_per_rank * world)


def _pool(world, transport, warp_size, shrink=False, timeout_s=30.0, t_max=BASE["t_max"],
          hidden=BASE["hidden"], experts_per_rank=4):
    r = Ranks(world)
    try:
        info = r.run("ep_jobs:init", transport, _bytes(world, t_max, hidden, experts_per_rank),
                     timeout_s, shrink, warp_size, timeout=180)
    except BaseException:
        r.close()
        raise
    r.world, r.transport, r.info = world, transport, info
    return r


def _close(r):
    try:
        r.run("ep_jobs:close", timeout=60)
    finally:
        r.close()


def _spec(world, seed, **kw):
    s = dict(BASE, seed=seed, num_experts=4 * world)
    s.update(kw)
    return s


def _assert_round(out, spec, bound=None):
    bound = bound if bound is not None else (FP8_BOUND if spec.get("use_fp8") else BF16_BOUND)
    for rank, o in enumerate(out):
        assert o["bad"] == [], "rank %d: %s (spec %r)" % (rank, o["bad"], spec)
        assert not o["nan"], "rank %d: NaN in the combined output (spec %r)" % (rank, spec)
        assert o["calc_diff"] < bound, "rank %d: combine calc_diff %.3g >= %.1g (spec %r)" % (
            rank, o["calc_diff"], bound, spec)


@pytest.fixture(scope="module")
def ibgda2():
    r = _pool(2, "ibgda", 32)
    yield r
    _close(r)


def test_bf16_dispatch_and_combine_match_the_reference_on_2_ranks_over_ibgda(ibgda2):
    """Tagged rows, -1 holes: every rank receives exactly the reference's packed rows, src_info,
    counts and layout ranges, and combine is within DeepEP's BF16 bound of the float32 reference."""
    spec = _spec(2, seed=11, tagged=True)
    _assert_round(ibgda2.run("ep_jobs:round_", spec), spec)
