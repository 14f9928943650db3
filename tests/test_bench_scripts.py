"""The benchmark scripts' CPU-side logic: bench/device_post.py builds its CUDA kernels and runs its
whole flow (sink, soft NIC rows, GPU ordering variant) on the HOST arm."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_post.py"


def _nvcc():
    return shutil.which(os.environ.get("GPUNET_NVCC", "nvcc")) or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed: the CUDA arm "
                                            "of device_post.py cannot be compiled here")
def test_device_post_compile_only():
    r = _run("--compile-only")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "built for CUDA" in r.stdout


def test_device_post_cpu_smoke(tmp_path):
    """The same script on the HOST arm: sink rows of both posting modes, soft-NIC rows and ordering
    schedules all pass; the gate's reader (scripts/gate.py device_post) takes the one-warp target
    from the serial row and the shared-QP targets from batched rows."""
    out = tmp_path / "dp.json"
    r = _run("--cpu-smoke", "--post-modes", "batched,serial", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    assert d["ordering_pass"] is True
    assert all(o["ok"] for o in d["ordering"])
    sink = [row for row in d["rows"] if row["row"] == "post, sink"]
    assert {(row["warps"], row["post_mode"]) for row in sink} == {(1, "batched"), (2, "batched"),
                                                                  (1, "serial")}, sink
    assert all(row["note"].startswith("OK") for row in d["rows"] if row["row"] == "post, soft NIC")
    rows = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gate.py"), "device_post", str(out)],
                   check=True, timeout=60, env=dict(os.environ, GATE_ROWS=str(rows)))
    got = {g["name"]: g for g in map(json.loads, rows.read_text().splitlines())}
    serial = next(row for row in sink if row["warps"] == 1 and row["post_mode"] == "serial")
    one = got["post 1 warp(s), 1 QP(s), serial"]
    assert one["figure"].startswith("%.1f M WQE/s" % serial["mwqes"]), one
    assert got["post 32 warp(s), 1 QP(s), batched"]["figure"] == "row missing"
    assert got["device post rows ran"]["result"] == "PASS"


def test_sink_threads_split_the_qps_and_the_gate_reads_one_sink_rows(tmp_path):
    """--sink-threads 1,2 repeats each sink row with the QPs split over that many sink threads
    (QP q on thread q % n): both rows credit every WQE (the script checks the heads agree); the
    gate's reader takes its targets from the one-sink rows only (the others are a comparison)."""
    out = tmp_path / "dps.json"
    r = _run("--cpu-smoke", "--qps", "2", "--warps", "2", "--sink-threads", "1,2", "--skip",
             "store,e2e,ordering", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    sink = [row for row in json.loads(out.read_text())["rows"] if row["row"] == "post, sink"]
    assert sorted(row["sinks"] for row in sink) == [1, 2], sink
    assert all(row["wqes"] > 0 and not row["note"].startswith("FAIL") for row in sink), sink
    # the gate's reader: both rows relabelled as the 32-warp target's row, the 2-sink one with a
    # figure that would meet it; the target must come from the 1-sink row
    d = json.loads(out.read_text())
    for row in d["rows"]:
        if row["row"] == "post, sink":
            row.update(warps=32, qps=1, post_mode="batched")
            if row["sinks"] == 2:
                row.update(mwqes=999.0, mwqes_min=999.0, mwqes_max=999.0)
    d["rows"].sort(key=lambda row: -row.get("sinks", 0))   # the 2-sink row first
    out.write_text(json.dumps(d))
    rows = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gate.py"), "device_post", str(out)],
                   check=True, timeout=60, env=dict(os.environ, GATE_ROWS=str(rows)))
    got = {g["name"]: g for g in map(json.loads, rows.read_text().splitlines())}
    one = next(row for row in d["rows"] if row.get("sinks") == 1)
    assert got["post 32 warp(s), 1 QP(s), batched"]["figure"].startswith("%.1f M WQE/s" % one["mwqes"])


def test_post_warp_k_moves_every_byte_on_the_host_arm(tmp_path):
    """post_warp_k (8 WQEs per lane per reservation, warps of 32 interleaved so each store covers
    consecutive WQEBBs): on the soft NIC every WQE executes and the destination equals the source,
    in both CQ modes; the sink rows account for every WQEBB (heads agree)."""
    out = tmp_path / "dpk.json"
    r = _run("--cpu-smoke", "--per-lane", "8", "--skip", "ordering", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    rows = json.loads(out.read_text())["rows"]
    e2e = [row for row in rows if row["row"] == "post, soft NIC"]
    assert len(e2e) == 4 and all(row["note"].startswith("OK") for row in e2e), e2e
    assert all(row["wqes"] > 0 for row in rows if row["row"] == "post, sink")


def test_device_post_without_gpu_fails_fast():
    """No GPU: a clear message and exit status 2, not a crash or a hang."""
    env = dict(os.environ, GPUNET_PLATFORM="cpu")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr


EP_SCRIPT = ROOT / "bench" / "ep.py"


def test_ep_bench_cpu_smoke(tmp_path):
    """bench/ep.py on the CPU (2 ranks, soft NIC, tiny sizes): every configuration matches the
    reference (its gate rows PASS), each op has a row per token count with a positive median,
    bytes follow DeepEP's per-selection count, and the torch yardsticks are in the same JSON.
    --hold-us runs the "(device)" loops too (on the CPU without a hold: the code a GPU run
    reaches, its rows and its target rows, with nothing held)."""
    out = tmp_path / "ep.json"
    r = subprocess.run([sys.executable, str(EP_SCRIPT), "--ranks", "2", "--sweep", "4,8",
                        "--tokens", "8", "--hidden", "128", "--topk", "2", "--experts", "4",
                        "--holes", "2", "--iters", "2", "--warmup", "1", "--hold-us", "1",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    tests = [g for g in d["gate"] if g["kind"] == "test"]
    assert len(tests) == 2 and all(g["result"] == "PASS" for g in tests), tests
    for op in ("dispatch bf16", "dispatch fp8", "combine bf16", "torch gather, all ranks",
               "dispatch bf16 (device)", "combine bf16 (device)", "torch gather (device), all ranks"):
        rows = [row for row in d["rows"] if row["op"] == op]
        assert sorted(row["tokens"] for row in rows) == [4, 8] and all(
            row["median_us"] > 0 for row in rows), op
    fp8 = next(row for row in d["rows"] if row["op"] == "dispatch fp8" and row["tokens"] == 8)
    bf16 = next(row for row in d["rows"] if row["op"] == "dispatch bf16" and row["tokens"] == 8)
    assert bf16["bytes_per_rank"] % 256 == 0 and fp8["bytes_per_rank"] % (128 + 4 + 16) == 0
    assert bf16["bytes_per_rank"] // 256 == fp8["bytes_per_rank"] // 148      # same selections
    assert "DeepEP" in d["bytes"] and d["machine"]["cores"] >= 1
    assert sum(g["kind"] == "target" for g in d["gate"]) == 4     # both timings, at --tokens


def test_ep_bench_gpu_without_gpu_fails_fast():
    """--gpu with no GPU: exit status 2 and a message the GPU gate recognises, no rank started."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(EP_SCRIPT), "--gpu"], capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr


def test_ep_profile_cpu_gives_every_phase_of_every_call(tmp_path):
    """bench/ep_profile.py on the CPU (2 ranks, soft NIC, HOST arm): the check passes, and for
    every op and rank the device stamps (LlParams::prof) give a kernel time no longer than the
    call's own clock, with the send phase and the receive phase inside it (so a stamp that stops
    being written, or lands in the wrong slot, fails here before it misleads a GPU run)."""
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ep_profile.py"), "--tokens", "8",
                        "--hidden", "128", "--topk", "2", "--experts", "4", "--holes", "2",
                        "--iters", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    (run,) = d["runs"]
    assert not run["fail"]
    for op in ("dispatch bf16", "dispatch fp8", "combine bf16"):
        for rank in run["per_rank"]:
            for call in rank["calls"][op]:
                assert 0 < call["kernel"] <= call["host"], (op, call)
                assert 0 < call["send"] <= call["kernel"] and 0 < call["recv"] <= call["kernel"]
                assert call["plan"] >= 0 and "skew" in call, (op, call)
                if op.startswith("dispatch"):  # every block's header rows, before the last block
                    assert 0 <= call["fill"] <= call["hdr"], (op, call)
    assert "check: OK" in r.stdout and "kernel" in r.stdout


def test_ep_ht_profiles_every_rank_at_the_same_config():
    """bench/ep_ht.py profiles each op at one Config for all ranks: the one whose slowest rank's
    median is lowest. Generated: 2 Configs where rank 0 is faster at the first and rank 1 at the
    second (each rank's own best differs, which made the ranks call with different Configs);
    invariant: one answer, the min over Configs of the max over ranks, whichever rank asks."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ep_ht
    finally:
        sys.path.pop(0)
    r0 = {"dispatch bf16": [100.0, 130.0], "combine bf16": [90.0, 95.0]}
    r1 = {"dispatch bf16": [125.0, 110.0], "combine bf16": [99.0, 80.0]}
    # slowest per Config: dispatch [125, 130] -> 0; combine [99, 95] -> 1
    assert ep_ht.profile_choice([r0, r1]) == {"dispatch bf16": 0, "combine bf16": 1}
    assert ep_ht.profile_choice([r1, r0]) == ep_ht.profile_choice([r0, r1])
    # each rank's own fastest disagrees here: the old choice
    assert min(range(2), key=r0["dispatch bf16"].__getitem__) != min(range(2), key=r1["dispatch bf16"].__getitem__)


def test_ep_profile_ab_takes_the_slower_rank_and_the_late_starting_ranks_kernel(tmp_path):
    """bench/ep_profile_ab.py on ep_profile.py-shaped JSON: per run the slower rank's figure and
    the kernel of the rank with the largest skew (not the slower one), the median [min, max]
    over a variant's runs, the ratio of medians against the first variant; a run whose check
    failed is refused (not a measurement)."""
    import json
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ep_profile_ab as ab
    finally:
        sys.path.pop(0)

    def run(kernels, skews, send):
        ranks = [dict(event=k + 4, kernel=k, send=send, hdr=1.0, recv=2.0, skew=sk)
                 for k, sk in zip(kernels, skews)]
        return {"summary_us": {"dispatch bf16": ranks}, "fail": []}

    # variant a: late-starting rank (skew 9) has the SMALLER kernel: late kernel != slower kernel
    (tmp_path / "a1.json").write_text(json.dumps({"runs": [run([50.0, 40.0], [0.0, 9.0], 8.0)]}))
    (tmp_path / "a2.json").write_text(json.dumps({"runs": [run([44.0, 46.0], [2.0, 0.0], 6.0)]}))
    (tmp_path / "a3.json").write_text(json.dumps({"runs": [run([60.0, 42.0], [0.0, 12.0], 7.0)]}))
    (tmp_path / "b1.json").write_text(json.dumps({"runs": [run([30.0, 25.0], [0.0, 1.0], 4.0)]}))
    out = tmp_path / "ab.json"
    assert ab.main(["a=%s/a*.json" % tmp_path, "b=%s/b*.json" % tmp_path, "--json", str(out)]) == 0
    rows = {(r["op"], r["figure"]): r for r in json.loads(out.read_text())["rows"]}
    slower = rows[("dispatch bf16", "slower kernel")]["a"]
    assert slower["runs"] == [50.0, 46.0, 60.0] and slower["median"] == 50.0
    late = rows[("dispatch bf16", "late kernel")]["a"]
    assert late["runs"] == [40.0, 44.0, 42.0] and (late["min"], late["median"], late["max"]) == (40.0, 42.0, 44.0)
    assert rows[("dispatch bf16", "late kernel")]["b"]["runs"] == [25.0]
    assert rows[("dispatch bf16", "slower send")]["a"]["median"] == 7.0
    bad = {"runs": [dict(run([1.0], [0.0], 1.0), fail=[{"rank": 0, "why": "layout"}])]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="failed its check"):
        ab.main(["x=%s/bad.json" % tmp_path])


PROXY_SCRIPT = ROOT / "bench" / "proxy.py"
CPU_PUT_SCRIPT = ROOT / "bench" / "cpu_put.py"


def test_proxy_roundtrip_host_arm_runs_reps_and_records_placement(tmp_path):
    """bench/proxy.py --roundtrip host: the GPU round trip's code path (k_roundtrip, channel,
    proxy, two soft NICs) on the HOST arm; every row has --reps independent run medians, their
    median and spread, a p99, and per run the placement plan (or why none) and what each of the 4
    polling threads got; the rows the GPU gate reads have the fields it reads; the diagnostics
    (the NIC leg alone, yielding and spinning engine) have --reps run medians each."""
    out = tmp_path / "rt.json"
    r = subprocess.run([sys.executable, str(PROXY_SCRIPT), "--roundtrip", "host", "--quick",
                        "--reps", "3", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    rows = d["rows"]
    assert [row["mode"] for row in rows] == ["host-rt drain-only", "host-rt soft NIC",
                                             "host-rt soft NIC spinning"]
    assert [len(x["run_medians_us"]) for x in d["diagnostics"]] == [3, 3]   # the NIC leg alone
    assert all(0 < x["min_median_us"] <= x["median_us"] for x in d["diagnostics"])
    for row in rows:
        meds = row["run_medians_us"]
        assert len(meds) == 3 and all(m > 0 for m in meds)
        assert row["min_median_us"] <= row["median_us"] <= row["max_median_us"]
        assert row["p99_us"] >= row["min_us"] > 0
        assert len(row["placement"]) == 3
        for p in row["placement"]:
            assert set(p["threads"]) == {"device", "proxy", "nic_a", "nic_b"}
            assert all("cpus_allowed" in t and "last_cpu" in t for t in p["threads"].values())
            if p["plan"] is None:
                assert p["why"].startswith("not pinned")
            else:       # pinned: each thread may run on its own core only
                for role, t in p["threads"].items():
                    assert t["cpus_allowed"] == str(p["plan"][role][0]), (role, t, p["plan"])
                a, b = p["c2c_ns"]["best_pair"]       # the probe's closest pair went to them
                assert {a, b} == {p["plan"]["proxy"][0], p["plan"]["nic_a"][0]}


def test_placement_probe_measures_core_to_core_latency():
    """bench/proxy.py's placement probe: a cache line bounced between two pinned threads gives a
    finite positive one-way latency for any pair of allowed CPUs, the caller's affinity is
    restored, and a two-role plan puts the proxy and the NIC engine on the closest pair."""
    sys.path.insert(0, str(ROOT / "bench"))
    import proxy as bench_proxy
    allowed = sorted(os.sched_getaffinity(0))
    a, b = allowed[0], allowed[-1]
    ns = bench_proxy.c2c_ns(a, b, rounds=500, warm=50)
    assert 0 < ns < 1e6 and sorted(os.sched_getaffinity(0)) == allowed
    if len(allowed) >= 2:
        plan, why, info = bench_proxy.plan_placement(roles=("proxy", "nic_a"))
        if plan is not None:
            assert {plan["proxy"][0], plan["nic_a"][0]} == set(info["c2c_ns"]["best_pair"])
            assert info["c2c_ns"]["best"] <= info["c2c_ns"]["worst"] and "closest pair" in why


def test_proxy_gpu_without_gpu_fails_fast():
    """--gpu with no GPU: exit status 2 and the message the GPU gate recognises."""
    env = dict(os.environ, GPUNET_PLATFORM="cpu")
    r = subprocess.run([sys.executable, str(PROXY_SCRIPT), "--gpu", "--quick"], capture_output=True,
                       text=True, timeout=600, cwd=str(ROOT), env=env)
    if _nvcc() is None:     # the CUDA build comes first and fails with a ToolchainError
        assert r.returncode != 0
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr


def test_cpu_put_bench_rows_and_spread(tmp_path):
    """bench/cpu_put.py (2 runs, few iterations): put+quiet and ping-pong over both transports
    (2 ranks) and the one-rank breakdown, each with one median per run, their median and spread,
    and the target recorded on the put+quiet rows."""
    out = tmp_path / "cpu_put.json"
    r = subprocess.run([sys.executable, str(CPU_PUT_SCRIPT), "--runs", "2", "--iters", "20",
                        "--warmup", "3", "--json", str(out)], capture_output=True, text=True,
                       timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    rows = {(row["row"], row["transport"]): row for row in d["rows"]}
    for t in ("ibgda", "proxy"):
        for name in ("put+quiet", "ping-pong", "breakdown: ctypes call",
                     "breakdown: launch, quiet only", "breakdown: device put+quiet",
                     "breakdown: API put+quiet"):
            row = rows[(name, t)]
            assert len(row["run_medians_us"]) == 2 and row["iters"] == 20, row
            assert 0 < row["min_median_us"] <= row["median_us"] <= row["max_median_us"]
        assert rows[("put+quiet", t)]["target_us"] == 30.0
    assert d["machine"]["cores"] >= 1 and "loadavg_start" in d


P2P_SCRIPT = ROOT / "bench" / "p2p.py"


def test_p2p_bench_cpu_small_mode_rows_gate_and_json(tmp_path):
    """bench/p2p.py on the CPU (2 ranks over p2p, HOST arm, 4 KiB .. 256 KiB, 2 runs, 30 round
    trips): the bulk put lands byte for byte (the test gate row passes), every size has a put and
    a memmove figure per run with median within [min, max] and a ratio, the ping-pong has one
    round trip per run, and the machine is recorded."""
    out = tmp_path / "p2p.json"
    r = subprocess.run([sys.executable, str(P2P_SCRIPT), "--runs", "2", "--max-mib", "0.25",
                        "--pp-iters", "30", "--json", str(out)], capture_output=True, text=True,
                       timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    assert [row["bytes"] for row in d["rows"]] == [4096, 16384, 65536, 262144]
    for row in d["rows"]:
        for k in ("put_GBps", "memcpy_GBps", "ratio"):
            assert 0 < row[k + "_min"] <= row[k] <= row[k + "_max"], (k, row)
    assert d["rows"][-1]["bulk_geometry"] == [1, 32, 262144]      # the bulk launch was used
    assert len(d["pingpong"]["runs"]) == 2 and all(x > 0 for x in d["pingpong"]["runs"])
    tests = [g for g in d["gate"] if g["kind"] == "test"]
    assert tests and all(g["result"] == "PASS" for g in tests), d["gate"]
    assert any(g["name"] == "p2p put_signal ping-pong round trip" for g in d["gate"])
    assert d["machine"]["cores"] >= 1


def test_p2p_bench_gpu_without_gpu_fails_fast():
    """bench/p2p.py --gpu on a machine without CUDA says so and exits 2 (no MPS daemon started)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU path is not reachable")
    r = subprocess.run([sys.executable, str(P2P_SCRIPT), "--gpu"], capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr


def test_icache_probe_builds_for_cuda_and_needs_a_gpu():
    """bench/icache.py's kernel compiles for the CUDA arm and exports its launcher (when nvcc is
    here); without a GPU the script exits 2 with the reason instead of measuring nothing."""
    import torch
    if _nvcc() is not None:
        from gpunet.device import loader, testing
        lib = loader.build([testing.kernels_dir() / "icache_probe.cu"], arch="cuda")
        assert hasattr(lib, "gpunet_icache_probe")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU path is not reachable")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "icache.py"), "--gpu"],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr


def test_copy_engine_stall_says_it_needs_a_gpu_on_a_machine_without_one():
    """bench/copy_engine_stall.py (a CUDA-only measurement) exits non-zero with a one-line reason
    where torch.cuda is not available, instead of a traceback."""
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script measures instead (scripts/gpu-check.sh)")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "..", "bench", "copy_engine_stall.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr, r
