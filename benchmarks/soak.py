"""Soak test of the tuning database: tune for a long budget, kill -9 the tuner at random moments
(start-up, build, run, database write), restart it on the same database, and check that no
record committed before a kill is ever lost and that the database still loads everywhere.

    python benchmarks/soak.py [--kills 8] [--pattern softmax_dropout] [--min-secs 15 --max-secs 45]

Writes benchmarks/results/soak-<target-key>.json: per kill, the seconds it ran, records on disk
before the kill and after the restart, and at the end the total, lost (must be 0), the lines
moved aside as half-written, and whether plain TVM's JSONDatabase and `autofuse db check` accept
the result.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.database import RECORDS, WORKLOADS  # noqa: E402
from autofuse.report import machine_info, write_json  # noqa: E402
from autofuse.target import parse_target, target_key  # noqa: E402


def committed(folder: str) -> set[str]:
    """Digests of the complete record lines on disk (a torn last line is not a record yet)."""
    path = os.path.join(folder, RECORDS)
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    return {hashlib.sha1(line).hexdigest() for line in data.split(b"\n")[:-1] if line.strip()}


def tune_command(args, db: str, seed: int, trials: int) -> list[str]:
    return [sys.executable, "-m", "autofuse.cli", "tune", "--pattern", args.pattern, "--small",
            "--trials", str(trials), "--db", db, "--seed", str(seed), "--no-progress"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--pattern", default="softmax_dropout")
    parser.add_argument("--trials", type=int, default=400, help="budget of each killed run (never reached)")
    parser.add_argument("--final-trials", type=int, default=16, help="budget of the last, unkilled run")
    parser.add_argument("--min-secs", type=float, default=15.0)
    parser.add_argument("--max-secs", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times
    rng = random.Random(args.seed)
    key = target_key(parse_target("llvm"))
    result = {"machine": machine_info(), "pattern": args.pattern, "kills": [], "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="autofuse-soak-") as db:
        folder = os.path.join(db, key)
        seen: set[str] = set()
        lost: set[str] = set()
        for k in range(args.kills):
            before_start = committed(folder)
            lost |= seen - before_start
            proc = subprocess.Popen(tune_command(args, db, k, args.trials), cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            wait = rng.uniform(args.min_secs, args.max_secs)
            time.sleep(wait)
            proc.send_signal(signal.SIGKILL)
            _, stderr = proc.communicate()
            at_kill = committed(folder)
            lost |= before_start - at_kill
            seen |= at_kill
            result["kills"].append({"after_secs": round(wait, 1), "records_at_start": len(before_start),
                                    "records_at_kill": len(at_kill), "warnings": stderr.count("skipped")})
            print(f"kill {k + 1}/{args.kills} after {wait:.0f} s: {len(before_start)} -> {len(at_kill)} records",
                  flush=True)
        final = subprocess.run(tune_command(args, db, args.kills, args.final_trials), cwd=ROOT,
                               capture_output=True, text=True)
        at_end = committed(folder)
        lost |= seen - at_end
        from tvm.s_tir import meta_schedule as ms
        try:
            plain = len(ms.database.JSONDatabase(path_workload=os.path.join(folder, WORKLOADS),
                                                 path_tuning_record=os.path.join(folder, RECORDS),
                                                 allow_missing=False))
        except Exception as err:  # what this benchmark exists to catch
            plain = f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        check = subprocess.run([sys.executable, "-m", "autofuse.cli", "db", "check", "--db", db], cwd=ROOT,
                               capture_output=True, text=True)
        damaged = os.path.join(folder, RECORDS + ".damaged")
        result.update(final_exit_code=final.returncode, records_at_end=len(at_end), records_seen=len(seen),
                      lost=len(lost), plain_tvm_loads=plain, db_check_exit_code=check.returncode,
                      db_check=check.stdout.strip().splitlines(),
                      torn_lines_moved_aside=_count_lines(damaged))
    out = os.path.join(ROOT, "benchmarks", "results", f"soak-{key}.json")
    write_json(out, result)
    print(f"{args.kills} kills, {result['records_at_end']} records at the end, {result['lost']} lost, "
          f"{result['torn_lines_moved_aside']} torn lines moved aside; plain TVM loads: {plain}; "
          f"db check exit {check.returncode}; final run exit {final.returncode}")
    print(f"wrote {out}")
    return 0 if result["lost"] == 0 and final.returncode == 0 and check.returncode == 0 else 1


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


if __name__ == "__main__":
    sys.exit(main())
