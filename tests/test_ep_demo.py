"""`python -m gpunet ep-demo`: the MoE layer's math, the rank launcher it shares, and the demo run
end to end over rank processes with gpunet.ep.Buffer (small sizes)."""
import json
import subprocess
import sys

import pytest
import torch

from gpunet.demo import run_ranks
from gpunet.errors import GpunetError
from gpunet.ep import demo
from gpunet.ep import reference as ref


@pytest.mark.parametrize("world,fp8", [(2, False), (4, False), (2, True)])
def test_layer_composed_from_references_matches_one_process_torch_moe(world, fp8):
    """The demo's pipeline with the references standing in for Buffer (ll_dispatch_ref ->
    run_local_experts on the packed rows -> ll_combine_ref) equals the one-process torch MoE
    within the demo's bound: the packed-row expert step and the weights are wired correctly."""
    H, F, E, K, T = 256, 64, 4 * world, 3, 12
    router, w1, w2 = demo.make_layer(H, F, E, seed=3)
    xs = [demo.make_tokens(r, T, H, seed=3) for r in range(world)]
    routes = [demo.route(x, router, K) for x in xs]
    tks = [r[0] for r in routes]
    disp = [ref.ll_dispatch_ref(xs, tks, E, T, o, use_fp8=fp8) for o in range(world)]
    outs = []
    for o, (recv, count, _, _) in enumerate(disp):
        rows = recv
        if fp8:
            q, s = recv
            rows = ref.per_token_cast_back(q.reshape(-1, H), s.reshape(-1, s.shape[2])).view(q.shape)
        outs.append(demo.run_local_experts(rows, count, o, w1, w2))
    handles = [(d[2], d[3], T, H, E) for d in disp]
    for r in range(world):
        got = ref.ll_combine_ref(outs, tks[r], routes[r][1], handles, r)
        want = demo.torch_moe(xs[r], tks[r], routes[r][1], w1, w2)
        torch.testing.assert_close(got.float(), want.float(), atol=demo.MOE_ATOL, rtol=demo.MOE_RTOL)
        assert ref.calc_diff(got, want) < (1e-3 if fp8 else 1e-4)


def test_torch_moe_weights_sum_to_one_per_token():
    """route() renormalises the top-k weights: they sum to 1 per token, ids are distinct."""
    router, _, _ = demo.make_layer(128, 8, 8, seed=1)
    idx, w = demo.route(demo.make_tokens(0, 16, 128, seed=1), router, 3)
    torch.testing.assert_close(w.sum(1), torch.ones(16))
    assert all(len(set(row)) == 3 for row in idx.tolist())


def test_run_ranks_returns_rank0_result_and_names_a_failing_rank():
    """run_ranks returns rank 0's value, tensors by value (rank 0 may exit before the launcher
    reads it); when every rank raises, the GpunetError carries the exception type and message,
    and the call returns (bounded) instead of hanging."""
    assert run_ranks(pow, 2, 7, timeout_s=120) == 0          # pow(rank=0, world=2, 7)
    got = run_ranks(torch.arange, 2, 1, timeout_s=120)       # torch.arange(0, 2, 1)
    assert torch.equal(got, torch.tensor([0, 1]))
    with pytest.raises(GpunetError, match="ValueError"):
        run_ranks(pow, 2, 0, timeout_s=120)                    # pow(x, 2, 0): modulus 0


def _ep_demo(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "gpunet", "ep-demo", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("ranks,extra", [("2", []), ("4", ["--fp8"])])
def test_ep_demo_end_to_end_matches_torch_moe(tmp_path, ranks, extra):
    """The demo over rank processes (soft NIC, HOST arm): every rank's MoE output matches the
    one-process torch layer (atol=rtol=6e-2), one table row per rank, exit status 0."""
    js = tmp_path / "ep.json"
    r = _ep_demo("--ranks", ranks, "--tokens", "8", "--hidden", "128", "--experts", "8",
                 "--topk", "2", "--ffn", "32", "--iters", "2", "--json", str(js), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vs the one-process torch layer: PASS" in r.stdout
    d = json.loads(js.read_text())
    assert d["ok"] and len(d["rows"]) == int(ranks)
    assert all(row["ok"] and len(row["dispatch_us"]) == 2 for row in d["rows"])


def test_ep_demo_rejects_bad_arguments():
    """Experts not divisible by ranks: an argparse error, before any rank starts."""
    r = _ep_demo("--ranks", "3", "--experts", "8", timeout=120)
    assert r.returncode == 2 and "multiple of --ranks" in r.stderr
