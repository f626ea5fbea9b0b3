"""linear_bias_relu: y = relu(x @ W^T + b), the GEMM with its epilogue fused.

Unfused, the GEMM writes m*n values that the bias and ReLU read back; fused, the epilogue runs on
the accumulator tile while it is in registers. The accumulator, bias and ReLU are float32 in every
dtype and y is rounded once; casts appear only where dtypes differ, so the float32 function (whose
structural hash keys the tuning records) stays as it was.

CUDA templates (``search_spaces.lib.cuda_gemm``): ``cuda_tiled_epilogue``, SIMT register tiles over
x and W k-tiles staged through padded shared memory and software-pipelined; ``cuda_wmma``, float16
tensor cores through TVM's WMMA intrinsics (other dtypes, and sizes not multiples of 16, fall back
to the former). Neither drops the function's global ``acc`` (see ``cuda_drop_acc``). On sm_90 in
float16/bfloat16, at multiples of its tile, the kernel template ``cuda_wgmma`` comes first: Hopper
TMA + wgmma in the tirx script (``search_spaces.lib.cuda_wgmma``), which schedule primitives cannot
reach; before it, at up to 256 rows, ``cuda_wgmma_split_k``, the same GEMM with K split among CTAs
(a skinny GEMM's few tiles would leave SMs idle or read all of K through each).
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import FLOAT_DTYPES, Pattern, RelaxRule, dtype_of, onnx_model, static_shape, template
from search_spaces.lib import cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import (cuda_drop_acc, cuda_fetch_shared, cuda_outputs_per_thread, cuda_pipeline,
                                         cuda_split_k, cuda_tile_output, cuda_unroll, cuda_vector_lanes, cuda_wmma_gemm)
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.stages import matmul_stage
from search_spaces.lib.tiling import epilogue_on_tile, parallel_register_tile, unroll


def build(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    # The accumulator is float32 for every dtype. Casts appear only where the dtypes differ, so the
    # float32 function is the one tuning records were made for (they are keyed by structural hash).
    to_f32 = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast("float32", e))
    to_out = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast(dtype, e))

    @T.prim_func(s_tir=True)
    def linear_bias_relu(x: T.Buffer((m, k), dtype), w: T.Buffer((n, k), dtype),
                         b: T.Buffer((n,), dtype), y: T.Buffer((m, n), dtype)):
        T.func_attr({"global_symbol": "linear_bias_relu", "tirx.noalias": True})
        acc = T.alloc_buffer((m, n), "float32")
        matmul_stage("matmul", acc, (m, n, k), lambda i, j, kk: to_f32(x[i, kk]) * to_f32(w[j, kk]))
        for i, j in T.grid(m, n):
            with T.sblock("bias_relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = to_out(T.max(acc[vi, vj] + to_f32(b[vj]), T.float32(0)))

    return linear_bias_relu


def reference(x, w, b):
    f64 = np.float64
    return np.maximum(x.astype(f64) @ w.astype(f64).T + b.astype(f64), 0).astype(x.dtype)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    m, n, k = shape["m"], shape["n"], shape["k"]
    scale = 1.0 / np.sqrt(k)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((m, k)), rng.standard_normal((n, k)) * scale, rng.standard_normal(n)]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    return 2.0 * shape["m"] * shape["n"] * shape["k"] + 2.0 * shape["m"] * shape["n"]


def nbytes(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    return np.dtype(dtype).itemsize * (m * k + n * k + n + m * n)


@template("packed_tile")
def packed_tile(sch, target, knobs):
    """BLIS-style GEMM (``search_spaces.lib.cpu_gemm``): W packed into NR-column panels, an
    MR x NR register tile sized from the target's vectors, bias + ReLU on the tile; a few rows
    of x (decoding) read W as stored, in dot products along k."""
    schedule_gemm(sch, sch.get_sblock("matmul"), knobs, target,
                  epilogue_blocks=[sch.get_sblock("bias_relu")], weight_read=1)


@template("tiled_epilogue")
def tiled_epilogue(sch, target, knobs):
    """Register-blocked GEMM: outer tiles in parallel, K split for cache, vectorised inner N,
    accumulator tile written once through a cache_write with bias+ReLU fused at the tile."""
    mm = sch.get_sblock("matmul")
    outer, tile, k0, vec = parallel_register_tile(sch, knobs, mm, [4, 4], [4, 16], 8)
    epilogue_on_tile(sch, mm, sch.get_sblock("bias_relu"), tile, k0, vec)
    unroll(sch, knobs, outer)


# ---- CUDA ------------------------------------------------------------------------------------


@template("cuda_tiled_epilogue", target_kinds=("cuda",))
def cuda_tiled_epilogue(sch, target, knobs):
    """Shared-memory tiled GEMM: one block per output tile, x and W k-tiles staged through padded
    shared memory by all threads (vector loads, software-pipelined through registers), each
    thread accumulating a strided register tile in float32, bias + ReLU applied to it on the way
    out (defaults: 16x16 threads, 4x4 or 8x8 outputs each, k tile 16)."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("bias_relu")
    x = sch.get(mm).reads[0].source
    lanes = cuda_vector_lanes(x.dtype, int(x.shape[1]))
    # The k loop accumulates into a register copy of acc (reindex: see cuda_drop_acc).
    wb = sch.reindex(mm, ("write", 0))
    sch.set_scope(mm, 0, "local")
    i, j, k = sch.get_loops(mm)
    per_thread = cuda_outputs_per_thread(sch, i, j)
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, i, j, rows=(16, per_thread), cols=(16, per_thread))
    (k0,) = cuda_split_k(sch, knobs, [k], lanes)
    sch.reverse_compute_at(wb, tx, preserve_unit_loops=True)
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    cuda_drop_acc(sch, wb)
    fetches = [cuda_fetch_shared(sch, mm, index, k0, (nty, ntx), lanes, k_major=True) for index in (0, 1)]
    sch.decompose_reduction(mm, k0)
    cuda_pipeline(sch, k0, fetches)
    cuda_unroll(sch, knobs, bx)


@template("cuda_wmma", target_kinds=("cuda",))
def cuda_wmma(sch, target, knobs):
    """float16: tensor cores through TVM's WMMA intrinsics (``lib.cuda_gemm.cuda_wmma_gemm``:
    16x16x16, float32 accumulator fragments, each staged through shared memory for bias + ReLU).
    float32/bfloat16 (no WMMA intrinsic in TVM for bfloat16; float32 would lose precision as
    tf32) and sizes not multiple of 16: ``cuda_tiled_epilogue``."""
    if not cuda_wmma_gemm(sch, knobs, "bias_relu", trans_b=True):
        cuda_tiled_epilogue.fn(sch, target, knobs)


def _wgmma_gemm_bias_relu(shape, dtype, knobs):
    """Hopper TMA + mbarrier ring + wgmma GEMM (``search_spaces.lib.cuda_wgmma``), bias + ReLU on
    the accumulator registers; float16/bfloat16 at multiples of its tile."""
    return cuda_wgmma.gemm_bias_act(shape, dtype, knobs, "relu")


cuda_wgmma_relu = KernelTemplate("cuda_wgmma", _wgmma_gemm_bias_relu, cuda_wgmma.KNOBS, cuda_wgmma.DEFAULT_KNOBS,
                                 cuda_wgmma.check, shape_default=cuda_wgmma.fill_tile, **cuda_wgmma.HOPPER)


def _wgmma_split_k_bias_relu(shape, dtype, knobs):
    """Hopper wgmma GEMM with K split among CTAs (``search_spaces.lib.cuda_wgmma.gemm_split_k``),
    then a kernel summing the float32 partials with bias + ReLU; at most 256 rows."""
    return cuda_wgmma.gemm_split_k(shape, dtype, knobs, "relu")


cuda_wgmma_split_k_relu = KernelTemplate("cuda_wgmma_split_k", _wgmma_split_k_bias_relu, cuda_wgmma.SPLIT_K_KNOBS,
                                         cuda_wgmma.SPLIT_K_DEFAULT_KNOBS, cuda_wgmma.split_k_check,
                                         shape_default=cuda_wgmma.split_k_fill, **cuda_wgmma.HOPPER)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x, w, b = wildcard(), wildcard(), wildcard()
    root = is_op("relax.nn.relu")(is_op("relax.add")(is_op("relax.matmul")(x, w), b))
    return root, {"x": x, "w": w, "b": b}


def _relax_rewrite(matched, kernel):
    """matmul(x, w[k, n]) + b[n] -> relu, x of any rank >= 2 (leading axes are rows)."""
    from tvm import relax
    x, w, b = matched["x"], matched["w"], matched["b"]
    xs, ws, bs = static_shape(x), static_shape(w), static_shape(b)
    if None in (xs, ws, bs) or len(xs) < 2 or len(ws) != 2 or bs != (ws[1],) or xs[-1] != ws[0]:
        return None
    dtype = dtype_of(x)
    if not dtype == dtype_of(w) == dtype_of(b) or dtype not in FLOAT_DTYPES:
        return None
    m = int(np.prod(xs[:-1]))
    rows = x if len(xs) == 2 else relax.op.reshape(x, (m, xs[-1]))
    out = kernel({"m": m, "n": ws[1], "k": ws[0]}, dtype,
                 [rows, relax.op.permute_dims(w, [1, 0]), b])
    return out if len(xs) == 2 else relax.op.reshape(out, (*xs[:-1], ws[1]))


def onnx_graph(shape, dtype):
    """Gemm (transB, as torch exports nn.Linear) then Relu."""
    from onnx import helper
    m, n, k = shape["m"], shape["n"], shape["k"]
    return onnx_model("linear_bias_relu", [helper.make_node("Gemm", ["x", "w", "b"], ["t"], transB=1),
                                           helper.make_node("Relu", ["t"], ["y"])],
                      [("x", (m, k)), ("w", (n, k)), ("b", (n,))], [("y", (m, n))], dtype)

PATTERN = Pattern.from_module(
    globals(),
    description="relu(x @ W^T + b): GEMM with bias and ReLU fused in its epilogue",
    shape_params=gemm_shape((256, 16), (256, 32), (256, 16)),
    templates=[packed_tile, tiled_epilogue, cuda_wgmma_split_k_relu, cuda_wgmma_relu, cuda_tiled_epilogue, cuda_wmma],
    relax_rules=[RelaxRule("matmul_add_relu", _relax_pattern, _relax_rewrite)],
)
