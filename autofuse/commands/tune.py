"""``autofuse tune``: tune patterns, or an ONNX model's kernels, into the database."""

from __future__ import annotations

import sys

from ..errors import AutofuseError
from .common import (db_flag, fusion_flag, input_shape_flag, input_shapes, open_database, pattern_flags,
                     positive_float, positive_int, pattern_jobs, print_matches, target_flag, target_of)

DEFAULT_PATTERN = "linear_bias_relu"
DEFAULT_TRIALS = 32
NEEDS_DEVICE = "tuning checks and times the best records on it (run autofuse tune on the GPU's host)"


def add_parser(sub) -> None:
    tune = sub.add_parser("tune", help="tune fusion patterns into the database and print the result table",
                          description=(
        "Tune a pattern (or all of them) with MetaSchedule. With no arguments it tunes "
        f"{DEFAULT_PATTERN} at its default shape on this CPU for {DEFAULT_TRIALS} trials. Running it "
        "again on the same database resumes from the stored records and adds --trials more. The best "
        "record is checked against the numpy reference before it is reported."), parents=[
        pattern_flags(f"pattern name, several separated by commas, or 'all' (default {DEFAULT_PATTERN})",
                      "override a shape parameter, repeatable or comma-separated (see autofuse list)"),
        target_flag("llvm (this CPU, with its mcpu and core count), cuda/h200, or a JSON target dict"),
        db_flag("database root; records go to DB/<target-key>/ (default logs)"),
        fusion_flag("for a model: none (op per kernel), auto (TVM FuseOps, the XLA-style baseline) or "
                    "patterns (our patterns matched first, the rest auto; default)"), input_shape_flag()])
    tune.set_defaults(handler=run)
    tune.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx",
                      help="tune this ONNX model's kernels instead of a pattern (see --fusion)")
    tune.add_argument("--trials", default=DEFAULT_TRIALS, type=positive_int,
                      help=f"trials to add per pattern workload, or shared by a model's kernels by weight "
                           f"(default {DEFAULT_TRIALS})")
    tune.add_argument("--space", default="union", choices=["template", "generic", "union"],
                      help="template: our hand-designed templates; generic: MetaSchedule's default rules "
                           "(Ansor-style); union: both (default)")
    tune.add_argument("--seed", default=None, type=int, help="random seed of the search")
    tune.add_argument("--timeout", default=30.0, type=positive_float, metavar="SECS",
                      help="a candidate that runs longer (or crashes) is stored as a failed trial (default 30)")
    tune.add_argument("--rpc", default=None, metavar="HOST:PORT:KEY",
                      help="measure on the RPC servers registered under KEY at this TVM tracker (builds stay "
                           "here; --target must describe the servers' device)")
    tune.add_argument("--rpc-workers", default=None, type=positive_int, metavar="N",
                      help="measurements in flight with --rpc (default: the number of servers of KEY)")
    tune.add_argument("--json", default=None, metavar="PATH", help="also write the result rows as JSON")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    if args.model is not None:
        return _tune_model(args)
    if args.input_shape:
        raise AutofuseError("--input-shape applies to a model (autofuse tune MODEL.onnx), not to patterns")
    args.pattern = args.pattern or DEFAULT_PATTERN
    from ..report import TUNE_COLUMNS, table
    from ..target import target_key
    from ..tune_patterns import tune_jobs

    target = target_of(args, NEEDS_DEVICE)
    jobs = pattern_jobs(args)
    for job in jobs:
        if args.space == "template" and not job.pattern.templates_for(target):
            raise AutofuseError(f"pattern {job.pattern.name!r} has no template for {target.kind.name}; "
                                "use --space generic")
    runner, runner_status = _runner(args)
    db = open_database(args, target)
    print(f"autofuse: tuning {len(jobs)} workload(s) on {target_key(target)}, space {args.space}, "
          f"{args.trials} trials each, database {db.path}", file=sys.stderr)
    rows, stats = tune_jobs(jobs, target, db, trials=args.trials, space=args.space, seed=args.seed,
                            run_timeout=args.timeout, progress=not args.no_progress,
                            runner=runner, runner_status=runner_status)
    print(table(rows, TUNE_COLUMNS))
    for row in rows:
        for line in row["rejected"]:
            print(f"  {row['pattern']}: {line}")
        if row["best_ms"] is None:
            print(f"  {row['pattern']}: no record passed the numerical check; nothing to report")
    print(_throughput_line(stats))
    _write_json(args, target, rows, stats, trials_per_workload=args.trials)
    return 0 if all(row["best_ms"] is not None for row in rows) else 1


def _write_json(args, target, rows, stats, **head) -> None:
    """``--json``: the result rows and the session's figures."""
    from ..report import machine_info, write_json

    if args.json:
        write_json(args.json, {"machine": machine_info(), "target": str(target), "space": args.space, **head,
                               "rows": rows,
                               "session": {"trials": stats.total_trials, "secs": stats.total_secs,
                                           "first_trial_secs": stats.first_trial_secs,
                                           "trials_per_minute": stats.trials_per_minute(),
                                           "steady_trials_per_minute": stats.steady_trials_per_minute()}})


def _tune_model(args) -> int:
    from ..model.jobs import prepare, tune_model
    from ..report import table
    from ..target import target_key

    if args.pattern or args.shape or args.small:
        raise AutofuseError("--pattern/--shape/--small apply to pattern tuning, not to a model")
    target = target_of(args, NEEDS_DEVICE)
    shapes = input_shapes(args.input_shape)
    prepared = prepare(args.model, args.fusion, shapes)
    print_matches(prepared)
    runner, runner_status = _runner(args)
    db = open_database(args, target)
    print(f"autofuse: tuning {prepared.name} (fusion {args.fusion}) on {target_key(target)}, {args.trials} trials "
          f"shared by its kernels, database {db.path}", file=sys.stderr)
    tasks, stats = tune_model(prepared, target, db, trials=args.trials, space=args.space, seed=args.seed,
                              run_timeout=args.timeout, progress=not args.no_progress,
                              runner=runner, runner_status=runner_status)
    rows = [{"kernel": t.name, "weight": t.weight, "space": t.space, "trials": stats.trials.get(i, 0),
             "best_ms": stats.best_secs[i] * 1e3 if i in stats.best_secs else None,
             "tune_secs": stats.task_secs.get(i, 0.0)} for i, t in enumerate(tasks)]
    print(table(rows, [("kernel", "kernel"), ("weight", "runs"), ("space", "space"), ("trials", "trials"),
                       ("best_ms", "best ms (measured in tuning)"), ("tune_secs", "time s")]))
    print(_throughput_line(stats))
    _write_json(args, target, rows, stats, model=args.model, fusion=args.fusion, trials_shared=args.trials)
    bind = "".join(f" --input-shape {n}={'x'.join(map(str, d))}" for n, d in (shapes or {}).items())
    print(f"next: autofuse build {args.model} --fusion {args.fusion} --db {args.db}{bind}")
    return 0


def _runner(args):
    """(runner, status for the progress bar) of ``--rpc``; (None, None) measures here."""
    if args.rpc is None:
        if args.rpc_workers is not None:
            raise AutofuseError("--rpc-workers needs --rpc HOST:PORT:KEY")
        return None, None
    from .. import rpc

    address = rpc.parse_address(args.rpc)
    servers = rpc.check_servers(address)
    workers = args.rpc_workers or servers
    print(f"autofuse: measuring through the RPC tracker {address.host}:{address.port}, key {address.key} "
          f"({servers} server(s), {workers} measurement(s) in flight)", file=sys.stderr)
    return rpc.make_runner(address, workers, args.timeout), rpc.bar_status(address)


def _throughput_line(stats) -> str:
    if stats.first_trial_secs is None:
        return f"no trial measured ({stats.total_secs:.1f} s)"
    steady = stats.steady_trials_per_minute()
    steady_text = f", {steady:.1f}/min after the first batch" if steady else ""
    return (f"{stats.total_trials} trials in {stats.total_secs:.1f} s ({stats.trials_per_minute():.1f} trials/min"
            f"{steady_text}); first batch of {stats.first_batch_trials} measured after "
            f"{stats.first_trial_secs:.1f} s")
