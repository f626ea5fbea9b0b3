"""paged_attention: attention over a KV cache in fixed-size pages addressed through a block table
(vLLM's layout), for decode (``q_len`` = 1) and chunked prefill (``q_len`` > 1, causal).

Key position j of sequence b lives at ``k_pages[block_table[b, j // page_size], kv_head,
j % page_size]``; ``block_table`` and ``seq_lens`` are int32 inputs, so K and V are gathered through
the table inside the kernel. Query t sits at position seq_lens[b] - q_len + t and sees the keys up
to its own; GQA: head h reads kv head h // (num_heads // num_kv_heads). The stages run per (batch,
token, head) row over the maximum context, masked past the row's last visible key by a ``Select``
(a stale score adds nothing). Unfused, scores and probabilities round-trip through memory and K/V
are first materialised gathered; fused, a row's scratch stays on chip and K/V are read straight from
their pages. CUDA: ``lib.attention.cuda_decode_attention`` with a K/V head's query heads x tokens
as its rows; for decode and chunks of up to ``SPLIT_KV_MAX_Q`` tokens on an sm_90 GPU in
float16/bfloat16 first ``cuda_split_kv``, flash-decoding (``lib.cuda_attention.decode_attention``)
reading the pages through the block table; longer chunks ``cuda_wgmma_prefill``, the tensor-core
prefill (``lib.cuda_attention.prefill_attention``) loading whole pages into its key tiles.
"""

import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, template
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import HEAD_DIM, cuda_decode_attention, gqa_heads, softmax_stages
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.cpu_rows import lanes_innermost, rfactor_lanes
from search_spaces.lib.tiling import unroll, vectorize_inner
from search_spaces.lib.tirx_sequence import buffer, sequence, workspace

PAGED_STAGES = ("qk", "row_max", "probs", "exp_sum", "pv", "out")


def _dims(shape):
    b, q, h, kvh = shape["batch"], shape["q_len"], shape["num_heads"], shape["num_kv_heads"]
    d, ps, mp, npg = shape["head_dim"], shape["page_size"], shape["max_pages"], shape["num_pages"]
    if h % kvh:
        raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({kvh})")
    if q > mp * ps:
        raise ValueError(f"q_len ({q}) cannot exceed the maximum context max_pages*page_size ({mp * ps})")
    return b, q, h, kvh, d, ps, mp, npg


def build(shape, dtype):
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    C = MP * PS
    G = H // KVH
    scale = 1.0 / math.sqrt(D)
    stages = softmax_stages()

    @T.prim_func(s_tir=True)
    def paged_attention(q: T.Buffer((B, Q, H, D), dtype), k_pages: T.Buffer((NP, KVH, PS, D), dtype),
                        v_pages: T.Buffer((NP, KVH, PS, D), dtype), block_table: T.Buffer((B, MP), "int32"),
                        seq_lens: T.Buffer((B,), "int32"), o: T.Buffer((B, Q, H, D), dtype)):
        T.func_attr({"global_symbol": "paged_attention", "tirx.noalias": True})
        # Key j is visible to query t when j <= seq_lens[b] - Q + t (causal, and inside the sequence).
        stages(lambda b, t, h, d: q[b, t, h, d],
               lambda b, t, h, j, d: k_pages[block_table[b, j // PS], h // G, j % PS, d],
               lambda b, t, h, j, d: v_pages[block_table[b, j // PS], h // G, j % PS, d],
               o, lambda b, t, h, d: [b, t, h, d], (B, Q, H, C, D), scale, PAGED_STAGES,
               lambda b, t, h, j: j + (Q - t) <= seq_lens[b])

    return paged_attention


def gather_cache(pages, block_table):
    """(batch, kv_heads, max_pages*page_size, head_dim): each sequence's pages in logical order."""
    b, mp = block_table.shape
    _, kvh, ps, d = pages.shape
    return pages[block_table].transpose(0, 2, 1, 3, 4).reshape(b, kvh, mp * ps, d)


def reference(q, k_pages, v_pages, block_table, seq_lens):
    b, ql, h, d = q.shape
    kvh = k_pages.shape[1]
    k = np.repeat(gather_cache(k_pages, block_table).astype(np.float64), h // kvh, axis=1)
    v = np.repeat(gather_cache(v_pages, block_table).astype(np.float64), h // kvh, axis=1)
    s = np.einsum("bthd,bhjd->bthj", q.astype(np.float64), k) / math.sqrt(d)
    pos = np.arange(k.shape[2])
    last = seq_lens.astype(np.int64)[:, None] - ql + np.arange(ql)[None, :]       # (b, t)
    visible = pos[None, None, :] <= last[:, :, None]                                 # (b, t, j)
    s = np.where(visible[:, :, None, :], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bthj,bhjd->bthd", p, v).astype(q.dtype)


def _draw_seq_lens(rng, shape):
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    return rng.integers(Q, MP * PS + 1, size=B).astype("int32")


def seeded_seq_lens(shape, seed=0):
    """The sequence lengths ``make_inputs(shape, dtype, seed)`` draws first: uniform in [q_len, max
    context]. At seed 0, compare's inputs, they also count the work (``flops``, ``nbytes``)."""
    return _draw_seq_lens(np.random.default_rng(seed), shape)


def make_inputs(shape, dtype, seed):
    """Sequences of different seeded lengths in [q_len, max context]; each sequence's pages are
    taken from a seeded permutation of the pool, so they are scattered; block-table entries past a
    sequence's last page point at random pages (other sequences' data), which must stay masked."""
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    if NP < B * MP:
        raise ValueError(f"num_pages ({NP}) must hold batch*max_pages ({B * MP}) pages")
    rng = np.random.default_rng(seed)
    seq_lens = _draw_seq_lens(rng, shape)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    q, k_pages, v_pages = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                           for s in ((B, Q, H, D), (NP, KVH, PS, D), (NP, KVH, PS, D)))
    block_table = rng.integers(0, NP, size=(B, MP)).astype("int32")
    perm = rng.permutation(NP).astype("int32")
    used = 0
    for b in range(B):
        n = -(-int(seq_lens[b]) // PS)
        block_table[b, :n] = perm[used:used + n]
        used += n
    return [q, k_pages, v_pages, block_table, seq_lens]


def flops(shape):
    # The useful work at compare's inputs (seed 0): query t of a sequence of length L sees
    # L - q_len + t + 1 keys; per (query, key) pair q.k and p.v (2 flops per MAC each) and ~5 for
    # the scale/max/exp/sum, as flash_attention counts.
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    pairs = sum(Q * (int(n) - Q) + Q * (Q + 1) // 2 for n in seeded_seq_lens(shape))
    return H * pairs * (4.0 * D + 5.0)


def nbytes(shape, dtype):
    # q and the output once, the block table and lengths once, and the K/V pages holding each
    # sequence's keys at compare's inputs (seed 0) once: no kernel needs the rest of the pool.
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    pages = sum(-(-int(n) // PS) for n in seeded_seq_lens(shape))
    item = np.dtype(dtype).itemsize
    return item * (2 * B * Q * H * D + 2 * pages * KVH * PS * D) + 4 * (B * MP + B)


def _graph_more_work(shape):
    """Why the ONNX graph does more work than needed at compare's inputs, or None."""
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    lens = seeded_seq_lens(shape)
    if lens.min() == MP * PS:
        return None
    return (f"the graph gathers every block-table entry's page (a copy of {MP * PS} keys a sequence) and "
            f"attends over all of them, masked; the sequences hold {lens.min()} to {lens.max()} keys "
            "(the GPU kernels read only those pages; the row kernels mask the whole table too)")


@template("row_parallel")
def row_parallel(sch, target, knobs):
    """(batch, query, head) rows in parallel with all six stages at the row; q.k vectorised along
    head_dim, the max, exponentials and sum along the key axis, P*V along head_dim."""
    out, pv, probs = (sch.get_sblock(name) for name in ("out", "pv", "probs"))
    # The q.k partials are laid out (row, key, lane) so each key's lane vector is contiguous; the
    # max/sum partials are one short lane vector per row.
    qk_rf, qk_fin = rfactor_lanes(sch, knobs, "qk", 8, factor_axis=4, max_lanes=32)
    max_rf, max_fin = rfactor_lanes(sch, knobs, "row_max", 16, factor_axis=0, max_lanes=32)
    sum_rf, sum_fin = rfactor_lanes(sch, knobs, "exp_sum", 16, factor_axis=0, max_lanes=32)

    b, t, h, d = sch.get_loops(out)
    # One fused row loop, not split further: an inner row tile that does not divide num_heads
    # leaves the blocks under it with non-affine (b, t, h) bindings, which vectorize rejects.
    row = sch.fuse(b, t, h)
    sch.parallel(row)
    sch.vectorize(d)
    # Consumers first: each block joins the row loop after everything reading it already has.
    for blk in (pv, sum_fin, sum_rf, probs, max_fin, max_rf, qk_fin, qk_rf):
        sch.compute_at(blk, row, preserve_unit_loops=True)

    # P*V: the key loop outside, head_dim inside and vectorised, so one probability scales a
    # contiguous row of the V page.
    pv_loops = sch.get_loops(pv)
    pd, pj = pv_loops[-2], pv_loops[-1]
    sch.reorder(pj, pd)
    pd0, pd1 = sch.split(pd, knobs.tile(pd, 2, [64], max_innermost_factor=64))
    sch.reorder(pd0, pj, pd1)
    sch.vectorize(pd1)
    sch.decompose_reduction(pv, pj)

    vectorize_inner(sch, knobs, sch.get_loops(probs)[-1], max_lanes=32)

    # The final q.k block sums each key's lanes: the key loop outside, the lanes inside, so it
    # reads its (key, lane) partials in order.
    fin = sch.get_loops(qk_fin)
    sch.reorder(*fin[2:], fin[1])

    for rf in (qk_rf, max_rf, sum_rf):
        # After compute_at the rf block's loops follow its iter order: lanes, (unit b, t, h),
        # [key for qk], outer reduction.
        _, lanes, *rest = sch.get_loops(rf)
        lanes_innermost(sch, rf, lanes, rest)
    unroll(sch, knobs, row)


@template("cuda_kv_head", target_kinds=("cuda",))
def cuda_kv_head(sch, target, knobs):
    """A thread block per (batch, K/V head): its query heads x query tokens are the rows sharing
    each K/V page row; lanes x slots threads, a slot's lanes split a key row's head_dim (vector
    loads through the block table, each K/V vector used for every row, partial dot products summed
    by shuffles), scores and probabilities in shared memory, block-wide max and sum, P*V partials
    per slot summed through shared memory (``cuda_decode_attention``, shared with
    gqa_decode_attention)."""
    q, k_pages = sch.mod["main"].params[:2]    # (batch, tokens, heads, d), (pages, K/V heads, ...)
    group = int(q.shape[2]) // int(k_pages.shape[1])

    def head_rows(sch, block):
        # (batch, token, head, ...) -> (batch x K/V head, token x group member, ...)
        b, t, h = sch.get_loops(block)[:3]
        kv, g = sch.split(h, [None, group])
        sch.reorder(b, kv, t, g)
        sch.fuse(b, kv)
        sch.fuse(t, g)

    cuda_decode_attention(sch, target, knobs, ("qk", "row_max", "probs", "exp_sum", "pv", "out"),
                          head_rows, lambda b, t, h: (t, h % group))


def onnx_graph(shape, dtype):
    """Gather each sequence's pages through its block table (all max_pages entries: the table and
    seq_lens are inputs, so a static graph, like the kernel, reads every entry and masks past the
    sequence) and lay them out per K/V head; GQA without repeating K/V: q reshaped to (batch,
    kv_heads, group x q_len, head_dim), so one MatMul per K/V head covers its query group; mask from
    seq_lens (a constant position iota compared with each query's last visible position), Softmax,
    MatMul."""
    import onnx
    from onnx import helper, numpy_helper

    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    C, G = MP * PS, H // KVH
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    i32 = onnx.TensorProto.INT32
    consts = {
        "kv_shape": np.array([B, KVH, C, D], np.int64),
        "q_split": np.array([B, Q, KVH, G, D], np.int64),
        "q_rows": np.array([B, KVH, G * Q, D], np.int64),
        "s_split": np.array([B, KVH, G, Q, C], np.int64),
        "s_rows": np.array([B, KVH, G * Q, C], np.int64),
        "o_split": np.array([B, KVH, G, Q, D], np.int64),
        "o_shape": np.array([B, Q, H, D], np.int64),
        "axes_1_2_4": np.array([1, 2, 4], np.int64),
        "lens_shape": np.array([B, 1], np.int64),
        "positions": np.arange(C, dtype=np.int32),                       # (C,)
        "query_offset": (np.arange(Q) - Q).astype(np.int32),             # t - Q, (Q,)
        "scale": np.array(1.0 / math.sqrt(D), dtype),
        "masked": np.array(-np.inf, dtype),               # every row sees a key
    }

    def cache(pages, name):
        return [
            helper.make_node("Gather", [pages, "block_table"], [f"{name}_g"], axis=0),       # (B,MP,KVH,PS,D)
            helper.make_node("Transpose", [f"{name}_g"], [f"{name}_t"], perm=[0, 2, 1, 3, 4]),
            helper.make_node("Reshape", [f"{name}_t", "kv_shape"], [name]),                  # (B,KVH,C,D)
        ]

    nodes = cache("k_pages", "k") + cache("v_pages", "v") + [
        # Query head kv * G + g of token t becomes row g * Q + t of K/V head kv.
        helper.make_node("Reshape", ["q", "q_split"], ["q5"]),                                # (B,Q,KVH,G,D)
        helper.make_node("Transpose", ["q5"], ["qg"], perm=[0, 2, 3, 1, 4]),                  # (B,KVH,G,Q,D)
        helper.make_node("Reshape", ["qg", "q_rows"], ["qr"]),                                # (B,KVH,G*Q,D)
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qr", "kt"], ["s_raw"]),                                  # (B,KVH,G*Q,C)
        helper.make_node("Mul", ["s_raw", "scale"], ["s_rows_scaled"]),
        helper.make_node("Reshape", ["s_rows_scaled", "s_split"], ["s"]),                     # (B,KVH,G,Q,C)
        # last[b, t] = seq_lens[b] - Q + t; key j visible when j <= last, i.e. not last < j.
        helper.make_node("Reshape", ["seq_lens", "lens_shape"], ["lens"]),
        helper.make_node("Add", ["lens", "query_offset"], ["last"]),                          # (B,Q)
        helper.make_node("Unsqueeze", ["last", "axes_1_2_4"], ["last5"]),                     # (B,1,1,Q,1)
        helper.make_node("Less", ["last5", "positions"], ["hidden"]),                         # (B,1,1,Q,C)
        helper.make_node("Where", ["hidden", "masked", "s"], ["s_masked"]),
        helper.make_node("Softmax", ["s_masked"], ["p"], axis=-1),
        helper.make_node("Reshape", ["p", "s_rows"], ["pr"]),                                 # (B,KVH,G*Q,C)
        helper.make_node("MatMul", ["pr", "v"], ["or"]),                                      # (B,KVH,G*Q,D)
        helper.make_node("Reshape", ["or", "o_split"], ["og"]),                               # (B,KVH,G,Q,D)
        helper.make_node("Transpose", ["og"], ["ot"], perm=[0, 3, 1, 2, 4]),                  # (B,Q,KVH,G,D)
        helper.make_node("Reshape", ["ot", "o_shape"], ["o"]),                                # (B,Q,H,D)
    ]
    graph = helper.make_graph(
        nodes, "paged_attention",
        [helper.make_tensor_value_info("q", elem, [B, Q, H, D]),
         helper.make_tensor_value_info("k_pages", elem, [NP, KVH, PS, D]),
         helper.make_tensor_value_info("v_pages", elem, [NP, KVH, PS, D]),
         helper.make_tensor_value_info("block_table", i32, [B, MP]),
         helper.make_tensor_value_info("seq_lens", i32, [B])],
        [helper.make_tensor_value_info("o", elem, [B, Q, H, D])],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="autofuse")
    onnx.checker.check_model(model)
    return model


# query tokens a sequence up to which the split-KV kernel takes a chunk (its rows in registers, the
# K/V reread per set of 8 rows: beyond a few tokens a chunk is a prefill's, tensor cores' work)
SPLIT_KV_MAX_Q = 16


def _decode_shape(shape):
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    if Q > SPLIT_KV_MAX_Q:
        raise cuda_attention.AttentionShapeError(f"q_len={Q}: the split-KV kernel takes chunks of at most "
                                                 f"{SPLIT_KV_MAX_Q} tokens")
    return {"batch": B, "num_heads": H, "num_kv_heads": KVH, "head_dim": D, "max_seq": MP * PS}


def _split_kv_check(shape, dtype, knobs):
    cuda_attention.check_decode(_decode_shape(shape), dtype, knobs, queries=shape["q_len"])


def _split_kv(shape, dtype, knobs):
    """Flash-decoding on Hopper (``lib.cuda_attention``), two kernels in one PrimFunc
    (``lib.tirx_sequence``): the split kernel, a CTA per (key split, K/V head's query group x
    q_len tokens in sets of up to 8 rows, sequence) over its share of the sequence's seq_lens[b]
    keys, each key row read once through the block table per row set (a chunk's token t seeing keys
    up to seq_lens[b] - q_len + t), then the combine; float16/bfloat16, head_dim 64 or 128, q_len
    up to SPLIT_KV_MAX_Q."""
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    decode = _decode_shape(shape)
    split, combine = cuda_attention.decode_attention(decode, dtype, knobs, paged=(PS, MP, NP), queries=Q)
    splits = cuda_attention.check_decode(decode, dtype, knobs, queries=Q)[1]["splits"]
    q, o = buffer("q", (B, Q, H, D), dtype), buffer("o", (B, Q, H, D), dtype)
    k_pages, v_pages = (buffer(name, (NP, KVH, PS, D), dtype) for name in ("k_pages", "v_pages"))
    block_table, seq_lens = buffer("block_table", (B, MP), "int32"), buffer("seq_lens", (B,), "int32")
    part_o = workspace("part_o", (B, H * Q, splits, D), "float32")
    part_ml = workspace("part_ml", (B, H * Q, splits, 2), "float32")
    return sequence("paged_attention", [q, k_pages, v_pages, block_table, seq_lens, o],
                    [(split, [q, k_pages, v_pages, block_table, seq_lens, part_o, part_ml]),
                     (combine, [part_o, part_ml, o])], [part_o, part_ml])


cuda_split_kv = KernelTemplate("cuda_split_kv", _split_kv, cuda_attention.SPLIT_KV_KNOBS,
                               cuda_attention.SPLIT_KV_DEFAULT_KNOBS, _split_kv_check, **HOPPER)


def _prefill_shape(shape):
    """(flash_attention's shape, the page geometry) of a chunk too long for the split-KV kernel."""
    B, Q, H, KVH, D, PS, MP, NP = _dims(shape)
    if Q <= SPLIT_KV_MAX_Q:
        raise cuda_attention.AttentionShapeError(f"q_len={Q}: chunks of up to {SPLIT_KV_MAX_Q} tokens run on "
                                                 "the split-KV kernel")
    return ({"batch": B, "heads": H, "kv_heads": KVH, "seq_q": Q, "seq_kv": MP * PS, "head_dim": D, "causal": 1},
            (PS, MP, NP))


def _wgmma_prefill_check(shape, dtype, knobs):
    prefill, paged = _prefill_shape(shape)
    return cuda_attention.check_prefill(prefill, dtype, knobs, paged)


def _wgmma_prefill(shape, dtype, knobs):
    """FlashAttention on Hopper tensor cores for chunks of more than SPLIT_KV_MAX_Q tokens
    (``lib.cuda_attention.prefill_attention`` paged): TMA copies of whole pages through the block
    table into the key ring, two wgmma consumer warpgroups of 64 query rows of one head, token t
    seeing keys up to seq_lens[b] - q_len + t; float16/bfloat16, head_dim 64 or 128, a page size
    that is a multiple of 8 dividing the key tile or a multiple of it."""
    prefill, paged = _prefill_shape(shape)
    return cuda_attention.prefill_attention(prefill, dtype, knobs, paged)


cuda_wgmma_prefill = KernelTemplate("cuda_wgmma_prefill", _wgmma_prefill, cuda_attention.PREFILL_KNOBS,
                                    cuda_attention.PREFILL_DEFAULT_KNOBS, _wgmma_prefill_check, **HOPPER)


PATTERN = Pattern.from_module(
    globals(),
    description="attention over a block-table paged KV cache (vLLM layout), GQA; q_len=1 is decode, "
                "q_len>1 causal chunked prefill",
    shape_params=[ShapeParam("batch", 4, 2, "sequences"),
                  ShapeParam("q_len", 1, 3, "query tokens per sequence, its last ones (1: decode)"),
                  *gqa_heads((16, 4), (4, 2), prefix="num_"), HEAD_DIM,
                  ShapeParam("page_size", 16, 4, "tokens per KV page"),
                  ShapeParam("max_pages", 32, 3, "block-table entries per sequence"),
                  ShapeParam("num_pages", 160, 8, "physical pages in the pool (>= batch*max_pages)")],
    templates=[row_parallel, cuda_split_kv, cuda_wgmma_prefill, cuda_kv_head],
    more_work={"onnx_graph": _graph_more_work},
)
