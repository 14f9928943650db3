"""What a kernel's code size costs: straight-line code run cold (first pass in a launch) and warm.

    python bench/icache.py --gpu [--runs 5] [--json FILE]

gpunet/device/testing/kernels/icache_probe.cu runs N steps of straight-line code (a clock read and an
xor each, about 48 B of SASS) twice in one thread and times each pass with the SM clock. The cold
pass pays the instruction fetch from L2 / HBM; the warm pass the issue alone. The gpunet EP kernels are hundreds of KB of SASS whose phases
each run once per launch (bench/RESULTS.md), so cold ns per KB of code is a fixed cost per phase.
Each run is a fresh launch of the same kernel; between runs a 64 MiB copy evicts L2, as an EP
call's data traffic does. Prints a table, writes JSON. GPU only (no instruction cache on the HOST
arm to measure).
"""
import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/machine.py

from machine import machine  # noqa: E402

SIZES = (256, 1024, 4096)          # steps per pass (icache_probe.cu's instantiations)
SASS_BYTES = 48                      # bytes of SASS per step (sm_90: 3 instructions of 16 B; the
                                     # cubin's .text size over N, measured with nvcc 13.0)


def sm_ghz(cycles=50_000_000):
    """The SM clock in GHz: torch.cuda._sleep of ``cycles`` timed with CUDA events."""
    import torch

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    e1.synchronize()
    return cycles / (e0.elapsed_time(e1) * 1e-3) / 1e9


def probe(runs):
    """Rows: instructions, KB of code, cold / warm cycles and ns (medians of ``runs`` launches,
    with [min, max]), cold ns per KB."""
    import torch

    from gpunet.device import loader, testing

    lib = loader.build([testing.kernels_dir() / "icache_probe.cu"], arch="cuda")
    f = lib.gpunet_icache_probe
    f.argtypes, f.restype = [ctypes.c_uint32, ctypes.c_void_p], ctypes.c_int
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ghz = sm_ghz()
    rows = []
    for n in SIZES:
        cold, warm = [], []
        for _ in range(runs + 1):                # the first launch also loads the module: dropped
            b.copy_(a)                           # evict L2 (50 MB on an H200)
            torch.cuda.synchronize()
            if f(n, ctypes.c_void_p(out.data_ptr())) != 0:
                raise RuntimeError("icache probe launch failed for %d instructions" % n)
            c, w, _ = out.tolist()
            cold.append(c)
            warm.append(w)
        cold, warm = cold[1:], warm[1:]
        kb = n * SASS_BYTES / 1024
        row = {"steps": n, "code_kb": kb,
               "cold_cycles": statistics.median(cold), "cold_range": [min(cold), max(cold)],
               "warm_cycles": statistics.median(warm), "warm_range": [min(warm), max(warm)]}
        row["cold_us"] = row["cold_cycles"] / ghz / 1e3
        row["warm_us"] = row["warm_cycles"] / ghz / 1e3
        row["cold_extra_ns_per_kb"] = (row["cold_cycles"] - row["warm_cycles"]) / ghz / kb
        rows.append(row)
    return rows, ghz


def table(rows):
    lines = ["| steps | code KB | cold cycles [min, max] | warm cycles [min, max] | cold us | "
             "warm us | cold extra ns / KB |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append("| %d | %.0f | %d [%d, %d] | %d [%d, %d] | %s | %s | %s |" % (
            r["steps"], r["code_kb"], r["cold_cycles"], *r["cold_range"], r["warm_cycles"],
            *r["warm_range"], "%.2f" % r["cold_us"], "%.2f" % r["warm_us"],
            "%.0f" % r["cold_extra_ns_per_kb"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="run on the GPU (the only mode)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "icache.json"))
    args = ap.parse_args()
    import torch
    if not args.gpu or not torch.cuda.is_available():
        print("bench/icache.py measures a GPU's instruction fetch: it needs an NVIDIA GPU and --gpu",
              file=sys.stderr)
        sys.exit(2)
    rows, ghz = probe(args.runs)
    print(table(rows))
    print("SM clock %.2f GHz (torch.cuda._sleep timed); %d launches per row, L2 evicted before each"
          % (ghz, args.runs))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"what": "instruction fetch cost, cold vs warm",
                                           "rows": rows, "sm_ghz": ghz, "runs": args.runs,
                                           "machine": machine(gpu=True)}, indent=1))
    print("JSON:", args.json)


if __name__ == "__main__":
    main()
