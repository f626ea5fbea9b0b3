"""The ``autofuse`` command: sub-commands ``tune``, ``build``, ``compare``, ``db``, ``rpc``, ``run`` and ``list``.

Every known problem with the user's input is an ``AutofuseError``; this module alone prints it, as
one line on stderr, and exits with code 2. The sub-commands live in ``autofuse/commands/``, one
module each; ``compare`` is still here.
"""

from __future__ import annotations

import sys

from .baselines import BASELINES
from .commands import build, db, listing, rpc, run, tune
from .commands.common import (Parser, db_flag, non_negative_int, pattern_flags, positive_int, target_flag,
                              check_writable as _check_writable, require_device as _require_device,
                              shape_overrides as _shape_overrides)
from .errors import AutofuseError


def _build_parser() -> Parser:
    parser = Parser(prog="autofuse", description=(
        "Search fused-kernel schedules with TVM MetaSchedule: hand-designed templates vs the generic "
        "(Ansor-style) space, best records kept in a JSON tuning database."))
    from . import __version__
    parser.add_argument("--version", action="version", version=f"autofuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    tune.add_parser(sub)
    build.add_parser(sub)
    _add_compare_parser(sub)
    for command in (db, rpc, run, listing):
        command.add_parser(sub)
    return parser


def _add_compare_parser(sub) -> None:
    cmp = sub.add_parser("compare", help="time tuned kernels against onnxruntime, XLA and TVM baselines",
                         description=(
        "Measure autofuse against the baselines on the same seeded inputs, in one process, pinned to "
        "the same threads: tvm-untuned (FuseOps, default schedules), tvm-auto (FuseOps + generic-space "
        "records from the same database), onnxruntime (ORT_ENABLE_ALL) and xla (jax.jit of the same "
        "ONNX graph). Outputs are checked against the reference first; a contender that disagrees is "
        "marked invalid. Writes report.md, report.json, report.png and roofline.png to --report."), parents=[
        pattern_flags("compare on a pattern (several separated by commas, or 'all') at its default shape",
                      "override a pattern shape parameter"),
        db_flag("database root (default logs); none: no records"), target_flag()])
    cmp.set_defaults(handler=cmd_compare)
    cmp.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx", help="compare on this ONNX model")
    cmp.add_argument("--from-json", default=None, metavar="GPU.json",
                     help="measure nothing: render a benchmarks/gpu.py result (e.g. from the H200) as report.md, "
                          "report.png and roofline.png in --report")
    cmp.add_argument("--baselines", default=",".join(BASELINES),
                     help=f"comma-separated subset of {','.join(BASELINES)} (default all)")
    cmp.add_argument("--trials", default=0, type=non_negative_int,
                     help="first tune ours (union space) and tvm-auto (generic space) for this many more trials "
                          "each into --db, the same budget for both (default 0: use the database as it is)")
    cmp.add_argument("--repeat", default=20, type=positive_int, help="timed repeats per contender (default 20)")
    cmp.add_argument("--warmup", default=3, type=non_negative_int, help="untimed calls first (default 3)")
    cmp.add_argument("--threads", default=None, type=positive_int,
                     help="cores every contender may use (default all of this process's cores)")
    cmp.add_argument("--report", default=None, metavar="DIR", help="report folder (default reports/<name>)")
    cmp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar while tuning")
    cmp.add_argument("--seed", default=None, type=int, help="random seed of the search (with --trials)")


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


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except AutofuseError as err:
        print(f"autofuse {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autofuse {args.command}: interrupted; records measured so far are in the database",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
