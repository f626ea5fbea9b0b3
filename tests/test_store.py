"""The database files survive what users do to them: kills mid-write, two processes at once,
damaged lines, compaction cut short. Plain TVM reads every file autofuse writes."""

import json
import logging
import multiprocessing
import os

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T

from autofuse.store import COMPACT_MARKER, SafeJSONDatabase, finish_compaction, mean_secs

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _func(n: int, block: str = "b"):
    @T.prim_func(s_tir=True)
    def scale(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n):
            with T.sblock(block):
                vi = T.axis.spatial(n, i)
                b[vi] = a[vi] * T.float32(2)
    return tvm.IRModule({"main": scale})


def _record(workload, secs: float, block: str = "b"):
    sch = tvm.s_tir.Schedule(workload.mod)
    sch.get_sblock(block)  # a record needs a non-empty trace
    return ms.database.TuningRecord(sch.trace, workload, [secs], TARGET,
                                    ms.arg_info.ArgInfo.from_prim_func(workload.mod["main"]))


def _paths(folder):
    return str(folder / "database_workload.json"), str(folder / "database_tuning_record.json")


def _open(folder):
    return SafeJSONDatabase(*_paths(folder))


def _plain_tvm(folder):
    wpath, rpath = _paths(folder)
    return ms.database.JSONDatabase(path_workload=wpath, path_tuning_record=rpath, allow_missing=False)


def _fill(folder, sizes=(16, 32), per_workload=3):
    db = _open(folder)
    for n in sizes:
        workload = db.commit_workload(_func(n))
        for k in range(per_workload):
            db.commit_tuning_record(_record(workload, n * 1e-6 + k * 1e-7))
    return db


def test_what_autofuse_writes_plain_tvm_reads_and_back(tmp_path):
    _fill(tmp_path)
    plain = _plain_tvm(tmp_path)
    assert len(plain) == 6
    top = plain.get_top_k(plain.commit_workload(_func(32)), 2)
    assert [round(mean_secs(r) * 1e7) for r in top] == [320, 321]
    # And what plain TVM appends, autofuse reads.
    plain.commit_tuning_record(_record(plain.commit_workload(_func(64)), 1e-3))
    reopened = _open(tmp_path)
    assert len(reopened) == 7 and reopened.problems == []
    assert mean_secs(reopened.get_top_k(reopened.commit_workload(_func(64)), 5)[0]) == pytest.approx(1e-3)


def test_a_half_written_last_line_is_skipped_once_and_moved_aside(tmp_path, caplog):
    _fill(tmp_path)
    _, rpath = _paths(tmp_path)
    with open(rpath) as f:
        last = f.read().splitlines()[-1]
    with open(rpath, "a") as f:
        f.write(last[: len(last) // 2])  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        db = _open(tmp_path)
    assert len(db) == 6  # every complete record is there
    assert sum("half-written" in r.message for r in caplog.records) == 1
    db.commit_tuning_record(_record(db.commit_workload(_func(16)), 5e-5))
    with open(rpath) as f:
        lines = f.read().splitlines()
    assert len(lines) == 7 and all(json.loads(line) for line in lines)
    assert os.path.getsize(f"{rpath}.damaged") > 0
    assert len(_plain_tvm(tmp_path)) == 7


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path):
    _fill(tmp_path)
    _, rpath = _paths(tmp_path)
    with open(rpath) as f:
        text = f.read()
    with open(rpath, "w") as f:
        f.write(text.rstrip("\n"))
    db = _open(tmp_path)
    assert len(db) == 6
    db.commit_tuning_record(_record(db.commit_workload(_func(16)), 5e-5))
    assert len(_plain_tvm(tmp_path)) == 7


def test_damaged_lines_are_named_and_skipped_and_the_rest_loads(tmp_path):
    _fill(tmp_path)
    _, rpath = _paths(tmp_path)
    with open(rpath) as f:
        lines = f.read().splitlines()
    good = json.loads(lines[0])
    lines.insert(1, "{not json")
    lines.insert(3, json.dumps([7, good[1]]))  # a workload that does not exist
    with open(rpath, "w") as f:
        f.write("\n".join(lines) + "\n")
    db = _open(tmp_path)
    assert len(db) == 6
    assert [(p.line, p.reason.split(" (")[0]) for p in db.problems] == [
        (2, "not a tuning record"), (4, "record of unknown workload 7")]
    assert all(p.path == rpath for p in db.problems)


def _commit_many(folder, n, count, offset):
    db = _open(folder)
    workload = db.commit_workload(_func(n))
    for k in range(count):
        # Each record's run time says which workload it belongs to: n * 1e-6.
        db.commit_tuning_record(_record(workload, n * 1e-6 + (offset + k) * 1e-10))


def test_two_processes_committing_at_once_lose_nothing(tmp_path):
    # Not forked from this process (fork after jax or TVM threads start can deadlock): from
    # multiprocessing's fork server, a fresh single-threaded process that has imported TVM once
    # (each spawned writer imported it itself, 2.5 s of CPU apiece, so they barely overlapped).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tvm", "tvm.s_tir.meta_schedule", "autofuse.store"])
    jobs = [(16, 0), (32, 1000), (16, 2000), (48, 3000)]  # two of them share a workload
    procs = [ctx.Process(target=_commit_many, args=(tmp_path, n, 40, offset)) for n, offset in jobs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    plain = _plain_tvm(tmp_path)
    assert len(plain) == 160
    with open(_paths(tmp_path)[0]) as f:
        assert len(f.read().splitlines()) == 3  # each workload once
    for record in plain.get_all_tuning_records():
        n = int(record.workload.mod["main"].params[0].shape[0])
        assert int(round(mean_secs(record) * 1e6)) == n  # indices agree across the writers


def test_compact_keeps_the_best_k_and_plain_tvm_reads_it(tmp_path):
    db = _fill(tmp_path, sizes=(16, 32, 48), per_workload=5)
    db.commit_tuning_record(_record(db.commit_workload(_func(64)), 1e10))  # failed only: dropped
    assert db.compact(keep=2) == (16, 6)
    plain = _plain_tvm(tmp_path)
    assert len(plain) == 6
    for n in (16, 32, 48):
        top = plain.get_top_k(plain.commit_workload(_func(n)), 5)
        assert [round(mean_secs(r) * 1e7) for r in top] == [n * 10, n * 10 + 1]
    assert os.path.exists(_paths(tmp_path)[1] + ".bak")
    assert len(db) == 6  # the open handle follows the new files


def test_a_compaction_cut_short_is_finished_or_undone(tmp_path):
    _fill(tmp_path)
    wpath, rpath = _paths(tmp_path)
    # Cut short before the commit marker: the new files are dropped, the old ones stay.
    for path in (wpath, rpath):
        with open(f"{path}.new", "w") as f:
            f.write("")
    assert len(_open(tmp_path)) == 6
    assert not os.path.exists(f"{rpath}.new")
    # Cut short after the marker, one file swapped: the next open finishes the swap.
    db = _open(tmp_path)
    with open(f"{rpath}.new", "w") as f:
        with open(rpath) as old:
            f.write(old.read().splitlines()[0] + "\n")
    (tmp_path / COMPACT_MARKER).write_text("swap\n")
    assert len(_open(tmp_path)) == 1
    assert not (tmp_path / COMPACT_MARKER).exists()
    finish_compaction(str(tmp_path))  # nothing left to do
    assert len(db.get_all_tuning_records()) == 6  # an old handle keeps what it read


def test_kernels_equal_but_for_block_names_are_separate_workloads(tmp_path):
    """Relax names a kernel's blocks after its variables: two models' identical layer_norms
    differ only there. Filed as one workload, the second one's records would not parse again."""
    db = _open(tmp_path)
    first, second = _func(16, "lv1_sum"), _func(16, "lv5_sum")
    db.commit_tuning_record(_record(db.commit_workload(first), 1e-6, "lv1_sum"))
    db.commit_tuning_record(_record(db.commit_workload(second), 2e-6, "lv5_sum"))
    reopened = _open(tmp_path)
    assert reopened.problems == [] and len(reopened.workloads()) == 2
    assert [mean_secs(r) for r in reopened.get_top_k(reopened.commit_workload(second), 5)] == [pytest.approx(2e-6)]
    assert len(_plain_tvm(tmp_path)) == 2


def test_a_trace_holding_an_index_map_is_written_as_metaschedule_writes_it(tmp_path):
    """transform_layout puts an IndexMap in the trace, which TuningRecord.as_json leaves as a TVM
    object: the line must still be what MetaSchedule's JSON writer produces, readable both ways."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    from autofuse.registry import get_pattern
    from autofuse.verify import default_schedule
    pattern = get_pattern("cross_attention")
    func = pattern.build(pattern.small_shape(), "float32")
    sch = default_schedule(func, TARGET, pattern)
    assert "transform_layout" in str(sch.trace.as_python())
    db = _open(tmp_path)
    workload = db.commit_workload(_normalize_mod(func))
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-3], TARGET,
                                                     ms.arg_info.ArgInfo.from_prim_func(func)))
    assert len(_open(tmp_path)) == 1 and _open(tmp_path).problems == []
    assert len(_plain_tvm(tmp_path)) == 1


def test_a_record_that_tensorizes_with_a_library_intrinsic_parses_in_a_fresh_process(tmp_path):
    """The library's int8 pair-dot intrinsics are registered at first use, not at import (their
    parsing took 3 s of every start): a process that reads a record using one (TVM replays it
    while parsing) registers it first, and an import alone registers none."""
    import subprocess
    import sys

    from autofuse.registry import get_pattern
    from autofuse.target import parse_target
    from autofuse.tune import template_defaults

    target = parse_target("llvm")
    pattern = get_pattern("int8_matmul_dequant")
    func = pattern.build(pattern.resolve_shape({}, base="small"), pattern.dtypes[0])
    traces = [s.trace for s in template_defaults(pattern.templates_for(target, func), func, target)
              if "autofuse_pair_dot_" in str(s.trace)]
    if not traces:
        pytest.skip("this CPU has no int8 pair dot")
    db = SafeJSONDatabase(*_paths(tmp_path))
    workload = db.commit_workload(tvm.IRModule({"main": func}))
    db.commit_tuning_record(ms.database.TuningRecord(traces[0], workload, [1e-5], TARGET,
                                                     ms.arg_info.ArgInfo.from_prim_func(func)))
    script = (
        "import sys; from tvm.s_tir import TensorIntrin; import search_spaces.lib.cpu_gemm as g; "
        "from autofuse.store import SafeJSONDatabase; "
        "names = [g.PAIR_DOT_PREFIX + 'bcast_' + n for n in g.PAIR_DOTS]; "
        "assert all(TensorIntrin.get(n, allow_missing=True) is None for n in names), 'registered at import'; "
        f"db = SafeJSONDatabase({_paths(tmp_path)[0]!r}, {_paths(tmp_path)[1]!r}); "
        "assert len(db.get_all_tuning_records()) == 1, db.problems")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
