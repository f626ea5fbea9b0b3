"""rope_qk: scores = rope(q) @ rope(k)^T * scale, rotary position embedding fused into Q.K^T.

Rotate-half RoPE (GPT-NeoX, Llama) with cos/sin tables (seq_k, head_dim) as inputs; queries sit at
the last seq_q of the seq_k key positions; scale = 1/sqrt(head_dim). The rotated tensors are
indexed by (half, index in the half), so the partner element is an affine index (no modulo) and the
rotation vectorises; rotated K is stored transposed for the GEMM's key axis. Unfused, rope(q) and
rope(k) go to memory and back; fused, each tile's rotation is computed once, into a small buffer
(``key_tiles``) or shared memory (``cuda_score_tiles``), and reused by the whole tile. On an sm_90
GPU in float16/bfloat16, ``cuda_rotate_then_gemm`` rotates every row once into a workspace, then
one batched wgmma GEMM computes every head's scores (seq_k a multiple of 8); else
``cuda_wgmma_scores``, the tiles rotated in place after their TMA copy, then wgmma.
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, onnx_model, template
from search_spaces.lib import cuda_attention, cuda_wgmma
from search_spaces.lib.attention import BATCH, HEADS
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.cuda_gemm import cuda_tile_output, cuda_unroll, cuda_vector_lanes
from search_spaces.lib.tiling import unroll
from search_spaces.lib.tirx_sequence import buffer, sequence, workspace

BASE = 10000.0


def _dims(shape):
    b, heads, sq, sk, d = (shape[n] for n in ("batch", "heads", "seq_q", "seq_k", "head_dim"))
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, not {d}")
    if sk < sq:
        raise ValueError(f"seq_k ({sk}) must be >= seq_q ({sq}): queries are the last seq_q positions")
    return b, heads, sq, sk, d


def build(shape, dtype):
    b, heads, sq, sk, d = _dims(shape)
    half = d // 2
    off = sk - sq
    scale = 1.0 / math.sqrt(d)

    @T.prim_func(s_tir=True)
    def rope_qk(q: T.Buffer((b, heads, sq, d), dtype), k: T.Buffer((b, heads, sk, d), dtype),
                cos: T.Buffer((sk, d), dtype), sin: T.Buffer((sk, d), dtype),
                scores: T.Buffer((b, heads, sq, sk), dtype)):
        T.func_attr({"global_symbol": "rope_qk", "tirx.noalias": True})
        qr = T.sblock_alloc_buffer((b, heads, sq, 2, half), "float32")
        # Transposed: keys innermost, for the GEMM's vectorised key axis.
        kr = T.sblock_alloc_buffer((b, heads, 2, half, sk), "float32")
        acc = T.sblock_alloc_buffer((b, heads, sq, sk), "float32")
        for n, h, i, c, e in T.grid(b, heads, sq, 2, half):
            with T.sblock("rope_q"):
                vn, vh, vi, vc, ve = T.axis.remap("SSSSS", [n, h, i, c, e])
                qr[vn, vh, vi, vc, ve] = (
                    T.Cast("float32", q[vn, vh, vi, vc * half + ve])
                    * T.Cast("float32", cos[off + vi, vc * half + ve])
                    + T.Cast("float32", q[vn, vh, vi, (1 - vc) * half + ve]) * T.Cast("float32", vc * 2 - 1)
                    * T.Cast("float32", sin[off + vi, vc * half + ve]))
        for n, h, c, e, j in T.grid(b, heads, 2, half, sk):
            with T.sblock("rope_k"):
                vn, vh, vc, ve, vj = T.axis.remap("SSSSS", [n, h, c, e, j])
                kr[vn, vh, vc, ve, vj] = (
                    T.Cast("float32", k[vn, vh, vj, vc * half + ve])
                    * T.Cast("float32", cos[vj, vc * half + ve])
                    + T.Cast("float32", k[vn, vh, vj, (1 - vc) * half + ve]) * T.Cast("float32", vc * 2 - 1)
                    * T.Cast("float32", sin[vj, vc * half + ve]))
        for n, h, i, j, c, e in T.grid(b, heads, sq, sk, 2, half):
            with T.sblock("qk"):
                vn, vh, vi, vj, vc, ve = T.axis.remap("SSSSRR", [n, h, i, j, c, e])
                with T.init():
                    acc[vn, vh, vi, vj] = T.float32(0)
                acc[vn, vh, vi, vj] = acc[vn, vh, vi, vj] + qr[vn, vh, vi, vc, ve] * kr[vn, vh, vc, ve, vj]
        for n, h, i, j in T.grid(b, heads, sq, sk):
            with T.sblock("scale"):
                vn, vh, vi, vj = T.axis.remap("SSSS", [n, h, i, j])
                scores[vn, vh, vi, vj] = T.Cast(dtype, acc[vn, vh, vi, vj] * T.float32(scale))

    return rope_qk


def rope_tables(positions, d, base=BASE):
    """cos and sin (positions, d) of the rotate-half convention, in float64."""
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """rope(x) for x (..., seq, d) with the cos/sin rows of its positions (seq, d), float64."""
    x = x.astype(np.float64)
    return x * cos.astype(np.float64) + rotate_half(x) * sin.astype(np.float64)


def reference(q, k, cos, sin):
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    qr = apply_rope(q, cos[sk - sq:sk], sin[sk - sq:sk])
    kr = apply_rope(k, cos[:sk], sin[:sk])
    return (np.matmul(qr, np.swapaxes(kr, -1, -2)) / math.sqrt(d)).astype(q.dtype)


def make_inputs(shape, dtype, seed):
    b, heads, sq, sk, d = _dims(shape)
    rng = np.random.default_rng(seed)
    cos, sin = rope_tables(sk, d)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((b, heads, sq, d)), rng.standard_normal((b, heads, sk, d)), cos, sin]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    b, heads, sq, sk, d = _dims(shape)
    # rope: 2 mul + 1 add per rotated element (the sign ignored); QK^T: 2*D per score; scale: 1.
    return 3.0 * b * heads * (sq + sk) * d + 2.0 * b * heads * sq * sk * d + b * heads * sq * sk


def nbytes(shape, dtype):
    b, heads, sq, sk, d = _dims(shape)
    return np.dtype(dtype).itemsize * (b * heads * (sq + sk) * d + 2 * sk * d + b * heads * sq * sk)


@template("key_tiles")
def key_tiles(sch, target, knobs):
    """(batch, head, query tile) in parallel; the query tile's rope(q) computed once at that loop,
    each key tile's rope(k) computed once at the key-tile loop and reused by every query of the
    tile; a register-blocked (queries x keys) accumulator vectorised along keys, scaled at the tile."""
    qk = sch.get_sblock("qk")
    epi = sch.get_sblock("scale")
    rq = sch.get_sblock("rope_q")
    rk = sch.get_sblock("rope_k")
    n, h, i, j, c, e = sch.get_loops(qk)
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, [8, 4], max_innermost_factor=8))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, [4, 16], max_innermost_factor=64))
    sch.reorder(n, h, i0, j0, i1, j1, c, e, i2, j2)
    outer = sch.fuse(n, h, i0)
    sch.parallel(outer)
    sch.reverse_compute_at(epi, j1, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(epi)[-1])
    # The K tile joins the key-tile loop: rotated once per (query tile, key tile), and the compacted
    # kr buffer shrinks to (D, key tile). Its key loop goes outermost so the rotation vectorises
    # along e (contiguous k, cos, sin reads; the transposed stores are strided).
    sch.compute_at(rk, j0, preserve_unit_loops=True)
    rc, re_, rj = sch.get_loops(rk)[-3:]
    sch.reorder(rj, rc, re_)
    sch.vectorize(re_)
    sch.compute_at(rq, outer, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(rq)[-1])
    sch.vectorize(j2)
    sch.decompose_reduction(qk, c)
    unroll(sch, knobs, outer)


# ---- CUDA ------------------------------------------------------------------------------------


def _cuda_stage(sch, block, order, at, threads, lanes, pad_axis, pad):
    """Compute rotation ``block`` into shared memory at loop ``at``, its last three loops put in
    ``order`` and shared among all ``threads`` (thread-y, thread-x factors), ``lanes`` elements a
    thread (a vector along the head dimension); the stride of ``pad_axis`` becomes ``pad[1]``
    modulo ``pad[0]`` elements."""
    sch.set_scope(block, 0, "shared")
    sch.compute_at(block, at, preserve_unit_loops=True)
    loops = sch.get_loops(block)[-3:]
    sch.reorder(*[loops[k] for k in order])
    _, ty, tx, vec = sch.split(sch.fuse(*sch.get_loops(block)[-3:]), [None, threads[0], threads[1], lanes])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.storage_align(block, 0, axis=pad_axis, factor=pad[0], offset=pad[1])


@template("cuda_score_tiles", target_kinds=("cuda",))
def cuda_score_tiles(sch, target, knobs):
    """A thread block per (batch, head, query tile x key tile) of the scores (blockIdx.z, y, x),
    each thread a strided register tile of it (default 32x64 tile, 8x16 threads, 4x4 scores each).
    Per chunk of the head dimension (both halves of 8 rotation pairs by default) the block rotates
    its query rows and key columns into shared memory once, reading q/k/cos/sin coalesced, and
    every thread of it reuses them: a rotated q element serves the tile's key columns, a rotated
    k element its query rows. The scale is applied to the float32 register tile as it is stored."""
    qk = sch.get_sblock("qk")
    rq, rk = sch.get_sblock("rope_q"), sch.get_sblock("rope_k")
    n, h, i, j, c, e = sch.get_loops(qk)
    half = int(sch.get(e).extent)
    lanes = cuda_vector_lanes(sch.get(rq).reads[0].source.dtype, half, max_bytes=16)
    # The accumulator becomes the thread's registers (acc is allocated in the function, so the
    # scale reads them directly: no float32 score matrix in memory).
    sch.set_scope(qk, 0, "local")
    sch.bind(n, "blockIdx.z")
    sch.bind(h, "blockIdx.y")
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, i, j, rows=(8, 4), cols=(16, 4))
    # Head-dimension chunks: (chunk, pairs, lanes) of a half, both halves per chunk (the rotation
    # of element d needs its partner d +- D/2). At most 8 pairs (16 values) a chunk: with the
    # largest sampled tiles (256 x 256) the two staged operands stay under 37 KiB.
    eo, _ = sch.split(e, [None, lanes])
    pairs = max(1, 8 // lanes)
    e0, _ = sch.split(eo, knobs.tile(eo, 2, [pairs], max_innermost_factor=pairs))
    sch.reorder(e0, c)
    sch.reverse_compute_at(sch.get_sblock("scale"), tx, preserve_unit_loops=True)
    # rope(q) tile (rows, half c, pairs): vectors along the pairs; the row stride is `lanes` mod
    # 16 words, so that the rows a warp reads at one (c, e) (2 at 16 x-threads, up to 8) sit in
    # different banks, and vector stores stay aligned.
    _cuda_stage(sch, rq, (0, 1, 2), e0, (nty, ntx), lanes, 2, (16, lanes))
    # rope(k) tile (c, e, keys), keys contiguous as the GEMM reads them; computed key-major so that
    # a warp reads k's rows coalesced, its transposed stores spread over the banks by an odd stride.
    _cuda_stage(sch, rk, (2, 0, 1), e0, (nty, ntx), 1, 3, (32, 1))
    sch.decompose_reduction(qk, e0)
    cuda_unroll(sch, knobs, bx)


def _wgmma_scores(shape, dtype, knobs):
    """The scores on Hopper tensor cores (``lib.cuda_attention.rope_scores``): Q and K tiles by TMA,
    rotated in shared memory by every thread, one wgmma chain over head_dim per warpgroup, scaled
    and stored from the accumulators; float16/bfloat16, head_dim 64 or 128, an even seq_k."""
    return cuda_attention.rope_scores(shape, dtype, knobs)


cuda_wgmma_scores = KernelTemplate("cuda_wgmma_scores", _wgmma_scores, cuda_attention.ROPE_KNOBS,
                                   cuda_attention.ROPE_DEFAULT_KNOBS, cuda_attention.check_rope_scores, **HOPPER)


def _rotate_then_gemm(shape, dtype, knobs):
    """The scores on Hopper tensor cores in two kernels (``lib.tirx_sequence``): every row of q and
    k rotated once into a workspace (``lib.cuda_attention.rope_rotate``), then every head's scores
    as one batched wgmma GEMM, scaled in its epilogue and written by TMA stores, which clip the
    tiles at seq_q and seq_k (``lib.cuda_wgmma.batched_gemm``); seq_k a multiple of 8. Storing the
    scores is the work, so the GEMM does nothing else: each row is rotated once, not once per tile
    that reads it."""
    b, heads, sq, sk, d = _dims(shape)
    gemm_shape, batches = cuda_attention.rope_gemm_shape(shape)
    rotate = cuda_attention.rope_rotate(shape, dtype)
    gemm = cuda_wgmma.batched_gemm(gemm_shape, batches, dtype, knobs, 1.0 / math.sqrt(d),
                                   cuda_attention.ROPE_GEMM_KNOBS, cuda_attention.ROPE_GEMM_DEFAULT_KNOBS)
    q, k = buffer("q", (b, heads, sq, d), dtype), buffer("k", (b, heads, sk, d), dtype)
    cos, sin = buffer("cos", (sk, d), dtype), buffer("sin", (sk, d), dtype)
    scores = buffer("scores", (b, heads, sq, sk), dtype)
    q_rot, k_rot = workspace("q_rot", (b, heads, sq, d), dtype), workspace("k_rot", (b, heads, sk, d), dtype)
    return sequence("rope_qk", [q, k, cos, sin, scores],
                    [(rotate, [q, k, cos, sin, q_rot, k_rot]), (gemm, [q_rot, k_rot, scores])], [q_rot, k_rot])


def _rotate_then_gemm_default(shape, dtype):
    """The default tile, or the first smaller one that tiles seq_q x seq_k without padding; the
    default where none does."""
    default = cuda_attention.ROPE_GEMM_DEFAULT_KNOBS
    for change in ({}, {"warpgroups": 1}, {"block_n": 64}, {"warpgroups": 1, "block_n": 64}):
        knobs = {**default, **change}
        if shape["seq_q"] % (64 * knobs["warpgroups"]) == 0 and shape["seq_k"] % knobs["block_n"] == 0:
            try:
                cuda_attention.check_rope_gemm(shape, dtype, knobs)
            except ValueError:
                continue
            return knobs
    return dict(default)


cuda_rotate_then_gemm = KernelTemplate("cuda_rotate_then_gemm", _rotate_then_gemm, cuda_attention.ROPE_GEMM_KNOBS,
                                       cuda_attention.ROPE_GEMM_DEFAULT_KNOBS, cuda_attention.check_rope_gemm,
                                       shape_default=_rotate_then_gemm_default, **HOPPER)


def onnx_graph(shape, dtype):
    """Rotate-half as Slice/Neg/Concat, Mul/Add with the tables (the queries' rows Sliced out),
    Transpose, MatMul, Mul by the scale."""
    from onnx import helper
    b, heads, sq, sk, d = _dims(shape)
    half = d // 2
    i64 = np.int64
    consts = {"h_lo": np.array([0], i64), "h_mid": np.array([half], i64), "h_end": np.array([d], i64),
              "ax_last": np.array([-1], i64), "ax0": np.array([0], i64),
              "q_start": np.array([sk - sq], i64), "q_end": np.array([sk], i64),
              "scale": np.array(1.0 / math.sqrt(d), dtype)}
    nodes = [helper.make_node("Slice", ["cos", "q_start", "q_end", "ax0"], ["cos_q"]),
             helper.make_node("Slice", ["sin", "q_start", "q_end", "ax0"], ["sin_q"])]
    for x, c, s in (("q", "cos_q", "sin_q"), ("k", "cos", "sin")):
        nodes += [helper.make_node("Slice", [x, "h_lo", "h_mid", "ax_last"], [f"{x}1"]),
                  helper.make_node("Slice", [x, "h_mid", "h_end", "ax_last"], [f"{x}2"]),
                  helper.make_node("Neg", [f"{x}2"], [f"{x}2n"]),
                  helper.make_node("Concat", [f"{x}2n", f"{x}1"], [f"{x}rot"], axis=-1),
                  helper.make_node("Mul", [x, c], [f"{x}c"]),
                  helper.make_node("Mul", [f"{x}rot", s], [f"{x}s"]),
                  helper.make_node("Add", [f"{x}c", f"{x}s"], [f"{x}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["krt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qr", "krt"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["scores"])]
    return onnx_model("rope_qk", nodes,
                      [("q", (b, heads, sq, d)), ("k", (b, heads, sk, d)), ("cos", (sk, d)), ("sin", (sk, d))],
                      [("scores", (b, heads, sq, sk))], dtype, consts)


PATTERN = Pattern.from_module(
    globals(),
    description="rope(q) @ rope(k)^T / sqrt(D), rotate-half RoPE fused into the attention scores",
    shape_params=[BATCH, HEADS, ShapeParam("seq_q", 256, 8, "queries (the last seq_q positions)"),
                  ShapeParam("seq_k", 256, 12, "keys (positions 0..seq_k-1), >= seq_q"),
                  ShapeParam("head_dim", 64, 8, "head dimension D (even)", minimum=2)],
    templates=[key_tiles, cuda_rotate_then_gemm, cuda_wgmma_scores, cuda_score_tiles],
)
