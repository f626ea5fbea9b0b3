"""The ``autofuse tune --pattern`` job: tune pattern workloads, check the best record of each
against its numpy reference, time it against the untuned kernel, and return the table rows."""

from __future__ import annotations

import dataclasses

import tvm
from tvm.target import Target

from .database import TuningDatabase
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
        self.func = self.pattern.build(self.shape, self.dtype)

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


def time_kernel(job: Job, rt, dev, repeat: int) -> float:
    inputs = to_device(job.pattern.make_inputs(job.shape, job.dtype, 0), dev)
    outputs = empty_outputs(job.pattern.output_specs(job.func), dev)
    return time_function(rt, inputs + outputs, dev, repeat=repeat).median_secs


def summarize(job: Job, db: TuningDatabase, target: Target, *, space: str, stats: TuneStats | None,
              index: int, repeat: int = 10) -> dict:
    """One table row: best checked record vs the untuned kernel."""
    dev = tvm.device("cpu" if target.kind.name == "llvm" else target.kind.name, 0)
    chosen, rejected = db.best(job.func, checker(job, target, dev))
    untuned = time_kernel(job, build_kernel(job.func, target), dev, repeat)
    valid, total = db.count(job.func)
    row = {
        "pattern": job.pattern.name, "shape": shape_label(job.shape), "dtype": job.dtype, "space": space,
        "trials": stats.trials.get(index, 0) if stats else 0, "records": total, "valid_records": valid,
        "untuned_ms": untuned * 1e3, "best_ms": None, "gflops": None, "gbps": None, "speedup": None,
        "source": None, "tune_secs": stats.task_secs.get(index, 0.0) if stats else 0.0,
        "rejected": rejected,
    }
    if chosen is not None:
        best = time_kernel(job, build_kernel(chosen.schedule.mod, target), dev, repeat)
        row.update(best_ms=best * 1e3, speedup=untuned / best, source=chosen.source,
                   gflops=job.pattern.flops(job.shape) / best / 1e9,
                   gbps=job.pattern.bytes(job.shape, job.dtype) / best / 1e9)
    return row


def tune_jobs(jobs: list[Job], target: Target, db: TuningDatabase, *, trials: int, space: str,
              seed: int | None, progress: bool = True) -> tuple[list[dict], TuneStats]:
    from .progress import tuning_bar

    tasks = [Task(job.label, job.func, job.pattern.templates) for job in jobs]
    with tuning_bar(trials * len(jobs), [job.label for job in jobs], progress) as (on_phase, on_progress):
        stats = tune(tasks, target, db.ms, db.work_dir, trials_per_task=trials, space=space, seed=seed,
                     cost_model_path=db.cost_model_path, on_progress=on_progress, on_phase=on_phase)
    rows = []
    for index, job in enumerate(jobs):
        rows.append(summarize(job, db, target, space=space, stats=stats, index=index))
    return rows, stats


