"""The kernels (PrimFuncs) of a fused model: their MetaSchedule workloads, the pattern each came
from, and the numerical check a tuned record of each must pass."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import tvm
from tvm import tirx
from tvm.target import Target

from ..errors import AutofuseError
from ..measure import param_arrays, param_bytes, run_on, time_function, to_device
from ..pattern import DLIGHT, Pattern
from ..registry import get_pattern
from ..accuracy import compare, reduction_length
from ..verify import check_module
from .fusion import DTYPE_ATTR, PATTERN_ATTR, SHAPE_ATTR

# A generic kernel is checked against its unscheduled self: reordered float sums differ a little.


@dataclasses.dataclass
class Kernel:
    gv: tvm.ir.GlobalVar
    func: tirx.PrimFunc
    pattern: Pattern | None

    @property
    def name(self) -> str:
        return self.gv.name_hint

    @property
    def workload(self) -> tvm.IRModule:
        """The module MetaSchedule's Relax integration tunes for this kernel (same structure)."""
        return tvm.IRModule({"main": self.func.with_attr("global_symbol", "main")})

    @property
    def templates(self):
        return self.pattern.templates if self.pattern else ()

    def pattern_shape(self) -> tuple[dict, str]:
        return json.loads(str(self.func.attrs[SHAPE_ATTR])), str(self.func.attrs[DTYPE_ATTR])


def kernels(mod: tvm.IRModule) -> list[Kernel]:
    found = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = func.attrs.get(PATTERN_ATTR) if func.attrs else None
        found.append(Kernel(gv, func, get_pattern(str(name)) if name else None))
    return sorted(found, key=lambda k: k.name)


def runnable_workload(kernel: Kernel, target: Target) -> tvm.IRModule:
    """A non-pattern kernel as TVM runs it without a record: as it is on a CPU; on a GPU under
    dlight's rules, because an unscheduled GPU kernel builds but crashes when run."""
    if not DLIGHT.applies_to(target):
        return kernel.workload
    try:
        return DLIGHT.apply(kernel.workload["main"], target, tunable=False).mod
    except ValueError as err:
        raise AutofuseError(f"kernel {kernel.name} has no {target.kind.name} schedule: {err}") from None


def build_kernel(mod: tvm.IRModule, target: Target):
    return tvm.tirx.build(mod, target=target)


def make_checker(kernel: Kernel, target: Target, dev):
    """``check(schedule) -> (ok, message)``: a pattern kernel against its numpy reference, any
    other kernel against its own unscheduled version on seeded random data."""
    if kernel.pattern is not None:
        shape, dtype = kernel.pattern_shape()

        def check_pattern(sch):
            try:
                rt = build_kernel(sch.mod, target)
            except Exception as err:
                return False, f"build failed: {str(err).strip().splitlines()[0]}"
            result = check_module(kernel.pattern, rt, sch.mod["main"], shape, dtype, dev)
            return result.ok, result.message
        return check_pattern

    arrays = param_arrays(kernel.func, seed=7)
    expected = None

    def check_generic(sch):
        nonlocal expected
        if expected is None:
            expected = run_on(build_kernel(runnable_workload(kernel, target), target), arrays, dev)
        try:
            got = run_on(build_kernel(sch.mod, target), arrays, dev)
        except Exception as err:
            return False, f"kernel failed: {str(err).strip().splitlines()[0]}"
        result = compare(got, expected, accumulation=reduction_length(kernel.func))
        return result.ok, result.message
    return check_generic


def time_module(mod: tvm.IRModule, func: tirx.PrimFunc, target: Target, dev, repeat: int = 5) -> float:
    rt = build_kernel(mod, target)
    args = to_device(param_arrays(func, seed=0), dev)
    return time_function(rt, args, dev, repeat=repeat, min_repeat_ms=20).median_secs


def finite(values) -> bool:
    return all(np.all(np.isfinite(v)) for v in values)


def kernel_figures(mod: tvm.IRModule, target: Target, dev, repeat: int = 5) -> list[dict]:
    """Every kernel of a built module as it will run: its latency on seeded data, FLOPs and bytes.
    A pattern kernel counts them as its pattern does; any other kernel gets TVM's FLOP estimate
    and the bytes of its buffers, each read or written once (the traffic a perfect schedule moves)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    figures = []
    for kernel in kernels(mod):
        workload = kernel.workload
        if kernel.pattern is not None:
            shape, dtype = kernel.pattern_shape()
            flops, nbytes = kernel.pattern.flops(shape), kernel.pattern.bytes(shape, dtype)
        else:
            try:
                flops = float(estimate_tir_flops(workload))
            except Exception:  # the estimator rejects some TIR (Let expressions); FLOPs stay unknown
                flops = None
            nbytes = param_bytes(kernel.func)
        figures.append({"name": kernel.name, "pattern": kernel.pattern.name if kernel.pattern else None,
                        "ms": time_module(workload, kernel.func, target, dev, repeat=repeat) * 1e3,
                        "flops": float(flops) if flops else None, "bytes": float(nbytes)})
    return figures
