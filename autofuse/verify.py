"""The numerical check: run a built kernel on seeded inputs and compare every output with the
pattern's numpy reference at the dtype's tolerance."""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm

from .measure import empty_outputs, to_device
from .pattern import Pattern, Shape


@dataclasses.dataclass
class Check:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    message: str = ""


def compare(outputs, expected, rtol: float, atol: float) -> Check:
    worst_abs = worst_rel = 0.0
    for got, want in zip(outputs, expected):
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            return Check(False, float("inf"), float("inf"), f"shape {got.shape} != reference {want.shape}")
        if not np.all(np.isfinite(got) == np.isfinite(want)):
            return Check(False, float("inf"), float("inf"), "non-finite values where the reference has none")
        diff = np.abs(got - want)
        worst_abs = max(worst_abs, float(diff.max(initial=0.0)))
        worst_rel = max(worst_rel, float((diff / (np.abs(want) + atol)).max(initial=0.0)))
        if not np.allclose(got, want, rtol=rtol, atol=atol):
            return Check(False, worst_abs, worst_rel,
                         f"max abs error {worst_abs:.3g} > tolerance (rtol={rtol}, atol={atol})")
    return Check(True, worst_abs, worst_rel)


def check_module(pattern: Pattern, rt_mod, func, shape: Shape, dtype: str, dev, seed: int = 1234) -> Check:
    """Run ``rt_mod`` (built from a schedule of ``func``) on fresh inputs and compare."""
    inputs = pattern.make_inputs(shape, dtype, seed)
    outputs = empty_outputs(pattern.output_specs(func), dev)
    try:
        rt_mod(*to_device(inputs, dev), *outputs)
    except tvm.error.TVMError as err:
        return Check(False, float("inf"), float("inf"), f"kernel failed: {str(err).splitlines()[0]}")
    rtol, atol = pattern.tolerance_for(dtype)
    return compare([o.numpy() for o in outputs], pattern.run_reference(inputs, shape), rtol, atol)
