"""Tuning: a list of tasks (PrimFunc + templates + budget) searched by MetaSchedule into a database.

Spaces: ``template`` (our hand-designed templates, AutoTVM-style), ``generic`` (MetaSchedule's
default rules, the Ansor-style sketch space), ``union`` (both). Search is evolutionary with the
XGBoost cost model in every space, so spaces compare at equal budgets. In the union each arm has
an evolutionary search of its own and every measured batch is split between them
(``ArmsSearch``): one search over both let the cost model, trained on the first template
records, rank the generic arm's candidates out of every batch. All tasks run in one MetaSchedule
session, so the process start-up cost is paid once; a model's kernels share its budget through
``_GradientScheduler``, which measures each batch before the next kernel's search.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import tvm.s_tir
from tvm import IRModule, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.target import Target

from .database import record_source, replay
from .errors import AutofuseError
from .measure import is_integer
from .pattern import Template
from .store import FAILED_RUN_SECS
from .target import use_host_cores

SPACES = ("template", "generic", "union")


@dataclasses.dataclass
class Task:
    """One workload to tune: a PrimFunc, the templates that apply to it, and its label."""

    name: str
    func: tirx.PrimFunc | IRModule
    templates: Sequence[Template] = ()
    weight: float = 1.0
    # Overrides the session's space; a model's kernels without templates use "generic".
    space: str | None = None


@dataclasses.dataclass
class TuneStats:
    """What a tuning session did, per task index and overall."""

    trials: dict[int, int] = dataclasses.field(default_factory=dict)
    failed: dict[int, int] = dataclasses.field(default_factory=dict)
    best_secs: dict[int, float] = dataclasses.field(default_factory=dict)
    # Wall time between measure callbacks, charged to the task whose batch just finished.
    task_secs: dict[int, float] = dataclasses.field(default_factory=dict)
    # (seconds since start, task index, latency) of every valid measurement, in order.
    history: list[tuple[float, int, float]] = dataclasses.field(default_factory=list)
    start_secs: float = 0.0
    first_trial_secs: float | None = None
    total_secs: float = 0.0
    # Tasks left out of a session of several (index -> why): MetaSchedule's generic space cannot
    # schedule them, so they keep their default schedule.
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def total_trials(self) -> int:
        return sum(self.trials.values())

    first_batch_trials: int = 0

    def trials_per_minute(self) -> float:
        """Whole session, start-up included."""
        return 60.0 * self.total_trials / self.total_secs if self.total_secs > 0 else 0.0

    def steady_trials_per_minute(self) -> float | None:
        """After the first batch, i.e. without the start-up; None with a single batch."""
        if self.first_trial_secs is None or self.total_trials <= self.first_batch_trials:
            return None
        secs = self.total_secs - self.first_trial_secs
        return 60.0 * (self.total_trials - self.first_batch_trials) / secs if secs > 0 else None


ProgressFn = Callable[[TuneStats, int], None]


def make_space(templates: Sequence[Template], space: str, target: Target) -> ms.space_generator.SpaceGenerator:
    """The MetaSchedule design-space generator for ``space`` over these templates."""
    if space not in SPACES:
        raise AutofuseError(f"unknown space {space!r}: use one of {', '.join(SPACES)}")
    usable = [t for t in templates if t.applies_to(target)]
    template_spaces = [ms.space_generator.ScheduleFn(_as_schedule_fn(t, target)) for t in usable]
    generic = ms.space_generator.PostOrderApply()
    if space == "generic":
        return generic
    if not template_spaces:
        if space == "template":
            raise AutofuseError(f"no template applies on target {target.kind.name!r}: use --space generic")
        return generic
    if space == "template":
        if len(template_spaces) == 1:
            return template_spaces[0]
        return ms.space_generator.SpaceGeneratorUnion(template_spaces)
    return ms.space_generator.SpaceGeneratorUnion(template_spaces + [generic])


def _as_schedule_fn(template: Template, target: Target):
    def schedule_fn(sch):
        template.schedule(sch, target, tunable=True)
        return [sch]
    return schedule_fn


@derived_object
class ArmsSearch(ms.search_strategy.PySearchStrategy):
    """The union space searched arm by arm: the template spaces and the generic sketches each get
    an evolutionary search of their own (half the population each), and every measured batch
    takes half its candidates from each. Both draw on the same database (each arm's population
    starts from the best records of either) and cost model. An arm that has nothing left to
    propose leaves the rest of the budget to the other. ``seeds`` (the templates' untuned
    defaults) are the first batch, so that the union ends no worse than them and both arms start
    from them."""

    def __init__(self, seeds=()):
        base = ms.search_strategy.SearchStrategy.create("evolutionary")
        self.population = max(16, int(base.population_size) // 2)
        self.seeds = list(seeds)
        self.pending: list = []
        self.arms: list = []
        self.owners: list[int] = []
        self.done: set[int] = set()
        self.max_trials = 0
        self.measured = 0
        self.context = None

    def _new_arm(self):
        arm = ms.search_strategy.EvolutionarySearch(population_size=self.population)
        arm._initialize_with_tune_context(self.context)
        return arm

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context

    def _candidate(self, sch):
        """``sch`` after the postprocessors every sample gets, as a measure candidate; None when
        one refuses it. Replayed from its trace onto the task's module: TVM 0.27's Schedule.copy
        fails (unordered_map::at) on some schedules, int8_matmul_dequant's vnni default among them."""
        replayed = tvm.s_tir.Schedule(self.context.mod)
        try:
            replay(sch.trace, replayed, remove_postproc=True)
        except Exception:  # a seed that does not replay is not measured (the arms still search)
            return None
        sch = replayed
        if not all(post.apply(sch) for post in self.context.space_generator.postprocs):
            return None
        return ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True))

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        groups = [[s for s in design_spaces if record_source(s.trace) != "generic"],
                  [s for s in design_spaces if record_source(s.trace) == "generic"]]
        groups = [g for g in groups if g]
        self.arms = [self._new_arm() for _ in groups]
        self.max_trials, self.measured, self.done = int(max_trials), 0, set()
        self.pending = [c for c in map(self._candidate, self.seeds) if c is not None]
        share = max(1, -(-int(num_trials_per_iter) // len(groups)))
        for arm, spaces in zip(self.arms, groups):
            # Each arm may take the whole budget; this search stops at max_trials in all.
            arm.pre_tuning(max_trials, share, spaces, database, cost_model)

    def post_tuning(self) -> None:
        for arm in self.arms:
            arm.post_tuning()

    def generate_measure_candidates(self):
        left = self.max_trials - self.measured
        if left <= 0:
            return None
        if self.pending:
            # The seeds alone: measured while nothing has been bred yet, they are the first
            # trial within seconds, and the arms' first populations start from their records.
            candidates, self.pending = self.pending[:left], []
            self.owners = [-1] * len(candidates)
            return candidates
        candidates, self.owners = [], []
        for index, arm in enumerate(self.arms):
            if index in self.done or len(candidates) >= left:
                continue
            batch = arm.generate_measure_candidates()
            if batch is None:
                self.done.add(index)
                continue
            batch = list(batch)[:left - len(candidates)]
            candidates += batch
            self.owners += [index] * len(batch)
        return candidates or None

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.measured += len(results)
        for index, arm in enumerate(self.arms):
            mine = [n for n, owner in enumerate(self.owners) if owner == index]
            if mine:
                arm.notify_runner_results([measure_candidates[n] for n in mine], [results[n] for n in mine])

    def clone(self):
        return ArmsSearch(self.seeds)


def template_defaults(templates: Sequence[Template], func, target: Target) -> list:
    """The untuned schedule of each template that applies (one that fails at this shape is left
    out, as ``verify`` leaves it out of the defaults)."""
    seeds = []
    for template in templates:
        try:
            prim = func if isinstance(func, tirx.PrimFunc) else list(func.functions.values())[0]
            sch = template.apply(prim, target, tunable=False)
        except Exception:  # a template that does not fit this shape: no seed from it
            continue
        if sch is not None:
            seeds.append(sch)
    return seeds


def fast_build(mod, target, _params):
    """MetaSchedule's default build first imports every tensor intrinsic (~1 min on 2 cores), longer
    than the builder's timeout; build without that import (the tuning process registers what the
    target needs, and the scheduled IR is already tensorized). The math as builds make it
    (``verify.build_kernel``), so a candidate is timed as it will run."""
    from .verify import build_kernel
    return build_kernel(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target)


def alloc_arguments(device, args_info, alloc_repeat: int, f_random_fill=None) -> list:
    """The runner's arguments for a candidate (MetaSchedule's ``f_alloc_argument``): random data
    as MetaSchedule fills them (``tvm.contrib.random.random_fill_for_measure``), except integer
    tensors, which are zeros. The runner knows only shapes and dtypes, and its random integers are
    float bit patterns (4.6e18 for int64): as the indices of an embedding lookup (``take``,
    ``gather_nd``) every candidate read far outside its table, crashed its runner and was stored
    failed. Zero is a valid index into any axis."""
    import numpy as np
    import tvm

    if f_random_fill is None:
        f_random_fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure")
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for kind, dtype, shape in args_info:
            if kind != "TENSOR":
                raise NotImplementedError(f"runner argument of kind {kind!r}")
            arg = tvm.runtime.empty(shape=shape, dtype=dtype, device=device)
            if is_integer(dtype):
                arg.copyfrom(np.zeros([int(d) for d in shape], dtype=str(dtype)))
            else:
                f_random_fill(arg)
            args.append(arg)
        repeated.append(args)
    return repeated


def local_runner(timeout_sec: float) -> ms.runner.LocalRunner:
    """MetaSchedule's LocalRunner with ``alloc_arguments``."""
    return ms.runner.LocalRunner(timeout_sec=timeout_sec, f_alloc_argument=alloc_arguments)


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder with one pool of build processes for the whole session.

    LocalBuilder starts a fresh pool for every batch of candidates (and one more to check its build
    functions), and each new process imports TVM and autofuse first, about 5 s of CPU: on 2 cores
    most of the wall time of a batch, and of the wait for the first measured trial. Here the
    processes start once, when the builder is made, and import while the search breeds its first
    candidates; each builds ``uses_per_process`` candidates, then a fresh one takes its place (the
    reason LocalBuilder gives for restarting is a slow leak in long-lived workers). The builds are
    LocalBuilder's own worker function, so what is built and its errors are the same."""

    def __init__(self, *, f_build, max_workers: int | None = None, timeout_sec: float = 30.0,
                 uses_per_process: int = 64):
        super().__init__()
        from tvm.support.popen_pool import PopenPoolExecutor

        self.max_workers = max_workers or ms.utils.cpu_count(logical=True)
        self.timeout_sec = timeout_sec
        self.f_build = f_build
        self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=timeout_sec,
                                       maximum_process_uses=uses_per_process)
        # One call per process starts them all now (each submission waits for a free process).
        self._warming = [self._pool.submit(_import_autofuse) for _ in range(self.max_workers)]

    def build(self, build_inputs: list) -> list:
        from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
        from tvm.support.popen_pool import StatusKind

        results = []
        jobs = [(self.f_build, None, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs]
        for done in self._pool.map_with_error_catching(lambda job: _worker_func(*job), jobs):
            if done.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(done.value, None))
            elif done.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, f"LocalBuilder: An exception occurred\n{done.value}"))
        return results

    def shutdown(self) -> None:
        self._pool.shutdown()


def _import_autofuse() -> None:
    # A build process's first job: what every build imports (fast_build's verify, TVM's build).
    importlib.import_module("autofuse.verify")


_INTRIN_PACKAGE = "tvm.s_tir.tensor_intrin"
_INTRIN_MODULES = {"llvm": ("x86", "arm_cpu")}


def register_tensor_intrinsics(target: Target) -> float:
    """Register the tensor intrinsics ``target`` can use; returns the seconds it took.

    ``TuneContext`` imports all of ``tvm.s_tir.tensor_intrin`` (CUDA, ROCm, Hexagon, ...: 25-60 s on
    2 cores, most of it the CUDA set) before any trial. A CPU target can only tensorize with the x86
    and Arm intrinsics, so for llvm we load the package without its ``__init__`` and import just
    those; ``TuneContext``'s own import then finds the package loaded. Other targets get it all.
    """
    start = time.perf_counter()
    modules = _INTRIN_MODULES.get(target.kind.name)
    if modules is None:
        importlib.import_module(_INTRIN_PACKAGE)
    else:
        if _INTRIN_PACKAGE not in sys.modules:
            spec = importlib.util.find_spec(_INTRIN_PACKAGE)
            package = importlib.util.module_from_spec(spec)
            sys.modules[_INTRIN_PACKAGE] = package
            tvm.s_tir.tensor_intrin = package
        for name in modules:
            importlib.import_module(f"{_INTRIN_PACKAGE}.{name}")
    return time.perf_counter() - start


@derived_object
class _ProgressCallback(ms.measure_callback.PyMeasureCallback):
    def __init__(self, stats: TuneStats, on_progress: ProgressFn | None, task_ids: Sequence[int]):
        self.stats = stats
        self.on_progress = on_progress
        self.last_secs = 0.0
        self.task_ids = list(task_ids)  # MetaSchedule's task index -> the caller's

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        stats = self.stats
        task_id = self.task_ids[task_id]
        now = time.perf_counter() - stats.start_secs
        if stats.first_trial_secs is None:
            stats.first_trial_secs = now
            stats.first_batch_trials = len(runner_results)
        stats.task_secs[task_id] = stats.task_secs.get(task_id, 0.0) + now - self.last_secs
        self.last_secs = now
        for build, run in zip(builder_results, runner_results):
            stats.trials[task_id] = stats.trials.get(task_id, 0) + 1
            secs = _mean_secs(run.run_secs) if build.error_msg is None and run.error_msg is None else None
            if secs is None or secs >= FAILED_RUN_SECS:
                stats.failed[task_id] = stats.failed.get(task_id, 0) + 1
                continue
            stats.history.append((now, task_id, secs))
            if secs < stats.best_secs.get(task_id, float("inf")):
                stats.best_secs[task_id] = secs
        if self.on_progress is not None:
            self.on_progress(stats, task_id)


@derived_object
class _GradientScheduler(ms.task_scheduler.PyTaskScheduler):
    """MetaSchedule's gradient task scheduler (Ansor's: after one batch of every task, the task
    whose weight x (alpha x its recent gain + (1 - alpha) x best / batches) is largest goes next),
    except that each batch is measured before the next task's candidates are searched and built.
    TVM's searches and builds the first batch of every task before it measures any, so a model's
    first result came a minute or more in, and a batch timed while the next search ran shared
    the cores with it."""

    def __init__(self, alpha: float = 0.2, window: int = 3, seed: int | None = None):
        super().__init__()
        self.alpha, self.window = alpha, window
        self.rng = random.Random(seed)
        self.history: list[list[float]] = []  # best ms of each task after each of its batches
        self.warmup = 0                        # tasks given their first batch
        self.last: int | None = None

    def next_task_id(self) -> int:
        outer = self._outer()
        records = outer.tasks_
        if not self.history:
            self.history = [[] for _ in records]
        if self.last is not None and records[self.last].runner_futures is not None:
            history = self.history[self.last]
            best = history[-1] if history else 1e100  # finite: no inf - inf in a never-timed task's gain
            for result in outer.join_running_task(self.last):
                if result.error_msg is None and result.run_secs:
                    secs = sorted(float(x) for x in result.run_secs)[len(result.run_secs) // 2]
                    best = min(best, secs * 1e3)
            history.append(best)
        while self.warmup < len(records):
            self.warmup += 1
            if not records[self.warmup - 1].is_terminated:
                self.last = self.warmup - 1
                return self.last
        alive = [i for i, record in enumerate(records) if not record.is_terminated and self.history[i]]
        if not alive:
            return -1
        grads = []
        for i in alive:
            history, w = self.history[i], self.window
            best = history[-1]
            recent = (history[-1 - w] - best) / w if len(history) > w else 0.0
            grads.append((self.alpha * recent + (1 - self.alpha) * best / len(history)) * float(records[i].task_weight))
        top = max(grads)
        self.last = alive[grads.index(top)] if top != min(grads) else self.rng.choice(alive)
        return self.last


def _mean_secs(run_secs) -> float | None:
    if not run_secs:
        return None
    values = [float(s) for s in run_secs]
    return sum(values) / len(values)


def tune(tasks: Sequence[Task], target: Target, database: ms.database.Database, work_dir: str, *,
         trials_per_task: int, trials_total: int | None = None, space: str = "union", seed: int | None = None,
         num_trials_per_iter: int = 8, cost_model_path: str | None = None,
         runner: ms.runner.Runner | None = None, run_timeout: float = 30.0,
         on_progress: ProgressFn | None = None,
         on_phase: Callable[[str], None] | None = None) -> TuneStats:
    """Tune every task for ``trials_per_task`` more trials into ``database``; with
    ``trials_total``, the tasks share that budget instead, by weight (MetaSchedule's gradient
    task scheduler), as the kernels of one model do.

    Records already in ``database`` seed the evolutionary search, so a rerun continues from them.
    A candidate that crashes its runner or runs past ``run_timeout`` seconds is stored as failed
    (run time 1e10) and the search goes on.
    MetaSchedule's logs go to ``work_dir/logs``; nothing of it reaches the terminal.
    """
    if trials_per_task <= 0 or (trials_total is not None and trials_total <= 0):
        raise AutofuseError("--trials must be a positive integer")
    if not tasks:
        return TuneStats()
    stats = TuneStats(start_secs=time.perf_counter())
    phase = on_phase or (lambda _msg: None)
    if target.kind.name == "llvm":
        use_host_cores()  # the runner's processes time candidates on the cores compare will use
    phase("registering tensor intrinsics")
    register_tensor_intrinsics(target)
    os.makedirs(work_dir, exist_ok=True)
    cost_model = _load_cost_model(cost_model_path)
    with _quiet_metaschedule(work_dir), _native_stderr_to(os.path.join(work_dir, "logs", "console.log")):
        loggers = ms.logging.get_loggers_from_work_dir(work_dir, [t.name for t in tasks])
        seeds = ms.utils.fork_seed(seed, n=len(tasks))
        contexts, kept = [], []
        phase("generating design spaces")
        for index, (task, logger, rand_state) in enumerate(zip(tasks, loggers, seeds)):
            try:
                contexts.append(_context(task, task.space or space, target, logger, rand_state))
                kept.append(index)
            except AutofuseError as err:
                # One kernel of a model that TVM's generic rules cannot schedule keeps its default;
                # the rest of the model is still tuned (a lone task has nothing else to tune).
                if len(tasks) == 1:
                    raise
                stats.skipped[index] = str(err)
                logging.getLogger("autofuse").warning("%s; it keeps its default schedule", err)
        if not contexts:
            raise AutofuseError(next(iter(stats.skipped.values())))
        phase("measuring")
        builder = PooledBuilder(f_build=fast_build)
        try:
            ms.tune.tune_tasks(
                tasks=contexts, task_weights=[tasks[i].weight for i in kept], work_dir=work_dir,
                max_trials_global=trials_total or trials_per_task * len(kept), max_trials_per_task=trials_per_task,
                num_trials_per_iter=_trials_per_round(num_trials_per_iter, trials_per_task, trials_total, len(kept)),
                builder=builder, runner=runner or local_runner(run_timeout),
                database=database, cost_model=cost_model,
                measure_callbacks=ms.measure_callback.MeasureCallback.create("default")
                + [_ProgressCallback(stats, on_progress, kept)],
                task_scheduler=_GradientScheduler(seed=seed) if trials_total else "round-robin")
        finally:
            builder.shutdown()
    if cost_model_path:
        _save_cost_model(cost_model, cost_model_path)
    stats.total_secs = time.perf_counter() - stats.start_secs
    return stats


def _context(task: Task, space: str, target: Target, logger, rand_state: int) -> ms.TuneContext:
    """The task's TuneContext; when MetaSchedule's generic rules fail on the task's TensorIR (a
    ScheduleError inside a default rule, e.g. on the running-state blocks of an online softmax),
    its templates alone, rather than a session that dies before its first trial."""
    def make(space_name):
        usable = [t for t in task.templates if t.applies_to(target)]
        strategy = (ArmsSearch(template_defaults(usable, task.func, target))
                    if space_name in ("union", "template") and usable else "evolutionary")
        return ms.TuneContext(mod=task.func, target=target, space_generator=make_space(task.templates, space_name, target),
                              search_strategy=strategy, task_name=task.name, rand_state=rand_state,
                              num_threads="physical", logger=logger).clone()

    context = make(space)
    if space == "template":
        return context
    try:
        context.generate_design_space()
    except Exception as err:  # TVM raises its own error types from C++
        if space == "generic" or not [t for t in task.templates if t.applies_to(target)]:
            raise AutofuseError(f"MetaSchedule's generic space fails on {task.name}: "
                                f"{str(err).strip().splitlines()[0]}") from None
        logging.getLogger("autofuse").warning(
            "%s: MetaSchedule's generic rules fail on this TensorIR (%s); tuning its templates only",
            task.name, str(err).strip().splitlines()[0][:200])
        return make("template")
    return context


def _trials_per_round(preferred: int, per_task: int, total: int | None, n_tasks: int) -> int:
    # The gradient scheduler gives its first rounds to the tasks one after another; a round larger
    # than the shared budget's share would spend it all on the first task and leave the rest untuned.
    share = per_task if total is None else max(1, total // n_tasks)
    return max(1, min(preferred, per_task, share))


def _load_cost_model(path: str | None) -> ms.cost_model.XGBModel:
    # MetaSchedule's default waits for 100 samples before trusting XGBoost, more than a small budget
    # has; the model saved from earlier runs on this database makes up for the lower threshold.
    model = ms.cost_model.XGBModel(num_warmup_samples=16, adaptive_training=True)
    if path and os.path.exists(path):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # xgboost guessing the format of its own file
                model.load(path)
        except Exception as err:  # a stale or truncated file only costs the warm start
            logging.getLogger("autofuse").warning("ignoring cost model %s: %s", path, err)
    return model


def _save_cost_model(model: ms.cost_model.XGBModel, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # xgboost's note about its default file format
            model.save(tmp)
        os.replace(tmp, path)
    except Exception as err:
        logging.getLogger("autofuse").warning("could not save cost model to %s: %s", path, err)
        with contextlib.suppress(OSError):
            os.remove(tmp)


@contextlib.contextmanager
def _native_stderr_to(path: str):
    """TVM's native output on fd 2 goes to ``path``: its C++ warnings (one for every pooling kernel:
    "Unknown schedule rule meta_schedule.pool_max"), the build and run processes' own. Python's
    ``sys.stderr`` (the progress bar, autofuse's warnings) stays on the terminal."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding=getattr(python_stderr, "encoding", None) or "utf-8",
                         errors="replace")
    terminal.reconfigure(write_through=True)  # the bar redraws its line with \r, never a newline
    with open(path, "a", encoding="utf-8") as sink:
        os.dup2(sink.fileno(), 2)
        # Python's own writes keep their terminal; one already redirected (a test's capture) stays.
        if _is_fd2(python_stderr):
            sys.stderr = terminal
        try:
            yield
        finally:
            sys.stderr.flush()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            terminal.close()


def _is_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _quiet_metaschedule(work_dir: str):
    """Send MetaSchedule's console output to ``work_dir/logs/console.log``; warnings included, since
    it warns for every failed candidate, which the progress bar already counts."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    old_level = ms_logger.level
    ms_logger.setLevel(logging.DEBUG)
    # MetaSchedule's logger setup configures its logger's handlers by name and fails on an unnamed
    # one (pytest's log capture, an application's own): they sit out the tuning.
    unnamed = [h for h in ms_logger.handlers if not h.get_name()]
    for handler in unnamed:
        ms_logger.removeHandler(handler)
    os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
    with open(os.path.join(work_dir, "logs", "console.log"), "a", encoding="utf-8") as sink:
        with contextlib.redirect_stdout(sink):
            try:
                yield
            finally:
                ms_logger.setLevel(old_level)
                for handler in unnamed:
                    ms_logger.addHandler(handler)
