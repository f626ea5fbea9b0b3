"""Only numerically checked records are ever chosen; verdicts are remembered."""

import os
import shutil

from autofuse.database import VERDICTS, TuningDatabase, record_secs
from autofuse.registry import get_pattern
from autofuse.target import parse_target


def _copy_without_verdicts(root, dest):
    """The shared database with no verdicts yet, so every check runs afresh."""
    src = TuningDatabase(str(root), parse_target("llvm")).path
    copy = dest / os.path.basename(src)
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(VERDICTS, "ms-logs"))
    return TuningDatabase(str(dest), parse_target("llvm"))


def _func():
    pattern = get_pattern("linear_bias_relu")
    return pattern.build(pattern.small_shape(), "float32")


def test_failing_record_is_never_chosen_and_next_best_is(tuned_db, tmp_path):
    root, _ = tuned_db
    db = _copy_without_verdicts(root, tmp_path)
    func = _func()
    ranked = db.records(func)
    assert len(ranked) >= 2
    calls = []

    def reject_fastest(sch):
        calls.append(sch)
        return (len(calls) > 1, "injected mismatch")

    chosen, rejected = db.best(func, reject_fastest)
    assert chosen is not None
    assert record_secs(chosen.record) == record_secs(ranked[1])
    assert len(rejected) == 1 and "injected mismatch" in rejected[0]

    # the verdicts persist: a new handle checks nothing again and makes the same choice
    reopened = TuningDatabase(str(tmp_path), parse_target("llvm"))
    chosen_again, rejected_again = reopened.best(func, lambda sch: (_ for _ in ()).throw(AssertionError))
    assert record_secs(chosen_again.record) == record_secs(chosen.record)
    assert len(rejected_again) == 1


def test_no_passing_record_means_no_choice(tuned_db, tmp_path):
    root, _ = tuned_db
    db = _copy_without_verdicts(root, tmp_path)
    chosen, rejected = db.best(_func(), lambda sch: (False, "always wrong"), limit=3)
    assert chosen is None and len(rejected) == 3


def test_best_of_real_tuning_passes_the_reference(tuned_db):
    import tvm
    from autofuse.tune_patterns import Job
    from autofuse.verify import checker
    root, _ = tuned_db
    target = parse_target("llvm")
    pattern = get_pattern("linear_bias_relu")
    job = Job(pattern, pattern.small_shape(), "float32")
    chosen, _ = TuningDatabase(str(root), target).best(job.func, checker(job, target, tvm.cpu()))
    assert chosen is not None
    assert chosen.source in {"generic", *(f"template:{t.name}" for t in pattern.templates)}, chosen.source


def test_history_is_in_trial_order_and_the_curve_ends_at_the_best(tuned_db):
    root, _ = tuned_db
    db = TuningDatabase(str(root), parse_target("llvm"))
    func = _func()
    history = db.history(func)
    assert len(history) == db.count(func)[1]
    assert {source for _, source in history} <= {"template", "generic"}
    curve = db.best_so_far(func)
    valid = [c for c in curve if c is not None]
    assert all(a >= b for a, b in zip(valid, valid[1:]))
    assert abs(valid[-1] - record_secs(db.records(func)[0]) * 1e3) < 1e-9


def _record_lines(folder):
    path = folder / "database_tuning_record.json"
    return path.read_bytes().split(b"\n")[:-1] if path.exists() else []


def _tune_process(db, pattern, trials, seed):
    from conftest import start_cli
    return start_cli("tune", "--pattern", pattern, "--small", "--trials", str(trials), "--db", str(db),
                     "--seed", str(seed), "--no-progress")


def test_two_tune_processes_on_one_database_lose_nothing(tmp_path):
    from tvm.s_tir import meta_schedule as ms
    procs = [_tune_process(tmp_path, "layernorm_residual", 4, 1), _tune_process(tmp_path, "softmax_dropout", 4, 2)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
    folder = tmp_path / os.listdir(tmp_path)[0]
    assert len(_record_lines(folder)) == 8
    plain = ms.database.JSONDatabase(path_workload=str(folder / "database_workload.json"),
                                     path_tuning_record=str(folder / "database_tuning_record.json"))
    names = sorted(str(r.workload.mod["main"].attrs["global_symbol"]) for r in plain.get_all_tuning_records())
    assert names == ["layernorm_residual"] * 4 + ["softmax_dropout"] * 4


def test_kill_9_mid_tuning_then_rerun_keeps_every_committed_record(tmp_path):
    import signal
    import time
    proc = _tune_process(tmp_path, "softmax_dropout", 400, 1)
    deadline = time.time() + 300
    while time.time() < deadline:
        folders = [tmp_path / d for d in os.listdir(tmp_path)] if tmp_path.exists() else []
        if folders and len(_record_lines(folders[0])) >= 4:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    folder = folders[0]
    before = _record_lines(folder)
    assert len(before) >= 4
    with open(folder / "database_tuning_record.json", "ab") as f:
        f.write(before[-1][:100])  # as if the kill had landed mid-write
    rerun = _tune_process(tmp_path, "softmax_dropout", 4, 2)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-2000:]
    assert err.count("half-written") == 1
    after = _record_lines(folder)
    assert after[:len(before)] == before and len(after) == len(before) + 4


def test_a_record_whose_trace_no_longer_applies_is_named_skipped_reported_and_compacted_away(tmp_path, caplog):
    import logging

    import tvm
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    from conftest import run_cli

    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path), target)
    func = _func()
    workload = db.ms.commit_workload(_normalize_mod(func))
    # A trace written against other TensorIR (here: a block this kernel does not have).
    other = tvm.s_tir.Schedule(get_pattern("softmax_dropout").build({"rows": 4, "cols": 8}, "float32"))
    other.get_sblock("row_max")
    db.ms.commit_tuning_record(ms.database.TuningRecord(other.trace, workload, [1e-6], target,
                                                        ms.arg_info.ArgInfo.from_prim_func(func)))
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        chosen, rejected = db.best(func, lambda sch: (True, ""))
    assert chosen is None
    assert rejected[0].startswith(f"{db.path}/database_tuning_record.json:1: ") and "no longer applies" in rejected[0]
    assert any("no longer applies" in r.message for r in caplog.records)
    check = run_cli("db", "check", "--db", str(tmp_path))
    assert check.returncode == 1 and "no longer applies" in check.stdout
    compact = run_cli("db", "compact", "--db", str(tmp_path))
    assert compact.returncode == 0 and "-> 0" in compact.stdout
    assert run_cli("db", "check", "--db", str(tmp_path)).returncode == 0


def test_compaction_drops_records_that_failed_their_numerical_check(tuned_db, tmp_path):
    from autofuse.database import compact_folder

    root, _ = tuned_db
    db = _copy_without_verdicts(root, tmp_path)
    func = _func()
    fastest = db.records(func)[0]
    calls = []

    def reject_fastest(sch):
        calls.append(sch)
        return (len(calls) > 1, "injected mismatch")

    db.best(func, reject_fastest)  # stores the fastest record's failed verdict
    before, after = compact_folder(db.path, keep=100)
    assert after == before - 1
    kept = TuningDatabase(str(tmp_path), parse_target("llvm")).records(func)
    assert all(str(r.trace) != str(fastest.trace) or list(r.run_secs) != list(fastest.run_secs) for r in kept)
