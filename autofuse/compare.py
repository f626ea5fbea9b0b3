"""``autofuse compare``: ours against the baselines on the same subject, in one process.

Every contender gets the same seeded inputs, the same thread count and the same timing loop
(warm-up, then repeats of enough calls to last ``min_repeat_ms``: median, p10, p90). Outputs are
checked against the reference before any timing (the numpy reference for a pattern, onnxruntime
for a model); a contender that disagrees is reported invalid, never timed.
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

from .baselines import BASELINES, Context, Subject, Unavailable
from .errors import AutofuseError


SCHEMA = "autofuse.compare/1"


def contenders() -> dict:
    from .baselines.ort import OnnxRuntime
    from .baselines.tuned import Autofuse
    from .baselines.tvm_auto import TvmAuto
    from .baselines.tvm_untuned import TvmUntuned
    from .baselines.xla import Xla
    return {c.name: c for c in (Autofuse(), TvmUntuned(), TvmAuto(), OnnxRuntime(), Xla())}


def parse_baselines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise AutofuseError(f"unknown baseline(s) {', '.join(unknown)}: choose from {', '.join(BASELINES)}")
    return names


def pin_threads(threads: int | None) -> int:
    """Pin this process (and every runtime it starts later) to ``threads`` cores; call it before
    TVM, onnxruntime or jax start their thread pools."""
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
    return threads


def pattern_subject(pattern, shape: dict, dtype: str, folder: str, seed: int = 0) -> Subject:
    onnx_path = None
    names = [f"in{i}" for i in range(len(pattern.make_inputs(shape, dtype, seed)))]
    if pattern.onnx_graph is not None:
        import onnx
        model = pattern.onnx_graph(shape, dtype)
        os.makedirs(folder, exist_ok=True)
        onnx_path = os.path.join(folder, f"{pattern.name}.onnx")
        onnx.save(model, onnx_path)
        initializers = {i.name for i in model.graph.initializer}
        names = [v.name for v in model.graph.input if v.name not in initializers]
    return Subject("pattern", pattern.name, pattern.make_inputs(shape, dtype, seed), names, onnx_path,
                   flops=pattern.flops(shape), bytes=pattern.bytes(shape, dtype), shape=dict(shape), dtype=dtype,
                   pattern=pattern, tolerance=pattern.tolerance_for(dtype))


def model_subject(path: str, seed: int = 0) -> Subject:
    """A model's figures: FLOPs estimated over its auto-fused kernels; bytes the least any
    schedule moves (inputs, weights and outputs once each)."""
    from tvm import tirx
    from tvm.s_tir.analysis import estimate_tir_flops
    import tvm

    from .model.importer import random_inputs
    from .model.jobs import prepare

    prepared = prepare(path, "auto")
    feeds = random_inputs(prepared.onnx, seed)
    flops = 0.0
    for gv, func in prepared.mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            try:
                flops += float(estimate_tir_flops(tvm.IRModule({"main": func})))
            except Exception:
                pass
    weights = sum(int(np.prod(i.dims)) * 4 for i in prepared.onnx.graph.initializer)
    nbytes = float(sum(x.nbytes for x in feeds.values()) + weights + _output_bytes(prepared.onnx))
    return Subject("model", prepared.name, list(feeds.values()), list(feeds), os.path.abspath(path),
                   flops=flops or None, bytes=nbytes, tolerance=(1e-3, 1e-4))


def _output_bytes(model) -> int:
    import onnx
    total = 0
    for value in model.graph.output:
        tensor = value.type.tensor_type
        dims = [d.dim_value for d in tensor.shape.dim]
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize
        total += int(np.prod(dims)) * itemsize if all(dims) else 0
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


def tune_subject(subject: Subject, ctx: Context, baselines: list[str], trials: int, seed: int | None,
                 progress: bool) -> dict:
    """Give ours (union space) and tvm-auto (generic space on the auto-fused kernels) the same
    number of new trials in the shared database; returns the budgets for the report."""
    from .model.jobs import prepare, tune_model

    budgets = {}
    if subject.kind == "pattern":
        from .tune_patterns import Job, tune_jobs
        tune_jobs([Job(subject.pattern, subject.shape, subject.dtype)], ctx.target, ctx.db, trials=trials,
                  space="union", seed=seed, progress=progress)
    else:
        tune_model(prepare(subject.onnx_path, "patterns"), ctx.target, ctx.db, trials=trials, space="union",
                   seed=seed, progress=progress)
    budgets["autofuse"] = {"space": "union", "trials": trials}
    if "tvm-auto" in baselines and subject.onnx_path is not None:
        tune_model(prepare(subject.onnx_path, "auto"), ctx.target, ctx.db, trials=trials, space="generic",
                   seed=seed, progress=progress)
        budgets["tvm-auto"] = {"space": "generic", "trials": trials}
    return budgets


def compare_subject(subject: Subject, ctx: Context, baselines: list[str], machine, *, repeat: int = 20,
                    warmup: int = 3, min_repeat_ms: float = 20.0, log=lambda msg: None) -> dict:
    from .measure import time_calls
    from .roofline import point
    from .verify import compare

    reference, reference_name = reference_outputs(subject)
    available = contenders()
    rows = []
    for name in ["autofuse", *baselines]:
        contender = available[name]
        row = {"name": name, "description": contender.description, "status": "ok", "reason": None,
               "median_ms": None, "p10_ms": None, "p90_ms": None, "samples_ms": [], "max_abs_err": None}
        rows.append(row)
        log(f"{subject.name}: {name}")
        try:
            prepared = contender.prepare(subject, ctx)
            prepared.call()
            outputs = prepared.outputs()
        except Unavailable as err:
            row.update(status="unavailable", reason=str(err))
            continue
        except AutofuseError as err:
            row.update(status="failed", reason=str(err))
            continue
        except Exception as err:  # a contender's own bug or a runtime failure: report it, go on
            row.update(status="failed", reason=_first_line(err), traceback=traceback.format_exc(limit=4))
            continue
        row["info"] = {k: v for k, v in prepared.info.items() if k != "kernel_figures"}
        # The search budget each tuned contender has had: its kernels' records in the database.
        row["trials_in_db"] = prepared.info.get("records")
        if reference is None:
            reference, reference_name = outputs, f"{name} (onnxruntime missing)"
        check = compare(outputs, reference, *subject.tolerance)
        row["max_abs_err"] = check.max_abs_err
        if not check.ok:
            row.update(status="invalid", reason=f"disagrees with the {reference_name}: {check.message}")
            continue
        timing = time_calls(prepared.call, warmup=warmup, repeat=repeat, min_repeat_ms=min_repeat_ms)
        row.update(median_ms=timing.median_secs * 1e3, p10_ms=timing.p10_secs * 1e3, p90_ms=timing.p90_secs * 1e3,
                   samples_ms=[s * 1e3 for s in timing.samples_secs])
        row.update(point(subject.flops, subject.bytes, timing.median_secs, machine))
        if name == "autofuse" and "kernel_figures" in prepared.info:
            row["kernels"] = _kernel_rows(prepared.info, machine)
    _speedups(rows)
    entry = {"kind": subject.kind, "name": subject.name, "shape": subject.shape, "dtype": subject.dtype,
             "flops": subject.flops, "bytes": subject.bytes, "reference": reference_name,
             "tolerance": list(subject.tolerance), "contenders": rows}
    ours = rows[0]
    if "kernels" in ours:
        entry["kernels"] = ours.pop("kernels")
    if subject.kind == "pattern" and ctx.db is not None:
        from .tune_patterns import Job
        entry["search_curve_ms"] = ctx.db.best_so_far(Job(subject.pattern, subject.shape, subject.dtype).func)
    return entry


def _kernel_rows(info: dict, machine) -> list[dict]:
    from .roofline import point
    decisions = {d["name"]: d for d in info.get("decisions", [])}
    rows = []
    for fig in info["kernel_figures"]:
        decision = decisions.get(fig["name"], {})
        rows.append({**fig, "applied": decision.get("applied"), "source": decision.get("source") or "none",
                     **point(fig["flops"], fig["bytes"], fig["ms"] / 1e3, machine)})
    return rows


# The baselines that count as "the best baseline": not tvm-untuned, which nobody would deploy.
RIVALS = ("tvm-auto", "onnxruntime", "xla")
GPU_RIVALS = ("tvm-auto", "torch-eager", "torch-compile", "xla-gpu", "torch-sdpa")


def _speedups(rows: list[dict], rivals=RIVALS) -> None:
    """Each baseline's time over ours, and ours over the best of the real baselines (the target
    is <= 0.8: 20% faster than the best of onnxruntime, XLA and TVM auto-fusion)."""
    ours = rows[0]["median_ms"]
    for row in rows:
        row["autofuse_speedup"] = row["median_ms"] / ours if ours and row["median_ms"] else None
    rivals = [r["median_ms"] for r in rows if r["name"] in rivals and r["median_ms"]]
    rows[0]["ratio_to_best_baseline"] = ours / min(rivals) if ours and rivals else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def versions() -> dict:
    found = {}
    for module in ("tvm", "numpy", "onnx", "onnxruntime", "jax", "jaxlib", "xgboost"):
        try:
            found[module] = __import__(module).__version__
        except Exception:
            found[module] = None
    return found


def new_report(ctx: Context, machine, *, baselines, trials, repeat, warmup) -> dict:
    import dataclasses

    from .report import machine_info
    info = machine_info()
    info["roofline"] = dataclasses.asdict(machine)
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": info,
            "versions": versions(), "target": str(ctx.target), "threads": ctx.threads,
            "baselines": list(baselines), "trials_added": trials, "repeat": repeat, "warmup": warmup,
            "database": ctx.db.path if ctx.db is not None else None, "budgets": {}, "subjects": []}


_REPORT_KEYS = {"schema": str, "created": str, "machine": dict, "versions": dict, "target": str, "threads": int,
                "baselines": list, "trials_added": int, "repeat": int, "warmup": int, "budgets": dict,
                "subjects": list}
_SUBJECT_KEYS = {"kind": str, "name": str, "reference": str, "tolerance": list, "contenders": list}
_CONTENDER_KEYS = {"name": str, "status": str, "median_ms": (float, type(None)), "p10_ms": (float, type(None)),
                   "p90_ms": (float, type(None)), "samples_ms": list}


_GPU_STATUS = {"ok": "ok", "invalid": "invalid", "unavailable": "unavailable", "error": "failed"}


def report_from_gpu(data: dict) -> dict:
    """A ``benchmarks/gpu.py`` JSON (measured on a GPU machine) as a compare report, so that
    ``report.md`` and the plots come out the same way as for CPU runs."""
    if data.get("schema") != "autofuse.gpu/1" or not isinstance(data.get("patterns"), dict):
        raise AutofuseError("not a benchmarks/gpu.py result (schema autofuse.gpu/1)")
    machine, versions_ = data.get("machine") or {}, data.get("versions") or {}
    dtype = (data.get("args") or {}).get("dtype", "float32")
    subjects, names = [], []
    for name, entry in data["patterns"].items():
        rows = []
        for contender, got in (entry.get("contenders") or {}).items():
            status = _GPU_STATUS.get(got.get("status"), "failed")
            reason = got.get("reason") or got.get("error") or got.get("check")
            rows.append({"name": contender, "description": got.get("description", ""), "status": status,
                         "reason": reason if status != "ok" else None, "median_ms": got.get("median_ms"),
                         "p10_ms": got.get("p10_ms"), "p90_ms": got.get("p90_ms"), "samples_ms": [],
                         "max_abs_err": got.get("max_abs_err"), "gflops": got.get("gflops"),
                         "gbps": got.get("gbps"), "intensity": got.get("intensity"),
                         "roofline_pct": got.get("roofline_pct"), "pct_copy_bw": got.get("pct_copy_bw"),
                         "info": got.get("info") or {}})
        if not rows or rows[0]["name"] != "autofuse":
            continue  # skipped (dtype) or failed before any contender ran
        _speedups(rows, GPU_RIVALS)
        names = names or [r["name"] for r in rows]
        subjects.append({"kind": "pattern", "name": name, "shape": entry.get("shape"), "dtype": entry.get("dtype"),
                         "flops": entry.get("flops"), "bytes": entry.get("bytes"), "reference": "numpy reference",
                         "tolerance": entry.get("tolerance", []), "contenders": rows})
    peak = machine.get("fp32_gflops") if dtype == "float32" else machine.get("bf16_gemm_gflops")
    gpu = versions_.get("gpu") or "GPU"
    return {"schema": SCHEMA, "created": str(data.get("created") or "measured by benchmarks/gpu.py"),
            "machine": {"processor": gpu, "mcpu": f"compute {versions_.get('compute_capability', '?')}",
                        "python": versions_.get("python"), "tvm": versions_.get("tvm"),
                        "roofline": {"bandwidth_gbps": machine.get("copy_gbps") or 0.0, "peak_gflops": peak or 0.0,
                                     "bandwidth_method": machine.get("copy_method", "?"),
                                     "peak_method": machine.get("peak_method", "?"), "bandwidth_ladder": []}},
            "versions": versions_, "target": data.get("target", "cuda"), "threads": 0, "device_label": gpu,
            "baselines": names[1:], "rivals": list(GPU_RIVALS), "trials_added": int((data.get("args") or {}).get("trials", 0)),
            "repeat": int((data.get("args") or {}).get("repeat", 0)), "warmup": 0, "database": None,
            "budgets": {}, "subjects": subjects, "notes": data.get("notes", [])}


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
            if c.get("status") == "ok" and not c.get("median_ms"):
                problems.append(f"{where}/{c.get('name')}: ok without a latency")
            if c.get("status") != "ok" and not c.get("reason"):
                problems.append(f"{where}/{c.get('name')}: {c.get('status')} without a reason")
    return problems
