"""spec_accept: speculative decoding's acceptance step, fused into one kernel.

Inputs: drafts d (batch, k) int32, target logits (batch, k+1, vocab), the draft distributions q
(batch, k, vocab), uniforms u (batch, k+1) (an input, so that the reference reproduces the kernel).
Outputs: accepted (batch,), the accepted prefix length n, and next_token (batch,). Per row, with
p_i = softmax(logits[i]): draft i is accepted when u[i] * q_i[d_i] < p_i[d_i]; next_token is drawn
by inverse CDF with u[k] from max(0, p_n - q_n) (q_k = 0, so at n = k the bonus p_k), or from p_n
where that is all zero. ``greedy=1``: accepted while d_i == argmax(logits[i]), next_token the argmax
at n. Unfused, Softmax writes every probability and the residual, its CumSum and the comparison
round-trip through memory; the kernel reads the logits twice and only row n of q, and the residual
is summed in vocab chunks (``_chunk``) so that the serial scan covers chunk sums, then one chunk.
CUDA: a rows kernel (``lib.cuda_rows.CudaRows``, a block per (batch, position) row: more SMs share
the traffic than with a block per batch row), then a block per batch row.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.errors import AutofuseError
from autofuse.pattern import Pattern, ShapeParam, template
from search_spaces.lib.cpu_rows import lanes_innermost, rfactor_lanes
from search_spaces.lib.cuda_rows import CudaRows, unroll_chunks, vector_load
from search_spaces.lib.onnx_graphs import typed_model
from search_spaces.lib.stages import row_sum_stage
from search_spaces.lib.tiling import unroll
from search_spaces.lib.tir_math import exp_f32

# make_inputs keeps every decision at least this far from its tie: |u[i] - p/q| > ACCEPT_MARGIN,
# and the threshold u[k] * sum(w) more than SAMPLE_MARGIN * sum(w) from every cumulative-sum
# boundary. A plain sequential float32 cumsum of a residual at vocab 32000 is off by up to 2.5e-5
# of the total (numpy, 40 rows); the kernel's chunked sums by less. At 3e-4 about 40% of the u[k]
# draws at vocab 32000 are redrawn.
ACCEPT_MARGIN = 1e-4
SAMPLE_MARGIN = 3e-4


def _dims(shape):
    b, k, v, g = shape["batch"], shape["k"], shape["vocab"], shape.get("greedy", 0)
    if g not in (0, 1):
        raise AutofuseError(f"shape parameter greedy={g} of 'spec_accept' must be 0 or 1")
    return b, k, v, g


def _chunk(vocab):
    """The chunk of the residual scan: a divisor of vocab of at most min(512, max(16, vocab // 4)),
    the one with the most factors of 2 (up to 16, so the rfactor lanes tile it), then the largest.
    The serial scan costs vocab/chunk + chunk steps; a prime vocab degrades to chunks of 1."""
    cap = min(512, max(16, vocab // 4))
    divisors = [c for c in range(1, min(cap, vocab) + 1) if vocab % c == 0]
    return max(divisors, key=lambda c: (min(c & -c, 16), c))


def build(shape, dtype):
    B, K, V, rule = _dims(shape)
    greedy = rule == 1     # a Python bool: the parser keeps only the branch it selects
    L = _chunk(V)
    C = V // L
    imax = 2 ** 31 - 1

    # One kernel per rule (greedy is a build-time constant): both take the row max of the logits
    # and find the first rejected draft; greedy matches argmaxes, sampling draws from the residual.
    @T.prim_func(s_tir=True)
    def spec_accept(d: T.Buffer((B, K), "int32"), logits: T.Buffer((B, K + 1, V), "float32"),
                    q: T.Buffer((B, K, V), "float32"), u: T.Buffer((B, K + 1), "float32"),
                    accepted: T.Buffer((B,), "int32"), next_token: T.Buffer((B,), "int32")):
        T.func_attr({"global_symbol": "spec_accept", "tirx.noalias": True})
        mx = T.sblock_alloc_buffer((B, K + 1), "float32")
        if greedy:
            amax = T.sblock_alloc_buffer((B, K + 1), "int32")
        else:
            ssum = T.sblock_alloc_buffer((B, K + 1), "float32")
            csum = T.sblock_alloc_buffer((B, C), "float32")
            total = T.sblock_alloc_buffer((B,), "float32")
        for b, i, j in T.grid(B, K + 1, V):
            with T.sblock("row_max"):
                vb, vi, vj = T.axis.remap("SSR", [b, i, j])
                with T.init():
                    mx[vb, vi] = T.min_value("float32")
                mx[vb, vi] = T.max(mx[vb, vi], logits[vb, vi, vj])
        if greedy:
            # Starts at INT32_MAX (min's identity, which rfactor requires), clamped in ``pick``.
            for b, i, j in T.grid(B, K + 1, V):
                with T.sblock("row_argmax"):
                    vb, vi, vj = T.axis.remap("SSR", [b, i, j])
                    with T.init():
                        amax[vb, vi] = T.int32(imax)
                    amax[vb, vi] = T.min(amax[vb, vi], T.Select(logits[vb, vi, vj] == mx[vb, vi], vj, T.int32(imax)))
            for b, i in T.grid(B, K):
                with T.sblock("first_reject"):
                    vb, vi = T.axis.remap("SR", [b, i])
                    with T.init():
                        accepted[vb] = K
                    accepted[vb] = T.min(accepted[vb], T.Select(d[vb, vi] == amax[vb, vi], K, vi))
            for b in range(B):
                with T.sblock("pick"):
                    vb = T.axis.spatial(B, b)
                    T.reads(accepted[vb], amax[vb, 0:K + 1])
                    T.writes(next_token[vb])
                    next_token[vb] = T.min(amax[vb, accepted[vb]], V - 1)
        else:
            for b, i, j in T.grid(B, K + 1, V):
                with T.sblock("exp_sum"):
                    vb, vi, vj = T.axis.remap("SSR", [b, i, j])
                    with T.init():
                        ssum[vb, vi] = T.float32(0)
                    ssum[vb, vi] = ssum[vb, vi] + exp_f32(logits[vb, vi, vj] - mx[vb, vi])
            for b, i in T.grid(B, K):
                with T.sblock("first_reject"):
                    vb, vi = T.axis.remap("SR", [b, i])
                    T.reads(d[vb, vi], u[vb, vi], q[vb, vi, 0:V], logits[vb, vi, 0:V], mx[vb, vi], ssum[vb, vi])
                    T.writes(accepted[vb])
                    with T.init():
                        accepted[vb] = K
                    accepted[vb] = T.min(accepted[vb], T.Select(
                        u[vb, vi] * q[vb, vi, T.max(T.min(d[vb, vi], V - 1), 0)]
                        < _prob(logits[vb, vi, T.max(T.min(d[vb, vi], V - 1), 0)], mx[vb, vi], ssum[vb, vi]),
                        K, vi))
            # q_k = 0: at n = k the residual is p_k, the bonus distribution (the q index is clamped
            # only to stay in bounds; Select reads both arms).
            for b, c, j in T.grid(B, C, L):
                with T.sblock("chunk_res"):
                    vb, vc, vj = T.axis.remap("SSR", [b, c, j])
                    T.reads(accepted[vb], logits[vb, 0:K + 1, 0:V], q[vb, 0:K, 0:V], mx[vb, 0:K + 1],
                            ssum[vb, 0:K + 1])
                    T.writes(csum[vb, vc])
                    with T.init():
                        csum[vb, vc] = T.float32(0)
                    csum[vb, vc] = csum[vb, vc] + T.max(
                        _prob(logits[vb, accepted[vb], vc * L + vj], mx[vb, accepted[vb]], ssum[vb, accepted[vb]])
                        - T.Select(accepted[vb] < K, q[vb, T.min(accepted[vb], K - 1), vc * L + vj], T.float32(0)),
                        T.float32(0))
            # Its own block, not a loop in sample, so that chunk_res has two consumers: with sample its
            # only one, MetaSchedule's multi-level tiling tried to reverse_compute_at sample under it.
            row_sum_stage("res_total", total, (B, C), lambda b, c: csum[b, c])
            for b in range(B):
                with T.sblock("sample"):
                    vb = T.axis.spatial(B, b)
                    T.reads(accepted[vb], csum[vb, 0:C], total[vb], u[vb, K], logits[vb, 0:K + 1, 0:V],
                            q[vb, 0:K, 0:V], mx[vb, 0:K + 1], ssum[vb, 0:K + 1])
                    T.writes(next_token[vb])
                    # Per-row scalars (this block runs in parallel over rows).
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")   # total, threshold, running, prefix
                    pos = T.sblock_alloc_buffer((2,), "int32", scope="local")     # chunk, count
                    acc[0] = total[vb]
                    if acc[0] > T.float32(0):
                        acc[1] = u[vb, K] * acc[0]
                        acc[2] = T.float32(0)
                        acc[3] = T.float32(0)
                        pos[0] = 0
                        # The running sum is monotone, so the chunks passing the test are a prefix;
                        # the last chunk is where a threshold at the very end lands.
                        for c in range(C - 1):
                            acc[2] = acc[2] + csum[vb, c]
                            if acc[2] <= acc[1]:
                                acc[3] = acc[2]
                                pos[0] = c + 1
                        acc[2] = acc[3]
                        pos[1] = 0
                        for j in range(L):
                            acc[2] = acc[2] + T.max(
                                _prob(logits[vb, accepted[vb], pos[0] * L + j], mx[vb, accepted[vb]],
                                      ssum[vb, accepted[vb]])
                                - T.Select(accepted[vb] < K, q[vb, T.min(accepted[vb], K - 1), pos[0] * L + j],
                                           T.float32(0)),
                                T.float32(0))
                            pos[1] = pos[1] + T.Select(acc[2] <= acc[1], 1, 0)
                        next_token[vb] = T.min(pos[0] * L + pos[1], V - 1)
                    else:
                        # Degenerate residual (q_n >= p_n everywhere): draw from p_n, serially.
                        acc[0] = T.float32(0)
                        for j in range(V):
                            acc[0] = acc[0] + _prob(logits[vb, accepted[vb], j], mx[vb, accepted[vb]],
                                                    ssum[vb, accepted[vb]])
                        acc[1] = u[vb, K] * acc[0]
                        acc[2] = T.float32(0)
                        pos[1] = 0
                        for j in range(V):
                            acc[2] = acc[2] + _prob(logits[vb, accepted[vb], j], mx[vb, accepted[vb]],
                                                    ssum[vb, accepted[vb]])
                            pos[1] = pos[1] + T.Select(acc[2] <= acc[1], 1, 0)
                        next_token[vb] = T.min(pos[1], V - 1)

    return spec_accept


def _prob(x, m, s):
    """p = exp(x - max) / sum as the kernel computes it everywhere (one reciprocal, one multiply)."""
    return exp_f32(x - m) * (T.float32(1) / s)




def softmax64(logits):
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _first_false(flags):
    """Per row, the index of the first False in a (batch, k) bool array, k when all are True."""
    k = flags.shape[1]
    return np.where(flags, k, np.arange(k)).min(axis=1, initial=k)


def sample_weights(p_row, q_row):
    """The distribution next_token is drawn from: the residual max(0, p - q), or p when it is all 0
    (q_row is None at the bonus position, where the residual is p itself)."""
    w = p_row if q_row is None else np.maximum(p_row - q_row.astype(np.float64), 0.0)
    return w if w.sum() > 0 else p_row


def inverse_cdf(w, uk):
    """#{j : cumsum(w)_j <= uk * sum(w)}, clamped to the last index (float64)."""
    return min(int(np.count_nonzero(np.cumsum(w) <= uk * w.sum())), len(w) - 1)


def accept_flags(d, p, q, u):
    """(batch, k) bool: u[i] * q_i[d_i] < p_i[d_i], in float64."""
    K = d.shape[1]
    idx = d.astype(np.int64)[..., None]
    pd = np.take_along_axis(p[:, :K], idx, axis=-1)[..., 0]
    qd = np.take_along_axis(q.astype(np.float64), idx, axis=-1)[..., 0]
    return u[:, :K].astype(np.float64) * qd < pd


def reference(d, logits, q, u, shape=None):
    greedy = (shape or {}).get("greedy", 0)
    B, K = d.shape
    if greedy:
        am = logits.argmax(axis=-1)       # first occurrence of the max
        n = _first_false(d == am[:, :K])
        return n.astype(np.int32), am[np.arange(B), n].astype(np.int32)
    p = softmax64(logits)
    n = _first_false(accept_flags(d, p, q, u))
    nxt = [inverse_cdf(sample_weights(p[b, n[b]], q[b, n[b]] if n[b] < K else None), float(u[b, K]))
           for b in range(B)]
    return n.astype(np.int32), np.array(nxt, np.int32)


def _sample_clear(w, uk, margin=SAMPLE_MARGIN):
    """Whether uk * sum(w) is more than margin * sum(w) from every boundary of cumsum(w) (and from
    0 and the end): then float32 sums of w cannot move the drawn token."""
    c = np.concatenate([[0.0], np.cumsum(w)])
    total = c[-1]
    return bool(np.min(np.abs(c - uk * total)) > margin * total)


def make_inputs(shape, dtype, seed):
    """Target logits ~ N(0, 3²); draft logits = target + N(0, 1) noise, q = their softmax (about
    60% of drafts accepted, so n spreads over 0..k); d drawn from q (greedy: the target's argmax
    with probability 0.7); u uniform. Ties are avoided by
    redrawing uniforms: u[i] until |u[i] - p/q| > ACCEPT_MARGIN (all i < k), then u[k] until the
    threshold is clear of every cumulative-sum boundary of the distribution it samples
    (``_sample_clear``). Both tests use the float64 reference's p."""
    B, K, V, greedy = _dims(shape)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((B, K + 1, V)) * 3.0
    qlog = logits[:, :K] + rng.standard_normal((B, K, V))
    logits = logits.astype(np.float32)
    q = softmax64(qlog).astype(np.float32)
    cq = np.cumsum(q.astype(np.float64), axis=-1)
    r = rng.random((B, K, 1))
    d = np.minimum((cq <= r * cq[..., -1:]).sum(axis=-1), V - 1).astype(np.int32)
    u = rng.random((B, K + 1)).astype(np.float32)
    if greedy:
        # Greedy drafts match the target's argmax with probability 0.7 (a sampled draft rarely
        # would), so n spreads over 0..k here too.
        top = logits[:, :K].argmax(axis=-1).astype(np.int32)
        return [np.where(rng.random((B, K)) < 0.7, top, d).astype(np.int32), logits, q, u]
    return [d, logits, q, clear_uniforms(d, logits, q, u, rng)]


def clear_uniforms(d, logits, q, u, rng, tries=1000):
    """u with entries redrawn from rng until no decision is within its margin of a tie."""
    B, K = d.shape
    u = u.copy()
    p = softmax64(logits)
    idx = d.astype(np.int64)[..., None]
    ratio = (np.take_along_axis(p[:, :K], idx, axis=-1)[..., 0]
             / np.take_along_axis(q.astype(np.float64), idx, axis=-1)[..., 0])
    for b in range(B):
        for i in range(K):
            for _ in range(tries):
                if abs(float(u[b, i]) - ratio[b, i]) > ACCEPT_MARGIN:
                    break
                u[b, i] = np.float32(rng.random())
            else:
                raise ValueError("could not draw a uniform clear of its accept threshold")
    n = _first_false(accept_flags(d, p, q, u))
    for b in range(B):
        w = sample_weights(p[b, n[b]], q[b, n[b]] if n[b] < K else None)
        for _ in range(tries):
            if _sample_clear(w, float(u[b, K])):
                break
            u[b, K] = np.float32(rng.random())
        else:
            raise ValueError("could not draw a uniform clear of every cumulative-sum boundary")
    return u


def flops(shape):
    """Per logit (all k+1 positions): max, then sub+exp+add (exp counted as one op), or in greedy
    mode max, compare+select+min. Sampling adds the chunk pass over one row per batch row (sub, exp,
    mul, sub, max, add) and the k accept tests; the serial scan of one chunk is not counted."""
    B, K, V, greedy = _dims(shape)
    if greedy:
        return 4.0 * B * (K + 1) * V
    return 4.0 * B * (K + 1) * V + 6.0 * B * V + 6.0 * B * K


def nbytes(shape, dtype):
    """The logits once; in sampling mode one row of q per batch row (the k gathered q entries
    aside) and u; d; the two int32 outputs."""
    B, K, V, greedy = _dims(shape)
    total = 4 * B * (K + 1) * V + 4 * B * K + 8 * B
    if not greedy:
        total += 4 * B * V + 4 * B * (K + 1)
    return float(total)


@template("row_parallel")
def row_parallel(sch, target, knobs):
    """(batch, position) rows across threads with their two vocab reductions together, each
    vectorised through an rfactor over a lane tile; the residual's chunk sums parallel over (batch,
    chunk) and vectorised inside a chunk; the serial sample/pick blocks parallel over batch."""
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    greedy = "row_argmax" in names      # the kernel's structure, not a knob
    second = "row_argmax" if greedy else "exp_sum"

    max_rf, max_fin = rfactor_lanes(sch, knobs, "row_max", 16, factor_axis=2, max_lanes=32)
    st_rf, st_fin = rfactor_lanes(sch, knobs, second, 16, factor_axis=2, max_lanes=32)
    # The rows: the final max block's (batch, position) loops, fused, tiled, the outer tile across
    # threads; every block of the two reductions joins the inner row loop.
    b, i = sch.get_loops(max_fin)[:2]
    rows = sch.fuse(b, i)
    r0, r1 = sch.split(rows, knobs.tile(rows, 2, [1], max_innermost_factor=8))
    sch.compute_at(max_rf, r1, preserve_unit_loops=True)
    sch.reverse_compute_at(st_rf, r1, preserve_unit_loops=True)
    sch.reverse_compute_at(st_fin, r1, preserve_unit_loops=True)
    sch.parallel(r0)
    unroll(sch, knobs, r0)
    for rf in (max_rf, st_rf):
        lanes, *rest = sch.get_loops(rf)[2:]
        lanes_innermost(sch, rf, lanes, rest)

    if not greedy:
        res_rf, res_fin = rfactor_lanes(sch, knobs, "chunk_res", 16, factor_axis=2, max_lanes=32)
        b, c = sch.get_loops(res_fin)[:2]
        chunks = sch.fuse(b, c)
        sch.compute_at(res_rf, chunks, preserve_unit_loops=True)
        sch.parallel(chunks)
        lanes, *rest = sch.get_loops(res_rf)[1:]
        lanes_innermost(sch, res_rf, lanes, rest)
    last = sch.get_sblock("pick" if greedy else "sample")
    sch.parallel(sch.get_loops(last)[0])


@template("cuda_rows_then_batch", target_kinds=("cuda",))
def cuda_rows_then_batch(sch, target, knobs):
    """Two kernels. Rows: each (batch, position) row of logits to a thread block (CudaRows: a
    warp or less for short rows), max and exp-sum (or argmax) as cross-thread reductions over
    vectorised loads, results to memory. Per batch row, one block: the k accept tests serially in
    every thread (registers), the residual's chunk sums a chunk per group of lanes (shuffles),
    their total and the inverse-CDF scan serially."""
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    greedy = "row_argmax" in names      # the kernel's structure, not a knob
    row_max = sch.get_sblock("row_max")
    second = sch.get_sblock("row_argmax" if greedy else "exp_sum")
    first_reject = sch.get_sblock("first_reject")
    last = sch.get_sblock("pick" if greedy else "sample")

    # Rows kernel. The second pass reads the max from the reduction's own result (registers for
    # a warp's row, shared memory for a block's): a global result is stored by thread 0 alone and
    # read by the others with no barrier between. A copy goes to memory for the batch kernel.
    # One row per block (a short row gets a warp or less): the blocks the second pass and the copy
    # are moved into are indexed by (batch, position), and several fused rows would give them a
    # (batch, position) cover wider than the block's rows, on other threadIdx.y extents.
    sch.fuse(*sch.get_loops(row_max)[:2])
    rows = CudaRows(sch, knobs, row_max, 4, contiguous=False, max_rows=1)
    loops = {row_max: rows.loops}
    mx = sch.cache_write(row_max, 0, rows.stat_scope, consumer_blocks=[second])
    sch.reverse_compute_at(mx, rows.block_loop, preserve_unit_loops=True)
    sch.bind(sch.get_loops(mx)[-1], "threadIdx.y")
    loops[second] = rows.attach(sch, second, reverse=True)
    for blk, (_, _, kc, _) in loops.items():
        vector_load(sch, blk, "logits", kc)
    unroll_chunks(sch, loops.values())

    # Batch kernel. The accept scan runs in every thread into a register copy of ``accepted``, read
    # from there by the residual and the sample; every thread then stores the same n. Scanning in
    # the output itself would race: one thread's init can land after another's last update.
    consumers = [last] if greedy else [sch.get_sblock("chunk_res"), last]
    accepted = sch.cache_write(first_reject, 0, "local", consumer_blocks=consumers)
    stages = [first_reject, accepted]
    if not greedy:
        res, total = sch.get_sblock("chunk_res"), sch.get_sblock("res_total")
        sch.set_scope(res, 0, "shared")
        sch.set_scope(total, 0, "local")
        stages += [res, total]
    # One loop over batch rows for every stage: each stage of row b reads only what the earlier
    # stages (and the rows kernel) wrote for row b, so running them row by row is the same
    # computation. compute_at cannot nest them: first_reject writes an output, and the regions
    # chunk_res and sample declare (all k+1 positions) defeat reverse_compute_at.
    batch = sch.merge(*[sch.get_loops(blk)[0] for blk in stages + [last]])
    if greedy:
        # Nothing to share within a batch row: a thread per row, a warp of rows per block (the
        # last one predicated).
        bx, tx = sch.split(batch, [None, 32])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.bind(batch, "blockIdx.x")
        # A chunk per group of lanes (the largest power of two dividing the chunk, up to a warp:
        # TVM reduces other group sizes through shared memory), chunks across threadIdx.y; the
        # lanes read consecutive vocab entries. Every kernel stage then runs in these threads.
        c, j = sch.get_loops(res)[-2:]
        chunk = int(sch.get(j).extent)
        group = min(32, chunk & -chunk)
        co, ty = sch.split(c, knobs.tile(c, 2, [8], max_innermost_factor=32))
        jo, tx = sch.split(j, [None, group])
        sch.reorder(co, ty, tx, jo)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.decompose_reduction(total, sch.get_loops(total)[-1])
    sch.decompose_reduction(first_reject, sch.get_loops(first_reject)[-1])


def onnx_graph(shape, dtype):
    """Sampling: Softmax over all positions; GatherElements of p and q at the drafts; Less gives the
    accept flags; n = ReduceMin(Where(accepted, k, position)); GatherElements takes row n of p and
    (n clamped to k-1) of q, Where zeroes q at n = k; Relu(p - q) is the residual, Where falls back
    to p when its ReduceSum is 0; CumSum, LessOrEqual against u[k] * total, a ReduceSum of the flags
    and Min(vocab-1) give the token. Greedy: ArgMax (first index), Equal against the drafts, the
    same ReduceMin, GatherElements of the argmax at n. Opset 18 (ReduceMin's axes as an input)."""
    import onnx
    from onnx import helper

    B, K, V, greedy = _dims(shape)
    i32, i64 = onnx.TensorProto.INT32, onnx.TensorProto.INT64
    consts = {"ax1": np.array([1], np.int64), "ax2": np.array([2], np.int64), "zero_i": np.array([0], np.int64),
              "k_i": np.array([K], np.int64), "k_s": np.array(K, np.int64),
              "positions": np.arange(K, dtype=np.int64).reshape(1, K, 1), "out_shape": np.array([B], np.int64)}
    if not greedy:
        consts.update({"k1_i": np.array([K + 1], np.int64), "km1_s": np.array(K - 1, np.int64),
                       "vm1_s": np.array(V - 1, np.int64), "row_shape": np.array([B, 1, V], np.int64),
                       "zero_f": np.array(0, np.float32), "axis2_s": np.array(2, np.int64)})
    nodes = [helper.make_node("Cast", ["d"], ["d64"], to=i64),
             helper.make_node("Unsqueeze", ["d64", "ax2"], ["d3"])]                       # (B, K, 1)
    if greedy:
        nodes += [
            helper.make_node("ArgMax", ["logits"], ["am"], axis=2, keepdims=1),           # (B, K+1, 1)
            helper.make_node("Slice", ["am", "zero_i", "k_i", "ax1"], ["am_d"]),
            helper.make_node("Equal", ["am_d", "d3"], ["ok"]),
            helper.make_node("Where", ["ok", "k_s", "positions"], ["rej"]),
            helper.make_node("ReduceMin", ["rej", "ax1"], ["n3"], keepdims=1),           # (B, 1, 1)
            helper.make_node("GatherElements", ["am", "n3"], ["tok3"], axis=1),
        ]
    else:
        nodes += [
            helper.make_node("Softmax", ["logits"], ["p"], axis=-1),                      # (B, K+1, V)
            helper.make_node("Slice", ["p", "zero_i", "k_i", "ax1"], ["p_d"]),
            helper.make_node("GatherElements", ["p_d", "d3"], ["pd"], axis=2),            # (B, K, 1)
            helper.make_node("GatherElements", ["q", "d3"], ["qd"], axis=2),
            helper.make_node("Slice", ["u", "zero_i", "k_i", "ax1"], ["u_d"]),
            helper.make_node("Unsqueeze", ["u_d", "ax2"], ["u3"]),
            helper.make_node("Mul", ["u3", "qd"], ["uq"]),
            helper.make_node("Less", ["uq", "pd"], ["ok"]),
            helper.make_node("Where", ["ok", "k_s", "positions"], ["rej"]),
            helper.make_node("ReduceMin", ["rej", "ax1"], ["n3"], keepdims=1),           # (B, 1, 1)
            helper.make_node("Expand", ["n3", "row_shape"], ["n_row"]),
            helper.make_node("GatherElements", ["p", "n_row"], ["pn"], axis=1),           # (B, 1, V)
            helper.make_node("Min", ["n3", "km1_s"], ["nq3"]),
            helper.make_node("Expand", ["nq3", "row_shape"], ["nq_row"]),
            helper.make_node("GatherElements", ["q", "nq_row"], ["qn_raw"], axis=1),
            helper.make_node("Less", ["n3", "k_s"], ["has_q"]),
            helper.make_node("Where", ["has_q", "qn_raw", "zero_f"], ["qn"]),
            helper.make_node("Sub", ["pn", "qn"], ["diff"]),
            helper.make_node("Relu", ["diff"], ["res"]),
            helper.make_node("ReduceSum", ["res", "ax2"], ["res_sum"], keepdims=1),
            helper.make_node("Greater", ["res_sum", "zero_f"], ["use_res"]),
            helper.make_node("Where", ["use_res", "res", "pn"], ["w"]),
            helper.make_node("ReduceSum", ["w", "ax2"], ["w_sum"], keepdims=1),
            helper.make_node("Slice", ["u", "k_i", "k1_i", "ax1"], ["u_k"]),              # (B, 1)
            helper.make_node("Unsqueeze", ["u_k", "ax2"], ["u_k3"]),
            helper.make_node("Mul", ["u_k3", "w_sum"], ["thr"]),
            helper.make_node("CumSum", ["w", "axis2_s"], ["cdf"]),
            helper.make_node("LessOrEqual", ["cdf", "thr"], ["below"]),
            helper.make_node("Cast", ["below"], ["below64"], to=i64),
            helper.make_node("ReduceSum", ["below64", "ax2"], ["count"], keepdims=1),
            helper.make_node("Min", ["count", "vm1_s"], ["tok3"]),
        ]
    nodes += [helper.make_node("Reshape", ["n3", "out_shape"], ["n64"]),
              helper.make_node("Cast", ["n64"], ["accepted"], to=i32),
              helper.make_node("Reshape", ["tok3", "out_shape"], ["tok64"]),
              helper.make_node("Cast", ["tok64"], ["next_token"], to=i32)]
    return typed_model("spec_accept", nodes,
                       [("d", (B, K), "int32"), ("logits", (B, K + 1, V), "float32"), ("q", (B, K, V), "float32"),
                        ("u", (B, K + 1), "float32")],
                       [("accepted", (B,), "int32"), ("next_token", (B,), "int32")], consts, opset=18)


PATTERN = Pattern.from_module(
    globals(),
    description="speculative decoding acceptance: softmax ratios, first rejection, residual/bonus "
                "inverse-CDF sample (or greedy argmax match), one kernel",
    shape_params=[ShapeParam("batch", 4, 2, "sequences"),
                  ShapeParam("k", 4, 3, "draft tokens per sequence"),
                  ShapeParam("vocab", 32000, 64, "vocabulary size"),
                  ShapeParam("greedy", 0, 0, "1: greedy acceptance (argmax match), 0: rejection sampling",
                             minimum=0)],
    dtypes=("float32",),
    templates=[row_parallel, cuda_rows_then_batch],
    num_outputs=2,
)
