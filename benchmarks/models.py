"""Every model under models/: kernels per fusion mode, and latency untuned (no records) vs
auto-fusion tuned vs pattern-fusion tuned at an equal trial budget, each mode in its own database.

    python benchmarks/models.py [--trials 64] [--models mlp,conv_block]

Writes benchmarks/results/models-<target-key>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autofuse.database import TuningDatabase  # noqa: E402
from autofuse.model.fusion import MODES  # noqa: E402
from autofuse.model.jobs import build_model, prepare, tune_model  # noqa: E402
from autofuse.report import machine_info, table, write_json  # noqa: E402
from autofuse.target import parse_target, target_key  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--models", default="mlp,transformer_block,conv_block")
    parser.add_argument("--target", default="llvm")
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times
    target = parse_target(args.target)
    results = {"machine": machine_info(), "target": str(target), "trials_per_model": args.trials, "models": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="autofuse-models-") as scratch:
        for name in args.models.split(","):
            path = os.path.join(ROOT, "models", f"{name}.onnx")
            entry = results["models"][name] = {}
            for mode in MODES:
                prepared = prepare(path, mode)
                untuned = build_model(prepared, target, None, os.path.join(scratch, f"{name}-{mode}-untuned.so"))
                row = {"model": name, "fusion": mode, "kernels": len(untuned.kernels), "matches": prepared.matches,
                       "untuned_ms": untuned.latency_ms, "untuned_verified": untuned.verified}
                if mode != "none":
                    db = TuningDatabase(os.path.join(scratch, f"db-{name}-{mode}"), target)
                    start = time.perf_counter()
                    _, stats = tune_model(prepared, target, db, trials=args.trials, space="union", seed=0)
                    tuned = build_model(prepared, target, db, os.path.join(scratch, f"{name}-{mode}-tuned.so"))
                    row.update(tuned_ms=tuned.latency_ms, tuned_verified=tuned.verified,
                               tuned_max_abs_err=tuned.max_abs_err, tune_secs=time.perf_counter() - start,
                               trials=stats.total_trials,
                               records_applied=sum(d.applied == "record" for d in tuned.decisions),
                               kernel_decisions=[d.__dict__ for d in tuned.decisions])
                entry[mode] = row
                rows.append(row)
                print(f"{name} {mode}: {row}", flush=True)
    out = os.path.join(RESULTS, f"models-{target_key(target)}.json")
    write_json(out, results)
    print(table(rows, [("model", "model"), ("fusion", "fusion"), ("kernels", "kernels"), ("untuned_ms", "untuned ms"),
                       ("trials", "trials"), ("records_applied", "records applied"), ("tuned_ms", "tuned ms"),
                       ("tuned_verified", "matches ORT")], markdown=True))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
