"""sparse24_matmul_gather: compress_24/decompress_24 (round trip, the 2:4 invariant, every position
pair), the kernel's own meta decoding against a hand-built dense W, gathers with repeated and
out-of-order indices, k not a multiple of 4, and the default template at a non-small shape."""

import functools
import itertools

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.sparse import sparse24_matmul_gather as sg

TARGET = parse_target("llvm")
DEV = tvm.cpu()
PAIRS = list(itertools.combinations(range(4), 2))      # the 6 ways to keep 2 of 4


def _shape(rows, m, n, k, bias=1):
    return {"rows": rows, "m": m, "n": n, "k": k, "bias": bias}


@functools.lru_cache(maxsize=None)
def _kernel(rows, m, n, k, bias, scheduled):
    func = sg.build(_shape(rows, m, n, k, bias), "float32")
    mod = sg.row_tiles.apply(func, TARGET, tunable=False).mod if scheduled else tvm.IRModule({"main": func})
    return tvm.tirx.build(mod, target=TARGET)


def _run(inputs, n, bias, scheduled=True):
    x, idx = inputs[0], inputs[1]
    rt = _kernel(x.shape[0], idx.shape[0], n, x.shape[1], bias, scheduled)
    out = tvm.runtime.tensor(np.zeros((idx.shape[0], n), "float32"), DEV)
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], out)
    return out.numpy()


def test_round_trip_and_the_24_invariant():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((16, 32)).astype("float32")
    values, meta = sg.compress_24(dense)
    assert values.shape == (16, 16) and values.dtype == np.float32
    assert meta.shape == (16, 8) and meta.dtype == np.uint8
    first, second = sg.decode_meta(meta)
    assert np.all(first < second) and np.all(meta >> 4 == 0)
    w = sg.decompress_24(values, meta)
    groups, kept = dense.reshape(16, 8, 4), w.reshape(16, 8, 4)
    assert np.all((kept != 0).sum(-1) == 2)
    # The kept entries are the original values, and they are the 2 largest magnitudes of the group.
    np.testing.assert_array_equal(kept[kept != 0], groups[kept != 0])
    dropped_max = np.where(kept == 0, np.abs(groups), 0).max(-1)
    kept_min = np.where(kept != 0, np.abs(groups), np.inf).min(-1)
    assert np.all(dropped_max <= kept_min)
    # A 2:4 matrix survives compression unchanged.
    again_values, again_meta = sg.compress_24(w)
    np.testing.assert_array_equal(again_values, values)
    np.testing.assert_array_equal(again_meta, meta)
    np.testing.assert_array_equal(sg.decompress_24(again_values, again_meta), w)


@pytest.mark.parametrize("pair", PAIRS)
def test_each_position_pair_encodes_and_decodes(pair):
    dense = np.zeros((1, 4), "float32")
    dense[0, list(pair)] = [2.0, -3.0]
    values, meta = sg.compress_24(dense)
    assert int(meta[0, 0]) == pair[0] | (pair[1] << 2)
    np.testing.assert_array_equal(values, [[2.0, -3.0]])
    np.testing.assert_array_equal(sg.decompress_24(values, meta), dense)


def test_kernel_decodes_all_six_pairs():
    """Row r, group g keeps pair (r + g) % 6: every pair at every group and output row. W is
    built from the pairs directly, not through decompress_24."""
    n, groups, m, rows = 6, 6, 8, 10
    k = 4 * groups
    rng = np.random.default_rng(1)
    values = rng.uniform(0.5, 1.5, (n, 2 * groups)).astype("float32")
    meta = np.zeros((n, groups), np.uint8)
    w = np.zeros((n, k), np.float64)
    for r, g in itertools.product(range(n), range(groups)):
        p0, p1 = PAIRS[(r + g) % 6]
        meta[r, g] = p0 | (p1 << 2)
        w[r, 4 * g + p0], w[r, 4 * g + p1] = values[r, 2 * g], values[r, 2 * g + 1]
    x = rng.standard_normal((rows, k)).astype("float32")
    idx = rng.integers(0, rows, m).astype(np.int32)
    expected = x[idx].astype(np.float64) @ w.T
    for scheduled in (False, True):
        np.testing.assert_allclose(_run([x, idx, values, meta], n, 0, scheduled), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sg.decompress_24(values, meta), w.astype("float32"))


def test_repeated_and_out_of_order_indices():
    shape = _shape(rows=7, m=12, n=16, k=16)
    x, _, values, meta, b = sg.make_inputs(shape, "float32", 2)
    idx = np.array([6, 0, 6, 3, 3, 5, 1, 0, 6, 2, 4, 3], np.int32)      # repeats, descending runs
    got = _run([x, idx, values, meta, b], 16, 1)
    np.testing.assert_allclose(got, sg.reference(x, idx, values, meta, b), rtol=1e-5, atol=1e-5)
    # The same table row gives the same output row wherever it is routed.
    np.testing.assert_array_equal(got[0], got[2])
    np.testing.assert_array_equal(got[3], got[11])
    np.testing.assert_array_equal(got[1], got[7])


@pytest.mark.parametrize("k", [6, 10, 15])
def test_k_not_a_multiple_of_4_is_rejected(k):
    with pytest.raises(ValueError, match="multiple of 4"):
        sg.build(_shape(rows=4, m=4, n=4, k=k), "float32")
    with pytest.raises(ValueError, match="multiple of 4"):
        sg.compress_24(np.zeros((2, k)))


@pytest.mark.parametrize("bias", [1, 0])
def test_default_template_at_a_larger_shape(bias):
    shape = _shape(rows=40, m=24, n=48, k=64, bias=bias)
    inputs = sg.make_inputs(shape, "float32", 5)
    assert len(inputs) == 4 + bias
    got = _run(inputs, 48, bias)
    np.testing.assert_allclose(got, sg.reference(*inputs), rtol=1e-4, atol=1e-4)


def test_onnx_graph_without_bias():
    import onnxruntime as ort

    shape = _shape(rows=5, m=6, n=8, k=12, bias=0)
    inputs = sg.make_inputs(shape, "float32", 4)
    model = sg.onnx_graph(shape, "float32")
    names = [v.name for v in model.graph.input]
    assert names == ["x", "idx", "values", "meta"]
    (got,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    np.testing.assert_allclose(got, sg.reference(*inputs), rtol=1e-5, atol=1e-5)
