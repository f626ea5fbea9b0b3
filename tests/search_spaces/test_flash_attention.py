"""flash_attention beyond the automatic checks: the causal mask aligned at the end when seq_q !=
seq_kv, seq_kv not a multiple of the key tile (a padded, masked last tile), causal key tiles
skipped, the shape rule build enforces, and the ONNX graph on the same shapes.

The tiling needs no divisibility: a key tile is KV_TILE (64) keys, or seq_kv when smaller; when
seq_kv is not a multiple of it the last tile is padded and masked. The rules are causal=1 ->
seq_q <= seq_kv (every query row must see a key) and kv_heads dividing heads (grouped-query
attention). seq_q and seq_kv may also be symbolic (int64 variables): one function for any
length."""

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.attention import flash_attention as fa

TARGET = parse_target("llvm")
DEV = tvm.cpu()


def _shape(seq_q, seq_kv, causal, heads=2, head_dim=8, batch=1, kv_heads=None):
    return {"batch": batch, "heads": heads, "kv_heads": heads if kv_heads is None else kv_heads,
            "seq_q": seq_q, "seq_kv": seq_kv, "head_dim": head_dim, "causal": causal}


def _run(shape, schedule, inputs=None):
    func = fa.build(shape, "float32")
    if schedule:
        mod = fa.flash_tiles.apply(func, TARGET, tunable=False).mod
    else:
        mod = tvm.IRModule({"main": func})
    rt = tvm.tirx.build(mod, target=TARGET)
    inputs = fa.make_inputs(shape, "float32", 7) if inputs is None else inputs
    out = tvm.runtime.tensor(np.zeros_like(inputs[0]), DEV)
    rt(*[tvm.runtime.tensor(x, DEV) for x in inputs], out)
    return inputs, out.numpy()


def _naive(q, k, v, causal):
    """Attention row by row, straight from the definition (float64); query head h reads K/V head
    h // (heads / kv_heads)."""
    sq, skv, d = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            g = h // group
            for i in range(sq):
                keys = range(skv) if not causal else range(min(skv, i + skv - sq + 1))
                s = np.array([q[b, h, i] @ k[b, g, j] for j in keys], dtype=np.float64) / np.sqrt(d)
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, g, list(keys)].astype(np.float64)
    return out


# (seq_q, seq_kv): 70 keys = a 64-key tile and a padded tile of 6; 130 = two tiles and 2 keys,
# and with causal=1 the first 10 query rows skip the third tile entirely; 40 keys < KV_TILE is
# one tile of 40; 12 queries against 70 keys puts the causal diagonal at key i + 58.
SHAPES = [(12, 70), (12, 130), (5, 40), (70, 70)]


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "flash_tiles"])
@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
@pytest.mark.parametrize("seq_q,seq_kv", SHAPES)
def test_kernel_matches_definition(seq_q, seq_kv, causal, schedule):
    shape = _shape(seq_q, seq_kv, causal)
    (q, k, v), out = _run(shape, schedule)
    np.testing.assert_allclose(out, _naive(q, k, v, causal), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, fa.reference(q, k, v, shape=shape), rtol=1e-4, atol=1e-5)


# Grouped-query attention: 4 query heads on 2 K/V heads (groups of 2) and on 1 (multi-query).
@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "flash_tiles"])
@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seq_q,seq_kv", [(12, 70), (16, 16)])
def test_grouped_query_heads_match_definition(seq_q, seq_kv, kv_heads, causal, schedule):
    shape = _shape(seq_q, seq_kv, causal, heads=4, kv_heads=kv_heads)
    (q, k, v), out = _run(shape, schedule)
    assert k.shape == v.shape == (1, kv_heads, seq_kv, 8)
    np.testing.assert_allclose(out, _naive(q, k, v, causal), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, fa.reference(q, k, v, shape=shape), rtol=1e-4, atol=1e-5)


def test_grouped_query_heads_read_their_own_kv_head():
    # heads=4 on kv_heads=2: query heads 0-1 read K/V head 0, 2-3 head 1. Changing V head 1 moves
    # query heads 2-3 only.
    shape = _shape(12, 70, 1, heads=4, kv_heads=2)
    (q, k, v), out = _run(shape, True)
    v2 = v.copy()
    v2[:, 1] += 1.0
    _, out2 = _run(shape, True, [q, k, v2])
    np.testing.assert_array_equal(out2[:, :2], out[:, :2])
    np.testing.assert_allclose(out2[:, 2:], out[:, 2:] + 1.0, rtol=1e-4, atol=1e-4)


def test_kv_bytes_counted_per_kv_head():
    mha, mqa = _shape(16, 64, 0, heads=4), _shape(16, 64, 0, heads=4, kv_heads=1)
    assert fa.nbytes(mha, "float32") - fa.nbytes(mqa, "float32") == 4 * 8 * 2 * 64 * 3


def test_causal_mask_is_aligned_at_the_end():
    # seq_q=4 against 70 keys: row i sees keys j <= i + 66. Key 67 (in the padded last tile) is
    # hidden from row 0 only, so changing its value leaves row 0 bit for bit alone and moves
    # rows 1-3.
    shape = _shape(4, 70, 1)
    (q, k, v), out = _run(shape, True)
    v2 = v.copy()
    v2[:, :, 67] += 10.0
    _, out2 = _run(shape, True, [q, k, v2])
    np.testing.assert_array_equal(out2[:, :, 0], out[:, :, 0])
    assert np.all(np.abs(out2[:, :, 1:] - out[:, :, 1:]).max(axis=-1) > 1e-3)


def test_decode_row_sees_all_keys():
    # One query against a cache: causal or not, the same attention.
    q, k, v = fa.make_inputs(_shape(1, 70, 1), "float32", 2)
    np.testing.assert_allclose(fa.reference(q, k, v, shape=_shape(1, 70, 1)),
                               fa.reference(q, k, v, shape=_shape(1, 70, 0)), rtol=1e-6)


def test_shape_rule():
    with pytest.raises(ValueError, match="seq_q <= seq_kv"):
        fa.build(_shape(20, 16, 1), "float32")
    with pytest.raises(ValueError, match="causal must be 0 or 1"):
        fa.build(_shape(16, 16, 2), "float32")
    fa.build(_shape(20, 16, 0), "float32")    # without the mask any seq_q is fine
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        fa.build(_shape(16, 16, 0, heads=4, kv_heads=3), "float32")
    with pytest.raises(ValueError, match="int64"):
        fa.build(_shape(tvm.tirx.Var("seq_q", "int32"), 16, 0), "float32")


# Symbolic lengths: one function for every run-time seq_q and/or seq_kv, the key tile fixed at
# KV_TILE. (autofuse.dynamic builds such kernels from the tuning database; tests/test_dynamic.py.)
@pytest.mark.parametrize("symbolic", ["seq_q", "seq_kv", "both"])
@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
def test_symbolic_lengths(symbolic, causal):
    names = ["seq_q", "seq_kv"] if symbolic == "both" else [symbolic]
    static_q, static_kv = 12, 70
    shape = _shape(static_q, static_kv, causal, heads=4, kv_heads=2)
    sym = {**shape, **{n: tvm.tirx.Var(n, "int64") for n in names}}
    func = fa.build(sym, "float32")
    rt = tvm.tirx.build(fa.flash_tiles.apply(func, TARGET, tunable=False).mod, target=TARGET)
    for seq_q, seq_kv in [(1, 1), (5, 40), (12, 70), (70, 130), (64, 64), (3, 200)]:
        concrete = {**shape, "seq_q": seq_q if "seq_q" in names else static_q,
                    "seq_kv": seq_kv if "seq_kv" in names else static_kv}
        if causal and concrete["seq_q"] > concrete["seq_kv"]:
            continue  # the caller's guarantee with causal=1
        q, k, v = fa.make_inputs(concrete, "float32", 3)
        out = tvm.runtime.tensor(np.zeros_like(q), DEV)
        rt(*[tvm.runtime.tensor(x, DEV) for x in (q, k, v)], out)
        np.testing.assert_allclose(out.numpy(), fa.reference(q, k, v, shape=concrete), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [0, 1])
def test_onnx_graph_on_uneven_shapes(causal, kv_heads):
    import onnxruntime as ort
    shape = _shape(12, 70, causal, kv_heads=kv_heads)
    model = fa.onnx_graph(shape, "float32")
    inputs = fa.make_inputs(shape, "float32", 4)
    names = [i.name for i in model.graph.input]
    (got,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    np.testing.assert_allclose(got, fa.reference(*inputs, shape=shape), rtol=1e-4, atol=1e-5)


def test_tuned_samples_stay_right_over_several_key_tiles():
    """What MetaSchedule measures is a sample after its postprocessors; RewriteReductionBlock once
    hoisted the per-tile max/sum inits above the key-tile loop, which only shows with 2+ tiles."""
    import tvm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Trace

    from autofuse.verify import check_module

    shape = {**fa.PATTERN.small_shape(), "seq_q": 32, "seq_kv": 130}
    func = fa.build(shape, "float32")
    design = s_tir.Schedule(func, seed=1)
    fa.flash_tiles.schedule(design, TARGET, tunable=True)
    space = Trace(design.trace.insts, {})
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=TARGET)
    postprocs = ms.postproc.Postproc.create("llvm")
    for post in postprocs:
        post._initialize_with_tune_context(context)
    for seed in (2, 3, 4):
        sch = s_tir.Schedule(func, seed=seed)
        space.apply_to_schedule(sch, remove_postproc=True)
        assert all(post.apply(sch) for post in postprocs)
        result = check_module(fa.PATTERN, tvm.tirx.build(sch.mod, target=TARGET), func, shape, "float32", tvm.cpu())
        assert result.ok, result.message
