"""softmax_dropout: y = dropout(softmax(x, axis=-1)), the row softmax with its dropout fused.

The dropout mask is no random state but a hash of (seed, flat index) (``lib.tir_math.hash_keep``),
so kernel and numpy reference agree bit for bit and the kernel reads and writes no mask. Three
sblocks, ``row_max``, ``exp_sum`` and ``norm_dropout``: unfused, the max, the sum and the
exponentials round-trip through memory; fused, a row stays in L1 (CPU) or in registers or shared
memory (CUDA, ``lib.cuda_rows``) across the passes. The exponential is the polynomial ``exp_f32``
(``T.exp`` is a scalar call per lane on x86). Statistics are float32 in every dtype, each output
rounded once. ``p_permille`` sets p (0 is inference, plain softmax, what models match);
``build_with`` takes any p and seed.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import Pattern, RelaxRule, ShapeParam, dtype_of, onnx_model, static_shape, template
from search_spaces.lib.cpu_rows import lanes_innermost, parallel_rows, rfactor_lanes
from search_spaces.lib.cuda_rows import output_rows, unroll_chunks, vector_load
from search_spaces.lib.stages import row_sum_stage
from search_spaces.lib.tiling import unroll
from search_spaces.lib.tir_math import DROPOUT_P as P  # noqa: F401 (the default p)
from search_spaces.lib.tir_math import DROPOUT_SEED as SEED
from search_spaces.lib.tir_math import (DROPOUT_PERMILLE, dropout_constants, dropout_mask, dropout_p, dtype_bytes,
                                       exp_f32, hash_keep)


def _exp_masked(v, row_max):
    """exp(v - row_max), exactly 0 where v is -inf (exp_f32 alone clamps to exp(-87)): a row of
    -inf only (a fully masked attention row) then sums to 0 and comes out NaN (0 * inf), as in
    numpy and onnxruntime; exporters' graphs test for that NaN (IsNaN -> Where)."""
    return T.Select(v == T.float32("-inf"), T.float32(0), exp_f32(v - row_max))


def build(shape, dtype):
    return build_with(shape, dtype, dropout_p(shape), SEED)


def build_with(shape, dtype, p, seed):
    """The kernel with dropout probability ``p`` and mask seed ``seed`` baked in as constants."""
    rows, cols = shape["rows"], shape["cols"]
    mix, thresh, scale = dropout_constants(p, seed, rows, cols)

    @T.prim_func(s_tir=True)
    def softmax_dropout(x: T.Buffer((rows, cols), dtype), y: T.Buffer((rows, cols), dtype)):
        T.func_attr({"global_symbol": "softmax_dropout", "tirx.noalias": True})
        row_max = T.sblock_alloc_buffer((rows,), "float32")
        row_sum = T.sblock_alloc_buffer((rows,), "float32")
        for i, k in T.grid(rows, cols):
            with T.sblock("row_max"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    row_max[vi] = T.min_value("float32")
                row_max[vi] = T.max(row_max[vi], T.Cast("float32", x[vi, vk]))
        row_sum_stage("exp_sum", row_sum, (rows, cols),
                      lambda i, k: _exp_masked(T.Cast("float32", x[i, k]), row_max[i]))
        for i, j in T.grid(rows, cols):
            with T.sblock("norm_dropout"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast(dtype, T.Select(
                    hash_keep(vi * cols + vj, mix, thresh),
                    _exp_masked(T.Cast("float32", x[vi, vj]), row_max[vi])
                    * (T.float32(scale) / row_sum[vi]),
                    T.float32(0)))

    return softmax_dropout


def reference_with(x, p, seed):
    xf = x.astype(np.float64)
    e = np.exp(xf - xf.max(axis=-1, keepdims=True))
    soft = e / e.sum(axis=-1, keepdims=True)
    keep = dropout_mask(x.shape[0], x.shape[1], p, seed)
    return np.where(keep, soft / (1.0 - p), 0.0).astype(x.dtype)


def reference(x, shape=None):
    return reference_with(x, dropout_p(shape or {}), SEED)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    return [(rng.standard_normal((shape["rows"], shape["cols"])) * 2.0).astype(np.float32).astype(dtype)]


def flops(shape):
    # max, sub+exp+add, sub+exp+mul+select per element (exp counted as one op), the hash ignored.
    return 9.0 * shape["rows"] * shape["cols"]


def nbytes(shape, dtype):
    return np.dtype(dtype).itemsize * 2 * shape["rows"] * shape["cols"]


@template("row_parallel")
def row_parallel(sch, target, knobs):
    """Rows split and run in parallel; both reductions compute_at the inner row loop, each
    vectorised through an rfactor over a lane tile; the normalise+dropout pass vectorised."""
    max_rf, max_fin = rfactor_lanes(sch, knobs, "row_max", 32, max_lanes=32)
    sum_rf, sum_fin = rfactor_lanes(sch, knobs, "exp_sum", 16, max_lanes=32)
    i0, i1 = parallel_rows(sch, knobs, sch.get_sblock("norm_dropout"), 32)
    # All four reduction blocks join the row loop (consumers first), so a row's max and sum are
    # per-thread scalars and the row stays in L1 across the three passes.
    for blk in (sum_fin, sum_rf, max_fin, max_rf):
        sch.compute_at(blk, i1, preserve_unit_loops=True)

    for rf in (max_rf, sum_rf):
        # compute_at regenerates the rf block's loops in its iter order: lanes, row (unit), k0.
        _, _, lanes, row, k0 = sch.get_loops(rf)
        lanes_innermost(sch, rf, lanes, (row, k0))
    unroll(sch, knobs, i0)


# ---- CUDA ------------------------------------------------------------------------------------


def _softmax_cuda(sch, target, knobs, keep):
    """``keep``: where the row of x lives across the three passes: "local" (registers), "shared"
    or None (each pass loads it again, through L1). A row too long for shared memory is re-read."""
    norm = sch.get_sblock("norm_dropout")
    row_max, exp_sum = sch.get_sblock("row_max"), sch.get_sblock("exp_sum")
    itemsize = dtype_bytes(sch.get(norm).reads[0].source.dtype)
    rows, keep, loops = output_rows(sch, target, knobs, norm, (exp_sum, row_max), itemsize, keep)
    if keep is None:
        for blk, (_, _, kc, _) in loops.items():
            vector_load(sch, blk, "x", kc)
    else:
        # Read by all three passes; placed before the first, under the thread block's loop.
        _, _, kc, kv = rows.attach(sch, sch.cache_read(row_max, "x", keep))
        sch.unroll(kc)
        sch.vectorize(kv)
    unroll_chunks(sch, loops.values())


@template("cuda_rows", target_kinds=("cuda",))
def cuda_rows(sch, target, knobs):
    """A warp (short rows) or a block (long rows) per row; the row of x loaded once into
    registers, vectorised; max and sum as cross-thread reductions (warp shuffles, and shared
    memory across warps); the normalise+dropout pass writes y from the registers, vectorised."""
    _softmax_cuda(sch, target, knobs, "local")


@template("cuda_rows_smem", target_kinds=("cuda",))
def cuda_rows_smem(sch, target, knobs):
    """As cuda_rows, with the row of x staged in shared memory (loads coalesced across threads)
    instead of registers."""
    _softmax_cuda(sch, target, knobs, "shared")


@template("cuda_rows_reread", target_kinds=("cuda",))
def cuda_rows_reread(sch, target, knobs):
    """As cuda_rows, but each of the three passes loads its part of x again (L1/L2 hits after the
    first): no limit on the row length from registers or shared memory."""
    _softmax_cuda(sch, target, knobs, None)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x = wildcard()
    root = is_op("relax.nn.softmax")(x)
    # The root is in the dict too: the rewriter gets matches by name only, and the axis is an
    # attribute of the matched call.
    return root, {"x": x, "call": root}


def _relax_rewrite(matched, kernel):
    """softmax(x, axis=last) on float32 x of rank >= 2 -> the kernel with p = 0 (inference), the
    leading axes flattened into rows."""
    from tvm import relax
    x, call = matched["x"], matched["call"]
    xs = static_shape(x)
    if xs is None or len(xs) < 2 or dtype_of(x) != "float32":
        return None
    if int(call.attrs.axis) not in (-1, len(xs) - 1):
        return None
    rows, cols = int(np.prod(xs[:-1])), xs[-1]
    if rows * cols >= 1 << 31:
        return None
    x2d = x if len(xs) == 2 else relax.op.reshape(x, (rows, cols))
    out = kernel({"rows": rows, "cols": cols, "p_permille": 0}, "float32", [x2d])
    return out if len(xs) == 2 else relax.op.reshape(out, xs)


def onnx_graph(shape, dtype):
    """Softmax times a constant keep/(1-p) mask. seed and p are compile-time constants, so the mask
    is one too: the baselines read it from memory where our kernel hashes it in registers."""
    from onnx import helper
    rows, cols = shape["rows"], shape["cols"]
    p = dropout_p(shape)
    scale = np.where(dropout_mask(rows, cols, p, SEED), 1.0 / (1.0 - p), 0.0).astype(dtype)
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1), helper.make_node("Mul", ["s", "keep_scale"], ["y"])]
    return onnx_model("softmax_dropout", nodes, [("x", (rows, cols))], [("y", (rows, cols))], dtype,
                      {"keep_scale": scale})

PATTERN = Pattern.from_module(
    globals(),
    description="dropout(softmax(x, axis=-1)) with a hashed (seed, index) keep mask, p=0.1",
    shape_params=[ShapeParam("rows", 512, 8, "rows (softmax is over each row)"),
                  ShapeParam("cols", 1024, 64, "columns (the softmax axis)"),
                  DROPOUT_PERMILLE],
    # The first CUDA template is the default of builds without records: the fastest on the H200
    # (benchmarks/results/h200/check-rows-*.json, check-large-*.json).
    templates=[row_parallel, cuda_rows_reread, cuda_rows, cuda_rows_smem],
    relax_rules=[RelaxRule("softmax_last_axis", _relax_pattern, _relax_rewrite)],
)
