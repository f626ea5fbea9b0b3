"""spec_verify_attention beyond the automatic checks: chain (causal) and branching tree masks, a
single draft (which is decode attention), an empty cache (drafts only), GQA, MQA and MHA, a cache
longer than one key tile and not a multiple of it (a padded last tile), a full cache; cache rows
past cache_len are never read (NaN there changes nothing); the reference against two other
patterns' references and a row-by-row definition; the ONNX graph at the edges; the shape rules."""

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir.schedule import Trace

from autofuse.target import parse_target
from autofuse.accuracy import compare
from search_spaces.attention import flash_attention as fa
from search_spaces.attention import gqa_decode_attention as gqa
from search_spaces.speculative import spec_verify_attention as sv

TARGET = parse_target("llvm")
DEV = tvm.cpu()
SMALL = sv.PATTERN.small_shape()   # batch 1, heads 4, kv_heads 2, head_dim 16, max_seq 32, cache_len 13, k_draft 5
CASES = {
    "tree_gqa": SMALL,
    "chain": SMALL,
    "single_draft": dict(SMALL, k_draft=1),
    "empty_cache": dict(SMALL, cache_len=0),
    "empty_cache_chain": dict(SMALL, cache_len=0, k_draft=4),
    "mqa": dict(SMALL, heads=4, kv_heads=1),
    "mha": dict(SMALL, heads=2, kv_heads=2, batch=2),
    "padded_tile": dict(SMALL, max_seq=80, cache_len=70, k_draft=6),
    "full_cache": dict(SMALL, cache_len=SMALL["max_seq"]),
}
CHAIN = {"chain", "empty_cache_chain"}


def _inputs(case, seed=11):
    shape = CASES[case]
    inputs = sv.make_inputs(shape, "float32", seed)
    if case in CHAIN:
        inputs[-1] = sv.chain_mask(shape["k_draft"])
    return shape, inputs


def _run(mod, inputs):
    rt = tvm.tirx.build(mod, target=TARGET)
    outs = [tvm.runtime.tensor(np.zeros(s, d), DEV) for s, d in sv.PATTERN.output_specs(mod["main"])]
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], *outs)
    return [o.numpy() for o in outs]


def _modules(shape, samples=()):
    func = sv.build(shape, "float32")
    yield "unscheduled", tvm.IRModule({"main": func})
    yield "kv_head_tiles", sv.kv_head_tiles.apply(func, TARGET, tunable=False).mod
    if samples:
        design = s_tir.Schedule(func, seed=1)
        sv.kv_head_tiles.schedule(design, TARGET, tunable=True)
        space = Trace(design.trace.insts, {})
        for seed in samples:
            sch = s_tir.Schedule(func, seed=seed)
            space.apply_to_schedule(sch, remove_postproc=True)
            yield f"sample{seed}", sch.mod


@pytest.mark.parametrize("case", list(CASES))
def test_edges_match_reference(case):
    shape, inputs = _inputs(case)
    expected = sv.PATTERN.run_reference(inputs, shape)
    samples = (5,) if case in ("single_draft", "empty_cache", "padded_tile") else ()
    bounds = sv.PATTERN.check_args(shape, "float32")  # the shape's, the same for every schedule
    for label, mod in _modules(shape, samples):
        check = compare(_run(mod, inputs), expected, **bounds)
        assert check.ok, f"{label}: {check.message}"


@pytest.mark.parametrize("case", ["tree_gqa", "empty_cache", "padded_tile", "full_cache"])
def test_cache_rows_past_cache_len_are_never_read(case):
    # A stale cache may hold anything; NaN there would show in any output that read it (even
    # multiplied by a masked probability of 0).
    shape, inputs = _inputs(case, seed=3)
    for cache in inputs[1:3]:
        cache[:, :, shape["cache_len"]:] = np.nan
    expected = sv.PATTERN.run_reference(inputs, shape)
    assert np.all(np.isfinite(expected[0]))
    bounds = sv.PATTERN.check_args(shape, "float32")
    for label, mod in _modules(shape):
        check = compare(_run(mod, inputs), expected, **bounds)
        assert check.ok, f"{label}: {check.message}"


def test_two_branch_tree_is_a_tree():
    mask = sv.two_branch_mask(8)
    # 0 <- 1 <- 2 <- 3 <- 4 and 0 <- 5 <- 6 <- 7: each row sees itself and its ancestors only.
    want = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4],
            5: [0, 5], 6: [0, 5, 6], 7: [0, 5, 6, 7]}
    for i, seen in want.items():
        assert list(np.flatnonzero(mask[i])) == seen
    assert mask.dtype == np.int32
    np.testing.assert_array_equal(sv.chain_mask(5), np.tril(np.ones((5, 5), np.int32)))
    with pytest.raises(ValueError):
        sv.tree_mask([-1, 2, 0])


def test_reference_is_the_definition():
    # Row by row: query i of head h sees every cached key and the drafts its tree row allows.
    shape, (q, kc, vc, kn, vn, tree) = _inputs("mqa", seed=5)
    got = sv.reference(q, kc, vc, kn, vn, tree, shape=shape)
    length, group = shape["cache_len"], shape["heads"] // shape["kv_heads"]
    for b in range(shape["batch"]):
        for h in range(shape["heads"]):
            g = h // group
            for i in range(shape["k_draft"]):
                drafts = np.flatnonzero(tree[i])
                keys = np.concatenate([kc[b, g, :length], kn[b, g, drafts]]).astype(np.float64)
                vals = np.concatenate([vc[b, g, :length], vn[b, g, drafts]]).astype(np.float64)
                s = keys @ q[b, h, i].astype(np.float64) / np.sqrt(shape["head_dim"])
                w = np.exp(s - s.max())
                np.testing.assert_allclose(got[b, h, i], (w / w.sum()) @ vals, rtol=1e-5, atol=1e-6)


def test_chain_is_causal_attention_over_cache_and_drafts():
    # A chain of drafts is end-aligned causal attention over the cache followed by the drafts.
    shape, (q, kc, vc, kn, vn, tree) = _inputs("chain", seed=6)
    length = shape["cache_len"]
    k = np.concatenate([kc[:, :, :length], kn], axis=2)
    v = np.concatenate([vc[:, :, :length], vn], axis=2)
    want = fa.reference(q, k, v, shape={"causal": 1})
    got = _run(tvm.IRModule({"main": sv.build(shape, "float32")}), [q, kc, vc, kn, vn, tree])[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_single_draft_is_decode_attention():
    # k_draft = 1: one new token over the cache plus itself, what gqa_decode_attention computes
    # after appending the token at cache_len.
    shape, (q, kc, vc, kn, vn, tree) = _inputs("single_draft", seed=8)
    decode_shape = {"batch": shape["batch"], "num_heads": shape["heads"], "num_kv_heads": shape["kv_heads"],
                    "head_dim": shape["head_dim"], "max_seq": shape["max_seq"], "cache_len": shape["cache_len"]}
    want, _, _ = gqa.reference(q[:, :, 0], kn[:, :, 0], vn[:, :, 0], kc, vc, shape=decode_shape)
    func = sv.build(shape, "float32")
    got = _run(sv.kv_head_tiles.apply(func, TARGET, tunable=False).mod, [q, kc, vc, kn, vn, tree])[0]
    np.testing.assert_allclose(got[:, :, 0], want, rtol=1e-4, atol=1e-5)


def test_empty_cache_single_draft_returns_its_value():
    # Nothing cached, one draft seeing itself: softmax over one key is 1.
    shape = dict(CASES["empty_cache"], k_draft=1)
    q, kc, vc, kn, vn, tree = sv.make_inputs(shape, "float32", 2)
    got = _run(tvm.IRModule({"main": sv.build(shape, "float32")}), [q, kc, vc, kn, vn, tree])[0]
    group = shape["heads"] // shape["kv_heads"]
    np.testing.assert_allclose(got, np.repeat(vn, group, axis=1), rtol=1e-6)


def test_branches_do_not_see_each_other():
    # Changing the K/V of the second branch leaves the first branch's rows (and the root) alone.
    shape, (q, kc, vc, kn, vn, tree) = _inputs("tree_gqa", seed=4)
    split = shape["k_draft"] // 2             # 0; 1..split; split+1..k-1
    func = sv.kv_head_tiles.apply(sv.build(shape, "float32"), TARGET, tunable=False).mod
    before = _run(func, [q, kc, vc, kn, vn, tree])[0]
    kn2, vn2 = kn.copy(), vn.copy()
    kn2[:, :, split + 1:] += 3.0
    vn2[:, :, split + 1:] -= 2.0
    after = _run(func, [q, kc, vc, kn2, vn2, tree])[0]
    np.testing.assert_array_equal(after[:, :, :split + 1], before[:, :, :split + 1])
    assert not np.allclose(after[:, :, split + 1:], before[:, :, split + 1:])


@pytest.mark.parametrize("case", ["chain", "empty_cache", "mqa", "single_draft"])
def test_onnx_graph_at_the_edges(case):
    import onnxruntime as ort
    shape, inputs = _inputs(case, seed=3)
    model = sv.onnx_graph(shape, "float32")
    names = [v.name for v in model.graph.input]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    np.testing.assert_allclose(got[0], sv.PATTERN.run_reference(inputs, shape)[0], rtol=1e-4, atol=1e-4)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        sv.build(dict(SMALL, heads=3, kv_heads=2), "float32")
    with pytest.raises(ValueError):
        sv.build(dict(SMALL, cache_len=SMALL["max_seq"] + 1), "float32")


def test_sdpa_does_the_same_work_where_the_drafts_fit_after_the_cache():
    # SDPA over the caches in place (the drafts written into their free rows) is the same work;
    # concatenating the prefix with the drafts copies the cache, labelled more work
    fits = dict(SMALL, max_seq=512, cache_len=200, k_draft=8)
    full = dict(fits, cache_len=510)
    assert "torch-sdpa" not in sv.PATTERN.more_work_at(fits) and "onnx_graph" in sv.PATTERN.more_work_at(fits)
    assert "copy of the cache" in sv.PATTERN.more_work_at(full)["torch-sdpa"]
