"""Kernel templates, the second kind of template (``KernelTemplate``, which the pattern files fill
in): where they apply, their records in the target's database folder, their search, and what
``verify.choose`` gets from them. Their tirx kernels are built by ``autofuse.building``.

Records: ``kernel_records.json`` beside MetaSchedule's files, written through
``store.JSONLinesFile`` (locked, one fsync'ed line per record, damage skipped), one JSON object a
line per measured configuration::

    {"pattern", "shape", "dtype", "template", "knobs", "run_secs", "checked": {"ok", "message"},
     "func_hash", "commit", "dirty", "time"}

``run_secs`` is empty when the kernel failed to build, run or pass its check (kept as history, never
chosen). A record replays from its knob values: the template builds the kernel again, and its
structural hash must equal ``func_hash`` (the PrimFunc that was checked and timed), or the record is
stale, skipped as a MetaSchedule trace that no longer applies is.

Search (``tune_kernels``): the space is small, so it is walked in ``KernelTemplate.configs``'s order
(the default first, then by how few knobs differ from it) up to the trial budget, skipping
configurations already recorded. Every candidate is built and measured as the caller says
(``verify.device_measure``: checked against the pattern's reference, the one check, and when it
passes timed with compare's timer).

Selection (``candidates``): in one pass over a kernel's pattern, the fastest checked record that
still replays, each applicable template at its default knobs and the schedule rules after them,
for ``verify.choose`` to set beside the best MetaSchedule record and the untuned default; it times
them against each other, never worse.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tvm
from tvm import tirx
from tvm.target import Target

from .building import TIRX_ARCH_ATTR, TIRX_ATTR, build_tirx, kernel_module
from .pattern import Pattern
from .provenance import code_commit
from .store import JSONLinesFile, Problem, workload_key

KERNEL_RECORDS = "kernel_records.json"
# A kernel record's source, as a MetaSchedule record's is "template:<name>" or "generic".
SOURCE_PREFIX = "kernel:"

log = logging.getLogger("autofuse")


# --- the template -------------------------------------------------------------------------------

class KernelTemplate:
    """A kernel template: ``build(shape, dtype, knobs) -> PrimFunc`` written in the tirx script, for
    what schedule primitives cannot express (Hopper wgmma with TMA and mbarrier rings).

    Its knobs form a small space (``space``: knob -> allowed values) that tuning walks config by
    config from ``default``, or from ``shape_default(shape, dtype)`` where the best start depends on
    the shape (a smaller tile where the default's would leave SMs idle); ``check(shape, dtype,
    knobs)`` raises ValueError for what the kernel cannot compute. It applies on ``target_kinds``
    with an ``arch`` in ``archs`` (any arch when empty); its functions are compiled for ``build_arch`` (wgmma needs sm_90a's arch-specific
    instructions, which an sm_90 target does not enable). The PrimFunc takes the pattern's
    parameters in the pattern's order.
    """

    def __init__(self, name: str, build: Callable[[dict, str, dict], tirx.PrimFunc], space: dict,
                 default: dict, check: Callable[[dict, str, dict], Any], target_kinds: Sequence[str] = ("cuda",),
                 archs: Sequence[str] = (), build_arch: str | None = None, doc: str = "",
                 shape_default: Callable[[dict, str], dict] | None = None):
        self.name = name
        self._build = build
        self.space = {knob: tuple(values) for knob, values in space.items()}
        self.default = dict(default)
        self._shape_default = shape_default
        self._check = check
        self.target_kinds = tuple(target_kinds)
        self.archs = tuple(archs)
        self.build_arch = build_arch
        self.doc = doc or ((build.__doc__ or "").strip().splitlines() or [""])[0]
        self._configs: dict[str, list[dict]] = {}  # per shape and dtype: a space walked once

    def applies_to(self, target: Target) -> bool:
        if target.kind.name not in self.target_kinds:
            return False
        return not self.archs or str(target.attrs.get("arch", "")) in self.archs

    def configs(self, shape: dict, dtype: str) -> list[dict]:
        """Every knob configuration ``check`` accepts for ``shape``, the shape's default first, then
        by how few knobs differ from it, then by how many steps along each knob's values (BN 256 ->
        128 before 64); remaining ties in the space's order."""
        key = json.dumps([shape, dtype], sort_keys=True, default=str)
        if key not in self._configs:
            self._configs[key] = self._walk(shape, dtype)
        return [dict(knobs) for knobs in self._configs[key]]

    def _walk(self, shape: dict, dtype: str) -> list[dict]:
        start = self._shape_default(shape, dtype) if self._shape_default else self.default
        found = []
        for values in itertools.product(*self.space.values()):
            knobs = dict(zip(self.space, values))
            try:
                self._check(shape, dtype, knobs)
            except ValueError:
                continue
            found.append(knobs)

        def steps(name, value):
            values = self.space[name]
            return abs(values.index(value) - values.index(start[name])) if start.get(name) in values else 1

        return sorted(found, key=lambda k: (sum(k[n] != start.get(n) for n in k),
                                            sum(steps(n, v) for n, v in k.items())))

    def default_for(self, shape: dict, dtype: str) -> dict | None:
        """The knobs used without tuning: the first of ``configs`` (None when none fits)."""
        configs = self.configs(shape, dtype)
        return configs[0] if configs else None

    def applies(self, shape: dict, dtype: str, target: Target) -> bool:
        """On ``target``, for ``shape`` in ``dtype``, with some configuration (False where ``check``
        raises for every one)."""
        return self.applies_to(target) and self.default_for(shape, dtype) is not None

    def build(self, shape: dict, dtype: str, knobs: dict | None = None) -> tirx.PrimFunc:
        """The kernel for ``knobs`` (``default_for`` the shape when None); ValueError where it cannot
        be built."""
        if knobs is None:
            knobs = self.default_for(shape, dtype)
            if knobs is None:
                raise ValueError(f"{self.name}: no configuration computes {shape} in {dtype}")
        self._check(shape, dtype, knobs)
        func = self._build(shape, dtype, dict(knobs))
        func = func.with_attr(TIRX_ATTR, True).with_attr("tirx.is_scheduled", True)
        return func.with_attr(TIRX_ARCH_ATTR, self.build_arch) if self.build_arch else func

    def __repr__(self) -> str:
        return f"KernelTemplate({self.name!r})"


def kernel_templates_for(pattern: Pattern, shape: dict, dtype: str, target: Target) -> list[KernelTemplate]:
    """``pattern``'s kernel templates that compute ``shape`` in ``dtype`` on ``target``; where one
    applies, it is tried before the schedule rules."""
    return [t for t in pattern.templates if isinstance(t, KernelTemplate) and t.applies(shape, dtype, target)]


# --- records ------------------------------------------------------------------------------------

_FIELDS = {"pattern": str, "shape": dict, "dtype": str, "template": str, "knobs": dict, "run_secs": list,
           "checked": dict, "func_hash": str}


@dataclasses.dataclass
class KernelRecord:
    pattern: str
    shape: dict
    dtype: str
    template: str
    knobs: dict
    run_secs: list          # seconds of each timed call; empty: failed to build, run or check
    checked: dict           # {"ok": bool, "message": str}
    func_hash: str          # structural hash of the PrimFunc that was checked and timed
    commit: str = "unknown"
    dirty: bool | None = None
    time: str = ""

    @property
    def secs(self) -> float:
        return sum(self.run_secs) / len(self.run_secs) if self.run_secs else math.inf

    @property
    def ok(self) -> bool:
        return bool(self.checked.get("ok")) and bool(self.run_secs)

    @property
    def source(self) -> str:
        return f"{SOURCE_PREFIX}{self.template}"

    @property
    def workload(self) -> tuple:
        return workload_of(self.pattern, self.shape, self.dtype)

    def label(self) -> str:
        knobs = ",".join(f"{k}={v}" for k, v in self.knobs.items())
        return f"{self.template}[{knobs}]"

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> "KernelRecord":
        """ValueError when a field is missing or of the wrong type."""
        for name, kind in _FIELDS.items():
            if not isinstance(value.get(name), kind):
                raise ValueError(f"field {name!r} missing or not a {kind.__name__}")
        if not all(isinstance(s, (int, float)) for s in value["run_secs"]):
            raise ValueError("run_secs holds a non-number")
        if not isinstance(value["checked"].get("ok"), bool):
            raise ValueError("checked.ok is not a boolean")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in known})


def workload_of(pattern: str, shape: dict, dtype: str) -> tuple:
    """What kernel records are filed under: the pattern workload (a pattern at a shape in a dtype)."""
    return pattern, tuple(sorted((str(k), int(v)) for k, v in shape.items())), dtype


class KernelRecords:
    """The kernel records of one database folder (``KERNEL_RECORDS``)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, KERNEL_RECORDS)
        self.file = JSONLinesFile(self.path)
        self._invalid: dict[int, Problem] = {}

    @property
    def problems(self) -> list[Problem]:
        """Lines skipped: not JSON objects, or objects that are not kernel records."""
        return [*self.file.problems, *self._invalid.values()]

    def numbered(self) -> list[tuple[int, KernelRecord]]:
        """(line, record) of every readable record, in the order measured."""
        found = []
        for number, value in self.file.entries():
            try:
                found.append((number, KernelRecord.from_json(value)))
            except (ValueError, TypeError) as err:
                if number not in self._invalid:
                    self._invalid[number] = Problem(self.path, number, f"not a kernel record ({err})")
                    log.warning("%s; skipped", self._invalid[number])
        return found

    def all(self) -> list[KernelRecord]:
        return [record for _, record in self.numbered()]

    def of(self, pattern: str, shape: dict, dtype: str) -> list[KernelRecord]:
        key = workload_of(pattern, shape, dtype)
        return [r for r in self.all() if r.workload == key]

    def count(self, pattern: str, shape: dict, dtype: str) -> tuple[int, int]:
        """(records that passed their check, all) of a pattern workload."""
        records = self.of(pattern, shape, dtype)
        return sum(r.ok for r in records), len(records)

    def append(self, record: KernelRecord) -> None:
        self.file.append(record.as_json())

    def location(self, record: KernelRecord) -> str:
        for number, stored in self.numbered():
            if stored == record:
                return f"{self.path}:{number}"
        return self.path


# --- replay -------------------------------------------------------------------------------------

class StaleRecord(ValueError):
    """A record whose kernel cannot be built again as it was measured."""


def func_hash(func: tirx.PrimFunc) -> str:
    return workload_key(tvm.IRModule({"main": func}))


def kernel_template(pattern: Pattern, name: str) -> KernelTemplate | None:
    return next((t for t in pattern.templates if isinstance(t, KernelTemplate) and t.name == name), None)


def replay(record: KernelRecord, pattern: Pattern | None = None) -> tirx.PrimFunc:
    """The record's kernel, built again from its knob values (``pattern`` looked up by the
    record's name when not given); ``StaleRecord`` when its pattern or template is gone, its knobs
    are refused, or the kernel differs from the one measured."""
    if pattern is None:
        from .errors import AutofuseError
        from .registry import get_pattern
        try:
            pattern = get_pattern(record.pattern)
        except AutofuseError as err:
            raise StaleRecord(str(err)) from None
    return _rebuild(record, pattern)


def _rebuild(record: KernelRecord, pattern: Pattern) -> tirx.PrimFunc:
    template = kernel_template(pattern, record.template)
    if template is None:
        raise StaleRecord(f"pattern {record.pattern!r} has no kernel template {record.template!r}")
    try:
        func = build_cached(pattern, template, record.shape, record.dtype, record.knobs)
    except (ValueError, TypeError, KeyError) as err:
        raise StaleRecord(f"its knobs no longer build: {err}") from None
    if func_hash(func) != record.func_hash:
        raise StaleRecord("its kernel changed since it was measured (the template was edited)")
    return func


_BUILT: dict[str, tirx.PrimFunc] = {}


def build_cached(pattern: Pattern, template: KernelTemplate, shape: dict, dtype: str, knobs: dict) -> tirx.PrimFunc:
    """``template.build``, once per process for each configuration (parsing a tirx kernel takes
    about a second, and checking a database replays every record)."""
    key = json.dumps([pattern.name, template.name, shape, dtype, knobs], sort_keys=True)
    if key not in _BUILT:
        _BUILT[key] = template.build(shape, dtype, knobs)
    return _BUILT[key]


# --- selection (for verify.choose) --------------------------------------------------------------

@dataclasses.dataclass
class Candidates:
    """What a kernel's pattern offers ``verify.choose`` on a target (a ``verify.Kernel``)."""
    record: KernelRecord | None = None       # the fastest checked kernel record that still replays
    module: tvm.IRModule | None = None       # its kernel
    rejected: list[str] = dataclasses.field(default_factory=list)  # about the records passed over
    # The defaults in the order tried: (template, knobs, module) of each applicable kernel template
    # at its default knobs, built as they are asked for; then the schedule rules, at fixed knobs.
    defaults: Iterator[tuple[KernelTemplate, dict, tvm.IRModule]] = dataclasses.field(default_factory=lambda: iter(()))
    rules: list = dataclasses.field(default_factory=list)


def candidates(kernel, db, target: Target, limit: int = 8) -> Candidates:
    """In one pass over ``kernel``'s pattern: its kernel templates' best record (from ``db`` when
    given) and its defaults; nothing for a kernel no pattern made."""
    if kernel.pattern is None:
        return Candidates()
    pattern, shape, dtype = kernel.pattern, kernel.shape, kernel.dtype
    templates = kernel_templates_for(pattern, shape, dtype, target)
    found = Candidates(defaults=_defaults(pattern, templates, shape, dtype), rules=pattern.templates_for(target))
    if db is None:
        return found
    names = {t.name for t in templates}
    usable = [r for r in db.kernels.of(pattern.name, shape, dtype) if r.template in names]
    failed = [r for r in usable if not r.checked.get("ok") and r.checked.get("message") != BUILD_FAILED]
    if failed:
        found.rejected.append(f"{len(failed)} kernel record(s) failed the numerical check (kept, never chosen), "
                              f"e.g. {failed[0].label()}: {failed[0].checked.get('message')}")
    for record in sorted((r for r in usable if r.ok), key=lambda r: r.secs)[:limit]:
        try:
            func = _rebuild(record, pattern)
        except StaleRecord as err:
            message = f"{db.kernels.location(record)}: kernel record {record.label()} skipped: {err}"
            log.warning(message)
            found.rejected.append(message)
            continue
        found.record, found.module = record, kernel_module(func)
        break
    return found


def _defaults(pattern: Pattern, templates: list[KernelTemplate], shape: dict, dtype: str):
    for template in templates:
        knobs = template.default_for(shape, dtype)
        yield template, knobs, kernel_module(build_cached(pattern, template, shape, dtype, knobs))


# --- search -------------------------------------------------------------------------------------

BUILD_FAILED = "build failed"

# measure(job, runtime module, device) -> (check passed, message, seconds of each timed call), as
# ``verify.device_measure`` makes it
Measure = Callable[[object, object, object], tuple[bool, str, list]]


@dataclasses.dataclass
class KernelTuneStats:
    trials: int = 0
    failed: int = 0
    best_secs: float | None = None
    secs: float = 0.0       # wall time of the search
    crashed: bool = False   # a kernel's run raised: the search stopped (the device may be unusable)


class _Crashed(Exception):
    """A kernel raised while it ran: the device may be left unusable (a CUDA fault poisons the
    context), so the search stops rather than record every later configuration as failed."""


def tune_kernels(jobs: Sequence, target: Target, db, *, trials: int, dev, measure: Measure,
                 on_phase: Callable[[str], None] | None = None,
                 templates: Sequence[str] = ()) -> dict[int, KernelTuneStats]:
    """Measure up to ``trials`` not yet recorded configurations of each job's kernel templates
    (``tune_patterns.Job``s; only those named in ``templates`` when given) on ``dev``, in
    ``configs`` order, each stored as a record as soon as it is measured. Returns what was done per
    job index."""
    phase = on_phase or (lambda _msg: None)
    commit, dirty = _commit()
    stats: dict[int, KernelTuneStats] = {}
    for index, job in enumerate(jobs):
        todo = []
        for template in kernel_templates_for(job.pattern, job.shape, job.dtype, target):
            if templates and template.name not in templates:
                continue
            done = _recorded(db, job, template)
            todo += [(template, knobs) for knobs in template.configs(job.shape, job.dtype)
                     if _knobs_key(knobs) not in done]
        if not todo:
            continue
        job_stats = stats[index] = KernelTuneStats()
        start = time.perf_counter()
        try:
            for number, (template, knobs) in enumerate(todo[:trials], 1):
                phase(f"{job.label}: {template.name} {number}/{min(len(todo), trials)}")
                record = _trial(job, template, knobs, target, dev, measure, commit, dirty, db)
                job_stats.trials += 1
                if not record.ok:
                    job_stats.failed += 1
                elif job_stats.best_secs is None or record.secs < job_stats.best_secs:
                    job_stats.best_secs = record.secs
        except _Crashed as crash:
            job_stats.trials += 1
            job_stats.failed += 1
            job_stats.crashed = True
            log.warning("%s; kernel-template search stopped (the device may need a fresh process)", crash)
            job_stats.secs = time.perf_counter() - start
            break
        job_stats.secs = time.perf_counter() - start
    return stats


def _trial(job, template: KernelTemplate, knobs: dict, target: Target, dev, measure: Measure, commit: str,
           dirty: bool | None, db) -> KernelRecord:
    """Build, check and time one configuration and append its record; ``_Crashed`` (after
    appending it) when its run raised."""
    func = build_cached(job.pattern, template, job.shape, job.dtype, knobs)
    crashed = None
    try:
        rt = build_tirx(func, target)
    except Exception as err:  # TVM raises its own types; a config that does not build is a failed trial
        ok, message, run_secs = False, BUILD_FAILED, []
        log.warning("%s: %s %s does not build: %s", job.label, template.name, knobs, _first_line(err))
    else:
        try:
            ok, message, run_secs = measure(job, rt, dev)
        except Exception as err:  # the kernel crashed (a wrong answer is a failed check, not this)
            ok, message, run_secs = False, f"run failed: {_first_line(err)}", []
            crashed = f"{job.label}: {template.name} {knobs} crashed: {_first_line(err)}"
    record = KernelRecord(job.pattern.name, dict(job.shape), job.dtype, template.name, dict(knobs),
                          list(run_secs) if ok else [], {"ok": bool(ok), "message": message},
                          func_hash(func), commit, dirty, time.strftime("%Y-%m-%d %H:%M:%S"))
    db.kernels.append(record)
    if crashed:
        raise _Crashed(crashed)
    return record


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _commit() -> tuple[str, bool | None]:
    try:
        found = code_commit()
        return found["commit"], found["dirty"]
    except Exception:  # provenance only; never a reason to lose a measurement
        return "unknown", None


def _knobs_key(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True)


def _recorded(db, job, template: KernelTemplate) -> set[str]:
    """Knob sets of ``template`` already measured for ``job`` on the kernel as it is now (a stale
    record's configuration is measured again)."""
    done = set()
    for record in db.kernels.of(job.pattern.name, job.shape, job.dtype):
        if record.template != template.name:
            continue
        try:
            _rebuild(record, job.pattern)
        except StaleRecord:
            continue
        done.add(_knobs_key(record.knobs))
    return done


# --- database maintenance (``autofuse db``) -----------------------------------------------------

def check_records(folder: str) -> dict:
    """Kernel records of one folder: how many, how many passed their check, how many failed it, and
    the problems (skipped lines, records that no longer replay)."""
    records = KernelRecords(folder)
    numbered = records.numbered()
    problems = [str(p) for p in records.problems]
    for number, record in numbered:
        if not record.ok:
            continue
        try:
            replay(record)
        except StaleRecord as err:
            problems.append(f"{records.path}:{number}: kernel record {record.label()}: {err}")
    failed = sum(not r.checked.get("ok") and r.checked.get("message") != BUILD_FAILED for _, r in numbered)
    return {"records": len(numbered), "valid": sum(r.ok for _, r in numbered), "failed_numerical_check": failed,
            "workloads": len({r.workload for _, r in numbered}), "problems": problems}


def compact_records(folder: str, keep: int) -> tuple[int, int]:
    """Rewrite one folder's kernel records keeping the ``keep`` fastest per pattern workload that
    passed their check and still replay (failed ones, stale ones and damaged lines go); (before,
    after). Nothing is written when the folder has no kernel records."""
    records = KernelRecords(folder)
    if not os.path.exists(records.path):
        return 0, 0
    numbered = records.numbered()
    before = len(numbered) + len(records.problems)
    by_workload: dict[tuple, list[tuple[int, KernelRecord]]] = {}
    for number, record in numbered:
        if record.ok:
            by_workload.setdefault(record.workload, []).append((number, record))
    kept = []
    for ranked in by_workload.values():
        usable = []
        for number, record in sorted(ranked, key=lambda nr: nr[1].secs):
            if len(usable) == keep:
                break
            try:
                replay(record)
            except StaleRecord:
                continue
            usable.append((number, record))
        kept += usable
    kept.sort(key=lambda nr: nr[0])  # in the order measured
    records.file.rewrite([record.as_json() for _, record in kept])
    return before, len(kept)
