"""The one path from a kernel to what runs, for ``tune``, ``build`` and ``compare`` alike: its
default schedules, the numerical check every schedule passes before it is used, and the choice
between the best checked record and the checked default, with the kernel's records counted.

A kernel here is anything with ``name``, ``func`` (the PrimFunc its schedules are made of),
``workload`` (what its tuning records are filed under) and ``pattern``, ``shape``, ``dtype`` (None
for a kernel no pattern made): a pattern workload (``tune_patterns.Job``) or a model's kernel
(``model.kernels.Kernel``).

- Default schedules, in the order they are tried: each of the pattern's kernel templates that
  applies at its default knobs (``autofuse.kernel_templates``), each of its schedule rules with its
  fixed knobs, then the untuned default: dlight's rules on a GPU (an unscheduled GPU kernel builds
  and then crashes the device), the CPU rules of the schedule library on a CPU
  (``search_spaces.lib.cpu_rules``: packed GEMM, batched GEMM, rows, injective, parallel), and
  where none applies or passes its check, the TensorIR as written.
- What TVM runs as shipped (``stock``: the tvm-untuned and tvm-auto baselines): dlight on a GPU,
  the TensorIR as written on a CPU, built without ``fast_math``.
- Building (``autofuse.building``: ``build_kernel``, and ``fast_math`` for a model): on a CPU,
  float32 exp/erf/tanh/sigmoid calls become the vectorisable polynomials of
  ``search_spaces.lib.tir_math``.
- The check: a pattern kernel against the pattern's numpy reference; any other kernel against what
  TVM runs for it as shipped, built with libm's math, on seeded data (reordered float sums and the
  polynomials differ a little); both by ``autofuse.accuracy.compare`` at the bound of the dtype
  and the longest reduction. Every default but the reference itself is checked like any record,
  and one that fails is not used.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Protocol

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from .accuracy import Check, compare, reduction_length
from . import kernel_templates
from .building import build_kernel
from .database import TuningDatabase
from .measure import empty_outputs, param_arrays, run_on, time_function, timer_for, to_device
from .pattern import DLIGHT, Pattern, Shape, Template

from search_spaces.lib import cpu_rules  # noqa: E402 (the schedule library, no pattern)

# The untuned default of a CPU kernel, tried in order (each a dlight-shaped rule).
CPU_RULES = tuple(Template(name, fn, target_kinds=("llvm",)) for name, fn in cpu_rules.RULES)

# What ``Choice.source`` says when a default runs (a record's says which space it came from).
TEMPLATE_DEFAULT = "template-default"
UNSCHEDULED = "unscheduled"
DEFAULTS = (TEMPLATE_DEFAULT, DLIGHT.name, UNSCHEDULED, *(rule.name for rule in CPU_RULES))

# Takes a schedule, or the module of a kernel template's kernel.
CheckFn = Callable[[s_tir.Schedule | tvm.IRModule], tuple[bool, str]]


class Kernel(Protocol):
    name: str
    func: tirx.PrimFunc
    workload: tirx.PrimFunc | tvm.IRModule
    pattern: Pattern | None
    shape: Shape | None
    dtype: str | None


def stock_default(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule:
    """What TVM runs as shipped without a record: dlight's rules on a GPU, the TensorIR as written
    on a CPU; the reference of a kernel no pattern made. ValueError where no dlight rule
    schedules ``func``."""
    if DLIGHT.applies_to(target):
        return DLIGHT.apply(func, target, tunable=False)
    return s_tir.Schedule(func)


def stock_source(target: Target) -> str:
    return DLIGHT.name if DLIGHT.applies_to(target) else UNSCHEDULED


def untuned_rules(target: Target) -> list[Template]:
    """The rules of the untuned default on ``target``, tried in order (see the module docstring)."""
    return [DLIGHT] if DLIGHT.applies_to(target) else [r for r in CPU_RULES if r.applies_to(target)]


def untuned(func: tirx.PrimFunc, target: Target) -> tuple[s_tir.Schedule, str]:
    """The untuned default of ``func``, unchecked, and its source: the first rule of
    ``untuned_rules`` that applies, else what TVM runs as shipped."""
    for rule in untuned_rules(target):
        if rule is DLIGHT:
            break
        try:
            return rule.apply(func, target, tunable=False), rule.name
        except Exception:  # the rule does not describe this kernel, or TVM refused one of its steps
            continue
    return stock_default(func, target), stock_source(target)


def default_schedule(func: tirx.PrimFunc, target: Target, pattern: Pattern | None = None, *,
                     fallback: bool = True) -> s_tir.Schedule:
    """The first default that applies, unchecked: the first of ``pattern``'s templates for
    ``target`` with fixed knobs, else (with ``fallback``) the untuned kernel. ValueError when none."""
    refused = []
    for template in pattern.templates_for(target) if pattern is not None else ():
        try:
            sch = template.apply(func, target, tunable=False)
        except Exception as err:  # a template that does not fit this TensorIR: try the next
            refused.append(f"{template.name}: {_first_line(err)}")
            continue
        if sch is not None:
            return sch
    if fallback:
        return untuned(func, target)[0]
    name = pattern.name if pattern is not None else "this kernel"
    raise ValueError(f"no template of {name!r} applies on {target.kind.name}"
                     + (f" ({'; '.join(refused)})" if refused else ""))


def check_module(pattern: Pattern, rt_mod, func, shape: Shape, dtype: str, dev, seed: int = 1234) -> Check:
    """Run ``rt_mod`` (built from a schedule of ``func``) on fresh inputs and compare with the
    pattern's reference."""
    inputs = pattern.make_inputs(shape, dtype, seed)
    specs = pattern.output_specs(func)
    outputs = empty_outputs(specs, dev)
    try:
        rt_mod(*to_device(inputs, dev), *outputs)
    except tvm.error.TVMError as err:
        return Check(False, float("inf"), float("inf"), 0.0, f"kernel failed: {_first_line(err)}")
    return pattern.check([o.numpy() for o in outputs], inputs, shape, dtype, func)


def checker(kernel: Kernel, target: Target, dev, stock: bool = False) -> CheckFn:
    """``check(schedule) -> (ok, message)``, as ``TuningDatabase.best`` takes it: build the
    schedule (as TVM does, with ``stock``) and compare on fresh inputs (see the module docstring
    for against what)."""
    if kernel.pattern is not None:
        def check_pattern(sch):
            try:
                rt = build_kernel(sch if isinstance(sch, tvm.IRModule) else sch.mod, target, stock=stock)
            except Exception as err:  # a record that no longer builds is as unusable as a wrong one
                return False, f"build failed: {_first_line(err)}"
            result = check_module(kernel.pattern, rt, kernel.func, kernel.shape, kernel.dtype, dev)
            return result.ok, result.message or f"max abs error {result.max_abs_err:.2g}"
        return check_pattern

    reference = []  # (arrays, expected): made at the first check

    def check_generic(sch):
        if not reference:
            arrays = param_arrays(kernel.func, seed=7)
            shipped = build_kernel(stock_default(kernel.func, target).mod, target, stock=True)
            reference.append((arrays, run_on(shipped, arrays, dev)))
        arrays, expected = reference[0]
        try:
            got = run_on(build_kernel(sch.mod, target, stock=stock), arrays, dev)
        except Exception as err:
            return False, f"kernel failed: {_first_line(err)}"
        result = compare(got, expected, accumulation=reduction_length(kernel.func))
        return result.ok, result.message or f"max abs error {result.max_abs_err:.2g}"
    return check_generic


def time_kernel(kernel: Kernel, rt, dev, repeat: int = 10, min_repeat_ms: int = 50) -> float:
    """Median seconds of ``rt`` on seeded inputs: the pattern's own for a pattern kernel, random
    data for its parameters otherwise."""
    if kernel.pattern is not None:
        inputs = kernel.pattern.make_inputs(kernel.shape, kernel.dtype, 0)
        specs = kernel.pattern.output_specs(kernel.func)
        args = to_device(inputs, dev) + empty_outputs(specs, dev)
    else:
        args = to_device(param_arrays(kernel.func, seed=0), dev)
    return time_function(rt, args, dev, repeat=repeat, min_repeat_ms=min_repeat_ms).median_secs


def measure_on_device(job, rt, dev, timer=None, repeat: int = 20) -> tuple[bool, str, list]:
    """Check ``rt`` (a kernel of ``job``'s pattern) against the reference; when it passes, time it
    on the pattern's seeded inputs with compare's timer (``measure.timer_for``: CUDA events after an
    L2 flush on a GPU, TVM's launches on torch's stream)."""
    result = check_module(job.pattern, rt, job.func, job.shape, job.dtype, dev)
    message = result.message or f"max abs error {result.max_abs_err:.2g}"
    if not result.ok:
        return False, message, []
    args = (to_device(job.pattern.make_inputs(job.shape, job.dtype, 0), dev)
            + empty_outputs(job.pattern.output_specs(job.func), dev))
    timer = timer if timer is not None else timer_for(dev)
    with _torch_stream(dev):
        timing = timer.time(lambda: rt(*args), dev.sync, repeat=repeat)
    return True, message, [float(s) for s in timing.samples_secs]


@contextlib.contextmanager
def _torch_stream(dev):
    if dev.dlpack_device_type() != 2:  # kDLCUDA
        yield
        return
    import tvm_ffi
    with tvm_ffi.use_torch_stream():
        yield


def device_measure(dev):
    """``kernel_templates.tune_kernels``' measure on ``dev`` (``measure_on_device``), its timer made
    now: a missing torch is the user's to fix before any trial, not a failed record."""
    timer = timer_for(dev)
    return lambda job, rt, dev_: measure_on_device(job, rt, dev_, timer)


@dataclasses.dataclass
class Choice:
    """What runs for a kernel."""
    mod: tvm.IRModule
    # A record's space ("template:<name>", "generic"), or which default: "template-default",
    # "dlight", a CPU rule ("cpu_gemm", ...) or "unscheduled".
    source: str
    trace: s_tir.Trace | None
    # Timed here only when a record and a default were timed against each other.
    secs: float | None = None
    record_source: str | None = None   # the best checked record's space, also when the default won
    record_secs: float | None = None
    default_secs: float | None = None
    # Why defaults before this one were passed over (also among ``choose``'s rejected lines).
    notes: list[str] = dataclasses.field(default_factory=list)
    # A kernel template's knob values (``mod`` then holds its tirx kernel; source "kernel:<name>"
    # for a record).
    knobs: dict | None = None
    default_source: str | None = None  # the checked default's source, also when a record won
    template: str | None = None  # the kernel template that made ``mod`` (a kernel-template default)
    # The kernel's tuning records in the database, of both kinds: all (failed trials included), and
    # those that passed their check.
    records: int = 0
    valid_records: int = 0

    @property
    def is_record(self) -> bool:
        return self.source not in DEFAULTS


def choose(kernel: Kernel, db: TuningDatabase | None, target: Target, dev, *, defaults: bool = True,
           fallback: bool = False, stock: bool = False, repeat: int = 10,
           min_repeat_ms: int = 50) -> tuple[Choice | None, list[str]]:
    """Never worse than no tuning: the best checked record of each kind (MetaSchedule's, a kernel
    template's) and the first default that passes its check, timed on the same inputs; the fastest
    one runs (a short search can leave records slower than the template's fixed knobs).

    ``defaults`` off: records only (how the generic space is measured on its own). ``fallback``:
    when no template default passes, the untuned default (a model's every kernel must run).
    ``stock``: TVM as shipped, its default and its build (the TVM baselines). ``dev`` None: nothing
    runs here, so nothing is checked (compiling for a device this machine lacks). Returns None
    when nothing may run, and one line per candidate not used."""
    check = checker(kernel, target, dev, stock) if dev is not None else None
    records, rejected = [], []
    valid, total = 0, 0
    if db is not None:
        if check is None:
            raise ValueError("records are only used after their check, which needs a device")
        chosen, rejected = db.best(kernel.workload, check)
        valid, total = db.count_kernel(kernel)
        if chosen is not None:
            records.append(Choice(chosen.schedule.mod, chosen.source, chosen.record.trace,
                                  record_source=chosen.source))
    # A kernel record was checked when it was measured (its verdict is in the record).
    offered = kernel_templates.candidates(kernel, db, target)
    rejected = rejected + offered.rejected
    if offered.record is not None:
        records.append(Choice(offered.module, offered.record.source, None, record_source=offered.record.source,
                              knobs=offered.record.knobs))
    notes: list[str] = []
    default = _checked_default(kernel, offered, target, check, fallback, stock, notes) if defaults else None
    rejected = rejected + notes
    if default is not None:
        default.notes = notes
        default.default_source = default.source
    candidates = records + ([default] if default is not None else [])
    if not candidates:
        return None, rejected
    if len(candidates) == 1:
        return dataclasses.replace(candidates[0], records=total, valid_records=valid), rejected
    for candidate in candidates:
        candidate.secs = time_kernel(kernel, build_kernel(candidate.mod, target, stock=stock), dev, repeat,
                                     min_repeat_ms)
    record = min(records, key=lambda c: c.secs)  # ties: MetaSchedule's, listed first
    winner = record if default is None or record.secs <= default.secs else default
    return dataclasses.replace(winner, record_source=record.source, record_secs=record.secs,
                               default_secs=default.secs if default is not None else None,
                               default_source=default.source if default is not None else None,
                               records=total, valid_records=valid), rejected


def _checked_default(kernel: Kernel, offered: kernel_templates.Candidates, target: Target, check: CheckFn | None,
                     fallback: bool, stock: bool, notes: list[str]) -> Choice | None:
    """The first default schedule that applies and passes ``check``; each one passed over is
    said in ``notes``. The pattern's (``offered``) come first: a kernel template that applies at its
    default knobs, then the schedule rules."""
    for template, knobs, mod in offered.defaults:
        ok, message = check(mod) if check is not None else (True, "")
        if ok:
            return Choice(mod, TEMPLATE_DEFAULT, None, knobs=knobs, template=template.name)
        notes.append(f"template default failed the numerical check ({template.name}): {message}")
    templates = offered.rules
    for template in templates:
        try:
            sch = template.apply(kernel.func, target, tunable=False)
        except Exception as err:  # a template that does not fit this shape: try the next
            notes.append(f"template default ({template.name}) does not apply: {_first_line(err)}")
            continue
        if sch is None:
            continue
        ok, message = check(sch) if check is not None else (True, "")
        if ok:
            return Choice(sch.mod, TEMPLATE_DEFAULT, sch.trace)
        notes.append(f"template default failed the numerical check ({template.name}): {message}")
    if not fallback or DLIGHT in templates:
        return None
    passed_over = "no template default passed" if templates else ""
    for rule in [] if stock else [r for r in untuned_rules(target) if r is not DLIGHT]:
        try:
            sch = rule.apply(kernel.func, target, tunable=False)
        except cpu_rules.NotApplicable:
            continue
        except Exception as err:  # TVM refused a step: the rule's analysis missed something here
            notes.append(f"{rule.name} does not apply: {_first_line(err)}")
            continue
        ok, message = check(sch) if check is not None else (True, "")
        if ok:
            if passed_over:
                notes.append(f"{rule.name} used: {passed_over}")
            return Choice(sch.mod, rule.name, sch.trace)
        notes.append(f"{rule.name} failed the numerical check: {message}")
        passed_over = passed_over or f"{rule.name} failed its check"
    source = stock_source(target)
    try:
        sch = stock_default(kernel.func, target)
    except ValueError as err:
        notes.append(f"no {target.kind.name} schedule: {_first_line(err)}")
        return None
    # TVM's own default is the reference of a kernel no pattern made; a pattern's is judged too.
    ok, message = check(sch) if check is not None and kernel.pattern is not None else (True, "")
    if not ok:
        notes.append(f"{source} failed the numerical check: {message}")
        return None
    if passed_over:
        notes.append(f"{source} used: {passed_over}")
    return Choice(sch.mod, source, sch.trace)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
