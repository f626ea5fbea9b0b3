"""TensorIR stages several patterns write alike: the GEMM reduction (``matmul_stage``) and the sum
over a row (``row_sum_stage``). Each is called inside a ``T.prim_func`` (or a macro) and writes one
block of the name its caller gives; each call parses a fresh ``T.macro``, since a macro suffixes its
blocks' names from its second call on and templates find blocks by name."""

from tvm.script import tirx as T


def matmul_stage(name, acc, extents, product):
    """Writes, inside a ``T.prim_func``, the block ``name`` over spatial i, spatial j, reduction k
    (``extents`` = (m, n, k)): ``acc[i, j]`` starts at 0 of its dtype and adds ``product(i, j, k)``
    (the casts of the operands included)."""

    @T.macro
    def stage(name, acc, extents, product):
        for i, j, kk in T.grid(*extents):
            with T.sblock(name):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.cast(0, acc.dtype)
                acc[vi, vj] = acc[vi, vj] + product(vi, vj, vk)

    stage(name, acc, extents, product)


def row_sum_stage(name, acc, extents, value):
    """Writes the block ``name`` over spatial i, reduction j (``extents`` = (rows, cols)):
    ``acc[i]`` starts at 0 of its dtype and adds ``value(i, j)``."""

    @T.macro
    def stage(name, acc, extents, value):
        for i, j in T.grid(*extents):
            with T.sblock(name):
                vi, vj = T.axis.remap("SR", [i, j])
                with T.init():
                    acc[vi] = T.cast(0, acc.dtype)
                acc[vi] = acc[vi] + value(vi, vj)

    stage(name, acc, extents, value)
