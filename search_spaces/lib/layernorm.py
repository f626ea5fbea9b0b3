"""LayerNorm over the last axis as the normalization patterns define it: eps (a power of ten, a
shape parameter where models differ: 1e-5 in GPT-2, 1e-12 in BERT and ViT, 1e-6 in Llama's
RMSNorm), its three TensorIR stages (``layernorm_stages``), the float64 numpy reference, the
(rows, hidden) shape parameters, and the seeded (x, r, gamma, beta) inputs of a
residual-then-LayerNorm kernel."""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import ShapeParam
from search_spaces.lib.stages import row_sum_stage

EPS = 1e-5

# The shape parameters of a LayerNorm pattern, what ``residual_inputs`` reads.
ROWS_HIDDEN = (ShapeParam("rows", 512, 8, "rows (tokens); LayerNorm is over each row"),
               ShapeParam("hidden", 768, 64, "hidden size (the normalised axis)"))


def eps_param(default_exp: int) -> ShapeParam:
    """The ``eps_exp`` shape parameter: eps = 10^-eps_exp."""
    return ShapeParam("eps_exp", default_exp, default_exp, "eps = 10^-eps_exp", minimum=1)


def eps_of(shape, default_exp: int = 5) -> float:
    """A shape's eps (``eps_param``; ``default_exp`` where it has none)."""
    return 10.0 ** -shape.get("eps_exp", default_exp)


def eps_exp_of(eps: float) -> int | None:
    """The eps_exp of a model's eps (a float32 constant: 1e-6 arrives as 9.99999997e-07), None
    where eps is no power of ten."""
    import math
    if eps <= 0:
        return None
    exp = round(-math.log10(eps))
    return exp if exp >= 1 and math.isclose(eps, 10.0 ** -exp, rel_tol=1e-5) else None


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


def layernorm_stages(eps=EPS):
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
                y[vi, vj] = T.Cast(y.dtype, (h_at(vi, vj) - mu) * T.rsqrt(var + T.float32(eps))
                                   * T.Cast("float32", gamma[vj]) + T.Cast("float32", beta[vj]))

    return stages
