"""Tuning a model: its kernels after fusion become MetaSchedule tasks sharing one budget by weight
(how often each kernel runs); pattern kernels search their templates too."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..registry import get_pattern
from ..tune import Task
from .fusion import PATTERN_ATTR


def model_tasks(fused_mod, target: Target, space: str) -> list[Task]:
    tasks = []
    for extracted in ms.relax_integration.extract_tasks(fused_mod, target):
        workload = extracted.dispatched[0]
        attrs = workload["main"].attrs
        pattern = get_pattern(str(attrs[PATTERN_ATTR])) if attrs and PATTERN_ATTR in attrs else None
        templates = pattern.templates_for(target) if pattern else []
        tasks.append(Task(extracted.task_name, workload, templates, weight=float(extracted.weight),
                          space=space if templates else "generic"))
    return tasks
