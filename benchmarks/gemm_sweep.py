"""linear_bias_relu (float32) over a grid of GEMM shapes, every contender in one process through
autofuse.compare's pipeline: the same seeded inputs, thread count, numerical check and timer.

    python benchmarks/gemm_sweep.py [--trials 64] [--shapes MxNxK,...] [--budget-secs S] [--threads N]

Per shape: ours with the template default and no tuning (``ours-default``); with ``--trials N``
(N > 0) ours tuned in the union space (``ours-tuned``) and tvm-auto (MetaSchedule's generic space
on TVM's auto-fused kernels of the pattern's ONNX graph), N new trials each in one database; and
onnxruntime, XLA (jax.jit) and numpy (BLAS sgemm, then bias and ReLU in place). "ours / best" is
over onnxruntime, XLA and tvm-auto (compare's rivals); numpy is reported beside it.

Grid: m in {1, 16, 128, 512, 2048} x (n, k) in {(256, 256), (768, 768), (1024, 1024),
(3072, 768), (768, 3072), (4096, 4096), (1000, 1000), (3000, 1000)}, plus 2048x2048x2048 (the
issue's figure against numpy). ``--shapes`` takes any MxNxK list instead.

Writes ``benchmarks/results/gemm-sweep-<target-key>.json`` (and the Markdown table as ``.md``
beside it) after every shape, so a cut run keeps what it measured. The database is a fresh
temporary folder unless ``--db`` names one (then the trials add to what it holds: the JSON says
how many each contender's kernels have).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Neither imports anything heavy: threads are pinned first.
from autofuse.errors import AutofuseError  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.sweep import fmt as _fmt, median_ms as _ms, ratio as _ratio  # noqa: E402

SCHEMA = "autofuse.gemm_sweep/1"
PATTERN = "linear_bias_relu"
GRID_M = (1, 16, 128, 512, 2048)
GRID_NK = ((256, 256), (768, 768), (1024, 1024), (3072, 768), (768, 3072), (4096, 4096), (1000, 1000),
           (3000, 1000))
EXTRA = ((2048, 2048, 2048),)
NUMPY_SHAPE = "2048x2048x2048"
RIVALS = ("tvm-auto", "onnxruntime", "xla")
ORDER = ("ours-default", "ours-tuned", "tvm-auto", "onnxruntime", "xla", "numpy")
TARGET_RATIO, DEFAULT_SLACK = 0.8, 1.25


def default_shapes() -> list[tuple[int, int, int]]:
    return [(m, n, k) for m in GRID_M for n, k in GRID_NK] + list(EXTRA)


def label(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def parse_shapes(text: str | None) -> list[tuple[int, int, int]]:
    """``MxNxK[,MxNxK...]``, or None/"all" for the grid."""
    if text is None or text.strip() == "all":
        return default_shapes()
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise AutofuseError(f"--shapes item {item!r} is not MxNxK with three positive integers (e.g. 512x1024x1024)")
        shape = tuple(int(p) for p in parts)
        if shape not in shapes:
            shapes.append(shape)
    if not shapes:
        raise AutofuseError("--shapes names no shape: give MxNxK[,MxNxK...] or all")
    return shapes


def parse_args(argv: list[str]):
    parser = sweep.parser(__doc__, 64, "new trials for ours-tuned and for tvm-auto per shape; 0: the untuned "
                                       "default only")
    parser.add_argument("--shapes", default=None, help="MxNxK[,MxNxK...] (default: the grid and 2048^3)")
    args = parser.parse_args(argv)
    sweep.check(args)
    args.shape_list = parse_shapes(args.shapes)
    return args


# --- numpy, a contender of this benchmark only ---------------------------------------------------

def numpy_blas_threads(threads: int) -> int | None:
    """numpy's OpenBLAS sized its pool when numpy was imported, before pin_threads set
    OPENBLAS_NUM_THREADS: set it through OpenBLAS's own call. The count OpenBLAS then reports, or
    None where numpy's BLAS is not an OpenBLAS found beside numpy."""
    import ctypes
    import glob

    import numpy as np
    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*.so*")):
        lib = ctypes.CDLL(path)  # the copy numpy loaded: dlopen returns the same handle
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    setter(ctypes.c_int(threads))
                    return int(getter())
    return None


class NumpyMatmul:
    """numpy's matmul (its BLAS sgemm, W transposed as a view), then + b and ReLU in place: the
    least numpy can do for y = relu(x @ W^T + b)."""
    name = "numpy"
    description = "numpy matmul (BLAS sgemm) into y, then + b and ReLU in place"
    runs_onnx_graph = False

    def __init__(self, blas_threads: int | None):
        self.blas_threads = blas_threads

    def prepare(self, subject, ctx):
        import numpy as np

        from autofuse.baselines import Prepared, Unavailable
        if ctx.device != "cpu":
            raise Unavailable("numpy runs on the CPU only")
        x, w, b = subject.inputs
        y = np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)

        def launch():
            np.matmul(x, w.T, out=y)
            np.add(y, b, out=y)
            np.maximum(y, 0, out=y)

        blas = np.__config__.CONFIG.get("Build Dependencies", {}).get("blas", {})
        return Prepared(launch, lambda: None, lambda: [y.copy()],
                        {"version": np.__version__, "blas": f"{blas.get('name')} {blas.get('version')}",
                         "blas_threads": self.blas_threads})


def numpy_row(contender, subject, ctx, entry: dict, machine, *, repeat: int, warmup: int) -> dict:
    """numpy through the steps compare_subject takes for every contender (run once, check against
    the reference at the shape's bound, then compare's timer), as a compare row."""
    from autofuse.accuracy import compare as check_outputs
    from autofuse.compare import _new_row, _run_once, reference_outputs
    from autofuse.measure import timer_for
    from autofuse.roofline import point

    row = _new_row(contender.name, contender, subject)
    row["rival"] = False
    ran = _run_once(contender, subject, ctx, row)
    if ran is None:
        return row
    prepared, outputs = ran
    row["info"] = dict(prepared.info)
    reference, reference_name = reference_outputs(subject)
    check = check_outputs(outputs, reference, accumulation=subject.accumulation, bound=entry["bound"])
    row.update(max_abs_err=check.max_abs_err, scaled_err=check.scaled_err, bound=entry["bound"])
    if not check.ok:
        row.update(status="invalid", reason=f"disagrees with the {reference_name}: {check.message}")
        return row
    timing = timer_for(ctx.dev).time(prepared.launch, prepared.wait, same_stream=prepared.same_stream,
                                     warmup=warmup, repeat=repeat, min_repeat_ms=20.0)
    row.update(median_ms=timing.median_secs * 1e3, p10_ms=timing.p10_secs * 1e3, p90_ms=timing.p90_secs * 1e3,
               samples_ms=[s * 1e3 for s in timing.samples_secs], timing=timing.method)
    row.update(point(subject.flops, subject.bytes, timing.median_secs, machine))
    return row


# --- one shape -----------------------------------------------------------------------------------

def _tuning_figures(space: str, trials: int, stats) -> dict:
    return {"space": space, "trials": trials, "measured": stats.total_trials, "failed": sum(stats.failed.values()),
            "first_trial_secs": stats.first_trial_secs, "tune_secs": stats.total_secs,
            "best_trial_ms": min(stats.best_secs.values()) * 1e3 if stats.best_secs else None}


def tune_shape(subject, ctx, trials: int, seed: int, progress: bool) -> dict:
    """compare.tune_subject's two searches, N new trials each, keeping their statistics: ours
    (union space) through tune_patterns' Job and tune(), without tune_jobs' summary rows (those
    time the kernel as written, a scalar loop nest: minutes a call at the grid's largest shapes);
    tvm-auto (generic space on the auto-fused kernels) through tune_model."""
    from autofuse.model.jobs import prepare, tune_model
    from autofuse.progress import tuning_bar
    from autofuse.tune import Task, tune
    from autofuse.tune_patterns import Job

    job = Job(subject.pattern, subject.shape, subject.dtype)
    task = Task(job.label, job.func, job.pattern.templates_for(ctx.target, job.func))
    with tuning_bar(trials, [job.label], progress) as (on_phase, on_progress):
        ours = tune([task], ctx.target, ctx.db.ms, ctx.db.work_dir, trials_per_task=trials, space="union",
                    seed=seed, cost_model_path=ctx.db.cost_model_path, on_progress=on_progress, on_phase=on_phase)
    _, auto = tune_model(prepare(subject.onnx_path, "auto"), ctx.target, ctx.db, trials=trials, space="generic",
                         seed=seed, progress=progress)
    return {"ours-tuned": _tuning_figures("union", trials, ours), "tvm-auto": _tuning_figures("generic", trials, auto)}


def _not_run(name: str, reason: str) -> dict:
    return {"name": name, "status": "not run", "reason": reason, "median_ms": None, "gflops": None,
            "samples_ms": [], "scaled_err": None, "rival": name in RIVALS}


def measure_shape(shape, pattern, ctx_default, ctx_tuned, machine, args, numpy_contender, folder: str, log) -> dict:
    from autofuse.compare import compare_subject, pattern_subject

    m, n, k = shape
    start = time.perf_counter()
    subject = pattern_subject(pattern, pattern.resolve_shape({"m": m, "n": n, "k": k}), "float32", folder, seed=0)
    # The load at the start: on a shared machine, others' work slows the multi-threaded contenders.
    record = {"label": label(shape), "m": m, "n": n, "k": k, "flops": subject.flops, "bytes": subject.bytes,
              "loadavg": list(os.getloadavg()), "tuning": None}
    if args.trials:
        log(f"{label(shape)}: tuning ours (union) and tvm-auto (generic), {args.trials} trials each")
        record["tuning"] = tune_shape(subject, ctx_tuned, args.trials, args.seed, not args.no_progress)

    def timing(ours: str) -> dict:
        return {"repeat": args.repeat, "warmup": args.warmup,
                "log": lambda msg: log(f"{label(shape)}: measuring {msg.replace('autofuse', ours)}")}

    # ours-default: no database, so the checked template default runs; the framework's and XLA's
    # rows come from this call, tvm-auto's and ours-tuned's from the one with the database.
    default = compare_subject(subject, ctx_default, ["onnxruntime", "xla"], machine, **timing("ours-default"))
    rows = [dict(default["contenders"][0], name="ours-default"), *default["contenders"][1:]]
    if args.trials:
        tuned = compare_subject(subject, ctx_tuned, ["tvm-auto"], machine, **timing("ours-tuned"))
        rows += [dict(tuned["contenders"][0], name="ours-tuned"), tuned["contenders"][1]]
        record["search_curve_ms"] = tuned.get("search_curve_ms")
    else:
        reason = "--trials 0: untuned, tvm-auto's kernels would run as written (no records)"
        rows += [_not_run("ours-tuned", "--trials 0"), _not_run("tvm-auto", reason)]
    log(f"{label(shape)}: measuring numpy (run and check, timing)")
    rows.append(numpy_row(numpy_contender, subject, ctx_default, default, machine, repeat=args.repeat,
                          warmup=args.warmup))
    sweep.drop_compare_ratios(rows)
    by_name = {r["name"]: r for r in rows}
    record["contenders"] = [by_name[name] for name in ORDER]
    for key in ("reference", "accumulation", "dtype_bound", "bound", "framework"):
        record[key] = default[key]

    rivals = [by_name[r] for r in RIVALS if _ms(by_name, r) is not None and by_name[r].get("same_work", True)]
    best = min(rivals, key=lambda r: r["median_ms"], default=None)
    ours = "ours-tuned" if args.trials else "ours-default"
    best_ms = best["median_ms"] if best else None
    record.update(best_rival=best["name"] if best else None, best_rival_ms=best_ms,
                  rivals_measured=[r["name"] for r in rivals], ours=ours,
                  ratio=_ratio(_ms(by_name, ours), best_ms),
                  ratio_default=_ratio(_ms(by_name, "ours-default"), best_ms),
                  ratio_tuned=_ratio(_ms(by_name, "ours-tuned"), best_ms),
                  default_over_tuned=_ratio(_ms(by_name, "ours-default"), _ms(by_name, "ours-tuned")),
                  ours_over_numpy=_ratio(_ms(by_name, ours), _ms(by_name, "numpy")),
                  ours_source=(by_name[ours].get("info") or {}).get("source"),
                  secs=time.perf_counter() - start)
    return record


# --- the summary the targets read --------------------------------------------------------

def summarize(shapes: list[dict], trials: int) -> dict:
    ours = "ours-tuned" if trials else "ours-default"
    ratios = {s["label"]: s["ratio"] for s in shapes if s.get("ratio") is not None}
    within = [s for s in shapes if s.get("ratio") is not None and s["ratio"] <= TARGET_RATIO]
    summary = {
        "ours": ours, "rivals": list(RIVALS) if trials else ["onnxruntime", "xla"],
        "shapes_measured": len(shapes), "shapes_with_ratio": len(ratios), "target_ratio": TARGET_RATIO,
        f"fraction_at_or_below_{TARGET_RATIO}x_best": len(within) / len(ratios) if ratios else None,
        f"shapes_at_or_below_{TARGET_RATIO}x_best": [s["label"] for s in within],
        "shapes_above_1.0x_best": {name: r for name, r in ratios.items() if r > 1.0},
        "geomean_ratio": statistics.geometric_mean(ratios.values()) if ratios else None,
        "shapes_without_ratio": [s["label"] for s in shapes if s.get("ratio") is None],
    }
    at = next((s for s in shapes if s["label"] == NUMPY_SHAPE), None)
    if at is not None:
        rows = {c["name"]: c for c in at["contenders"]}
        summary[f"ours_vs_numpy_{NUMPY_SHAPE}"] = {"ours_ms": _ms(rows, ours), "numpy_ms": _ms(rows, "numpy"),
                                                   "ratio": at.get("ours_over_numpy")}
    else:
        summary[f"ours_vs_numpy_{NUMPY_SHAPE}"] = None
    if trials:
        pairs = {s["label"]: s["default_over_tuned"] for s in shapes if s.get("default_over_tuned") is not None}
        inside = [name for name, r in pairs.items() if r <= DEFAULT_SLACK]
        summary[f"default_within_{DEFAULT_SLACK}x_of_tuned"] = {
            "within": len(inside), "of": len(pairs), "fraction": len(inside) / len(pairs) if pairs else None,
            "outside": {name: r for name, r in pairs.items() if r > DEFAULT_SLACK}}
        firsts = {}
        for name in ("ours-tuned", "tvm-auto"):
            secs = [s["tuning"][name]["first_trial_secs"] for s in shapes
                    if s.get("tuning") and s["tuning"][name]["first_trial_secs"] is not None]
            firsts[name] = {"first_shape": secs[0], "median": statistics.median(secs), "max": max(secs)} if secs else None
        summary["time_to_first_measured_trial_secs"] = firsts
    else:
        summary[f"default_within_{DEFAULT_SLACK}x_of_tuned"] = None
        summary["time_to_first_measured_trial_secs"] = None
    return summary


# --- Markdown ------------------------------------------------------------------------------------

def _cell(row: dict) -> str:
    """median ms (GFLOP/s)."""
    if row["status"] == "ok":
        return f"{_fmt(row['median_ms'])} ({_fmt(row.get('gflops'))})"
    if row["status"] == "invalid" and row.get("scaled_err") is not None:
        return f"invalid ({row['scaled_err']:.1e})"
    return {"not run": "-", "unavailable": "n/a"}.get(row["status"], row["status"])


def markdown(report: dict) -> str:
    m = report["machine"]
    code = report["code"]
    s = report["summary"]
    ours = s["ours"]
    loads = [shape["loadavg"][0] for shape in report["shapes"] if shape.get("loadavg")]
    lines = [f"# GEMM sweep: {PATTERN} float32 — {report['created']}", "",
             (f"Machine: {m.get('cpu_model')} (mcpu {m.get('mcpu', '?')}), {report['threads']} threads of "
              f"{m.get('cores')} cores; TVM {m.get('tvm')}."),
             (f"Code: commit {code.get('commit')}{' with local changes' if code.get('dirty') else ''}; command: "
              f"`{' '.join(report['command'])}`."),
             (f"Trials: {report['trials_added']} new each for ours-tuned (union space) and tvm-auto (generic "
              f"space) per shape. Timing: compare's timer, {report['warmup']} warm-up calls, median of "
              f"{report['repeat']} samples. Cells: median ms (GFLOP/s); ratio = {ours} / best of "
              f"{', '.join(s['rivals'])} (target <= {TARGET_RATIO})."),
             (f"Load average (1 min) at each shape's start: {_fmt(min(loads))} to {_fmt(max(loads))} on "
              f"{m.get('cores')} cores.") if loads else "", "",
             f"| shape MxNxK | {' | '.join(ORDER)} | best rival | ratio | default / tuned | {ours} / numpy |",
             "|" + "---|" * (len(ORDER) + 5)]
    for shape in report["shapes"]:
        rows = {c["name"]: c for c in shape["contenders"]}
        lines.append(f"| {shape['label']} | " + " | ".join(_cell(rows[n]) for n in ORDER)
                     + f" | {shape.get('best_rival') or '-'} | {_fmt(shape.get('ratio'))} | "
                       f"{_fmt(shape.get('default_over_tuned'))} | {_fmt(shape.get('ours_over_numpy'))} |")
    fraction = s[f"fraction_at_or_below_{TARGET_RATIO}x_best"]
    lines += ["", f"- Shapes at <= {TARGET_RATIO}x the best rival: {len(s[f'shapes_at_or_below_{TARGET_RATIO}x_best'])}"
              f" of {s['shapes_with_ratio']}" + (f" ({100 * fraction:.0f}%)" if fraction is not None else "")
              + f"; geometric-mean ratio {_fmt(s['geomean_ratio'])}.",
              "- Above 1.0x: " + (", ".join(f"{k} ({v:.2f})" for k, v in s["shapes_above_1.0x_best"].items())
                                  or "none") + "."]
    numpy = s[f"ours_vs_numpy_{NUMPY_SHAPE}"]
    if numpy:
        lines.append(f"- {NUMPY_SHAPE}: {ours} {_fmt(numpy['ours_ms'])} ms, numpy {_fmt(numpy['numpy_ms'])} ms "
                     f"(ratio {_fmt(numpy['ratio'])}).")
    within = s[f"default_within_{DEFAULT_SLACK}x_of_tuned"]
    if within:
        outside = ", ".join(f"{k} ({v:.2f})" for k, v in within["outside"].items()) or "none outside"
        lines.append(f"- Default within {DEFAULT_SLACK}x of tuned: {within['within']} of {within['of']} ({outside}).")
    firsts = s["time_to_first_measured_trial_secs"]
    if firsts:
        lines.append("- Time to first measured trial: " + "; ".join(
            f"{name} {_fmt(v['first_shape'])} s at the first shape, median {_fmt(v['median'])} s, max {_fmt(v['max'])} s"
            for name, v in firsts.items() if v) + ".")
    problems = [f"{shape['label']}/{c['name']}: {c['status']}: {c.get('reason')}" for shape in report["shapes"]
                for c in shape["contenders"] if c["status"] not in ("ok", "not run")]
    if problems:
        lines += ["", "Not valid or not run:", "", *[f"- {p}" for p in problems]]
    if report.get("not_started"):
        lines += ["", f"Not started (--budget-secs {report['budget_secs']}): {', '.join(report['not_started'])}."]
    return "\n".join(lines) + "\n"


def write(report: dict, path: str) -> None:
    report["summary"] = summarize(report["shapes"], report["trials_added"])
    sweep.write(report, path, markdown)


# --- the command ---------------------------------------------------------------------------------

def run(args, argv: list[str]) -> int:
    log = lambda msg: print(f"gemm_sweep: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    with sweep.session(args, argv, "gemm-sweep", ["tvm-auto", "onnxruntime", "xla"], log) as bench:
        from autofuse.database import TuningDatabase
        from autofuse.registry import resolve_patterns

        pattern = resolve_patterns(PATTERN)[0]
        for shape in args.shape_list:  # every shape checked before anything runs
            pattern.resolve_shape(dict(zip("mnk", shape)))
        blas_threads = numpy_blas_threads(bench.ctx.threads)
        ctx_default = bench.ctx
        ctx_tuned = dataclasses.replace(ctx_default, db=TuningDatabase(bench.db_root, ctx_default.target))
        report, out = bench.report, bench.out
        report.update(schema=SCHEMA, pattern=PATTERN, dtype="float32", contenders=list(ORDER), rivals=list(RIVALS),
                      numpy_blas_threads=blas_threads, shapes=[])
        start = time.perf_counter()
        for index, shape in enumerate(args.shape_list):
            if sweep.budget_spent(args, start, [label(s) for s in args.shape_list[index:]], report, log):
                break
            folder = os.path.join(bench.work, "graphs", label(shape))
            record = measure_shape(shape, pattern, ctx_default, ctx_tuned, bench.machine, args,
                                   NumpyMatmul(blas_threads), folder, log)
            report["shapes"].append(record)
            report["elapsed_secs"] = time.perf_counter() - start
            write(report, out)
            log(f"{record['label']}: {record['ours']} / best ({record['best_rival']}) = "
                f"{_fmt(record['ratio'])} in {record['secs']:.0f} s; wrote {out}")
        write(report, out)
    print(markdown(report))
    print(f"wrote {out} and {os.path.splitext(out)[0]}.md")
    failed = [s["label"] for s in report["shapes"] if s["contenders"][0]["status"] != "ok"]
    if failed:
        print(f"gemm_sweep: ours-default has no valid, timed result at {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return sweep.main("gemm_sweep", __file__, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
