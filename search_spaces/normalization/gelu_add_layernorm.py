"""gelu_add_layernorm: y = LayerNorm(GELU(x) + r) * gamma + beta over the last axis.

Exact (erf) GELU, eps = 1e-5, biased variance. Four sblocks: ``gelu_add`` (h), ``mean`` and
``sumsq`` (float32 row sums of h and h*h) and ``norm``. Unfused, h goes to memory and is read back
three times; fused per row it stays in L1, registers or shared memory, or is recomputed in each pass
(``row_recompute``, ``cuda_rows_recompute``). erf is the rational ``erf_f32`` (LLVM makes ``T.erf``
a scalar libm call per element); ``build_with(..., "libm")`` keeps ``T.erf``. Everything is float32
in every dtype, each output rounded once.
"""

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.pattern import Pattern, onnx_model, template
from search_spaces.lib.cpu_rows import parallel_rows, rfactor_lanes, vectorize_rf
from search_spaces.lib.cuda_rows import output_rows, unroll_chunks, vector_load
from search_spaces.lib.layernorm import EPS, ROWS_HIDDEN, layernorm, layernorm_stages
from search_spaces.lib.layernorm import residual_inputs as make_inputs
from search_spaces.lib.tiling import unroll, vectorize_inner
from search_spaces.lib.tir_math import dtype_bytes, erf_f32

ERF = "rational"
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def build(shape, dtype):
    return build_with(shape, dtype, ERF)


def build_with(shape, dtype, erf_impl):
    """``erf_impl``: "rational" (``erf_f32``, vectorises) or "libm" (``T.erf``, which LLVM lowers
    to one scalar ``erff`` call per element, even inside a vectorised loop)."""
    if erf_impl not in ("rational", "libm"):
        raise ValueError(f"erf_impl must be 'rational' or 'libm', not {erf_impl!r}")
    erf = erf_f32 if erf_impl == "rational" else tirx.erf
    rows, hidden = shape["rows"], shape["hidden"]
    stages = layernorm_stages()

    @T.prim_func(s_tir=True)
    def gelu_add_layernorm(x: T.Buffer((rows, hidden), dtype), r: T.Buffer((rows, hidden), dtype),
                           gamma: T.Buffer((hidden,), dtype), beta: T.Buffer((hidden,), dtype),
                           y: T.Buffer((rows, hidden), dtype)):
        T.func_attr({"global_symbol": "gelu_add_layernorm", "tirx.noalias": True})
        h = T.sblock_alloc_buffer((rows, hidden), "float32")
        for i, j in T.grid(rows, hidden):
            with T.sblock("gelu_add"):
                vi, vj = T.axis.remap("SS", [i, j])
                # No T.let for x here: with the libm erf, a let used inside T.erf in a vectorised
                # loop is lost when the call is scalarised (MakePackedAPI: "variables (xv,) are
                # used, but are not passed in as API arguments").
                h[vi, vj] = (T.float32(0.5) * T.Cast("float32", x[vi, vj])
                             * (T.float32(1) + erf(T.Cast("float32", x[vi, vj]) * T.float32(_INV_SQRT2)))
                             + T.Cast("float32", r[vi, vj]))
        stages(lambda i, k: h[i, k], gamma, beta, y, rows, hidden)

    return gelu_add_layernorm


_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_exact(x):
    """0.5 * x * (1 + erf(x / sqrt(2))) in float64, erf from ``math.erf`` (no scipy needed)."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + _erf(x * _INV_SQRT2).astype(np.float64))


def reference(x, r, gamma, beta):
    h = gelu_exact(x) + r.astype(np.float64)
    return layernorm(h, gamma, beta).astype(x.dtype)


def flops(shape):
    # GELU ~ 4 (+ erf as one op), add 1, mean 1, sumsq 2, normalise+affine 4 per element.
    return 13.0 * shape["rows"] * shape["hidden"]


def nbytes(shape, dtype):
    rows, hidden = shape["rows"], shape["hidden"]
    return np.dtype(dtype).itemsize * (3 * rows * hidden + 2 * hidden)


def _row_fused(sch, knobs, recompute):
    norm = sch.get_sblock("norm")
    if recompute:
        sch.compute_inline(sch.get_sblock("gelu_add"))
    mean_rf, mean = rfactor_lanes(sch, knobs, "mean", 16)
    sq_rf, sq = rfactor_lanes(sch, knobs, "sumsq", 16)
    i0, i1 = parallel_rows(sch, knobs, norm, 16)
    # Producers join the output at its row loop, in reverse order so each lands before the last.
    for blk in (sq, sq_rf, mean, mean_rf):
        sch.compute_at(blk, i1, preserve_unit_loops=True)
    if not recompute:
        gelu = sch.get_sblock("gelu_add")
        sch.compute_at(gelu, i1, preserve_unit_loops=True)
        vectorize_inner(sch, knobs, sch.get_loops(gelu)[-1])
    for rf in (mean_rf, sq_rf):
        vectorize_rf(sch, rf)
    unroll(sch, knobs, i0)


@template("row_fused")
def row_fused(sch, target, knobs):
    """Rows split and run in parallel; per row, GELU+add is materialised once into a row buffer
    (L1), then the mean and sum-of-squares passes (vectorised through an rfactor over a lane
    tile, float32) and the vectorised normalise pass read it back. Lowering shrinks h to one
    row per parallel task (the buffer's allocation moves under the row loop it is used in).
    The default: one erf per element instead of three, twice as fast as row_recompute."""
    _row_fused(sch, knobs, recompute=False)


@template("row_recompute")
def row_recompute(sch, target, knobs):
    """As row_fused, but GELU+add is inlined into its three consumers: no row buffer, the erf
    computed three times per element."""
    _row_fused(sch, knobs, recompute=True)


def _gelu_layernorm_cuda(sch, target, knobs, keep):
    """``keep``: where the float32 row of h = GELU(x) + r lives between the three passes:
    "local" (registers), "shared", or None (GELU+add recomputed in each pass from x and r)."""
    gelu = sch.get_sblock("gelu_add")
    mean, sq, norm = (sch.get_sblock(n) for n in ("mean", "sumsq", "norm"))
    itemsize = dtype_bytes(sch.get(norm).writes[0].source.dtype)
    # The row kept is h, float32 in every dtype.
    rows, keep, loops = output_rows(sch, target, knobs, norm, (sq, mean), itemsize, keep, keep_bytes=4)
    if keep is None:
        sch.compute_inline(gelu)
        readers = [mean, sq, norm]
    else:
        sch.set_scope(gelu, 0, keep)
        loops[gelu] = rows.attach(sch, gelu)
        readers = [gelu]
    for blk in readers:
        for name in ("x", "r"):
            vector_load(sch, blk, name, loops[blk][2])
    for name in ("gamma", "beta"):
        vector_load(sch, norm, name, rows.loops[2])
    unroll_chunks(sch, loops.values())


@template("cuda_rows", target_kinds=("cuda",))
def cuda_rows(sch, target, knobs):
    """A warp (short rows) or a block (long rows) per row; x and r loaded with vector loads,
    GELU+add computed once into a float32 row held in registers; mean and sum of squares as
    cross-thread reductions (warp shuffles, shared memory across warps); the normalise pass writes
    y from the registers with vector stores. (``lib.cuda_rows.CudaRows``.)"""
    _gelu_layernorm_cuda(sch, target, knobs, "local")


@template("cuda_rows_smem", target_kinds=("cuda",))
def cuda_rows_smem(sch, target, knobs):
    """As cuda_rows, with the float32 row of GELU+add in shared memory instead of registers
    (computed coalesced across threads)."""
    _gelu_layernorm_cuda(sch, target, knobs, "shared")


@template("cuda_rows_recompute", target_kinds=("cuda",))
def cuda_rows_recompute(sch, target, knobs):
    """As cuda_rows, but GELU+add is inlined into its three readers: x and r are loaded (from L1
    after the first pass) and the erf computed three times, nothing of the row kept."""
    _gelu_layernorm_cuda(sch, target, knobs, None)


def onnx_graph(shape, dtype):
    """Exact GELU spelled out in Div/Erf/Add/Mul (opset 17 has no Gelu), Add, LayerNormalization."""
    from onnx import helper
    rows, hidden = shape["rows"], shape["hidden"]
    consts = {"sqrt2": np.array(np.sqrt(2.0), dtype), "one": np.array(1.0, dtype), "half": np.array(0.5, dtype)}
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["xs"]), helper.make_node("Erf", ["xs"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["x", "e1"], ["xe"]),
             helper.make_node("Mul", ["xe", "half"], ["g"]), helper.make_node("Add", ["g", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["y"], axis=-1, epsilon=EPS)]
    return onnx_model("gelu_add_layernorm", nodes,
                      [("x", (rows, hidden)), ("r", (rows, hidden)), ("gamma", (hidden,)), ("beta", (hidden,))],
                      [("y", (rows, hidden))], dtype, consts)

PATTERN = Pattern.from_module(
    globals(),
    description="LayerNorm(GELU(x) + r) * gamma + beta over the last axis, exact (erf) GELU, eps=1e-5",
    shape_params=list(ROWS_HIDDEN),
    # The first CUDA template is the default of builds without records: the fastest on the H200
    # (benchmarks/results/h200/check-rows-*.json, check-large-*.json).
    templates=[row_fused, row_recompute, cuda_rows_recompute, cuda_rows, cuda_rows_smem],
)
