"""softmax_dropout's dropout: p=0 is plain softmax, the kept fraction is about 1-p, and the mask the
kernel computes in TIR uint32 arithmetic is bit for bit the numpy ``dropout_mask``."""

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.reduction import softmax_dropout as sd

TARGET = parse_target("llvm")
DEV = tvm.cpu()


def _run(func, x, schedule=False):
    if schedule:
        mod = sd.row_parallel.apply(func, TARGET, tunable=False).mod
    else:
        mod = tvm.IRModule({"main": func})
    rt = tvm.tirx.build(mod, target=TARGET)
    y = tvm.runtime.tensor(np.zeros_like(x), DEV)
    rt(tvm.runtime.tensor(x, DEV), y)
    return y.numpy()


def _softmax(x):
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "row_parallel"])
def test_p0_is_softmax(schedule):
    shape = {"rows": 16, "cols": 128}
    x = sd.make_inputs(shape, "float32", 3)[0]
    y = _run(sd.build_with(shape, "float32", 0.0, sd.SEED), x, schedule)
    assert np.count_nonzero(y) == y.size
    np.testing.assert_allclose(y, _softmax(x), rtol=1e-5, atol=1e-6)


def test_kept_fraction_near_1_minus_p():
    keep = sd.dropout_mask(512, 1024, 0.1, sd.SEED)
    assert 0.88 <= keep.mean() <= 0.92
    # The fraction dropped is p: 0.08..0.12 at p=0.1, for other seeds too.
    for seed in (0, 1, 7, 12345):
        assert 0.08 <= 1.0 - sd.dropout_mask(512, 1024, 0.1, seed).mean() <= 0.12


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "row_parallel"])
@pytest.mark.parametrize("seed", [sd.SEED, 0, 2**31 + 5])
# p = 0.25 once kept every element: uint32 multiplies compiled as `mul nuw` let LLVM fold the test.
@pytest.mark.parametrize("p", [0.1, 0.25, 0.5])
def test_tir_mask_matches_numpy(schedule, seed, p):
    # With x = 0 every softmax value is 1/cols, so the output is nonzero exactly where kept.
    shape = {"rows": 24, "cols": 256}
    x = np.zeros((shape["rows"], shape["cols"]), dtype="float32")
    y = _run(sd.build_with(shape, "float32", p, seed), x, schedule)
    want = sd.dropout_mask(shape["rows"], shape["cols"], p, seed)
    np.testing.assert_array_equal(y != 0, want)
    np.testing.assert_allclose(y[want], 1.0 / shape["cols"] / (1 - p), rtol=1e-6)


def test_reference_scales_kept_values():
    shape = sd.PATTERN.small_shape()
    x = sd.make_inputs(shape, "float32", 0)[0]
    keep = sd.dropout_mask(shape["rows"], shape["cols"])
    y = sd.reference(x)
    np.testing.assert_array_equal(y != 0, keep)
    np.testing.assert_allclose(y[keep], (_softmax(x) / (1 - sd.P))[keep], rtol=1e-6)


def test_masked_logits_stay_finite():
    # Attention-style masking puts -1e9 in the logits: exp must underflow to ~0, never to inf/nan.
    shape = {"rows": 8, "cols": 64}
    x = sd.make_inputs(shape, "float32", 5)[0]
    x[:, ::3] = -1e9
    y = _run(sd.build_with(shape, "float32", 0.0, sd.SEED), x, schedule=True)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y[:, ::3]) < 1e-30)
    np.testing.assert_allclose(y, _softmax(x), rtol=1e-5, atol=1e-6)


def test_p_permille_zero_is_a_shape_and_means_softmax():
    from autofuse.registry import get_pattern
    pattern = get_pattern("softmax_dropout")
    shape = pattern.resolve_shape({"p_permille": "0"}, base="small")
    x = pattern.make_inputs(shape, "float32", 3)[0]
    (y,) = pattern.run_reference([x], shape)
    np.testing.assert_allclose(y, _softmax(x), rtol=1e-6)


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "row_parallel"])
def test_fully_masked_row_is_nan_as_in_numpy(schedule):
    # A causal row whose only key is padded holds -inf only: numpy and onnxruntime give NaN, which
    # HF's exported graphs replace (IsNaN -> Where); a uniform row here was a wrong model output.
    shape = {"rows": 8, "cols": 64}
    x = sd.make_inputs(shape, "float32", 6)[0]
    x[2] = -np.inf
    x[5, ::2] = -np.inf
    y = _run(sd.build_with(shape, "float32", 0.0, sd.SEED), x, schedule)
    with np.errstate(invalid="ignore"):
        want = _softmax(x)
    assert np.isnan(y[2]).all() and np.isnan(want[2]).all()
    np.testing.assert_allclose(np.delete(y, 2, 0), np.delete(want, 2, 0), rtol=1e-5, atol=1e-6)
