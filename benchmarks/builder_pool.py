"""A tuning session with MetaSchedule's LocalBuilder (a fresh pool of build processes for every
batch) against autofuse's PooledBuilder (one pool for the session): wall time of the session, time
to its first measured trial and the seconds its batches waited on the builder (from MetaSchedule's
log, whole seconds per batch; the rest of a session depends on which candidates the search picks
to run), the same pattern, shape, trials and seed, alternating, each
session in a fresh process with a fresh database.

    python benchmarks/builder_pool.py [--trials 32] [--shape m=512,n=1024,k=1024] [--repeat 2]

Writes benchmarks/results/builder-pool-<target key>.json (or --out).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.provenance import code_commit  # noqa: E402
from autofuse.report import machine_info, write_json  # noqa: E402

# One session, run in a child process: BUILDER is "local" (MetaSchedule's LocalBuilder, as autofuse
# used before) or "pooled" (autofuse.tune.PooledBuilder); prints a JSON line.
SESSION = """
import datetime, glob, json, os, sys, tempfile, time
from tvm.s_tir import meta_schedule as ms
import autofuse.tune as tune
from autofuse.commands.common import shape_overrides
from autofuse.database import TuningDatabase
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.tune_patterns import Job, tune_jobs

builder, pattern, shape, trials, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if builder == "local":
    def local(*, f_build, **_):
        made = ms.builder.LocalBuilder(f_build=f_build)
        made.shutdown = lambda: None
        return made
    tune.PooledBuilder = local
target = parse_target("llvm")
p = get_pattern(pattern)
job = Job(p, p.resolve_shape(shape_overrides([shape])), p.dtypes[0])
root = tempfile.mkdtemp()
start = time.perf_counter()
rows, stats = tune_jobs([job], target, TuningDatabase(root, target), trials=trials, space="union",
                        seed=seed, progress=False)
session = time.perf_counter() - start
# Seconds between each batch's "to builder" and "to runner" lines of MetaSchedule's log: the builds.
build = 0.0
for log in glob.glob(os.path.join(root, "**", "*task_scheduler.log"), recursive=True):
    sent = None
    for line in open(log):
        if line.startswith("20") and "to builder" in line:
            sent = datetime.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
        elif line.startswith("20") and "to runner" in line and sent is not None:
            build += (datetime.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S") - sent).total_seconds()
            sent = None
print(json.dumps({"session_secs": session, "first_trial_secs": stats.first_trial_secs, "tune_secs": stats.total_secs,
                  "build_secs": build, "best_ms": rows[0].get("best_ms")}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="linear_bias_relu")
    parser.add_argument("--shape", default="m=512,n=1024,k=1024")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="sessions per builder, alternating")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times
    from autofuse.target import parse_target, target_key

    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"builder-pool-{target_key(parse_target('llvm'))}.json")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = []
    for index in range(args.repeat):
        for builder in ("local", "pooled"):
            done = subprocess.run([sys.executable, "-c", SESSION, builder, args.pattern, args.shape, str(args.trials),
                                   str(args.seed)], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            run = {"builder": builder, "index": index, "loadavg": list(os.getloadavg()),
                   **json.loads(done.stdout.strip().splitlines()[-1])}
            runs.append(run)
            print(f"{builder}: session {run['session_secs']:.1f} s, first trial {run['first_trial_secs']:.1f} s, "
                  f"builds {run['build_secs']:.0f} s", flush=True)
    summary = {b: {key: statistics.median(r[key] for r in runs if r["builder"] == b)
                   for key in ("session_secs", "first_trial_secs", "build_secs")} for b in ("local", "pooled")}
    write_json(out, {"schema": "autofuse.builder-pool/1", "code": code_commit(),
                     "command": shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                     "machine": machine_info(), "pattern": args.pattern, "shape": args.shape, "trials": args.trials,
                     "space": "union", "seed": args.seed, "runs": runs, "median": summary})
    print(json.dumps(summary), f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
