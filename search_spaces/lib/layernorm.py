"""LayerNorm over the last axis as the normalization patterns define it: eps, its three TensorIR
stages (``layernorm_stages``), the float64 numpy reference, the (rows, hidden) shape parameters,
and the seeded (x, r, gamma, beta) inputs of a residual-then-LayerNorm kernel."""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import ShapeParam
from search_spaces.lib.stages import row_sum_stage

EPS = 1e-5

# The shape parameters of a LayerNorm pattern, what ``residual_inputs`` reads.
ROWS_HIDDEN = (ShapeParam("rows", 512, 8, "rows (tokens); LayerNorm is over each row"),
               ShapeParam("hidden", 768, 64, "hidden size (the normalised axis)"))


def layernorm(h, gamma, beta, eps=EPS):
    """LayerNorm of h over its last axis, biased (1/hidden) variance, in float64."""
    h = np.asarray(h, dtype=np.float64)
    mu = h.mean(axis=-1, keepdims=True)
    var = ((h - mu) ** 2).mean(axis=-1, keepdims=True)
    return (h - mu) / np.sqrt(var + eps) * gamma.astype(np.float64) + beta.astype(np.float64)


def residual_inputs(shape, dtype, seed):
    """x, r (rows, hidden) unit normal, gamma ~ 1 and beta ~ 0 (hidden,)."""
    rng = np.random.default_rng(seed)
    rows, hidden = shape["rows"], shape["hidden"]
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((rows, hidden)), rng.standard_normal((rows, hidden)),
              1.0 + 0.1 * rng.standard_normal(hidden), 0.1 * rng.standard_normal(hidden)]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def layernorm_stages():
    """A fresh ``T.macro`` writing LayerNorm's stages over rows of ``h``: ``mean`` and ``sumsq``
    (float32 row sums of h and h*h, in buffers it allocates) and ``norm`` (var = sumsq/hidden -
    mean^2, biased; y rounded to its dtype once). Called in a prim_func as ``stages(h_at, gamma,
    beta, y, rows, hidden)``, ``h_at(row, col)`` loading h as float32. Fresh per prim_func: a macro
    renames its blocks from its second call on, and templates find them by name."""

    @T.macro
    def stages(h_at, gamma, beta, y, rows, hidden):
        row_sum = T.sblock_alloc_buffer((rows,), "float32")
        row_sq = T.sblock_alloc_buffer((rows,), "float32")
        row_sum_stage("mean", row_sum, (rows, hidden), h_at)
        row_sum_stage("sumsq", row_sq, (rows, hidden), lambda i, k: h_at(i, k) * h_at(i, k))
        for i, j in T.grid(rows, hidden):
            with T.sblock("norm"):
                vi, vj = T.axis.remap("SS", [i, j])
                mu: T.let = row_sum[vi] * T.float32(1.0 / hidden)
                var: T.let = T.max(row_sq[vi] * T.float32(1.0 / hidden) - mu * mu, T.float32(0))
                y[vi, vj] = T.Cast(y.dtype, (h_at(vi, vj) - mu) * T.rsqrt(var + T.float32(EPS))
                                   * T.Cast("float32", gamma[vj]) + T.Cast("float32", beta[vj]))

    return stages
