"""The numerical check: strict where a kernel is wrong, fair to what standard kernels compute."""

import math

import numpy as np
import pytest

from autofuse.accuracy import compare, dtype_eps, error_bound, framework_bound


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_zeroing_small_softmax_outputs_fails():
    rng = np.random.default_rng(0)
    want = _softmax(rng.standard_normal((64, 4096))).astype(np.float32)
    assert (want < 1e-4).mean() > 0.3  # the case the old atol = 1e-4 let through
    got = np.where(want < 1e-4, 0.0, want).astype(np.float32)
    assert not compare([got], [want], accumulation=4096).ok
    # ... and one float32 rounding of the exact result passes.
    exact = _softmax(rng.standard_normal((64, 4096)))
    assert compare([exact.astype(np.float32)], [exact], accumulation=4096).ok


def _cublas_style_gemm(m, n, k, seed=0):
    """float16 inputs, float32 accumulation, one rounding of the output to float16."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float16)
    b = rng.uniform(-1, 1, (n, k)).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    fp32 = (a.astype(np.float32) @ b.astype(np.float32).T).astype(np.float16)
    return fp32, exact


@pytest.mark.parametrize("k", [256, 4096, 8192])
def test_cublas_style_float16_gemm_passes(k):
    got, exact = _cublas_style_gemm(64, 64, k)
    check = compare([got], [exact], accumulation=k)
    assert check.ok, check.message


def test_float16_gemm_accumulated_in_float16_fails():
    rng = np.random.default_rng(1)
    k = 4096
    a = rng.uniform(0, 1, (16, k)).astype(np.float16)
    b = rng.uniform(0, 1, (16, k)).astype(np.float16)
    acc = np.zeros((16, 16), np.float16)
    for i in range(k):
        acc = (acc + np.outer(a[:, i], b[:, i]).astype(np.float16)).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    assert not compare([acc], [exact], accumulation=k).ok


def test_one_ulp_off_in_a_float32_reduction_passes():
    rng = np.random.default_rng(2)
    want = rng.standard_normal((128, 256)).astype(np.float32)
    got = np.nextafter(want, np.float32(np.inf))
    assert compare([got], [want], accumulation=256).ok


def test_nan_where_the_reference_has_none_fails():
    want = np.ones((4, 4), np.float32)
    got = want.copy()
    got[1, 2] = np.nan
    check = compare([got], [want])
    assert not check.ok and "non-finite" in check.message


def test_matching_non_finite_values_pass():
    want = np.array([1.0, -np.inf, 2.0], np.float32)
    assert compare([want.copy()], [want]).ok
    assert not compare([np.array([1.0, np.inf, 2.0], np.float32)], [want]).ok
    # NaN where the reference has NaN (the sqrt of a negative mean on random inputs) passes too
    nan = np.array([1.0, np.nan, 2.0], np.float32)
    assert compare([nan.copy()], [nan]).ok
    assert not compare([np.array([1.0, np.inf, 2.0], np.float32)], [nan]).ok


def test_integers_must_match_exactly():
    want = np.array([3, 4, 5], np.int32)
    assert compare([want.copy()], [want]).ok
    assert not compare([want + np.array([0, 1, 0], np.int32)], [want]).ok


def test_float32_is_stricter_than_the_old_fixed_tolerance():
    # 1e-4 of the scale off everywhere passed rtol = atol = 1e-4; it is ~1000 float32 roundings.
    want = np.linspace(-1, 1, 1000).astype(np.float32)
    assert not compare([want + np.float32(1e-4)], [want], accumulation=1024).ok


def test_bounds_follow_dtype_and_accumulation():
    assert dtype_eps("bfloat16") == 2 ** -7 and dtype_eps("int8") == 0.0
    assert error_bound("float32", 4096) > error_bound("float32", 16)
    assert error_bound("float16") > error_bound("float32") and error_bound("bfloat16") > error_bound("float16")
    assert error_bound("int32", 4096) == 0.0


def test_shape_and_count_mismatches_fail():
    assert not compare([np.zeros(3)], [np.zeros(4)]).ok
    assert not compare([np.zeros(3)], [np.zeros(3), np.zeros(3)]).ok


def test_framework_bound_admits_what_the_framework_computes_but_not_garbage():
    bound = error_bound("float16", 2048)
    assert framework_bound(bound, [3 * bound]) == pytest.approx(3.75 * bound)
    assert framework_bound(bound, []) == bound
    assert framework_bound(bound, [0.5, math.inf, None]) == bound


def test_large_outputs_are_compared_in_chunks(monkeypatch):
    # a decode step's caches (2 x 537M values) are checked a chunk at a time: the worst error and
    # a misplaced NaN must still be found in any chunk, and an exact copy takes the short way
    from autofuse import accuracy

    monkeypatch.setattr(accuracy, "_CHUNK", 7)
    want = np.linspace(-2.0, 3.0, 60, dtype=np.float32).reshape(6, 10)
    got = want.copy()
    got[5, 9] += 0.25
    check = compare([got], [want], bound=1.0)
    assert check.max_abs_err == pytest.approx(0.25) and check.scaled_err == pytest.approx(0.25 / 3.0)
    assert compare([want.copy()], [want]).scaled_err == 0.0
    got = want.copy()
    got[4, 3] = np.nan
    assert not compare([got], [want], bound=1.0).ok
    want_nan = want.copy()
    want_nan[4, 3] = np.nan
    assert compare([got], [want_nan]).ok and compare([got], [want_nan]).scaled_err == 0.0
    got[4, 4] += 1.0
    assert compare([got], [want_nan], bound=1.0).max_abs_err == pytest.approx(1.0)
