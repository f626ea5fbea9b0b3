"""LayerNorm over the last axis as the normalization patterns define it: eps, the float64 numpy
reference, and the seeded (x, r, gamma, beta) inputs of a residual-then-LayerNorm kernel."""

import numpy as np

EPS = 1e-5


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
