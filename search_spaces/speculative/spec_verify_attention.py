"""spec_verify_attention: the target model's attention over k drafted tokens (a chain or a token
tree) in one pass, as speculative decoding verifies them.

q (batch, heads, k_draft, head_dim); the KV cache k_cache, v_cache (batch, kv_heads, max_seq,
head_dim) with ``cache_len`` valid positions (a shape parameter, the same for the batch; 0 allowed);
the drafts' own k_new, v_new (batch, kv_heads, k_draft, head_dim); the tree mask (k_draft, k_draft)
int32, tree[i, j] != 0 when draft j is i or one of its ancestors (``tree_mask``; a chain is the
lower triangle). Draft i sees every cached position and its own tree path; GQA as in
flash_attention. The cache is only read: the caller appends the accepted prefix once it knows it.

Unfused, the cache prefix is sliced and concatenated with the drafts' K/V, repeated over the group,
and a score matrix goes through memory. Fused, nothing is copied and no score matrix exists: the
cache goes by in tiles of ``KV_TILE`` with flash_attention's online softmax, and after the last
tile the draft block (masked by the tree) is folded into the same state. Each (batch, K/V head) owns
group * k_draft query rows, the vector axis of ``kv_head_tiles`` (CPU), so a K/V tile is loaded
once for the whole group; ``cuda_verify_rows`` follows ``cuda_flash`` (a block per (batch, K/V
head, row tile), K/V tiles in shared memory, the running state in registers). On an sm_90 GPU in
float16/bfloat16 the kernel templates come first: with VERIFY_MIN_ITEMS (batch, K/V head) pairs or
more ``cuda_wgmma_verify``, the tensor-core prefill (``lib.cuda_attention``) with a K/V head's group
x drafts rows as one query tile, the cache's tiles then the drafts' under the tree; else
``cuda_split_kv``, flash-decoding's split kernel over the cache (its query rows the group's drafts),
one more split for the draft block under the tree, and the combine, at any cache length.
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, param_buffers, template
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (HEAD_DIM, MAX_SEQ, annotate_read, gqa_heads, load_lanes, row_lanes,
                                         vector_split)
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.onnx_graphs import (attention_nodes, hidden_score, kv_repeat_constants, repeat_kv_heads,
                                           typed_model)
from search_spaces.lib.tiling import unroll
from search_spaces.lib.tir_math import dtype_bytes, exp_f32
from search_spaces.lib.tirx_sequence import buffer, sequence, workspace

KV_TILE = 64


def _dims(shape):
    nb, hq, hkv = shape["batch"], shape["heads"], shape["kv_heads"]
    hd, smax, length, kd = shape["head_dim"], shape["max_seq"], shape["cache_len"], shape["k_draft"]
    if hq % hkv:
        raise ValueError(f"kv_heads={hkv} must divide heads={hq}")
    if not 0 <= length <= smax:
        raise ValueError(f"cache_len={length} must be in [0, max_seq={smax}]")
    return nb, hq, hkv, hq // hkv, hd, smax, length, kd


def key_tiles(cache_len):
    """(key tile, tile count) over the cache: KV_TILE-key tiles (one shorter tile when the cache is
    shorter), at least one tile, which with cache_len = 0 is wholly masked."""
    kt = min(KV_TILE, max(cache_len, 1))
    return kt, max(1, -(-cache_len // kt))


def build(shape, dtype):
    nb, hq, hkv, grp, hd, smax, length, kd = _dims(shape)
    rows = grp * kd
    kt, nt = key_tiles(length)
    pad = nt * kt != length
    # A Python bool, resolved when the script is parsed: with an empty cache the two cache products
    # vanish, so nothing reads k_cache/v_cache (a stale row might hold NaN, and 0 * NaN is NaN).
    has_cache = length > 0
    last = max(length - 1, 0)
    scale = 1.0 / math.sqrt(hd)
    f32 = "float32"
    neg = T.min_value(f32)

    def key(j):
        # The padded tail of the last tile reads the last cached row again; its scores are masked.
        return T.min(j, last) if pad else j

    def masked(j, value, fill):
        return T.Select(j < length, value, fill) if pad else value

    @T.prim_func(s_tir=True)
    def spec_verify_attention(q: T.Buffer((nb, hq, kd, hd), dtype),
                              k_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                              v_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                              k_new: T.Buffer((nb, hkv, kd, hd), dtype),
                              v_new: T.Buffer((nb, hkv, kd, hd), dtype),
                              tree: T.Buffer((kd, kd), "int32"),
                              o: T.Buffer((nb, hq, kd, hd), dtype)):
        T.func_attr({"global_symbol": "spec_verify_attention", "tirx.noalias": True})
        qt = T.sblock_alloc_buffer((nb, hkv, hd, rows), f32)
        keep = T.sblock_alloc_buffer((nb, hkv, kd, rows), f32)
        s = T.sblock_alloc_buffer((nb, hkv, kt, rows), f32)
        tile_max = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        alpha = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        m = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        p = T.sblock_alloc_buffer((nb, hkv, kt, rows), f32)
        tile_sum = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        l = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        pv = T.sblock_alloc_buffer((nb, hkv, rows, hd), f32)
        acc = T.sblock_alloc_buffer((nb, hkv, rows, hd), f32)
        sd = T.sblock_alloc_buffer((nb, hkv, kd, rows), f32)
        md = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        beta = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        pd = T.sblock_alloc_buffer((nb, hkv, kd, rows), f32)
        ld = T.sblock_alloc_buffer((nb, hkv, rows), f32)
        pvd = T.sblock_alloc_buffer((nb, hkv, rows, hd), f32)
        for b, hk in T.grid(nb, hkv):
            for dd, r in T.grid(hd, rows):
                with T.sblock("q_scaled_t"):
                    vb, vh, vd, vr = T.axis.remap("SSSS", [b, hk, dd, r])
                    qt[vb, vh, vd, vr] = T.Cast(f32, q[vb, vh * grp + vr // kd, vr % kd, vd]) * T.float32(scale)
            for j, r in T.grid(kd, rows):
                with T.sblock("draft_keep"):
                    vb, vh, vj, vr = T.axis.remap("SSSS", [b, hk, j, r])
                    keep[vb, vh, vj, vr] = T.Select(tree[vr % kd, vj] != 0, T.float32(1), T.float32(0))
            for t in T.serial(nt):
                for c, dd, r in T.grid(kt, hd, rows):
                    with T.sblock("qk"):
                        vb, vh, vt, vc, vd, vr = T.axis.remap("SSSSRS", [b, hk, t, c, dd, r])
                        with T.init():
                            s[vb, vh, vc, vr] = T.float32(0)
                        if has_cache:
                            s[vb, vh, vc, vr] = s[vb, vh, vc, vr] + T.Cast(
                                f32, k_cache[vb, vh, key(vt * kt + vc), vd]) * qt[vb, vh, vd, vr]
                for c, r in T.grid(kt, rows):
                    with T.sblock("tile_max"):
                        vb, vh, vt, vc, vr = T.axis.remap("SSSRS", [b, hk, t, c, r])
                        with T.init():
                            tile_max[vb, vh, vr] = neg
                        tile_max[vb, vh, vr] = T.max(tile_max[vb, vh, vr],
                                                     masked(vt * kt + vc, s[vb, vh, vc, vr], neg))
                for r in T.serial(rows):
                    with T.sblock("run_max"):
                        vb, vh, vt, vr = T.axis.remap("SSRS", [b, hk, t, r])
                        # alpha = exp(m - m') from the old m, written here so that nothing reads m
                        # before its update. First tile: m is the float32 minimum, l = acc = 0.
                        with T.init():
                            m[vb, vh, vr] = neg
                            alpha[vb, vh, vr] = T.float32(0)
                        alpha[vb, vh, vr] = exp_f32(m[vb, vh, vr] - T.max(m[vb, vh, vr], tile_max[vb, vh, vr]))
                        m[vb, vh, vr] = T.max(m[vb, vh, vr], tile_max[vb, vh, vr])
                for c, r in T.grid(kt, rows):
                    with T.sblock("prob"):
                        vb, vh, vt, vc, vr = T.axis.remap("SSSSS", [b, hk, t, c, r])
                        p[vb, vh, vc, vr] = masked(vt * kt + vc, exp_f32(s[vb, vh, vc, vr] - m[vb, vh, vr]),
                                                   T.float32(0))
                for c, r in T.grid(kt, rows):
                    with T.sblock("tile_sum"):
                        vb, vh, vt, vc, vr = T.axis.remap("SSSRS", [b, hk, t, c, r])
                        with T.init():
                            tile_sum[vb, vh, vr] = T.float32(0)
                        tile_sum[vb, vh, vr] = tile_sum[vb, vh, vr] + p[vb, vh, vc, vr]
                for r in T.serial(rows):
                    with T.sblock("run_sum"):
                        vb, vh, vt, vr = T.axis.remap("SSRS", [b, hk, t, r])
                        with T.init():
                            l[vb, vh, vr] = T.float32(0)
                        l[vb, vh, vr] = l[vb, vh, vr] * alpha[vb, vh, vr] + tile_sum[vb, vh, vr]
                for r, c, dd in T.grid(rows, kt, hd):
                    with T.sblock("pv"):
                        vb, vh, vt, vr, vc, vd = T.axis.remap("SSSSRS", [b, hk, t, r, c, dd])
                        with T.init():
                            pv[vb, vh, vr, vd] = T.float32(0)
                        if has_cache:
                            pv[vb, vh, vr, vd] = pv[vb, vh, vr, vd] + p[vb, vh, vc, vr] * T.Cast(
                                f32, v_cache[vb, vh, key(vt * kt + vc), vd])
                for r, dd in T.grid(rows, hd):
                    with T.sblock("run_acc"):
                        vb, vh, vt, vr, vd = T.axis.remap("SSRSS", [b, hk, t, r, dd])
                        with T.init():
                            acc[vb, vh, vr, vd] = T.float32(0)
                        acc[vb, vh, vr, vd] = acc[vb, vh, vr, vd] * alpha[vb, vh, vr] + pv[vb, vh, vr, vd]
            # The draft block, folded into the state the cache tiles left.
            for j, dd, r in T.grid(kd, hd, rows):
                with T.sblock("draft_qk"):
                    vb, vh, vj, vd, vr = T.axis.remap("SSSRS", [b, hk, j, dd, r])
                    with T.init():
                        sd[vb, vh, vj, vr] = T.float32(0)
                    sd[vb, vh, vj, vr] = sd[vb, vh, vj, vr] + T.Cast(
                        f32, k_new[vb, vh, vj, vd]) * qt[vb, vh, vd, vr]
            for j, r in T.grid(kd, rows):
                with T.sblock("draft_max"):
                    vb, vh, vj, vr = T.axis.remap("SSRS", [b, hk, j, r])
                    with T.init():
                        md[vb, vh, vr] = m[vb, vh, vr]
                    md[vb, vh, vr] = T.max(md[vb, vh, vr], T.Select(
                        keep[vb, vh, vj, vr] > T.float32(0.5), sd[vb, vh, vj, vr], neg))
            for r in T.serial(rows):
                with T.sblock("rescale"):
                    vb, vh, vr = T.axis.remap("SSS", [b, hk, r])
                    beta[vb, vh, vr] = exp_f32(m[vb, vh, vr] - md[vb, vh, vr])
            for j, r in T.grid(kd, rows):
                with T.sblock("draft_prob"):
                    vb, vh, vj, vr = T.axis.remap("SSSS", [b, hk, j, r])
                    pd[vb, vh, vj, vr] = T.Select(keep[vb, vh, vj, vr] > T.float32(0.5),
                                                  exp_f32(sd[vb, vh, vj, vr] - md[vb, vh, vr]), T.float32(0))
            for j, r in T.grid(kd, rows):
                with T.sblock("draft_sum"):
                    vb, vh, vj, vr = T.axis.remap("SSRS", [b, hk, j, r])
                    with T.init():
                        ld[vb, vh, vr] = l[vb, vh, vr] * beta[vb, vh, vr]
                    ld[vb, vh, vr] = ld[vb, vh, vr] + pd[vb, vh, vj, vr]
            for r, j, dd in T.grid(rows, kd, hd):
                with T.sblock("draft_pv"):
                    vb, vh, vr, vj, vd = T.axis.remap("SSSRS", [b, hk, r, j, dd])
                    with T.init():
                        pvd[vb, vh, vr, vd] = acc[vb, vh, vr, vd] * beta[vb, vh, vr]
                    pvd[vb, vh, vr, vd] = pvd[vb, vh, vr, vd] + pd[vb, vh, vj, vr] * T.Cast(
                        f32, v_new[vb, vh, vj, vd])
            for r, dd in T.grid(rows, hd):
                with T.sblock("out"):
                    vb, vh, vr, vd = T.axis.remap("SSSS", [b, hk, r, dd])
                    o[vb, vh * grp + vr // kd, vr % kd, vd] = T.Cast(dtype, pvd[vb, vh, vr, vd] / ld[vb, vh, vr])

    return spec_verify_attention


def tree_mask(parents):
    """The (k, k) int32 mask of a draft tree given each draft's parent (-1: child of the accepted
    prefix): mask[i, j] = 1 when j is i or one of its ancestors. Parents precede their children."""
    k = len(parents)
    mask = np.zeros((k, k), dtype=np.int32)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft {i}'s parent {parent} must be -1 or an earlier draft")
        mask[i, i] = 1
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def chain_mask(k):
    """A chain of k drafts, each continuing the previous one: the causal lower triangle."""
    return tree_mask([i - 1 for i in range(k)])


def two_branch_mask(k):
    """Draft 0 continues the prefix; drafts 1..k//2 and k//2+1..k-1 are two chains under it that do
    not see each other (for k=8: 0 <- 1 <- 2 <- 3 <- 4 and 0 <- 5 <- 6 <- 7)."""
    split = k // 2
    return tree_mask([-1] + [0 if j in (1, split + 1) else j - 1 for j in range(1, k)])


def reference(q, k_cache, v_cache, k_new, v_new, tree, shape=None):
    if shape is None:
        raise ValueError("spec_verify_attention's reference needs the shape (for cache_len)")
    nb, hq, hkv, grp, hd, _, length, kd = _dims(shape)
    k = np.concatenate([k_cache[:, :, :length], k_new], axis=2).astype(np.float64)
    v = np.concatenate([v_cache[:, :, :length], v_new], axis=2).astype(np.float64)
    k, v = (np.repeat(x, grp, axis=1) for x in (k, v))
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / math.sqrt(hd)
    visible = np.concatenate([np.ones((kd, length), bool), tree != 0], axis=1)
    s = np.where(visible, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True) @ v).astype(q.dtype)


def make_inputs(shape, dtype, seed):
    """Unit-normal q, K and V (scores of unit variance); cache rows past cache_len hold values too,
    so reading them would show. The tree has two branches under a root draft (``two_branch_mask``)."""
    nb, hq, hkv, _, hd, smax, _, kd = _dims(shape)
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((nb, hq, kd, hd)).astype(dtype),
            rng.standard_normal((nb, hkv, smax, hd)).astype(dtype),
            rng.standard_normal((nb, hkv, smax, hd)).astype(dtype),
            rng.standard_normal((nb, hkv, kd, hd)).astype(dtype),
            rng.standard_normal((nb, hkv, kd, hd)).astype(dtype),
            two_branch_mask(kd)]


def flops(shape):
    # Per query row and key (cache_len + k_draft of them, as the kernel computes every draft's
    # score and masks it): q.k and p.v, 2 flops per multiply-add each, and ~5 for scale, max,
    # exp, sum.
    nb, hq, _, _, hd, _, length, kd = _dims(shape)
    return nb * hq * kd * (length + kd) * (4.0 * hd + 5.0)


def nbytes(shape, dtype):
    # q and o; the cache_len valid rows of K and V (the rest of the cache is never read); the
    # drafts' K and V; the tree.
    nb, hq, hkv, _, hd, _, length, kd = _dims(shape)
    item = np.dtype(dtype).itemsize
    return item * nb * hd * (2 * hq * kd + 2 * hkv * length + 2 * hkv * kd) + 4 * kd * kd


@template("kv_head_tiles")
def kv_head_tiles(sch, target, knobs):
    """(batch, K/V head) in parallel, key tiles streamed through the running state of its
    group x drafts rows; scores, softmax statistics and exponentials vectorised along the rows,
    P.V along head_dim; the two products register-blocked."""
    qk = sch.get_sblock("qk")
    b, hk, t, c, dd, r = sch.get_loops(qk)
    outer = sch.fuse(b, hk)
    sch.parallel(outer)

    # The row vector: one sampled width for every row loop (they all have extent group*k_draft).
    row_vec = knobs.tile(r, 2, [32], max_innermost_factor=32)

    def row_split(loop):
        return sch.split(loop, row_vec)

    # Scores: c1 keys x a row vector of accumulators, each qt[d, rows] vector loaded once per
    # head_dim step and used for the c1 keys, each k[c, d] a broadcast scalar.
    c0, c1 = sch.split(c, knobs.tile(c, 2, [2], max_innermost_factor=8))
    r0, r1 = row_split(r)
    sch.reorder(c0, r0, dd, c1, r1)
    sch.vectorize(r1)

    # Statistics per row: the key loop outside, a row vector inside (one vector accumulator).
    reductions = []
    for name in ("tile_max", "tile_sum", "draft_max", "draft_sum"):
        blk = sch.get_sblock(name)
        kc, rr = sch.get_loops(blk)[-2:]
        rr0, rr1 = row_split(rr)
        sch.reorder(rr0, kc, rr1)
        sch.vectorize(rr1)
        reductions.append((blk, kc))
    for name in ("run_max", "run_sum", "rescale", "prob", "draft_prob"):
        rr = sch.get_loops(sch.get_sblock(name))[-1]
        sch.vectorize(row_split(rr)[1])

    dq = sch.get_sblock("draft_qk")
    j, jd, jr = sch.get_loops(dq)[-3:]
    jr0, jr1 = row_split(jr)
    sch.reorder(jr0, jd, jr1)
    sch.vectorize(jr1)

    # P.V: rb rows x a head_dim vector of accumulators; each V row vector loaded once for the rb
    # rows, each p[c, r] a broadcast scalar.
    pvb = sch.get_sblock("pv")
    pr, pc, pd = sch.get_loops(pvb)[-3:]
    d_vec = knobs.tile(pd, 2, [16], max_innermost_factor=64)
    pr0, pr1 = sch.split(pr, knobs.tile(pr, 2, [4], max_innermost_factor=8))
    pd0, pd1 = sch.split(pd, d_vec)
    sch.reorder(pr0, pd0, pc, pr1, pd1)
    sch.vectorize(pd1)
    dpv = sch.get_sblock("draft_pv")
    qr, qj, qd = sch.get_loops(dpv)[-3:]
    qd0, qd1 = sch.split(qd, d_vec)
    sch.reorder(qd0, qj, qd1)
    sch.vectorize(qd1)
    for name in ("run_acc", "out"):
        sch.vectorize(sch.get_loops(sch.get_sblock(name))[-1])

    # Inits after vectorising (a block without its init is no longer a reduction, and vectorize
    # refuses the loop around it); the running state is initialised once, before the tile loop.
    sch.decompose_reduction(qk, dd)
    sch.decompose_reduction(dq, jd)
    for blk, loop in reductions:
        sch.decompose_reduction(blk, loop)
    sch.decompose_reduction(pvb, pc)
    sch.decompose_reduction(dpv, qj)
    for name in ("run_max", "run_sum", "run_acc"):
        sch.decompose_reduction(sch.get_sblock(name), t)
    unroll(sch, knobs, outer)


# ---- CUDA ---------------------------------------------------------------------------------------

_CUDA_ROW_TILES = (1, 2, 4, 8, 16, 32, 64)   # query rows per thread block (threadIdx.y)


def _cuda_plan(kt, hd, kd, rows, lanes, itemsize, limit):
    """What ``cuda_verify_rows`` keeps where, and the row tiles that then fit: (q in registers,
    stage K, stage V, row tiles). Per row of the tile, shared memory always holds the
    probabilities of a key tile and the drafts' scores and probabilities (float32), and the
    scaled q row where head_dim is too long for registers; K (transposed, rows padded by one) and
    V tiles (the dtype) while they fit, otherwise they are read through L1. Tiles beyond the next
    power of two of the rows would only add idle threads."""
    q_regs = hd <= 128
    per_row = (kt + 2 * kd + (0 if q_regs else hd)) * 4
    tall = [r for r in _CUDA_ROW_TILES if r * lanes <= 1024 and r < 2 * rows]
    k_bytes = hd * (kt + 1) * itemsize
    v_bytes = kt * hd * itemsize
    for stage_k, stage_v in ((True, True), (True, False), (False, False)):
        fixed = stage_k * k_bytes + stage_v * v_bytes
        tiles = [r for r in tall if fixed + r * per_row <= limit]
        if tiles:
            return q_regs, stage_k, stage_v, tiles
    raise ValueError(f"cuda_verify_rows: no row tile fits {limit} bytes of shared memory")


@template("cuda_verify_rows", target_kinds=("cuda",))
def cuda_verify_rows(sch, target, knobs):
    """A thread block per (batch, K/V head, row tile), a query row (group member x draft) per
    threadIdx.y, LANES threads per row. K/V tiles of the cache are staged in shared memory, where
    all rows of the block (the GQA group's heads x drafts) reuse them; scores, running max/sum and
    the output accumulator stay in each thread's registers, the tile max and sum are warp
    shuffles across the row's threads, and the probabilities, which P.V needs on every thread of
    the row, go through shared memory; the key-tile loop stays serial; the draft block is folded
    in at the end the same way."""
    get = sch.get_sblock
    qk, pv, dq, dpv = get("qk"), get("pv"), get("draft_qk"), get("draft_pv")
    b, hk, t, c, dd, r = sch.get_loops(qk)
    kt, hd, rows = (int(sch.get(x).extent) for x in (c, dd, r))
    kd = int(sch.get(sch.get_loops(dq)[-3]).extent)
    smax = int(param_buffers(sch.mod["main"])[1].shape[2])   # k_cache's capacity, max_seq
    itemsize = dtype_bytes(sch.get(get("out")).writes[0].source.dtype)
    lanes = row_lanes(hd)
    vec = load_lanes(hd)
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024))
    q_regs, stage_k, stage_v, tiles = _cuda_plan(kt, hd, kd, rows, lanes, itemsize, limit)
    # Default 8 rows a block: more blocks on the GPU's SMs outweigh loading each K/V tile once
    # per 8 rows instead of once per 32 (faster on the H200).
    tile = knobs.choice(tiles, max(r_ for r_ in tiles if r_ <= 8))
    # With an empty cache nothing reads it (the TIR drops both cache products).
    reads_cache = any(reg.source.name == "k_cache" for reg in sch.get(qk).reads)

    bx = sch.fuse(b, hk)
    sch.bind(bx, "blockIdx.x")

    def rows_of(loop):
        # Every stage splits its row loop the same way: the row tile on blockIdx.y (the same
        # extent in every stage, so one launch dimension), the row in the tile on threadIdx.y.
        by, ty = sch.split(loop, [None, tile])
        sch.bind(by, "blockIdx.y")
        sch.bind(ty, "threadIdx.y")
        return ty

    def lanes_of(loop):
        # Keys (or drafts) of a row to its threads: key c to thread c % LANES, which then owns
        # its score and probability in every stage (the reductions over keys are shuffles).
        cc, tx = sch.split(loop, [None, lanes])
        sch.bind(tx, "threadIdx.x")
        return tx, cc

    def columns_of(loop):
        # head_dim over the row's threads, each a run of head_dim / LANES consecutive columns.
        tx, dj = sch.split(loop, [lanes, None])
        sch.bind(tx, "threadIdx.x")
        return tx, dj

    def stage(block, name):
        # A K/V tile of the cache in shared memory. The keys of the last tile of a padded cache
        # clamp to the last cached row, which would leave that tile a symbolic number of rows (a
        # loop MetaSchedule rejects); the block's read is declared instead as the whole window
        # [min(t * kt, max_seq - kt), + kt) of cache rows, which holds every row it reads (tile
        # t's clamped keys lie in [t * kt, t * kt + kt) and below max_seq) and lies in the cache.
        # Rows of the window past cache_len are loaded and never used.
        cache = sch.cache_read(block, name, "shared")
        index = [reg.source.name for reg in sch.get(block).reads].index(name + "_shared")
        annotate_read(sch, block, index, lambda vb, vh, vt, *_: [
            (vb, vb + 1), (vh, vh + 1), (T.min(vt * kt, smax - kt), T.min(vt * kt, smax - kt) + kt), (0, hd)])
        sch.compute_at(cache, t, preserve_unit_loops=True)
        return cache

    def fill(cache):
        fused = sch.fuse(*sch.get_loops(cache)[-2:])
        _, fy, fx, fv = sch.split(fused, [None, tile, lanes, vec])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")
        sch.vectorize(fv)

    # q scaled and transposed, per row: in each of the row's threads' registers (every thread
    # of the row reads all of it), or for a long head_dim in shared memory.
    qs = get("q_scaled_t")
    qd, qr = sch.get_loops(qs)[-2:]
    sch.reorder(qr, qd)
    rows_of(qr)
    if q_regs:
        vector_split(sch, qd, 4)
    else:
        columns_of(qd)
    # The tree mask is read where it is used (a 0/1 per draft pair, from L1), not materialised.
    sch.compute_inline(get("draft_keep"))

    # Per key tile: scores, max, probabilities and sum with key c on thread c % LANES of the row.
    sch.reorder(r, c, dd)
    rows_of(r)
    ctx, cc = lanes_of(c)
    sch.reorder(ctx, cc)
    for name in ("tile_max", "prob", "tile_sum"):
        kc, kr = sch.get_loops(get(name))[-2:]
        sch.reorder(kr, kc)
        rows_of(kr)
        lanes_of(kc)
    for name in ("run_max", "run_sum"):
        rows_of(sch.get_loops(get(name))[-1])
    # P.V and the accumulator: head_dim split over the row's threads.
    pr, pc, pd = sch.get_loops(pv)[-3:]
    rows_of(pr)
    ptx, pdj = columns_of(pd)
    sch.reorder(ptx, pc, pdj)
    ar, ad = sch.get_loops(get("run_acc"))[-2:]
    rows_of(ar)
    _, adj = columns_of(ad)
    if reads_cache and stage_k:
        # K^T of the tile: thread c % LANES reads along the keys (consecutive words), rows padded
        # by one so that the transposing stores of the fill spread over the banks.
        kc_ = stage(qk, "k_cache")
        sch.transform_layout(kc_, ("write", 0), lambda b_, h_, j_, d_: (b_, h_, d_, j_))
        sch.storage_align(kc_, 0, axis=-2, factor=32, offset=1)
        fill(kc_)
    if reads_cache and stage_v:
        vc_ = stage(pv, "v_cache")
        fill(vc_)

    # The draft block: scores and probabilities with draft j on thread j % LANES; its max and
    # sum start from the running state (not an identity), so each thread folds all drafts of
    # its row in serially, reading the scores and probabilities from shared memory.
    j, jd, jr = sch.get_loops(dq)[-3:]
    sch.reorder(jr, j, jd)
    rows_of(jr)
    jtx, jc = lanes_of(j)
    sch.reorder(jtx, jc)
    # The draft scores accumulate in a register and are then stored to the shared row.
    sd_store = sch.cache_write(dq, 0, "local")
    sch.reverse_compute_at(sd_store, jc, preserve_unit_loops=True)
    jj, jr = sch.get_loops(get("draft_prob"))[-2:]
    sch.reorder(jr, jj)
    rows_of(jr)
    lanes_of(jj)
    serial = []
    for name in ("draft_max", "draft_sum"):
        jj, jr = sch.get_loops(get(name))[-2:]
        sch.reorder(jr, jj)
        rows_of(jr)
        serial.append((get(name), jj))
    rows_of(sch.get_loops(get("rescale"))[-1])
    qr_, qj, qdd = sch.get_loops(dpv)[-3:]
    rows_of(qr_)
    qtx, qdj = columns_of(qdd)
    sch.reorder(qtx, qj, qdj)
    or_, od = sch.get_loops(get("out"))[-2:]
    rows_of(or_)
    _, odj = columns_of(od)

    # Per-thread values in registers; what a row's threads exchange in shared memory.
    for name in ("qk", "tile_max", "tile_sum", "run_sum", "pv", "run_acc", "draft_max", "rescale",
                 "draft_sum", "draft_pv"):
        sch.set_scope(get(name), 0, "local")
    sch.set_scope(get("run_max"), 0, "local")
    sch.set_scope(get("run_max"), 1, "local")
    sch.set_scope(qs, 0, "local" if q_regs else "shared")
    for blk in (get("prob"), sd_store, get("draft_prob")):
        sch.set_scope(blk, 0, "shared")
        # Row-major, rows padded by one: the build lays these out (key, row) for the CPU's row
        # vectors, where key c of every row is written by thread c % LANES, a bank conflict
        # across the row's threads.
        sch.transform_layout(blk, ("write", 0), lambda b_, h_, c_, r_: (b_, h_, r_, c_))
        sch.storage_align(blk, 0, axis=-2, factor=32, offset=1)

    for loop in (pdj, qdj, adj, odj):
        vector_split(sch, loop, 4)
    # Inits split out of every reduction that is not across threads (after the bindings and
    # vectorising: an update block without its init is neither complete nor a reduction).
    sch.decompose_reduction(qk, cc)
    for loop in sch.get_loops(qk)[-2:]:
        sch.unroll(loop)
    sch.decompose_reduction(dq, jc)
    for loop in sch.get_loops(dq)[-2:]:
        sch.unroll(loop)
    sch.decompose_reduction(pv, pc)
    sch.decompose_reduction(dpv, qj)
    for blk, loop in serial:
        sch.decompose_reduction(blk, loop)
    # The running state initialised once per row, before the key-tile loop.
    for name in ("run_max", "run_sum", "run_acc"):
        sch.decompose_reduction(get(name), t)
    unroll(sch, knobs, pc, explicit=0)


def _decode_shape(shape):
    nb, hq, hkv, _, hd, smax, length, _ = _dims(shape)
    return {"batch": nb, "num_heads": hq, "num_kv_heads": hkv, "head_dim": hd, "max_seq": smax, "cache_len": length}


def _split_kv_check(shape, dtype, knobs):
    cuda_attention.check_decode(_decode_shape(shape), dtype, knobs, drafts=_dims(shape)[7])


def _split_kv(shape, dtype, knobs):
    """Flash-decoding on Hopper (``lib.cuda_attention``), two kernels in one PrimFunc
    (``lib.tirx_sequence``): the split kernel, a CTA per (key split, set of up to 8 of a K/V head's
    group x drafts query rows, sequence) over its share of the cache_len cached keys, each K/V row
    read once per row set, and one more split per row set for the drafts' own keys under the tree;
    then the combine; float16/bfloat16, head_dim 64 or 128, no cache length limit."""
    nb, hq, hkv, _, hd, smax, length, kd = _dims(shape)
    decode = _decode_shape(shape)
    split, combine = cuda_attention.decode_attention(decode, dtype, knobs, drafts=kd)
    partials = cuda_attention.decode_partials(cuda_attention.check_decode(decode, dtype, knobs, kd)[1], kd)
    q, o = buffer("q", (nb, hq, kd, hd), dtype), buffer("o", (nb, hq, kd, hd), dtype)
    k_cache, v_cache = (buffer(name, (nb, hkv, smax, hd), dtype) for name in ("k_cache", "v_cache"))
    k_new, v_new = (buffer(name, (nb, hkv, kd, hd), dtype) for name in ("k_new", "v_new"))
    tree = buffer("tree", (kd, kd), "int32")
    part_o = workspace("part_o", (nb, hq * kd, partials, hd), "float32")
    part_ml = workspace("part_ml", (nb, hq * kd, partials, 2), "float32")
    return sequence("spec_verify_attention", [q, k_cache, v_cache, k_new, v_new, tree, o],
                    [(split, [q, k_cache, v_cache, k_new, v_new, tree, part_o, part_ml, length]),
                     (combine, [part_o, part_ml, o])], [part_o, part_ml])


cuda_split_kv = KernelTemplate("cuda_split_kv", _split_kv, cuda_attention.SPLIT_KV_KNOBS,
                               cuda_attention.SPLIT_KV_DEFAULT_KNOBS, _split_kv_check, **HOPPER)


def _verify_prefill(shape):
    return cuda_attention.verify_prefill_shape(_decode_shape(shape), shape["k_draft"]), \
        (shape["k_draft"], shape["cache_len"])


def _wgmma_verify_check(shape, dtype, knobs):
    prefill, verify = _verify_prefill(shape)
    cuda_attention.check_prefill(prefill, dtype, knobs, verify=verify)


def _wgmma_verify(shape, dtype, knobs):
    """FlashAttention on Hopper tensor cores (``lib.cuda_attention.prefill_attention`` with
    ``verify``): a work item per (batch, K/V head), its group x drafts query rows one wgmma tile,
    the cache's first cache_len keys in TMA-loaded tiles, then the drafts' own keys as one more tile
    under the tree; float16/bfloat16, head_dim 64 or 128, from VERIFY_MIN_ITEMS (batch, K/V head)
    pairs on (fewer leave the SMs idle: ``cuda_split_kv`` then)."""
    prefill, verify = _verify_prefill(shape)
    return cuda_attention.prefill_attention(prefill, dtype, knobs, verify=verify)


cuda_wgmma_verify = KernelTemplate("cuda_wgmma_verify", _wgmma_verify, cuda_attention.PREFILL_KNOBS,
                                   cuda_attention.PREFILL_DEFAULT_KNOBS, _wgmma_verify_check, **HOPPER)


def onnx_graph(shape, dtype):
    """As exporters write tree verification: Slice the cache to cache_len and Concat the drafts'
    K/V, repeat K/V heads over their group (Unsqueeze, Expand, Reshape), MatMul, Mul by the scale,
    Add the mask (zeros for the cache, Where(Equal(tree, 1), 0, -1e9) for the drafts, built from the
    tree input), Softmax, MatMul."""
    from onnx import helper

    nb, hq, hkv, grp, hd, smax, length, kd = _dims(shape)
    n = length + kd
    consts = {
        "zero_i64": np.array([0], np.int64),
        "len_i64": np.array([length], np.int64),
        **kv_repeat_constants(nb, hkv, hq, n, hd),
        "scale": np.array(1.0 / math.sqrt(hd), dtype),
        "one_i32": np.array(1, np.int32),
        "visible": np.array(0.0, dtype),
        "hidden": np.array(hidden_score(dtype), dtype),
        "cache_bias": np.zeros((kd, length), dtype),
    }
    nodes = []
    for x in ("k", "v"):
        nodes += [helper.make_node("Slice", [f"{x}_cache", "zero_i64", "len_i64", "axis2"], [f"{x}_prefix"]),
                  helper.make_node("Concat", [f"{x}_prefix", f"{x}_new"], [f"{x}_all"], axis=2)]
        if grp > 1:
            nodes += repeat_kv_heads(f"{x}_all", x)
        else:
            nodes.append(helper.make_node("Identity", [f"{x}_all"], [f"{x}_heads"]))
    nodes += [helper.make_node("Equal", ["tree", "one_i32"], ["in_tree"]),
              helper.make_node("Where", ["in_tree", "visible", "hidden"], ["tree_bias"]),
              helper.make_node("Concat", ["cache_bias", "tree_bias"], ["mask"], axis=1),
              *attention_nodes("q", "k_heads", "v_heads", "o", mask="mask")]
    cache, new = (nb, hkv, smax, hd), (nb, hkv, kd, hd)
    return typed_model("spec_verify_attention", nodes,
                       [("q", (nb, hq, kd, hd), dtype), ("k_cache", cache, dtype), ("v_cache", cache, dtype),
                        ("k_new", new, dtype), ("v_new", new, dtype), ("tree", (kd, kd), "int32")],
                       [("o", (nb, hq, kd, hd), dtype)], consts)


def _drafts_fit(shape) -> bool:
    """Whether the caches have room for the drafts after the cache prefix."""
    return shape["cache_len"] + shape["k_draft"] <= shape["max_seq"]


def sdpa(torch, shape, q, k_cache, v_cache, k_new, v_new, tree):
    """The torch-sdpa baseline as a serving stack writes it: the drafts' K/V written into the caches'
    free rows after the prefix (the same rows each call, so the inputs stay the same for every
    contender: no kernel reads past cache_len), then torch's scaled_dot_product_attention over the
    caches' first cache_len + k_draft rows in place, the visibility as a boolean mask, GQA. Where
    the drafts do not fit, the prefix and the drafts concatenated (a copy of the cache)."""
    length, drafts = shape["cache_len"], shape["k_draft"]
    if _drafts_fit(shape):
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            cache[:, :, length:length + drafts] = new
        k, v = k_cache[:, :, :length + drafts], v_cache[:, :, :length + drafts]
    else:
        k, v = (torch.cat([cache[:, :, :length], new], dim=2) for cache, new in ((k_cache, k_new), (v_cache, v_new)))
    visible = torch.cat([torch.ones(tree.shape[0], length, dtype=torch.bool, device=tree.device), tree != 0], dim=1)
    return [torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible,
                                                             enable_gqa=shape["heads"] != shape["kv_heads"])]


PATTERN = Pattern.from_module(
    globals(),
    description="speculative-decoding verification: k draft queries over the KV cache and the drafts "
                "(tree mask), online softmax, GQA",
    shape_params=[ShapeParam("batch", 2, 1, "sequences being verified"),
                  *gqa_heads((8, 4), (2, 2)), HEAD_DIM.with_sizes(64, 16), MAX_SEQ.with_sizes(512, 32),
                  ShapeParam("cache_len", 200, 13, "valid cache positions, the same for every sequence",
                             minimum=0),
                  ShapeParam("k_draft", 8, 5, "draft tokens (tree nodes) verified in this pass")],
    templates=[kv_head_tiles, cuda_wgmma_verify, cuda_split_kv, cuda_verify_rows],
    more_work={"onnx_graph": "the graph concatenates the cache prefix with the drafts' K/V (a copy of the "
                             "cache) and repeats K/V over each query group; the kernel reads the cache in place",
               "torch-sdpa": lambda shape: None if _drafts_fit(shape) else (
                   "concatenates the cache prefix with the drafts' K/V (a copy of the cache: the drafts do "
                   "not fit after it) for SDPA's one K and V; the kernel reads the cache in place")},
)
