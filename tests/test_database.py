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
    from autofuse.tune_patterns import Job, checker
    root, _ = tuned_db
    target = parse_target("llvm")
    pattern = get_pattern("linear_bias_relu")
    job = Job(pattern, pattern.small_shape(), "float32")
    chosen, _ = TuningDatabase(str(root), target).best(job.func, checker(job, target, tvm.cpu()))
    assert chosen is not None and chosen.source in ("generic", "template:tiled_epilogue")


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
