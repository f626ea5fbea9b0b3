"""Attention building blocks shared by the attention patterns: the unfused softmax stages in
TensorIR (``softmax_stages``), the lane counts and vector splits of their CUDA kernels, a
read-region annotation for staged K/V windows, and ``cuda_decode_attention``, the decode kernel (a
thread block per (batch, K/V head)) that gqa_decode_attention and paged_attention schedule onto
those stages; the shape parameters, and for attention over (batch, heads, seq, head_dim) tensors
with grouped K/V heads and an optional causal mask its reference, inputs, ONNX graph and torch-sdpa
baseline; and the online-softmax kernel over key tiles (``flash_attention_func``, optionally with an
additive mask input) with its templates ``flash_tiles`` and ``cuda_flash``, which flash_attention
and masked_attention share; and for Relax rules, a K/V head repeat recognised through the layout
ops above an operand (``layout_chain``, ``unrepeated_heads``)."""

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.pattern import ShapeParam, onnx_model, template
from search_spaces.lib.cpu_rows import lanes_innermost
from search_spaces.lib.cpu_rules import PARALLEL_MIN_ELEMENTS
from search_spaces.lib.cuda_rows import VECTOR_BYTES
from search_spaces.lib.onnx_graphs import attention_nodes, hidden_score, kv_repeat_constants, repeat_kv_heads
from search_spaces.lib.tiling import unroll, vectorize_inner
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
    Transpose(k)) * scale [+ constant 0/-1e9 (float16: -65504) causal mask], Softmax, MatMul with v, the score matrix
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
        consts["mask"] = np.where(j <= i + (skv - sq), 0.0, hidden_score(dtype)).astype(dtype)
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


_FLT_MIN = 1.1754943508222875e-38  # the smallest normal float32
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


# ---- Online-softmax attention over key tiles (flash_attention, masked_attention) ----------------
#
# The TensorIR and its templates: ``flash_attention_func`` builds the kernel (see flash_attention's
# docstring for how the recurrence fits TensorIR), with an optional additive mask input;
# ``flash_tiles`` (CPU) and ``cuda_flash`` schedule it, with or without the mask.

KV_TILE = 64


def _symbolic(n):
    """Whether a shape value is a TIR expression (a length only known at run time), not a number."""
    return not isinstance(n, (int, np.integer))


def kv_tile(seq_kv):
    """The key tile ``build`` uses for this seq_kv (KV_TILE for a symbolic one: a symbolic seq_kv
    gets whole KV_TILE tiles, the last one padded, so that the tile stays a constant loop extent
    that templates split and vectorise; only the tile count is symbolic)."""
    return KV_TILE if _symbolic(seq_kv) else min(KV_TILE, seq_kv)


def flash_attention_func(shape, dtype, symbol="flash_attention", mask_rows=None):
    """flash_attention's online-softmax PrimFunc (see its docstring), global symbol ``symbol``,
    over q (batch, heads, seq_q, head_dim) and k, v (batch, kv_heads, seq_kv, head_dim).

    ``mask_rows`` (1 or seq_q) adds an input ``mask`` (batch, 1, mask_rows, seq_kv) of the dtype
    between v and o, added to the scaled scores (broadcast over heads, and over query rows when 1)
    before the max and the exponentials, as exporters write attention masks; None: no mask, the
    function flash_attention's records were tuned on, unchanged."""
    b_, h_, kvh, sq, skv, d_ = (shape[k] for k in
                                ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    if mask_rows not in (None, 1, sq):
        raise ValueError(f"mask_rows must be 1 or seq_q={sq}, not {mask_rows}")
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

    def score(mask, b, i, j, value):
        # The additive mask of row i (its only row when broadcast over rows) at key j.
        if mask is None:
            return value
        return value + T.Cast(f32, mask[b, 0, 0 if mask_rows == 1 else i, key(j)])

    def prob(mask, value, row_max):
        # With a mask, a key masked by -inf (torch's SDPA export of a boolean mask) adds exactly
        # nothing: exp_f32 clamps, and a row of such keys would otherwise average V.
        e = exp_f32(value - row_max)
        return e if mask is None else T.Select(value >= neg, e, T.float32(0))

    def normalise(mask, total, count):
        # A row whose every score is -inf has count 0 and total 0: 0 out, what the exports'
        # IsNaN/Where guard makes of the softmax's NaN (finfo.min masks keep their scores finite and
        # never get here); any other row has count >= 1. A max, not a Select: TVM's CUDA codegen
        # types a vectorised Select's condition as ushort4 in a float4 (NVRTC rejects it).
        return total / count if mask is None else total / T.max(count, T.float32(_FLT_MIN))

    # One body for both signatures (with and without the mask), spliced into each.
    @T.macro
    def body(q, k, v, mask, o):
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
                        vi, vt * kt + vc * lanes + vl,
                        score(mask, vb, vi, vt * kt + vc * lanes + vl, s[vb, vh, vi, vc * lanes + vl]), neg))
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
                    p[vb, vh, vi, vc] = masked(vi, vt * kt + vc, prob(
                        mask, score(mask, vb, vi, vt * kt + vc, s[vb, vh, vi, vc]), m[vb, vh, vi]), T.float32(0))
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
                    o[vb, vh, vi, vd] = T.Cast(dtype, normalise(mask, acc[vb, vh, vi, vd], l[vb, vh, vi]))

    if mask_rows is None:
        @T.prim_func(s_tir=True)
        def flash_attention(q: T.Buffer((B, H, SQ, D), dtype), k: T.Buffer((B, KVH, SKV, D), dtype),
                            v: T.Buffer((B, KVH, SKV, D), dtype), o: T.Buffer((B, H, SQ, D), dtype)):
            T.func_attr({"global_symbol": symbol, "tirx.noalias": True})
            body(q, k, v, None, o)

        return flash_attention

    MR = ext(mask_rows)

    @T.prim_func(s_tir=True)
    def masked_attention(q: T.Buffer((B, H, SQ, D), dtype), k: T.Buffer((B, KVH, SKV, D), dtype),
                         v: T.Buffer((B, KVH, SKV, D), dtype), mask: T.Buffer((B, 1, MR, SKV), dtype),
                         o: T.Buffer((B, H, SQ, D), dtype)):
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True})
        body(q, k, v, mask, o)

    return masked_attention


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
    # Below PARALLEL_MIN_ELEMENTS score multiply-adds (a small model's attention: BERT-tiny at 32
    # tokens ran 22.6 us in parallel, 10.3 us on one thread) waking the thread pool costs more than
    # it saves. A shape fact, not a knob; a symbolic length counts as large.
    work = 1
    for iv in sch.get(qk).iter_vars:
        work = work * iv.dom.extent
    threads = not isinstance(work, tirx.IntImm) or int(work) >= PARALLEL_MIN_ELEMENTS
    if threads:
        sch.parallel(outer)
    # K scaled and transposed once per call, its own parallel nest (not per query tile: that
    # costs a strided gather of the whole K per query tile, as much as the score products
    # themselves at 8-32 rows a tile). Left scalar: LLVM took 80 s to compile the 64-lane
    # strided gather, and the pass is 1/seq_q of the work.
    kts = sch.get_sblock("k_scaled_t")
    kb, kh, kd, kj = sch.get_loops(kts)
    k_rows = sch.fuse(kb, kh, kd)
    if threads:
        sch.parallel(k_rows)

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


# ---- Relax: K/V heads repeated for grouped-query attention --------------------------------------
#
# Exporters repeat each K/V head for its query group before the attention (ONNX Unsqueeze, Expand,
# Reshape: expand_dims, broadcast_to, reshape in Relax), then often transpose or reshape the result
# again. ``layout_chain`` matches a
# run of such data-movement ops above an operand; ``unrepeated_heads`` finds the tensor under them
# that a kernel indexing K/V head h // group can read instead, the repeat proved by running the chain
# on an array of element indices (any other order or broadcast fails the comparison).

LAYOUT_OPS = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.permute_dims", "relax.broadcast_to",
              "relax.tile", "relax.repeat")
LAYOUT_DEPTH = 6    # Llama's dynamo export has 5 between K^T and K, its TorchScript export 4


def layout_chain(named, name, depth=LAYOUT_DEPTH):
    """A ``tvm.relax.dpl`` pattern: up to ``depth`` LAYOUT_OPS calls over any expression, as many as
    the graph has. Each level is named in ``named`` for ``layout_calls`` and ``chain_top``:
    ``{name}.{level}.{op}`` a call, ``{name}.{level}`` the expression where the chain ends."""
    from tvm.relax.dpl import is_op, wildcard

    below = named[f"{name}.{depth}"] = wildcard()
    for level in reversed(range(depth)):
        # The calls before the wildcard: alternatives are tried left to right, and it takes anything.
        level_pattern = named[f"{name}.{level}"] = wildcard()
        for op in reversed(LAYOUT_OPS):
            named[f"{name}.{level}.{op}"] = call = is_op(op)(below, varg_default_wildcard=True)
            level_pattern = call | level_pattern
        below = level_pattern
    return below


def layout_calls(matched, name, depth=LAYOUT_DEPTH):
    """The calls ``layout_chain(named, name)`` matched, outermost first."""
    calls = []
    for level in range(depth):
        call = next((matched[key] for key in (f"{name}.{level}.{op}" for op in LAYOUT_OPS) if key in matched), None)
        if call is None:
            break
        calls.append(call)
    return calls


def chain_top(matched, name, depth=LAYOUT_DEPTH):
    """The expression ``layout_chain(named, name)`` matched."""
    calls = layout_calls(matched, name, depth)
    return calls[0] if calls else matched[f"{name}.0"]


def _apply_layout(call, x):
    """numpy's version of a LAYOUT_OPS ``call`` on ``x``, or None where the shapes disagree."""
    from autofuse.pattern import static_shape

    out = static_shape(call)
    if out is None:
        return None
    op, attrs = call.op.name, call.attrs
    if op in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
        # The same elements in row-major order.
        y = x.reshape(out) if x.size == math.prod(out) else None
    elif op == "relax.permute_dims":
        y = np.transpose(x, None if attrs.axes is None else [int(a) for a in attrs.axes])
    elif op == "relax.broadcast_to":
        try:
            y = np.broadcast_to(x, out)
        except ValueError:
            return None
    elif op == "relax.tile":
        y = np.tile(x, [int(r) for r in attrs.repeats])
    else:
        y = np.repeat(x, int(attrs.repeats), axis=None if attrs.axis is None else int(attrs.axis))
    return y if y is not None and y.shape == out else None


def unrepeated_heads(calls, batch, heads, seq, head_dim, transposed=False):
    """``(source, kv_heads)``: the nearest tensor under ``calls`` (``layout_calls`` above K or V) of
    shape (batch, kv_heads, seq, head_dim), kv_heads < heads, from which the calls make the operand
    with K/V head h // group at query head h (group = heads // kv_heads), as the attention
    kernels index it; ``transposed``: the operand is K^T, (batch, heads, head_dim, seq). None where
    no tensor is one."""
    from autofuse.pattern import static_shape

    for depth, call in enumerate(calls):
        source = call.args[0]
        shape = static_shape(source)
        if shape is None or len(shape) != 4:
            continue
        b, kv_heads, s, d = shape
        if (b, s, d) != (batch, seq, head_dim) or kv_heads >= heads or heads % kv_heads:
            continue
        index = np.arange(math.prod(shape)).reshape(shape)
        out = index
        for step in reversed(calls[:depth + 1]):
            out = _apply_layout(step, out)
            if out is None:
                break
        want = np.repeat(index, heads // kv_heads, axis=1)
        if out is not None and np.array_equal(out, want.swapaxes(2, 3) if transposed else want):
            return source, kv_heads
    return None
