"""gqa_decode_attention: one decode step of grouped-query attention over a KV cache.

Each sequence brings one new token: q (batch, num_heads, head_dim) and its key/value rows k_new,
v_new (batch, num_kv_heads, head_dim). num_heads query heads share num_kv_heads K/V heads in groups
of ``group = num_heads / num_kv_heads`` (query head ``hk * group + g`` uses K/V head ``hk``;
num_kv_heads = 1 is multi-query attention). The kernel appends k_new/v_new to the caches at
position ``cache_len`` (a shape parameter, so the attended length cache_len + 1 is static) and
returns softmax(q k^T / sqrt(head_dim)) v over positions 0..cache_len.

The caches are outputs, not updated in place: a TIR function that writes an input cannot be
checked against a reference, so k_cache_out and v_cache_out are the input caches with row
cache_len replaced. That copy (2 x batch x num_kv_heads x max_seq x head_dim floats read and
written) is part of this kernel's cost, counted in ``bytes``, and at the default shape it is most
of the traffic (2 x 8 MiB read and written against 2 x 4 MiB of attended rows); an in-place
kernel would write only the new row. The default batch is 2, not 4: at 4 the copy alone (64 MiB
of traffic) takes longer than 5 ms on the 2-core development machine.

Stages (one sblock each): ``append`` (both output caches in one block: whole rows copied, row
cache_len taken from k_new/v_new), ``scores`` (q k^T over the new cache, float32), ``row_max``,
``exp`` (p = exp((s - max) * scale), scale folded in here since it is > 0), ``row_sum``, ``pv``
(p v, float32) and ``normalise`` (divide by the sum once per output element). The attention reads
the appended cache, so the new row needs no special case.

Unfused, the copy and the attention each stream the caches from memory, and scores and
probabilities of every head round-trip through memory. The ``kv_head`` template parallelises over
(batch, K/V head): under each iteration it copies that head's K and V slabs and then runs every
attention stage for the whole query group, so the slabs are read back from cache, not DRAM, and
each K/V row loaded serves all ``group`` query heads (the group is the inner axis of the score and
P*V tiles). Scores are dot products along head_dim, vectorised through an rfactor over a lane tile
of head_dim; max and sum through an rfactor along the key axis; exp along keys; P*V along head_dim.

Precision: float32, float16 or bfloat16 inputs and outputs; scores, softmax statistics and the P*V
accumulator are float32 in every dtype, and each output is rounded to the dtype once. (The
half-precision tolerance is stated at ``PATTERN``.)
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import Pattern, ShapeParam, onnx_model, template
from search_spaces.reduction.softmax_dropout import _exp


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

    @T.prim_func(s_tir=True)
    def gqa_decode_attention(q: T.Buffer((nb, hq, hd), dtype), k_new: T.Buffer((nb, hkv, hd), dtype),
                             v_new: T.Buffer((nb, hkv, hd), dtype),
                             k_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                             v_cache: T.Buffer((nb, hkv, smax, hd), dtype),
                             out: T.Buffer((nb, hq, hd), dtype),
                             k_cache_out: T.Buffer((nb, hkv, smax, hd), dtype),
                             v_cache_out: T.Buffer((nb, hkv, smax, hd), dtype)):
        T.func_attr({"global_symbol": "gqa_decode_attention", "tirx.noalias": True})
        s = T.sblock_alloc_buffer((nb, hkv, grp, n), "float32")
        row_max = T.sblock_alloc_buffer((nb, hkv, grp), "float32")
        p = T.sblock_alloc_buffer((nb, hkv, grp, n), "float32")
        row_sum = T.sblock_alloc_buffer((nb, hkv, grp), "float32")
        acc = T.sblock_alloc_buffer((nb, hkv, grp, hd), "float32")
        for b, h, t, d in T.grid(nb, hkv, smax, hd):
            with T.sblock("append"):
                vb, vh, vt, vd = T.axis.remap("SSSS", [b, h, t, d])
                k_cache_out[vb, vh, vt, vd] = T.Select(vt == length, k_new[vb, vh, vd],
                                                       k_cache[vb, vh, vt, vd])
                v_cache_out[vb, vh, vt, vd] = T.Select(vt == length, v_new[vb, vh, vd],
                                                       v_cache[vb, vh, vt, vd])
        for b, h, g, j, d in T.grid(nb, hkv, grp, n, hd):
            with T.sblock("scores"):
                vb, vh, vg, vj, vd = T.axis.remap("SSSSR", [b, h, g, j, d])
                with T.init():
                    s[vb, vh, vg, vj] = T.float32(0)
                s[vb, vh, vg, vj] = s[vb, vh, vg, vj] + (T.Cast("float32", q[vb, vh * grp + vg, vd])
                                                         * T.Cast("float32", k_cache_out[vb, vh, vj, vd]))
        for b, h, g, j in T.grid(nb, hkv, grp, n):
            with T.sblock("row_max"):
                vb, vh, vg, vj = T.axis.remap("SSSR", [b, h, g, j])
                with T.init():
                    row_max[vb, vh, vg] = T.min_value("float32")
                row_max[vb, vh, vg] = T.max(row_max[vb, vh, vg], s[vb, vh, vg, vj])
        for b, h, g, j in T.grid(nb, hkv, grp, n):
            with T.sblock("exp"):
                vb, vh, vg, vj = T.axis.remap("SSSS", [b, h, g, j])
                p[vb, vh, vg, vj] = _exp((s[vb, vh, vg, vj] - row_max[vb, vh, vg]) * T.float32(scale))
        for b, h, g, j in T.grid(nb, hkv, grp, n):
            with T.sblock("row_sum"):
                vb, vh, vg, vj = T.axis.remap("SSSR", [b, h, g, j])
                with T.init():
                    row_sum[vb, vh, vg] = T.float32(0)
                row_sum[vb, vh, vg] = row_sum[vb, vh, vg] + p[vb, vh, vg, vj]
        for b, h, g, d, j in T.grid(nb, hkv, grp, hd, n):
            with T.sblock("pv"):
                vb, vh, vg, vd, vj = T.axis.remap("SSSSR", [b, h, g, d, j])
                with T.init():
                    acc[vb, vh, vg, vd] = T.float32(0)
                acc[vb, vh, vg, vd] = acc[vb, vh, vg, vd] + p[vb, vh, vg, vj] * T.Cast(
                    "float32", v_cache_out[vb, vh, vj, vd])
        for b, h, g, d in T.grid(nb, hkv, grp, hd):
            with T.sblock("normalise"):
                vb, vh, vg, vd = T.axis.remap("SSSS", [b, h, g, d])
                out[vb, vh * grp + vg, vd] = T.Cast(dtype, acc[vb, vh, vg, vd] / row_sum[vb, vh, vg])

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
    s = qg @ kc[:, :, :length + 1].astype(np.float64).swapaxes(-1, -2) / math.sqrt(hd)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (e / e.sum(axis=-1, keepdims=True)) @ vc[:, :, :length + 1].astype(np.float64)
    return o.reshape(nb, hq, hd).astype(q.dtype), kc, vc


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    nb, hq, hkv, _, hd, smax, _ = _dims(shape)
    # Unit-variance q and k: scores q.k/sqrt(hd) of unit variance. Rows past cache_len hold values
    # too, so reading beyond the attended positions would show.
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((nb, hq, hd)), rng.standard_normal((nb, hkv, hd)),
              rng.standard_normal((nb, hkv, hd)), rng.standard_normal((nb, hkv, smax, hd)),
              rng.standard_normal((nb, hkv, smax, hd))]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


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


def _vector_reduce(sch, knobs, name, default_width, factor_axis):
    """Split the block's innermost (reduction) loop into (outer, lanes) and rfactor the lanes: the
    partials become a spatial, vectorisable axis. rfactor must precede the compute-at moves (it
    needs the reduction to be the first child of its loop). Returns (rf block, final block)."""
    block = sch.get_sblock(name)
    r = sch.get_loops(block)[-1]
    _, lanes = sch.split(r, knobs.tile(r, 2, [default_width], max_innermost_factor=32))
    return sch.rfactor(lanes, factor_axis=factor_axis), block


@template("kv_head")
def kv_head(sch, target, knobs):
    """(batch, K/V head) in parallel: that head's cache slabs copied, then scores, softmax and P*V
    for its whole query group while the slabs are in cache; dot products vectorised via rfactor
    over head_dim lanes, max/sum/exp along keys, P*V and the copy along head_dim."""
    append = sch.get_sblock("append")
    exp = sch.get_sblock("exp")
    pv = sch.get_sblock("pv")
    norm = sch.get_sblock("normalise")
    score_rf, score_fin = _vector_reduce(sch, knobs, "scores", 16, 4)
    max_rf, max_fin = _vector_reduce(sch, knobs, "row_max", 16, 3)
    sum_rf, sum_fin = _vector_reduce(sch, knobs, "row_sum", 16, 3)

    # The attention stages gather under normalise's (batch, K/V head) loop, computed at it
    # consumers first (each producer then lands ahead of its readers).
    b, h, _, d = sch.get_loops(norm)
    attn_head = sch.fuse(b, h)
    _, d1 = sch.split(d, knobs.tile(d, 2, [16], max_innermost_factor=64))
    sch.vectorize(d1)
    for blk in (pv, sum_fin, sum_rf, exp, max_fin, max_rf, score_fin, score_rf):
        sch.compute_at(blk, attn_head, preserve_unit_loops=True)

    # The copy's (batch, K/V head) loop is merged with the attention's, so each head's slabs are
    # copied right before the attention reads them back. (Not reverse_compute_at of the attention
    # into the copy: the rf block's split head_dim index defeats its region solver, and rfactor
    # must run before the blocks share a loop with the copy.)
    b, h, _, d = sch.get_loops(append)
    copy_head = sch.fuse(b, h)
    _, d1 = sch.split(d, knobs.tile(d, 2, [16], max_innermost_factor=64))
    sch.vectorize(d1)
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

    for rf in (max_rf, sum_rf):
        lanes, _, _, g, j0 = sch.get_loops(rf)[-5:]
        sch.reorder(g, j0, lanes)
        sch.vectorize(lanes)
        sch.decompose_reduction(rf, j0)

    j = sch.get_loops(exp)[-1]
    _, j1 = sch.split(j, knobs.tile(j, 2, [16], max_innermost_factor=32))
    sch.vectorize(j1)

    # P*V: head_dim chunks as vectors, the group inside so each V row chunk serves all of it.
    g, d, j = sch.get_loops(pv)[-3:]
    d0, d1 = sch.split(d, knobs.tile(d, 2, [16], max_innermost_factor=64))
    sch.reorder(d0, j, g, d1)
    sch.vectorize(d1)
    sch.decompose_reduction(pv, j)

    sch.annotate(head, "pragma_auto_unroll_max_step", knobs.choice([0, 16, 64], 16))
    sch.annotate(head, "pragma_unroll_explicit", 1)


def onnx_graph(shape, dtype):
    """The static-cache decode step as exporters write it: the append as Where over a one-hot
    position mask, q reshaped to (batch, kv_heads, group, head_dim) so one MatMul per K/V head covers
    its group, and a constant additive mask hiding positions past cache_len. The baselines thus
    attend over all max_seq positions (masked) where the kernel visits cache_len + 1."""
    from onnx import helper
    nb, hq, hkv, grp, hd, smax, length = _dims(shape)
    pos = np.arange(smax)
    initializers = {
        "is_new": (pos == length).reshape(1, 1, smax, 1),
        "axis2": np.array([2], dtype=np.int64),
        "group_shape": np.array([nb, hkv, grp, hd], dtype=np.int64),
        "out_shape": np.array([nb, hq, hd], dtype=np.int64),
        "scale": np.asarray(1.0 / math.sqrt(hd), dtype=dtype),
        "mask": np.where(pos <= length, 0.0, -1e9).astype(dtype).reshape(1, 1, 1, smax),
    }
    nodes = [helper.make_node("Unsqueeze", ["k_new", "axis2"], ["k_row"]),
             helper.make_node("Unsqueeze", ["v_new", "axis2"], ["v_row"]),
             helper.make_node("Where", ["is_new", "k_row", "k_cache"], ["k_cache_out"]),
             helper.make_node("Where", ["is_new", "v_row", "v_cache"], ["v_cache_out"]),
             helper.make_node("Reshape", ["q", "group_shape"], ["qg"]),
             helper.make_node("Transpose", ["k_cache_out"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qg", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v_cache_out"], ["og"]),
             helper.make_node("Reshape", ["og", "out_shape"], ["out"])]
    cache = (nb, hkv, smax, hd)
    return onnx_model("gqa_decode_attention", nodes,
                      [("q", (nb, hq, hd)), ("k_new", (nb, hkv, hd)), ("v_new", (nb, hkv, hd)),
                       ("k_cache", cache), ("v_cache", cache)],
                      [("out", (nb, hq, hd)), ("k_cache_out", cache), ("v_cache_out", cache)], dtype,
                      initializers)


PATTERN = Pattern(
    name="gqa_decode_attention",
    family="attention",
    description="one-token GQA decode: append k/v at cache_len, attend over positions 0..cache_len",
    shape_params=[ShapeParam("batch", 2, 2, "sequences, one new token each"),
                  ShapeParam("num_heads", 32, 4, "query heads"),
                  ShapeParam("num_kv_heads", 8, 2, "K/V heads (divides num_heads; 1 is MQA)"),
                  ShapeParam("head_dim", 128, 8, "per-head feature size"),
                  ShapeParam("max_seq", 1024, 16, "cache capacity (positions)"),
                  ShapeParam("cache_len", 511, 9, "tokens already cached; the new one goes there",
                             minimum=0)],
    build=build,
    reference=reference,
    make_inputs=make_inputs,
    onnx_graph=onnx_graph,
    flops=flops,
    bytes=nbytes,
    dtypes=("float32", "float16", "bfloat16"),
    # float16/bfloat16: kernel (from float32) and reference (from float64) each round the output once
    # and may land one unit in the last place apart, <= 2u|y| (u = 2^-11 float16, 2^-8 bfloat16):
    # rtol = 4u. Near zero, where cancellation in P.V leaves no relative bound,
    # the float32 accumulation error remains: ~n * 2^-24 of |v|, 3.1e-5 at n = cache_len + 1 = 512:
    # atol 1e-4. (The cache outputs are copies, exact in any dtype.)
    tolerance={"float32": (1e-4, 1e-4), "float16": (2e-3, 1e-4), "bfloat16": (1.6e-2, 1e-4)},
    templates=[kv_head],
    num_outputs=3,
)
