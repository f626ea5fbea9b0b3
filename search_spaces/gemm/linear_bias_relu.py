"""linear_bias_relu: y = relu(x @ W^T + b), the GEMM with its epilogue fused.

Unfused, the GEMM writes M*N floats that the bias and ReLU read back; fused, the epilogue runs on
the accumulator tile while it is still in cache.

Precision: float32, float16 or bfloat16 inputs and output; the accumulator, bias add and ReLU are
float32 in every dtype and y is rounded once. Casts are only emitted where the dtypes differ: the
float32 function is unchanged (tuning records are keyed by its structural hash).
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import Pattern, RelaxRule, ShapeParam, onnx_model, template


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
        for i, j, kk in T.grid(m, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + to_f32(x[vi, vk]) * to_f32(w[vj, vk])
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


@template("tiled_epilogue")
def tiled_epilogue(sch, target, knobs):
    """Register-blocked GEMM: outer tiles in parallel, K split for cache, vectorised inner N,
    accumulator tile written once through a cache_write with bias+ReLU fused at the tile."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("bias_relu")
    i, j, k = sch.get_loops(mm)
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, [4, 4], max_innermost_factor=16))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, [4, 16], max_innermost_factor=64))
    k0, k1 = sch.split(k, knobs.tile(k, 2, [8], max_innermost_factor=64))
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    outer = sch.fuse(i0, j0)
    sch.parallel(outer)
    # The epilogue joins the matmul at the tile, so each acc tile is read back while hot.
    sch.reverse_compute_at(epi, j1, preserve_unit_loops=True)
    sch.vectorize(j2)
    sch.decompose_reduction(mm, k0)
    sch.vectorize(sch.get_loops(epi)[-1])
    sch.annotate(outer, "pragma_auto_unroll_max_step", knobs.choice([0, 16, 64], 16))
    sch.annotate(outer, "pragma_unroll_explicit", 1)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x, w, b = wildcard(), wildcard(), wildcard()
    root = is_op("relax.nn.relu")(is_op("relax.add")(is_op("relax.matmul")(x, w), b))
    return root, {"x": x, "w": w, "b": b}


def _relax_rewrite(matched, kernel):
    """matmul(x, w[k, n]) + b[n] -> relu, x of any rank >= 2 (leading axes are rows)."""
    from tvm import relax
    from autofuse.model.fusion import dtype_of, static_shape
    x, w, b = matched["x"], matched["w"], matched["b"]
    xs, ws, bs = static_shape(x), static_shape(w), static_shape(b)
    if None in (xs, ws, bs) or len(xs) < 2 or len(ws) != 2 or bs != (ws[1],) or xs[-1] != ws[0]:
        return None
    if not dtype_of(x) == dtype_of(w) == dtype_of(b) == "float32":
        return None
    m = int(np.prod(xs[:-1]))
    rows = x if len(xs) == 2 else relax.op.reshape(x, (m, xs[-1]))
    out = kernel({"m": m, "n": ws[1], "k": ws[0]}, "float32",
                 [rows, relax.op.permute_dims(w, [1, 0]), b])
    return out if len(xs) == 2 else relax.op.reshape(out, (*xs[:-1], ws[1]))


def onnx_graph(shape, dtype):
    """Gemm (transB, as torch exports nn.Linear) then Relu."""
    from onnx import helper
    m, n, k = shape["m"], shape["n"], shape["k"]
    return onnx_model("linear_bias_relu", [helper.make_node("Gemm", ["x", "w", "b"], ["t"], transB=1),
                                           helper.make_node("Relu", ["t"], ["y"])],
                      [("x", (m, k)), ("w", (n, k)), ("b", (n,))], [("y", (m, n))], dtype)

PATTERN = Pattern(
    name="linear_bias_relu",
    family="gemm",
    description="relu(x @ W^T + b): GEMM with bias and ReLU fused in its epilogue",
    shape_params=[ShapeParam("m", 256, 16, "rows of x (tokens)"),
                  ShapeParam("n", 256, 32, "output features"),
                  ShapeParam("k", 256, 16, "input features")],
    build=build,
    reference=reference,
    make_inputs=make_inputs,
    onnx_graph=onnx_graph,
    flops=flops,
    bytes=nbytes,
    dtypes=("float32", "float16", "bfloat16"),
    # float16/bfloat16: kernel (from float32) and reference (from float64) each round the output once
    # and may land one unit in the last place apart, <= 2u|y| (u = 2^-11 float16, 2^-8 bfloat16):
    # rtol = 4u. Near zero, where cancellation leaves no relative bound, the float32
    # accumulation error remains: ~k * 2^-24 of the terms' size, 1.5e-5 at k = 256: atol 1e-4.
    tolerance={"float32": (1e-4, 1e-4), "float16": (2e-3, 1e-4), "bfloat16": (1.6e-2, 1e-4)},
    templates=[tiled_epilogue],
    relax_rules=[RelaxRule("matmul_add_relu", _relax_pattern, _relax_rewrite)],
)
