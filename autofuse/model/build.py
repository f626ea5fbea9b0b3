"""Building a model: apply the database kernel by kernel (never worse than the default), build
with ``relax.build``, export a library TVM's runtime loads alone, and check it against
onnxruntime."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.target import Target

from ..database import TuningDatabase
from ..errors import AutofuseError
from ..accuracy import compare, reduction_length
from ..pattern import DLIGHT
from .kernels import Kernel, kernels, make_checker, runnable_workload, time_module


@dataclasses.dataclass
class KernelDecision:
    name: str
    pattern: str | None
    applied: str            # "record", "template-default" or "default"
    source: str | None      # where the applied record came from: template:<name> / generic
    default_ms: float | None
    tuned_ms: float | None
    note: str = ""
    records: int = 0        # tuning records of this kernel in the database, failed trials included


def default_schedule(kernel: Kernel, target: Target) -> s_tir.Schedule | None:
    """A pattern kernel's template default; for others None (TVM's lowering as is) on a CPU and
    dlight's rules on a GPU."""
    if kernel.pattern is None:
        if not DLIGHT.applies_to(target):
            return None
        return s_tir.Schedule(runnable_workload(kernel, target))
    for template in kernel.pattern.templates_for(target):
        try:
            return template.apply(kernel.workload["main"], target, tunable=False)
        except Exception:  # a template that does not fit this shape: try the next
            continue
    if DLIGHT.applies_to(target):  # unscheduled, it would build and then crash the GPU
        raise AutofuseError(f"kernel {kernel.name} ({kernel.pattern.name}): no {target.kind.name} template applies")
    return None


def apply_database(mod: tvm.IRModule, db: TuningDatabase | None, target: Target,
                   dev) -> tuple[tvm.IRModule, list[KernelDecision]]:
    """Each kernel gets its best checked record if that beats the default schedule, else the
    default (the template default for pattern kernels)."""
    decisions = []
    mod = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions_items()))
    for kernel in kernels(mod):
        pattern = kernel.pattern.name if kernel.pattern else None
        fallback = default_schedule(kernel, target)
        fallback_mod = fallback.mod if fallback is not None else kernel.workload
        chosen = None
        note = ""
        records = db.count(kernel.workload)[1] if db is not None else 0
        if db is not None:
            chosen, rejected = db.best(kernel.workload, make_checker(kernel, target, dev))
            if rejected:
                note = f"{len(rejected)} record(s) rejected by the numerical check"
        default_kind = "template-default" if kernel.pattern is not None and fallback is not None else "default"
        if chosen is None:
            kind = default_kind
            decisions.append(KernelDecision(kernel.name, pattern, kind, None, None, None,
                                            note or ("no record" if db is not None else ""), records))
            if fallback is not None:
                mod[kernel.gv] = _as_kernel(fallback.mod["main"], kernel)
            continue
        default_secs = time_module(fallback_mod, kernel.func, target, dev)
        tuned_secs = time_module(chosen.schedule.mod, kernel.func, target, dev)
        if tuned_secs <= default_secs:
            mod[kernel.gv] = _as_kernel(chosen.schedule.mod["main"], kernel)
            decisions.append(KernelDecision(kernel.name, pattern, "record", chosen.source,
                                            default_secs * 1e3, tuned_secs * 1e3, note, records))
        else:
            if fallback is not None:
                mod[kernel.gv] = _as_kernel(fallback.mod["main"], kernel)
            decisions.append(KernelDecision(
                kernel.name, pattern, default_kind, chosen.source,
                default_secs * 1e3, tuned_secs * 1e3, (note + "; " if note else "") + "record slower than default",
                records))
    return mod, decisions


def _as_kernel(scheduled, kernel: Kernel):
    """The scheduled PrimFunc under the original kernel's attributes (name, visibility)."""
    func = scheduled.without_attr("global_symbol")
    if kernel.func.attrs and "global_symbol" in kernel.func.attrs:
        func = func.with_attr("global_symbol", kernel.func.attrs["global_symbol"])
    return func.with_attr("tirx.is_scheduled", True)


def build(mod: tvm.IRModule, target: Target, cuda_graph: bool = False):
    """``cuda_graph``: Relax's RewriteCUDAGraph captures the static parts of ``main`` into CUDA
    graphs on the first call and replays them after, one launch instead of one per kernel."""
    if cuda_graph and target.kind.name != "cuda":
        raise AutofuseError(f"--cuda-graph needs a cuda target, not {target.kind.name}")
    config = {"relax.backend.use_cuda_graph": True} if cuda_graph else {}
    with tvm.transform.PassContext(opt_level=3, config=config):
        return relax.build(mod, target=target)


def export(executable, path: str, meta: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise AutofuseError(f"cannot create output folder {folder}: {err.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise AutofuseError(f"output folder {folder} is not writable")
    executable.export_library(path)
    with open(path + ".json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, default=str)


def run_vm(executable_or_lib, inputs: list[np.ndarray], dev) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable_or_lib, dev)
    out = vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs])
    return _flatten(out)


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for item in out for a in _flatten(item)]


def onnxruntime_outputs(model_path: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check_against(outputs, expected, mod: tvm.IRModule):
    """A model's outputs against onnxruntime's, at the bound of its longest reduction."""
    return compare(outputs, expected, accumulation=model_reduction_length(mod))


def model_reduction_length(mod: tvm.IRModule) -> int:
    return max([reduction_length(f) for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)], default=1)
