"""cross_attention: out = softmax(q k^T / sqrt(head_dim)) v, decoder queries over encoder keys.

No mask; seq_q != seq_kv in general. Six sblocks: ``scores``, ``row_max``, ``exp`` (the scale
folded in here, valid as it is > 0), ``row_sum``, ``pv`` and ``normalise`` (one division per output
rather than per probability). Unfused, the score matrix goes to memory and is read back four times;
the templates keep a query tile's score rows on chip: ``query_tile`` (CPU, per-thread scratch, K^T
staged per tile so the key axis vectorises) and ``cuda_query_rows`` (the two-pass softmax over whole
score rows in shared memory, which therefore bounds seq_kv); on an sm_90 GPU in float16/bfloat16 first
``cuda_wgmma_flash``, flash_attention's tensor-core kernel with a K/V head per query head. float32
accumulation in every dtype.
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, template
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (BATCH, HEAD_DIM, HEADS, attention_graph, cpu_softmax_tail, load_lanes,
                                         row_lanes, sdpa, softmax_stages, vector_split)
from search_spaces.lib.attention import attention_inputs as make_inputs
from search_spaces.lib.attention import attention_reference as reference
from search_spaces.lib.cpu_rows import rfactor_lanes
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.tiling import unroll, vectorize_inner
from search_spaces.lib.tir_math import dtype_bytes


def _dims(shape):
    return shape["batch"], shape["heads"], shape["seq_q"], shape["seq_kv"], shape["head_dim"]


def build(shape, dtype):
    nb, nh, sq, skv, hd = _dims(shape)
    scale = 1.0 / math.sqrt(hd)
    stages = softmax_stages()

    @T.prim_func(s_tir=True)
    def cross_attention(q: T.Buffer((nb, nh, sq, hd), dtype), k: T.Buffer((nb, nh, skv, hd), dtype),
                        v: T.Buffer((nb, nh, skv, hd), dtype), out: T.Buffer((nb, nh, sq, hd), dtype)):
        T.func_attr({"global_symbol": "cross_attention", "tirx.noalias": True})
        stages(lambda b, h, i, d: q[b, h, i, d], lambda b, h, i, j, d: k[b, h, j, d],
               lambda b, h, i, j, d: v[b, h, j, d], out, lambda b, h, i, d: [b, h, i, d], (nb, nh, sq, skv, hd), scale)

    return cross_attention


def flops(shape):
    nb, nh, sq, skv, hd = _dims(shape)
    # Two matmuls (2 flops per multiply-add each), plus max, sub+mul+exp, add per score (exp as one
    # op), plus a divide per output element.
    return nb * nh * (4.0 * sq * skv * hd + 5.0 * sq * skv + sq * hd)


def nbytes(shape, dtype):
    nb, nh, sq, skv, hd = _dims(shape)
    return np.dtype(dtype).itemsize * nb * nh * hd * (2 * sq + 2 * skv)


@template("query_tile")
def query_tile(sch, target, knobs):
    """(batch, head, query tile) in parallel; scores, softmax stages and P*V computed per tile in
    scratch; scores/exp/max/sum vectorised along keys (K^T staged per tile), P*V along head_dim."""
    scores = sch.get_sblock("scores")
    exp = sch.get_sblock("exp")
    pv = sch.get_sblock("pv")
    norm = sch.get_sblock("normalise")
    max_rf, max_fin = rfactor_lanes(sch, knobs, "row_max", 16, factor_axis=3, max_lanes=32)
    sum_rf, sum_fin = rfactor_lanes(sch, knobs, "row_sum", 16, factor_axis=3, max_lanes=32)
    # K^T of the head: the score stage's key-axis lanes then read contiguous memory.
    k_t = sch.cache_read(scores, "k", "global")
    sch.transform_layout(k_t, ("write", 0), lambda b, h, j, d: (b, h, d, j))

    b, h, i, d = sch.get_loops(norm)
    i0, i1 = sch.split(i, knobs.tile(i, 2, [16], max_innermost_factor=32))
    tile = sch.fuse(b, h, i0)
    sch.parallel(tile)
    vectorize_inner(sch, knobs, d)
    # Consumers first, so each producer lands ahead of everything under the tile that reads it.
    for blk in (pv, sum_fin, sum_rf, exp, max_fin, max_rf, scores, k_t):
        sch.compute_at(blk, tile, preserve_unit_loops=True)

    # Scores as a register-blocked GEMM over the tile: each K^T row chunk is reused by every row.
    i, j, d = sch.get_loops(scores)[-3:]
    j0, j1 = sch.split(j, knobs.tile(j, 2, [16], max_innermost_factor=32))
    sch.reorder(j0, d, i, j1)
    sch.vectorize(j1)
    sch.decompose_reduction(scores, d)

    cpu_softmax_tail(sch, knobs, (max_rf, sum_rf), exp, pv)
    unroll(sch, knobs, tile)


# ---- CUDA ---------------------------------------------------------------------------------------

_CUDA_QUERY_TILES = (1, 2, 4, 8, 16, 32)   # query rows per thread block (threadIdx.y)
_CUDA_KEY_TILES = (64, 32, 16)             # keys per K/V tile staged in shared memory
_CUDA_ROWS = 8                             # the default query tile, where shared memory allows


def _cuda_plan(seq_q, seq_kv, head_dim, lanes, itemsize, limit):
    """(key tile, query tiles) of ``cuda_query_rows``. Shared memory holds the query tile's score
    and probability rows (2 x rows x seq_kv float32), a K tile transposed with rows padded by one
    and a V tile (both the dtype). The key tile is the largest that still leaves room for
    _CUDA_ROWS query rows (or the most rows any tile allows). A query tile is at most seq_q rows:
    with a taller one, the stages computed at the block cover only the seq_q rows that exist, so
    TVM binds their row loops to fewer threadIdx.y than the block has, and the extra threads
    index past the shared score rows."""
    best = None
    for kt in _CUDA_KEY_TILES:
        kt = min(kt, seq_kv)
        tiles_bytes = (head_dim * (kt + 1) + kt * head_dim) * itemsize
        tiles = [r for r in _CUDA_QUERY_TILES
                 if r * lanes <= 1024 and r <= seq_q and tiles_bytes + 2 * r * seq_kv * 4 <= limit]
        if tiles and (best is None or min(max(tiles), _CUDA_ROWS) > min(max(best[1]), _CUDA_ROWS)):
            best = (kt, tiles)
    if best is None:
        raise ValueError(f"cuda_query_rows: the score rows of seq_kv={seq_kv} do not fit {limit} bytes "
                         "of shared memory")
    return best


@template("cuda_query_rows", target_kinds=("cuda",))
def cuda_query_rows(sch, target, knobs):
    """A thread block per (batch, head, query tile), a query row per threadIdx.y, LANES threads
    per row. K^T and V tiles are staged in shared memory, where every row of the tile reuses
    them; the tile's score rows live there too, since P.V on a thread needs the whole row's
    probabilities; the row max and sum reduce across the row's threads with warp shuffles; q,
    the score accumulators and the P.V accumulator are registers."""
    names = ("scores", "row_max", "exp", "row_sum", "pv", "normalise")
    scores, row_max, exp, row_sum, pv, norm = (sch.get_sblock(n) for n in names)
    b, h, i, d = sch.get_loops(norm)
    seq_q, hd = int(sch.get(i).extent), int(sch.get(d).extent)
    seq_kv = int(sch.get(sch.get_loops(scores)[3]).extent)
    itemsize = dtype_bytes(sch.get(norm).writes[0].source.dtype)
    lanes = row_lanes(hd)
    vec = load_lanes(hd)
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024))
    kt, tiles = _cuda_plan(seq_q, seq_kv, hd, lanes, itemsize, limit)
    rows = knobs.choice(tiles, max(r for r in tiles if r <= _CUDA_ROWS))

    # The output nest sets the thread block; every other stage is computed inside it, its row
    # loop on threadIdx.y, so that a row's statistics and accumulator stay with its threads.
    i0, i1 = sch.split(i, [None, rows])
    bx = sch.fuse(b, h, i0)
    sch.bind(bx, "blockIdx.x")
    for blk in (pv, row_sum, exp, row_max, scores):
        sch.compute_at(blk, bx, preserve_unit_loops=True)
    sch.bind(i1, "threadIdx.y")

    def fill(cache):
        # A K/V tile loaded by the whole block: coalesced along head_dim, a vector per thread.
        _, fy, fx, fv = sch.split(sch.fuse(*sch.get_loops(cache)[-2:]), [None, rows, lanes, vec])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")
        sch.vectorize(fv)

    # Scores: key c of a tile goes to thread c % LANES of the row, the q row in registers, a
    # register accumulator per key, the finished scores written to the shared score row.
    si, sj, sd = sch.get_loops(scores)[-3:]
    sch.bind(si, "threadIdx.y")
    sjo, sjk = sch.split(sj, [None, kt])
    sjc, stx = sch.split(sjk, [None, lanes])
    sch.reorder(sjo, stx, sjc, sd)
    sch.bind(stx, "threadIdx.x")
    s_acc = sch.cache_write(scores, 0, "local")
    sch.reverse_compute_at(s_acc, sjc, preserve_unit_loops=True)
    kc = sch.cache_read(scores, "k", "shared")
    sch.compute_at(kc, sjo, preserve_unit_loops=True)
    # K^T in shared memory: thread c % LANES reads along the keys, consecutive words (no bank
    # conflict), while the row's q element is a register; rows padded by one so that the
    # transposing stores of the fill spread over the banks.
    sch.transform_layout(kc, ("write", 0), lambda b_, h_, j_, d_: (b_, h_, d_, j_))
    sch.storage_align(kc, 0, axis=-2, factor=32, offset=1)
    fill(kc)
    if hd <= 128:
        qc = sch.cache_read(scores, "q", "local")
        sch.compute_at(qc, si, preserve_unit_loops=True)
        vector_split(sch, sch.get_loops(qc)[-1], 4)

    # Row max, exponentials and row sum: key j of the row to thread j % LANES; the max and sum
    # reduce each thread's keys, then across the row's threads (shuffles).
    for blk in (row_max, exp, row_sum):
        ri, rj = sch.get_loops(blk)[-2:]
        sch.bind(ri, "threadIdx.y")
        _, rtx = sch.split(rj, [None, lanes])
        sch.bind(rtx, "threadIdx.x")

    # P.V: head_dim split over the row's threads, each owning head_dim / LANES consecutive
    # columns (vector loads of the V tile), the probabilities broadcast from the shared row.
    pi, pd, pj = sch.get_loops(pv)[-3:]
    sch.bind(pi, "threadIdx.y")
    ptx, pdj = sch.split(pd, [lanes, None])
    pjo, pjk = sch.split(pj, [None, kt])
    sch.reorder(ptx, pjo, pjk, pdj)
    sch.bind(ptx, "threadIdx.x")
    vc = sch.cache_read(pv, "v", "shared")
    sch.compute_at(vc, pjo, preserve_unit_loops=True)
    fill(vc)
    vector_split(sch, pdj, 4)
    dtx, dj = sch.split(sch.get_loops(norm)[-1], [lanes, None])
    sch.bind(dtx, "threadIdx.x")
    vector_split(sch, dj, 4)

    sch.set_scope(s_acc, 0, "shared")
    sch.set_scope(exp, 0, "shared")
    for blk in (row_max, row_sum, pv):
        sch.set_scope(blk, 0, "local")

    sch.decompose_reduction(scores, sd)
    for loop in sch.get_loops(scores)[-2:]:
        sch.unroll(loop)
    sch.decompose_reduction(pv, pjo)
    unroll(sch, knobs, pjk, explicit=0)


def _prefill_shape(shape):
    return {**shape, "kv_heads": shape["heads"], "causal": 0}


def _wgmma_prefill(shape, dtype, knobs):
    """FlashAttention on Hopper tensor cores (``lib.cuda_attention.prefill_attention``, as
    flash_attention's ``cuda_wgmma_flash``), a K/V head per query head, no mask; float16/bfloat16,
    head_dim 64 or 128, any seq_q and seq_kv (padded last tiles; other shapes fall back to
    ``cuda_query_rows``)."""
    return cuda_attention.prefill_attention(_prefill_shape(shape), dtype, knobs)


def _wgmma_check(shape, dtype, knobs):
    cuda_attention.check_prefill(_prefill_shape(shape), dtype, knobs)


cuda_wgmma_flash = KernelTemplate("cuda_wgmma_flash", _wgmma_prefill, cuda_attention.PREFILL_KNOBS,
                                  cuda_attention.PREFILL_DEFAULT_KNOBS, _wgmma_check, **HOPPER)


def onnx_graph(shape, dtype):
    return attention_graph("cross_attention", shape, dtype, out="out")


PATTERN = Pattern.from_module(
    globals(),
    description="softmax(q k^T / sqrt(d)) v with seq_q != seq_kv, no mask, scores kept per query tile",
    shape_params=[BATCH, HEADS, ShapeParam("seq_q", 128, 8, "decoder (query) length"),
                  ShapeParam("seq_kv", 384, 12, "encoder (key/value) length"), HEAD_DIM],
    templates=[query_tile, cuda_wgmma_flash, cuda_query_rows],
)
