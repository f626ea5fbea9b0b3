"""moe_gate_topk: a mixture-of-experts layer, router + top-k gate + routed expert FFNs + combine.

logits = x W_g; each token takes the k experts of highest probability (ties to the lower index, as
ONNX TopK), their probabilities renormalised over the k (a softmax over the chosen logits, which is
what the kernel computes); expert e is relu(v W1[e]) W2[e]; y[t] sums the chosen experts' outputs,
weighted. The kernel runs each expert on its tokens only: ``group`` (one serial block, the
data-dependent part) scatters token ids into an (experts, rows) table, and the expert GEMMs run
under (expert, row tile) loops behind ``if row_tile * ROW_TILE < counts[e]`` (an ``if``, not a block
predicate: a predicate reading ``counts`` is no affine binding, and split/reorder refuse it).
Unfused, every expert runs on every token and the hidden activations round-trip through memory.
CUDA (``cuda_routed``): five kernels, one per stage that needs all of the one before. Half precision
sums the combine in float32 and ``combine_store`` rounds once; float32 sums straight into y, the
function its tuning records were made for. On an sm_90 GPU in float16/bfloat16 the kernel template
``cuda_wgmma`` comes first: the expert FFNs as two grouped wgmma GEMMs over the routed rows sorted
by expert (see "Hopper" below).
"""

import functools

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import Pattern, ShapeParam, fit_tiles, onnx_model, template
from search_spaces.lib import cuda_moe, cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import cuda_vector_lanes
from search_spaces.lib.gemm import ffn_shape
from search_spaces.lib.stages import matmul_stage, row_sum_stage
from search_spaces.lib.tiling import unroll, vectorize_inner
from search_spaces.lib.tir_math import exp_f32

# Rows of an expert's token list per skip test (and the register tile of the expert GEMMs).
ROW_TILE = 8


def _dims(shape):
    t, h, i, e, k = shape["tokens"], shape["hidden"], shape["inter"], shape["experts"], shape["k"]
    if k > e:
        raise ValueError(f"k ({k}) cannot exceed experts ({e})")
    return t, h, i, e, k


def build(shape, dtype):
    NT, H, I, E, K = _dims(shape)
    R = ROW_TILE
    NR = -(-NT // R)            # row tiles per expert: one expert may get every token
    TP = NR * R
    half = dtype != "float32"

    @T.prim_func(s_tir=True)
    def moe_gate_topk(x: T.Buffer((NT, H), dtype), wg: T.Buffer((H, E), dtype),
                      w1: T.Buffer((E, H, I), dtype), w2: T.Buffer((E, I, H), dtype),
                      y: T.Buffer((NT, H), dtype)):
        T.func_attr({"global_symbol": "moe_gate_topk", "tirx.noalias": True})
        logits = T.sblock_alloc_buffer((NT, E), "float32")
        rank = T.sblock_alloc_buffer((NT, E), "int32")
        sel = T.sblock_alloc_buffer((NT, K), "int32")
        ex = T.sblock_alloc_buffer((NT, K), "float32")
        esum = T.sblock_alloc_buffer((NT,), "float32")
        gate = T.sblock_alloc_buffer((NT, K), "float32")
        counts = T.sblock_alloc_buffer((E,), "int32")
        tok = T.sblock_alloc_buffer((E, TP), "int32")
        slot = T.sblock_alloc_buffer((NT, K), "int32")
        hacc = T.sblock_alloc_buffer((E, TP, I), "float32")
        hid = T.sblock_alloc_buffer((E, TP, I), "float32")
        out = T.sblock_alloc_buffer((E, TP, H), "float32")
        if half:
            ysum = T.sblock_alloc_buffer((NT, H), "float32")
        matmul_stage("router", logits, (NT, E, H),
                     lambda t, e, c: T.Cast("float32", x[t, c]) * T.Cast("float32", wg[c, e]))
        for t, e, c in T.grid(NT, E, E):
            with T.sblock("rank"):
                vt, ve, vc = T.axis.remap("SSR", [t, e, c])
                with T.init():
                    rank[vt, ve] = 0
                rank[vt, ve] = rank[vt, ve] + T.Select(
                    T.Or(logits[vt, vc] > logits[vt, ve], T.And(logits[vt, vc] == logits[vt, ve], vc < ve)), 1, 0)
        # rank is a permutation of 0..E-1 per token, so exactly one expert has rank j.
        for t, j, e in T.grid(NT, K, E):
            with T.sblock("topk"):
                vt, vj, ve = T.axis.remap("SSR", [t, j, e])
                with T.init():
                    sel[vt, vj] = 0
                sel[vt, vj] = sel[vt, vj] + T.Select(rank[vt, ve] == vj, ve, 0)
        # sel[t, 0] holds the largest logit, so every exponent is <= 0 (what exp_f32 needs).
        for t, j in T.grid(NT, K):
            with T.sblock("gate_exp"):
                vt, vj = T.axis.remap("SS", [t, j])
                ex[vt, vj] = exp_f32(logits[vt, sel[vt, vj]] - logits[vt, sel[vt, 0]])
        row_sum_stage("gate_sum", esum, (NT, K), lambda t, j: ex[t, j])
        for t, j in T.grid(NT, K):
            with T.sblock("gate"):
                vt, vj = T.axis.remap("SS", [t, j])
                gate[vt, vj] = ex[vt, vj] / esum[vt]
        with T.sblock("group"):
            T.reads(sel[0:NT, 0:K])
            T.writes(counts[0:E], tok[0:E, 0:TP], slot[0:NT, 0:K])
            for e in range(E):
                counts[e] = 0
            for e, r in T.grid(E, TP):
                tok[e, r] = 0
            for t, j in T.grid(NT, K):
                slot[t, j] = counts[sel[t, j]]
                tok[sel[t, j], counts[sel[t, j]]] = t
                counts[sel[t, j]] = counts[sel[t, j]] + 1
        # The skip test sits outside the tile's loop nests, not in a block predicate: a predicate
        # reading counts is no affine binding, and reorder/split then refuse the blocks.
        for e, rt in T.grid(E, NR):
            if rt * R < counts[e]:
                for r, n, c in T.grid(R, I, H):
                    with T.sblock("up"):
                        ve, vrt, vr, vn, vc = T.axis.remap("SSSSR", [e, rt, r, n, c])
                        with T.init():
                            hacc[ve, vrt * R + vr, vn] = T.float32(0)
                        hacc[ve, vrt * R + vr, vn] = hacc[ve, vrt * R + vr, vn] + T.Cast(
                            "float32", x[tok[ve, vrt * R + vr], vc]) * T.Cast("float32", w1[ve, vc, vn])
                for r, n in T.grid(R, I):
                    with T.sblock("relu"):
                        ve, vrt, vr, vn = T.axis.remap("SSSS", [e, rt, r, n])
                        hid[ve, vrt * R + vr, vn] = T.max(hacc[ve, vrt * R + vr, vn], T.float32(0))
                for r, m, n in T.grid(R, H, I):
                    with T.sblock("down"):
                        ve, vrt, vr, vm, vn = T.axis.remap("SSSSR", [e, rt, r, m, n])
                        with T.init():
                            out[ve, vrt * R + vr, vm] = T.float32(0)
                        out[ve, vrt * R + vr, vm] = out[ve, vrt * R + vr, vm] + hid[
                            ve, vrt * R + vr, vn] * T.Cast("float32", w2[ve, vn, vm])
        if half:
            # The k weighted rows are summed in float32 and rounded once, by a store block.
            for t, m, j in T.grid(NT, H, K):
                with T.sblock("combine"):
                    vt, vm, vj = T.axis.remap("SSR", [t, m, j])
                    with T.init():
                        ysum[vt, vm] = T.float32(0)
                    ysum[vt, vm] = ysum[vt, vm] + gate[vt, vj] * out[sel[vt, vj], slot[vt, vj], vm]
            for t, m in T.grid(NT, H):
                with T.sblock("combine_store"):
                    vt, vm = T.axis.remap("SS", [t, m])
                    y[vt, vm] = T.Cast(dtype, ysum[vt, vm])
        else:
            # float32 sums straight into y (this exact function is what float32 records are keyed by).
            for t, m, j in T.grid(NT, H, K):
                with T.sblock("combine"):
                    vt, vm, vj = T.axis.remap("SSR", [t, m, j])
                    with T.init():
                        y[vt, vm] = T.Cast(dtype, T.float32(0))
                    y[vt, vm] = y[vt, vm] + T.Cast(dtype, gate[vt, vj] * out[sel[vt, vj], slot[vt, vj], vm])

    return moe_gate_topk


def route(x, wg, k):
    """(experts (tokens, k) int64, weights (tokens, k) float64) in numpy: the k experts of highest
    probability in decreasing order, a tie going to the lower index, their probabilities
    renormalised to sum 1."""
    logits = x.astype(np.float64) @ wg.astype(np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # A stable sort of -logits keeps tied experts in index order; ranking the logits rather than
    # the probabilities keeps two distinct logits distinct (their softmax values could round equal).
    experts = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(probs, experts, axis=-1)
    return experts, chosen / chosen.sum(axis=-1, keepdims=True)


def reference(x, wg, w1, w2, shape=None):
    """Each expert's FFN on the tokens routed to it (float64 GEMMs), their outputs summed weighted
    by the gate; the same as every expert on every token combined with the sparse gate matrix, at
    k / experts of the work."""
    k = (shape or {}).get("k", 2)
    f64 = np.float64
    x64 = x.astype(f64)
    experts, weights = route(x, wg, k)
    y = np.zeros_like(x64)
    for e in range(wg.shape[1]):
        tokens, choice = np.nonzero(experts == e)
        if tokens.size:
            hidden = np.maximum(x64[tokens] @ w1[e].astype(f64), 0.0)
            y[tokens] += weights[tokens, choice][:, None] * (hidden @ w2[e].astype(f64))
    return y.astype(x.dtype)


def torch_function(torch, shape, x, wg, w1, w2):
    """The routed layer as torch users write it (Hugging Face's Mixtral sparse MoE block): router
    and gate in float32, then per expert only the rows routed to it, indexed, through its two GEMMs
    with the weights read in place, scaled by their gate and added into a float32 output
    (index_add_), rounded once: the kernels' work, where the ONNX graph must copy weights."""
    logits = x.float() @ wg.float()
    gate, experts = torch.topk(torch.softmax(logits, dim=-1), shape.get("k", 2), dim=-1)
    gate = gate / gate.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(wg.shape[1]):
        tokens, choice = torch.where(experts == e)
        hidden = torch.relu(x[tokens] @ w1[e])
        out.index_add_(0, tokens, (hidden @ w2[e]).float() * gate[tokens, choice, None])
    return [out.to(x.dtype)]


def make_inputs(shape, dtype, seed):
    """Random normal x and weights scaled by 1/sqrt(fan-in): logits ~ N(0, 1), so ties (or near ties
    that float32 rounding could flip) between the k-th and (k+1)-th expert are practically impossible."""
    NT, H, I, E, _ = _dims(shape)
    rng = np.random.default_rng(seed)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((NT, H)), rng.standard_normal((H, E)) / np.sqrt(H),
              rng.standard_normal((E, H, I)) / np.sqrt(H), rng.standard_normal((E, I, H)) / np.sqrt(I)]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    """The routed work: the router GEMM, tokens*k expert FFNs (two GEMMs and the ReLU) and the
    weighted combine; ranking and the gate softmax (O(tokens*experts^2) compares) are not counted."""
    NT, H, I, E, K = _dims(shape)
    return 2.0 * NT * H * E + NT * K * (4.0 * H * I + I) + 2.0 * NT * K * H


def nbytes(shape, dtype):
    """x and y once, the router and every expert's weights once (random routing of tokens*k
    choices over the experts reaches them all at the default shape; an expert without tokens is
    never read)."""
    NT, H, I, E, _ = _dims(shape)
    return np.dtype(dtype).itemsize * (2 * NT * H + H * E + 2 * E * H * I)


def _has_block(sch, name):
    """Whether the function has a top-level block ``name`` (the dtype decides, not a knob)."""
    return any(sch.get(b).name_hint == name for b in sch.get_child_blocks(sch.get_sblock("root")))


def _expert_gemm(sch, knobs, name, default_inner):
    """Under (expert, row tile): out-feature tiles, reduction, then a ROW_TILE x vector register tile."""
    block = sch.get_sblock(name)
    r, n, c = sch.get_loops(block)[-3:]
    n0, n1 = sch.split(n, knobs.tile(n, 2, [default_inner], max_innermost_factor=32))
    c0, c1 = sch.split(c, knobs.tile(c, 2, [8], max_innermost_factor=32))
    sch.reorder(n0, c0, c1, r, n1)
    sch.vectorize(n1)
    sch.decompose_reduction(block, c0)


@template("packed_experts")
def packed_experts(sch, target, knobs):
    """``expert_tiles`` with each expert GEMM the library's (``search_spaces.lib.cpu_gemm``): per
    (expert, row tile), in parallel, register tiles of the ROW_TILE token rows by output
    features over the expert's weights as stored (contiguous along the outputs), accumulated in
    place (under the skip test nothing moves into the nest); the ReLU pass, the combine and the
    routing as in ``expert_tiles``. Not the default: every row tile reads all of its expert's
    weights, so the GEMMs are bound by memory, and ``expert_tiles``' 16-wide strips ran faster
    (1.1-1.4x at 256 tokens, 1024 x 2048, 8 experts)."""
    relu = sch.get_sblock("relu")
    e, rt = sch.get_loops(relu)[:2]
    outer = sch.fuse(e, rt)
    sch.parallel(outer)
    for name, weight in (("up", "w1"), ("down", "w2")):
        block = sch.get_sblock(name)
        schedule_gemm(sch, block, knobs, target, weight_layout="kn", parallel=False,
                      weight_read=[str(r.source.name) for r in sch.get(block).reads].index(weight))
    vectorize_inner(sch, knobs, sch.get_loops(relu)[-1], max_lanes=32)
    _combine_and_route(sch, knobs)


@template("expert_tiles")
def expert_tiles(sch, target, knobs):
    """Expert GEMMs parallel over (expert, row tile), tiles past an expert's tokens skipped, each
    a ROW_TILE x vector register tile over output-feature tiles; the ReLU pass between them over
    the tile's hidden rows (still in L1/L2); the combine parallel over tokens and vectorised over
    hidden; the routing per token, serial, the router vectorised over experts."""
    # No compute_at/reverse_compute_at into the expert nests: under their `if`, TVM 0.27's
    # reverse_compute_at dropped the whole (expert, row tile) nest from the function.
    relu = sch.get_sblock("relu")
    e, rt = sch.get_loops(relu)[:2]
    # Parallel before decompose_reduction: parallel wants every block under it a complete or
    # reduction block, and a decomposed update block is neither.
    outer = sch.fuse(e, rt)
    sch.parallel(outer)
    unroll(sch, knobs, outer, default=64)
    _expert_gemm(sch, knobs, "up", 16)
    _expert_gemm(sch, knobs, "down", 16)
    vectorize_inner(sch, knobs, sch.get_loops(relu)[-1], max_lanes=32)
    _combine_and_route(sch, knobs)


def _combine_and_route(sch, knobs):
    """The combine parallel over tokens and vectorised over hidden; the routing per token,
    serial, the router vectorised over experts."""
    comb = sch.get_sblock("combine")
    t, m, j = sch.get_loops(comb)
    m0, m1 = sch.split(m, knobs.tile(m, 2, [32], max_innermost_factor=64))
    sch.reorder(t, m0, j, m1)
    sch.parallel(t)
    sch.vectorize(m1)
    sch.decompose_reduction(comb, j)
    if _has_block(sch, "combine_store"):
        # Half precision: the float32 sums of a (token, hidden tile) are rounded to the output
        # right after they are complete.
        store = sch.get_sblock("combine_store")
        sch.reverse_compute_at(store, m0, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(store)[-1])

    router = sch.get_sblock("router")
    t, e, c = sch.get_loops(router)
    sch.reorder(t, c, e)
    sch.vectorize(e)
    sch.decompose_reduction(router, c)



# ---- CUDA ------------------------------------------------------------------------------------
#
# Five kernels, one per stage that needs all of the previous one: the router, the ranking and
# top-k, the (serial) grouping, the expert tiles, and the combine with the gate softmax. Inside
# the expert nest's ``if`` TVM 0.27 inserts no __syncthreads (its sync planner refuses any under
# a condition not marked ``T.tvm_thread_invariant``), so the threads of an expert tile exchange
# nothing through shared memory: they share values only through cross-thread reductions, whose
# lowering carries its own barriers (and warp shuffles). compute_inline of relu drops the whole
# nest from the function (as reverse_compute_at does, see expert_tiles), so its blocks are only
# split, reordered, bound and re-scoped.


def _cuda_router(sch, knobs):
    """A warp (or the largest lane count below 32 dividing hidden) per token, the tokens of a
    block on threadIdx.y: each lane sums its strided slice of the token's hidden values (a warp
    reads x coalesced) for one expert after the other, and the lanes' partial sums meet in
    shuffles."""
    router = sch.get_sblock("router")
    t, _, c = sch.get_loops(router)
    lanes = fit_tiles(int(sch.get(c).extent), [32])[-1]
    bx, ty = sch.split(t, knobs.tile(t, 2, [4], max_innermost_factor=16))
    kc, tx = sch.split(c, [None, lanes])
    sch.reorder(tx, kc)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(kc)


def _cuda_rank_topk(sch, knobs):
    """A token per threadIdx.y, its experts on threadIdx.x: each thread ranks its expert against
    the token's others (experts compares, in registers), and the j-th choice of the token is a
    sum over the experts' threads (one expert has rank j), a shuffle reduction."""
    topk = sch.get_sblock("topk")
    t, _, e = sch.get_loops(topk)
    experts = int(sch.get(e).extent)
    per_block = max(1, min(16, 1024 // experts))
    bx, ty = sch.split(t, knobs.tile(t, 2, [max(1, min(per_block, 128 // experts))],
                                     max_innermost_factor=per_block))
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(e, "threadIdx.x")
    rank = sch.get_sblock("rank")
    sch.compute_at(rank, ty, preserve_unit_loops=True)
    sch.set_scope(rank, 0, "local")
    re_, rc = sch.get_loops(rank)[-2:]
    sch.bind(re_, "threadIdx.x")
    sch.decompose_reduction(rank, rc)
    sch.unroll(sch.get_loops(rank)[-1])


def _cuda_group(sch):
    """The grouping is one opaque block, a scan over all tokens in order: one thread of one block
    (two unit loops bound), a kernel between top-k and the expert tiles."""
    group = sch.get_sblock("group")
    bx = sch.add_unit_loop(group)
    tx = sch.add_unit_loop(group)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _cuda_experts(sch, knobs):
    """A thread block per (expert, row tile), threadIdx.y warps x 32 lanes (threadIdx.x). Up
    projection: lane l owns a contiguous run of inter features for all ROW_TILE rows, warp y a
    slice of hidden; the warps' partial sums meet in a cross-warp reduction (shared memory, its
    own barriers), after which every warp holds the lane's (rows x features) tile in registers,
    ReLU in place. Down projection: warp y owns a slice of the outputs, and for each (row,
    output) the lanes' partial sums over their own features meet in warp shuffles. Tiles past an
    expert's tokens exit at the ``if`` (the whole block)."""
    up, relu, down = (sch.get_sblock(name) for name in ("up", "relu", "down"))
    e, rt = sch.get_loops(relu)[:2]
    bx = sch.fuse(e, rt)
    sch.bind(bx, "blockIdx.x")
    _, n, c = sch.get_loops(up)[-3:]
    hidden, inter = int(sch.get(c).extent), int(sch.get(n).extent)
    lanes = fit_tiles(inter, [32])[-1]
    # Warps: a knob over the divisors of hidden (they split its reduction and its outputs).
    warps = [d for d in (1, 2, 4, 8, 16) if hidden % d == 0 and d * lanes <= 1024]
    ny = knobs.choice(warps, max(d for d in warps if d <= 4))
    # Lane l owns features [l * inter/lanes, (l + 1) * inter/lanes): a contiguous run, so that the
    # thread's accumulators compact to a (rows x run) register array.
    r, n, c = sch.get_loops(up)[-3:]
    tx, nv = sch.split(n, [lanes, None])
    cy, cv = sch.split(c, [ny, None])
    sch.reorder(tx, nv, r, cy, cv)
    sch.bind(tx, "threadIdx.x")
    sch.bind(cy, "threadIdx.y")
    sch.unroll(cv)
    sch.set_scope(up, 0, "local")
    r, n = sch.get_loops(relu)[-2:]
    tx, nv = sch.split(n, [lanes, None])
    sch.reorder(tx, r, nv)
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(relu, 0, "local")
    r, m, n = sch.get_loops(down)[-3:]
    my, mv = sch.split(m, [ny, None])
    tx, nv = sch.split(n, [lanes, None])
    sch.reorder(my, mv, r, tx, nv)
    sch.bind(my, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    # #pragma unroll for nvcc, not unrolled in TIR: an unrolled copy of a cross-thread reduction
    # makes TVM's allreduce lowering fail (one reduction buffer, several reductions).
    unroll(sch, knobs, bx, depths=(0, 16, 64, 512), default=512, explicit=0)


def _cuda_combine(sch, target, knobs):
    """Tokens on threadIdx.y, hidden on threadIdx.x (a contiguous vector each): every thread
    recomputes its token's gate weights (k exponentials, in registers) instead of reading a
    gate buffer, then sums the k expert rows (coalesced) into a register vector stored once."""
    comb = sch.get_sblock("combine")
    t, m, j = sch.get_loops(comb)
    # Vectors of 4 float32 (the expert rows and the sums), stored as 4 of the output dtype.
    lanes = cuda_vector_lanes("float32", int(sch.get(m).extent), max_bytes=16)
    bx, ty = sch.split(t, knobs.tile(t, 2, [2], max_innermost_factor=8))
    m_rest, mv = sch.split(m, [None, lanes])
    tx, mi = sch.split(m_rest, knobs.tile(m_rest, 2, [1], max_innermost_factor=4))
    sch.reorder(bx, ty, tx, j, mi, mv)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if _has_block(sch, "combine_store"):
        sch.set_scope(comb, 0, "local")
        store = sch.get_sblock("combine_store")
    else:
        store = sch.cache_write(comb, 0, "local")
    sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
    _, vec = sch.split(sch.get_loops(store)[-1], [None, lanes])
    sch.vectorize(vec)
    for name in ("gate", "gate_sum", "gate_exp"):
        block = sch.get_sblock(name)
        sch.compute_at(block, ty, preserve_unit_loops=True)
        sch.set_scope(block, 0, "local")
    gate_sum = sch.get_sblock("gate_sum")
    sch.decompose_reduction(gate_sum, sch.get_loops(gate_sum)[-1])
    sch.vectorize(mv)
    sch.decompose_reduction(comb, j)


@template("cuda_routed", target_kinds=("cuda",))
def cuda_routed(sch, target, knobs):
    """The routed MoE layer in five kernels: router (a warp per token, shuffle sums), ranking and
    top-k (a token per threadIdx.y, its experts on lanes, the choice a shuffle sum), grouping (one
    thread: a scan in token order), expert tiles (a block per (expert, row tile), skipped past the
    expert's tokens; up projection reduced across warps, down across lanes, the hidden tile in
    registers), combine (gate softmax recomputed per thread in registers, k expert rows summed
    per token, vectorised). Defaults: 4 tokens a router block, 4 warps an expert tile."""
    _cuda_router(sch, knobs)
    _cuda_rank_topk(sch, knobs)
    _cuda_group(sch)
    _cuda_experts(sch, knobs)
    _cuda_combine(sch, target, knobs)

# ---- Hopper ----------------------------------------------------------------------------------
#
# On an sm_90 GPU in float16/bfloat16 (``cuda_wgmma``) the expert FFNs run on tensor cores as two
# grouped GEMMs (``cuda_wgmma.grouped_gemm_act``) over the routed rows sorted by expert, inside
# ``lib.cuda_moe``'s routing kernels: six kernels in one PrimFunc. Each GEMM has its own tile
# (``up_``/``down_`` block_n and warpgroups); the ring and its roles are one set of knobs for both.
_TILE = ("block_n", "warpgroups")
UP, DOWN = "up_", "down_"


def _two_tiles(gemm_knobs):
    """A GEMM's knobs (space or values) as the template's: the tile once per GEMM, the rest shared."""
    return {**{UP + n: gemm_knobs[n] for n in _TILE}, **{DOWN + n: gemm_knobs[n] for n in _TILE},
            **{n: v for n, v in gemm_knobs.items() if n not in _TILE}}


WGMMA_KNOBS = _two_tiles(cuda_wgmma.KNOBS)
WGMMA_DEFAULT_KNOBS = _two_tiles(cuda_wgmma.DEFAULT_KNOBS)


def _gemm_knobs(knobs, prefix):
    """One GEMM's knobs: its tile, and the shared ring and roles."""
    return {n: knobs[prefix + n] if n in _TILE else knobs[n] for n in cuda_wgmma.KNOBS}


def _routed_rows(shape, knobs):
    """(rows, row tile): each expert's rows padded to the larger of the two GEMMs' row tiles (one
    group table then serves both)."""
    NT, _, _, E, K = _dims(shape)
    tile = 64 * max(knobs[UP + "warpgroups"], knobs[DOWN + "warpgroups"])
    return cuda_moe.routed_rows(NT, E, K, tile), tile


def _wgmma_check(shape, dtype, knobs):
    NT, H, I, E, K = _dims(shape)
    if E > cuda_moe.MAX_EXPERTS:
        raise ValueError(f"experts={E}: at most {cuda_moe.MAX_EXPERTS} (two a lane when routing)")
    if H % 32:
        raise ValueError(f"hidden={H} is not a multiple of 32 (a warp's lanes over hidden)")
    knobs = cuda_wgmma.resolve_knobs(knobs, WGMMA_KNOBS, WGMMA_DEFAULT_KNOBS)
    rows, _ = _routed_rows(shape, knobs)
    for prefix, n, k in ((UP, I, H), (DOWN, H, I)):
        refusal = _grouped_gemm_refusal(rows, n, k, E, dtype, tuple(_gemm_knobs(knobs, prefix).items()))
        if refusal:
            raise ValueError(refusal)
    return knobs


@functools.lru_cache(maxsize=4096)
def _grouped_gemm_refusal(m, n, k, groups, dtype, knob_items):
    """Why the grouped GEMM cannot take this shape and these knobs, or None (cached: the template's
    configurations repeat each GEMM's)."""
    try:
        cuda_wgmma.grouped_check({"m": m, "n": n, "k": k}, groups, dtype, dict(knob_items))
    except ValueError as err:
        return str(err)
    return None


def _wgmma_experts(shape, dtype, knobs):
    """The routed layer on Hopper tensor cores: ReLU in the up GEMM's epilogue, the expert outputs in
    float32 for the combine."""
    NT, H, I, E, K = _dims(shape)
    knobs = _wgmma_check(shape, dtype, knobs)
    rows, tile = _routed_rows(shape, knobs)
    up = cuda_wgmma.grouped_gemm_act({"m": rows, "n": I, "k": H}, E, dtype, _gemm_knobs(knobs, UP), act="relu")
    down = cuda_wgmma.grouped_gemm_act({"m": rows, "n": H, "k": I}, E, dtype, _gemm_knobs(knobs, DOWN),
                                       out_dtype="float32")
    return cuda_moe.routed_layer(NT, H, I, E, K, dtype, rows, tile, up, down)


def _wgmma_fill_tiles(shape, dtype):
    """One consumer warpgroup (64-row tiles, the one-role kernel) where an expert averages under
    128 rows (less padding); each GEMM's tile shrunk where its default would leave SMs idle
    (``cuda_wgmma.fill_tile``), the shallower of their rings for both."""
    NT, H, I, E, K = _dims(shape)
    knobs = dict(WGMMA_DEFAULT_KNOBS)
    if NT * K < 128 * E:
        knobs.update({UP + "warpgroups": 1, DOWN + "warpgroups": 1, "specialised": 0})
    rows, _ = _routed_rows(shape, knobs)
    stages = []
    for prefix, n, k in ((UP, I, H), (DOWN, H, I)):
        fitted = cuda_wgmma.fill_tile({"m": rows, "n": n, "k": k}, dtype, default=_gemm_knobs(knobs, prefix))
        knobs.update({prefix + name: fitted[name] for name in _TILE})
        stages.append(fitted["stages"])
    knobs["stages"] = min(stages)
    try:
        return _wgmma_check(shape, dtype, knobs)
    except ValueError:
        return dict(WGMMA_DEFAULT_KNOBS)


cuda_wgmma_experts = KernelTemplate("cuda_wgmma", _wgmma_experts, WGMMA_KNOBS, WGMMA_DEFAULT_KNOBS, _wgmma_check,
                                    shape_default=_wgmma_fill_tiles, **cuda_wgmma.HOPPER)


def onnx_graph(shape, dtype):
    """The routed layer with static shapes, each expert's FFN on its routed tokens only, in row
    tiles of ROW_TILE as the kernel pads them: MatMul router, Softmax, TopK(k), the chosen
    probabilities divided by their sum; each (token, choice) gets its row in an expert-sorted
    buffer (its expert's start, from a CumSum of the experts' token counts rounded up to whole
    tiles, plus its rank among that expert's choices, an exclusive CumSum of the one-hot choices),
    the token ids are ScatterElements'd into those rows and x Gathered through them; each tile's
    expert (how many expert segments end at or before it) Gathers that expert's W1 and W2, batched
    MatMul, Relu, MatMul; each token Gathers back its k rows and sums them weighted. The tile count
    is the static bound on sum(ceil(count / ROW_TILE)); tiles past the last used one compute rows
    nobody reads. ONNX has no grouped GEMM, so the per-tile weights are copies (see ``more_work``).
    The router and the gate run in float32 whatever the dtype, as the kernels compute them (and as
    Mixtral's reference code softmaxes its router logits): rounded to half precision, the
    probabilities of two experts tie often enough to route other experts (seen at 2048 tokens in
    float16). TopK ranks float32 probabilities where the kernel ranks logits: the same order but for
    near ties that rounding merges, which make_inputs' random floats do not produce. The k expert
    rows are summed in float32 and rounded once, as the kernels do."""
    from onnx import helper
    NT, H, I, E, K = _dims(shape)
    R, A = ROW_TILE, NT * K
    tiles = min((A + min(E, A) * (R - 1)) // R, E * -(-NT // R))
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=1),
             helper.make_node("Cast", ["wg"], ["wg32"], to=1),
             helper.make_node("MatMul", ["x32", "wg32"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["top_p", "top_e"], axis=-1, largest=1, sorted=1),
             helper.make_node("ReduceSum", ["top_p", "last_axis"], ["top_sum"], keepdims=1),
             helper.make_node("Div", ["top_p", "top_sum"], ["top_w"]),
             # Choice a = t * K + j of token t goes to row start[e] + rank of a among e's choices.
             helper.make_node("Reshape", ["top_e", "flat"], ["choice_e"]),                     # (A,)
             helper.make_node("Unsqueeze", ["choice_e", "last_axis"], ["choice_e2"]),           # (A,1)
             helper.make_node("Equal", ["choice_e2", "expert_ids"], ["is_e"]),
             helper.make_node("Cast", ["is_e"], ["one_hot"], to=7),                             # (A,E) int64
             helper.make_node("CumSum", ["one_hot", "zero"], ["before"], exclusive=1),
             helper.make_node("GatherElements", ["before", "choice_e2"], ["rank2"], axis=1),     # (A,1)
             helper.make_node("Reshape", ["rank2", "flat"], ["rank"]),
             helper.make_node("ReduceSum", ["one_hot", "first_axis"], ["counts"], keepdims=0),  # (E,)
             helper.make_node("Add", ["counts", "tile_round"], ["counts_up"]),
             helper.make_node("Div", ["counts_up", "tile_rows"], ["expert_tiles"]),
             helper.make_node("Mul", ["expert_tiles", "tile_rows"], ["padded"]),
             helper.make_node("CumSum", ["padded", "zero"], ["start"], exclusive=1),
             helper.make_node("CumSum", ["padded", "zero"], ["end"]),
             helper.make_node("Gather", ["start", "choice_e"], ["choice_start"], axis=0),
             helper.make_node("Add", ["choice_start", "rank"], ["row"]),                        # (A,)
             helper.make_node("ScatterElements", ["no_tokens", "row", "choice_token"], ["row_token"], axis=0),
             # Tile i belongs to the expert whose segment holds row i * R (past the last: any).
             helper.make_node("LessOrEqual", ["end", "tile_first_row"], ["ended"]),             # (tiles,E)
             helper.make_node("Cast", ["ended"], ["ended_i"], to=7),
             helper.make_node("ReduceSum", ["ended_i", "last_axis"], ["tile_e_raw"], keepdims=0),
             helper.make_node("Min", ["tile_e_raw", "last_expert"], ["tile_e"]),                # (tiles,)
             helper.make_node("Gather", ["x", "row_token"], ["x_rows"], axis=0),                 # (P,H)
             helper.make_node("Reshape", ["x_rows", "tile_shape"], ["x_tiles"]),                 # (tiles,R,H)
             helper.make_node("Gather", ["w1", "tile_e"], ["w1_tiles"], axis=0),                 # (tiles,H,I)
             helper.make_node("Gather", ["w2", "tile_e"], ["w2_tiles"], axis=0),                 # (tiles,I,H)
             helper.make_node("MatMul", ["x_tiles", "w1_tiles"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "w2_tiles"], ["y_tiles"]),
             helper.make_node("Reshape", ["y_tiles", "rows_shape"], ["y_rows"]),                 # (P,H)
             helper.make_node("Reshape", ["row", "choices_shape"], ["token_rows"]),              # (NT,K)
             helper.make_node("Gather", ["y_rows", "token_rows"], ["y_chosen"], axis=0),         # (NT,K,H)
             helper.make_node("Unsqueeze", ["top_w", "last_axis"], ["top_w3"]),
             helper.make_node("Cast", ["y_chosen"], ["y_chosen32"], to=1),
             helper.make_node("Mul", ["y_chosen32", "top_w3"], ["y_weighted"]),
             helper.make_node("ReduceSum", ["y_weighted", "one_axis"], ["y32"], keepdims=0),
             helper.make_node("Cast", ["y32"], ["y"], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))]
    i64 = np.int64
    return onnx_model("moe_gate_topk", nodes,
                      [("x", (NT, H)), ("wg", (H, E)), ("w1", (E, H, I)), ("w2", (E, I, H))],
                      [("y", (NT, H))], dtype,
                      {"k": np.array([K], i64), "last_axis": np.array([-1], i64),
                       "first_axis": np.array([0], i64), "one_axis": np.array([1], i64),
                       "zero": np.array(0, i64), "flat": np.array([A], i64),
                       "expert_ids": np.arange(E, dtype=i64), "tile_round": np.array(R - 1, i64),
                       "tile_rows": np.array(R, i64), "last_expert": np.array(E - 1, i64),
                       "no_tokens": np.zeros(tiles * R, i64), "choice_token": np.arange(A, dtype=i64) // K,
                       "tile_first_row": (np.arange(tiles, dtype=i64) * R)[:, None],
                       "tile_shape": np.array([tiles, R, H], i64), "rows_shape": np.array([tiles * R, H], i64),
                       "choices_shape": np.array([NT, K], i64)})


PATTERN = Pattern.from_module(
    globals(),
    description="MoE layer: router softmax, renormalised top-k gate, ReLU expert FFNs on routed tokens only, combine",
    shape_params=[*ffn_shape((64, 8), (256, 16), (512, 32)),
                  ShapeParam("experts", 8, 4, "number of experts"),
                  ShapeParam("k", 2, 2, "experts per token (top-k), at most experts")],
    templates=[expert_tiles, packed_experts, cuda_wgmma_experts, cuda_routed],
    more_work={"onnx_graph": "ONNX has no grouped GEMM: the graph runs the routed rows in 8-row expert "
                             "tiles as the kernel does, but Gathers a copy of its expert's W1 and W2 for "
                             "every tile (23 copies of the 8 experts' weights at the default shape); the "
                             "kernel reads them in place"},
)
