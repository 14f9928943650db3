"""Side by side: several runs of bench/ep_profile.py per variant (an A/B of device code, runs
alternated in one lease), reduced to one row per (op, phase) and variant.

Every run of ep_profile.py gives, per op and rank, the medians of its timed calls. Ranks that share
one GPU start their kernels up to ~15 us apart (MPS launch skew), and the rank that started first
waits for the other inside its kernel, so two figures are shown per run:

- slower: the larger of the ranks' figures (what a caller of the whole step waits for; the skew
  counts in it);
- late kernel: the kernel time of the rank that started last (largest "skew"): the other rank is
  already running, so no launch skew is inside it. The fairest single kernel figure for an A/B.

Each row is the median over the variant's runs with [min, max]; the last column is the ratio of
the medians against the first variant.

Usage:
  python3 bench/ep_profile_ab.py new=dir/prof_new*.json old=dir/prof_old*.json [--json out.json]
"""
import argparse
import glob
import json
import statistics
import sys

COLUMNS = ("event", "kernel", "send", "hdr", "hdr.f", "recv")


def load_runs(paths):
    """Each path: an ep_profile.py JSON; returns its runs' summary_us dicts (op -> [per rank])."""
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        for run in d["runs"]:
            if run.get("fail"):
                raise SystemExit("%s: a run failed its check (%r): not a measurement" % (p, run["fail"]))
            runs.append(run["summary_us"])
    return runs


def reduce_variant(runs):
    """(op, figure) -> the per-run values: figure 'slower <col>' or 'late kernel'."""
    out = {}
    for s in runs:
        for op, ranks in s.items():
            for col in COLUMNS:
                vals = [r[col] for r in ranks if r.get(col) is not None]
                if vals:
                    out.setdefault((op, "slower " + col), []).append(max(vals))
            late = max(ranks, key=lambda r: r.get("skew") or 0.0)
            out.setdefault((op, "late kernel"), []).append(late["kernel"])
    return out


def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help="label=glob of ep_profile.py JSON files")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    table = {}
    labels = []
    for v in a.variants:
        label, _, pattern = v.partition("=")
        paths = sorted(glob.glob(pattern))
        if not label or not paths:
            raise SystemExit("%r: want label=glob matching ep_profile.py JSON files" % v)
        labels.append(label)
        for key, xs in reduce_variant(load_runs(paths)).items():
            table.setdefault(key, {})[label] = spread(xs)
    base = labels[0]
    print("per run: slower = the larger rank's figure, late kernel = the late-starting rank's kernel;")
    print("median [min, max] over each variant's runs, us; ratio = median / %s's" % base)
    head = "%-14s %-13s" % ("op", "figure") + "".join("  %-22s" % l for l in labels) + "  ratio"
    print(head)
    print("-" * len(head))
    for (op, fig), per in table.items():
        cells = ""
        for l in labels:
            c = per.get(l)
            cells += "  %-22s" % ("%.1f [%.1f, %.1f] n=%d" % (c["median"], c["min"], c["max"], len(c["runs"]))
                                  if c else "-")
        b = per.get(base)
        ratios = ["%.2f" % (per[l]["median"] / b["median"]) for l in labels[1:] if l in per and b and b["median"]]
        print("%-14s %-13s%s  %s" % (op, fig, cells, " ".join(ratios)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"variants": labels, "rows": [dict(op=op, figure=fig, **per) for (op, fig), per in table.items()]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
