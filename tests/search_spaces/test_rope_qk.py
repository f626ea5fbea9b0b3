"""rope_qk: the rotation is orthogonal (norms kept, in numpy and in the kernel), queries shorter
than keys sit at the last positions, and scores depend only on relative position."""

import math

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.attention import rope_qk as rq

TARGET = parse_target("llvm")
DEV = tvm.cpu()


def _shape(sq, sk, d=8, heads=2):
    return {"batch": 1, "heads": heads, "seq_q": sq, "seq_k": sk, "head_dim": d}


def _run(shape, q, k, cos, sin, schedule):
    func = rq.build(shape, "float32")
    mod = rq.key_tiles.apply(func, TARGET, tunable=False).mod if schedule else tvm.IRModule({"main": func})
    rt = tvm.tirx.build(mod, target=TARGET)
    out = tvm.runtime.tensor(np.zeros(q.shape[:-1] + (k.shape[-2],), "float32"), DEV)
    rt(*(tvm.runtime.tensor(a, DEV) for a in (q, k, cos, sin)), out)
    return out.numpy()


def test_rope_preserves_norms_per_position():
    shape = _shape(12, 12, d=16)
    q, _, cos, sin = rq.make_inputs(shape, "float32", 0)
    rotated = rq.apply_rope(q, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(q.astype(np.float64), axis=-1),
                               rtol=1e-6)
    # Position 0 is the identity; later positions really rotate.
    np.testing.assert_allclose(rotated[..., 0, :], q[..., 0, :], rtol=1e-6)
    assert not np.allclose(rotated[..., 1:, :], q[..., 1:, :], atol=1e-3)


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "key_tiles"])
def test_kernel_rotation_is_orthogonal(schedule):
    # q == k at the same positions: the diagonal score is |rope(q_i)|^2 / sqrt(D) = |q_i|^2 / sqrt(D).
    shape = _shape(16, 16, d=16)
    q, _, cos, sin = rq.make_inputs(shape, "float32", 1)
    scores = _run(shape, q, q.copy(), cos, sin, schedule)
    diag = np.diagonal(scores, axis1=-2, axis2=-1)
    np.testing.assert_allclose(diag, (q.astype(np.float64) ** 2).sum(-1) / math.sqrt(16), rtol=1e-5)


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "key_tiles"])
def test_short_queries_are_aligned_at_the_end(schedule):
    full = _shape(12, 12)
    q_full, k, cos, sin = rq.make_inputs(full, "float32", 2)
    want = _run(full, q_full, k, cos, sin, schedule)[..., -4:, :]
    short = _shape(4, 12)
    q = np.ascontiguousarray(q_full[..., -4:, :])
    got = _run(short, q, k, cos, sin, schedule)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, rq.reference(q, k, cos, sin), rtol=1e-4, atol=1e-5)
    # Taking the first rows instead would be a different answer.
    assert not np.allclose(got, _run(full, q_full, k, cos, sin, schedule)[..., :4, :], atol=1e-3)


def test_scores_depend_on_relative_position_only():
    # The same query and key vector everywhere: score(i, j) is a function of pos_i - pos_j, so
    # stepping both one position on keeps it (query i sits at position 4 + i here).
    shape = _shape(6, 10)
    _, _, cos, sin = rq.make_inputs(shape, "float32", 3)
    rng = np.random.default_rng(4)
    q = np.broadcast_to(rng.standard_normal(8), (1, 2, 6, 8)).astype("float32")
    k = np.broadcast_to(rng.standard_normal(8), (1, 2, 10, 8)).astype("float32")
    s = rq.reference(q, k, cos, sin).astype(np.float64)
    for i in range(5):
        for j in range(9):
            assert abs(s[0, 0, i, j] - s[0, 0, i + 1, j + 1]) < 1e-5, (i, j)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        rq.build(_shape(12, 8), "float32")
    with pytest.raises(ValueError):
        rq.build(_shape(4, 8, d=7), "float32")
