"""How long a user waits for the first measured result of a model tune: `autofuse tune MODEL
--trials 512` on each model of the corpus (models/real/), from the command's start (import, fusion
and task extraction included) to the progress bar's first measured trial, then the tune is stopped.
Each run in a fresh database, the models one after another, ``--repeat`` rounds.

    python benchmarks/first_batch.py [--models bert,llama,...] [--variant torchscript-fixed]
                                     [--trials 512] [--repeat 1] [--limit-secs 240]

Writes benchmarks/results/first-batch-<target-key>.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = ("bert", "gpt2", "llama", "vit", "resnet18", "resnet50", "mobilenetv3_small", "shufflenetv2_x0_5")
# autofuse's progress bar names the best time once a trial has been measured
_MEASURED = re.compile(r"best \d")


def first_measured(stream, limit_secs: float, start: float) -> float | None:
    """Seconds from ``start`` (perf_counter) to the first progress line of ``stream`` (bytes, lines
    ended by \\r or \\n) that reports a measured trial; None when the stream ends or time runs out."""
    line = b""
    while time.perf_counter() - start < limit_secs:
        char = stream.read(1)
        if not char:
            return None
        if char in b"\r\n":
            if _MEASURED.search(line.decode(errors="replace")):
                return time.perf_counter() - start
            line = b""
        else:
            line += char
    return None


def time_model(path: str, trials: int, limit_secs: float) -> float | None:
    db = tempfile.mkdtemp(prefix="first-batch-")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", path, "--trials", str(trials), "--db", db],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        return first_measured(proc.stderr, limit_secs, start)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the tune and its builder processes
        proc.wait()
        shutil.rmtree(db, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variant", default="torchscript-fixed")
    parser.add_argument("--trials", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--limit-secs", type=float, default=240.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    from autofuse.provenance import code_commit
    from autofuse.report import machine_info, write_json
    from autofuse.target import parse_target, target_key

    out = args.out or os.path.join(REPO, "benchmarks", "results", f"first-batch-{target_key(parse_target('llvm'))}.json")
    models = [m for m in args.models.split(",") if m]
    runs: dict[str, list] = {m: [] for m in models}
    for _ in range(args.repeat):
        for model in models:
            path = os.path.join(REPO, "models", "real", f"{model}-{args.variant}.onnx")
            if not os.path.exists(path):
                print(f"first_batch: {path} does not exist", file=sys.stderr)
                return 2
            secs = time_model(path, args.trials, args.limit_secs)
            runs[model].append(secs)
            print(f"{model}: first measured trial after {'-' if secs is None else f'{secs:.1f} s'}", flush=True)
    results = {m: {"runs_secs": r, "median_secs": statistics.median([s for s in r if s is not None] or [float("nan")])}
               for m, r in runs.items()}
    write_json(out, {"schema": "autofuse.first_batch/1", "code": code_commit(), "command": " ".join(sys.argv),
                     "machine": machine_info(), "trials": args.trials, "variant": args.variant,
                     "measured": "command start to the progress bar's first measured trial", "models": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
