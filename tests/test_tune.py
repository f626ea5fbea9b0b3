"""A tiny tuning run writes a database plain MetaSchedule reads; a rerun resumes it."""

import json
import logging
import os

import pytest

from tvm.s_tir import meta_schedule as ms

from autofuse.database import RECORDS, WORKLOADS, TuningDatabase
from autofuse.errors import AutofuseError
from autofuse.registry import get_pattern
from autofuse.target import parse_target, target_key
from conftest import run_cli


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_database_is_plain_metaschedule_json(tuned_db):
    root, _ = tuned_db
    folder = root / target_key(parse_target("llvm"))
    db = ms.database.JSONDatabase(path_workload=str(folder / WORKLOADS), path_tuning_record=str(folder / RECORDS))
    records = db.get_all_tuning_records()
    assert len(records) >= 8
    assert any(r.run_secs and float(r.run_secs[0]) < 1e9 for r in records)
    pattern = get_pattern("linear_bias_relu")
    func = pattern.build(pattern.small_shape(), "float32")
    ours = TuningDatabase(str(root), parse_target("llvm"))
    assert ours.records(func), "the tuned workload must be found again from its PrimFunc"
    sch = ms.tir_integration.compile_tir(db, func, parse_target("llvm"))
    assert sch is not None


def test_rerun_resumes_and_adds_trials(tuned_db, tmp_path):
    root, _ = tuned_db
    folder = root / target_key(parse_target("llvm"))
    copy = tmp_path / "db"
    (copy / folder.name).mkdir(parents=True)
    for name in (WORKLOADS, RECORDS):
        (copy / folder.name / name).write_text((folder / name).read_text())
    before = _records(copy / folder.name / RECORDS)
    result = run_cli("tune", "--pattern", "linear_bias_relu", "--small", "--trials", "4", "--seed", "2",
                     "--db", str(copy), "--no-progress", "--space", "template")
    assert result.returncode == 0, result.stderr[-3000:]
    after = _records(copy / folder.name / RECORDS)
    assert after[:len(before)] == before, "earlier records must be kept as they were"
    assert len(after) == len(before) + 4
    assert len(_records(copy / folder.name / WORKLOADS)) == 1, "same workload, not a new one"


def test_spaces_produce_their_own_records(tmp_path):
    from autofuse.tune import Task, tune
    from autofuse.database import record_source

    target = parse_target("llvm")
    pattern = get_pattern("linear_bias_relu")
    func = pattern.build(pattern.small_shape(), "float32")
    db = TuningDatabase(str(tmp_path), target)
    stats = tune([Task("lbr", func, pattern.templates)], target, db.ms, db.work_dir, trials_per_task=4,
                 space="generic", seed=3)
    assert stats.total_trials == 4
    sources = {record_source(r.trace) for r in db.ms.get_all_tuning_records()}
    assert sources == {"generic"}
    tune([Task("lbr", func, pattern.templates)], target, db.ms, db.work_dir, trials_per_task=4,
         space="template", seed=3)
    sources = {record_source(r.trace) for r in db.ms.get_all_tuning_records()}
    cpu_templates = {f"template:{t.name}" for t in pattern.templates if t.applies_to(target)}
    assert "generic" in sources and sources - {"generic"} and sources - {"generic"} <= cpu_templates


def test_several_patterns_tune_in_one_session(tmp_path):
    """One pattern per kind of template (GEMM epilogue, online softmax, integer outputs, MoE
    routing), one trial each, in one process: search, build, run, check and choose for every one.
    That each template's samples survive MetaSchedule's postprocessors is checked for every
    pattern in tests/search_spaces/test_patterns.py, far faster than tuning them all."""
    names = ["linear_bias_relu", "flash_attention", "spec_accept", "moe_gate_topk"]
    result = run_cli("tune", "--pattern", ",".join(names), "--small", "--trials", "1", "--db", str(tmp_path),
                     "--no-progress", "--space", "template", "--seed", "5")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = result.stdout
    for name in names:
        line = next(l for l in table.splitlines() if l.startswith(name))
        assert "template:" in line or "template-default" in line, line
    assert f"{len(names)} trials" in table


def test_a_record_slower_than_the_template_default_is_not_what_runs(tmp_path):
    """A short search can leave only records worse than the template's default knobs: the
    tune table and compare then run the default, and say so."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from autofuse.database import TuningDatabase
    from autofuse.registry import get_pattern
    from autofuse.target import parse_target
    from autofuse.tune_patterns import Job
    from autofuse.verify import choose

    target = parse_target("llvm")
    pattern = get_pattern("linear_bias_relu")
    job = Job(pattern, {"m": 128, "n": 128, "k": 128}, "float32")
    db = TuningDatabase(str(tmp_path), target)
    # The unscheduled kernel as a record claiming 1 ns: first by the database's ordering, slow in fact.
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod
    workload = db.ms.commit_workload(_normalize_mod(job.func))
    sch = tvm.s_tir.Schedule(job.func)
    sch.get_sblock("matmul")  # the database ignores records with an empty trace
    db.ms.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, workload, [1e-9], target, ms.arg_info.ArgInfo.from_prim_func(job.func)))
    assert len(db.records(job.func)) == 1
    choice, rejected = choose(job, db, target, tvm.cpu(), repeat=3)
    assert rejected == [] and choice.source == "template-default"
    assert choice.record_secs > choice.secs
    # Without the default (how the generic space is measured) the record is what runs, untimed:
    # there is nothing to choose between.
    generic, _ = choose(job, db, target, tvm.cpu(), repeat=3, defaults=False)
    assert generic.is_record and generic.source == "generic" and generic.secs is None


def _add_one():
    """A kernel every space schedules and every build runs: b = a + 1 over 64 values."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def add_one(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("b"):
                vi = T.axis.spatial(64, i)
                b[vi] = a[vi] + T.float32(1)

    return add_one


def test_a_shared_budget_measures_each_batch_before_building_the_next(tmp_path, monkeypatch):
    """A model's kernels share one budget (the gradient task scheduler). MetaSchedule's own built
    the first batch of every kernel before it measured any, so a model's first result came a
    minute in; ours measures each batch first, and still spends the whole budget on all tasks."""
    from autofuse import tune as tuning

    built, at_first_result = [], []
    builder = tuning.PooledBuilder._cls  # the Python class under TVM's derived object
    build = builder.build
    monkeypatch.setattr(builder, "build", lambda self, inputs: built.append(len(inputs)) or build(self, inputs))

    def progress(stats, task_id):
        if not at_first_result:
            at_first_result.append(len(built))

    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    gemm = get_pattern("linear_bias_relu")
    tasks = [tuning.Task(f"gemm{n}", gemm.build({"m": n, "n": n, "k": n}, "float32"), weight=w)
             for n, w in ((16, 1.0), (32, 2.0), (48, 1.0))]
    stats = tuning.tune(tasks, target, db.ms, db.work_dir, trials_per_task=4, trials_total=6, space="generic",
                        seed=0, num_trials_per_iter=1, on_progress=progress)
    assert at_first_result == [1]
    assert stats.total_trials == 6 and set(stats.trials) == {0, 1, 2}


def test_tvms_native_warnings_go_to_the_log_and_the_progress_bar_stays(tmp_path):
    """topi's pooling kernels name a schedule rule MetaSchedule's CPU rules lack, and TVM's C++
    logs a warning for it on fd 2 in every pooled model's tune: it goes to the session's log,
    while the progress bar (Python's stderr) still reaches the terminal."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], "pool",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "pool.onnx")
    result = run_cli("tune", str(tmp_path / "pool.onnx"), "--trials", "2", "--db", str(tmp_path / "db"), "--seed", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Unknown schedule rule" not in result.stderr
    assert "measuring" in result.stderr and "best " in result.stderr  # the bar, live during the search
    logs = list((tmp_path / "db").rglob("console.log"))
    assert any("Unknown schedule rule" in log.read_text() for log in logs)


def test_candidates_that_crash_or_hang_are_stored_failed_and_tuning_goes_on(tmp_path):
    """A kernel that segfaults its runner and one that never ends: both are recorded as failed
    trials, and the healthy task in the same session still gets valid records."""
    from tvm.script import tirx as T

    from autofuse.tune import Task, tune

    healthy = _add_one()

    @T.prim_func(s_tir=True)
    def crashes(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("b"):
                vi = T.axis.spatial(64, i)
                b[vi * 100000000 + 100000000] = a[vi]  # far outside b: the runner process dies

    @T.prim_func(s_tir=True)
    def hangs(a: T.Buffer((1,), "float32"), b: T.Buffer((1,), "float32")):
        # 1e10 dependent square roots, which no schedule or compiler can shorten: far past 3 s.
        for k0, k1 in T.grid(100000, 100000):
            with T.sblock("b"):
                vk0, vk1 = T.axis.remap("RR", [k0, k1])
                with T.init():
                    b[0] = T.float32(0)
                b[0] = T.sqrt(b[0] + a[0])

    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    tasks = [Task("crashes", crashes), Task("hangs", hangs), Task("healthy", healthy)]
    stats = tune(tasks, target, db.ms, db.work_dir, trials_per_task=2, space="generic", seed=0, run_timeout=3)
    assert stats.trials.get(0, 0) >= 1 and stats.failed.get(0) == stats.trials[0]
    assert stats.trials.get(1, 0) >= 1 and stats.failed.get(1) == stats.trials[1]
    assert stats.trials.get(2, 0) >= 1 and not stats.failed.get(2)
    assert db.count(healthy)[0] >= 1
    for func in (crashes, hangs):
        valid, total = db.count(func)
        assert valid == 0 and total >= 1


def test_a_kernel_that_indexes_with_an_input_is_measured(tmp_path):
    """An embedding lookup (take) tuned as a model's kernel: the runner fills its int64 ids with
    valid indices, so its candidates run and are stored valid. With MetaSchedule's random fill
    (float bit patterns, 4.6e18 as int64) every candidate read far past the table and crashed
    its runner."""
    import numpy as np
    import tvm

    from autofuse.tune import Task, alloc_arguments, tune
    from index_kernels import take

    (table, ids, out), = alloc_arguments(tvm.cpu(), [("TENSOR", "float32", [64, 16]), ("TENSOR", "int64", [32]),
                                                     ("TENSOR", "float32", [32, 16])], 1)
    assert (ids.numpy() == 0).all() and len(np.unique(table.numpy())) > 1  # floats keep their random data

    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    stats = tune([Task("take", take)], target, db.ms, db.work_dir, trials_per_task=2, space="generic", seed=0,
                 run_timeout=10)
    assert stats.trials.get(0, 0) >= 1 and not stats.failed.get(0), stats
    valid, total = db.count(take)
    assert total >= 1 and valid == total


def test_a_template_that_computes_wrong_is_tuned_but_never_chosen(tmp_path):
    """An injected bug: a template that stages the weights through a float16 copy. Its candidates
    build, run and are stored, but neither they nor its defaults ever pass the reference check."""
    import dataclasses

    import tvm

    from autofuse.pattern import template
    from autofuse.tune_patterns import Job, tune_jobs
    from autofuse.verify import choose

    @template("fp16_weights")
    def fp16_weights(sch, target, knobs):
        mm = sch.get_sblock("matmul")
        i, j, k = sch.get_loops(mm)
        _, k1 = sch.split(k, knobs.tile(k, 2, [16]))
        sch.unroll(k1)
        staged = sch.cache_read(mm, 1, "global")
        sch.unsafe_set_dtype(staged, 0, "float16")  # the bug: the weights lose precision

    pattern = dataclasses.replace(get_pattern("linear_bias_relu"), templates=[fp16_weights])
    job = Job(pattern, {"m": 32, "n": 32, "k": 256}, "float32")
    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    rows, _ = tune_jobs([job], target, db, trials=4, space="template", seed=0, progress=False)
    assert db.count(job.func)[0] >= 1  # the wrong candidates were measured and kept as history
    assert rows[0]["best_ms"] is None and rows[0]["source"] is None
    assert any("failed the numerical check" in line for line in rows[0]["rejected"])
    choice, rejected = choose(job, db, target, tvm.cpu())
    assert choice is None and any("template default failed" in line for line in rejected)


def test_a_generic_space_that_fails_on_the_tensorir_leaves_the_templates_tuning(caplog):
    """MetaSchedule's default rules raise a ScheduleError on flash_attention's running-state
    blocks; the session must tune its templates instead of dying before its first trial."""
    import logging

    from tvm.s_tir import meta_schedule as ms

    from autofuse.errors import AutofuseError
    from autofuse.registry import get_pattern
    from autofuse.target import parse_target
    from autofuse.tune import Task, _context, register_tensor_intrinsics

    target = parse_target("llvm")
    register_tensor_intrinsics(target)
    pattern = get_pattern("flash_attention")
    func = pattern.build(pattern.default_shape(), "float32")
    logger = ms.logging.get_logger("autofuse-test")
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        context = _context(Task("flash", func, pattern.templates), "union", target, logger, 1)
    assert "generic rules fail" in caplog.text
    assert isinstance(context.space_generator, ms.space_generator.ScheduleFn)
    assert len(context.generate_design_space()) == 1
    with pytest.raises(AutofuseError, match="generic space fails"):
        _context(Task("flash", func, pattern.templates), "generic", target, logger, 1)


def test_a_kernel_the_generic_space_cannot_schedule_is_left_out_of_a_model_session(tmp_path, caplog):
    """tvm-auto over a model: MetaSchedule's generic rules fail on one kernel (flash_attention's
    online softmax here; fused_matmul1_where2_add4 of the BERT export in real_models). That kernel
    keeps its default, the others are tuned, and the statistics keep the caller's task indices."""
    from autofuse.registry import get_pattern
    from autofuse.tune import Task, tune

    healthy = _add_one()
    pattern = get_pattern("flash_attention")
    attention = pattern.build(pattern.default_shape(), "float32")
    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        stats = tune([Task("attention", attention), Task("healthy", healthy)], target, db.ms, db.work_dir,
                     trials_per_task=2, space="generic", seed=0)
    assert list(stats.skipped) == [0] and "generic space fails on attention" in stats.skipped[0]
    assert "keeps its default schedule" in caplog.text
    assert stats.trials.get(1, 0) >= 1 and 0 not in stats.trials
    assert db.count(healthy)[0] >= 1 and db.count(attention)[1] == 0
    with pytest.raises(AutofuseError, match="generic space fails"):  # alone, nothing is left to tune
        tune([Task("attention", attention)], target, db.ms, db.work_dir, trials_per_task=2, space="generic")


def test_the_union_space_measures_both_arms_in_every_batch():
    """Each arm of the union has its own evolutionary search and half of every batch: one search
    over both let a cost model trained on one arm's first records rank the other out. The
    templates' untuned defaults are the first batch, alone, so that it is measured at once."""
    from autofuse.database import record_source
    from autofuse.tune import Task, _context

    target = parse_target("llvm")
    pattern = get_pattern("linear_bias_relu")
    func = pattern.build(pattern.small_shape(), "float32")
    context = _context(Task("lbr", func, pattern.templates), "union", target, ms.logging.get_logger("autofuse-test"), 1)
    strategy = context.search_strategy
    assert not isinstance(strategy, ms.search_strategy.EvolutionarySearch), "autofuse.tune.ArmsSearch"
    strategy.pre_tuning(14, 8, context.generate_design_space(), ms.database.MemoryDatabase(),
                        ms.cost_model.RandomModel())
    batches = []
    while (batch := strategy.generate_measure_candidates()) is not None:
        batches.append(batch)
        strategy.notify_runner_results(batch, [ms.runner.RunnerResult([1e-3 * (n + 1)], None)
                                               for n in range(len(batch))])
    strategy.post_tuning()
    assert sum(map(len, batches)) == 14, "the budget, all of it and no more"
    defaults = [t.name for t in pattern.templates_for(target)]
    assert [record_source(c.sch.trace) for c in batches[0]] == [f"template:{n}" for n in defaults]
    assert not any("Sample" in inst.kind.name for c in batches[0] for inst in c.sch.trace.insts)
    arms = [record_source(c.sch.trace).split(":")[0] for c in batches[1]]
    assert sorted(arms) == ["generic"] * 4 + ["template"] * 4
    # The template space alone measures its defaults first too; the generic space keeps
    # MetaSchedule's one evolutionary search.
    alone = _context(Task("lbr", func, pattern.templates), "template", target, ms.logging.get_logger("autofuse-test"), 1)
    assert not isinstance(alone.search_strategy, ms.search_strategy.EvolutionarySearch)
    generic = _context(Task("lbr", func, pattern.templates), "generic", target, ms.logging.get_logger("autofuse-test"), 1)
    assert isinstance(generic.search_strategy, ms.search_strategy.EvolutionarySearch)


def test_the_union_measures_every_template_default_first():
    """Each template default becomes a measure candidate, replayed from its trace: TVM 0.27's
    Schedule.copy fails on int8_matmul_dequant's vnni default, which had ended its union search."""
    import types

    import tvm
    from autofuse.tune import ArmsSearch, template_defaults

    target = parse_target("llvm")
    pattern = get_pattern("int8_matmul_dequant")
    func = pattern.build(pattern.resolve_shape({}), pattern.dtypes[0])
    seeds = template_defaults(pattern.templates_for(target, func), func, target)
    search = ArmsSearch(seeds)
    search.context = types.SimpleNamespace(mod=tvm.IRModule({"main": func}),
                                           space_generator=types.SimpleNamespace(postprocs=[]))
    candidates = [search._candidate(seed) for seed in seeds]
    assert len(seeds) >= 2 and all(c is not None for c in candidates)
    assert [str(c.sch.trace) for c in candidates] == [str(s.trace) for s in seeds]


def _build_processes(builder) -> set:
    return {worker._proc.pid for worker in builder._pool._worker_map.values() if worker._proc is not None}


@pytest.mark.parametrize("uses, same", [(64, True), (1, False)])
def test_the_builder_keeps_its_processes_across_batches_until_their_uses_run_out(uses, same):
    """One pool for the session: the second batch is built by the processes of the first (no new
    process importing TVM); with one use per process, by fresh ones."""
    import tvm
    from tvm.script import tirx as T

    from autofuse.tune import PooledBuilder, fast_build

    @T.prim_func(s_tir=True)
    def add_one(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("b"):
                vi = T.axis.remap("S", [i])
                b[vi] = a[vi] + T.float32(1)

    target = parse_target("llvm")
    builder = PooledBuilder(f_build=fast_build, max_workers=1, uses_per_process=uses)
    try:
        batch = [ms.builder.BuilderInput(tvm.IRModule({"main": add_one}), target)]
        first = builder.build(batch)
        before = _build_processes(builder)
        second = builder.build(batch)
        after = _build_processes(builder)
    finally:
        builder.shutdown()
    assert [r.error_msg for r in first + second] == [None, None]
    assert len(before) == 1 and (before == after) is same
