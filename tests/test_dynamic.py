"""autofuse.dynamic: one symbolic build of flash_attention serving several (seq_q, seq_kv) sizes,
a schedule sampled at a static shape replayed on the symbolic function, the record/default choice
through a database, and the user errors."""

import pytest
import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from autofuse import dynamic
from autofuse.database import TuningDatabase
from autofuse.errors import AutofuseError
from autofuse.target import parse_target
from autofuse.database import record_source
from autofuse.verify import Choice, build_kernel
from search_spaces.attention import flash_attention as fa

TARGET = parse_target("llvm")
DEV = tvm.cpu()
NAMES = ["seq_q", "seq_kv"]
# Within one tile and across tiles, multiples of KV_TILE (64) and not, seq_q < seq_kv and equal
# (all seq_q <= seq_kv: what a causal caller guarantees).
SIZES = [{"seq_q": 1, "seq_kv": 1}, {"seq_q": 5, "seq_kv": 40}, {"seq_q": 12, "seq_kv": 70},
         {"seq_q": 70, "seq_kv": 130}, {"seq_q": 64, "seq_kv": 64}]


def _shape(causal, seq_q=16, seq_kv=16, heads=4, kv_heads=2):
    return {"batch": 1, "heads": heads, "kv_heads": kv_heads, "seq_q": seq_q, "seq_kv": seq_kv, "head_dim": 8,
            "causal": causal}


def _assert_all_ok(results):
    assert [r.size for r in results] == SIZES
    bad = [(r.size, r.message) for r in results if not r.ok]
    assert not bad, bad


def test_symbolic_replaces_the_named_params_by_int64_vars():
    shape = _shape(1)
    sym = dynamic.symbolic(shape, NAMES)
    assert all(isinstance(sym[n], tirx.Var) and str(sym[n].ty) == "int64" and sym[n].name == n for n in NAMES)
    assert all(sym[k] == v for k, v in shape.items() if k not in NAMES)
    assert shape["seq_q"] == 16  # not changed in place


@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
def test_one_build_serves_every_length(causal):
    rt, source = dynamic.build_dynamic(fa.PATTERN, _shape(causal), NAMES, "float32", TARGET)
    assert source == "template-default"
    results = dynamic.check_sizes(fa.PATTERN, rt, _shape(causal), SIZES, "float32", DEV, repeat=1)
    _assert_all_ok(results)
    assert all(r.max_abs_err < 1e-4 and r.median_ms > 0 for r in results)


@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
def test_sampled_static_trace_replays_on_the_symbolic_function(causal):
    static = fa.build(_shape(causal, 64, 128), "float32")
    symbolic = fa.build(dynamic.symbolic(_shape(causal), NAMES), "float32")
    tiles = set()
    for seed in (1, 2, 3):
        sch = s_tir.Schedule(static, seed=seed)
        fa.flash_tiles.schedule(sch, TARGET, tunable=True)
        trace = sch.trace
        tiles.update(v for inst, v in trace.decisions.items()
                     if inst.kind.name == "SampleCategorical" and list(inst.attrs[0]) == [8, 16, 32, 64])
        replayed = s_tir.Schedule(symbolic)
        trace.apply_to_schedule(replayed, remove_postproc=False)
        assert str(replayed.trace.decisions) == str(trace.decisions)
        rt = build_kernel(replayed.mod, TARGET)
        results = dynamic.check_sizes(fa.PATTERN, rt, _shape(causal), SIZES[1:4], "float32", DEV, repeat=0)
        assert all(r.ok for r in results), [(r.size, r.message) for r in results]
    assert len(tiles) > 1, "the seeds should sample different query tiles"


def _db_with_record(tmp_path, shape, trace):
    db = TuningDatabase(str(tmp_path), TARGET)
    func = fa.build(shape, "float32")
    workload = db.ms.commit_workload(_normalize_mod(func))
    db.ms.commit_tuning_record(ms.database.TuningRecord(trace, workload, [1e-6], TARGET,
                                                        ms.arg_info.ArgInfo.from_prim_func(func)))
    return db


def _sampled_trace(shape, seed=4):
    sch = s_tir.Schedule(fa.build(shape, "float32"), seed=seed)
    fa.flash_tiles.schedule(sch, TARGET, tunable=True)
    return sch.trace


def test_database_choice_is_replayed(tmp_path):
    # choose times the record against the template default for real: either may win, and the
    # winner's trace is what runs on the symbolic function. (seq_kv >= KV_TILE: the static key
    # tile is then the symbolic function's, and the default's fixed split of it replays too.)
    shape = _shape(1, seq_kv=64)
    db = _db_with_record(tmp_path, shape, _sampled_trace(shape))
    rt, source = dynamic.build_dynamic(fa.PATTERN, shape, NAMES, "float32", TARGET, db=db)
    assert source in ("record (template:flash_tiles), trace replayed", "template-default, trace replayed")
    _assert_all_ok(dynamic.check_sizes(fa.PATTERN, rt, shape, SIZES, "float32", DEV, repeat=0))


def _record_wins(monkeypatch):
    def choose(job, db, target, dev, *args, **kwargs):
        trace = db.records(job.func)[0].trace
        return Choice(job.func, record_source(trace), trace, 1e-6, record_source(trace), 1e-6, 2e-6), []
    monkeypatch.setattr(dynamic, "choose", choose)


def test_winning_record_is_replayed(tmp_path, monkeypatch):
    shape = _shape(1)
    db = _db_with_record(tmp_path, shape, _sampled_trace(shape))
    _record_wins(monkeypatch)
    rt, source = dynamic.build_dynamic(fa.PATTERN, shape, NAMES, "float32", TARGET, db=db)
    assert source == "record (template:flash_tiles), trace replayed"
    _assert_all_ok(dynamic.check_sizes(fa.PATTERN, rt, shape, SIZES, "float32", DEV, repeat=0))


def test_record_that_does_not_replay_falls_back_to_the_template_default(tmp_path, monkeypatch):
    # A perfect tile of the query loop: right at the static shape, meaningless for a symbolic one.
    shape = _shape(0)
    sch = s_tir.Schedule(fa.build(shape, "float32"))
    loop = sch.get_loops(sch.get_sblock("qk"))[2]
    sch.split(loop, sch.sample_perfect_tile(loop, n=2))
    db = _db_with_record(tmp_path, shape, sch.trace)
    _record_wins(monkeypatch)
    rt, source = dynamic.build_dynamic(fa.PATTERN, shape, NAMES, "float32", TARGET, db=db)
    assert source.startswith("template-default; record (generic), trace replayed not used: it did not apply "
                             "or build on the symbolic function (")
    _assert_all_ok(dynamic.check_sizes(fa.PATTERN, rt, shape, SIZES, "float32", DEV, repeat=0))


def test_user_errors():
    shape = _shape(0)
    with pytest.raises(AutofuseError, match="no shape parameter 'seq' to make symbolic"):
        dynamic.symbolic(shape, ["seq_q", "seq"])
    with pytest.raises(AutofuseError, match="no shape parameter 'length'"):
        dynamic.build_dynamic(fa.PATTERN, shape, ["length"], "float32", TARGET)
    with pytest.raises(AutofuseError, match="cannot be built with symbolic head_dim"):
        dynamic.build_dynamic(fa.PATTERN, shape, ["head_dim"], "float32", TARGET)
    rt, _ = dynamic.build_dynamic(fa.PATTERN, shape, ["seq_kv"], "float32", TARGET)
    sym = dynamic.symbolic(shape, ["seq_kv"])
    with pytest.raises(AutofuseError, match="leaves seq_kv without a value"):
        dynamic.check_sizes(fa.PATTERN, rt, sym, [{"seq_q": 16}], "float32", DEV, repeat=0)
    with pytest.raises(AutofuseError, match="no shape parameter 'seq'"):
        dynamic.check_sizes(fa.PATTERN, rt, sym, [{"seq": 16}], "float32", DEV, repeat=0)
    with pytest.raises(AutofuseError, match="seq_q <= seq_kv"):
        dynamic.check_sizes(fa.PATTERN, rt, _shape(1), [{"seq_kv": 8}], "float32", DEV, repeat=0)


def test_trace_declaring_a_static_buffer_region_is_not_replayed():
    """cuda_flash at a seq_kv that is not a multiple of the key tile declares its V read as a
    window ending at that seq_kv: right at that length only, so never replayed symbolically."""
    pattern = fa.PATTERN
    template = next(t for t in pattern.templates if t.name == "cuda_flash")
    shape = dict(pattern.small_shape(), seq_kv=70, seq_q=13)
    trace = template.apply(pattern.build(shape, "float32"), parse_target("h200"), tunable=False).trace
    assert any(inst.kind.name == "AnnotateBufferAccess" for inst in trace.insts)
    with pytest.raises(ValueError, match="buffer regions"):
        dynamic._replay(pattern.build(dynamic.symbolic(shape, ["seq_kv"]), "float32"), trace)
