"""The kernels (PrimFuncs) of a fused model and what each runs: their MetaSchedule workloads, the
pattern each came from, the database applied kernel by kernel (through ``verify.choose``, never
worse than the default), and each kernel's figures as built."""

from __future__ import annotations

import copy
import dataclasses
import json

import tvm
from tvm import tirx
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.target import Target

from ..building import is_tirx
from ..database import TuningDatabase
from ..errors import AutofuseError
from ..measure import param_bytes
from ..pattern import Pattern
from ..registry import get_pattern
from ..verify import TEMPLATE_DEFAULT, UNSCHEDULED, build_kernel, choose, time_kernel
from .fusion import DTYPE_ATTR, PATTERN_ATTR, SHAPE_ATTR


@dataclasses.dataclass
class Kernel:
    gv: tvm.ir.GlobalVar
    original: tirx.PrimFunc      # as the model's module holds it
    pattern: Pattern | None

    @property
    def name(self) -> str:
        return self.gv.name_hint

    @property
    def workload(self) -> tvm.IRModule:
        """The module MetaSchedule's Relax integration tunes for this kernel (same structure), on a
        copy of the model's PrimFunc: a TVM 0.27 schedule of a PrimFunc nothing else holds
        (``s_tir.Schedule(kernel.func)``) rewrites its body in place from the first ``annotate``
        on (every template's first step), and ``with_attr`` shares that body with ``original``."""
        return tvm.IRModule({"main": copy.deepcopy(self.original).with_attr("global_symbol", "main")})

    @property
    def func(self) -> tirx.PrimFunc:
        return self.workload["main"]

    @property
    def shape(self) -> dict | None:
        return json.loads(str(self.original.attrs[SHAPE_ATTR])) if self.pattern is not None else None

    @property
    def dtype(self) -> str | None:
        return str(self.original.attrs[DTYPE_ATTR]) if self.pattern is not None else None


def kernels(mod: tvm.IRModule) -> list[Kernel]:
    found = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = func.attrs.get(PATTERN_ATTR) if func.attrs else None
        found.append(Kernel(gv, func, get_pattern(str(name)) if name else None))
    return sorted(found, key=lambda k: k.name)


@dataclasses.dataclass
class KernelDecision:
    name: str
    pattern: str | None
    applied: str            # "record", "template-default" or "default"
    source: str | None      # where the best checked record came from: template:<name> / generic
    default_ms: float | None
    tuned_ms: float | None
    note: str = ""
    records: int = 0        # tuning records of this kernel in the database, failed trials included
    # Which default schedule: "template-default", a CPU rule ("cpu_gemm", ...), "dlight" or
    # "unscheduled"; None when a record runs and no default was timed against it.
    default: str | None = None


def apply_database(mod: tvm.IRModule, db: TuningDatabase | None, target: Target, dev,
                   stock: bool = False) -> tuple[tvm.IRModule, list[KernelDecision]]:
    """Each kernel gets its best checked record if that beats its default schedule, else the first
    default that passes its check (pattern kernels: their template defaults, then the untuned
    default: ``verify``'s module docstring). ``stock``: TVM's own default instead (the TVM
    baselines). ``dev`` None: compiled for a device this machine lacks, so nothing is checked."""
    decisions = []
    mod = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions_items()))
    for kernel in kernels(mod):
        choice, rejected = choose(kernel, db, target, dev, fallback=True, stock=stock, repeat=5, min_repeat_ms=20)
        if choice is None:
            what = f"kernel {kernel.name}" + (f" ({kernel.pattern.name})" if kernel.pattern else "")
            raise AutofuseError(f"{what} has nothing to run on {target.kind.name}: {'; '.join(rejected)}")
        if choice.source != UNSCHEDULED:  # the TensorIR as written stays as TVM lowers it
            mod[kernel.gv] = _as_kernel(choice.mod["main"], kernel)
        decisions.append(_decision(kernel, choice, len(rejected) - len(choice.notes), db is not None))
    return mod, decisions


def _decision(kernel: Kernel, choice, records_rejected: int, with_db: bool) -> KernelDecision:
    notes = [f"{records_rejected} record(s) rejected by the numerical check"] if records_rejected else []
    if choice.record_source is None and with_db and not records_rejected:
        notes.append("no record")
    if choice.record_source is not None and not choice.is_record:
        notes.append("record slower than default")
    notes += choice.notes
    if choice.knobs is not None:
        notes.append("tirx kernel " + ",".join(f"{k}={v}" for k, v in choice.knobs.items()))
    applied = "record" if choice.is_record else ("template-default" if choice.source == TEMPLATE_DEFAULT
                                                 else "default")
    ms = (lambda secs: secs * 1e3 if secs is not None else None)
    return KernelDecision(kernel.name, kernel.pattern.name if kernel.pattern else None, applied,
                          choice.record_source, ms(choice.default_secs), ms(choice.record_secs), "; ".join(notes),
                          choice.records, choice.default_source)


def _as_kernel(scheduled, kernel: Kernel):
    """The scheduled PrimFunc under the original kernel's attributes (name, visibility)."""
    func = scheduled.without_attr("global_symbol")
    if kernel.original.attrs and "global_symbol" in kernel.original.attrs:
        func = func.with_attr("global_symbol", kernel.original.attrs["global_symbol"])
    if is_tirx(func):  # a kernel template's kernel: still this pattern's kernel
        for key in (PATTERN_ATTR, SHAPE_ATTR, DTYPE_ATTR, "op_pattern"):
            if key in kernel.original.attrs:
                func = func.with_attr(key, kernel.original.attrs[key])
    return func.with_attr("tirx.is_scheduled", True)


def kernel_work(kernel: Kernel) -> tuple[float | None, float]:
    """(FLOPs, bytes) of one call: a pattern kernel counts them as its pattern does; any other
    kernel gets TVM's FLOP estimate (None where it has none) and the bytes of its buffers, each
    read or written once (the traffic a perfect schedule moves)."""
    if kernel.pattern is not None:
        return kernel.pattern.flops(kernel.shape), kernel.pattern.bytes(kernel.shape, kernel.dtype)
    try:
        flops = float(estimate_tir_flops(kernel.workload))
    except Exception:  # the estimator rejects some TIR (Let expressions); FLOPs stay unknown
        flops = None
    return flops, float(param_bytes(kernel.func))


def kernel_figures(mod: tvm.IRModule, target: Target, dev, repeat: int = 5) -> list[dict]:
    """Every kernel of a built module as it will run: its latency on seeded data, FLOPs and bytes
    (``kernel_work``)."""
    figures = []
    for kernel in kernels(mod):
        flops, nbytes = kernel_work(kernel)
        secs = time_kernel(kernel, build_kernel(kernel.workload, target), dev, repeat, min_repeat_ms=20)
        figures.append({"name": kernel.name, "pattern": kernel.pattern.name if kernel.pattern else None,
                        "ms": secs * 1e3, "flops": float(flops) if flops else None, "bytes": float(nbytes)})
    return figures


def pattern_share(mod: tvm.IRModule) -> dict:
    """How much of a fused model's work its pattern kernels do: FLOPs and bytes of every kernel
    (``kernel_work``) times its call sites, summed over pattern kernels and over all."""
    from tvm import relax

    calls: dict[str, int] = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir) and isinstance(expr.args[0], tvm.ir.GlobalVar):
            calls[expr.args[0].name_hint] = calls.get(expr.args[0].name_hint, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    share = {"pattern_flops": 0.0, "flops": 0.0, "pattern_bytes": 0.0, "bytes": 0.0}
    for kernel in kernels(mod):
        flops, nbytes = kernel_work(kernel)
        count = calls.get(kernel.name, 0)
        share["flops"] += (flops or 0.0) * count
        share["bytes"] += nbytes * count
        if kernel.pattern is not None:
            share["pattern_flops"] += (flops or 0.0) * count
            share["pattern_bytes"] += nbytes * count
    share["flop_fraction"] = share["pattern_flops"] / share["flops"] if share["flops"] else 0.0
    share["byte_fraction"] = share["pattern_bytes"] / share["bytes"] if share["bytes"] else 0.0
    return share
