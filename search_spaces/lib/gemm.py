"""GEMM pieces that do not depend on the target: the shape parameters of the GEMM and FFN patterns
(``gemm_shape``, ``ffn_shape``) and their TensorIR reduction stage (``matmul_stage``); the CPU and
CUDA schedules of that stage are ``cpu_gemm`` and ``cuda_gemm``."""

from tvm.script import tirx as T

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


def matmul_stage(name, acc, extents, product):
    """Writes, inside a ``T.prim_func``, the block ``name`` over spatial i, spatial j, reduction k
    (``extents`` = (m, n, k)): ``acc[i, j]`` starts at 0 of its dtype and adds ``product(i, j, k)``
    (the casts of the operands included). Its block keeps ``name`` however often it is called:
    each call parses a fresh macro (a macro suffixes its blocks' names from its second call on)."""

    @T.macro
    def stage(name, acc, extents, product):
        for i, j, kk in T.grid(*extents):
            with T.sblock(name):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.cast(0, acc.dtype)
                acc[vi, vj] = acc[vi, vj] + product(vi, vj, vk)

    stage(name, acc, extents, product)
