"""layernorm_residual: h = x + r; y = LayerNorm(h) * gamma + beta over the last axis; returns both.

The pre-norm transformer residual: h is the next residual stream, y feeds the next sublayer.
eps = 10^-eps_exp (1e-5 by default; BERT and ViT use 1e-12), biased variance. Four sblocks: ``add`` (h), ``mean``, ``sumsq`` and ``norm`` (y).
Unfused, h is written and read back three times; fused per row, the passes read the row just
written from L1, registers or shared memory. h is an output in the dtype, so the float32 statistics
are taken from the rounded h, as the reference does. Parameters: x, r, gamma, beta, h, y.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import FLOAT_DTYPES, Pattern, RelaxRule, dtype_of, onnx_model, static_shape, template
from search_spaces.lib import cpu_rows
from search_spaces.lib import cuda_rows as cuda_rows_lib
from search_spaces.lib.layernorm import ROWS_HIDDEN, eps_exp_of, eps_of, eps_param, layernorm, layernorm_stages
from search_spaces.lib.layernorm import residual_inputs as make_inputs


def build(shape, dtype):
    rows, hidden = shape["rows"], shape["hidden"]
    stages = layernorm_stages(eps_of(shape))

    @T.prim_func(s_tir=True)
    def layernorm_residual(x: T.Buffer((rows, hidden), dtype), r: T.Buffer((rows, hidden), dtype),
                           gamma: T.Buffer((hidden,), dtype), beta: T.Buffer((hidden,), dtype),
                           h: T.Buffer((rows, hidden), dtype), y: T.Buffer((rows, hidden), dtype)):
        T.func_attr({"global_symbol": "layernorm_residual", "tirx.noalias": True})
        for i, j in T.grid(rows, hidden):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                h[vi, vj] = x[vi, vj] + r[vi, vj]
        stages(lambda i, k: T.Cast("float32", h[i, k]), gamma, beta, y, rows, hidden)

    return layernorm_residual


def reference(x, r, gamma, beta, shape):
    # h is an output in the dtype, and the kernel normalises that stored h: so does the reference.
    h = (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype)
    return h, layernorm(h, gamma, beta, eps_of(shape)).astype(x.dtype)


def flops(shape):
    # add 1, mean 1, sumsq 2, normalise+affine 4 per element.
    return 8.0 * shape["rows"] * shape["hidden"]


def nbytes(shape, dtype):
    rows, hidden = shape["rows"], shape["hidden"]
    return np.dtype(dtype).itemsize * (4 * rows * hidden + 2 * hidden)


@template("row_fused")
def row_fused(sch, target, knobs):
    """Rows split and run in parallel; per row the residual add writes h, the mean and
    sum-of-squares passes re-read it from L1 (vectorised through an rfactor over a lane tile,
    float32) and the vectorised normalise pass writes y."""
    cpu_rows.residual_norm_rows(sch, knobs, ("mean", "sumsq"))


def _layernorm_residual_cuda(sch, target, knobs, keep):
    """``lib.cuda_rows.residual_norm_rows`` over the mean and sum-of-squares passes."""
    cuda_rows_lib.residual_norm_rows(sch, target, knobs, keep, ("mean", "sumsq"), ("gamma", "beta"))


@template("cuda_rows", target_kinds=("cuda",))
def cuda_rows(sch, target, knobs):
    """A warp (short rows) or a block (long rows) per row; x and r loaded with vector loads, the
    row of h = x + r kept in registers and stored with vector stores; mean and sum of squares as
    cross-thread reductions (warp shuffles, shared memory across warps); y written from the
    registers with vector stores. (``lib.cuda_rows.CudaRows``.)"""
    _layernorm_residual_cuda(sch, target, knobs, "local")


@template("cuda_rows_smem", target_kinds=("cuda",))
def cuda_rows_smem(sch, target, knobs):
    """As cuda_rows, with the row of h in shared memory (coalesced across threads)."""
    _layernorm_residual_cuda(sch, target, knobs, "shared")


@template("cuda_rows_reread", target_kinds=("cuda",))
def cuda_rows_reread(sch, target, knobs):
    """As cuda_rows, but the passes after the add read h back from global memory (each thread
    the elements it stored, so no barrier; L1 hits)."""
    _layernorm_residual_cuda(sch, target, knobs, None)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    a, b, gamma, beta = wildcard(), wildcard(), wildcard(), wildcard()
    root = is_op("relax.nn.layer_norm")(is_op("relax.add")(a, b), gamma, beta)
    return root, {"a": a, "b": b, "gamma": gamma, "beta": beta, "call": root}


def _relax_rewrite(matched, kernel):
    """layer_norm(a + b, gamma, beta) over the last axis, all of one of the pattern's dtypes,
    eps a power of ten -> the kernel's y, a and b (same shape, no broadcasting) flattened to (rows, hidden).

    Known limitation: only the root (the layer_norm) is replaced. The kernel also writes h = a + b,
    but that output is unused here: the original add stays for its other users (in a pre-norm
    block, the next residual add), so h is computed twice. Routing those users to the kernel's h
    needs a rewrite over several bindings (``rewrite_bindings``), not ``rewrite_call``.
    """
    from tvm import relax
    a, b, gamma, beta, call = (matched[k] for k in ("a", "b", "gamma", "beta", "call"))
    shape = static_shape(a)
    if shape is None or len(shape) < 1 or static_shape(b) != shape:
        return None
    hidden = shape[-1]
    if static_shape(gamma) != (hidden,) or static_shape(beta) != (hidden,):
        return None
    dtype = dtype_of(a)
    if dtype not in FLOAT_DTYPES or any(dtype_of(t) != dtype for t in (b, gamma, beta)):
        return None
    attrs = call.attrs
    if [int(v) for v in attrs.axes] not in ([-1], [len(shape) - 1]) or not attrs.center or not attrs.scale:
        return None
    eps_exp = eps_exp_of(float(attrs.epsilon))
    if eps_exp is None:
        return None
    rows = int(np.prod(shape[:-1]))
    flat = (lambda t: t) if len(shape) == 2 else (lambda t: relax.op.reshape(t, (rows, hidden)))
    out = kernel({"rows": rows, "hidden": hidden, "eps_exp": eps_exp}, dtype, [flat(a), flat(b), gamma, beta])
    y = relax.TupleGetItem(out, 1)
    return y if len(shape) == 2 else relax.op.reshape(y, shape)


def onnx_graph(shape, dtype):
    from onnx import helper
    rows, hidden = shape["rows"], shape["hidden"]
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["y"], axis=-1, epsilon=eps_of(shape))]
    return onnx_model("layernorm_residual", nodes,
                      [("x", (rows, hidden)), ("r", (rows, hidden)), ("gamma", (hidden,)), ("beta", (hidden,))],
                      [("h", (rows, hidden)), ("y", (rows, hidden))], dtype)

PATTERN = Pattern.from_module(
    globals(),
    description="h = x + r; y = LayerNorm(h) * gamma + beta over the last axis (eps=10^-eps_exp); outputs h and y",
    shape_params=[*ROWS_HIDDEN, eps_param(5)],
    # The first CUDA template is the default of builds without records: the fastest on the H200
    # (benchmarks/results/h200/check-rows-*.json, check-large-*.json).
    templates=[row_fused, cuda_rows_smem, cuda_rows_reread, cuda_rows],
    num_outputs=2,
    relax_rules=[RelaxRule("add_layer_norm", _relax_pattern, _relax_rewrite)],
)
