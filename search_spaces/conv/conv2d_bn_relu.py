"""conv2d_bn_relu: y = relu(conv2d(x, W) * bn_scale + bn_shift), an NCHW convolution with inference
batch norm and ReLU fused in its epilogue.

Stride 1, padding kernel // 2 (a "same" convolution for odd kernels); batch norm arrives folded into
a per-channel affine map (``fold_batch_norm``), as inference graphs carry it. Three sblocks:
``pad``, ``conv`` (float32 accumulator) and ``bn_relu``. Unfused, the convolution's output is
written and read back by the epilogue; fused, the epilogue runs on each register tile.
``cuda_direct`` computes the padded input rows straight into shared memory per input-channel chunk
(the zero border costs no extra pass), the chunk capped so that the largest sampled tile fits.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import Pattern, RelaxRule, ShapeParam, dtype_of, onnx_model, static_shape, template
from search_spaces.lib import cpu_rules
from search_spaces.lib.cpu_gemm import schedule_packed_gemm
from search_spaces.lib.cuda_gemm import cuda_unroll
from search_spaces.lib.tiling import unroll


def _dims(shape):
    n, ci, h, w, co, k = (shape[key] for key in ("n", "c_in", "h", "w", "c_out", "kernel"))
    pad = k // 2
    oh, ow = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    return n, ci, h, w, co, k, pad, oh, ow


def build(shape, dtype):
    n, ci, h, w, co, k, pad, oh, ow = _dims(shape)
    ph, pw = h + 2 * pad, w + 2 * pad

    @T.prim_func(s_tir=True)
    def conv2d_bn_relu(x: T.Buffer((n, ci, h, w), dtype), weight: T.Buffer((co, ci, k, k), dtype),
                       bn_scale: T.Buffer((co,), dtype), bn_shift: T.Buffer((co,), dtype),
                       y: T.Buffer((n, co, oh, ow), dtype)):
        T.func_attr({"global_symbol": "conv2d_bn_relu", "tirx.noalias": True})
        xp = T.sblock_alloc_buffer((n, ci, ph, pw), dtype)
        acc = T.sblock_alloc_buffer((n, co, oh, ow), "float32")
        for b, c, i, j in T.grid(n, ci, ph, pw):
            with T.sblock("pad"):
                vb, vc, vi, vj = T.axis.remap("SSSS", [b, c, i, j])
                xp[vb, vc, vi, vj] = T.if_then_else(
                    pad <= vi and vi < h + pad and pad <= vj and vj < w + pad,
                    x[vb, vc, vi - pad, vj - pad], T.cast(0, dtype))
        for b, o, i, j, c, di, dj in T.grid(n, co, oh, ow, ci, k, k):
            with T.sblock("conv"):
                vb, vo, vi, vj, vc, vdi, vdj = T.axis.remap("SSSSRRR", [b, o, i, j, c, di, dj])
                with T.init():
                    acc[vb, vo, vi, vj] = T.float32(0)
                acc[vb, vo, vi, vj] = acc[vb, vo, vi, vj] + (
                    T.Cast("float32", xp[vb, vc, vi + vdi, vj + vdj])
                    * T.Cast("float32", weight[vo, vc, vdi, vdj]))
        for b, o, i, j in T.grid(n, co, oh, ow):
            with T.sblock("bn_relu"):
                vb, vo, vi, vj = T.axis.remap("SSSS", [b, o, i, j])
                y[vb, vo, vi, vj] = T.Cast(dtype, T.max(
                    acc[vb, vo, vi, vj] * T.Cast("float32", bn_scale[vo])
                    + T.Cast("float32", bn_shift[vo]), T.float32(0)))

    return conv2d_bn_relu


def fold_batch_norm(gamma, beta, mean, var, eps=1e-5):
    """Inference batch norm as the (bn_scale, bn_shift) pair this pattern takes."""
    scale = gamma / np.sqrt(var + eps)
    return scale, beta - mean * scale


def reference(x, weight, bn_scale, bn_shift):
    k = weight.shape[2]
    pad = k // 2
    oh, ow = x.shape[2] + 2 * pad - k + 1, x.shape[3] + 2 * pad - k + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    wf = weight.astype(np.float64)
    out = np.zeros((x.shape[0], weight.shape[0], oh, ow))
    for di in range(k):
        for dj in range(k):
            out += np.einsum("nchw,oc->nohw", xp[:, :, di:di + oh, dj:dj + ow], wf[:, :, di, dj])
    out = out * bn_scale.astype(np.float64)[None, :, None, None] + bn_shift.astype(np.float64)[None, :, None, None]
    return np.maximum(out, 0).astype(x.dtype)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    n, ci, h, w, co, k, *_ = _dims(shape)
    x = rng.standard_normal((n, ci, h, w))
    weight = rng.standard_normal((co, ci, k, k)) / np.sqrt(ci * k * k)
    gamma = rng.uniform(0.5, 1.5, co)
    beta = rng.standard_normal(co) * 0.5
    mean = rng.standard_normal(co) * 0.1
    var = rng.uniform(0.5, 2.0, co)
    scale, shift = fold_batch_norm(gamma, beta, mean, var)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    return [a.astype(np.float32).astype(dtype) for a in (x, weight, scale, shift)]


def flops(shape):
    n, ci, _, _, co, k, _, oh, ow = _dims(shape)
    return 2.0 * n * co * oh * ow * ci * k * k + 3.0 * n * co * oh * ow


def nbytes(shape, dtype):
    n, ci, h, w, co, k, _, oh, ow = _dims(shape)
    return np.dtype(dtype).itemsize * (n * ci * h * w + co * ci * k * k + 2 * co + n * co * oh * ow)


@template("gemm_direct")
def gemm_direct(sch, target, knobs):
    """The convolution as the library's GEMM (``search_spaces.lib.cpu_gemm``): per (image,
    output row), register tiles of output channels (one weight broadcast per row and k) by
    output columns (vectors of the padded input row, read as stored at each kernel offset), the
    reduction over (input channel, kernel row, kernel column) in one loop; the padded input
    rows computed per parallel task, batch norm + ReLU on the accumulator tile. Second to
    ``tiled_direct``, whose tile also spans output rows: 0.9x its speed at 56x56 and 28x28 (64 and
    128 channels), 1.3x at 14x14 with 256 (quick measurements, shared 2-core machine)."""
    conv = sch.get_sblock("conv")
    b, o, i, j, c, di, dj = sch.get_loops(conv)
    sch.reorder(b, i, o, j, c, di, dj)
    schedule_packed_gemm(sch, conv, knobs, target, epilogue_blocks=[sch.get_sblock("bn_relu")],
                         weight_read=[str(r.source.name) for r in sch.get(conv).reads].index("xp"),
                         weight_layout="kn", pack=False)
    sch.compute_at(sch.get_sblock("pad"), sch.get_loops(sch.get_sblock("conv_update"))[0], preserve_unit_loops=True)


@template("channel_tile")
def channel_tile(sch, target, knobs):
    """The untuned CPU rule's dense convolution (``cpu_rules.channel_tile_conv``): a register tile
    of F vectors of output channels x P output positions along the row, W repacked so that one
    window point's channels load as one vector, every input value broadcast; row tiles of channel
    blocks in parallel, batch norm + ReLU on the tile. With fewer than two vectors of output
    channels, ``tiled_direct``'s schedule instead: there, at 28x28-56x56, its row vectors ran
    1.2-2x faster (the tile stores position by position; a half-width channel vector does half
    the work per FMA); from 32 channels this tile ran 0.7-0.8x ``tiled_direct``'s time (resnet18/50,
    ShuffleNetV2's kernels, 2-core znver4, one thread, interleaved)."""
    pad, conv, epi = sch.get_sblock("pad"), sch.get_sblock("conv"), sch.get_sblock("bn_relu")
    channels = int(sch.get(conv).iter_vars[1].dom.extent)
    if channels < 2 * cpu_rules.lanes_for(target, "float32"):
        tiled_direct.fn(sch, target, knobs)
        return
    if int(sch.get(conv).iter_vars[5].dom.extent) == 1:
        sch.compute_inline(pad)  # a 1x1 kernel pads nothing: read x where the copy would
    else:
        cpu_rules.parallel_copy(sch, pad)
    cpu_rules.channel_tile_conv(sch, conv, [epi], 1, knobs, target)


@template("tiled_direct")
def tiled_direct(sch, target, knobs):
    """Direct convolution with a register tile of (rows x out-channels x columns), columns
    vectorised; row tiles run in parallel with their padded input rows computed at the row tile,
    and batch norm + ReLU applied to each register tile as soon as its reduction ends."""
    pad = sch.get_sblock("pad")
    conv = sch.get_sblock("conv")
    epi = sch.get_sblock("bn_relu")
    b, o, i, j, c, di, dj = sch.get_loops(conv)
    # Register tile i2 x o2 x j2 (j2 vectorised): 4 rows x 4 channels x 8 columns is 16 vector
    # accumulators, 4 loads + 4 broadcasts per 16 FMAs (measured best of the tiles tried here).
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, [1, 4], max_innermost_factor=8))
    o0, o1, o2 = sch.split(o, knobs.tile(o, 3, [4, 4], max_innermost_factor=16))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, [8, 8], max_innermost_factor=16))
    c0, c1 = sch.split(c, knobs.tile(c, 2, [1], max_innermost_factor=16))
    sch.reorder(b, i0, o0, j0, i1, o1, j1, c0, di, dj, c1, i2, o2, j2)
    outer = sch.fuse(b, i0)
    sch.parallel(outer)
    # The padded rows a row tile reads (its rows plus the halo), for all channels and columns.
    # (Vectorising its column loop measured no faster: the pad is ~1% of the work.)
    sch.compute_at(pad, outer, preserve_unit_loops=True)
    # Batch norm + ReLU on each register tile, right after its reduction.
    sch.reverse_compute_at(epi, j1, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(epi)[-1])
    sch.vectorize(j2)
    sch.decompose_reduction(conv, c0)
    unroll(sch, knobs, outer, depths=(0, 16, 64, 512), default=64)


# ---- CUDA ------------------------------------------------------------------------------------


def _cuda_copy(sch, block, nloops, threads):
    """Spread the last ``nloops`` loops of ``block`` (a copy into shared memory) over all the
    block's threads (``threads``: z, y, x extents), consecutive threads on consecutive elements."""
    fused = sch.fuse(*sch.get_loops(block)[-nloops:])
    _, tz, ty, tx = sch.split(fused, [None, *threads])
    for loop, tag in ((tz, "threadIdx.z"), (ty, "threadIdx.y"), (tx, "threadIdx.x")):
        sch.bind(loop, tag)


def _cuda_channel_chunk(target, k, shape_cap):
    """Largest power-of-two input-channel chunk (<= 8) whose staged tiles fit the target's shared
    memory at the largest sampled output tile (``shape_cap``: out-channels, rows, columns), in
    float32 (the widest dtype): sampled schedules then never exceed the limit."""
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024))
    oc, rows, cols = shape_cap
    chunk = 8
    while chunk > 1 and 4 * chunk * ((rows + k - 1) * (cols + k - 1) + oc * k * k) > limit:
        chunk //= 2
    return chunk


@template("cuda_direct", target_kinds=("cuda",))
def cuda_direct(sch, target, knobs):
    """Direct convolution, a thread block per (batch, out-channel tile, row tile, column tile), its
    threads on (out-channels: z, rows: y, columns: x). Each thread accumulates a float32 register
    tile (out-channels x rows, contiguous, x columns strided by the x threads through virtual
    threads, so that a warp reads and writes consecutive columns). Per chunk of input channels the
    block stages the padded input rows its tile needs (the halo included, zeros at the border: the
    pad block computed straight into shared memory) and the chunk's weights in shared memory;
    every staged input is reused by all out-channels of the tile and the k x k taps, every weight
    by all its positions. BN scale/shift + ReLU run on the register tile as it is stored.
    Defaults: 8 out-channels x 4 rows x 56 columns (2 x 4 x 28 threads, 4 x 1 x 2 each), 8 input
    channels a chunk."""
    pad, conv = sch.get_sblock("pad"), sch.get_sblock("conv")
    b, o, i, j, c, di, dj = sch.get_loops(conv)
    k = int(sch.get(di).extent)
    sch.set_scope(conv, 0, "local")
    # Per-thread tile first (innermost factor of a split), then the threads from what is left (the
    # innermost factor of a second split): both bounded, <= 4 x 8 x 32 threads, so that every
    # sample launches (sample_perfect_tile bounds only a split's innermost factor).
    o_rest, o_r = sch.split(o, knobs.tile(o, 2, [4], max_innermost_factor=4))
    o_f = knobs.tile(o_rest, 2, [2], max_innermost_factor=4)
    o0, ot = sch.split(o_rest, o_f)
    i_rest, i_r = sch.split(i, knobs.tile(i, 2, [1], max_innermost_factor=2))
    i_f = knobs.tile(i_rest, 2, [4], max_innermost_factor=8)
    i0, it = sch.split(i_rest, i_f)
    j_f = knobs.tile(j, 2, [32], max_innermost_factor=32)
    j_rest, jt = sch.split(j, j_f)
    j0, jv = sch.split(j_rest, knobs.tile(j_rest, 2, [2], max_innermost_factor=2))
    # The largest sampled tile (16 out-channels, 16 rows, 64 columns) bounds the channel chunk.
    chunk = _cuda_channel_chunk(target, k, (16, 16, 64))
    c0, c1 = sch.split(c, knobs.tile(c, 2, [min(8, chunk)], max_innermost_factor=chunk))
    sch.reorder(b, o0, i0, j0, jv, ot, it, jt, c0, c1, di, dj, o_r, i_r)
    bx = sch.fuse(b, o0, i0, j0)
    sch.bind(bx, "blockIdx.x")
    sch.bind(jv, "vthread.x")
    sch.bind(ot, "threadIdx.z")
    sch.bind(it, "threadIdx.y")
    sch.bind(jt, "threadIdx.x")
    # The sampled factors themselves (not the loops' extents now): a replayed trace re-derives them.
    threads = (o_f[1], i_f[1], j_f[1])
    sch.reverse_compute_at(sch.get_sblock("bn_relu"), jt, preserve_unit_loops=True)
    sch.set_scope(pad, 0, "shared")
    sch.compute_at(pad, c0, preserve_unit_loops=True)
    _cuda_copy(sch, pad, 3, threads)
    weights = sch.cache_read(conv, "weight", "shared")
    sch.compute_at(weights, c0, preserve_unit_loops=True)
    _cuda_copy(sch, weights, 4, threads)
    sch.decompose_reduction(conv, c0)
    cuda_unroll(sch, knobs, bx)


def _relax_pattern():
    from tvm.relax.dpl import is_op, is_tuple_get_item, wildcard
    x, w, bias = wildcard(), wildcard(), wildcard()
    gamma, beta, mean, var = wildcard(), wildcard(), wildcard(), wildcard()
    conv = is_op("relax.nn.conv2d")(x, w)
    # ONNX Conv with a bias imports as conv2d + add(reshape(bias) to (1, C, 1, 1)): the bias is
    # optional and folds into bn_shift.
    biased = is_op("relax.add")(conv, bias)
    bn = is_op("relax.nn.batch_norm")(biased | conv, gamma, beta, mean, var)
    root = is_op("relax.nn.relu")(is_tuple_get_item(bn, 0))
    return root, {"x": x, "w": w, "bias": bias, "gamma": gamma, "beta": beta, "mean": mean, "var": var,
                  "conv": conv, "bn": bn}


def _ints(values):
    return tuple(int(v) for v in values)


def _conv_shape(matched):
    """The pattern's shape for the matched conv2d (x, w), when it is an NCHW/OIHW 'same' conv this
    pattern covers (stride 1, dilation 1, groups 1, odd square kernel k, padding k//2) in
    float32, else None."""
    x, w, conv = matched["x"], matched["w"], matched["conv"]
    xs, ws, ys = static_shape(x), static_shape(w), static_shape(conv)
    if None in (xs, ws, ys) or len(xs) != 4 or len(ws) != 4:
        return None
    n, ci, h, wd = xs
    co, wci, k, k2 = ws
    if wci != ci or k != k2 or k % 2 != 1:
        return None
    a = conv.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return None
    if (_ints(a.strides) != (1, 1) or _ints(a.dilation) != (1, 1) or int(a.groups) != 1
            or _ints(a.padding) != (k // 2,) * 4):
        return None
    if a.out_dtype is not None and str(a.out_dtype) not in ("", "float32"):
        return None
    shape = {"n": n, "c_in": ci, "h": h, "w": wd, "c_out": co, "kernel": k}
    if ys != (n, co) + _dims(shape)[7:] or any(dtype_of(t) != "float32" for t in (x, w, conv)):
        return None
    return shape


def _bias_channels(bias, co):
    """An ONNX Conv's bias as Relax carries it, (co, 1, 1) or (1, co, 1, 1), as (co,); None
    for anything else (a residual, a broadcast over positions)."""
    from tvm import relax
    if bias is None or static_shape(bias) not in ((co, 1, 1), (1, co, 1, 1)) or dtype_of(bias) != "float32":
        return None
    return relax.op.reshape(bias, (co,))


def _relax_rewrite(matched, kernel):
    """relu(batch_norm(conv2d(x, w) [+ bias])[0]) -> the kernel (``_conv_shape``); batch norm
    (and bias) become bn_scale/bn_shift as Relax arithmetic on their inputs, which FoldConstant
    folds when they are constants."""
    from tvm import relax
    shape = _conv_shape(matched)
    if shape is None:
        return None
    co, bn = shape["c_out"], matched["bn"]
    params = [matched[k] for k in ("gamma", "beta", "mean", "var")]
    if any(static_shape(p) != (co,) or dtype_of(p) != "float32" for p in params):
        return None
    b = bn.attrs
    if int(b.axis) not in (1, -3) or not b.center or not b.scale or b.training:
        return None
    gamma, beta, mean, var = params
    eps = relax.const(float(b.epsilon), "float32")
    scale = relax.op.divide(gamma, relax.op.sqrt(relax.op.add(var, eps)))
    if matched.get("bias") is None:
        shift = relax.op.subtract(beta, relax.op.multiply(mean, scale))
    else:
        # batch_norm(conv + bias) = conv * scale + (beta + (bias - mean) * scale)
        bias_c = _bias_channels(matched["bias"], co)
        if bias_c is None:
            return None
        shift = relax.op.add(beta, relax.op.multiply(relax.op.subtract(bias_c, mean), scale))
    return kernel(shape, "float32", [matched["x"], matched["w"], scale, shift])


def _folded_relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x, w, bias = wildcard(), wildcard(), wildcard()
    conv = is_op("relax.nn.conv2d")(x, w)
    root = is_op("relax.nn.relu")(is_op("relax.add")(conv, bias))
    return root, {"x": x, "w": w, "bias": bias, "conv": conv}


def _folded_relax_rewrite(matched, kernel):
    """relu(conv2d(x, w) + bias): batch norm already folded into w and bias, as torch.onnx exports
    an eval-mode Conv + BatchNorm (torchvision's ResNets) -> the kernel with bn_scale 1 and
    bn_shift the bias, the same arithmetic."""
    from tvm import relax
    shape = _conv_shape(matched)
    if shape is None:
        return None
    shift = _bias_channels(matched["bias"], shape["c_out"])
    if shift is None:
        return None
    scale = relax.const(np.ones(shape["c_out"], "float32"))
    return kernel(shape, "float32", [matched["x"], matched["w"], scale, shift])


def onnx_graph(shape, dtype):
    """Conv, BatchNormalization, Relu as exported; BN carries the folded scale/shift as its
    gamma/beta with mean 0 and var 1 - eps, so it computes exactly scale * conv + shift."""
    from onnx import helper
    n, ci, h, w, co, k, *_ = _dims(shape)
    pad = k // 2
    eps = 1e-5
    consts = {"mean": np.zeros(co, dtype), "var": np.full(co, 1.0 - eps, dtype)}
    nodes = [helper.make_node("Conv", ["x", "weight"], ["c"], pads=[pad] * 4, kernel_shape=[k, k]),
             helper.make_node("BatchNormalization", ["c", "bn_scale", "bn_shift", "mean", "var"], ["b"], epsilon=eps),
             helper.make_node("Relu", ["b"], ["y"])]
    oh, ow = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    return onnx_model("conv2d_bn_relu", nodes,
                      [("x", (n, ci, h, w)), ("weight", (co, ci, k, k)), ("bn_scale", (co,)), ("bn_shift", (co,))],
                      [("y", (n, co, oh, ow))], dtype, consts)

PATTERN = Pattern.from_module(
    globals(),
    description="relu(batchnorm(conv2d(x, W))): NCHW 'same' conv, stride 1, folded inference BN + ReLU",
    shape_params=[ShapeParam("n", 1, 1, "batch"),
                  ShapeParam("c_in", 64, 4, "input channels"),
                  ShapeParam("h", 56, 8, "input height"),
                  ShapeParam("w", 56, 8, "input width"),
                  ShapeParam("c_out", 64, 8, "output channels"),
                  ShapeParam("kernel", 3, 3, "kernel size (square); padding is kernel // 2")],
    templates=[channel_tile, tiled_direct, gemm_direct, cuda_direct],
    relax_rules=[RelaxRule("conv2d_batch_norm_relu", _relax_pattern, _relax_rewrite),
                 RelaxRule("conv2d_bias_relu", _folded_relax_pattern, _folded_relax_rewrite)],
)
