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

CUDA template ``cuda_kv_head`` (SIMT, two kernels). The copy is a kernel of its own, a thread per
vector of a cache row (vector loads and stores): the attention reads the copied rows back, and
within one kernel TVM puts no barrier between a thread block's global writes and other threads'
reads. The attention is a thread block per (batch, K/V head), so each K/V row is loaded once for the
whole query group: ``lanes`` threads (threadIdx.x) split a key row's head_dim in vectors of up to 4
elements and ``slots`` rows of them (threadIdx.y) take keys round-robin, ``unroll`` keys per step in
flight; q stays in registers. A slot's lanes multiply each K vector into every query row of the
group and sum their partial dot products by warp shuffles; scores and probabilities live in shared
memory, the row max and sum are block-wide reductions (shuffles, then across warps through shared
memory); for P*V each slot accumulates its keys' rows in registers (the same lane split of
head_dim), the slots' partials meet in shared memory after one barrier and each output vector sums
them and divides by the row sum. Knobs: lanes, slots, keys per step, threads of the copy. Shared
memory holds the score and probability rows (4 x group x 2 x (cache_len + 1) bytes, rows padded), so
very long caches do not fit (a ``DecodeShapeError``: past about 1400 positions at group 4). With
only batch x num_kv_heads thread blocks (16 at the default shape) the attention reads K/V from few
SMs; splitting the keys over blocks (flash-decoding) would need the softmax combined across blocks,
not this TensorIR. TVM 0.27 pitfalls the schedule steers around are noted where they bite. Compiled
here (nvcc, sm_90) and checked against the reference by emulating the generated CUDA on the CPU; not
yet run on a GPU.

Precision: float32, float16 or bfloat16 inputs and outputs; scores, softmax statistics and the P*V
accumulator are float32 in every dtype, and each output is rounded to the dtype once. (The
half-precision tolerance is stated at ``PATTERN``.)
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.pattern import Pattern, ShapeParam, onnx_model, template
from search_spaces.reduction.softmax_dropout import VECTOR_BYTES, _exp, dtype_bytes, vector_load


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


# ---- CUDA: a thread block per (batch, K/V head) ---------------------------------------------
#
# Shared with paged_attention, whose stages are the same (q.k, row max, exp, row sum, P*V,
# normalise) over (query rows, keys): ``cuda_decode_attention`` schedules them given the stage
# names and a function that brings each stage's loop nest into the form (head, row, ...).

DECODE_LANES = (1, 2, 4, 8, 16, 32)     # threads sharing one key row's head_dim (threadIdx.x)
DECODE_SLOTS = (1, 2, 4, 8, 16, 32)     # key rows in flight per block (threadIdx.y)
DECODE_UNROLL = (1, 2, 4)               # key rows per thread and step: loads in flight
DECODE_THREADS = 256                    # default threads per attention block
KEY_PAD = max(DECODE_SLOTS) * max(DECODE_UNROLL)   # score rows padded to this many keys
DECODE_SLACK = 1024                     # shared bytes left to the cross-warp reductions


class DecodeShapeError(AutofuseError, ValueError):
    """Score rows too long for a thread block's shared memory."""


def _decode_vector(dtype, head_dim):
    """Elements per vector access along head_dim: at most 16 bytes and 4 elements (the float32
    partial sums are vectors of as many elements, and TVM 0.27's CUDA codegen has no 8-lane
    float32 vectors)."""
    lanes = min(4, max(1, VECTOR_BYTES // dtype_bytes(dtype)))
    while head_dim % lanes:
        lanes //= 2
    return lanes


def _pad_keys(sch, block):
    """Pad the key axis of ``block``'s output (the scores) to a multiple of KEY_PAD. TVM 0.27
    lowers a cross-thread reduction's write-back without the block's predicate: the lane sums of
    keys past the last one (the key loop is split by slots x unroll, which need not divide it)
    are stored anyway, and land in this padding instead of the next row. Nothing reads it."""
    def padded(*idx):
        return (*idx[:-1], idx[-1] // KEY_PAD, idx[-1] % KEY_PAD)
    # The map is injective; the flag waives the pad value TVM would otherwise demand (and the
    # block writing it).
    sch.transform_layout(block, ("write", 0), padded, assume_injective_transform=True)


def cuda_decode_attention(sch, target, knobs, stages, head_rows, row_index):
    """A thread block per (batch, K/V head) for the six stages named by ``stages`` (q.k, max,
    exp, sum, P*V, normalise); ``head_rows(sch, block)`` rewrites a stage's loop nest as (head,
    row, ...), rows being the query rows that share the head's K/V, and ``row_index(*idx)`` maps
    the leading indices of the stages' buffers (all but head_dim or key) to the row's indices
    within its head. Blocks of other stages are the caller's. Threads: ``lanes`` (threadIdx.x)
    share a key row's head_dim, ``slots`` (threadIdx.y) key rows are in flight; the knobs are
    lanes, slots and keys per slot and step."""
    blocks = [sch.get_sblock(name) for name in stages]
    scores, row_max, exp, row_sum, pv, out = blocks
    dtype = sch.get(out).writes[0].source.dtype
    for blk in blocks:
        head_rows(sch, blk)
    _, row, d_loop = sch.get_loops(out)
    rows, d = int(sch.get(row).extent), int(sch.get(d_loop).extent)
    keys = int(sch.get(sch.get_loops(pv)[-1]).extent)
    vec = _decode_vector(dtype, d)

    # Shared memory holds the score rows (padded), the probabilities and the P*V partials of
    # every slot; slot counts that overflow it are not offered (a shape fact).
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024)) - DECODE_SLACK
    row_bytes = 4 * rows * (-(-keys // KEY_PAD) * KEY_PAD + keys)
    slot_fit = [c for c in DECODE_SLOTS if c <= keys and row_bytes + 4 * c * rows * d <= limit]
    if not slot_fit:
        raise DecodeShapeError(f"CUDA decode attention: the scores and probabilities of {rows} query "
                               f"rows x {keys} keys ({row_bytes} bytes) do not fit a thread block's "
                               f"shared memory ({limit} bytes)")
    lane_fit = [c for c in DECODE_LANES if (d // vec) % c == 0]
    lanes = knobs.choice(lane_fit, max(lane_fit))
    slots = knobs.choice(slot_fit, max([c for c in slot_fit if c * max(lane_fit) <= DECODE_THREADS]
                                       or [min(slot_fit)]))
    unroll = knobs.choice(list(DECODE_UNROLL), 2)

    # q.k: head_dim split (lane, chunk, vector), a lane owning chunks x vectors consecutive
    # elements; the partial dot products of lane x vector (an rfactor) are summed by shuffles.
    dd = sch.get_loops(scores)[-1]
    tx, chunk, v = sch.split(dd, [lanes, None, vec])
    sch.reorder(chunk, tx, v)
    score_rf = sch.rfactor(sch.fuse(tx, v), factor_axis=len(sch.get(scores).writes[0].source.shape))
    # P*V: keys dealt round-robin to the slots, a partial accumulator per slot (rfactor). Slots <=
    # keys: every slot's first key exists, so its accumulator is initialised (TVM 0.27's rfactor
    # leaves a slot that gets no key uninitialised).
    _, pk = sch.split(sch.get_loops(pv)[-1], [None, slots])
    pv_rf = sch.rfactor(pk, factor_axis=0)

    # A slot computes the lane partials of `unroll` keys for all rows (each K chunk loaded once
    # for the whole row group), then the lanes reduce them row by row.
    _, row, j, lane = sch.get_loops(scores)
    j_step, j_slot, j_unroll = sch.split(j, [None, slots, unroll])
    sch.reorder(j_step, j_slot, j_unroll, row, lane)
    sch.compute_at(score_rf, j_slot, preserve_unit_loops=True)
    _pad_keys(sch, scores)

    # One kernel: the stages' head loops merged (compute_at would regenerate the P*V partials'
    # loops without their key predicate) and bound to blocks.
    head = sch.merge(*[sch.get_loops(b)[0] for b in (scores, row_max, exp, row_sum, pv_rf, pv, out)])
    sch.bind(head, "blockIdx.x")
    sch.bind(j_slot, "threadIdx.y")
    # compute_at made a loop per iteration variable of the rf block: lane, (batch, heads, rows),
    # key, chunk. Each K vector is loaded once per key and chunk and used for every row.
    lane, *middle, key, rf_chunk = sch.get_loops(score_rf)[3:]
    tx, v = sch.split(lane, [lanes, vec])
    sch.reorder(tx, rf_chunk, key, *middle, v)
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    for loop in (rf_chunk, key, *middle):
        sch.unroll(loop)
    tx, _ = sch.split(sch.get_loops(scores)[-1], [lanes, vec])
    sch.bind(tx, "threadIdx.x")
    # q in registers for the whole kernel: a lane's chunks of every row, vector loads.
    q_local = sch.cache_read(score_rf, "q", "local")
    sch.compute_at(q_local, head, preserve_unit_loops=True)
    *q_rows, qd = sch.get_loops(q_local)[1:]
    tx, q_chunk, v = sch.split(qd, [lanes, None, vec])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    for loop in (*q_rows, q_chunk):
        sch.unroll(loop)

    # Max, exponentials and sum: keys over all the block's threads (coalesced shared reads), rows
    # serial; max and sum are block-wide reductions (shuffles, then across warps).
    for blk in (row_max, exp, row_sum):
        _, row, j = sch.get_loops(blk)
        step, ty, tx = sch.split(j, [None, slots, lanes])
        sch.reorder(row, ty, tx, step)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")

    # P*V partials: slot (threadIdx.y) x head_dim chunks (threadIdx.x) as in q.k, every row per
    # V vector; `unroll` keys per step.
    _, row, dd, j_step, j_slot = sch.get_loops(pv_rf)
    tx, chunk, v = sch.split(dd, [lanes, None, vec])
    pv_step, j_unroll = sch.split(j_step, [None, unroll])
    sch.reorder(j_slot, tx, pv_step, j_unroll, chunk, row, v)
    sch.bind(j_slot, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    for loop in (j_unroll, chunk, row):
        sch.unroll(loop)

    for blk, scope in ((scores, "shared"), (exp, "shared"), (row_max, "shared"), (row_sum, "shared"),
                       (score_rf, "local"), (pv_rf, "local"), (pv, "local")):
        sch.set_scope(blk, 0, scope)
    # The slots' partials through shared memory (each thread stores its own), then summed over
    # the slots by whichever thread writes that output vector: one barrier, not a tree per element.
    stage = sch.cache_read(pv, 0, "shared")
    # Laid out by (slot, row in the head, head_dim): its readers' rows are split by the slot
    # count, and the predicated rest would otherwise size it by up to `slots` rows per head.
    # Distinct within a thread block, which is all the buffer serves.
    sch.transform_layout(stage, ("write", 0), lambda k, *idx: (k, *row_index(*idx[:-1]), idx[-1]),
                         assume_injective_transform=True)
    slot, *middle, sd = sch.get_loops(stage)[1:]
    tx, chunk, v = sch.split(sd, [lanes, None, vec])
    sch.reorder(slot, tx, chunk, *middle, v)
    sch.bind(slot, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    for loop in (chunk, *middle):
        sch.unroll(loop)
    # Output: rows over threadIdx.y, head_dim vectors over threadIdx.x, the slot sum and the
    # division by the row sum at each output vector. (Rows and head_dim not fused: compute_at then
    # makes (row, head_dim) bindings that TVM 0.27 does not take for affine.)
    _, row, dd = sch.get_loops(out)
    row_step, ty = sch.split(row, [None, slots])
    d_step, tx, v = sch.split(dd, [None, lanes, vec])
    sch.reorder(row_step, d_step, ty, tx, v)
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    sch.compute_at(pv, tx, preserve_unit_loops=True)
    slot_sum, *_, pv_vec = sch.get_loops(pv)[len(sch.get_loops(out)) - 1:]
    sch.vectorize(pv_vec)

    # Inits last, P*V partials first: in TVM 0.27 decomposing a reduction under the merged loop
    # marks the predicated rf blocks beside it non-affine, after which they no longer decompose.
    sch.decompose_reduction(pv_rf, pv_step)
    sch.decompose_reduction(pv, slot_sum)
    sch.decompose_reduction(score_rf, rf_chunk)


def cuda_append(sch, knobs):
    """The cache copy as a kernel of its own: a thread per vector (16 bytes in float32) of a
    cache row: vector loads of both caches, the new row's elements selected one by one, vector
    stores. Its own kernel because the attention reads the copied rows back, and TVM puts no
    barrier between a block's global writes and other threads' reads."""
    append = sch.get_sblock("append")
    b, h, t, d = sch.get_loops(append)
    vec = _decode_vector(sch.get(append).writes[0].source.dtype, int(sch.get(d).extent))
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
              helper.make_node("Transpose", ["k_seen"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qg", "kt"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["ss"]),
              helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v_seen"], ["og"]),
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
    templates=[kv_head, cuda_kv_head],
    num_outputs=3,
)
