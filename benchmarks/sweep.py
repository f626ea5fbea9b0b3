"""What the benchmarks that run autofuse.compare's pipeline over a list of subjects share
(``gemm_sweep.py``: GEMM shapes, ``real_models.py``: the models of models/real/): their common
flags, the session (threads pinned first, one device context without records, the roofline, the
report's provenance), the JSON and Markdown written after every subject, and the number format."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

from autofuse.errors import AutofuseError

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(doc: str, default_trials: int, trials_help: str) -> argparse.ArgumentParser:
    """The flags every sweep takes; a script adds its own (what to sweep) before ``check``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--trials", type=int, default=default_trials, help=trials_help)
    parser.add_argument("--budget-secs", type=float, default=None, help="start no subject after this many seconds")
    parser.add_argument("--threads", type=int, default=None, help="cores for every contender (default: all)")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--db", default=None, help="database root (default: a fresh temporary folder)")
    parser.add_argument("--out", default=None, help="JSON path (default under benchmarks/results/)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="tuning seed (inputs are always seed 0)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def check(args) -> None:
    if args.trials < 0:
        raise AutofuseError(f"--trials must be 0 or more, got {args.trials}")
    if args.budget_secs is not None and args.budget_secs <= 0:
        raise AutofuseError(f"--budget-secs must be positive, got {args.budget_secs}")
    if args.repeat < 1 or args.warmup < 0:
        raise AutofuseError("--repeat must be at least 1 and --warmup 0 or more")


@dataclasses.dataclass
class Session:
    ctx: object          # no records: every contender's untuned run
    machine: object      # the roofline
    report: dict         # compare's report head, without its subjects and budgets
    db_root: str         # --db or a temporary folder
    work: str            # a temporary folder for the run
    out: str             # the JSON path


@contextlib.contextmanager
def session(args, argv: list[str], out_name: str, baselines: list[str], log):
    """Pin the threads (before TVM, onnxruntime or jax start their pools), then the device, the
    roofline (stored in the database root's target folder) and the report head."""
    from autofuse.compare import pin_threads
    threads = pin_threads(args.threads)

    from autofuse.baselines import Context
    from autofuse.compare import device_session, new_report
    from autofuse.database import TuningDatabase
    from autofuse.roofline import load_or_measure
    from autofuse.target import device_for, parse_target, target_key

    target = parse_target(args.target)
    out = args.out or os.path.join(RESULTS, f"{out_name}-{target_key(target)}.json")
    with tempfile.TemporaryDirectory(prefix=f"{out_name}-") as work:
        root = args.db or os.path.join(work, "db")
        ctx = Context(target, device_for(target), threads, None, work_dir=work)
        with device_session(ctx):
            log(f"this machine's roofline ({threads} threads)")
            machine = load_or_measure(os.path.join(TuningDatabase(root, target).path, "roofline.json"), threads)
            report = new_report(ctx, machine, baselines=baselines, trials=args.trials, repeat=args.repeat,
                                warmup=args.warmup, argv=argv)
            del report["subjects"], report["budgets"]
            report.update(budget_secs=args.budget_secs, input_seed=0, tuning_seed=args.seed,
                          database=args.db or "temporary (fresh for this run)", roofline=dataclasses.asdict(machine),
                          not_started=[])
            yield Session(ctx, machine, report, root, work, out)


def budget_spent(args, start: float, remaining: list[str], report: dict, log) -> bool:
    """Whether --budget-secs has run out since ``start`` (perf_counter); then ``remaining`` are
    recorded as not started."""
    if args.budget_secs is None or time.perf_counter() - start < args.budget_secs:
        return False
    report["not_started"] = list(remaining)
    log(f"--budget-secs {args.budget_secs} spent: {len(remaining)} not started")
    return True


def write(report: dict, path: str, markdown) -> None:
    """The JSON and, beside it, ``markdown(report)`` as ``.md``; each replaced whole."""
    from autofuse.report import write_json
    write_json(path, report)
    md = os.path.splitext(path)[0] + ".md"
    with open(f"{md}.tmp", "w", encoding="utf-8") as f:
        f.write(markdown(report))
    os.replace(f"{md}.tmp", md)


def main(name: str, script: str, parse_args, run, argv: list[str] | None) -> int:
    """Parse, run; bad input is one line and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        return run(args, [os.path.relpath(os.path.abspath(script), os.getcwd()), *argv])
    except AutofuseError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return 2


def median_ms(rows: dict, name: str) -> float | None:
    row = rows.get(name)
    return row["median_ms"] if row and row.get("status") == "ok" else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def drop_compare_ratios(rows: list[dict]) -> None:
    """compare's per-call ratios: a sweep puts its own on the subject."""
    for row in rows:
        for key in ("autofuse_speedup", "ratio_to_best_baseline", "best_baseline"):
            row.pop(key, None)
