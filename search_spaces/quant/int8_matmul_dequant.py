"""int8_matmul_dequant: a quantised Linear, y = [relu](float32(x_q @ w_q^T) * (x_scale * w_scale) + b).

x_q int8 (m, k), w_q int8 (n, k), x_scale (1,) per tensor, w_scale (n,) per output channel, b (n,);
symmetric (zero points 0). Products accumulate exactly in int32, and only the float32 epilogue
rounds; ``dtype`` is the output's (float32 only). Unfused (MatMulInteger, Cast, Mul, Add, Relu) the
int32 accumulator and float copies of it round-trip through memory; fused, the epilogue runs on the
accumulator tile in registers. CPU: ``int8_dot`` (k innermost, for LLVM's VNNI dot product) and
``int8_tiled`` (a register tile along n over w_q transposed once). CUDA: ``cuda_tiled_dp4a``,
linear_bias_relu's tiled scheme on int8 with ``__dp4a`` where k is a multiple of 4; on sm_90, at
multiples of its tile, the kernel template ``cuda_wgmma_int8`` comes first: Hopper TMA + s8 wgmma
into int32 accumulators, dequant + bias [+ ReLU] on them (``search_spaces.lib.cuda_wgmma``). The
Relax rules match what the ONNX frontend makes of MatMulInteger -> Cast -> Mul -> Add [-> Relu];
zero points, uint8 operands, scales varying along m and symbolic shapes are left alone.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, RelaxRule, ShapeParam, dtype_of, static_shape, template
from search_spaces.lib import cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import (cuda_drop_acc, cuda_fetch_shared, cuda_pipeline, cuda_split_k,
                                         cuda_tile_output, cuda_unroll, cuda_vector_lanes, dp4a_intrin)
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.onnx_graphs import typed_model
from search_spaces.lib.stages import matmul_stage
from search_spaces.lib.tiling import epilogue_on_tile, parallel_register_tile, unroll


def _relu_flag(shape):
    relu = int(shape.get("relu", 1))
    if relu not in (0, 1):
        raise AutofuseError(f"shape parameter relu={relu} of 'int8_matmul_dequant' must be 0 or 1")
    return relu


def build(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    relu = _relu_flag(shape)

    def epilogue(v):
        return T.max(v, T.cast(0, dtype)) if relu else v

    @T.prim_func(s_tir=True)
    def int8_matmul_dequant(x_q: T.Buffer((m, k), "int8"), w_q: T.Buffer((n, k), "int8"),
                            x_scale: T.Buffer((1,), dtype), w_scale: T.Buffer((n,), dtype),
                            b: T.Buffer((n,), dtype), y: T.Buffer((m, n), dtype)):
        T.func_attr({"global_symbol": "int8_matmul_dequant", "tirx.noalias": True})
        acc = T.alloc_buffer((m, n), "int32")
        matmul_stage("matmul", acc, (m, n, k),
                     lambda i, j, kk: T.cast(x_q[i, kk], "int32") * T.cast(w_q[j, kk], "int32"))
        for i, j in T.grid(m, n):
            with T.sblock("dequant"):
                vi, vj = T.axis.remap("SS", [i, j])
                # The scale product first, as ONNX's Mul(x_scale, w_scale) does.
                y[vi, vj] = epilogue(T.cast(acc[vi, vj], dtype) * (x_scale[0] * w_scale[vj]) + b[vj])

    return int8_matmul_dequant


def reference(x_q, w_q, x_scale, w_scale, b, shape):
    # The int32 accumulator exactly, through BLAS: every partial sum is an integer of magnitude at
    # most k * 2**14, exact in float64 while k < 2**39 (numpy's int64 matmul has no BLAS, and takes
    # about a minute at 4096^3).
    acc = x_q.astype(np.float64) @ w_q.astype(np.float64).T
    y = acc * (np.float64(x_scale[0]) * w_scale.astype(np.float64)) + b
    if _relu_flag(shape):
        y = np.maximum(y, 0.0)
    return y.astype(b.dtype)


def make_inputs(shape, dtype, seed):
    """int8 values in [-127, 127], a symmetric quantiser's range (the kernel takes -128 too: a
    saturating QuantizeLinear produces it), x_scale ~ 1/127 (x in [-1, 1]) and per-channel
    w_scale ~ 1/(127 sqrt(k)), so y is of order 1."""
    rng = np.random.default_rng(seed)
    m, n, k = shape["m"], shape["n"], shape["k"]
    return [rng.integers(-127, 128, size=(m, k)).astype(np.int8),
            rng.integers(-127, 128, size=(n, k)).astype(np.int8),
            np.array([rng.uniform(0.5, 1.5) / 127], dtype=dtype),
            (rng.uniform(0.5, 1.5, size=n) / (127 * np.sqrt(k))).astype(dtype),
            (0.5 * rng.standard_normal(n)).astype(dtype)]


def flops(shape):
    m, n, k = shape["m"], shape["n"], shape["k"]
    return 2.0 * m * n * k + (3.0 + _relu_flag(shape)) * m * n


def nbytes(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    f = np.dtype(dtype).itemsize
    return (m * k + n * k) + f * (1 + 2 * n + m * n)


@template("int8_packed")
def int8_packed(sch, target, knobs):
    """The library's CPU GEMM (``search_spaces.lib.cpu_gemm``) in int32: w_q packed into panels
    of pairs of k per task, each int32 lane fed two products per instruction (vpdpwssd with
    AVX-512 VNNI, vpmaddwd without; int8 dot over rows of both operands for few rows), dequant +
    bias + ReLU on the accumulator tile."""
    schedule_gemm(sch, sch.get_sblock("matmul"), knobs, target, epilogue_blocks=[sch.get_sblock("dequant")],
                  weight_read=[str(r.source.name) for r in sch.get(sch.get_sblock("matmul")).reads].index("w_q"))


@template("int8_tiled")
def int8_tiled(sch, target, knobs):
    """Parallel outer (m, n) tiles; an i2 x j2 int32 register tile vectorised along n over w_q
    packed once to (k, n); dequant+bias+ReLU on the accumulator tile."""
    mm = sch.get_sblock("matmul")
    outer, tile, k0, vec = parallel_register_tile(sch, knobs, mm, [2, 4], [2, 32], 64, max_k=128)
    # Vector loads along n need w contiguous in n. One transposed copy for the whole kernel (n*k
    # bytes, in parallel): packing per outer tile instead repeats it m/tile times and cost more
    # than the multiplies.
    w_index = [str(r.source.name) for r in sch.get(mm).reads].index("w_q")
    pack = sch.cache_read(mm, w_index, "global")
    sch.transform_layout(pack, ("write", 0), lambda jj, kk: (kk, jj))
    pj, pk = sch.get_loops(pack)
    sch.reorder(pk, pj)
    sch.parallel(pk)
    epilogue_on_tile(sch, mm, sch.get_sblock("dequant"), tile, k0, vec, vectorize_init=True)
    unroll(sch, knobs, outer)


@template("int8_dot")
def int8_dot(sch, target, knobs):
    """Parallel outer (m, n) tiles; each output a dot product along k (rows of x_q and w_q are
    both contiguous in k), left as the innermost serial loop for LLVM to vectorise as a
    reduction (VNNI vpdpwssd on znver4); dequant+bias+ReLU on the tile, vectorised along n."""
    mm = sch.get_sblock("matmul")
    # A long inner k: each dot product ends in a horizontal sum of the vector lanes.
    outer, tile, k0, _ = parallel_register_tile(sch, knobs, mm, [2, 4], [2, 4], 512, max_k=512, k_innermost=True)
    epilogue_on_tile(sch, mm, sch.get_sblock("dequant"), tile, k0, vectorize_init=True)
    unroll(sch, knobs, outer)


# ---- CUDA ------------------------------------------------------------------------------------

@template("cuda_tiled_dp4a", target_kinds=("cuda",))
def cuda_tiled_dp4a(sch, target, knobs):
    """linear_bias_relu's cuda_tiled_epilogue for int8: one block per output tile, x_q and w_q
    k-tiles staged through padded shared memory in 4-byte vectors (software-pipelined through
    registers), each thread a strided register tile of int32 accumulators fed four products at a
    time by ``__dp4a``, dequant + bias + ReLU on the tile on the way out (defaults: 32x64 tile,
    8x16 threads, 4x4 outputs each, k tile 32)."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("dequant")
    lanes = cuda_vector_lanes("int8", int(sch.get(mm).reads[0].source.shape[1]))
    wb = sch.reindex(mm, ("write", 0))
    sch.set_scope(mm, 0, "local")
    i, j, k = sch.get_loops(mm)
    # m is short in decoding and prefill chunks: 32-row tiles keep more blocks in flight.
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, i, j, rows=(8, 4), cols=(16, 4))
    (k0,) = cuda_split_k(sch, knobs, [k], lanes, tile=32)
    sch.reverse_compute_at(wb, tx, preserve_unit_loops=True)
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    cuda_drop_acc(sch, wb)
    fetches = [cuda_fetch_shared(sch, mm, index, k0, (nty, ntx), lanes, k_major=True) for index in (0, 1)]
    sch.decompose_reduction(mm, k0)
    if lanes == 4:
        # The innermost loop is 4 consecutive k of one shared row of x_q and one of w_q, 4-byte
        # aligned (k-tile and row stride multiples of 4): exactly dp4a's operands.
        sch.tensorize(sch.get_loops(mm)[-1], dp4a_intrin())
    cuda_pipeline(sch, k0, fetches)
    cuda_unroll(sch, knobs, bx)


def _wgmma_check(shape, dtype, knobs):
    if dtype != "float32":
        raise ValueError(f"cuda_wgmma_int8 writes float32, not {dtype}")
    if int(shape.get("relu", 1)) not in (0, 1):
        raise ValueError(f"relu={shape['relu']} is not 0 or 1")
    cuda_wgmma.int8_check(shape, knobs)


def _wgmma_int8(shape, dtype, knobs):
    """Hopper TMA + mbarrier ring + s8 wgmma (``search_spaces.lib.cuda_wgmma``), products summed
    exactly in int32 accumulators, dequant + bias [+ ReLU] on them; float32 out, at multiples of
    its tile (BK 128)."""
    return cuda_wgmma.gemm_int8_dequant(shape, knobs, relu=bool(_relu_flag(shape)))


def _wgmma_fill_tile(shape, dtype):
    return cuda_wgmma.fill_tile(shape, "int8", cuda_wgmma.INT8_KNOBS, cuda_wgmma.INT8_DEFAULT_KNOBS,
                                dtypes=cuda_wgmma.INT8_DTYPES)


cuda_wgmma_int8 = KernelTemplate("cuda_wgmma_int8", _wgmma_int8, cuda_wgmma.INT8_KNOBS, cuda_wgmma.INT8_DEFAULT_KNOBS,
                                 _wgmma_check, shape_default=_wgmma_fill_tile, **cuda_wgmma.HOPPER)


def _relax_pattern(relu):
    def make():
        from tvm.relax.dpl import is_op, wildcard
        x_q, w_kn, scale, b = wildcard(), wildcard(), wildcard(), wildcard()
        acc = is_op("relax.matmul")(is_op("relax.astype")(x_q), is_op("relax.astype")(w_kn))
        acc_f = is_op("relax.astype")(acc)
        root = is_op("relax.add")(is_op("relax.multiply")(acc_f, scale), b)
        if relu:
            root = is_op("relax.nn.relu")(root)
        return root, {"x_q": x_q, "w_kn": w_kn, "scale": scale, "b": b, "acc": acc, "acc_f": acc_f}
    return make


def _relax_rewrite(relu):
    def rewrite(matched, kernel):
        """MatMulInteger(x_q int8, w int8 (k, n)) as int32, Cast to float32, times a scale that
        broadcasts along n (scalar, (1,), (n,) or (1, n)), plus b (n,) [, Relu]; x_q of any rank
        >= 2 (leading axes are rows)."""
        from tvm import relax
        x_q, w_kn, scale, b = matched["x_q"], matched["w_kn"], matched["scale"], matched["b"]
        xs, ws, ss, bs = (static_shape(e) for e in (x_q, w_kn, scale, b))
        if None in (xs, ws, ss, bs) or len(xs) < 2 or len(ws) != 2 or xs[-1] != ws[0]:
            return None
        k, n = ws
        if bs != (n,) or ss not in ((), (1,), (n,), (1, n), (1, 1)):
            return None
        if dtype_of(x_q) != "int8" or dtype_of(w_kn) != "int8" or dtype_of(matched["acc"]) != "int32":
            return None
        if not dtype_of(matched["acc_f"]) == dtype_of(scale) == dtype_of(b) == "float32":
            return None
        m = int(np.prod(xs[:-1]))
        rows = x_q if len(xs) == 2 else relax.op.reshape(x_q, (m, k))
        # The combined scale goes in as w_scale with x_scale = 1: 1 * s rounds to s, so the kernel
        # multiplies by exactly the float32 the graph multiplies by.
        w_scale = relax.op.reshape(scale, (-1,))
        if int(np.prod(ss)) == 1:
            w_scale = relax.op.broadcast_to(w_scale, (n,))
        one = relax.const(np.ones(1, dtype=np.float32))
        out = kernel({"m": m, "n": n, "k": k, "relu": relu}, "float32",
                     [rows, relax.op.permute_dims(w_kn, [1, 0]), one, w_scale, b])
        return out if len(xs) == 2 else relax.op.reshape(out, (*xs[:-1], n))
    return rewrite


def onnx_graph(shape, dtype):
    """What an exporter writes for a quantised Linear: Transpose(w_q) to (k, n), MatMulInteger
    (int32), Cast to float, Mul by Mul(x_scale, w_scale), Add b [, Relu]."""
    from onnx import TensorProto, helper

    m, n, k = shape["m"], shape["n"], shape["k"]
    out = "y" if not _relu_flag(shape) else "z"
    nodes = [helper.make_node("Transpose", ["w_q"], ["w_kn"], perm=[1, 0]),
             helper.make_node("MatMulInteger", ["x_q", "w_kn"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x_scale", "w_scale"], ["scale"]),
             helper.make_node("Mul", ["acc_f", "scale"], ["deq"]),
             helper.make_node("Add", ["deq", "b"], [out])]
    if _relu_flag(shape):
        nodes.append(helper.make_node("Relu", ["z"], ["y"]))
    return typed_model("int8_matmul_dequant", nodes,
                       [("x_q", (m, k), "int8"), ("w_q", (n, k), "int8"), ("x_scale", (1,), dtype),
                        ("w_scale", (n,), dtype), ("b", (n,), dtype)],
                       [("y", (m, n), dtype)])


PATTERN = Pattern.from_module(
    globals(),
    description="int8 x int8 GEMM accumulated in int32, dequantised (per-tensor x, per-channel w scale), bias, ReLU",
    shape_params=[*gemm_shape((128, 16), (512, 32), (512, 32)),
                  ShapeParam("relu", 1, 1, "1: ReLU after the bias, 0: none", minimum=0)],
    dtypes=("float32",),
    templates=[int8_packed, int8_dot, int8_tiled, cuda_wgmma_int8, cuda_tiled_dp4a],
    # The ReLU rule first: the plain one would otherwise take the Add out from under it.
    relax_rules=[RelaxRule("matmulinteger_dequant_bias_relu", _relax_pattern(1), _relax_rewrite(1), priority=1),
                 RelaxRule("matmulinteger_dequant_bias", _relax_pattern(0), _relax_rewrite(0))],
)
