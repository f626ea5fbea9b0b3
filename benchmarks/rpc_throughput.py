"""Measurement throughput through TVM's RPC tracker on loopback: the same tuning budget with
1, 2, ... servers (and as many measurements in flight), against the local runner.

    python benchmarks/rpc_throughput.py [--servers 1,2] [--trials 48] [--pattern linear_bias_relu]

Each configuration tunes into a fresh database with the same seed, in its own process (so each
pays the same start-up), and reports trials per minute over the whole session and after the first
batch. Keep the machine otherwise idle. Writes benchmarks/results/rpc-<target-key>.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.report import machine_info, write_json  # noqa: E402
from autofuse.rpc import LocalFarm  # noqa: E402
from autofuse.target import parse_target, target_key  # noqa: E402


def tune(args, db: str, rpc: list[str]) -> dict:
    rows = os.path.join(db, "rows.json")
    command = [sys.executable, "-m", "autofuse.cli", "tune", "--pattern", args.pattern, "--trials", str(args.trials),
               "--seed", "0", "--db", db, "--no-progress", "--json", rows, *rpc]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"tuning failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    with open(rows, encoding="utf-8") as f:
        report = json.load(f)
    return {"session": report["session"], "best_ms": report["rows"][0]["best_ms"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="1,2", help="server counts to try (comma-separated)")
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--pattern", default="linear_bias_relu")
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times

    results = {"pattern": args.pattern, "trials": args.trials, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="autofuse-rpc-bench-") as scratch:
        results["runs"]["local"] = tune(args, os.path.join(scratch, "local"), [])
        for count in [int(c) for c in args.servers.split(",")]:
            with LocalFarm(count, key="bench", log_dir=os.path.join(scratch, f"farm{count}")) as farm:
                run = tune(args, os.path.join(scratch, f"rpc{count}"),
                           ["--rpc", str(farm.address), "--rpc-workers", str(count)])
                run["measured_per_server"] = farm.measured()
            results["runs"][f"rpc x{count}"] = run
    for name, run in results["runs"].items():
        session = run["session"]
        steady = session["steady_trials_per_minute"]
        print(f"{name:8s} {session['trials']:4d} trials in {session['secs']:6.1f} s: "
              f"{session['trials_per_minute']:5.1f} trials/min overall, "
              f"{steady or float('nan'):5.1f} after the first batch; best {run['best_ms']:.4f} ms"
              + (f"; per server {run['measured_per_server']}" if "measured_per_server" in run else ""))
    results["machine"] = machine_info()
    path = os.path.join(ROOT, "benchmarks", "results", f"rpc-{target_key(parse_target('llvm'))}.json")
    write_json(path, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
