"""The full comparison: every pattern and every model under models/ against tvm-untuned, tvm-auto,
onnxruntime and xla, at one trial budget for ours and for tvm-auto.

    python benchmarks/run_all.py [--trials 64] [--repeat 20] [--patterns all] [--models mlp,...]
    python benchmarks/run_all.py --skip-tuning      # measure again on the database as it is

Two passes of ``autofuse compare`` (in this process), once for all patterns and once per model:
a tuning pass with ``--trials N`` (ours tuned in the union space, tvm-auto's auto-fused kernels in
the generic space, N new trials each, into --db; its timings are thrown away) and a measuring
pass with no tuning, which is the report. Keep the machine otherwise idle during the second.
Writes, under benchmarks/results/compare-<target-key>/:
  patterns/ and <model>/   each a compare report (report.md/.json/.png, roofline.png, search.png)
  search.png               best latency vs trials, template vs generic vs union, from
                           benchmarks/results/patterns-<target-key>.json (benchmarks/patterns.py)
  summary.json, summary.md every subject's median per contender and ours over the best baseline
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse import cli  # noqa: E402
from autofuse.report import summary_rows, table, write_json  # noqa: E402
from autofuse.target import parse_target, target_key  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODELS = ("mlp", "transformer_block", "conv_block")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64, help="new trials for ours and for tvm-auto, per subject")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--patterns", default="all", help="'all', a pattern name, or 'none'")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names under models/, or 'none'")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--db", default=os.path.join(ROOT, "benchmarks", "work", "db"),
                        help="database root (default benchmarks/work/db, not committed)")
    parser.add_argument("--skip-tuning", action="store_true", help="only the measuring pass")
    parser.add_argument("--tune-only", action="store_true", help="only the tuning pass")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    key = target_key(parse_target(args.target))
    out = args.out or os.path.join(RESULTS, f"compare-{key}")
    os.makedirs(out, exist_ok=True)
    runs = []
    if args.patterns != "none":
        runs.append(("patterns", ["--pattern", args.patterns]))
    if args.models != "none":
        runs += [(name, [os.path.join(ROOT, "models", f"{name}.onnx")]) for name in args.models.split(",")]

    common = ["--db", args.db, "--target", args.target, "--seed", "0", "--no-progress"]
    if not args.skip_tuning:
        scratch = os.path.join(os.path.dirname(args.db), "tuning-pass")
        for name, subject in runs:
            code = cli.main(["compare", *subject, *common, "--trials", str(args.trials), "--repeat", "1",
                             "--warmup", "0", "--no-plots", "--report", os.path.join(scratch, name)])
            if code != 0:
                print(f"tuning pass of {name} exited {code}", file=sys.stderr)
    if args.tune_only:
        return 0
    print("== measuring pass: keep the machine idle ==", file=sys.stderr, flush=True)
    summary = {"target_key": key, "trials": None if args.skip_tuning else args.trials, "repeat": args.repeat,
               "database": os.path.relpath(args.db, ROOT), "runs": {}}
    for name, subject in runs:
        start = time.perf_counter()
        code = cli.main(["compare", *subject, *common, "--trials", "0", "--repeat", str(args.repeat),
                         "--report", os.path.join(out, name)])
        with open(os.path.join(out, name, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
        summary["runs"][name] = {"exit_code": code, "secs": time.perf_counter() - start,
                                 "trials_in_db": {s["name"]: {c["name"]: c.get("trials_in_db") for c in s["contenders"]
                                                              if c.get("trials_in_db") is not None}
                                                  for s in report["subjects"]},
                                 "rows": summary_rows(report)}
        summary.update(machine=report["machine"], versions=report["versions"], threads=report["threads"],
                       baselines=report["baselines"])
        write_json(os.path.join(out, "summary.json"), summary)  # after every run: a cut run keeps the rest

    rows = [row for run in summary["runs"].values() for row in run["rows"]]
    names = ["autofuse", *summary.get("baselines", [])]
    markdown = table(rows, [("subject", "subject"), *[(n, n) for n in names], ("ratio", "ours / best")],
                     markdown=True)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown + "\n")
    print(markdown)
    _search_plot(key, out)
    print(f"wrote {out}")
    return 0 if all(run["exit_code"] == 0 for run in summary["runs"].values()) else 1


def _search_plot(key: str, out: str) -> None:
    """Template vs generic vs union search curves from the patterns benchmark, when it has run."""
    path = os.path.join(RESULTS, f"patterns-{key}.json")
    if not os.path.exists(path):
        print(f"no {path}: run benchmarks/patterns.py for the search-efficiency plot", file=sys.stderr)
        return
    from autofuse.plots import search_curves

    with open(path, encoding="utf-8") as f:
        patterns = json.load(f)["patterns"]
    curves = {name: {space: entry[space]["curve_ms"] for space in ("template", "generic", "union") if space in entry}
              for name, entry in patterns.items()}
    search_curves(curves, os.path.join(out, "search.png"))


if __name__ == "__main__":
    sys.exit(main())
