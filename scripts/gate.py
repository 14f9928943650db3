"""Rows and the closing table of scripts/gpu-check.sh (the GPU gate).

Each subcommand reads one step's output (a JUnit XML file or a benchmark's JSON) and appends rows
to $GATE_ROWS (JSON lines): {"kind": "test" | "target", "name", "result", "figure", "goal"}.
`table` prints them and a last line: PASS when every "test" row passed, else FAIL.
"""
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

ROWS = os.environ.get("GATE_ROWS", "gate_rows.jsonl")
# A skip whose reason says the GPU or CUDA is missing is a failure on the GPU machine.
NO_GPU_SKIP = re.compile(r"needs an NVIDIA GPU|no libcudart|torch\.cuda\.is_available|no GPU|CUDA is not",
                         re.I)


def add(kind, name, result, figure="", goal=""):
    with open(ROWS, "a") as f:
        f.write(json.dumps({"kind": kind, "name": name, "result": result, "figure": figure,
                            "goal": goal}) + "\n")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"_error": "%s: %s" % (path, e)}


def junit(name, path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        add("test", name, "FAIL", "no JUnit report (%s)" % e)
        return
    cases = root.findall(".//testcase")
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    bad_skips = [c for c in skipped if NO_GPU_SKIP.search(c.find("skipped").get("message", ""))]
    ok = not failed and not bad_skips and cases
    figure = "%d passed, %d failed, %d skipped (%d for want of a GPU)" % (
        len(cases) - len(failed) - len(skipped), len(failed), len(skipped), len(bad_skips))
    add("test", name, "PASS" if ok else "FAIL", figure,
        "all pass; no skip for want of a GPU")
    for c in failed[:5] + bad_skips[:5]:
        print("  not passed: %s::%s" % (c.get("classname"), c.get("name")))


def proxy_gpu(path):
    d = _load(path)
    if "_error" in d:
        add("test", "proxy GPU round trip", "FAIL", d["_error"])
        return
    for r in d.get("rows", []):
        runs = r.get("run_medians_us") or [r["median_us"]]
        floor, ratio = r.get("floor_us", 2.85), r.get("target_ratio", 2.0)
        worst = max(runs)
        srt = sorted(runs)
        fig = "median of %d runs %.2f us [%.2f, %.2f], p99 %.1f us; %.2fx the %.2f us floor" % (
            len(runs), srt[len(srt) // 2], srt[0], srt[-1], r.get("p99_us", float("nan")),
            srt[len(srt) // 2] / floor, floor)
        add("target", "proxy rt: " + r["mode"], "met" if worst <= ratio * floor else "NOT met", fig,
            "<= %.1fx floor in every run" % ratio)


def proxy_cpu(path):
    d = _load(path)
    if "_error" in d:
        add("test", "proxy CPU drain", "FAIL", d["_error"])
        return
    rows = [r for r in d.get("rows", []) if r.get("mode", "").startswith("drain-only")]
    for r in rows:
        rate = r.get("commands_per_s_per_thread", 0) / 1e6
        add("target", "proxy drain: %s, %s thread(s)" % (r["mode"], r.get("proxy_threads")),
            "met" if rate >= 10 else "NOT met", "%.1f M commands/s per thread" % rate,
            ">= 10 M/s per thread")


# (warps, QPs, QpDesc post mode) -> M WQE/s goal, issue 8.4. One warp alone on a QP is the serial mode's
# case (qp.cuh "Posting modes"); a shared QP keeps the batched protocol.
POST_GOALS = [((1, 1, "serial"), 15.0), ((32, 1, "batched"), 40.0), ((132, 32, "batched"), 150.0),
              ((264, 32, "batched"), 150.0)]


def device_post(path):
    d = _load(path)
    if "_error" in d:
        add("test", "device post rate", "FAIL", d["_error"])
        return
    # the targets are read from one-sink-thread rows (--sink-threads adds others for comparison)
    sink = [r for r in d.get("rows", []) if r.get("row") == "post, sink" and r.get("sinks", 1) == 1]
    e2e = [r for r in d.get("rows", []) if r.get("row") == "post, soft NIC"]
    if e2e:
        bad = [r for r in e2e if not str(r.get("note", "")).startswith("OK")]
        add("test", "posts through the soft NIC land (dst == src)", "PASS" if not bad else "FAIL",
            "%d rows, %d failed" % (len(e2e), len(bad)))
    if d.get("ordering"):
        o = d["ordering"]
        add("test", "GPU ordering schedules", "PASS" if d.get("ordering_pass") else "FAIL",
            "%d/%d launches pass" % (sum(x["ok"] for x in o), len(o)))
    if not sink:
        return
    for (w, q, mode), goal in POST_GOALS:
        name = "post %d warp(s), %d QP(s), %s" % (w, q, mode)
        r = next((r for r in sink if r["warps"] == w and r.get("qps") == q
                  and r.get("post_mode", "batched") == mode), None)
        if r is None:
            add("target", name, "NOT met", "row missing", ">= %g" % goal)
            continue
        lo = r.get("mwqes_min", r["mwqes"])
        add("target", name, "met" if lo >= goal else "NOT met",
            "%.1f M WQE/s [%.1f, %.1f]" % (r["mwqes"], lo, r.get("mwqes_max", r["mwqes"])),
            ">= %g M WQE/s in every run" % goal)
    failed = [r for r in d.get("rows", []) if str(r.get("note", "")).startswith("FAIL")]
    add("test", "device post rows ran", "PASS" if sink and not failed else "FAIL",
        "%d sink rows, %d failed" % (len(sink), len(failed)))


def ep(out_dir):
    """bench/ep_gpu.sh leaves ep_*.json in out_dir; each carries a "gate" list of rows."""
    found = False
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("ep") and name.endswith(".json"):
            d = _load(os.path.join(out_dir, name))
            for g in d.get("gate", []):
                found = True
                add(g.get("kind", "target"), g["name"], g["result"], g.get("figure", ""), g.get("goal", ""))
    if not found:
        add("test", "EP bench", "FAIL", "no ep_*.json with gate rows in %s" % out_dir)


def doctor(path):
    """`python -m gpunet doctor --json`: one test row, PASS when it finished with no FAIL row."""
    d = _load(path)
    if "_error" in d:
        add("test", "doctor", "FAIL", d["_error"])
        return
    s = d.get("summary", {})
    inco = ["%s %s%s" % (c["kind"], c["direction"], " +fence" if c["fence"] else "")
            for c in d.get("coherence", []) if c.get("coherent") is False]
    add("test", "doctor", "PASS" if d.get("exit_code") == 0 else "FAIL",
        "%s; %.0f s; failed: %s; INCOHERENT: %s" % (s.get("verdict"), d.get("elapsed_s", 0),
                                                    ", ".join(s.get("failed", [])) or "none",
                                                    ", ".join(inco) or "none"),
        "no FAIL row")


def p2p(path):
    """bench/p2p.py's JSON carries a "gate" list of rows (a "test" row for the bytes landing, the
    bandwidth-ratio and round-trip targets)."""
    d = _load(path)
    if "_error" in d or not d.get("gate"):
        add("test", "p2p bench", "FAIL", d.get("_error", "no gate rows in %s" % path))
        return
    for g in d["gate"]:
        add(g.get("kind", "target"), g["name"], g["result"], g.get("figure", ""), g.get("goal", ""))


def table():
    rows = []
    if os.path.exists(ROWS):
        with open(ROWS) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    w = max([len(r["name"]) for r in rows] + [4])
    print("| %-*s | kind | result | figure | goal |" % (w, "row"))
    print("|%s|---|---|---|---|" % ("-" * (w + 2)))
    for r in rows:
        print("| %-*s | %s | %s | %s | %s |" % (w, r["name"], r["kind"], r["result"], r["figure"], r["goal"]))
    tests = [r for r in rows if r["kind"] == "test"]
    targets = [r for r in rows if r["kind"] == "target"]
    ok = bool(tests) and all(r["result"] == "PASS" for r in tests)
    print("GATE: %s (%d/%d test rows passed; performance targets met: %d/%d)" % (
        "PASS" if ok else "FAIL", sum(r["result"] == "PASS" for r in tests), len(tests),
        sum(r["result"] == "met" for r in targets), len(targets)))
    return 0 if ok else 1


def main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "row":
        add(args[0], args[1], args[2], args[3] if len(args) > 3 else "")
    elif cmd == "table":
        return table()
    else:
        globals()[cmd](*args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
