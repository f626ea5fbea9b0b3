"""gqa_decode_attention: one decode step of grouped-query attention over a KV cache.

Each sequence brings one token: q (batch, num_heads, head_dim) and its k_new, v_new rows; query head
hk * group + g uses K/V head hk. The kernel appends k_new/v_new at position ``cache_len`` (a shape
parameter, so the attended length cache_len + 1 is static) and attends over positions 0..cache_len.
The caches are outputs (k_cache_out, v_cache_out), not updated in place: a TIR function that writes
an input cannot be checked against a reference. The copy is counted in ``bytes``.

Fused, each K/V row serves the whole query group while in cache: ``kv_head`` (CPU, parallel over
(batch, K/V head), the copy in the same loop) and ``cuda_kv_head`` (the copy a kernel of its own,
since TVM puts no barrier between a block's global writes and other threads' reads, then
``lib.attention.cuda_decode_attention``). float32 scores and accumulators in every dtype. On an
sm_90 GPU in float16/bfloat16 the kernel template ``cuda_split_kv`` comes first: flash-decoding's
split kernel, copying the caches as it reads them, and its combine (``lib.cuda_attention``), at any
cache length.
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, onnx_model, template
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (HEAD_DIM, MAX_SEQ, cpu_softmax_tail, cuda_decode_attention, decode_vector,
                                         gqa_heads, softmax_stages)
from search_spaces.lib.cpu_rows import rfactor_lanes
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.cuda_rows import vector_load
from search_spaces.lib.onnx_graphs import attention_nodes
from search_spaces.lib.tiling import unroll, vectorize_inner
from search_spaces.lib.tirx_sequence import buffer, sequence, workspace


def _dims(shape):
    nb, hq, hkv = shape["batch"], shape["num_heads"], shape["num_kv_heads"]
    hd, smax, length = shape["head_dim"], shape["max_seq"], shape["cache_len"]
    if hq % hkv:
        raise ValueError(f"num_heads={hq} must be a multiple of num_kv_heads={hkv}")
    if not 0 <= length < smax:
        raise ValueError(f"cache_len={length} must be in [0, max_seq={smax})")
    return nb, hq, hkv, hq // hkv, hd, smax, length


def build(shape, dtype):
    nb, hq, hkv, grp, hd, smax, length = _dims(shape)
    n = length + 1  # positions attended: the old cache_len rows plus the new one
    scale = 1.0 / math.sqrt(hd)
    stages = softmax_stages()

    @T.prim_func(s_tir=True)
    def gqa_decode_attention(q: T.Buffer((nb, hq, hd), dtype), k_new: T.Buffer((nb, hkv, hd), dtype),
                             v_new: T.Buffer((nb, hkv, hd), dtype),
                             k_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                             v_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                             out: T.Buffer((nb, hq, hd), dtype),
                             k_cache_out: T.Buffer((nb, hkv, smax, hd), dtype),
                             v_cache_out: T.Buffer((nb, hkv, smax, hd), dtype)):
        T.func_attr({"global_symbol": "gqa_decode_attention", "tirx.noalias": True})
        for b, h, t, d in T.grid(nb, hkv, smax, hd):
            with T.sblock("append"):
                vb, vh, vt, vd = T.axis.remap("SSSS", [b, h, t, d])
                k_cache_out[vb, vh, vt, vd] = T.Select(vt == length, k_new[vb, vh, vd],
                                                       k_cache[vb, vh, vt, vd])
                v_cache_out[vb, vh, vt, vd] = T.Select(vt == length, v_new[vb, vh, vd],
                                                       v_cache[vb, vh, vt, vd])
        stages(lambda b, h, g, d: q[b, h * grp + g, d], lambda b, h, g, j, d: k_cache_out[b, h, j, d],
               lambda b, h, g, j, d: v_cache_out[b, h, j, d], out, lambda b, h, g, d: [b, h * grp + g, d],
               (nb, hkv, grp, n, hd), scale)

    return gqa_decode_attention


def appended(k_new, v_new, k_cache, v_cache, cache_len):
    """The caches with row ``cache_len`` replaced by the new token's K/V rows (copies)."""
    kc, vc = k_cache.copy(), v_cache.copy()
    kc[:, :, cache_len] = k_new
    vc[:, :, cache_len] = v_new
    return kc, vc


def reference(q, k_new, v_new, k_cache, v_cache, shape=None):
    if shape is None:
        raise ValueError("gqa_decode_attention's reference needs the shape (for cache_len)")
    nb, hq, hkv, grp, hd, _, length = _dims(shape)
    kc, vc = appended(k_new, v_new, k_cache, v_cache, length)
    qg = q.astype(np.float64).reshape(nb, hkv, grp, hd)
    o = np.empty(qg.shape, np.float64)
    for b in range(nb):  # a sequence at a time: float64 copies of all caches would be 34 GB at b64 c32768
        s = qg[b] @ kc[b, :, :length + 1].astype(np.float64).swapaxes(-1, -2) / math.sqrt(hd)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        o[b] = (e / e.sum(axis=-1, keepdims=True)) @ vc[b, :, :length + 1].astype(np.float64)
    return o.reshape(nb, hq, hd).astype(q.dtype), kc, vc


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    nb, hq, hkv, _, hd, smax, _ = _dims(shape)
    # Unit-variance q and k: scores q.k/sqrt(hd) of unit variance. Rows past cache_len hold values
    # too, so reading beyond the attended positions would show.
    # Uniform on [-sqrt(3), sqrt(3)) (unit variance), drawn in float32 and cast: a half-precision
    # run gets the float32 run's inputs, rounded, and batch 64's caches at 32768 positions (2 x 2.1G
    # values) are drawn 3x faster than normal ones.
    sizes = [(nb, hq, hd), (nb, hkv, hd), (nb, hkv, hd), (nb, hkv, smax, hd), (nb, hkv, smax, hd)]
    return [_unit_uniform(rng, size).astype(dtype) for size in sizes]


def _unit_uniform(rng, size):
    values = rng.random(size, dtype=np.float32)
    values -= np.float32(0.5)
    values *= np.float32(math.sqrt(12.0))
    return values


def flops(shape):
    nb, hq, _, _, hd, _, length = _dims(shape)
    n = length + 1
    # q k^T and p v (2 flops per multiply-add each), max, sub+mul+exp, add per score, a divide per
    # output element; the cache copy is traffic, not flops.
    return nb * hq * (4.0 * n * hd + 5.0 * n + hd)


def nbytes(shape, dtype):
    nb, hq, hkv, _, hd, smax, _ = _dims(shape)
    # q and out; k_new, v_new; both caches read once and written once (the copy).
    return np.dtype(dtype).itemsize * nb * hd * (2 * hq + 2 * hkv + 4 * hkv * smax)


@template("kv_head")
def kv_head(sch, target, knobs):
    """(batch, K/V head) in parallel: that head's cache slabs copied, then scores, softmax and P*V
    for its whole query group while the slabs are in cache; dot products vectorised via rfactor
    over head_dim lanes, max/sum/exp along keys, P*V and the copy along head_dim."""
    append, exp, pv, norm = (sch.get_sblock(name) for name in ("append", "exp", "pv", "normalise"))
    score_rf, score_fin = rfactor_lanes(sch, knobs, "scores", 16, factor_axis=4, max_lanes=32)
    max_rf, max_fin = rfactor_lanes(sch, knobs, "row_max", 16, factor_axis=3, max_lanes=32)
    sum_rf, sum_fin = rfactor_lanes(sch, knobs, "row_sum", 16, factor_axis=3, max_lanes=32)

    # The attention stages gather under normalise's (batch, K/V head) loop, computed at it
    # consumers first (each producer then lands ahead of its readers).
    b, h, _, d = sch.get_loops(norm)
    attn_head = sch.fuse(b, h)
    vectorize_inner(sch, knobs, d)
    for blk in (pv, sum_fin, sum_rf, exp, max_fin, max_rf, score_fin, score_rf):
        sch.compute_at(blk, attn_head, preserve_unit_loops=True)

    # The copy's (batch, K/V head) loop is merged with the attention's, so each head's slabs are
    # copied right before the attention reads them back. (Not reverse_compute_at of the attention
    # into the copy: the rf block's split head_dim index defeats its region solver, and rfactor
    # must run before the blocks share a loop with the copy.)
    b, h, _, d = sch.get_loops(append)
    copy_head = sch.fuse(b, h)
    vectorize_inner(sch, knobs, d)
    head = sch.merge(copy_head, attn_head)
    sch.parallel(head)

    # Dot products: each K row chunk is loaded once and multiplied into every query head of the
    # group (g inside j and the head_dim chunk), one lane-partial per (g, j, lane).
    lanes, _, _, g, j, d0 = sch.get_loops(score_rf)[-6:]
    sch.reorder(j, d0, g, lanes)
    sch.vectorize(lanes)
    sch.decompose_reduction(score_rf, d0)
    # The lane sums then read each score's partials contiguously.
    lanes, _, _, g, j = sch.get_loops(score_fin)[-5:]
    sch.reorder(g, j, lanes)

    # Max, sum and exp along keys; P*V with each V row chunk serving the whole group.
    cpu_softmax_tail(sch, knobs, (max_rf, sum_rf), exp, pv)
    unroll(sch, knobs, head)


# ---- CUDA ------------------------------------------------------------------------------------


def cuda_append(sch, knobs):
    """The cache copy as a kernel of its own: a thread per vector (16 bytes in float32) of a
    cache row: vector loads of both caches, the new row's elements selected one by one, vector
    stores. Its own kernel because the attention reads the copied rows back, and TVM puts no
    barrier between a block's global writes and other threads' reads."""
    append = sch.get_sblock("append")
    b, h, t, d = sch.get_loops(append)
    vec = decode_vector(sch.get(append).writes[0].source.dtype, int(sch.get(d).extent))
    dv, v = sch.split(d, [None, vec])
    rest = sch.fuse(b, h, t, dv)
    # A perfect split: reverse_compute_at does not carry a predicate over to the stores.
    bx, tx = sch.split(rest, knobs.tile(rest, 2, [256], max_innermost_factor=512))
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    for name in ("k_cache", "v_cache"):
        vector_load(sch, append, name, tx)
    stores = [sch.cache_write(append, i, "local") for i in (0, 1)]
    for store in stores:
        sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(store)[-1])
    sch.unroll(v)


@template("cuda_kv_head", target_kinds=("cuda",))
def cuda_kv_head(sch, target, knobs):
    """Two kernels: the cache copy (a thread per vector), then a thread block per (batch, K/V
    head) for the attention: lanes x slots threads, a slot's lanes split a key row's head_dim
    (vector loads, each K/V vector used for the whole query group, partial dot products summed by
    shuffles), scores and probabilities in shared memory, block-wide max and sum, P*V partials per
    slot summed through shared memory."""
    cuda_append(sch, knobs)

    def head_rows(sch, block):
        b, h = sch.get_loops(block)[:2]
        sch.fuse(b, h)

    cuda_decode_attention(sch, target, knobs, ("scores", "row_max", "exp", "row_sum", "pv", "normalise"),
                          head_rows, lambda b, h, g: (g,))


def _split_kv_check(shape, dtype, knobs):
    _dims(shape)
    cuda_attention.check_decode(shape, dtype, knobs, append=True)


def _split_kv(shape, dtype, knobs):
    """Flash-decoding on Hopper (``lib.cuda_attention``), two kernels in one PrimFunc
    (``lib.tirx_sequence``): the split kernel over the cache_len + 1 positions, which appends as it
    reads (row cache_len taken from k_new/v_new, every row it loads stored to the output caches,
    the rows past cache_len copied by the CTAs in shares; with ``stages``, the keys through a
    shared-memory ring by bulk copies, the append as bulk copies out of it; each K/V row read once
    for its whole query group, a partial per key split), then the combine (with ``merge`` "cluster"
    or "last", none: the splits merge in their thread-block cluster, or the last split to finish
    merges them); no cache length limit.
    float16/bfloat16, head_dim 64 or 128; a group of more than 8 query heads is shared out in row
    sets among CTAs over the same keys, the first of which appends."""
    nb, hq, hkv, _, hd, smax, length = _dims(shape)
    split, combine = cuda_attention.decode_attention(shape, dtype, knobs, append=True)
    resolved = cuda_attention.check_decode(shape, dtype, knobs, append=True)[1]
    splits = resolved["splits"]
    q, out = buffer("q", (nb, hq, hd), dtype), buffer("out", (nb, hq, hd), dtype)
    k_new, v_new = (buffer(name, (nb, hkv, hd), dtype) for name in ("k_new", "v_new"))
    k_cache, v_cache, k_out, v_out = (buffer(name, (nb, hkv, smax, hd), dtype)
                                      for name in ("k_cache", "v_cache", "k_cache_out", "v_cache_out"))
    params = [q, k_new, v_new, k_cache, v_cache, out, k_out, v_out]
    if resolved["merge"] == "cluster":  # the splits merged in their cluster, out written by the split kernel
        return sequence("gqa_decode_attention", params,
                        [(split, [q, k_new, v_new, k_cache, v_cache, k_out, v_out, out, length + 1])])
    part_o = workspace("part_o", (nb, hq, splits, hd), "float32")
    part_ml = workspace("part_ml", (nb, hq, splits, 2), "float32")
    if resolved["merge"] == "last":  # the last split to finish merges the partials and writes out
        return sequence("gqa_decode_attention", params,
                        [(split, [q, k_new, v_new, k_cache, v_cache, k_out, v_out, part_o, part_ml, out,
                                  length + 1])], [part_o, part_ml])
    return sequence("gqa_decode_attention", params,
                    [(split, [q, k_new, v_new, k_cache, v_cache, k_out, v_out, part_o, part_ml, length + 1]),
                     (combine, [part_o, part_ml, out])], [part_o, part_ml])


def _split_kv_default(shape, dtype):
    """The defaults, with ``merge`` as ``cuda_attention.default_merge`` sets it for the shape."""
    knobs = cuda_attention.APPEND_SPLIT_KV_DEFAULT_KNOBS
    try:
        merge = cuda_attention.check_decode(shape, dtype, knobs, append=True)[1]["merge"]
    except ValueError:  # a shape the kernel refuses: no configuration will be taken anyway
        merge = "combine"
    return {**knobs, "merge": merge}


cuda_split_kv = KernelTemplate("cuda_split_kv", _split_kv, cuda_attention.APPEND_SPLIT_KV_KNOBS,
                               cuda_attention.APPEND_SPLIT_KV_DEFAULT_KNOBS, _split_kv_check,
                               shape_default=_split_kv_default, **HOPPER)


def onnx_graph(shape, dtype):
    """The decode step as a dynamic-length exporter writes it, attending over exactly cache_len + 1
    positions as the kernel does: the cache outputs as Where over a one-hot position mask (the
    kernel writes the same full copies), the attended K/V as the first cache_len cache rows Sliced
    and the new token's row Concatenated, q reshaped to (batch, kv_heads, group, head_dim) so one
    MatMul per K/V head covers its group; no mask."""
    from onnx import helper
    nb, hq, hkv, grp, hd, smax, length = _dims(shape)
    pos = np.arange(smax)
    initializers = {
        "is_new": (pos == length).reshape(1, 1, smax, 1),
        "axis2": np.array([2], dtype=np.int64),
        "zero": np.array([0], dtype=np.int64),
        "cache_len": np.array([length], dtype=np.int64),
        "group_shape": np.array([nb, hkv, grp, hd], dtype=np.int64),
        "out_shape": np.array([nb, hq, hd], dtype=np.int64),
        "scale": np.asarray(1.0 / math.sqrt(hd), dtype=dtype),
    }
    nodes = [helper.make_node("Unsqueeze", ["k_new", "axis2"], ["k_row"]),
             helper.make_node("Unsqueeze", ["v_new", "axis2"], ["v_row"]),
             helper.make_node("Where", ["is_new", "k_row", "k_cache"], ["k_cache_out"]),
             helper.make_node("Where", ["is_new", "v_row", "v_cache"], ["v_cache_out"])]
    if length:
        nodes += [helper.make_node("Slice", [f"{c}_cache", "zero", "cache_len", "axis2"], [f"{c}_old"])
                  for c in "kv"]
        nodes += [helper.make_node("Concat", [f"{c}_old", f"{c}_row"], [f"{c}_seen"], axis=2) for c in "kv"]
    else:  # an empty cache: the new row alone (no zero-length Slice, which XLA and Relax handle badly)
        nodes += [helper.make_node("Identity", [f"{c}_row"], [f"{c}_seen"]) for c in "kv"]
    nodes += [helper.make_node("Reshape", ["q", "group_shape"], ["qg"]),
              *attention_nodes("qg", "k_seen", "v_seen", "og"),
              helper.make_node("Reshape", ["og", "out_shape"], ["out"])]
    cache = (nb, hkv, smax, hd)
    return onnx_model("gqa_decode_attention", nodes,
                      [("q", (nb, hq, hd)), ("k_new", (nb, hkv, hd)), ("v_new", (nb, hkv, hd)),
                       ("k_cache", cache), ("v_cache", cache)],
                      [("out", (nb, hq, hd)), ("k_cache_out", cache), ("v_cache_out", cache)], dtype,
                      initializers)


def sdpa(torch, shape, q, k_new, v_new, k_cache, v_cache):
    """The torch-sdpa baseline: the caches copied with the new row at cache_len (outputs, as ours),
    then torch's scaled_dot_product_attention over positions 0..cache_len."""
    length = shape["cache_len"]
    k_out, v_out = k_cache.clone(), v_cache.clone()
    k_out[:, :, length] = k_new
    v_out[:, :, length] = v_new
    o = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k_out[:, :, :length + 1], v_out[:, :, :length + 1],
        enable_gqa=shape["num_heads"] != shape["num_kv_heads"])
    return [o.squeeze(2), k_out, v_out]


PATTERN = Pattern.from_module(
    globals(),
    description="one-token GQA decode: append k/v at cache_len, attend over positions 0..cache_len",
    shape_params=[ShapeParam("batch", 2, 2, "sequences, one new token each"),
                  *gqa_heads((32, 4), (8, 2), prefix="num_"), HEAD_DIM.with_sizes(128, 8), MAX_SEQ,
                  ShapeParam("cache_len", 511, 9, "tokens already cached; the new one goes there",
                             minimum=0)],
    templates=[kv_head, cuda_split_kv, cuda_kv_head],
    num_outputs=3,
)
