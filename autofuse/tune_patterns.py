"""The ``autofuse tune --pattern`` job: tune pattern workloads, check the best record of each
against its numpy reference, time it against the untuned kernel, and return the table rows."""

from __future__ import annotations

import dataclasses

import tvm
from tvm.target import Target

from .database import TuningDatabase
from .errors import AutofuseError
from .measure import empty_outputs, time_function, to_device
from .pattern import Pattern, Shape, shape_label
from .tune import Task, TuneStats, tune
from .verify import check_module


@dataclasses.dataclass
class Job:
    pattern: Pattern
    shape: Shape
    dtype: str

    def __post_init__(self):
        try:
            self.func = self.pattern.build(self.shape, self.dtype)
        except ValueError as err:  # a pattern's own shape rule (kv_heads must divide heads, ...)
            raise AutofuseError(f"pattern {self.pattern.name!r} cannot be built at {shape_label(self.shape)}: {err}") from None

    @property
    def label(self) -> str:
        return f"{self.pattern.name}[{shape_label(self.shape)}]"


def build_kernel(mod_or_func, target: Target):
    return tvm.tirx.build(mod_or_func, target=target)


def checker(job: Job, target: Target, dev):
    """``check(schedule)`` for ``TuningDatabase.best``: build and compare on fresh inputs."""
    def check(sch):
        try:
            rt = build_kernel(sch.mod, target)
        except Exception as err:  # a record that no longer builds is as unusable as a wrong one
            return False, f"build failed: {str(err).strip().splitlines()[0]}"
        result = check_module(job.pattern, rt, job.func, job.shape, job.dtype, dev)
        return result.ok, result.message or f"max abs error {result.max_abs_err:.2g}"
    return check


def untuned_kernel(job: Job, target: Target):
    """What runs without tuning: on a CPU the TensorIR as written; on a GPU TVM's dlight default,
    since a kernel without thread bindings builds there but crashes the process when run. None
    when no dlight rule schedules it."""
    if target.kind.name == "llvm":
        return build_kernel(job.func, target)
    from .pattern import DLIGHT
    try:
        return build_kernel(DLIGHT.apply(job.func, target, tunable=False).mod, target)
    except ValueError:
        return None


def time_kernel(job: Job, rt, dev, repeat: int) -> float:
    inputs = to_device(job.pattern.make_inputs(job.shape, job.dtype, 0), dev)
    outputs = empty_outputs(job.pattern.output_specs(job.func), dev)
    return time_function(rt, inputs + outputs, dev, repeat=repeat).median_secs


@dataclasses.dataclass
class Choice:
    """What runs for a pattern workload: the best checked record or the template default,
    whichever is faster measured here; ``source`` says which."""
    mod: tvm.IRModule
    source: str
    secs: float
    record_secs: float | None = None   # the chosen record's own timing, also when the default won


def choose(job: Job, db: TuningDatabase | None, target: Target, dev, repeat: int = 10,
           with_default: bool = True) -> tuple[Choice | None, list[str]]:
    """Never worse than no tuning: a short search can leave records slower than the template's
    default knobs, so both are timed on the same inputs and the faster one runs. None when no
    record passes its check and there is no default (or ``with_default`` is off); with one line
    per rejected record."""
    check = checker(job, target, dev)
    chosen, rejected = db.best(job.func, check) if db is not None else (None, [])
    candidates = []
    if chosen is not None:
        candidates.append((chosen.schedule.mod, chosen.source))
    if with_default and job.pattern.templates_for(target, job.func):
        default = job.pattern.default_schedule(job.func, target)
        ok, message = check(default)  # a template's defaults are checked like any record
        if ok:
            candidates.append((default.mod, "template-default"))
        else:
            rejected.append(f"template default failed the numerical check: {message}")
    if not candidates:
        return None, rejected
    timed = [(time_kernel(job, build_kernel(mod, target), dev, repeat), mod, source) for mod, source in candidates]
    secs, mod, source = min(timed, key=lambda t: t[0])
    return Choice(mod, source, secs, timed[0][0] if chosen is not None else None), rejected


def summarize(job: Job, db: TuningDatabase, target: Target, *, space: str, stats: TuneStats | None,
              index: int, repeat: int = 10) -> dict:
    """One table row: the best checked record (or the template default, when faster) vs the
    untuned kernel."""
    dev = tvm.device("cpu" if target.kind.name == "llvm" else target.kind.name, 0)
    # The generic space is measured on its own: a template default would not be its result.
    choice, rejected = choose(job, db, target, dev, repeat, with_default=space != "generic")
    untuned_rt = untuned_kernel(job, target)
    untuned = time_kernel(job, untuned_rt, dev, repeat) if untuned_rt is not None else None
    valid, total = db.count(job.func)
    row = {
        "pattern": job.pattern.name, "shape": shape_label(job.shape), "dtype": job.dtype, "space": space,
        "trials": stats.trials.get(index, 0) if stats else 0, "records": total, "valid_records": valid,
        "untuned_ms": untuned * 1e3 if untuned is not None else None, "best_ms": None, "gflops": None, "gbps": None, "speedup": None,
        "source": None, "record_ms": None, "tune_secs": stats.task_secs.get(index, 0.0) if stats else 0.0,
        "rejected": rejected,
    }
    if choice is not None:
        best = choice.secs
        row.update(best_ms=best * 1e3, speedup=untuned / best if untuned is not None else None, source=choice.source,
                   record_ms=choice.record_secs * 1e3 if choice.record_secs else None,
                   gflops=job.pattern.flops(job.shape) / best / 1e9,
                   gbps=job.pattern.bytes(job.shape, job.dtype) / best / 1e9)
    return row


def tune_jobs(jobs: list[Job], target: Target, db: TuningDatabase, *, trials: int, space: str,
              seed: int | None, progress: bool = True, run_timeout: float = 30.0,
              runner=None, runner_status=None) -> tuple[list[dict], TuneStats]:
    """``runner``: MetaSchedule's runner (default: local); ``runner_status()``: a short text for
    the progress bar (the RPC servers in use)."""
    from .progress import tuning_bar

    tasks = [Task(job.label, job.func, job.pattern.templates_for(target, job.func)) for job in jobs]
    with tuning_bar(trials * len(jobs), [job.label for job in jobs], progress, runner_status) as (on_phase, on_progress):
        stats = tune(tasks, target, db.ms, db.work_dir, trials_per_task=trials, space=space, seed=seed,
                     cost_model_path=db.cost_model_path, run_timeout=run_timeout, runner=runner,
                     on_progress=on_progress, on_phase=on_phase)
    rows = []
    for index, job in enumerate(jobs):
        rows.append(summarize(job, db, target, space=space, stats=stats, index=index))
    return rows, stats


