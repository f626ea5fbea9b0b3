"""Kernels for run-time lengths (continuous batching): one PrimFunc and one compiled module that
serve every value of the shape parameters made symbolic.

Owns: turning shape parameters into int64 TIR variables (``symbolic``); building a pattern's
symbolic kernel with the schedule chosen at a static representative shape (``build_dynamic``:
the best checked record or the template default, whichever ``verify.choose`` picks, its
trace replayed on the symbolic function); and running that one module at concrete sizes against
the numpy reference (``check_sizes``). Whether a pattern accepts a symbolic parameter is the
pattern's own business: its ``build`` takes an int64 ``tirx.Var`` where it supports one.

Records are tuned at static shapes; a trace replays on the symbolic function when every decision
in it is valid for any length (a categorical choice, a split of a static loop), not when it is a
``sample_perfect_tile`` of a symbolic loop, nor when it declares a buffer region (its bounds are
the static shape's numbers). A trace that does not replay is replaced by the template default,
and ``source`` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
from tvm import s_tir, tirx
from tvm.target import Target

from .database import TuningDatabase, replay
from .errors import AutofuseError
from .pattern import Pattern, Shape, shape_label
from .target import device_for
from .tune_patterns import Job
from .verify import build_kernel, check_module, choose, default_schedule, time_kernel


def _names(names: str | Iterable[str]) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _is_static(value) -> bool:
    return isinstance(value, (int, np.integer))


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def symbolic(shape: Shape, names: str | Iterable[str]) -> dict:
    """``shape`` with the parameters ``names`` replaced by int64 ``tirx.Var``s of the same name."""
    names = _names(names)
    for name in names:
        if name not in shape:
            raise AutofuseError(f"no shape parameter {name!r} to make symbolic "
                                f"(known: {', '.join(shape) or 'none'})")
    return {key: tirx.Var(key, "int64") if key in names else value for key, value in shape.items()}


def _replay(func: tirx.PrimFunc, trace) -> s_tir.Schedule:
    # A declared buffer region holds the static shape's numbers (e.g. a window ending at the last
    # key): replayed on a symbolic function it would be right at that one length only, which is
    # the one length the candidate is checked at.
    if any(inst.kind.name == "AnnotateBufferAccess" for inst in trace.insts):
        raise ValueError("the trace declares buffer regions for its static shape")
    sch = s_tir.Schedule(func)
    # Postprocessing steps stay in: a MetaSchedule record was measured with them.
    replay(trace, sch)
    return sch


def _static_choice(pattern: Pattern, shape: Shape, dtype: str, target: Target, db: TuningDatabase):
    """(trace, source) of what ``choose`` runs at the static ``shape``; (None, why) for nothing."""
    job = Job(pattern, shape, dtype)
    choice, _rejected = choose(job, db, target, device_for(target))
    if choice is None:
        return None, "no checked record and no template default at the static shape"
    return choice.trace, choice.source if not choice.is_record else f"record ({choice.source})"


def build_dynamic(pattern: Pattern, shape: Shape, names: str | Iterable[str], dtype: str, target: Target,
                  db: TuningDatabase | None = None):
    """(runtime module, source): ``pattern`` built once with ``names`` symbolic.

    ``shape`` is the static representative: the schedule is the one chosen there (with ``db``,
    its best checked record or the template default, whichever runs faster; without, the template
    default), replayed on the symbolic function. Each candidate must build and match the reference
    at ``shape`` through the symbolic module, or the next is used: the template default applied
    to the symbolic function, then the function unscheduled. ``source`` names what was used and
    why an earlier candidate was not.
    """
    names = _names(names)
    sym_shape = symbolic(shape, names)
    loose = [key for key, value in shape.items() if not _is_static(value)]
    if loose:
        raise AutofuseError(f"the representative shape of {pattern.name!r} must be static; "
                            f"{', '.join(loose)} are not integers")
    try:
        func = pattern.build(sym_shape, dtype)
    except Exception as err:  # a pattern that needs this parameter as a number
        raise AutofuseError(f"pattern {pattern.name!r} cannot be built with symbolic {', '.join(names)}: "
                            f"{_first_line(err)}") from None

    candidates = []
    if db is not None:
        trace, source = _static_choice(pattern, shape, dtype, target, db)
        if trace is not None:
            candidates.append((f"{source}, trace replayed", lambda: _replay(func, trace)))
    candidates.append(("template-default", lambda: default_schedule(func, target, pattern, fallback=False)))
    candidates.append(("unscheduled", lambda: s_tir.Schedule(func)))

    dev = device_for(target)
    at_shape = {name: shape[name] for name in names}
    failures = []
    for source, make in candidates:
        try:
            rt = build_kernel(make().mod, target)
        except Exception as err:  # a trace or template that does not fit the symbolic function
            failures.append(f"{source} not used: it did not apply or build on the symbolic function "
                            f"({_first_line(err)})")
            continue
        (result,) = check_sizes(pattern, rt, shape, [at_shape], dtype, dev, repeat=0)
        if not result.ok:
            failures.append(f"{source} not used: it failed the numerical check at {shape_label(at_shape)} "
                            f"({result.message})")
            continue
        return rt, "; ".join([source] + failures)
    raise AutofuseError(f"no symbolic kernel of {pattern.name!r} works: {'; '.join(failures)}")


@dataclasses.dataclass
class SizeResult:
    size: dict            # the concrete values given for this run
    ok: bool
    max_abs_err: float
    median_ms: float | None
    message: str = ""


def check_sizes(pattern: Pattern, rt, shape: Shape, overrides_list: Sequence[dict], dtype: str, dev,
                repeat: int = 10, seed: int = 1234) -> list[SizeResult]:
    """Run the one module ``rt`` at each ``shape`` updated by an entry of ``overrides_list``;
    compare with the reference at the pattern's tolerance and time it (median over ``repeat``
    runs; 0: no timing). ``shape`` may hold the symbolic variables or any static values."""
    results = []
    for overrides in overrides_list:
        unknown = [key for key in overrides if key not in shape]
        if unknown:
            raise AutofuseError(f"no shape parameter {unknown[0]!r} in {pattern.name!r} "
                                f"(known: {', '.join(shape)})")
        concrete = {**shape, **overrides}
        loose = [key for key, value in concrete.items() if not _is_static(value)]
        if loose:
            raise AutofuseError(f"size {shape_label(overrides)} leaves {', '.join(loose)} without a value")
        try:
            # The static function at this size: its output shapes and the pattern's shape rules.
            job = Job(pattern, concrete, dtype)
        except ValueError as err:
            raise AutofuseError(f"{pattern.name} at {shape_label(overrides)}: {_first_line(err)}") from None
        check = check_module(pattern, rt, job.func, concrete, dtype, dev, seed=seed)
        secs = time_kernel(job, rt, dev, repeat) if repeat and check.ok else None
        results.append(SizeResult(dict(overrides), check.ok, check.max_abs_err,
                                  secs * 1e3 if secs is not None else None, check.message))
    return results
