"""swiglu_ffn: y = r + dropout((silu(x @ W1) * (x @ W3)) @ W2), the Llama-style gated FFN.

Weights are [in, out], so a GEMM's innermost output loop reads contiguous weights. sigmoid is built
on ``exp_f32`` of -|a| (the polynomial holds for non-positive arguments and never overflows);
dropout is ``lib.tir_math``'s hashed mask over the (tokens, hidden) output (p = p_permille / 1000).
Unfused, g, u and the down projection's output round-trip through memory; fused, the gate and up
tiles are computed back to back from the same x rows and only h is stored, and dropout and the
residual run on the down accumulator tile. On CUDA (``cuda_two_gemms``) the down projection needs
all of an h row, a grid-wide dependency, so the PrimFunc becomes two kernels with h (float32) in
global memory between them. On an sm_90 GPU in float16/bfloat16 the kernel template ``cuda_wgmma``
comes first where its tiles fit: the same two kernels on Hopper tensor cores (TMA + wgmma, written
in the tirx script), h in the dtype (wgmma's operand type, as torch computes it). For up to 256
tokens a search also weighs ``cuda_wgmma_split_k``, the down projection's K split among CTAs (its
float32 partials summed with dropout and the residual by a third kernel).
"""

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import (FLOAT_DTYPES, Pattern, RelaxRule, constant_value, dtype_of,
                              onnx_model, static_shape, template)
from search_spaces.lib import cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import (cuda_fetch_shared, cuda_pipeline, cuda_split_k, cuda_tile_output, cuda_unroll,
                                         cuda_vector_lanes)
from search_spaces.lib.gemm import ffn_shape
from search_spaces.lib.stages import matmul_stage
from search_spaces.lib.tiling import epilogue_on_tile, parallel_register_tile, unroll
from search_spaces.lib.tir_math import DROPOUT_SEED as SEED
from search_spaces.lib.tir_math import DROPOUT_PERMILLE, dropout_constants, dropout_mask, dropout_p, exp_f32, hash_keep
from search_spaces.lib.tirx_sequence import buffer, prefixed, sequence, unprefixed, workspace


def build(shape, dtype):
    return build_with(shape, dtype, dropout_p(shape), SEED)


def build_with(shape, dtype, p, seed):
    """The kernel with dropout probability ``p`` and mask seed ``seed`` baked in as constants."""
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    mix, thresh, keep_scale = dropout_constants(p, seed, tokens, hidden)

    @T.prim_func(s_tir=True)
    def swiglu_ffn(x: T.Buffer((tokens, hidden), dtype), w1: T.Buffer((hidden, inter), dtype),
                   w3: T.Buffer((hidden, inter), dtype), w2: T.Buffer((inter, hidden), dtype),
                   r: T.Buffer((tokens, hidden), dtype), y: T.Buffer((tokens, hidden), dtype)):
        T.func_attr({"global_symbol": "swiglu_ffn", "tirx.noalias": True})
        g = T.sblock_alloc_buffer((tokens, inter), "float32")
        u = T.sblock_alloc_buffer((tokens, inter), "float32")
        h = T.sblock_alloc_buffer((tokens, inter), "float32")
        acc = T.sblock_alloc_buffer((tokens, hidden), "float32")
        matmul_stage("gate", g, (tokens, inter, hidden),
                     lambda t, n, k: T.Cast("float32", x[t, k]) * T.Cast("float32", w1[k, n]))
        matmul_stage("up", u, (tokens, inter, hidden),
                     lambda t, n, k: T.Cast("float32", x[t, k]) * T.Cast("float32", w3[k, n]))
        for t, n in T.grid(tokens, inter):
            with T.sblock("swiglu"):
                vt, vn = T.axis.remap("SS", [t, n])
                a: T.let = g[vt, vn]
                # e = exp(-|a|) in (0, 1]: sigmoid(a) = (a < 0 ? e : 1) / (1 + e), never overflowing.
                e: T.let = exp_f32(-T.fabs(a))
                h[vt, vn] = a * T.Select(a < T.float32(0), e, T.float32(1)) / (T.float32(1) + e) * u[vt, vn]
        matmul_stage("down", acc, (tokens, hidden, inter), lambda t, m, n: h[t, n] * T.Cast("float32", w2[n, m]))
        for t, m in T.grid(tokens, hidden):
            with T.sblock("epilogue"):
                vt, vm = T.axis.remap("SS", [t, m])
                y[vt, vm] = T.Cast(dtype, T.Cast("float32", r[vt, vm]) + T.Select(
                    hash_keep(vt * hidden + vm, mix, thresh), acc[vt, vm] * T.float32(keep_scale), T.float32(0)))

    return swiglu_ffn


def silu(a):
    a = np.asarray(a, dtype=np.float64)
    return a / (1.0 + np.exp(-a))


def reference_with(x, w1, w3, w2, r, p, seed):
    f64 = np.float64
    x64 = x.astype(f64)
    hmid = silu(x64 @ w1.astype(f64)) * (x64 @ w3.astype(f64))
    down = hmid @ w2.astype(f64)
    keep = dropout_mask(x.shape[0], w2.shape[1], p, seed)
    return (r.astype(f64) + np.where(keep, down / (1.0 - p), 0.0)).astype(x.dtype)


def reference(x, w1, w3, w2, r, shape=None):
    return reference_with(x, w1, w3, w2, r, dropout_p(shape or {}), SEED)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((tokens, hidden)),
              rng.standard_normal((hidden, inter)) / np.sqrt(hidden),
              rng.standard_normal((hidden, inter)) / np.sqrt(hidden),
              rng.standard_normal((inter, hidden)) / np.sqrt(inter),
              rng.standard_normal((tokens, hidden))]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    # three GEMMs; silu*u ~ 5 per element (exp as one op); dropout select+scale+residual 2, hash ignored.
    return 6.0 * tokens * hidden * inter + 5.0 * tokens * inter + 2.0 * tokens * hidden


def nbytes(shape, dtype):
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    return np.dtype(dtype).itemsize * (3 * tokens * hidden + 3 * hidden * inter)


@template("packed_gemms")
def packed_gemms(sch, target, knobs):
    """The library's CPU GEMM (``search_spaces.lib.cpu_gemm``) twice: gate and up share one
    parallel tile loop, each with its weight packed into panels per task (read as stored for few
    tokens) and its own register tile, the SiLU product on the two tiles, only h stored; then the
    down projection with dropout and the residual on its register tile."""
    schedule_gemm(sch, sch.get_sblock("gate"), knobs, target, epilogue_blocks=[sch.get_sblock("swiglu")],
                  weight_layout="kn", siblings=[sch.get_sblock("up")])
    schedule_gemm(sch, sch.get_sblock("down"), knobs, target, epilogue_blocks=[sch.get_sblock("epilogue")],
                  weight_layout="kn")


@template("two_gemms")
def two_gemms(sch, target, knobs):
    """Two register-blocked GEMM nests, each parallel over (token tile, feature tile) and
    vectorised over output features. In the first, the gate and up accumulator tiles are computed
    at the register-tile loop of the SiLU product, one after the other over the same x rows, and
    only h is stored; in the second, dropout and the residual run on the down accumulator tile."""
    gate, up, prod = sch.get_sblock("gate"), sch.get_sblock("up"), sch.get_sblock("swiglu")
    down, epi = sch.get_sblock("down"), sch.get_sblock("epilogue")

    t, n = sch.get_loops(prod)
    t0, t1, t2 = sch.split(t, knobs.tile(t, 3, [8, 4], max_innermost_factor=8))
    n0, n1, n2 = sch.split(n, knobs.tile(n, 3, [4, 16], max_innermost_factor=32))
    sch.reorder(t0, n0, t1, n1, t2, n2)
    outer = sch.fuse(t0, n0)
    sch.parallel(outer)
    sch.vectorize(n2)
    # Both accumulator tiles land before the product in the register-tile loop, so g and u shrink
    # to (t2 x n2) tiles (registers), each with its k loop outermost; x's t2 rows stay in L1 between.
    for blk in (up, gate):
        sch.compute_at(blk, n1, preserve_unit_loops=True)
        bt, bn, bk = sch.get_loops(blk)[-3:]
        sch.reorder(bk, bt, bn)
        sch.vectorize(bn)
        sch.decompose_reduction(blk, bk)
    unroll(sch, knobs, outer)

    outer, tile, k0, vec = parallel_register_tile(sch, knobs, down, [8, 4], [4, 16], 64, max_i=8, max_j=32)
    epilogue_on_tile(sch, down, epi, tile, k0, vec)
    unroll(sch, knobs, outer)


@template("cuda_two_gemms", target_kinds=("cuda",))
def cuda_two_gemms(sch, target, knobs):
    """Two shared-memory tiled GEMM kernels (a grid-wide dependency sits between them: every h
    row feeds every down-projection output). The first tiles (tokens x inter): per thread a
    register tile of gate and of up accumulators, filled in one k loop from the same staged x
    tile (and the w1, w3 tiles), then h = silu(g) * u stored once, in float32. The second tiles
    (tokens x hidden) over h and w2, dropout and the residual applied to its accumulator tile on
    the way out. Both k loops are software-pipelined through registers."""
    gate, up, prod = sch.get_sblock("gate"), sch.get_sblock("up"), sch.get_sblock("swiglu")
    down, epi = sch.get_sblock("down"), sch.get_sblock("epilogue")
    x, w1 = (r.source for r in sch.get(gate).reads[-2:])
    dtype, hidden, inter = str(x.dtype), int(x.shape[1]), int(w1.shape[1])

    # Kernel 1. W1 and W3 are contiguous along inter: each thread owns runs of `wide` adjacent
    # features, read from shared as one vector per k; x is contiguous along hidden (k).
    wide, narrow = cuda_vector_lanes(dtype, inter, max_bytes=16), cuda_vector_lanes(dtype, hidden)
    for blk in (gate, up):
        sch.set_scope(blk, 0, "local")
    t, n = sch.get_loops(prod)
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, t, n, rows=(8, 4), cols=(16, 1), j_lanes=wide)
    for blk in (up, gate):
        sch.compute_at(blk, tx, preserve_unit_loops=False)
    k0s = cuda_split_k(sch, knobs, [sch.get_loops(blk)[-1] for blk in (gate, up)], narrow)
    if wide > 1:  # the feature run innermost, under the whole k loop
        for blk in (gate, up):
            sch.reorder(*sch.get_loops(blk)[-3:], sch.get_loops(blk)[-4])
    # One k loop for both GEMMs: each x tile is staged once and feeds both accumulator tiles.
    k0 = sch.merge(*k0s)
    fetches = [cuda_fetch_shared(sch, gate, 0, k0, (nty, ntx), narrow, k_major=True, consumers=[gate, up])]
    fetches += [cuda_fetch_shared(sch, blk, 1, k0, (nty, ntx), wide, k_major=False) for blk in (gate, up)]
    for blk in (gate, up):
        if wide > 1:
            sch.vectorize(sch.get_loops(blk)[-1])
        sch.decompose_reduction(blk, k0)
    cuda_unroll(sch, knobs, bx)
    cuda_pipeline(sch, k0, fetches)

    # Kernel 2: the down projection, with dropout and the residual at its register tile.
    wide, narrow = cuda_vector_lanes(dtype, hidden, max_bytes=16), cuda_vector_lanes("float32", inter)
    sch.set_scope(down, 0, "local")
    t, m, k = sch.get_loops(down)
    bx, _, tx, nty, ntx, lane = cuda_tile_output(sch, knobs, t, m, rows=(8, 4), cols=(8, 1), j_lanes=wide)
    (k0,) = cuda_split_k(sch, knobs, [k], narrow)
    if wide > 1:
        sch.reorder(*sch.get_loops(down)[-3:], lane)
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    fetches = [cuda_fetch_shared(sch, down, 0, k0, (nty, ntx), narrow, k_major=True),
               cuda_fetch_shared(sch, down, 1, k0, (nty, ntx), wide, k_major=False)]
    if wide > 1:
        sch.vectorize(lane)
    sch.decompose_reduction(down, k0)
    cuda_unroll(sch, knobs, bx)
    cuda_pipeline(sch, k0, fetches)


# Hopper (sm_90, float16/bfloat16): the gate/up pair and the down projection as two wgmma kernels
# in one PrimFunc (``lib.tirx_sequence``), h between them in global memory, in the dtype (wgmma's
# operand type). Their knobs are prefixed ``gate_`` and ``down_``.
GATE, DOWN = "gate_", "down_"
WGMMA_KNOBS = {**prefixed(cuda_wgmma.SWIGLU_KNOBS, GATE), **prefixed(cuda_wgmma.KNOBS, DOWN)}
WGMMA_DEFAULT_KNOBS = {**prefixed(cuda_wgmma.SWIGLU_DEFAULT_KNOBS, GATE), **prefixed(cuda_wgmma.DEFAULT_KNOBS, DOWN)}


def _gemm_shapes(shape):
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    return {"m": tokens, "n": inter, "k": hidden}, {"m": tokens, "n": hidden, "k": inter}


def _wgmma_check(shape, dtype, knobs, check_down=cuda_wgmma.check):
    gate, down = _gemm_shapes(shape)
    cuda_wgmma.check(gate, dtype, unprefixed(knobs, GATE), space=cuda_wgmma.SWIGLU_KNOBS,
                     default=cuda_wgmma.SWIGLU_DEFAULT_KNOBS, weights=2)
    check_down(down, dtype, unprefixed(knobs, DOWN))
    dropout_constants(dropout_p(shape), SEED, shape["tokens"], shape["hidden"])


def _dropout_residual(shape):
    """The down projection's epilogue: r + dropout(acc) (``hash_keep``'s mask), float32."""
    tokens, hidden = shape["tokens"], shape["hidden"]
    mix, thresh, keep_scale = dropout_constants(dropout_p(shape), SEED, tokens, hidden)

    def dropout_residual(acc, residual, row, col):
        if not dropout_p(shape):  # inference: the mask keeps everything, scale 1
            return residual + acc
        # the flat index bound once: the epilogue is unrolled over the accumulator tile, and the hash
        # repeats its argument eight times
        flat = tirx.Var("flat", "int32")
        return residual + tirx.Let(flat, row * hidden + col, T.Select(
            hash_keep(flat, mix, thresh), acc * T.float32(keep_scale), T.float32(0)))

    return dropout_residual


def _ffn_buffers(shape, dtype):
    """The composite's parameters (x, w1, w3, w2, r, y) and h, the gate kernel's output."""
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    x, r, y = (buffer(name, (tokens, hidden), dtype) for name in ("x", "r", "y"))
    w1, w3 = (buffer(name, (hidden, inter), dtype) for name in ("w1", "w3"))
    return x, w1, w3, buffer("w2", (inter, hidden), dtype), r, y, workspace("h", (tokens, inter), dtype)


def _wgmma_two_gemms(shape, dtype, knobs):
    """h = silu(x W1) * (x W3) by ``cuda_wgmma.swiglu`` (both weight tiles per k slice under one A
    tile, SiLU-multiply on the two accumulators), then y = r + dropout(h W2) by
    ``cuda_wgmma.gemm_residual`` (dropout and the residual on the accumulator); the weights are
    read as stored, (in, out), N-major."""
    gate_shape, down_shape = _gemm_shapes(shape)
    gate = cuda_wgmma.swiglu(gate_shape, dtype, unprefixed(knobs, GATE), b_layout="kn")
    down = cuda_wgmma.gemm_residual(down_shape, dtype, unprefixed(knobs, DOWN), _dropout_residual(shape),
                                    b_layout="kn", name="swiglu_down")
    x, w1, w3, w2, r, y, h = _ffn_buffers(shape, dtype)
    return sequence("swiglu_ffn", [x, w1, w3, w2, r, y], [(gate, [x, w1, w3, h]), (down, [h, w2, r, y])], [h])


def _wgmma_fill_tiles(shape, dtype, fill_down=cuda_wgmma.fill_tile):
    """Each GEMM's tile shrunk where its default would leave SMs idle (``cuda_wgmma.fill_tile``;
    the down projection's by ``fill_down``)."""
    gate, down = _gemm_shapes(shape)
    return {**prefixed(cuda_wgmma.fill_tile(gate, dtype, cuda_wgmma.SWIGLU_KNOBS, cuda_wgmma.SWIGLU_DEFAULT_KNOBS, 2),
                       GATE),
            **prefixed(fill_down(down, dtype), DOWN)}


cuda_wgmma_two_gemms = KernelTemplate("cuda_wgmma", _wgmma_two_gemms, WGMMA_KNOBS, WGMMA_DEFAULT_KNOBS, _wgmma_check,
                                      shape_default=_wgmma_fill_tiles, **cuda_wgmma.HOPPER)

# The down projection of a few tokens with its K (inter) split (``cuda_wgmma.split_k_kernels``):
# its knobs ``down_`` from SPLIT_K_KNOBS; the gate kernel as above.
SPLIT_KNOBS = {**prefixed(cuda_wgmma.SWIGLU_KNOBS, GATE), **prefixed(cuda_wgmma.SPLIT_K_KNOBS, DOWN)}
SPLIT_DEFAULT_KNOBS = {**prefixed(cuda_wgmma.SWIGLU_DEFAULT_KNOBS, GATE),
                       **prefixed(cuda_wgmma.SPLIT_K_DEFAULT_KNOBS, DOWN)}


def _wgmma_split_down(shape, dtype, knobs):
    """``cuda_wgmma``'s gate kernel, then the down projection with K split among CTAs
    (``cuda_wgmma.split_k_kernels``): float32 partials of h W2, summed with dropout and the residual
    by a third kernel; for a few tokens, whose down projection has few tiles over a long K."""
    gate_shape, down_shape = _gemm_shapes(shape)
    gate = cuda_wgmma.swiglu(gate_shape, dtype, unprefixed(knobs, GATE), b_layout="kn")
    dropout_residual = _dropout_residual(shape)
    partials, summed, splits = cuda_wgmma.split_k_kernels(
        down_shape, dtype, unprefixed(knobs, DOWN),
        lambda acc, _up, xs, row, col: dropout_residual(acc, T.Cast("float32", xs[0][row, col]), row, col),
        [("X", (shape["tokens"], shape["hidden"]), dtype)], "kn", "swiglu_down")
    x, w1, w3, w2, r, y, h = _ffn_buffers(shape, dtype)
    p = workspace("partials", (splits * shape["tokens"], shape["hidden"]), "float32")
    return sequence("swiglu_ffn", [x, w1, w3, w2, r, y],
                    [(gate, [x, w1, w3, h]), (partials, [h, w2, p]), (summed, [p, r, y])], [h, p])


# after the unsplit kernel: not yet measured on a GPU, so a search weighs it, no default takes it
cuda_wgmma_split_down = KernelTemplate(
    "cuda_wgmma_split_k", _wgmma_split_down, SPLIT_KNOBS, SPLIT_DEFAULT_KNOBS,
    lambda shape, dtype, knobs: _wgmma_check(shape, dtype, knobs, cuda_wgmma.split_k_check),
    shape_default=lambda shape, dtype: _wgmma_fill_tiles(shape, dtype, cuda_wgmma.split_k_fill), **cuda_wgmma.HOPPER)


def _relax_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard
    x, w1, w3, w2, r = (wildcard() for _ in range(5))
    keep_scale = is_const()
    gate = is_op("relax.matmul")(x, w1)
    act = is_op("relax.multiply")(gate, is_op("relax.sigmoid")(gate))
    hidden = is_op("relax.multiply")(act, is_op("relax.matmul")(x, w3))
    down = is_op("relax.matmul")(hidden, w2)
    root = is_op("relax.add")(is_op("relax.multiply")(down, keep_scale) | down, r)
    return root, {"x": x, "w1": w1, "w3": w3, "w2": w2, "r": r, "keep_scale": keep_scale}


def _dropout_permille(scale, tokens, hidden):
    """p_permille of a constant keep/(1-p) mask that is exactly this pattern's hashed mask, or None.

    Inference graphs have no dropout; a training-style graph exported with our mask as a constant
    (as ``onnx_graph`` writes it) is matched too, since the kernel computes exactly that."""
    values = np.asarray(scale)
    if values.shape != (tokens, hidden) or values.max() <= 1.0:
        return None
    permille = int(round(1000 * (1.0 - 1.0 / float(values.max()))))
    p = permille / 1000.0
    expected = np.where(dropout_mask(tokens, hidden, p, SEED), 1.0 / (1.0 - p), 0.0).astype(values.dtype)
    return permille if np.array_equal(values, expected) else None


def _relax_rewrite(matched, kernel):
    """r + (silu(x @ w1) * (x @ w3)) @ w2, all of one of the pattern's dtypes, x and r of the same
    shape, any rank >= 2 (leading axes are tokens); no dropout (inference) or exactly this
    pattern's mask."""
    from tvm import relax
    x, w1, w3, w2, r = (matched[k] for k in ("x", "w1", "w3", "w2", "r"))
    xs = static_shape(x)
    if xs is None or len(xs) < 2 or static_shape(r) != xs:
        return None
    hidden = xs[-1]
    w1s = static_shape(w1)
    if w1s is None or len(w1s) != 2 or w1s[0] != hidden:
        return None
    inter = w1s[1]
    if static_shape(w3) != (hidden, inter) or static_shape(w2) != (inter, hidden):
        return None
    dtype = dtype_of(x)
    if dtype not in FLOAT_DTYPES or any(dtype_of(t) != dtype for t in (w1, w3, w2, r)):
        return None
    tokens = int(np.prod(xs[:-1]))
    permille = 0
    if "keep_scale" in matched:
        permille = _dropout_permille(constant_value(matched["keep_scale"]), tokens, hidden)
        if permille is None or len(xs) != 2:
            return None
    flat = (lambda t: t) if len(xs) == 2 else (lambda t: relax.op.reshape(t, (tokens, hidden)))
    out = kernel({"tokens": tokens, "hidden": hidden, "inter": inter, "p_permille": permille}, dtype,
                 [flat(x), w1, w3, w2, flat(r)])
    return out if len(xs) == 2 else relax.op.reshape(out, xs)


def onnx_graph(shape, dtype):
    """MatMul/Sigmoid/Mul (SiLU), MatMul, Mul, MatMul, Mul by a constant keep/(1-p) mask (as
    softmax_dropout's graph: p and the seed are compile-time constants), Add the residual."""
    from onnx import helper
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["inter"]
    p = dropout_p(shape)
    scale = np.where(dropout_mask(tokens, hidden, p, SEED), 1.0 / (1.0 - p), 0.0).astype(dtype)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["act"]),
             helper.make_node("MatMul", ["x", "w3"], ["u"]),
             helper.make_node("Mul", ["act", "u"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["d"]),
             helper.make_node("Mul", ["d", "keep_scale"], ["dd"]),
             helper.make_node("Add", ["r", "dd"], ["y"])]
    return onnx_model("swiglu_ffn", nodes,
                      [("x", (tokens, hidden)), ("w1", (hidden, inter)), ("w3", (hidden, inter)),
                       ("w2", (inter, hidden)), ("r", (tokens, hidden))],
                      [("y", (tokens, hidden))], dtype, {"keep_scale": scale})


PATTERN = Pattern.from_module(
    globals(),
    description="r + dropout((silu(x W1) * (x W3)) W2): SwiGLU FFN with hashed dropout and residual fused",
    # inter ~2.75x hidden, as in Llama.
    shape_params=[*ffn_shape((128, 8), (256, 16), (704, 24)), DROPOUT_PERMILLE],
    templates=[packed_gemms, two_gemms, cuda_wgmma_two_gemms, cuda_wgmma_split_down, cuda_two_gemms],
    relax_rules=[RelaxRule("swiglu_residual", _relax_pattern, _relax_rewrite)],
)
