"""``autofuse compare``: ours against the baselines on the same subject, in one process, on a CPU
or a GPU alike.

Every contender gets the same seeded inputs, the same thread count and the device's timer
(``measure.timer_for``: on a CPU warm-up, then repeats of enough calls to last ``min_repeat_ms``;
on a GPU each call alone after an L2 flush, timed with CUDA events, plus the back-to-back figure).

Validity comes before timing. Every contender runs once and its outputs are compared with the
reference (the numpy reference for a pattern, onnxruntime for a model): its scaled error
(``autofuse.accuracy``). A contender is valid when that error is within the dtype's bound, or
within what the framework's own result in that dtype reaches (``FRAMEWORK``: torch eager on a
GPU, onnxruntime on a CPU), whichever is larger (``accuracy.framework_bound``): so cuBLAS, SDPA or
torch.compile in float16 are judged as accurate as what users ship, and never discarded by a
fixed tolerance. Only valid contenders are timed. "ours / best" counts the rivals that do the same
work; one marked as doing more (``Pattern.more_work``) is reported, labelled, outside the ratio.

Every report names the commit that ran, the command line, the machine and every raw sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import sys
import time
import traceback

import numpy as np

from .baselines import BASELINES, FRAMEWORK, RIVALS, Context, Subject, Unavailable, contenders
from .errors import AutofuseError
from .provenance import code_commit


SCHEMA = "autofuse.compare/2"


def parse_baselines(text: str) -> list[str]:
    if text.strip() == "all":
        return list(BASELINES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise AutofuseError(f"unknown baseline(s) {', '.join(unknown)}: choose from {', '.join(BASELINES)} or all")
    return names


def pin_threads(threads: int | None) -> int:
    """Pin this process (and every runtime it starts later) to ``threads`` cores; call it before
    TVM, onnxruntime, torch or jax start their thread pools."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is None:
        threads = len(cores)
    if threads <= 0 or threads > len(cores):
        raise AutofuseError(f"--threads must be between 1 and {len(cores)} (this machine's cores), got {threads}")
    if threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    # XLA's CPU client sizes its pool from the affinity mask set above.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    # torch, jax and TVM share a GPU: jax must not take 75% of its memory when it starts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return threads


@contextlib.contextmanager
def device_session(ctx: Context):
    """On a GPU: float32 is float32 for every contender (no TF32) and TVM's kernels run on torch's
    current stream, where the CUDA timer records its events."""
    if ctx.device != "cuda":
        yield
        return
    try:
        import torch
    except ImportError:
        raise AutofuseError("compare on a GPU needs torch (its CUDA timer): pip install torch") from None
    if not torch.cuda.is_available():
        raise AutofuseError("compare on a GPU needs a CUDA build of torch (its CUDA timer); this one has no CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import tvm_ffi
    with tvm_ffi.use_torch_stream():
        yield


def _free(ctx: Context) -> None:
    gc.collect()
    if ctx.device == "cuda":
        import torch
        torch.cuda.empty_cache()


# --- subjects ------------------------------------------------------------------------------------

def pattern_subject(pattern, shape: dict, dtype: str, folder: str, seed: int = 0) -> Subject:
    onnx_path = None
    inputs = pattern.make_inputs(shape, dtype, seed)
    names = [f"in{i}" for i in range(len(inputs))]
    if pattern.onnx_graph is not None:
        import onnx
        model = pattern.onnx_graph(shape, dtype)
        os.makedirs(folder, exist_ok=True)
        onnx_path = os.path.join(folder, f"{pattern.name}.onnx")
        onnx.save(model, onnx_path)
        initializers = {i.name for i in model.graph.initializer}
        names = [v.name for v in model.graph.input if v.name not in initializers]
    check = pattern.check_args(shape, dtype)
    return Subject("pattern", pattern.name, inputs, names, onnx_path,
                   flops=pattern.flops(shape), bytes=pattern.bytes(shape, dtype), shape=dict(shape), dtype=dtype,
                   pattern=pattern, accumulation=check["accumulation"], bound=check["bound"],
                   more_work=pattern.more_work_at(shape))


def model_subject(path: str, seed: int = 0, input_shapes: dict[str, tuple[int, ...]] | None = None,
                  torch_program: str | None = None) -> Subject:
    """A model's figures: FLOPs estimated over its auto-fused kernels; bytes the least any
    schedule moves (inputs, weights and outputs once each); its check's accumulation the longest
    reduction of those kernels. ``torch_program``: the module's torch.export program, which the
    torch baselines then run."""
    from tvm import tirx
    from tvm.s_tir.analysis import estimate_tir_flops
    import tvm

    from .model.build import model_reduction_length
    from .model.importer import random_inputs
    from .model.jobs import prepare

    prepared = prepare(path, "auto", input_shapes)
    feeds = random_inputs(prepared.onnx, seed)
    flops = 0.0
    for gv, func in prepared.mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            try:
                flops += float(estimate_tir_flops(tvm.IRModule({"main": func})))
            except Exception:
                pass
    weights = sum(int(np.prod(i.dims)) * _itemsize(i.data_type) for i in prepared.onnx.graph.initializer)
    nbytes = float(sum(x.nbytes for x in feeds.values()) + weights + _output_bytes(prepared.onnx))
    return Subject("model", prepared.name, list(feeds.values()), list(feeds), os.path.abspath(path),
                   flops=flops or None, bytes=nbytes, dtype=_model_dtype(prepared.onnx),
                   accumulation=model_reduction_length(prepared.mod),
                   torch_program=os.path.abspath(torch_program) if torch_program else None)


def _model_dtype(model) -> str:
    """The dtype a model computes in, for its roofline and report: its first floating-point output's
    (a float16 export's logits are float16), float32 when it has none."""
    for value in model.graph.output:
        dtype = _np_dtype(value.type.tensor_type.elem_type)
        if dtype is not None and np.issubdtype(dtype, np.floating):
            return dtype.name
    return "float32"


def _np_dtype(onnx_type: int):
    import onnx
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))
    except (KeyError, TypeError):
        return None


def _itemsize(onnx_type: int) -> int:
    return _np_dtype(onnx_type).itemsize


def _output_bytes(model) -> int:
    total = 0
    for value in model.graph.output:
        tensor = value.type.tensor_type
        dims = [d.dim_value for d in tensor.shape.dim]
        total += int(np.prod(dims)) * _itemsize(tensor.elem_type) if all(dims) else 0
    return total


def reference_outputs(subject: Subject) -> tuple[list[np.ndarray] | None, str]:
    if subject.kind == "pattern":
        return subject.pattern.run_reference(subject.inputs, subject.shape), "numpy reference"
    try:
        from .model.build import onnxruntime_outputs
        outputs = onnxruntime_outputs(subject.onnx_path, subject.feeds)
    except ImportError:
        outputs = None
    return (outputs, "onnxruntime") if outputs is not None else (None, "autofuse (onnxruntime missing)")


def pattern_shapes(items: list[str] | None, patterns) -> dict[str, dict[str, str]]:
    """``--shape`` items as {pattern: overrides}: ``K=V[,K=V]`` for the one pattern given, or
    ``PATTERN:K=V[,K=V]`` for one of several (repeatable)."""
    from .commands.common import shape_overrides

    names = [p.name for p in patterns]
    out: dict[str, dict[str, str]] = {}
    plain = []
    for item in items or []:
        name, sep, rest = item.partition(":")
        if sep and "=" not in name:
            if name.strip() not in names:
                raise AutofuseError(f"--shape {item!r}: {name.strip()!r} is not one of the patterns compared "
                                    f"({', '.join(names)})")
            out.setdefault(name.strip(), {}).update(shape_overrides([rest]))
        else:
            plain.append(item)
    if plain:
        if len(names) > 1:
            raise AutofuseError("--shape K=V applies to one pattern: with several, write --shape PATTERN:K=V")
        out.setdefault(names[0], {}).update(shape_overrides(plain))
    return out


# --- tuning and measuring ------------------------------------------------------------------------

def tune_subject(subject: Subject, ctx: Context, baselines: list[str], trials: int, seed: int | None,
                 progress: bool) -> dict:
    """Give ours (union space) and tvm-auto (generic space on the auto-fused kernels) the same
    number of new trials in the shared database; returns the budgets for the report, with each
    search's wall time and when its first batch was measured (a model's import and fusion
    included, as ``autofuse tune MODEL`` spends them)."""
    from .model.jobs import prepare, tune_model

    budgets = {}
    start = time.perf_counter()
    if subject.kind == "pattern":
        from .tune_patterns import Job, tune_jobs
        _, stats = tune_jobs([Job(subject.pattern, subject.shape, subject.dtype)], ctx.target, ctx.db, trials=trials,
                             space="union", seed=seed, progress=progress)
    else:
        prepared = prepare(subject.onnx_path, "patterns", subject.input_shapes)
        _, stats = tune_model(prepared, ctx.target, ctx.db, trials=trials, space="union", seed=seed, progress=progress)
    budgets["autofuse"] = _tuning_figures("union", trials, stats, start)
    if "tvm-auto" in baselines and subject.onnx_path is not None:
        start = time.perf_counter()
        prepared = prepare(subject.onnx_path, "auto", subject.input_shapes)
        _, stats = tune_model(prepared, ctx.target, ctx.db, trials=trials, space="generic", seed=seed,
                              progress=progress)
        budgets["tvm-auto"] = _tuning_figures("generic", trials, stats, start)
    return budgets


def _tuning_figures(space: str, trials: int, stats, start: float) -> dict:
    """``start``: perf_counter when the step began; the search itself started at stats.start_secs."""
    before = stats.start_secs - start  # import, fusion and task extraction
    return {"space": space, "trials": trials, "measured": stats.total_trials,
            "tune_secs": time.perf_counter() - start,
            "first_batch_secs": before + stats.first_trial_secs if stats.first_trial_secs is not None else None,
            # kernels the space could not schedule: they ran their default schedule
            "left_untuned": sorted(stats.skipped.values())}


def _new_row(name: str, contender, subject: Subject) -> dict:
    reason = subject.more_work.get(name)
    if reason is None and subject.runs_onnx_graph(contender):
        reason = subject.more_work.get("onnx_graph")
    return {"name": name, "description": contender.description, "status": "ok", "reason": None,
            "median_ms": None, "p10_ms": None, "p90_ms": None, "batched_ms": None, "samples_ms": [],
            "timing": None, "max_abs_err": None, "scaled_err": None, "bound": None,
            "rival": name in RIVALS, "same_work": reason is None, "more_work": reason}


def _run_once(contender, subject: Subject, ctx: Context, row: dict):
    """Prepare and run once: (prepared, outputs), or None with the row's status saying why."""
    try:
        start = time.perf_counter()
        prepared = contender.prepare(subject, ctx)
        row["prepare_secs"] = time.perf_counter() - start
        start = time.perf_counter()
        prepared.call()
        row["first_call_secs"] = time.perf_counter() - start  # torch.compile's and XLA's compile time
        return prepared, prepared.outputs()
    except Unavailable as err:
        row.update(status="unavailable", reason=str(err))
    except AutofuseError as err:
        row.update(status="failed", reason=str(err))
    except Exception as err:  # a contender's own bug or a runtime failure: report it, go on
        row.update(status="failed", reason=_first_line(err), traceback=traceback.format_exc(limit=4))
    return None


def _scaled_errors(outputs, reference) -> list[float] | None:
    """Per output, max |got - want| / max |want| (inf where shapes or non-finite values differ);
    None when the outputs do not line up with the reference's."""
    from .accuracy import compare

    if len(outputs) != len(reference):
        return None
    return [compare([o], [r], bound=float("inf")).scaled_err for o, r in zip(outputs, reference)]


def compare_subject(subject: Subject, ctx: Context, baselines: list[str], machine, *, repeat: int = 20,
                    warmup: int = 3, min_repeat_ms: float = 20.0, timer=None, log=lambda msg: None) -> dict:
    """One subject: every contender run once and checked, then the valid ones timed."""
    from .accuracy import compare, error_bound, framework_bound
    from .measure import timer_for
    from .roofline import point

    timer = timer if timer is not None else timer_for(ctx.dev)
    reference, reference_name = reference_outputs(subject)
    available = contenders()
    rows, runs = [], {}
    for name in ["autofuse", *baselines]:
        row = _new_row(name, available[name], subject)
        rows.append(row)
        log(f"{subject.name}: {name} (run and check)")
        ran = _run_once(available[name], subject, ctx, row)
        if ran is None:
            _free(ctx)
            continue
        prepared, outputs = ran
        row["info"] = {k: v for k, v in prepared.info.items() if k != "kernel_figures"}
        # The search budget each tuned contender has had: its kernels' records in the database.
        row["trials_in_db"] = prepared.info.get("records")
        if reference is None:
            reference, reference_name = outputs, f"{name} (onnxruntime missing)"
        runs[name] = prepared, outputs

    reference = reference or []
    # Each output's bound: the subject's own, or the dtype's for its accumulation length; lifted
    # to what the framework's own result reaches on it.
    dtype_bounds = [subject.bound if subject.bound is not None else error_bound(r.dtype, subject.accumulation)
                    for r in map(np.asarray, reference)]
    framework = _framework_errors(subject, ctx, rows, runs, reference, available, log)
    limits = [framework_bound(b, [e] if e is not None else [])
              for b, e in zip(dtype_bounds, framework["scaled_errs"] or [None] * len(dtype_bounds))]
    entry = {"kind": subject.kind, "name": subject.name, "shape": subject.shape, "dtype": subject.dtype,
             "flops": subject.flops, "bytes": subject.bytes, "reference": reference_name,
             "accumulation": subject.accumulation, "dtype_bound": max(dtype_bounds, default=None),
             "bound": max(limits, default=None), "framework": framework,
             "roofline": dataclasses.asdict(machine), "contenders": rows}
    for row in rows:
        if row["name"] not in runs:
            continue
        outputs = runs[row["name"]][1]
        check = compare(outputs, reference, accumulation=subject.accumulation, bound=limits)
        row.update(max_abs_err=check.max_abs_err, scaled_err=check.scaled_err, bound=max(limits, default=None))
        if not check.ok:
            row.update(status="invalid", reason=f"disagrees with the {reference_name}: {check.message}")
            del runs[row["name"]]

    for row in rows:
        if row["name"] not in runs:
            continue
        prepared, _ = runs.pop(row["name"])
        log(f"{subject.name}: {row['name']} (timing)")
        try:
            timing = timer.time(prepared.launch, prepared.wait, same_stream=prepared.same_stream, warmup=warmup,
                                repeat=repeat, min_repeat_ms=min_repeat_ms)
        except Exception as err:  # a run that fails after its first: its row, not the report's end
            row.update(status="failed", reason=_first_line(err), traceback=traceback.format_exc(limit=4))
            timing = None
        if timing is not None and row["name"] == "autofuse" and "kernel_figures" in prepared.info:
            row["kernels"] = _kernel_rows(prepared.info, machine)
        del prepared
        _free(ctx)
        if timing is None:
            continue
        row.update(median_ms=timing.median_secs * 1e3, p10_ms=timing.p10_secs * 1e3, p90_ms=timing.p90_secs * 1e3,
                   samples_ms=[s * 1e3 for s in timing.samples_secs], timing=timing.method,
                   batched_ms=timing.batched_secs * 1e3 if timing.batched_secs is not None else None)
        row.update(point(subject.flops, subject.bytes, timing.median_secs, machine))
    _speedups(rows)
    ours = rows[0]
    if "kernels" in ours:
        entry["kernels"] = ours.pop("kernels")
    if subject.kind == "pattern" and ctx.db is not None:
        from .tune_patterns import Job
        entry["search_curve_ms"] = ctx.db.best_so_far(Job(subject.pattern, subject.shape, subject.dtype).func)
    return entry


def _framework_errors(subject, ctx, rows, runs, reference, available, log) -> dict:
    """The framework's own result on this subject: its scaled error per output against the
    reference. Run for its error alone (untimed) when it is not among the baselines compared."""
    name = FRAMEWORK[ctx.device]
    out = {"name": name, "scaled_errs": None, "status": None, "reason": None}
    if not reference:
        return out
    if name in runs:
        outputs = runs[name][1]
    else:
        row = next((r for r in rows if r["name"] == name), None)
        if row is not None:  # compared, and it did not run
            out.update(status=row["status"], reason=row["reason"])
            return out
        log(f"{subject.name}: {name} (the framework's own error, not timed)")
        row = _new_row(name, available[name], subject)
        ran = _run_once(available[name], subject, ctx, row)
        if ran is None:
            out.update(status=row["status"], reason=row["reason"])
            return out
        outputs = ran[1]
        del ran
        _free(ctx)
    errors = _scaled_errors(outputs, reference)
    if errors is None:
        out.update(status="invalid", reason=f"{len(outputs)} outputs, the reference has {len(reference)}")
        return out
    out.update(status="ok", scaled_errs=errors)
    return out


def _kernel_rows(info: dict, machine) -> list[dict]:
    from .roofline import point
    decisions = {d["name"]: d for d in info.get("decisions", [])}
    rows = []
    for fig in info["kernel_figures"]:
        decision = decisions.get(fig["name"], {})
        rows.append({**fig, "applied": decision.get("applied"), "default": decision.get("default"),
                     "source": decision.get("source") or "none",
                     **point(fig["flops"], fig["bytes"], fig["ms"] / 1e3, machine)})
    return rows


def _speedups(rows: list[dict]) -> None:
    """Each baseline's time over ours, and ours over the best rival doing the same work (the
    target is <= 0.8: 20% faster than the best of them)."""
    ours = rows[0]["median_ms"]
    for row in rows:
        row["autofuse_speedup"] = row["median_ms"] / ours if ours and row["median_ms"] else None
    counted = [r for r in rows[1:] if r["rival"] and r["same_work"] and r["median_ms"]]
    best = min(counted, key=lambda r: r["median_ms"], default=None)
    rows[0]["ratio_to_best_baseline"] = ours / best["median_ms"] if ours and best else None
    rows[0]["best_baseline"] = best["name"] if best else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# --- provenance ----------------------------------------------------------------------------------

def versions() -> dict:
    found = {"python": platform.python_version()}
    for module in ("tvm", "numpy", "onnx", "onnxruntime", "jax", "jaxlib", "torch", "triton", "xgboost"):
        try:
            found[module] = __import__(module).__version__
        except Exception:  # not installed, or broken: the report says so
            found[module] = None
    return found


def new_report(ctx: Context, machine, *, baselines, trials, repeat, warmup, commit: str | None = None,
               argv: list[str] | None = None) -> dict:
    from .report import machine_info
    info = machine_info(ctx.dev)
    info["roofline"] = dataclasses.asdict(machine)
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "code": code_commit(commit), "command": list(sys.argv if argv is None else argv), "cwd": os.getcwd(),
            "machine": info, "versions": versions(), "target": str(ctx.target), "device": ctx.device,
            "threads": ctx.threads, "baselines": list(baselines), "rivals": list(RIVALS),
            "framework": FRAMEWORK[ctx.device], "trials_added": trials, "repeat": repeat, "warmup": warmup,
            "database": ctx.db.path if ctx.db is not None else None, "budgets": {}, "subjects": []}


_REPORT_KEYS = {"schema": str, "created": str, "code": dict, "command": list, "machine": dict, "versions": dict,
                "target": str, "device": str, "threads": int, "baselines": list, "framework": str,
                "trials_added": int, "repeat": int, "warmup": int, "budgets": dict, "subjects": list}
_SUBJECT_KEYS = {"kind": str, "name": str, "reference": str, "accumulation": int, "framework": dict,
                 "contenders": list}
_NUMBER = (float, int, type(None))
_CONTENDER_KEYS = {"name": str, "status": str, "median_ms": _NUMBER, "p10_ms": _NUMBER, "p90_ms": _NUMBER,
                   "samples_ms": list, "max_abs_err": _NUMBER, "scaled_err": _NUMBER, "bound": _NUMBER,
                   "same_work": bool}


def check_report(report: dict) -> list[str]:
    """Problems with a report.json against the schema this module writes (empty: valid)."""
    problems = []

    def need(obj, keys, where):
        for key, kind in keys.items():
            if key not in obj:
                problems.append(f"{where}: missing {key!r}")
            elif not isinstance(obj[key], kind):
                problems.append(f"{where}: {key!r} is {type(obj[key]).__name__}")

    need(report, _REPORT_KEYS, "report")
    if report.get("schema") != SCHEMA:
        problems.append(f"report: schema is {report.get('schema')!r}, not {SCHEMA!r}")
    if "roofline" not in report.get("machine", {}):
        problems.append("report: machine has no roofline figures")
    if not (report.get("code") or {}).get("commit"):
        problems.append("report: no commit named")
    for subject in report.get("subjects", []):
        where = f"subject {subject.get('name')}"
        need(subject, _SUBJECT_KEYS, where)
        names = [c.get("name") for c in subject.get("contenders", [])]
        if names != ["autofuse", *report.get("baselines", [])]:
            problems.append(f"{where}: contenders {names} are not autofuse + the baselines")
        for c in subject.get("contenders", []):
            need(c, _CONTENDER_KEYS, f"{where}/{c.get('name')}")
            if c.get("status") not in ("ok", "unavailable", "invalid", "failed"):
                problems.append(f"{where}/{c.get('name')}: status {c.get('status')!r}")
            if c.get("status") == "ok" and not (c.get("median_ms") and c.get("samples_ms")):
                problems.append(f"{where}/{c.get('name')}: ok without a latency and its samples")
            if c.get("status") in ("ok", "invalid") and c.get("scaled_err") is None:
                problems.append(f"{where}/{c.get('name')}: {c.get('status')} without its error")
            if c.get("status") != "ok" and not c.get("reason"):
                problems.append(f"{where}/{c.get('name')}: {c.get('status')} without a reason")
            if c.get("same_work") is False and not c.get("more_work"):
                problems.append(f"{where}/{c.get('name')}: more work without saying which")
    return problems


# --- the command ---------------------------------------------------------------------------------

def run_command(args) -> int:
    """``autofuse compare`` after argument parsing: every check of the input before anything is
    written, then tuning (--trials), then the subjects one by one, the report rewritten after each
    (a cut run keeps what it has)."""
    threads = pin_threads(args.threads)  # before any runtime starts its thread pool

    from .commands.common import check_writable, require_device
    from .database import TuningDatabase
    from .registry import resolve_patterns
    from .report import COMPARE_COLUMNS, table, write_compare_report
    from .target import device_for, parse_target

    if (args.model is None) == (args.pattern is None):
        raise AutofuseError("give a MODEL.onnx or --pattern NAME|all (one of them)")
    if args.model is not None and (args.shape or args.small or args.dtype):
        raise AutofuseError("--shape/--small/--dtype apply to patterns, not to a model")
    if args.model is None and getattr(args, "input_shape", None):
        raise AutofuseError("--input-shape applies to a model, not to patterns (use --shape)")
    program = getattr(args, "torch_program", None)
    if program is not None and args.model is None:
        raise AutofuseError("--torch-program applies to a model, not to patterns")
    if program is not None and not (program.endswith(".pt2") and os.path.isfile(program)):
        raise AutofuseError(f"--torch-program {program!r}: no such .pt2 file (a torch.export program, as "
                            f"models/real/export.py --programs saves it)")
    baselines = parse_baselines(args.baselines)
    target = parse_target(args.target)
    require_device(target, "compare measures on it (run it on the GPU's host: benchmarks/gpu_session.sh)")
    if args.trials and args.db == "none":
        raise AutofuseError("--trials needs a database: drop --db none")
    commit = getattr(args, "commit", None)
    code_commit(commit)  # a malformed --commit stops the run here
    name = os.path.splitext(os.path.basename(args.model))[0] if args.model is not None else args.pattern
    folder = args.report or os.path.join("reports", name.replace(",", "+"))
    jobs = []  # (pattern, shape, dtype), all checked before anything is written
    if args.model is None:
        from .tune_patterns import Job
        patterns = resolve_patterns(args.pattern)
        shapes = pattern_shapes(args.shape, patterns)
        for pattern in patterns:
            job = Job(pattern, pattern.resolve_shape(shapes.get(pattern.name), base="small" if args.small else "default"),
                      pattern.check_dtype(args.dtype or pattern.dtypes[0]))  # builds: the pattern's shape rules
            jobs.append((pattern, job.shape, job.dtype))
    check_writable(folder)
    plots = not args.no_plots
    if plots:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            print("autofuse compare: matplotlib is not installed: no plots (pip install -e '.[bench]')",
                  file=sys.stderr)
            plots = False
    from .commands.common import input_shapes
    subjects = [model_subject(args.model, input_shapes=input_shapes(getattr(args, "input_shape", None)),
                              torch_program=program)] \
        if args.model is not None else [
        pattern_subject(pattern, shape, dtype, os.path.join(folder, "graphs")) for pattern, shape, dtype in jobs]
    db = None if args.db == "none" else TuningDatabase(args.db, target)
    ctx = Context(target, device_for(target), threads, db, work_dir=folder)
    log = lambda msg: print(f"autofuse: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    with device_session(ctx):
        rooflines = _rooflines(ctx, db, threads, {s.dtype for s in subjects}, log)
        report = new_report(ctx, rooflines[subjects[0].dtype], baselines=baselines, trials=args.trials,
                            repeat=args.repeat, warmup=args.warmup, commit=commit)
        if args.trials:  # all tuning first, so no measurement shares the cores with a tuning run
            for subject in subjects:
                report["budgets"][subject.name] = tune_subject(subject, ctx, baselines, args.trials, args.seed,
                                                               progress=not args.no_progress)
        for subject in subjects:
            entry = compare_subject(subject, ctx, baselines, rooflines[subject.dtype], repeat=args.repeat,
                                    warmup=args.warmup, log=lambda msg: log(f"measuring {msg}"))
            report["subjects"].append(entry)
            write_compare_report(report, folder, plots=False)
            print(f"\n{subject.kind} {subject.name}")
            print(table(entry["contenders"], COMPARE_COLUMNS))
            for c in entry["contenders"]:
                if c["status"] != "ok":
                    print(f"  {c['name']}: {c['status']}: {c['reason']}")
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


def _rooflines(ctx: Context, db, threads: int, dtypes: set[str], log) -> dict:
    """The roofline each subject is measured against, by dtype: on a CPU one for all (stored in
    the database folder), on a GPU the copy bandwidth and the matmul peak of that dtype."""
    if ctx.device == "cuda":
        from .measure import cuda_roofline
        log("measuring the GPU's roofline")
        return {dtype: cuda_roofline(dtype, threads) for dtype in sorted(dtypes)}
    from .roofline import load_or_measure
    log(f"measuring this machine's roofline ({threads} threads)")
    machine = load_or_measure(os.path.join(db.path, "roofline.json") if db is not None else None, threads)
    return {dtype: machine for dtype in dtypes}
