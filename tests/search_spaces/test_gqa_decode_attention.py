"""gqa_decode_attention at the edges the automatic tests do not reach: multi-query attention
(num_kv_heads=1), an empty cache (cache_len=0) and a full one (cache_len=max_seq-1); the returned
caches are the inputs with only row cache_len replaced; the reference's head grouping is the usual
repeat_kv convention (query head h reads K/V head h // group)."""

import numpy as np
import pytest

from autofuse.accuracy import compare
import tvm
from tvm import s_tir
from tvm.s_tir.schedule import Trace

from autofuse.target import parse_target
from search_spaces.attention import gqa_decode_attention as gqa

TARGET = parse_target("llvm")
DEV = tvm.cpu()
SMALL = gqa.PATTERN.small_shape()
CASES = {
    "mqa": dict(SMALL, num_heads=4, num_kv_heads=1),
    "mha": dict(SMALL, num_heads=2, num_kv_heads=2),
    "empty_cache": dict(SMALL, cache_len=0),
    "full_cache": dict(SMALL, cache_len=SMALL["max_seq"] - 1),
    "mqa_full": dict(SMALL, num_heads=4, num_kv_heads=1, cache_len=SMALL["max_seq"] - 1),
}


def _run(mod, inputs):
    rt = tvm.tirx.build(mod, target=TARGET)
    outs = [tvm.runtime.tensor(np.zeros(shape, dtype), DEV)
            for shape, dtype in gqa.PATTERN.output_specs(mod["main"])]
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], *outs)
    return [o.numpy() for o in outs]


def _modules(shape):
    func = gqa.build(shape, "float32")
    yield "unscheduled", tvm.IRModule({"main": func})
    yield "kv_head", gqa.kv_head.apply(func, TARGET, tunable=False).mod
    # Two knob samples replayed as MetaSchedule replays them (cache_len=0 leaves one-position loops).
    design = s_tir.Schedule(func, seed=1)
    gqa.kv_head.schedule(design, TARGET, tunable=True)
    space = Trace(design.trace.insts, {})
    for seed in (5, 6):
        sch = s_tir.Schedule(func, seed=seed)
        space.apply_to_schedule(sch, remove_postproc=True)
        yield f"sample{seed}", sch.mod


@pytest.mark.parametrize("case", list(CASES))
def test_edges_match_reference(case):
    shape = CASES[case]
    inputs = gqa.make_inputs(shape, "float32", 11)
    expected = gqa.PATTERN.run_reference(inputs, shape)
    bounds = gqa.PATTERN.check_args(shape, "float32")  # the shape's, the same for every schedule
    for label, mod in _modules(shape):
        got = _run(mod, inputs)
        check = compare(got, expected, **bounds)
        assert check.ok, f"{label}: {check.message}"


@pytest.mark.parametrize("case", ["mqa", "empty_cache", "full_cache"])
def test_caches_change_only_at_cache_len(case):
    shape = CASES[case]
    length = shape["cache_len"]
    q, k_new, v_new, k_cache, v_cache = gqa.make_inputs(shape, "float32", 4)
    func = gqa.build(shape, "float32")
    for mod in (tvm.IRModule({"main": func}), gqa.kv_head.apply(func, TARGET, tunable=False).mod):
        _, k_out, v_out = _run(mod, [q, k_new, v_new, k_cache, v_cache])
        for new, old, got in ((k_new, k_cache, k_out), (v_new, v_cache, v_out)):
            np.testing.assert_array_equal(got[:, :, length], new)
            others = np.arange(shape["max_seq"]) != length
            np.testing.assert_array_equal(got[:, :, others], old[:, :, others])


def test_empty_cache_attends_to_the_new_token_only():
    # One position: softmax is 1, so every query head of a group returns its K/V head's v_new.
    shape = CASES["empty_cache"]
    q, k_new, v_new, k_cache, v_cache = gqa.make_inputs(shape, "float32", 2)
    out, _, _ = gqa.reference(q, k_new, v_new, k_cache, v_cache, shape=shape)
    group = shape["num_heads"] // shape["num_kv_heads"]
    np.testing.assert_allclose(out, np.repeat(v_new, group, axis=1), rtol=1e-6)


@pytest.mark.parametrize("case", ["mqa", "full_cache"])
def test_reference_grouping_is_repeat_kv(case):
    shape = CASES[case]
    length = shape["cache_len"]
    q, k_new, v_new, k_cache, v_cache = gqa.make_inputs(shape, "float32", 9)
    out, kc, vc = gqa.reference(q, k_new, v_new, k_cache, v_cache, shape=shape)
    group = shape["num_heads"] // shape["num_kv_heads"]
    want = np.empty_like(out, dtype=np.float64)
    for b in range(shape["batch"]):
        for h in range(shape["num_heads"]):
            keys = kc[b, h // group, :length + 1].astype(np.float64)
            scores = keys @ q[b, h].astype(np.float64) / np.sqrt(shape["head_dim"])
            w = np.exp(scores - scores.max())
            want[b, h] = (w / w.sum()) @ vc[b, h // group, :length + 1]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["mqa", "empty_cache", "full_cache"])
def test_onnx_graph_at_the_edges(case):
    import onnxruntime as ort
    shape = CASES[case]
    inputs = gqa.make_inputs(shape, "float32", 3)
    model = gqa.onnx_graph(shape, "float32")
    names = [v.name for v in model.graph.input]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    for g, e in zip(got, gqa.PATTERN.run_reference(inputs, shape)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        gqa.build(dict(SMALL, num_heads=3, num_kv_heads=2), "float32")
    with pytest.raises(ValueError):
        gqa.build(dict(SMALL, cache_len=SMALL["max_seq"]), "float32")


@pytest.mark.parametrize("stages, merge", [(0, "combine"), (2, "combine"), (4, "combine"), (0, "cluster"),
                                           (4, "cluster"), (0, "last"), (4, "last")])
def test_the_split_kv_template_builds_at_a_fixed_cache_len(stages, merge):
    # the ring's byte counts once had a negative bound (a split past cache_len) that their uint32
    # cast rejected at build time, for the constant cache_len a pattern's kernel is built with
    from autofuse import building as B
    from autofuse import kernel_templates as K

    shape = {"batch": 4, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "max_seq": 2048, "cache_len": 1500}
    h200 = parse_target("h200")
    template = K.kernel_template(gqa.PATTERN, "cuda_split_kv")
    assert template.default_for(shape, "float16")["stages"] == 4
    assert template.default_for(shape, "float16")["merge"] == "cluster"  # 32 row sets of 16 splits fill the GPU
    assert template.default_for(dict(shape, batch=1, max_seq=4096), "float16")["merge"] == "last"  # 32 splits
    func = template.build(shape, "float16", {**template.default_for(shape, "float16"), "stages": stages,
                                             "merge": merge, "evict_first": min(stages, 1)})
    B.build_tirx(func, h200)
