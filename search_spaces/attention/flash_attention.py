"""flash_attention: o = softmax(q k^T * scale [+ causal mask]) v in one kernel, FlashAttention style.

scale = 1/sqrt(head_dim); the causal mask is aligned at the end (key j visible to query i when
j <= i + seq_kv - seq_q, as in decoding with a KV cache); grouped-query: query head h reads K/V head
h // (heads // kv_heads). Unfused, the score matrix is written and read back three times; here it
never exists: keys go by in tiles of ``KV_TILE`` (fixed at build time; a padded last tile is
masked) with the online-softmax recurrence per query row (running max m, rescale alpha, sum l,
output acc; o = acc / l after the last tile).

How the recurrence fits TensorIR: every buffer has one writer, and the running state is written
only by reduction blocks over the tile index ``t`` (``T.init`` is the state before the first tile),
so TVM takes the nest as compact dataflow and its loops can be scheduled. The per-tile blocks bind
``t`` as a spatial axis indexing no buffer: their KV_TILE-wide scratch is overwritten per tile,
right only because no template parallelises or reorders ``t``. seq_q and seq_kv may be int64
``tirx.Var``s, one function for every run-time length (``autofuse.dynamic``).

Templates: ``flash_tiles`` (CPU: query tiles in parallel, each K/V tile reused from L1 by a tile's
rows) and ``cuda_flash`` (FlashAttention-2 on SIMT cores: a block per (batch, head, query tile),
K/V tiles in shared memory, the running state in registers). Scores, statistics and acc are float32
in every dtype. On an sm_90 GPU in float16/bfloat16 the kernel template ``cuda_wgmma_flash`` comes
first where its tiles fit (``lib.cuda_attention``'s tensor-core prefill, written in the tirx script).
"""

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import (FLOAT_DTYPES, Pattern, RelaxRule, ShapeParam, constant_value, dtype_of,
                              static_shape, template)
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (BATCH, CUDA_LOAD_LANES, HEAD_DIM, annotate_read, attention_graph, gqa_heads,
                                         row_lanes, sdpa, vector_split)
from search_spaces.lib.attention import attention_inputs as make_inputs
from search_spaces.lib.attention import attention_reference as reference
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.tiling import unroll
from search_spaces.lib.tir_math import dtype_bytes, exp_f32

KV_TILE = 64


def _symbolic(n):
    """Whether a shape value is a TIR expression (a length only known at run time), not a number."""
    return not isinstance(n, (int, np.integer))


def kv_tile(seq_kv):
    """The key tile ``build`` uses for this seq_kv (KV_TILE for a symbolic one: a symbolic seq_kv
    gets whole KV_TILE tiles, the last one padded, so that the tile stays a constant loop extent
    that templates split and vectorise; only the tile count is symbolic)."""
    return KV_TILE if _symbolic(seq_kv) else min(KV_TILE, seq_kv)


def build(shape, dtype):
    b_, h_, kvh, sq, skv, d_ = (shape[k] for k in
                                ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    causal = int(shape.get("causal", 0))
    if causal not in (0, 1):
        raise ValueError(f"causal must be 0 or 1, not {causal}")
    if h_ % kvh:
        raise ValueError(f"kv_heads={kvh} must divide heads={h_}")
    for name, n in (("seq_q", sq), ("seq_kv", skv)):
        if _symbolic(n) and str(n.ty) != "int64":
            raise ValueError(f"a symbolic {name} must be an int64 variable, not {n.ty}")
    dyn_kv = _symbolic(skv)
    dynamic = dyn_kv or _symbolic(sq)
    if causal and not dynamic and sq > skv:
        raise ValueError(f"causal attention needs seq_q <= seq_kv (got seq_q={sq}, seq_kv={skv}): "
                         "with the mask aligned at the end, the first seq_q - seq_kv query rows "
                         "would see no key at all")
    group = h_ // kvh
    kt = kv_tile(skv)
    nt = (skv + kt - 1) // kt
    padded = nt * kt
    pad = dyn_kv or padded != skv
    lanes = row_lanes(kt)
    off = skv - sq
    scale = 1.0 / math.sqrt(d_)
    f32 = "float32"
    neg = T.min_value(f32)

    # With a symbolic length every extent is int64, like the length itself: loop variables of one
    # width throughout, so no index mixes int32 and int64.
    def ext(n):
        return tirx.IntImm("int64", n) if dynamic and isinstance(n, int) else n

    B, H, KVH, SQ, SKV, D = (ext(n) for n in (b_, h_, kvh, sq, skv, d_))
    NT, PADDED, KT, LANES, CHUNK = (ext(n) for n in (nt, padded, kt, lanes, kt // lanes))

    def kv(h):
        # Query head h reads K/V head h // group.
        return h // group if group > 1 else h

    def key(j):
        # The padded tail reads the last key again (and masks its score): no out-of-bounds load.
        return T.min(j, skv - 1) if pad else j

    def visible(i, j):
        cond = None
        if pad:
            cond = j < skv
        if causal:
            c2 = j <= i + off
            cond = c2 if cond is None else T.And(cond, c2)
        return cond

    def live(i, t):
        # Causal: a key tile wholly above the diagonal of row i changes nothing (all its scores
        # are masked, p = 0), so the two products skip it; their inits still run, which makes
        # the skipped tile's s and pv zeros. (An if in the body rather than a block predicate:
        # TVM's affine-binding check rejects a predicate coupling t and i.)
        return t * kt <= i + off if causal else True

    def masked(i, j, value, fill):
        cond = visible(i, j)
        return value if cond is None else T.Select(cond, value, fill)

    @T.prim_func(s_tir=True)
    def flash_attention(q: T.Buffer((B, H, SQ, D), dtype), k: T.Buffer((B, KVH, SKV, D), dtype),
                        v: T.Buffer((B, KVH, SKV, D), dtype), o: T.Buffer((B, H, SQ, D), dtype)):
        T.func_attr({"global_symbol": "flash_attention", "tirx.noalias": True})
        k_t = T.sblock_alloc_buffer((B, KVH, D, PADDED), f32)
        s = T.sblock_alloc_buffer((B, H, SQ, KT), f32)
        max_l = T.sblock_alloc_buffer((B, H, SQ, LANES), f32)
        tile_max = T.sblock_alloc_buffer((B, H, SQ), f32)
        alpha = T.sblock_alloc_buffer((B, H, SQ), f32)
        m = T.sblock_alloc_buffer((B, H, SQ), f32)
        p = T.sblock_alloc_buffer((B, H, SQ, KT), f32)
        sum_l = T.sblock_alloc_buffer((B, H, SQ, LANES), f32)
        tile_sum = T.sblock_alloc_buffer((B, H, SQ), f32)
        l = T.sblock_alloc_buffer((B, H, SQ), f32)
        pv = T.sblock_alloc_buffer((B, H, SQ, D), f32)
        acc = T.sblock_alloc_buffer((B, H, SQ, D), f32)
        for b, h, dd, j in T.grid(B, KVH, D, PADDED):
            with T.sblock("k_scaled_t"):
                vb, vh, vd, vj = T.axis.remap("SSSS", [b, h, dd, j])
                k_t[vb, vh, vd, vj] = T.Cast(f32, k[vb, vh, key(vj), vd]) * T.float32(scale)
        for b, h, i, t in T.grid(B, H, SQ, NT):
            for c, dd in T.grid(KT, D):
                with T.sblock("qk"):
                    vb, vh, vi, vt, vc, vd = T.axis.remap("SSSSSR", [b, h, i, t, c, dd])
                    with T.init():
                        s[vb, vh, vi, vc] = T.float32(0)
                    if live(vi, vt):
                        s[vb, vh, vi, vc] = (s[vb, vh, vi, vc]
                                             + T.Cast(f32, q[vb, vh, vi, vd]) * k_t[vb, kv(vh), vd, vt * kt + vc])
            # Row max of the tile in two steps, one partial per lane then over the lanes (an
            # rfactor written out: rfactor itself needs the reduction to be the first block
            # of its loop nest, and these blocks share theirs).
            for lane, c in T.grid(LANES, CHUNK):
                with T.sblock("tile_max_lanes"):
                    vb, vh, vi, vt, vl, vc = T.axis.remap("SSSSSR", [b, h, i, t, lane, c])
                    with T.init():
                        max_l[vb, vh, vi, vl] = neg
                    max_l[vb, vh, vi, vl] = T.max(max_l[vb, vh, vi, vl], masked(
                        vi, vt * kt + vc * lanes + vl, s[vb, vh, vi, vc * lanes + vl], neg))
            for lane in T.serial(LANES):
                with T.sblock("tile_max"):
                    vb, vh, vi, vt, vl = T.axis.remap("SSSSR", [b, h, i, t, lane])
                    with T.init():
                        tile_max[vb, vh, vi] = neg
                    tile_max[vb, vh, vi] = T.max(tile_max[vb, vh, vi], max_l[vb, vh, vi, vl])
            with T.sblock("run_max"):
                vb, vh, vi, vt = T.axis.remap("SSSR", [b, h, i, t])
                # alpha (exp(m - m'), the factor that rescales l and acc) is written here, from
                # the old m, so that no other block reads m before it is updated. On the first
                # tile m is the float32 minimum and exp_f32 clamps: alpha ~ 1e-38 times l = acc = 0.
                with T.init():
                    m[vb, vh, vi] = neg
                    alpha[vb, vh, vi] = T.float32(0)
                alpha[vb, vh, vi] = exp_f32(m[vb, vh, vi] - T.max(m[vb, vh, vi], tile_max[vb, vh, vi]))
                m[vb, vh, vi] = T.max(m[vb, vh, vi], tile_max[vb, vh, vi])
            for c in T.serial(KT):
                with T.sblock("prob"):
                    vb, vh, vi, vt, vc = T.axis.remap("SSSSS", [b, h, i, t, c])
                    p[vb, vh, vi, vc] = masked(vi, vt * kt + vc, exp_f32(s[vb, vh, vi, vc] - m[vb, vh, vi]),
                                               T.float32(0))
            for lane, c in T.grid(LANES, CHUNK):
                with T.sblock("tile_sum_lanes"):
                    vb, vh, vi, vt, vl, vc = T.axis.remap("SSSSSR", [b, h, i, t, lane, c])
                    with T.init():
                        sum_l[vb, vh, vi, vl] = T.float32(0)
                    sum_l[vb, vh, vi, vl] = sum_l[vb, vh, vi, vl] + p[vb, vh, vi, vc * lanes + vl]
            for lane in T.serial(LANES):
                with T.sblock("tile_sum"):
                    vb, vh, vi, vt, vl = T.axis.remap("SSSSR", [b, h, i, t, lane])
                    with T.init():
                        tile_sum[vb, vh, vi] = T.float32(0)
                    tile_sum[vb, vh, vi] = tile_sum[vb, vh, vi] + sum_l[vb, vh, vi, vl]
            with T.sblock("run_sum"):
                vb, vh, vi, vt = T.axis.remap("SSSR", [b, h, i, t])
                with T.init():
                    l[vb, vh, vi] = T.float32(0)
                l[vb, vh, vi] = l[vb, vh, vi] * alpha[vb, vh, vi] + tile_sum[vb, vh, vi]
            for dd, c in T.grid(D, KT):
                with T.sblock("pv"):
                    vb, vh, vi, vt, vd, vc = T.axis.remap("SSSSSR", [b, h, i, t, dd, c])
                    with T.init():
                        pv[vb, vh, vi, vd] = T.float32(0)
                    if live(vi, vt):
                        pv[vb, vh, vi, vd] = (pv[vb, vh, vi, vd] + p[vb, vh, vi, vc]
                                              * T.Cast(f32, v[vb, kv(vh), key(vt * kt + vc), vd]))
            for dd in T.serial(D):
                with T.sblock("run_acc"):
                    vb, vh, vi, vt, vd = T.axis.remap("SSSRS", [b, h, i, t, dd])
                    with T.init():
                        acc[vb, vh, vi, vd] = T.float32(0)
                    acc[vb, vh, vi, vd] = acc[vb, vh, vi, vd] * alpha[vb, vh, vi] + pv[vb, vh, vi, vd]
            for dd in T.serial(D):
                with T.sblock("out"):
                    vb, vh, vi, vd = T.axis.remap("SSSS", [b, h, i, dd])
                    T.where(t >= nt - 1)
                    o[vb, vh, vi, vd] = T.Cast(dtype, acc[vb, vh, vi, vd] / l[vb, vh, vi])

    return flash_attention


def visible_pairs(shape):
    """(query, key) pairs the mask lets through, per batch and head."""
    sq, skv = shape["seq_q"], shape["seq_kv"]
    if not int(shape.get("causal", 0)):
        return sq * skv
    off = skv - sq
    return sum(min(skv, max(0, i + off + 1)) for i in range(sq))


def flops(shape):
    # Two multiply-adds per (pair, head_dim element) for q.k and p.v, plus ~5 per score for the
    # scale/max/exp/sum; counted over the visible pairs (the useful work).
    bh = shape["batch"] * shape["heads"]
    return bh * visible_pairs(shape) * (4.0 * shape["head_dim"] + 5.0)


def nbytes(shape, dtype):
    b, h, kvh, sq, skv, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    # q and o per query head, K and V per K/V head.
    return np.dtype(dtype).itemsize * b * d * (2 * h * sq + 2 * kvh * skv)


@template("flash_tiles")
def flash_tiles(sch, target, knobs):
    """Query tiles in parallel over (batch, head, query tile), key tiles streamed through each
    query tile's running state; the score tile vectorised along keys, P.V along head_dim."""
    qk = sch.get_sblock("qk")
    b, h, i, t, c, dd = sch.get_loops(qk)
    # Default 32 rows: acc is 32 x head_dim floats (8 KiB at 64) per thread and each K/V tile
    # serves 32 rows.
    # A categorical knob and an imperfect split (the last query tile predicated) rather than a
    # perfect tile: a decision of sample_perfect_tile only replays on the extent it was drawn for,
    # this one also on a symbolic seq_q, so a schedule tuned at one length serves all of them.
    i0, i1 = sch.split(i, [None, knobs.choice([8, 16, 32, 64], 32)])
    # Key tile outside the query rows: one K/V tile serves every row of the query tile while it
    # is in L1, and the rows' running state (m, l, acc) stays live across the key tiles.
    sch.reorder(t, i1)
    outer = sch.fuse(b, h, i0)
    sch.parallel(outer)
    # K scaled and transposed once per call, its own parallel nest (not per query tile: that
    # costs a strided gather of the whole K per query tile, as much as the score products
    # themselves at 8-32 rows a tile). Left scalar: LLVM took 80 s to compile the 64-lane
    # strided gather, and the pass is 1/seq_q of the work.
    kts = sch.get_sblock("k_scaled_t")
    kb, kh, kd, kj = sch.get_loops(kts)
    sch.parallel(sch.fuse(kb, kh, kd))

    # Score tile: a (1 x head_dim) . (head_dim x key tile) product, key lanes innermost.
    # (Everything is vectorised before decompose_reduction: an update block without its init
    # is neither complete nor a reduction, and vectorize refuses the loop around it.)
    c0, c1 = sch.split(c, knobs.tile(c, 2, [64], max_innermost_factor=64))
    sch.reorder(c0, dd, c1)
    sch.vectorize(c1)

    sch.vectorize(sch.get_loops(sch.get_sblock("prob"))[-1])
    lane_blocks = [sch.get_sblock(n) for n in ("tile_max_lanes", "tile_sum_lanes")]
    for blk in lane_blocks:
        lane, r = sch.get_loops(blk)[-2:]
        sch.reorder(r, lane)
        sch.vectorize(lane)

    # P.V: head_dim lanes innermost, the key tile the reduction around them.
    pv = sch.get_sblock("pv")
    pd, pc = sch.get_loops(pv)[-2:]
    pd0, pd1 = sch.split(pd, knobs.tile(pd, 2, [64], max_innermost_factor=64))
    sch.reorder(pd0, pc, pd1)
    sch.vectorize(pd1)
    for name in ("run_acc", "out"):
        sch.vectorize(sch.get_loops(sch.get_sblock(name))[-1])

    sch.decompose_reduction(qk, dd)
    for blk in lane_blocks:
        sch.decompose_reduction(blk, sch.get_loops(blk)[-2])
    sch.decompose_reduction(pv, pc)
    # The per-tile max and sum restart at every key tile: their inits go right above their lane
    # loop. Left to MetaSchedule's RewriteReductionBlock postproc, every tuned record ended up
    # wrong (max abs error 2.1 at the default shape; the numerical check rejected all of them).
    for name in ("tile_max", "tile_sum"):
        block = sch.get_sblock(name)
        sch.decompose_reduction(block, sch.get_loops(block)[-1])
    # Running state: initialised once per query tile, before the key-tile loop.
    for name in ("run_max", "run_sum", "run_acc"):
        sch.decompose_reduction(sch.get_sblock(name), t)
    unroll(sch, knobs, outer)


# ---- CUDA ---------------------------------------------------------------------------------------

_CUDA_QUERY_TILES = (1, 2, 4, 8, 16, 32, 64)   # query rows per thread block (threadIdx.y)


def _cuda_plan(kt, d, lanes, itemsize, limit, seq_q):
    """What the CUDA template stages in shared memory at this key tile, head_dim and dtype, and
    the query tiles that then fit: (stage K, stage V, query tiles). The probabilities p (query
    tile x key tile, float32) are always there; K scaled and transposed (float32, rows padded by
    one against bank conflicts) and V (the dtype) while they fit, otherwise read through L1.
    Tiles beyond the next power of two of a static seq_q would only add idle rows; a symbolic
    seq_q gets tiles of 8 rows and more."""
    tall = [r for r in _CUDA_QUERY_TILES if (r >= 8 if _symbolic(seq_q) else r < 2 * seq_q)]
    k_bytes = kt * (d + 1) * 4
    v_bytes = kt * d * itemsize
    for stage_k, stage_v in ((True, True), (True, False), (False, False)):
        fixed = stage_k * k_bytes + stage_v * v_bytes
        tiles = [rows for rows in tall if rows * lanes <= 1024 and fixed + rows * kt * 4 <= limit]
        if tiles:
            return stage_k, stage_v, tiles
    raise ValueError(f"no query tile fits {limit} bytes of shared memory at key tile {kt}")


def _window_read(sch, pv, kt, seq_kv):
    """Declare ``pv``'s read of the staged V as the kt-key window of tile t (see cuda_flash)."""
    index = [reg.source.name for reg in sch.get(pv).reads].index("v_shared")
    start = lambda vt: T.min(vt * kt, seq_kv - kt)  # noqa: E731
    block = sch.get(pv)
    v_shape = block.reads[index].source.shape
    group = int(block.iter_vars[1].dom.extent) // int(v_shape[1])  # query heads per K/V head
    annotate_read(sch, pv, index, lambda vb, vh, vi, vt, *_: [
        (vb, vb + 1), (vh // group, vh // group + 1), (start(vt), start(vt) + kt), (0, v_shape[3])])


@template("cuda_flash", target_kinds=("cuda",))
def cuda_flash(sch, target, knobs):
    """FlashAttention-2 on SIMT cores: a thread block per (batch, head, query tile), a query row
    per threadIdx.y, LANES threads per row; K/V tiles staged in shared memory; scores, running
    max/sum and the output accumulator per thread, P in shared memory; the key-tile loop serial."""
    qk, pv, prob = (sch.get_sblock(n) for n in ("qk", "pv", "prob"))
    b, h, i, t, c, dd = sch.get_loops(qk)
    lanes = int(sch.get(sch.get_loops(sch.get_sblock("tile_max"))[-1]).extent)
    kt, d = int(sch.get(c).extent), int(sch.get(dd).extent)
    itemsize = dtype_bytes(sch.get(pv).reads[-1].source.dtype)
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024))
    seq_q = sch.get(i).extent
    seq_q = seq_q.value if isinstance(seq_q, tirx.IntImm) else seq_q
    stage_k, stage_v, tiles = _cuda_plan(kt, d, lanes, itemsize, limit, seq_q)
    # Query rows per block: a categorical knob and an imperfect split (the last tile predicated),
    # so that a trace tuned at one seq_q replays on a symbolic one (as flash_tiles).
    rows = knobs.choice(tiles, max(r for r in tiles if r <= 16) if min(tiles) <= 16 else min(tiles))
    i0, i1 = sch.split(i, [None, rows])
    bx = sch.fuse(b, h, i0)
    sch.bind(bx, "blockIdx.x")
    # The row loop stays above the key-tile loop: a row's running state (m, l, acc) then belongs
    # to its threads across the key tiles (registers), and t stays serial inside every thread.
    sch.bind(i1, "threadIdx.y")

    # Threads of a row: LANES (the lane count of the tile max/sum, fixed by build). Key c of the
    # score tile goes to thread c % LANES, the lane that reduces it in tile_max_lanes, so the
    # scores never leave that thread's registers; the tile max and sum are cross-thread
    # reductions over the lanes (warp shuffles within the row's LANES threads).
    ck, ctx = sch.split(c, [None, lanes])
    sch.reorder(ctx, ck, dd)
    sch.bind(ctx, "threadIdx.x")
    for name in ("tile_max_lanes", "tile_sum_lanes"):
        lane, r = sch.get_loops(sch.get_sblock(name))[-2:]
        sch.bind(lane, "threadIdx.x")
    for name in ("tile_max", "tile_sum"):
        sch.bind(sch.get_loops(sch.get_sblock(name))[-1], "threadIdx.x")
    pck, ptx = sch.split(sch.get_loops(prob)[-1], [None, lanes])
    sch.bind(ptx, "threadIdx.x")
    sch.unroll(pck)
    # P.V, the accumulator and the output: head_dim split over the row's threads, each owning a
    # run of d / LANES consecutive columns (vector loads of V from shared memory).
    pd, pc = sch.get_loops(pv)[-2:]
    ptx, pdj = sch.split(pd, [lanes, None])
    sch.reorder(ptx, pc, pdj)
    sch.bind(ptx, "threadIdx.x")
    even = d % lanes == 0
    if even:
        vector_split(sch, pdj, 4)
    djs = []
    for name in ("run_acc", "out"):
        dtx, dj = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [lanes, None])
        sch.bind(dtx, "threadIdx.x")
        djs.append(dj)

    # Per-thread values in registers ("local"); what the row's threads exchange in shared memory.
    for name in ("qk", "tile_max_lanes", "tile_sum_lanes", "tile_max", "tile_sum", "run_sum", "pv", "run_acc"):
        sch.set_scope(sch.get_sblock(name), 0, "local")
    run_max = sch.get_sblock("run_max")
    sch.set_scope(run_max, 0, "local")
    sch.set_scope(run_max, 1, "local")
    sch.set_scope(prob, 0, "shared")
    # p is indexed by the query row, which is symbolic with seq_q: shared memory needs a constant
    # size, and TVM cannot prove the block's rows (the tile) fit a symbolic one. Rows taken modulo
    # the largest tile are distinct within a block, and the block is all the buffer serves.
    big = max(tiles)
    sch.transform_layout(prob, ("write", 0), lambda b_, h_, i_, c_: (i_ % big, c_),
                         assume_injective_transform=True)

    kts = sch.get_sblock("k_scaled_t")
    if stage_k:
        # K of this key tile, scaled and transposed to (head_dim, keys), by the whole block: read
        # along head_dim (coalesced, vectorised), written transposed into rows padded by one.
        sch.set_scope(kts, 0, "shared")
        sch.compute_at(kts, t)
        sch.storage_align(kts, 0, axis=-2, factor=32, offset=1)
        kd, kj = sch.get_loops(kts)[-2:]
        sch.reorder(kj, kd)
        _, fy, fx, fv = sch.split(sch.fuse(kj, kd), [None, rows, lanes, CUDA_LOAD_LANES])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")
        sch.vectorize(fv)
    else:
        # Its own kernel, before the attention one: K scaled and transposed once into memory.
        f0, f1 = sch.split(sch.fuse(*sch.get_loops(kts)), [None, 256])
        sch.bind(f0, "blockIdx.x")
        sch.bind(f1, "threadIdx.x")
    if stage_v:
        vs = sch.cache_read(pv, "v", "shared")
        seq_kv = sch.get(pv).reads[-1].source.shape[2]
        if isinstance(seq_kv, tirx.IntImm) and int(seq_kv) % kt:
            # The last tile's keys clamp to seq_kv - 1, which would leave its copy a symbolic
            # number of rows (a loop MetaSchedule's DisallowDynamicLoop rejects, so tuning at such
            # a length would fail every candidate). The read is declared instead as the whole
            # window [min(t * kt, seq_kv - kt), + kt), which holds every key the tile reads and
            # lies inside v; its rows before the tile's first key are loaded and never used.
            _window_read(sch, pv, kt, int(seq_kv))
        sch.compute_at(vs, t)
        # As p: keys modulo KV_TILE, distinct within a tile (the padded tail clamps to the last
        # key, in range). KV_TILE and not this build's tile, which is shorter when seq_kv is: a
        # trace tuned there and replayed on a symbolic seq_kv (64-key tiles) must not alias keys.
        sch.transform_layout(vs, ("write", 0), lambda b_, h_, j_, d_: (j_ % KV_TILE, d_),
                             assume_injective_transform=True)
        _, fy, fx, fv = sch.split(sch.fuse(*sch.get_loops(vs)[-2:]), [None, rows, lanes, CUDA_LOAD_LANES])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")
        sch.vectorize(fv)
    if d <= 128:
        # The query row in registers for the whole kernel (every thread of the row reads all of it).
        qc = sch.cache_read(qk, "q", "local")
        sch.compute_at(qc, i1)
        vector_split(sch, sch.get_loops(qc)[-1], 4)

    # Inits split out of every reduction that is not across threads (after the bindings: an
    # update block without its init is neither complete nor a reduction, and bind refuses it).
    sch.decompose_reduction(qk, ck)
    for loop in sch.get_loops(qk)[-2:]:
        sch.unroll(loop)
    for name in ("tile_max_lanes", "tile_sum_lanes"):
        blk = sch.get_sblock(name)
        r = sch.get_loops(blk)[-1]
        sch.decompose_reduction(blk, r)
        sch.unroll(sch.get_loops(blk)[-1])
    sch.decompose_reduction(pv, pc)
    if not even:
        sch.unroll(sch.get_loops(pv)[-1])
    for dj in djs:
        if even:
            vector_split(sch, dj, 4)
        else:
            sch.unroll(dj)
    # The running state initialised once per query row, before the key-tile loop (as
    # MetaSchedule's RewriteReductionBlock would do to a tuned record anyway). The init of acc
    # carries the head_dim loop bound to threadIdx.x out of the key-tile loop, and with it TVM
    # lifts threadIdx.x above that loop, so that acc compacts to the thread's own columns
    # (registers) instead of a whole row per thread.
    for name in ("run_max", "run_sum", "run_acc"):
        sch.decompose_reduction(sch.get_sblock(name), t)
    unroll(sch, knobs, pc, explicit=0)


def _wgmma_prefill(shape, dtype, knobs):
    """FlashAttention on Hopper tensor cores (``lib.cuda_attention.prefill_attention``): TMA
    producer warpgroup, two wgmma consumer warpgroups of 64 query rows, online softmax in
    registers; float16/bfloat16, head_dim 64 or 128, seq_q a multiple of 128 and seq_kv of the key
    tile (other shapes fall back to ``cuda_flash``)."""
    return cuda_attention.prefill_attention(shape, dtype, knobs)


cuda_wgmma_flash = KernelTemplate("cuda_wgmma_flash", _wgmma_prefill, cuda_attention.PREFILL_KNOBS,
                                  cuda_attention.PREFILL_DEFAULT_KNOBS, cuda_attention.check_prefill, **HOPPER)


def onnx_graph(shape, dtype):
    return attention_graph("flash_attention", shape, dtype)


def _relax_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    named = {}

    def maybe_repeated(name):
        # K/V heads repeated for grouped-query attention, as exporters write it (Unsqueeze,
        # Expand, Reshape): matched so that the kernel gets the unrepeated heads.
        named[f"{name}0"], named[f"{name}_plain"] = wildcard(), wildcard()
        named[f"{name}_expand"] = is_op("relax.expand_dims")(named[f"{name}0"])
        named[f"{name}_broadcast"] = is_op("relax.broadcast_to")(named[f"{name}_expand"], wildcard())
        return is_op("relax.reshape")(named[f"{name}_broadcast"], wildcard()) | named[f"{name}_plain"]

    named.update(q=wildcard(), scale=is_const(), mask=is_const())
    named["kt"] = is_op("relax.permute_dims")(maybe_repeated("k"))
    scores = is_op("relax.multiply")(is_op("relax.matmul")(named["q"], named["kt"]), named["scale"])
    named["probs"] = is_op("relax.nn.softmax")(is_op("relax.add")(scores, named["mask"]) | scores)
    root = is_op("relax.matmul")(named["probs"], maybe_repeated("v"))
    return root, named


def _kv_heads(matched, name, batch, heads, seq, head_dim):
    """K/V heads behind a matched K or V: its own heads, or those a GQA repeat started from."""
    plain = matched.get(f"{name}_plain")
    if plain is not None:
        return static_shape(plain) == (batch, heads, seq, head_dim) and heads
    source = matched[f"{name}0"]
    shape = static_shape(source)
    if shape is None or len(shape) != 4:
        return None
    b, kv_heads, s, d = shape
    if (b, s, d) != (batch, seq, head_dim) or heads % kv_heads:
        return None
    # The repeat must put copy g of kv head j at head j*group + g (what h // group undoes):
    # expand_dims at axis 2, then broadcast to (b, kv_heads, group, seq, d).
    axes = [int(a) for a in matched[f"{name}_expand"].attrs.axis]
    if axes != [2] or static_shape(matched[f"{name}_broadcast"]) != (b, kv_heads, heads // kv_heads, s, d):
        return None
    return kv_heads


def _relax_rewrite(matched, kernel):
    """softmax(q @ k^T * 1/sqrt(d) [+ causal mask]) @ v over (batch, heads, seq, head_dim)
    tensors of one of the pattern's dtypes; k and v may be GQA-repeated from fewer heads (then the
    kernel gets the unrepeated ones). The mask must be the end-aligned causal one (0 visible, <= -1e4 hidden);
    any other mask, scale or softmax axis leaves the graph alone."""
    q, scale = matched["q"], matched["scale"]
    qs = static_shape(q)
    dtype = dtype_of(q)
    if qs is None or len(qs) != 4 or dtype not in FLOAT_DTYPES:
        return None
    batch, heads, seq_q, head_dim = qs
    probs_shape = static_shape(matched["probs"])
    if probs_shape is None or probs_shape[:3] != (batch, heads, seq_q):
        return None
    seq_kv = probs_shape[3]
    if [int(a) for a in matched["kt"].attrs.axes] != [0, 1, 3, 2]:
        return None
    if int(matched["probs"].attrs.axis) not in (-1, 3):
        return None
    factor = constant_value(scale)
    # 1/sqrt(d) as the graph's dtype holds it (a float16 graph's scale is rounded to float16)
    if factor.size != 1 or not math.isclose(float(factor.reshape(())),
                                            float(np.asarray(1.0 / math.sqrt(head_dim), factor.dtype)), rel_tol=1e-6):
        return None
    causal = 0
    if "mask" in matched:
        mask = constant_value(matched["mask"])
        if mask.shape[-2:] != (seq_q, seq_kv) or mask.size != seq_q * seq_kv:
            return None
        mask = mask.reshape(seq_q, seq_kv)
        i, j = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
        visible = j <= i + (seq_kv - seq_q)
        if not (np.all(mask[visible] == 0) and np.all(mask[~visible] <= -1e4)) or seq_q > seq_kv:
            return None
        causal = 1
    kv = [_kv_heads(matched, n, batch, heads, seq_kv, head_dim) for n in ("k", "v")]
    if not kv[0] or kv[0] != kv[1]:
        return None
    k = matched.get("k_plain", matched.get("k0"))
    v = matched.get("v_plain", matched.get("v0"))
    if dtype_of(k) != dtype or dtype_of(v) != dtype:
        return None
    shape = {"batch": batch, "heads": heads, "kv_heads": kv[0], "seq_q": seq_q, "seq_kv": seq_kv,
             "head_dim": head_dim, "causal": causal}
    return kernel(shape, dtype, [q, k, v])


PATTERN = Pattern.from_module(
    globals(),
    description="softmax(q k^T / sqrt(d) [+ causal mask]) v in one kernel, online softmax over key tiles",
    shape_params=[BATCH, *gqa_heads((8, 2), (8, 2)), ShapeParam("seq_q", 256, 16, "query positions"),
                  ShapeParam("seq_kv", 256, 16, "key/value positions (any length; tiles of KV_TILE)"), HEAD_DIM,
                  ShapeParam("causal", 1, 1, "1: key j visible to query i iff j <= i + seq_kv - seq_q",
                             minimum=0)],
    templates=[flash_tiles, cuda_wgmma_flash, cuda_flash],
    # Before softmax_dropout's rule, which would otherwise take the softmax out of the attention.
    relax_rules=[RelaxRule("attention", _relax_pattern, _relax_rewrite, priority=10)],
)
