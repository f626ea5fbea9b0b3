"""How close an output must be to its reference: one bound, derived from the dtype and the
accumulation length, judged against the output's scale.

An output passes when no element is further from the reference than ``bound * scale``, where
``scale`` is the largest magnitude in the reference, and non-finite values sit exactly where the
reference has them. Judging errors against the scale (not elementwise ``rtol/atol``) catches wrong
small values, such as a softmax whose tiny probabilities were zeroed, that a fixed ``atol`` lets
through; and it accepts what standard half-precision kernels compute (float32 accumulation, one or
two roundings to the output dtype) without loosening float32.

The bound: two roundings to the output dtype, plus float32 accumulation error growing as the square
root of the accumulation length (random rounding errors add as a random walk; the constant leaves
room for worst-case orderings). Integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def dtype_eps(dtype) -> float:
    """Machine epsilon of a float dtype (bfloat16 too); 0 for integers and booleans."""
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name == "bfloat16":
        return 2.0 ** -7
    kind = np.dtype(name).kind
    return float(np.finfo(np.dtype(name)).eps) if kind == "f" else 0.0


def error_bound(dtype, accumulation: int = 1) -> float:
    """Largest ``max |got - want| / max |want|`` accepted for an output of ``dtype`` whose
    elements sum ``accumulation`` terms."""
    eps = dtype_eps(dtype)
    if eps == 0.0:
        return 0.0
    return 2.0 * eps + 4.0 * _FLOAT32_EPS * math.sqrt(max(1, int(accumulation)))


@dataclasses.dataclass
class Check:
    ok: bool
    max_abs_err: float
    # max |got - want| / max |want| over the outputs: the figure the bound is about.
    scaled_err: float
    bound: float = 0.0
    message: str = ""

    def as_dict(self) -> dict:
        return {"ok": self.ok, "max_abs_err": self.max_abs_err, "scaled_err": self.scaled_err,
                "bound": self.bound, "message": self.message}


def compare(outputs, expected, *, accumulation: int = 1, bound: float | Sequence[float] | None = None) -> Check:
    """Check every output against its reference. ``bound`` overrides the dtype-derived bound (one
    figure for all outputs, or one per output); by default each output's dtype sets its own."""
    outputs, expected = list(outputs), list(expected)
    if len(outputs) != len(expected):
        return Check(False, math.inf, math.inf, 0.0, f"{len(outputs)} outputs, the reference has {len(expected)}")
    bounds = _bounds(outputs, accumulation, bound)
    worst_abs = worst_scaled = 0.0
    for index, (got, want, limit) in enumerate(zip(outputs, expected, bounds)):
        where = f"output {index}: " if len(outputs) > 1 else ""
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            return Check(False, math.inf, math.inf, limit, f"{where}shape {got.shape} != reference {want.shape}")
        found = _max_errors(got, want)
        if found is None:
            return Check(False, math.inf, math.inf, limit, f"{where}non-finite values where the reference has none")
        err, scale = found
        scaled = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        worst_abs, worst_scaled = max(worst_abs, err), max(worst_scaled, scaled)
        if scaled > limit:
            return Check(False, worst_abs, worst_scaled, limit,
                         f"{where}max abs error {err:.3g} is {scaled:.3g} of the output's scale {scale:.3g} "
                         f"(bound {limit:.3g})")
    return Check(True, worst_abs, worst_scaled, max(bounds, default=0.0))


_CHUNK = 1 << 22  # elements compared at once: a decode step's caches are 2 x 537M values


def _max_errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float] | None:
    """(max |got - want|, max |want|) over the reference's finite elements, in float64 and in chunks;
    None when the non-finite values differ in place or value."""
    if got.dtype == want.dtype and np.array_equal(got, want):
        return 0.0, 0.0  # a copy (a cache passed through): no error, whatever the scale
    err = scale = 0.0
    for g, w in zip(_chunks(got), _chunks(want)):
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        finite = np.isfinite(w64)
        if not np.array_equal(np.isfinite(g64), finite) or not np.array_equal(g64[~finite], w64[~finite], equal_nan=True):
            return None
        if not finite.all():
            g64, w64 = g64[finite], w64[finite]
        err = max(err, float(np.abs(g64 - w64).max(initial=0.0)))
        scale = max(scale, float(np.abs(w64).max(initial=0.0)))
    return err, scale


def _chunks(array: np.ndarray):
    flat = array.reshape(-1)
    for start in range(0, max(flat.size, 1), _CHUNK):
        yield flat[start:start + _CHUNK]


def _bounds(outputs, accumulation: int, bound) -> list[float]:
    if bound is None:
        return [error_bound(_dtype_of(o), accumulation) for o in outputs]
    if isinstance(bound, (int, float)):
        return [float(bound)] * len(outputs)
    return [float(b) for b in bound]


def _dtype_of(array) -> str:
    dtype = getattr(array, "dtype", None)
    return str(dtype) if dtype is not None else "float64"


def reduction_length(func) -> int:
    """The longest reduction in a PrimFunc: the product of the reduction axes' extents of its
    largest reducing block (1 when nothing reduces or an extent is symbolic)."""
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    longest, pending = 1, list(sch.get_child_blocks(sch.get_sblock("root")))
    while pending:
        block = pending.pop()
        pending.extend(sch.get_child_blocks(block))
        length = 1
        for var in sch.get(block).iter_vars:
            if var.iter_type == tirx.IterVar.CommReduce:
                extent = var.dom.extent
                length *= int(extent.value) if isinstance(extent, tirx.IntImm) else 1
        longest = max(longest, length)
    return longest


def framework_bound(bound: float, framework_errs: Sequence[float], *, slack: float = 1.25,
                    ceiling: float = 32.0) -> float:
    """The bound a compare row is judged by: the dtype bound, or the framework's own result's scaled
    error (torch eager / onnxruntime on the same inputs) with some slack, whichever is larger, so
    what every framework ships in that dtype is valid. A framework far off (``ceiling`` x the bound)
    lifts nothing: its result is not a standard to hold others to."""
    usable = [e for e in framework_errs if e is not None and math.isfinite(e) and e <= ceiling * max(bound, 1e-30)]
    return max([bound, *(slack * e for e in usable)])
