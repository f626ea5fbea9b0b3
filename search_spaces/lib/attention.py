"""Attention building blocks shared by the attention patterns: the unfused softmax stages in
TensorIR (``softmax_stages``), the lane counts and vector splits of their CUDA kernels, a
read-region annotation for staged K/V windows, and ``cuda_decode_attention``, the decode kernel (a
thread block per (batch, K/V head)) that gqa_decode_attention and paged_attention schedule onto
those stages; the shape parameters, and for attention over (batch, heads, seq, head_dim) tensors
with grouped K/V heads and an optional causal mask its reference, inputs, ONNX graph and torch-sdpa
baseline."""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.pattern import ShapeParam, onnx_model
from search_spaces.lib.cpu_rows import lanes_innermost
from search_spaces.lib.cuda_rows import VECTOR_BYTES
from search_spaces.lib.onnx_graphs import attention_nodes, kv_repeat_constants, repeat_kv_heads
from search_spaces.lib.tiling import vectorize_inner
from search_spaces.lib.tir_math import dtype_bytes, exp_f32

# Shape parameters of the attention patterns (``with_sizes`` sizes one for a pattern).
BATCH = ShapeParam("batch", 1, 1, "batch size")
HEADS = ShapeParam("heads", 8, 2, "attention heads")
HEAD_DIM = ShapeParam("head_dim", 64, 8, "per-head feature size")
MAX_SEQ = ShapeParam("max_seq", 1024, 16, "cache capacity (positions)")


def gqa_heads(heads, kv_heads, prefix=""):
    """Grouped-query head counts ``{prefix}heads`` and ``{prefix}kv_heads``, (default, small) each:
    query heads, and K/V heads each serving heads / kv_heads of them."""
    return [ShapeParam(f"{prefix}heads", *heads, "query heads"),
            ShapeParam(f"{prefix}kv_heads", *kv_heads, f"key/value heads (divides {prefix}heads; 1 is MQA)")]


def attention_reference(q, k, v, shape=None):
    """softmax(q k^T / sqrt(head_dim) [+ causal mask]) v in float64, for q (batch, heads, seq_q,
    head_dim) and k, v (batch, kv_heads, seq_kv, head_dim); causal when ``shape["causal"]``, the
    mask aligned at the end (key j visible to query i iff j <= i + seq_kv - seq_q)."""
    causal = int((shape or {}).get("causal", 0))
    qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
    # Grouped-query: K/V head g serves query heads g * group .. (g + 1) * group - 1.
    group = q.shape[1] // k.shape[1]
    kf, vf = (np.repeat(x, group, axis=1) for x in (kf, vf))
    sq, skv, d = q.shape[2], k.shape[2], q.shape[3]
    s = qf @ np.swapaxes(kf, -1, -2) / math.sqrt(d)
    if causal:
        i = np.arange(sq)[:, None]
        j = np.arange(skv)[None, :]
        s = np.where(j <= i + (skv - sq), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=-1, keepdims=True) @ vf).astype(q.dtype)


def attention_inputs(shape, dtype, seed):
    """Seeded q (batch, heads, seq_q, head_dim), k and v (batch, kv_heads, seq_kv, head_dim;
    kv_heads = heads where the shape has none)."""
    rng = np.random.default_rng(seed)
    b, h, sq, skv, d = (shape[k] for k in ("batch", "heads", "seq_q", "seq_kv", "head_dim"))
    kvh = shape.get("kv_heads", h)
    # Unit-normal q and k: scores q.k/sqrt(d) are about unit-normal, a softmax neither flat nor one-hot.
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((b, h, sq, d)), rng.standard_normal((b, kvh, skv, d)),
              rng.standard_normal((b, kvh, skv, d))]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def attention_graph(name, shape, dtype, out="o"):
    """The ONNX model ``name`` of ``attention_reference`` as exporters write it: MatMul(q,
    Transpose(k)) * scale [+ constant 0/-1e9 causal mask], Softmax, MatMul with v, the score matrix
    materialised. With kv_heads < heads, K and V are first repeated to every query head of their
    group (``repeat_kv_heads``)."""
    b, h, sq, skv, d = (shape[k] for k in ("batch", "heads", "seq_q", "seq_kv", "head_dim"))
    kvh = shape.get("kv_heads", h)
    consts = {"scale": np.array(1.0 / math.sqrt(d), dtype=dtype)}
    nodes = []
    k_in, v_in = "k", "v"
    if kvh != h:
        consts.update(kv_repeat_constants(b, kvh, h, skv, d))
        nodes += repeat_kv_heads("k", "k") + repeat_kv_heads("v", "v")
        k_in, v_in = "k_heads", "v_heads"
    mask = None
    if int(shape.get("causal", 0)):
        i = np.arange(sq)[:, None]
        j = np.arange(skv)[None, :]
        # -1e9 rather than -inf: exp underflows to exactly 0 either way, and a finite mask is what
        # exporters emit.
        consts["mask"] = np.where(j <= i + (skv - sq), 0.0, -1e9).astype(dtype)
        mask = "mask"
    nodes += attention_nodes("q", k_in, v_in, out, mask)
    return onnx_model(name, nodes, [("q", (b, h, sq, d)), ("k", (b, kvh, skv, d)), ("v", (b, kvh, skv, d))],
                      [(out, (b, h, sq, d))], dtype, consts)


def sdpa(torch, shape, q, k, v):
    """The torch-sdpa baseline of softmax(q k^T / sqrt(head_dim) [+ causal mask]) v: torch's
    scaled_dot_product_attention on the same tensors, causal when ``shape["causal"]`` (the mask
    aligned at the end, as the patterns align it), grouped-query when kv_heads < heads."""
    mask, causal = None, bool(shape.get("causal", 0))
    if causal and shape["seq_q"] != shape["seq_kv"]:  # ours aligns the mask at the end, is_causal at the start
        from torch.nn.attention.bias import causal_lower_right
        mask, causal = causal_lower_right(shape["seq_q"], shape["seq_kv"]), False
    return [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=shape.get("kv_heads", shape["heads"]) != shape["heads"])]


CUDA_LOAD_LANES = 4     # elements per thread and instruction in the K/V tile loads


def row_lanes(n):
    """Threads (or partials) per row sharing a reduction over ``n``: the widest of 16, 8, 4, 2, 1
    dividing it."""
    return next(w for w in (16, 8, 4, 2, 1) if n % w == 0)


def load_lanes(n):
    """Elements per thread in a tile load along a row of ``n``: a vector aligned at every row start."""
    return next(v for v in (CUDA_LOAD_LANES, 2, 1) if n % v == 0)


def vector_split(sch, loop, width):
    """``loop`` (a per-thread run of consecutive elements) as unrolled vectors of ``width``."""
    extent = int(sch.get(loop).extent)
    vec = 4 if extent % 4 == 0 else 2 if extent % 2 == 0 else 1
    outer, inner = sch.split(loop, [None, min(vec, width)])
    sch.unroll(outer)
    sch.vectorize(inner)


def annotate_read(sch, block, index, region):
    """``sch.annotate_buffer_access`` of read ``index`` as ``region(*iterators)``, a (begin, end)
    per buffer dimension. TVM 0.27's Python wrapper wants one range per block iterator, so it
    refuses a buffer of another rank; the schedule instruction itself does not."""
    from tvm.s_tir.schedule import _ffi_api
    from tvm.tirx.function import IndexMap

    iters = [iv.var for iv in sch.get(block).iter_vars]
    bounds = [x for rng in region(*iters) for x in rng]
    _ffi_api.ScheduleAnnotateBufferAccess(sch, block, index, 0, IndexMap(iters, bounds, None))


# ---- CUDA decode: a thread block per (batch, K/V head) ------------------------------------------
#
# The six stages (q.k, row max, exp, row sum, P*V, normalise) over (query rows, keys), scheduled by
# ``cuda_decode_attention`` given the stage names and a function that brings each stage's loop nest
# into the form (head, row, ...).

DECODE_LANES = (1, 2, 4, 8, 16, 32)     # threads sharing one key row's head_dim (threadIdx.x)
DECODE_SLOTS = (1, 2, 4, 8, 16, 32)     # key rows in flight per block (threadIdx.y)
DECODE_UNROLL = (1, 2, 4)               # key rows per thread and step: loads in flight
DECODE_THREADS = 256                    # default threads per attention block
KEY_PAD = max(DECODE_SLOTS) * max(DECODE_UNROLL)   # score rows padded to this many keys
DECODE_SLACK = 1024                     # shared bytes left to the cross-warp reductions


class DecodeShapeError(AutofuseError, ValueError):
    """Score rows too long for a thread block's shared memory."""


def decode_vector(dtype, head_dim):
    """Elements per vector access along head_dim: at most 16 bytes and 4 elements (the float32
    partial sums are vectors of as many elements, and TVM 0.27's CUDA codegen has no 8-lane
    float32 vectors)."""
    lanes = min(4, max(1, VECTOR_BYTES // dtype_bytes(dtype)))
    while head_dim % lanes:
        lanes //= 2
    return lanes


def pad_keys(sch, block):
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
    vec = decode_vector(dtype, d)

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
    pad_keys(sch, scores)

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


# ---- TensorIR: the unfused softmax-attention stages ---------------------------------------------

SOFTMAX_STAGES = ("scores", "row_max", "exp", "row_sum", "pv", "normalise")


def softmax_stages():
    """A fresh ``T.macro`` writing the six stages of attention over whole score rows: q.k scores,
    row max, exp((s - max) * scale), row sum, P.V and the division by the sum once per output.

    Called in a prim_func as ``stages(q_at, k_at, v_at, out, out_at, dims, scale, names=
    SOFTMAX_STAGES, visible=None)``, ``dims`` = (a, b, rows, keys, head_dim): it allocates the
    float32 scores and probabilities (a, b, rows, keys), row statistics (a, b, rows) and the P.V
    accumulator (a, b, rows, head_dim). ``q_at(a, b, row, d)``, ``k_at(a, b, row, key, d)`` and
    ``v_at`` (alike) load the operands, ``out_at(a, b, row, d)`` gives the output's indices;
    ``visible(a, b, row, key)``, when given, masks keys out of the max and the probabilities. Fresh
    per prim_func: a macro renames its blocks from its second call on, and templates find the
    stages by name."""

    @T.macro
    def stages(q_at, k_at, v_at, out, out_at, dims, scale, names=SOFTMAX_STAGES, visible=None):
        s = T.sblock_alloc_buffer(dims[:4], "float32")
        row_max = T.sblock_alloc_buffer(dims[:3], "float32")
        p = T.sblock_alloc_buffer(dims[:4], "float32")
        row_sum = T.sblock_alloc_buffer(dims[:3], "float32")
        acc = T.sblock_alloc_buffer((*dims[:3], dims[4]), "float32")
        for b, h, i, j, d in T.grid(*dims):
            with T.sblock(names[0]):
                vb, vh, vi, vj, vd = T.axis.remap("SSSSR", [b, h, i, j, d])
                with T.init():
                    s[vb, vh, vi, vj] = T.float32(0)
                s[vb, vh, vi, vj] = s[vb, vh, vi, vj] + (T.Cast("float32", q_at(vb, vh, vi, vd))
                                                         * T.Cast("float32", k_at(vb, vh, vi, vj, vd)))
        for b, h, i, j in T.grid(*dims[:4]):
            with T.sblock(names[1]):
                vb, vh, vi, vj = T.axis.remap("SSSR", [b, h, i, j])
                with T.init():
                    row_max[vb, vh, vi] = T.min_value("float32")
                if visible is None:
                    row_max[vb, vh, vi] = T.max(row_max[vb, vh, vi], s[vb, vh, vi, vj])
                else:
                    row_max[vb, vh, vi] = T.max(row_max[vb, vh, vi], T.Select(
                        visible(vb, vh, vi, vj), s[vb, vh, vi, vj], T.min_value("float32")))
        for b, h, i, j in T.grid(*dims[:4]):
            with T.sblock(names[2]):
                vb, vh, vi, vj = T.axis.remap("SSSS", [b, h, i, j])
                if visible is None:
                    p[vb, vh, vi, vj] = exp_f32((s[vb, vh, vi, vj] - row_max[vb, vh, vi]) * T.float32(scale))
                else:
                    # A Select, so a masked key adds exactly nothing however large its stale score.
                    p[vb, vh, vi, vj] = T.Select(
                        visible(vb, vh, vi, vj),
                        exp_f32((s[vb, vh, vi, vj] - row_max[vb, vh, vi]) * T.float32(scale)), T.float32(0))
        for b, h, i, j in T.grid(*dims[:4]):
            with T.sblock(names[3]):
                vb, vh, vi, vj = T.axis.remap("SSSR", [b, h, i, j])
                with T.init():
                    row_sum[vb, vh, vi] = T.float32(0)
                row_sum[vb, vh, vi] = row_sum[vb, vh, vi] + p[vb, vh, vi, vj]
        for b, h, i, d, j in T.grid(*dims[:3], dims[4], dims[3]):
            with T.sblock(names[4]):
                vb, vh, vi, vd, vj = T.axis.remap("SSSSR", [b, h, i, d, j])
                with T.init():
                    acc[vb, vh, vi, vd] = T.float32(0)
                acc[vb, vh, vi, vd] = acc[vb, vh, vi, vd] + p[vb, vh, vi, vj] * T.Cast(
                    "float32", v_at(vb, vh, vi, vj, vd))
        for b, h, i, d in T.grid(*dims[:3], dims[4]):
            with T.sblock(names[5]):
                vb, vh, vi, vd = T.axis.remap("SSSS", [b, h, i, d])
                T.buffer_store(out, T.Cast(out.dtype, acc[vb, vh, vi, vd] / row_sum[vb, vh, vi]),
                               out_at(vb, vh, vi, vd))

    return stages


def cpu_softmax_tail(sch, knobs, rfs, exp, pv):
    """The end of a CPU softmax-attention schedule whose stages sit at a tile loop (rfactored max and
    sum partials ``rfs`` under (lanes, batch, head, row, outer key) loops): the partials' lanes
    vectorised innermost, the exponentials vectorised along keys, P.V tiled (``cpu_pv_tile``)."""
    for rf in rfs:
        lanes, _, _, row, outer = sch.get_loops(rf)[-5:]
        lanes_innermost(sch, rf, lanes, (row, outer))
    vectorize_inner(sch, knobs, sch.get_loops(exp)[-1], max_lanes=32)
    cpu_pv_tile(sch, knobs, pv)


def cpu_pv_tile(sch, knobs, pv, lanes=16):
    """P.V on a CPU, a (row, head_dim, key) nest: head_dim in vectors of ``lanes``, the key loop
    outside the rows so each vector of V serves every row of the tile, the init split out."""
    i, d, j = sch.get_loops(pv)[-3:]
    d0, d1 = sch.split(d, knobs.tile(d, 2, [lanes], max_innermost_factor=64))
    sch.reorder(d0, j, i, d1)
    sch.vectorize(d1)
    sch.decompose_reduction(pv, j)
