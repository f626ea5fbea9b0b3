"""The shape parameters of the GEMM and FFN patterns (``gemm_shape``, ``ffn_shape``); their
reduction stage is ``stages.matmul_stage``, its CPU and CUDA schedules ``cpu_gemm`` and
``cuda_gemm``."""

from autofuse.pattern import ShapeParam


def gemm_shape(m, n, k):
    """Shape parameters ``m``, ``n``, ``k`` of y = x W^T (x m x k, W n x k), (default, small) each."""
    return [ShapeParam("m", *m, "rows of x (tokens)"),
            ShapeParam("n", *n, "output features (rows of W)"),
            ShapeParam("k", *k, "input features (the reduction)")]


def ffn_shape(tokens, hidden, inter):
    """Shape parameters ``tokens``, ``hidden``, ``inter`` of a feed-forward block (model width
    hidden -> inter -> hidden), (default, small) each."""
    return [ShapeParam("tokens", *tokens, "tokens (rows of x)"),
            ShapeParam("hidden", *hidden, "model width (x and y)"),
            ShapeParam("inter", *inter, "intermediate width of the FFN")]
