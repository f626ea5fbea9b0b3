"""woq_matmul: y = x @ dequant(W)^T + b, the weight-only-quantised linear layer of LLM decoding.

W (n, k) is stored per output row with group-wise scales, w[j, kk] = q[j, kk] * scales[j, kk //
group], symmetric. ``bits`` 8: int8 (n, k); ``bits`` 4: uint8 (n, k/2), two's-complement nibbles,
even kk in the low one (``pack_int4``/``unpack_int4``). Shapes it cannot hold raise ``ShapeError``.
Unfused, a dequantise kernel writes the float W that the GEMM reads back; fused, weights are
dequantised on load (``dequant`` at the GEMM's innermost reduction tile, in registers) and each
dequantised vector serves every token. ``x_split`` regroups x per group into even then odd
positions, so that both FMA operands are contiguous vectors and no nibble shuffle is needed. CUDA:
``cuda_warp_per_row``, a GEMV bound by the weight bytes, a warp per output feature. No RelaxRule:
TVM 0.27's ONNX importer rejects blocked DequantizeLinear and has no MatMulNBits.
"""

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, template
from search_spaces.lib import cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import cuda_vector_lanes
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.onnx_graphs import typed_model
from search_spaces.lib.tiling import unroll


class ShapeError(AutofuseError, ValueError):
    """A shape this pattern cannot hold; an AutofuseError so the CLI prints it as one line."""


def _dims(shape):
    m, n, k, bits, group = shape["m"], shape["n"], shape["k"], shape["bits"], shape["group"]
    if bits not in (4, 8):
        raise ShapeError(f"woq_matmul: bits={bits}, weights are quantised to 4 or 8 bits")
    if k % group:
        raise ShapeError(f"woq_matmul: group={group} must divide k={k}")
    if bits == 4 and group % 2:
        raise ShapeError(f"woq_matmul: group={group} must be even for bits=4 (two values share a byte)")
    return m, n, k, bits, group, 8 // bits  # the last: values per stored byte


def _unpack4(byte, h):
    """Nibble h (0: low, even kk; 1: high, odd kk) of a uint8 as a signed int32: (u ^ 8) - 8 is the
    two's-complement value of the 4-bit u. All in int32 and in range, so nothing can wrap (TVM
    emits some integer ops as no-wrap, and LLVM folds away what wraps under those flags)."""
    u = (T.Cast("int32", byte) >> (h * 4)) & 15
    return (u ^ 8) - 8


def _unpack8(byte, h):
    return T.Cast("int32", byte)


def build(shape, dtype):
    m, n, k, bits, group, per = _dims(shape)
    ng, gp = k // group, group // per  # groups per row; stored bytes (and values per h) per group
    w_dtype = "uint8" if bits == 4 else "int8"
    unpack = _unpack4 if bits == 4 else _unpack8

    @T.prim_func(s_tir=True)
    def woq_matmul(x: T.Buffer((m, k), dtype), w: T.Buffer((n, k // per), w_dtype),
                   scales: T.Buffer((n, ng), "float32"), b: T.Buffer((n,), dtype),
                   y: T.Buffer((m, n), dtype)):
        T.func_attr({"global_symbol": "woq_matmul", "tirx.noalias": True})
        xs = T.sblock_alloc_buffer((m, ng, per, gp), "float32")
        wd = T.sblock_alloc_buffer((n, ng, per, gp), "float32")
        acc = T.sblock_alloc_buffer((m, n), "float32")
        for i, g, h, p in T.grid(m, ng, per, gp):
            with T.sblock("x_split"):
                vi, vg, vh, vp = T.axis.remap("SSSS", [i, g, h, p])
                xs[vi, vg, vh, vp] = T.Cast("float32", x[vi, vg * group + vp * per + vh])
        for j, g, h, p in T.grid(n, ng, per, gp):
            with T.sblock("dequant"):
                vj, vg, vh, vp = T.axis.remap("SSSS", [j, g, h, p])
                wd[vj, vg, vh, vp] = T.Cast("float32", unpack(w[vj, vg * gp + vp], vh)) * scales[vj, vg]
        for i, j, g, h, p in T.grid(m, n, ng, per, gp):
            with T.sblock("matmul"):
                vi, vj, vg, vh, vp = T.axis.remap("SSRRR", [i, j, g, h, p])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + xs[vi, vg, vh, vp] * wd[vj, vg, vh, vp]
        for i, j in T.grid(m, n):
            with T.sblock("bias"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast(dtype, acc[vi, vj] + T.Cast("float32", b[vj]))

    return woq_matmul


def pack_int4(q):
    """(n, k) int values in [-8, 7] -> (n, k/2) uint8, even k in the low nibble, odd k in the high."""
    q = np.asarray(q)
    if q.shape[-1] % 2 or q.min(initial=0) < -8 or q.max(initial=0) > 7:
        raise ValueError("pack_int4 needs an even last axis of values in [-8, 7]")
    u = (q.astype(np.int16) & 0xF).astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << np.uint8(4))


def unpack_int4(packed):
    """(n, k/2) uint8 -> (n, k) int8 in [-8, 7], the inverse of ``pack_int4``."""
    packed = np.asarray(packed, dtype=np.uint8)
    u = np.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1).astype(np.int8)
    return ((u ^ 8) - 8).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(w, scales):
    """The float64 weights (n, k): q[j, kk] * scales[j, kk // group]; uint8 w is packed int4,
    int8 w is int8."""
    q = unpack_int4(w) if w.dtype == np.uint8 else np.asarray(w, dtype=np.int8)
    group = q.shape[1] // scales.shape[1]
    return q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, axis=1)


def reference(x, w, scales, b):
    y = x.astype(np.float64) @ dequantize(w, scales).T + b.astype(np.float64)
    return y.astype(x.dtype)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    m, n, k, bits, group, _ = _dims(shape)
    qmax = 7 if bits == 4 else 127
    q = rng.integers(-qmax - 1, qmax + 1, size=(n, k))
    w = pack_int4(q) if bits == 4 else q.astype(np.int8)
    # Per-group scales around 1/(qmax*sqrt(k)): dequantised weights of the size x@W^T keeps at ~1.
    scales = (rng.uniform(0.5, 1.5, size=(n, k // group)) / (qmax * np.sqrt(k))).astype(np.float32)
    return [rng.standard_normal((m, k)).astype(dtype), w, scales, rng.standard_normal(n).astype(dtype)]


def flops(shape):
    m, n, k, *_ = _dims(shape)
    return 2.0 * m * n * k + m * n


def nbytes(shape, dtype):
    m, n, k, bits, group, _ = _dims(shape)
    item = np.dtype(dtype).itemsize
    return n * k * bits // 8 + 4 * n * (k // group) + item * (m * k + m * n + n)


@template("packed_dequant")
def packed_dequant(sch, target, knobs):
    """The library's CPU GEMM (``search_spaces.lib.cpu_gemm``) with W dequantised where it is
    read: for few tokens (decoding) in the dot products along k (lane-wide vectors of packed
    bytes unpacked and scaled in registers, each serving every token of the row tile), for more
    into the panels each parallel task packs; bias on the accumulator tile."""
    mm = sch.get_sblock("matmul")
    schedule_gemm(sch, mm, knobs, target, epilogue_blocks=[sch.get_sblock("bias")],
                  weight_read=[str(r.source.name) for r in sch.get(mm).reads].index("wd"))


@template("dequant_on_load")
def dequant_on_load(sch, target, knobs):
    """Output features split into row tiles run in parallel; per tile the k reduction walks groups
    and lane-wide chunks of packed bytes, each chunk dequantised for the tile's rows right before
    the lane-vectorised FMAs of every token consume it; lane partials summed, bias added, per tile."""
    mm = sch.get_sblock("matmul")
    deq = sch.get_sblock("dequant")
    bias = sch.get_sblock("bias")
    p = sch.get_loops(mm)[-1]
    _, lanes = sch.split(p, knobs.tile(p, 2, [16], max_innermost_factor=32))
    # rfactor before any compute_at: it needs the reduction as the first child of its loop.
    rf = sch.rfactor(lanes, factor_axis=2)

    i, j = sch.get_loops(bias)
    sch.reorder(j, i)
    j0, _ = sch.split(j, knobs.tile(j, 2, [2], max_innermost_factor=8))
    sch.parallel(j0)
    for blk in (mm, rf):
        sch.compute_at(blk, j0, preserve_unit_loops=True)

    pl, i, j1, g, h, p0 = sch.get_loops(rf)[-6:]
    sch.reorder(g, p0, h, j1, i, pl)
    sch.compute_at(deq, h, preserve_unit_loops=True)
    sch.vectorize(pl)
    sch.decompose_reduction(rf, g)
    sch.vectorize(sch.get_loops(deq)[-1])

    pl, i, j1 = sch.get_loops(mm)[-3:]
    sch.reorder(i, j1, pl)
    unroll(sch, knobs, j0)


def _compute_at(sch, block, loop):
    """``compute_at`` keeping unit loops; returns {name of an iteration variable of ``block``: the
    loop made for it}. compute_at names the loop of the k-th iteration variable ``ax{k}`` and
    orders the loops its own way; unit loops (group = k, bits = 8, a sampled factor of 1) stay."""
    sch.compute_at(block, loop, preserve_unit_loops=True)
    names = [iv.var.name for iv in sch.get(block).iter_vars]
    made = {}
    for rv in sch.get_loops(block):
        loop_name = sch.get(rv).loop_var.name
        if loop_name.startswith("ax") and loop_name[2:].isdigit():
            made[names[int(loop_name[2:])]] = rv
    assert len(made) == len(names), "compute_at made one loop per iteration variable"
    return made


@template("cuda_warp_per_row", target_kinds=("cuda",))
def cuda_warp_per_row(sch, target, knobs):
    """Decode GEMV: a warp per output feature (a row of W; default 4 rows a block), its lanes
    taking consecutive 4-byte chunks of the packed row (one coalesced 128-byte load per warp and
    step), each chunk dequantised in registers and multiplied into m per-lane partial sums, one
    per token; the partials summed across the warp by shuffles, bias added by lane 0."""
    mm, deq, bias = sch.get_sblock("matmul"), sch.get_sblock("dequant"), sch.get_sblock("bias")
    w = sch.get(deq).reads[0].source
    per = int(sch.get(mm).reads[0].source.shape[2])  # values per byte
    bytes_per_row = int(w.shape[1])
    # Dequantised weights and regrouped x are computed where they are used, in registers.
    sch.compute_inline(deq)
    sch.compute_inline(sch.get_sblock("x_split"))
    i, j, g, h, p = sch.get_loops(mm)
    sch.reorder(g, p, h)
    chunk = cuda_vector_lanes("uint8", bytes_per_row, max_bytes=4)
    rest, byte = sch.split(sch.fuse(g, p), [None, chunk])
    step, lane = sch.split(rest, knobs.tile(rest, 2, [32], max_innermost_factor=32))
    # The rfactor block's iteration variables are named after these loops.
    role = {key: "v" + sch.get(loop).loop_var.name
            for key, loop in (("lane", lane), ("i", i), ("step", step), ("byte", byte), ("nibble", h))}
    # Per-lane partial sums (registers), then one cross-lane sum per token.
    rf = sch.rfactor(lane, factor_axis=0)
    sch.set_scope(rf, 0, "local")
    sch.set_scope(mm, 0, "local")
    i, j, lane = sch.get_loops(mm)
    sch.reorder(j, i, lane)
    block, row = sch.split(j, knobs.tile(j, 2, [4], max_innermost_factor=16))
    sch.bind(block, "blockIdx.x")
    sch.bind(row, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    loops = _compute_at(sch, rf, row)
    rf_lane, rf_i, step, byte, nibble = (loops.pop(role[key]) for key in ("lane", "i", "step", "byte", "nibble"))
    # Each lane walks its row in steps; per step a chunk of bytes, per byte its nibbles, per
    # nibble all m tokens. Left: unit loops (the row; the group where group = k, a reduction,
    # which must sit under the step loop the accumulator is initialised above).
    reducing = {iv.var.name for iv in sch.get(rf).iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    sch.reorder(rf_lane, *(loop for name, loop in loops.items() if name not in reducing), step,
                *(loop for name, loop in loops.items() if name in reducing), byte, nibble, rf_i)
    sch.bind(rf_lane, "threadIdx.x")
    # The chunk of packed bytes as one vector load, the x values it meets as float4s.
    wl = sch.cache_read(rf, 1, "local")
    sch.compute_at(wl, step, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(wl)[-1])
    xl = sch.cache_read(rf, 0, "local")
    sch.compute_at(xl, step, preserve_unit_loops=True)
    xvec = cuda_vector_lanes("float32", chunk * per, max_bytes=16)
    _, xv = sch.split(sch.get_loops(xl)[-1], [None, xvec])
    sch.vectorize(xv)
    sch.decompose_reduction(rf, step)
    for loop in (byte, nibble, rf_i):
        sch.unroll(loop)
    # Unrolled steps put more loads in flight; the cross-lane sum must stay out of any unrolled
    # loop (TVM 0.27 fails lowering two shuffle reductions into one buffer).
    unroll(sch, knobs, step, depths=(0, 4, 16), default=4)
    sch.reverse_compute_at(bias, row, preserve_unit_loops=True)


def _wgmma_woq(shape, dtype, knobs):
    """Hopper tensor cores from 16 tokens (``search_spaces.lib.cuda_wgmma.gemm_woq``): a producer
    warpgroup TMA-loads W's bytes and x, dequantises W into the swizzled shared-memory tile that
    wgmma reads (features x tokens, float32 accumulators), then the bias; float16/bfloat16."""
    return cuda_wgmma.gemm_woq(shape, dtype, knobs)


def _wgmma_check(shape, dtype, knobs):
    cuda_wgmma.woq_check(shape, dtype, knobs)


cuda_wgmma_woq = KernelTemplate("cuda_wgmma_woq", _wgmma_woq, cuda_wgmma.WOQ_KNOBS, cuda_wgmma.WOQ_DEFAULT_KNOBS,
                                _wgmma_check, shape_default=cuda_wgmma.woq_fill_tile, **cuda_wgmma.HOPPER)


def onnx_graph(shape, dtype):
    """Opset 17 has no blocked DequantizeLinear (opset 21) and no int4 type, so the dequantisation
    is spelled out on the graph inputs, the packed bytes themselves: for int4 the nibbles are split
    with BitShift (hi = w >> 4, lo = w - (hi << 4), no shift overflows), interleaved back to k order
    (Unsqueeze + Concat + Reshape), cast, and made signed with Where(u >= 8, u - 16, u); int8 is a
    Cast. Then Reshape (n, k/group, group) * scales (n, k/group, 1), Reshape (n, k), Transpose,
    MatMul, Add; in float16/bfloat16 the float32 weights are cast to the dtype before the MatMul,
    as the tensor-core kernel rounds them. Every baseline thus dequantises the whole of W into a
    float tensor per call."""
    from onnx import helper

    m, n, k, bits, group, per = _dims(shape)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype("float32"))
    consts = {"grouped": np.array([n, k // group, group], np.int64), "flat": np.array([n, k], np.int64),
              "axis2": np.array([2], np.int64)}
    if bits == 4:
        consts.update(four=np.array(4, np.uint8), eight=np.array(8, np.float32), sixteen=np.array(16, np.float32))
        unpack = [
            helper.make_node("BitShift", ["w", "four"], ["hi"], direction="RIGHT"),
            helper.make_node("BitShift", ["hi", "four"], ["hi_shifted"], direction="LEFT"),
            helper.make_node("Sub", ["w", "hi_shifted"], ["lo"]),
            helper.make_node("Unsqueeze", ["lo", "axis2"], ["lo3"]),
            helper.make_node("Unsqueeze", ["hi", "axis2"], ["hi3"]),
            helper.make_node("Concat", ["lo3", "hi3"], ["pairs"], axis=2),         # (n, k/2, 2)
            helper.make_node("Reshape", ["pairs", "flat"], ["u8"]),                # (n, k), k order
            helper.make_node("Cast", ["u8"], ["u"], to=elem),
            helper.make_node("GreaterOrEqual", ["u", "eight"], ["negative"]),
            helper.make_node("Sub", ["u", "sixteen"], ["u_minus_16"]),
            helper.make_node("Where", ["negative", "u_minus_16", "u"], ["q"]),
        ]
    else:
        unpack = [helper.make_node("Cast", ["w"], ["q"], to=elem)]
    nodes = unpack + [
        helper.make_node("Reshape", ["q", "grouped"], ["qg"]),
        helper.make_node("Unsqueeze", ["scales", "axis2"], ["s3"]),
        helper.make_node("Mul", ["qg", "s3"], ["wg"]),
        helper.make_node("Reshape", ["wg", "flat"], ["wf32"]),
        helper.make_node("Cast", ["wf32"], ["wf"], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))),
        helper.make_node("Transpose", ["wf"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["y"]),
    ]
    return typed_model("woq_matmul", nodes,
                       [("x", (m, k), dtype), ("w", (n, k // per), "uint8" if bits == 4 else "int8"),
                        ("scales", (n, k // group), "float32"), ("b", (n,), dtype)],
                       [("y", (m, n), dtype)], consts)


PATTERN = Pattern.from_module(
    globals(),
    description="x @ dequant(W)^T + b, W int4/int8 per output row with group-wise scales (LLM decode)",
    shape_params=[*gemm_shape((4, 2), (1024, 32), (1024, 64)),
                  ShapeParam("group", 64, 32, "values sharing one scale along k (divides k)"),
                  ShapeParam("bits", 4, 4, "weight bits: 4 (two per byte) or 8")],
    templates=[packed_dequant, dequant_on_load, cuda_wgmma_woq, cuda_warp_per_row],
)
