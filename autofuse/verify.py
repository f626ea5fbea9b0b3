"""The one numerical check of a built kernel: run it on seeded inputs and compare every output with
the pattern's numpy reference at the bound ``autofuse.accuracy`` derives for the dtype."""

from __future__ import annotations

import tvm

from .accuracy import Check
from .measure import empty_outputs, to_device
from .pattern import Pattern, Shape


def check_module(pattern: Pattern, rt_mod, func, shape: Shape, dtype: str, dev, seed: int = 1234) -> Check:
    """Run ``rt_mod`` (built from a schedule of ``func``) on fresh inputs and compare."""
    inputs = pattern.make_inputs(shape, dtype, seed)
    outputs = empty_outputs(pattern.output_specs(func), dev)
    try:
        rt_mod(*to_device(inputs, dev), *outputs)
    except tvm.error.TVMError as err:
        return Check(False, float("inf"), float("inf"), 0.0, f"kernel failed: {str(err).splitlines()[0]}")
    return pattern.check([o.numpy() for o in outputs], inputs, shape, dtype, func)
