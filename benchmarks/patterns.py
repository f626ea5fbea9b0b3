"""Every pattern at its default shape: untuned vs template space vs generic space at an equal
trial budget, each space in a database of its own (so neither sees the other's records).

    python benchmarks/patterns.py [--trials 64] [--spaces template,generic] [--patterns a,b]

Writes benchmarks/results/patterns-<target-key>.json: per pattern and space, the best checked
latency, GFLOP/s, GB/s, speed-up over untuned, the best-so-far curve in trial order and the trial
at which the space reached 95% of its final best.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autofuse.database import TuningDatabase  # noqa: E402
from autofuse.registry import all_patterns  # noqa: E402
from autofuse.report import machine_info, table, write_json  # noqa: E402
from autofuse.target import parse_target, target_key  # noqa: E402
from autofuse.tune_patterns import Job, tune_jobs  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def trial_to_fraction(curve: list[float | None], fraction: float = 0.95) -> int | None:
    """First trial (1-based) whose best-so-far is within 1/fraction of the final best."""
    final = next((c for c in reversed(curve) if c is not None), None)
    if final is None:
        return None
    for i, value in enumerate(curve, 1):
        if value is not None and final / value >= fraction:
            return i
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--spaces", default="template,generic,union")
    parser.add_argument("--patterns", default="all")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times

    target = parse_target(args.target)
    patterns = list(all_patterns().values())
    if args.patterns != "all":
        wanted = args.patterns.split(",")
        patterns = [p for p in patterns if p.name in wanted]
    jobs = [Job(p, p.default_shape(), p.dtypes[0]) for p in patterns]
    results = {"machine": machine_info(), "target": str(target), "trials_per_space": args.trials,
               "patterns": {}, "sessions": {}}
    rows = []
    out = args.out or os.path.join(RESULTS, f"patterns-{target_key(target)}.json")
    for space in args.spaces.split(","):
        with tempfile.TemporaryDirectory(prefix=f"autofuse-bench-{space}-") as root:
            db = TuningDatabase(root, target)
            start = time.perf_counter()
            space_rows, stats = tune_jobs(jobs, target, db, trials=args.trials, space=space, seed=0)
            results["sessions"][space] = {
                "secs": time.perf_counter() - start, "trials": stats.total_trials,
                "first_trial_secs": stats.first_trial_secs, "trials_per_minute": stats.trials_per_minute(),
                "steady_trials_per_minute": stats.steady_trials_per_minute()}
            for job, row in zip(jobs, space_rows):
                curve = db.best_so_far(job.func)
                row["curve_ms"] = curve
                row["trial_to_95pct"] = trial_to_fraction(curve)
                entry = results["patterns"].setdefault(job.pattern.name, {"shape": row["shape"]})
                entry["untuned_ms"] = row["untuned_ms"]
                entry[space] = {k: v for k, v in row.items() if k not in ("pattern", "shape")}
                rows.append(row)
        write_json(out, results)  # after every space, so an interrupted run keeps what it measured
    print(table(rows, [("pattern", "pattern"), ("shape", "shape"), ("space", "space"), ("trials", "trials"),
                       ("untuned_ms", "untuned ms"), ("best_ms", "best ms"), ("speedup", "speed-up"),
                       ("gflops", "GFLOP/s"), ("gbps", "GB/s"), ("trial_to_95pct", "trial to 95%"),
                       ("source", "best from")], markdown=True))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
