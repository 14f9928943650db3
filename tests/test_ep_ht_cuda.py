"""gpunet.ep's high-throughput mode on an NVIDIA GPU (platform "cuda"): the HT kernels' CUDA arm,
CUDA tensors in and out, over the soft NIC asked for by name (ibgda; "auto" on CUDA would be
p2p), the heap device memory. Runs only where
torch.cuda.is_available(); elsewhere every test is skipped with the reason (scripts/gpu-check.sh
counts a skip as a failure on the H200). The CPU suite's checks (tests/ep_ht_jobs.py) on one rank
in this process, then on two rank processes sharing the GPU."""
import pytest
import torch

from gpunet.ep import Config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")

CFG = (8, 6, 64)
SPEC = dict(tokens=300, hidden=512, topk=4, holes=5, num_experts=8, config=CFG)


@pytest.mark.parametrize("mode", [dict(tagged=True), dict(fp8=True, cached=True, biases=2),
                                  dict(worst=9, async_finish=True, prev_event=True)],
                         ids=["tagged-bf16", "fp8-cached-bias", "worst-async"])
def test_ht_dispatch_combine_on_the_gpu_match_the_reference(cuda_platform, mode):
    """One rank on the GPU (4 channels of 64-slot rings, 300 tokens: every ring wraps): the layout,
    the received rows, local expert ids, weights and counts equal the reference's, combine equals
    the float32 reference bit for bit and / fan-out is within DeepEP's bound of x."""
    from mp_ranks import Ranks
    r = Ranks(1, env={"GPUNET_PLATFORM": "cuda"})
    try:
        nb = Config(*CFG).get_nvl_buffer_size_hint(SPEC["hidden"] * 2, 1)
        info = r.run("ep_ht_jobs:init", "ibgda", nb, 20.0, False, None, timeout=300)
        assert info[0]["transports"]
        spec = dict(SPEC, seed=3, **mode)
        for o in r.run("ep_ht_jobs:round_", spec, timeout=300):
            assert o["raised"] is None and o["bad"] == [], o
            assert o["calc_diff"] < (5e-4 if mode.get("fp8") else 5e-6), o["calc_diff"]
        r.run("ep_ht_jobs:close", timeout=120)
    finally:
        r.close()


def test_ht_two_ranks_share_the_gpu(cuda_platform):
    """Two rank processes on one GPU (the gate runs them under MPS), over ibgda: BF16 and FP8
    rounds match the reference on both ranks."""
    from mp_ranks import Ranks
    r = Ranks(2, env={"GPUNET_PLATFORM": "cuda"})
    try:
        nb = Config(*CFG).get_nvl_buffer_size_hint(SPEC["hidden"] * 2, 2)
        r.run("ep_ht_jobs:init", "ibgda", nb, 60.0, False, None, timeout=300)
        for mode in (dict(tagged=True, vary_tokens=True), dict(fp8=True, hot_expert=2)):
            spec = dict(SPEC, seed=5, num_experts=16, **mode)
            for rank, o in enumerate(r.run("ep_ht_jobs:round_", spec, timeout=300)):
                assert o["raised"] is None and o["bad"] == [], (rank, o)
                assert o["calc_diff"] < (5e-4 if mode.get("fp8") else 5e-6), (rank, o["calc_diff"])
        r.run("ep_ht_jobs:close", timeout=120)
    finally:
        r.close()


def test_p2p_ranks_store_rows_into_the_receive_pool(cuda_platform):
    """Two rank processes on one GPU over p2p with a receive pool (Buffer's recv_pool_bytes): the
    receive tensors come from the pool and the peer stores its rows straight into them (BF16
    tagged with varying tokens, FP8 cached with biases, num_worst_tokens); with rank 1's pool held
    full, rank 1 takes torch memory and the ring while rank 0 still receives in place; every
    round matches the reference on both ranks. Combine given the received rows themselves loads
    the rows of a peer whose rows lie in its pool in place (ht.cuh "the in-place combine"; the rows
    copied into Buffer.empty_combine_x's tensor, recv_x then overwritten). A BF16 round repeated takes views of the receive
    tensors allocated during its notify (the last such call's rows + 1/8), into which its data
    phase was launched before the host read the counts."""
    from mp_ranks import Ranks
    r = Ranks(2, env={"GPUNET_PLATFORM": "cuda"})
    try:
        nb = Config(*CFG).get_nvl_buffer_size_hint(SPEC["hidden"] * 2, 2)
        info = r.run("ep_ht_jobs:init", "p2p", nb, 60.0, False, None, 0, False, 64 << 20, timeout=300)
        assert {t for i in info for t in i["transports"].values()} == {"p2p"}
        modes = (dict(tagged=True, vary_tokens=True), dict(fp8=True, cached=True, biases=2), dict(worst=9))
        for held in (False, True):
            if held:
                r.run("ep_ht_jobs:hold_pool", [False, True], timeout=120)
            for mode in modes:
                spec = dict(SPEC, seed=7, num_experts=16, **mode)
                outs = r.run("ep_ht_jobs:round_", spec, timeout=300)
                for rank, o in enumerate(outs):
                    assert o["raised"] is None and o["bad"] == [], (rank, o)
                    assert o["calc_diff"] < (5e-4 if mode.get("fp8") else 5e-6), (rank, o["calc_diff"])
                assert [o["in_pool"] for o in outs] == [True, not held], (mode, held)
            if not held:
                # the first round again: its receive tensors were allocated while its notify ran,
                # for the rows of the first round + 1/8 (Buffer._ht_recv_guess_rows), and are views;
                # its data phase was launched behind the notify and ran (ht.cuh F_HT_PRE)
                spec = dict(SPEC, seed=7, num_experts=16, **modes[0])
                outs = r.run("ep_ht_jobs:round_", spec, timeout=300)
                for rank, o in enumerate(outs):
                    assert o["raised"] is None and o["bad"] == [], (rank, o)
                    n = o["n_recv"]
                    assert o["in_pool"] and o["rows_held"] == n + -(-n // 8), (rank, n, o["rows_held"])
                    assert o["prelaunched"] == 1, (rank, o)
            # combine given the received rows: a peer whose rows lie in its pool hands this rank a
            # descriptor and this rank loads them (none in its ring); rank 1's, in torch memory
            # while held, come through rank 0's ring (after the repeated round: its guess is the
            # first mode's rows); the rows are copied into Buffer.empty_combine_x's tensor (in the
            # pool where it has room) and recv_x overwritten with NaN before the combine
            spec = dict(SPEC, seed=8, num_experts=16, tagged=True, in_place=True, empty_x=True,
                        ring_probe=True)
            outs = r.run("ep_ht_jobs:round_", spec, timeout=300)
            for rank, o in enumerate(outs):
                assert o["raised"] is None and o["bad"] == [], (rank, o)
                assert o["calc_diff"] < 5e-6, (rank, o["calc_diff"])
            ring = [o["ring_rows"][1 - rank] for rank, o in enumerate(outs)]
            assert (ring[0] > 0) == held and ring[1] == 0, (ring, held)
            assert [o["x_in_pool"] for o in outs] == [True, not held], (outs, held)
        r.run("ep_ht_jobs:hold_pool", [False, False], timeout=120)
        r.run("ep_ht_jobs:close", timeout=120)
    finally:
        r.close()


def test_num_worst_tokens_dispatch_and_combine_replay_in_a_cuda_graph(cuda_platform):
    """num_worst_tokens keeps everything on the device: get_dispatch_layout + dispatch + combine
    captured once in a CUDA graph, then replayed on three new routings copied into the captured
    inputs (one rank, in this process): every replay's received rows, local ids and weights equal
    that routing's reference in the prefix, the tail's recv_topk_idx is -1, and combine / fan-out
    is x (the op counter advances on the device)."""
    from gpunet.ep import Buffer
    from gpunet.ep import reference as ref
    T, H, K, E, worst = 64, 512, 4, 8, 80
    cfg = Config(*CFG)
    # with a receive pool: the warm-up's receive tensors come from it, the captured call's from
    # torch (a pool is not used while a stream is captured)
    b = Buffer(None, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(H * 2, 1), explicitly_destroy=True,
               timeout_s=20.0, transport="ibgda", recv_pool_bytes=16 << 20)
    try:
        def inputs(seed):
            return ref.make_rank_inputs(1, T, H, K, E, seed, holes=5)[0]
        first = inputs(1)
        x, tk, w = first["x"].cuda(), first["topk_idx"].cuda(), first["topk_weights"].cuda()

        def step():
            _, _, ntpe, inr, _ = b.get_dispatch_layout(tk, E)
            rx, rtk, rw, counts, h, _ = b.dispatch(x, is_token_in_rank=inr, num_tokens_per_expert=ntpe,
                                                   topk_idx=tk, topk_weights=w, num_worst_tokens=worst,
                                                   config=cfg)
            out, ow, _ = b.combine(rx, h, topk_weights=rw, config=cfg)
            return rx, rtk, rw, counts, out, ow
        step()                                            # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rx, rtk, rw, counts, out, ow = step()
        assert counts == []
        for seed in (11, 12, 13):
            new = inputs(seed)
            x.copy_(new["x"])
            tk.copy_(new["topk_idx"])
            w.copy_(new["topk_weights"])
            g.replay()
            torch.cuda.synchronize()
            want = ref.ht_dispatch_ref([new["x"]], [new["topk_idx"]], [new["topk_weights"]], E, 0)
            n = want["src_idx"].numel()
            assert torch.equal(rx[:n].cpu(), want["recv_x"])
            assert torch.equal(rtk[:n].cpu(), want["recv_topk_idx"]) and bool((rtk[n:] == -1).all())
            assert torch.equal(rw[:n].cpu(), want["recv_topk_weights"])
            reach = (new["topk_idx"] >= 0).any(1)
            assert torch.equal(out.cpu()[reach], new["x"][reach])   # one rank: fan-out 1, the row itself
    finally:
        b.destroy()
