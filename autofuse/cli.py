"""The ``autofuse`` command: sub-commands ``tune``, ``build``, ``compare``, ``db``, ``rpc``, ``run`` and ``list``.

Every known problem with the user's input is an ``AutofuseError``; this module alone prints it, as
one line on stderr, and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from .baselines import BASELINES
from .errors import AutofuseError

DEFAULT_PATTERN = "linear_bias_relu"
DEFAULT_TRIALS = 32


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _shape_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items or []:
        for part in item.split(","):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key or not value:
                raise AutofuseError(f"--shape expects key=value (e.g. m=128), got {part!r}")
            overrides[key.strip()] = value.strip()
    return overrides


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autofuse", description=(
        "Search fused-kernel schedules with TVM MetaSchedule: hand-designed templates vs the generic "
        "(Ansor-style) space, best records kept in a JSON tuning database."))
    from . import __version__
    parser.add_argument("--version", action="version", version=f"autofuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    tune = sub.add_parser("tune", help="tune fusion patterns into the database and print the result table",
                          description=(
        "Tune a pattern (or all of them) with MetaSchedule. With no arguments it tunes "
        f"{DEFAULT_PATTERN} at its default shape on this CPU for {DEFAULT_TRIALS} trials. Running it "
        "again on the same database resumes from the stored records and adds --trials more. The best "
        "record is checked against the numpy reference before it is reported."))
    tune.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx",
                      help="tune this ONNX model's kernels instead of a pattern (see --fusion)")
    tune.add_argument("--pattern", default=None, help=f"pattern name, several separated by commas, or 'all' (default {DEFAULT_PATTERN})")
    tune.add_argument("--fusion", default="patterns", choices=["none", "auto", "patterns"],
                      help="for a model: none (op per kernel), auto (TVM FuseOps, the XLA-style baseline) or "
                           "patterns (our patterns matched first, the rest auto; default)")
    tune.add_argument("--shape", action="append", metavar="K=V",
                      help="override a shape parameter, repeatable or comma-separated (see autofuse list)")
    tune.add_argument("--dtype", default=None, help="element type (default: the pattern's first)")
    tune.add_argument("--target", default="llvm",
                      help="llvm (this CPU, with its mcpu and core count), cuda/h200, or a JSON target dict")
    tune.add_argument("--trials", default=DEFAULT_TRIALS, type=_positive_int,
                      help=f"trials to add per pattern workload, or shared by a model's kernels by weight "
                           f"(default {DEFAULT_TRIALS})")
    tune.add_argument("--space", default="union", choices=["template", "generic", "union"],
                      help="template: our hand-designed templates; generic: MetaSchedule's default rules "
                           "(Ansor-style); union: both (default)")
    tune.add_argument("--db", default="logs", help="database root; records go to DB/<target-key>/ (default logs)")
    tune.add_argument("--seed", default=None, type=int, help="random seed of the search")
    tune.add_argument("--timeout", default=30.0, type=_positive_float, metavar="SECS",
                      help="a candidate that runs longer (or crashes) is stored as a failed trial (default 30)")
    tune.add_argument("--rpc", default=None, metavar="HOST:PORT:KEY",
                      help="measure on the RPC servers registered under KEY at this TVM tracker (builds stay "
                           "here; --target must describe the servers' device)")
    tune.add_argument("--rpc-workers", default=None, type=_positive_int, metavar="N",
                      help="measurements in flight with --rpc (default: the number of servers of KEY)")
    tune.add_argument("--json", default=None, metavar="PATH", help="also write the result rows as JSON")
    tune.add_argument("--small", action="store_true", help="use each pattern's small test shape")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")

    build = sub.add_parser("build", help="build an ONNX model with the tuned records into a shared library",
                           description=(
        "Fuse MODEL, give every kernel its best checked record when that beats the default schedule "
        "(pattern kernels default to their template), build with relax.build, export a library that "
        "TVM's runtime loads alone (plus LIB.json describing inputs and kernels), and check the "
        "result against onnxruntime on seeded inputs (exit 1 on a mismatch)."))
    build.add_argument("model", metavar="MODEL.onnx")
    build.add_argument("--fusion", default="patterns", choices=["none", "auto", "patterns"])
    build.add_argument("--db", default="logs", help="database root (default logs); --db none builds without records")
    build.add_argument("--target", default="llvm")
    build.add_argument("-o", "--output", default=None, help="library path (default out/<model>-<fusion>.so)")
    build.add_argument("--no-verify", action="store_true", help="skip the onnxruntime check")
    build.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")
    build.add_argument("--cuda-graph", action="store_true",
                       help="cuda targets: capture main's kernel launches into a CUDA graph (Relax RewriteCUDAGraph)")

    cmp = sub.add_parser("compare", help="time tuned kernels against onnxruntime, XLA and TVM baselines",
                         description=(
        "Measure autofuse against the baselines on the same seeded inputs, in one process, pinned to "
        "the same threads: tvm-untuned (FuseOps, default schedules), tvm-auto (FuseOps + generic-space "
        "records from the same database), onnxruntime (ORT_ENABLE_ALL) and xla (jax.jit of the same "
        "ONNX graph). Outputs are checked against the reference first; a contender that disagrees is "
        "marked invalid. Writes report.md, report.json, report.png and roofline.png to --report."))
    cmp.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx", help="compare on this ONNX model")
    cmp.add_argument("--from-json", default=None, metavar="GPU.json",
                     help="measure nothing: render a benchmarks/gpu.py result (e.g. from the H200) as report.md, "
                          "report.png and roofline.png in --report")
    cmp.add_argument("--pattern", default=None, help="compare on a pattern (several separated by commas, or 'all') at its default shape")
    cmp.add_argument("--shape", action="append", metavar="K=V", help="override a pattern shape parameter")
    cmp.add_argument("--small", action="store_true", help="use each pattern's small test shape")
    cmp.add_argument("--dtype", default=None, help="element type (default: the pattern's first)")
    cmp.add_argument("--db", default="logs", help="database root (default logs); none: no records")
    cmp.add_argument("--target", default="llvm")
    cmp.add_argument("--baselines", default=",".join(BASELINES),
                     help=f"comma-separated subset of {','.join(BASELINES)} (default all)")
    cmp.add_argument("--trials", default=0, type=_non_negative_int,
                     help="first tune ours (union space) and tvm-auto (generic space) for this many more trials "
                          "each into --db, the same budget for both (default 0: use the database as it is)")
    cmp.add_argument("--repeat", default=20, type=_positive_int, help="timed repeats per contender (default 20)")
    cmp.add_argument("--warmup", default=3, type=_non_negative_int, help="untimed calls first (default 3)")
    cmp.add_argument("--threads", default=None, type=_positive_int,
                     help="cores every contender may use (default all of this process's cores)")
    cmp.add_argument("--report", default=None, metavar="DIR", help="report folder (default reports/<name>)")
    cmp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar while tuning")
    cmp.add_argument("--seed", default=None, type=int, help="random seed of the search (with --trials)")

    db = sub.add_parser("db", help="check or compact a tuning database",
                        description="Inspect and maintain the tuning database: every target folder under --db.")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", parser_class=_Parser, required=True)
    check = db_sub.add_parser("check", help="report damaged lines, stale records and failed numerical checks",
                              description=(
        "Read every target folder under --db and report lines that are skipped (not JSON, record of an "
        "unknown workload, half-written), records whose trace no longer applies to their TensorIR, and "
        "records that failed the numerical check. Exit 0 when clean, 1 when something was found."))
    check.add_argument("--db", default="logs", help="database root (default logs)")
    compact = db_sub.add_parser("compact", help="rewrite the database keeping the best records per workload",
                                description=(
        "Rewrite every target folder under --db keeping the --keep fastest valid records per workload whose "
        "trace still applies; damaged lines and failed trials go. The files are replaced atomically and the "
        "old ones kept as *.bak. Safe while other autofuse processes use the database."))
    compact.add_argument("--db", default="logs", help="database root (default logs)")
    compact.add_argument("--keep", default=16, type=_positive_int, help="records kept per workload (default 16)")

    rpc = sub.add_parser("rpc", help="start TVM's RPC tracker or a server, or show the tracker's queue",
                         description=(
        "Measurement farms with TVM's own RPC pieces. Start a tracker once, one server per device (on this "
        "or other machines) registered under a key, then `autofuse tune --rpc HOST:PORT:KEY`."))
    rpc_sub = rpc.add_subparsers(dest="rpc_command", metavar="ACTION", parser_class=_Parser, required=True)
    tracker = rpc_sub.add_parser("tracker", help="run TVM's RPC tracker (python -m tvm.exec.rpc_tracker)",
                                 description="Run TVM's RPC tracker in the foreground until interrupted.")
    tracker.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: all)")
    tracker.add_argument("--port", default=9190, type=_positive_int, help="port (default 9190)")
    server = rpc_sub.add_parser("server", help="run a TVM RPC server registered at a tracker",
                                description=(
        "Run TVM's RPC server (python -m tvm.exec.rpc_server) in the foreground, registered at --tracker "
        "under --key. Run one per device; on a GPU host pin each to its GPU with CUDA_VISIBLE_DEVICES."))
    server.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the tracker to register at")
    server.add_argument("--key", required=True, help="device key the tuner asks for (e.g. cpu, h200)")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    server.add_argument("--port", default=9090, type=_positive_int,
                        help="first port to try (default 9090; the next free one up to +100 is used)")
    status = rpc_sub.add_parser("status", help="servers and queue of a tracker",
                                description="Print the servers registered at a tracker and the queue per key.")
    status.add_argument("--tracker", default="127.0.0.1:9190", metavar="HOST:PORT",
                        help="tracker address (default 127.0.0.1:9190)")

    run = sub.add_parser("run", help="run a library built by autofuse build",
                         description="Run LIB on inputs from an .npz (arrays named as the model's inputs) "
                                     "or on seeded random inputs; print a summary, optionally save the outputs.")
    run.add_argument("library", metavar="LIB.so")
    run.add_argument("--inputs", default=None, metavar="X.npz")
    run.add_argument("--save", default=None, metavar="OUT.npz", help="save the outputs")
    run.add_argument("--seed", type=int, default=0)

    lst = sub.add_parser("list", help="list patterns, their shapes and templates, and stored best latency",
                         description="List the patterns; with a database, the best checked latency of each "
                                     "workload stored there.")
    lst.add_argument("--db", default="logs", help="database root (default logs)")
    lst.add_argument("--target", default="llvm", help="target whose records to show (default llvm)")
    return parser


def _number(convert, noun: str, accept, rule: str):
    """An argparse type: ``convert`` the text (else "not {noun}"), then ``accept`` it (else "must be {rule}")."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


_positive_int = _number(lambda t: int(t, 10), "an integer", lambda v: v > 0, "positive")
_non_negative_int = _number(lambda t: int(t, 10), "an integer", lambda v: v >= 0, "zero or more")
_positive_float = _number(float, "a number", lambda v: v > 0, "positive")


def _render_gpu_json(args) -> int:
    import json
    import os

    from .compare import report_from_gpu
    from .report import table, write_compare_report

    if args.model is not None or args.pattern is not None or args.trials:
        raise AutofuseError("--from-json renders a finished run: drop MODEL, --pattern and --trials")
    try:
        with open(args.from_json, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise AutofuseError(f"cannot read {args.from_json}: {err.strerror}") from None
    except ValueError as err:
        raise AutofuseError(f"{args.from_json} is not JSON: {err}") from None
    report = report_from_gpu(data)
    folder = args.report or os.path.join("reports", os.path.splitext(os.path.basename(args.from_json))[0])
    written = write_compare_report(report, folder, plots=not args.no_plots)
    from .report import summary_rows
    print(table(summary_rows(report), [("subject", "subject"), *[(n, n) for n in ["autofuse", *report["baselines"]]],
                                       ("ratio", "ratio")]))
    print("wrote " + ", ".join(written))
    return 0


def cmd_compare(args) -> int:
    import os

    if args.from_json is not None:
        return _render_gpu_json(args)
    from .compare import pin_threads
    threads = pin_threads(args.threads)  # before any runtime starts its thread pool

    from .baselines import Context
    from .compare import (compare_subject, model_subject, new_report, parse_baselines, pattern_subject,
                          tune_subject)
    from .database import TuningDatabase
    from .registry import resolve_patterns
    from .report import COMPARE_COLUMNS, table, write_compare_report
    from .roofline import load_or_measure
    from .target import device_for, parse_target

    if (args.model is None) == (args.pattern is None):
        raise AutofuseError("give a MODEL.onnx or --pattern NAME|all (one of them)")
    if args.model is not None and (args.shape or args.small or args.dtype):
        raise AutofuseError("--shape/--small/--dtype apply to patterns, not to a model")
    baselines = parse_baselines(args.baselines)
    target = parse_target(args.target)
    _require_device(target, "compare measures on it (on a GPU's host run benchmarks/gpu.py, "
                            "then render its JSON here with --from-json)")
    if args.trials and args.db == "none":
        raise AutofuseError("--trials needs a database: drop --db none")
    name = os.path.splitext(os.path.basename(args.model))[0] if args.model is not None else args.pattern
    folder = args.report or os.path.join("reports", name)
    overrides = _shape_overrides(args.shape)
    jobs = []  # (pattern, shape, dtype), all checked before anything is written
    if args.model is None:
        patterns = resolve_patterns(args.pattern)
        if overrides and len(patterns) > 1:
            raise AutofuseError("--shape applies to one pattern; drop it with several patterns")
        from .tune_patterns import Job
        for pattern in patterns:
            job = Job(pattern, pattern.resolve_shape(overrides, base="small" if args.small else "default"),
                      pattern.check_dtype(args.dtype or pattern.dtypes[0]))  # builds: the pattern's shape rules
            jobs.append((pattern, job.shape, job.dtype))
    _check_writable(folder)
    subjects = [model_subject(args.model)] if args.model is not None else [
        pattern_subject(pattern, shape, dtype, os.path.join(folder, "graphs")) for pattern, shape, dtype in jobs]
    db = None if args.db == "none" else TuningDatabase(args.db, target)
    ctx = Context(target, device_for(target), threads, db, work_dir=folder)
    cache = os.path.join(db.path, "roofline.json") if db is not None else None
    print(f"autofuse: measuring this machine's roofline ({threads} threads)", file=sys.stderr)
    machine = load_or_measure(cache, threads)
    report = new_report(ctx, machine, baselines=baselines, trials=args.trials, repeat=args.repeat,
                        warmup=args.warmup)
    if args.trials:  # all tuning first, so no measurement shares the cores with a tuning run
        for subject in subjects:
            report["budgets"][subject.name] = tune_subject(subject, ctx, baselines, args.trials, args.seed,
                                                           progress=not args.no_progress)
    for subject in subjects:
        entry = compare_subject(subject, ctx, baselines, machine, repeat=args.repeat, warmup=args.warmup,
                                log=lambda msg: print(f"autofuse: measuring {msg}", file=sys.stderr))
        report["subjects"].append(entry)
        print(f"\n{subject.kind} {subject.name}")
        print(table(entry["contenders"], COMPARE_COLUMNS))
        for c in entry["contenders"]:
            if c["status"] != "ok":
                print(f"  {c['name']}: {c['status']}: {c['reason']}")
    plots = not args.no_plots
    if plots:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            print("autofuse compare: matplotlib is not installed: no plots (pip install -e '.[bench]')",
                  file=sys.stderr)
            plots = False
    written = write_compare_report(report, folder, plots=plots)
    print(f"\nwrote {', '.join(written)}")
    invalid = [f"{s['name']}/{c['name']}" for s in report["subjects"] for c in s["contenders"]
               if c["status"] in ("invalid", "failed")]
    if any(s["contenders"][0]["status"] != "ok" for s in report["subjects"]):
        print("autofuse compare: autofuse itself did not produce a valid, timed result", file=sys.stderr)
        return 1
    if invalid:
        print(f"autofuse compare: invalid or failed contenders: {', '.join(invalid)}", file=sys.stderr)
    return 0


def cmd_db(args) -> int:
    from .database import check_folder, compact_folder, database_folders

    folders = database_folders(args.db)
    if args.db_command == "compact":
        for folder in folders:
            before, after = compact_folder(folder, args.keep)
            print(f"{folder}: {before} records -> {after} (best {args.keep} per workload; old files kept as *.bak)")
        return 0
    dirty = False
    for folder in folders:
        found = check_folder(folder)
        print(f"{folder}: {found['workloads']} workloads, {found['records']} records ({found['valid']} valid), "
              f"{found['failed_numerical_check']} failed the numerical check (kept, never chosen)")
        for problem in found["problems"]:
            print(f"  {problem}")
        dirty |= bool(found["problems"])
    if dirty:
        print("problems found: `autofuse db compact` rewrites the database without them", file=sys.stderr)
    return 1 if dirty else 0


def _check_writable(folder: str) -> None:
    """Before any work: the report folder must exist as a writable directory or be creatable."""
    import os
    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    probe = probe or "."
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise AutofuseError(f"report folder {folder} cannot be written ({probe} is not a writable directory)")


def _require_device(target, doing: str) -> None:
    """Before any work: the target's device must be on this machine (a CUDA target on a machine
    without a GPU would otherwise fail deep inside TVM, after a minute of setup)."""
    from .target import device_for
    if not device_for(target).exist:
        raise AutofuseError(f"no {target.kind.name} device on this machine: {doing}")


def cmd_tune(args) -> int:
    if args.model is not None:
        return _tune_model(args)
    args.pattern = args.pattern or DEFAULT_PATTERN
    from .database import TuningDatabase
    from .registry import resolve_patterns
    from .report import TUNE_COLUMNS, machine_info, table, write_json
    from .target import parse_target, target_key
    from .tune_patterns import Job, tune_jobs

    target = parse_target(args.target)
    _require_device(target, "tuning checks and times the best records on it (run autofuse tune on the GPU's host)")
    patterns = resolve_patterns(args.pattern)
    overrides = _shape_overrides(args.shape)
    if overrides and len(patterns) > 1:
        raise AutofuseError("--shape applies to one pattern; drop it with several patterns")
    jobs = []
    for pattern in patterns:
        dtype = pattern.check_dtype(args.dtype or pattern.dtypes[0])
        shape = pattern.resolve_shape(overrides, base="small" if args.small else "default")
        if not pattern.templates_for(target) and args.space == "template":
            raise AutofuseError(f"pattern {pattern.name!r} has no template for {target.kind.name}; use --space generic")
        jobs.append(Job(pattern, shape, dtype))
    runner, runner_status = _runner(args)
    db = TuningDatabase(args.db, target)
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
    if args.json:
        write_json(args.json, {"machine": machine_info(), "target": str(target), "space": args.space,
                               "trials_per_workload": args.trials, "rows": rows,
                               "session": {"trials": stats.total_trials, "secs": stats.total_secs,
                                           "first_trial_secs": stats.first_trial_secs,
                                           "trials_per_minute": stats.trials_per_minute(),
                                           "steady_trials_per_minute": stats.steady_trials_per_minute()}})
    return 0 if all(row["best_ms"] is not None for row in rows) else 1


def _tune_model(args) -> int:
    from .database import TuningDatabase
    from .model.jobs import prepare, tune_model
    from .report import table
    from .target import parse_target, target_key

    if args.pattern or args.shape or args.small:
        raise AutofuseError("--pattern/--shape/--small apply to pattern tuning, not to a model")
    target = parse_target(args.target)
    _require_device(target, "tuning checks and times the best records on it (run autofuse tune on the GPU's host)")
    prepared = prepare(args.model, args.fusion)
    _print_matches(prepared)
    runner, runner_status = _runner(args)
    db = TuningDatabase(args.db, target)
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
    print(f"next: autofuse build {args.model} --fusion {args.fusion} --db {args.db}")
    return 0


def _runner(args):
    """(runner, status for the progress bar) of ``--rpc``; (None, None) measures here."""
    if args.rpc is None:
        if args.rpc_workers is not None:
            raise AutofuseError("--rpc-workers needs --rpc HOST:PORT:KEY")
        return None, None
    from . import rpc

    address = rpc.parse_address(args.rpc)
    servers = rpc.check_servers(address)
    workers = args.rpc_workers or servers
    print(f"autofuse: measuring through the RPC tracker {address.host}:{address.port}, key {address.key} "
          f"({servers} server(s), {workers} measurement(s) in flight)", file=sys.stderr)
    return rpc.make_runner(address, workers, args.timeout), rpc.bar_status(address)


def cmd_rpc(args) -> int:
    import os
    from . import rpc

    if args.rpc_command == "status":
        print(rpc.status_text(rpc.parse_address(args.tracker, need_key=False)))
        return 0
    if args.rpc_command == "tracker":
        command = rpc.tracker_command(args.host, args.port)
    else:
        tracker = rpc.parse_address(args.tracker, need_key=False)
        rpc.summary(tracker)  # fail now, not after TVM's minute of retries
        command = rpc.server_command(tracker, args.key, args.host, args.port)
    print("autofuse: " + " ".join(command[1:]), file=sys.stderr, flush=True)
    os.execv(command[0], command)  # TVM's own process, signals and all
    return 0


def _print_matches(prepared) -> None:
    if prepared.fusion != "patterns":
        return
    if prepared.matches:
        found = ", ".join(f"{name} x{count}" for name, count in sorted(prepared.matches.items()))
        print(f"autofuse: matched patterns in {prepared.name}: {found}", file=sys.stderr)
    else:
        print(f"autofuse: no pattern matched in {prepared.name}; everything goes through auto fusion", file=sys.stderr)


def cmd_build(args) -> int:
    import dataclasses
    import os

    from .database import TuningDatabase
    from .model.jobs import build_model, prepare
    from .report import table
    from .target import parse_target

    target = parse_target(args.target)
    if args.cuda_graph and target.kind.name != "cuda":
        raise AutofuseError(f"--cuda-graph needs a cuda target, not {target.kind.name}")
    _require_device(target, "cannot run or check the build")
    prepared = prepare(args.model, args.fusion)
    _print_matches(prepared)
    output = args.output or os.path.join("out", f"{prepared.name}-{args.fusion}.so")
    db = None if args.db == "none" else TuningDatabase(args.db, target)
    result = build_model(prepared, target, db, output, verify=not args.no_verify, seed=args.seed,
                         cuda_graph=args.cuda_graph)
    rows = [dataclasses.asdict(d) for d in result.decisions]
    print(table(rows, [("name", "kernel"), ("pattern", "pattern"), ("applied", "applied"), ("source", "record from"),
                       ("default_ms", "default ms"), ("tuned_ms", "record ms"), ("note", "note")]))
    applied = sum(d.applied == "record" for d in result.decisions)
    print(f"{applied} of {len(result.decisions)} kernels use a tuned record; the others their default schedule")
    print(f"model latency {result.latency_ms:.3f} ms (median); library {output}")
    if result.verified is None:
        print(f"not verified: {result.message or '--no-verify'}")
        return 0
    if not result.verified:
        print(f"autofuse build: MISMATCH against onnxruntime: max abs error {result.max_abs_err:.3g}, "
              f"max rel error {result.max_rel_err:.3g}", file=sys.stderr)
        return 1
    print(f"matches onnxruntime: max abs error {result.max_abs_err:.2g}, max rel error {result.max_rel_err:.2g}")
    return 0


def cmd_run(args) -> int:
    import numpy as np

    from .model.jobs import run_library

    _, outputs = run_library(args.library, args.inputs, args.seed)
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} {value.dtype}, mean {float(value.mean()):.6g}, "
              f"min {float(value.min()):.6g}, max {float(value.max()):.6g}")
    if args.save:
        try:
            np.savez(args.save, **outputs)
        except OSError as err:
            raise AutofuseError(f"cannot write {args.save}: {err.strerror}") from None
        print(f"saved {args.save}")
    return 0


def _throughput_line(stats) -> str:
    if stats.first_trial_secs is None:
        return f"no trial measured ({stats.total_secs:.1f} s)"
    steady = stats.steady_trials_per_minute()
    steady_text = f", {steady:.1f}/min after the first batch" if steady else ""
    return (f"{stats.total_trials} trials in {stats.total_secs:.1f} s ({stats.trials_per_minute():.1f} trials/min"
            f"{steady_text}); first batch of {stats.first_batch_trials} measured after "
            f"{stats.first_trial_secs:.1f} s")


def cmd_list(args) -> int:
    import os

    from .pattern import shape_label
    from .registry import all_patterns
    from .report import table
    from .target import parse_target, target_key

    target = parse_target(args.target)
    db_path = os.path.join(args.db, target_key(target))
    db = None
    if os.path.exists(os.path.join(db_path, "database_tuning_record.json")):
        from .database import TuningDatabase
        db = TuningDatabase(args.db, target)
    rows = []
    for pattern in all_patterns().values():
        row = {"family": pattern.family, "pattern": pattern.name,
               "shape": shape_label(pattern.default_shape()), "small": shape_label(pattern.small_shape()),
               "dtypes": ",".join(pattern.dtypes), "templates": ",".join(t.name for t in pattern.templates),
               "description": pattern.description}
        if db is not None:
            row.update(_stored_best(db, pattern, target))
        rows.append(row)
    columns = [("family", "family"), ("pattern", "pattern"), ("shape", "default shape"),
               ("small", "small shape"), ("templates", "templates")]
    if db is not None:
        columns += [("records", "records"), ("best_ms", "best ms (default shape)"), ("source", "best from")]
    print(table(rows, columns))
    print()
    for row in rows:
        print(f"{row['pattern']}: {row['description']}")
    if db is None:
        print(f"\n(no database at {db_path}: run `autofuse tune` to fill it)")
    return 0


def _stored_best(db, pattern, target) -> dict:
    from .tune_patterns import Job, checker
    import tvm

    job = Job(pattern, pattern.default_shape(), pattern.dtypes[0])
    dev = tvm.device("cpu" if target.kind.name == "llvm" else target.kind.name, 0)
    _, total = db.count(job.func)
    if not total:
        return {"records": 0}
    chosen, _ = db.best(job.func, checker(job, target, dev))
    if chosen is None:
        return {"records": total, "best_ms": None, "source": "none passed the check"}
    return {"records": total, "best_ms": chosen.run_secs * 1e3, "source": chosen.source}


COMMANDS = {"tune": cmd_tune, "build": cmd_build, "compare": cmd_compare, "db": cmd_db, "rpc": cmd_rpc, "run": cmd_run,
            "list": cmd_list}


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except AutofuseError as err:
        print(f"autofuse {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autofuse {args.command}: interrupted; records measured so far are in the database",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
