"""Tuning a model: its kernels after fusion become MetaSchedule tasks sharing one budget by weight
(how often each kernel runs); pattern kernels search their templates too, and every other kernel
the default rule that schedules it untuned (``verify.untuned``), so its search starts from, and
never ends behind, the schedule it would run without records."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..pattern import DLIGHT
from ..registry import get_pattern
from ..tune import Task
from ..verify import untuned, untuned_rules
from .fusion import PATTERN_ATTR


def model_tasks(fused_mod, target: Target, space: str) -> list[Task]:
    tasks = []
    for extracted in ms.relax_integration.extract_tasks(fused_mod, target):
        workload = extracted.dispatched[0]
        attrs = workload["main"].attrs
        pattern = get_pattern(str(attrs[PATTERN_ATTR])) if attrs and PATTERN_ATTR in attrs else None
        templates = pattern.templates_for(target) if pattern else _default_rule(workload["main"], target)
        tasks.append(Task(extracted.task_name, workload, templates, weight=float(extracted.weight),
                          space=space if templates else "generic"))
    return tasks


def _default_rule(func, target: Target) -> list:
    """The rule ``verify.untuned`` schedules ``func`` with, as a template; none where that is
    dlight or TVM's stock schedule (GPU targets, kernels no rule describes)."""
    name = untuned(func, target)[1]
    return [rule for rule in untuned_rules(target) if rule.name == name and rule is not DLIGHT][:1]
