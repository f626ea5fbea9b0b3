"""The ``autofuse tune --pattern`` job: tune pattern workloads, then for each what runs (through
``verify.choose``: the best checked record or the checked template default) timed against the
untuned kernel, as the table rows."""

from __future__ import annotations

import dataclasses

from tvm.target import Target

from .database import TuningDatabase
from .errors import AutofuseError
from .pattern import Pattern, Shape, shape_label
from .progress import tuning_bar
from .target import device_for
from .kernel_templates import tune_kernels
from .tune import Task, TuneStats, tune
from .verify import build_kernel, choose, device_measure, time_kernel, untuned


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

    name = label

    @property
    def workload(self):
        return self.func


def summarize(job: Job, db: TuningDatabase, target: Target, *, space: str, stats: TuneStats | None,
              index: int, repeat: int = 10) -> dict:
    """One table row: the best checked record (or the template default, when faster) vs the
    untuned default (``verify.untuned``: the CPU rules, dlight on a GPU)."""
    dev = device_for(target)
    # The generic space is measured on its own: a template default would not be its result.
    choice, rejected = choose(job, db, target, dev, defaults=space != "generic", repeat=repeat)
    try:
        untuned_secs = time_kernel(job, build_kernel(untuned(job.func, target)[0].mod, target), dev, repeat)
    except ValueError:  # no dlight rule schedules it on this GPU
        untuned_secs = None
    valid, total = db.count_kernel(job)
    row = {
        "pattern": job.pattern.name, "shape": shape_label(job.shape), "dtype": job.dtype, "space": space,
        "trials": stats.trials.get(index, 0) if stats else 0, "records": total, "valid_records": valid,
        "untuned_ms": untuned_secs * 1e3 if untuned_secs is not None else None, "best_ms": None, "gflops": None,
        "gbps": None, "speedup": None, "source": None, "record_ms": None,
        "tune_secs": stats.task_secs.get(index, 0.0) if stats else 0.0, "rejected": rejected,
    }
    if choice is not None:
        best = choice.secs if choice.secs is not None else time_kernel(job, build_kernel(choice.mod, target),
                                                                        dev, repeat)
        record_secs = choice.record_secs if choice.record_secs is not None else (best if choice.is_record else None)
        row.update(best_ms=best * 1e3, speedup=untuned_secs / best if untuned_secs is not None else None,
                   source=choice.source, knobs=choice.knobs, record_ms=record_secs * 1e3 if record_secs else None,
                   gflops=job.pattern.flops(job.shape) / best / 1e9,
                   gbps=job.pattern.bytes(job.shape, job.dtype) / best / 1e9)
    return row


def add_kernel_trials(stats: TuneStats, kernel_stats: dict) -> None:
    """Count a kernel-template search (``kernel_templates.tune_kernels``) into the session's stats."""
    for index, done in kernel_stats.items():
        stats.trials[index] = stats.trials.get(index, 0) + done.trials
        stats.failed[index] = stats.failed.get(index, 0) + done.failed
        stats.task_secs[index] = stats.task_secs.get(index, 0.0) + done.secs
        stats.total_secs += done.secs
        if done.best_secs is not None and done.best_secs < stats.best_secs.get(index, float("inf")):
            stats.best_secs[index] = done.best_secs


def tune_jobs(jobs: list[Job], target: Target, db: TuningDatabase, *, trials: int, space: str,
              seed: int | None, progress: bool = True, run_timeout: float = 30.0,
              runner=None, runner_status=None) -> tuple[list[dict], TuneStats]:
    """``runner``: MetaSchedule's runner (default: local); ``runner_status()``: a short text for
    the progress bar (the RPC servers in use)."""
    tasks = [Task(job.label, job.func, job.pattern.templates_for(target, job.func)) for job in jobs]
    with tuning_bar(trials * len(jobs), [job.label for job in jobs], progress, runner_status) as (on_phase, on_progress):
        stats = tune(tasks, target, db.ms, db.work_dir, trials_per_task=trials, space=space, seed=seed,
                     cost_model_path=db.cost_model_path, run_timeout=run_timeout, runner=runner,
                     on_progress=on_progress, on_phase=on_phase)
        # Kernel templates' spaces (the template space's other kind): up to ``trials`` configs each,
        # measured on this host's device.
        if space != "generic":
            dev = device_for(target)
            add_kernel_trials(stats, tune_kernels(jobs, target, db, trials=trials, dev=dev, measure=device_measure(dev),
                                                  on_phase=on_phase))
    rows = []
    for index, job in enumerate(jobs):
        rows.append(summarize(job, db, target, space=space, stats=stats, index=index))
    return rows, stats


