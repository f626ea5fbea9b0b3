"""linear_bias_relu: y = relu(x @ W^T + b), the GEMM with its epilogue fused.

Unfused, the GEMM writes M*N floats that the bias and ReLU read back; fused, the epilogue runs on
the accumulator tile while it is still in cache.

Precision: float32, float16 or bfloat16 inputs and output; the accumulator, bias add and ReLU are
float32 in every dtype and y is rounded once. Casts are only emitted where the dtypes differ: the
float32 function is unchanged (tuning records are keyed by its structural hash).

On CUDA, ``cuda_tiled_epilogue`` (every dtype): a thread block per output tile (default 16x16
threads with a 4x4 accumulator tile each, 64x64; 8x8 each, 128x128, where such tiles still fill the
GPU: ``cuda_outputs_per_thread``), x and W k-tiles (16 wide) staged through shared memory
by all threads in 8-byte vectors. Both operands are k-major, so the lanes of a warp read 16
different rows at one k: the rows are padded to 18 floats (20 halves) to put those in 16 different
banks, and a thread's outputs are strided by the thread count (virtual threads; each accumulator
stays a register) so consecutive lanes take consecutive rows and store consecutive columns. The k
loop is software-pipelined through registers: the next tile's global loads are in flight during
this tile's FMAs. Bias + ReLU run on the register tile. ``cuda_wmma`` (float16; float32 and bfloat16
fall back to the former): tensor cores through TVM's WMMA intrinsics, 2x2 warps of 2x2 16x16
fragments (64x64 tile), k tile 32, the same pipelined staging, each accumulator fragment staged
through shared memory for the epilogue. The template helpers are shared with swiglu_ffn.
Neither can drop the function's global ``acc`` (see ``cuda_drop_acc``): it is still written once.
"""

import numpy as np
from tvm import tirx
from tvm.s_tir import SBlockRealize
from tvm.script import tirx as T

from autofuse.pattern import Pattern, RelaxRule, ShapeParam, onnx_model, template


def build(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    # The accumulator is float32 for every dtype. Casts appear only where the dtypes differ, so the
    # float32 function is the one tuning records were made for (they are keyed by structural hash).
    to_f32 = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast("float32", e))
    to_out = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast(dtype, e))

    @T.prim_func(s_tir=True)
    def linear_bias_relu(x: T.Buffer((m, k), dtype), w: T.Buffer((n, k), dtype),
                         b: T.Buffer((n,), dtype), y: T.Buffer((m, n), dtype)):
        T.func_attr({"global_symbol": "linear_bias_relu", "tirx.noalias": True})
        acc = T.alloc_buffer((m, n), "float32")
        for i, j, kk in T.grid(m, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + to_f32(x[vi, vk]) * to_f32(w[vj, vk])
        for i, j in T.grid(m, n):
            with T.sblock("bias_relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = to_out(T.max(acc[vi, vj] + to_f32(b[vj]), T.float32(0)))

    return linear_bias_relu


def reference(x, w, b):
    f64 = np.float64
    return np.maximum(x.astype(f64) @ w.astype(f64).T + b.astype(f64), 0).astype(x.dtype)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    m, n, k = shape["m"], shape["n"], shape["k"]
    scale = 1.0 / np.sqrt(k)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    arrays = [rng.standard_normal((m, k)), rng.standard_normal((n, k)) * scale, rng.standard_normal(n)]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    return 2.0 * shape["m"] * shape["n"] * shape["k"] + 2.0 * shape["m"] * shape["n"]


def nbytes(shape, dtype):
    m, n, k = shape["m"], shape["n"], shape["k"]
    return np.dtype(dtype).itemsize * (m * k + n * k + n + m * n)


@template("tiled_epilogue")
def tiled_epilogue(sch, target, knobs):
    """Register-blocked GEMM: outer tiles in parallel, K split for cache, vectorised inner N,
    accumulator tile written once through a cache_write with bias+ReLU fused at the tile."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("bias_relu")
    i, j, k = sch.get_loops(mm)
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, [4, 4], max_innermost_factor=16))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, [4, 16], max_innermost_factor=64))
    k0, k1 = sch.split(k, knobs.tile(k, 2, [8], max_innermost_factor=64))
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    outer = sch.fuse(i0, j0)
    sch.parallel(outer)
    # The epilogue joins the matmul at the tile, so each acc tile is read back while hot.
    sch.reverse_compute_at(epi, j1, preserve_unit_loops=True)
    sch.vectorize(j2)
    sch.decompose_reduction(mm, k0)
    sch.vectorize(sch.get_loops(epi)[-1])
    sch.annotate(outer, "pragma_auto_unroll_max_step", knobs.choice([0, 16, 64], 16))
    sch.annotate(outer, "pragma_unroll_explicit", 1)



# ---- CUDA ------------------------------------------------------------------------------------
# Shared by the GEMM-like patterns' CUDA templates (swiglu_ffn imports them).


def cuda_vector_lanes(dtype, contiguous, max_bytes=8):
    """Lanes of the widest vector access (at most ``max_bytes``, at most 4 lanes) that keeps every
    row of an axis of ``contiguous`` elements aligned: a misaligned vector access faults.

    At most 4 lanes: where a sampled tile does not divide among the threads the copy is
    predicated, its index becomes a vector too, and TVM 0.27's CUDA codegen emits 8-lane int32
    vectors that do not compile (``make_longlong4`` with 8 arguments)."""
    lanes = max(1, min(4, max_bytes // np.dtype(dtype).itemsize))
    while contiguous % lanes:
        lanes //= 2
    return lanes


def cuda_tile_output(sch, knobs, i, j, rows=(16, 4), cols=(16, 4), j_lanes=1):
    """Split output axes ``i``, ``j`` into (block, vthread, thread) and bind them; ``rows`` and
    ``cols`` are the defaults (threads, outputs per thread).

    Threads are sampled first (<= 32 per axis, so <= 1024 a block), then the outputs per thread
    from what is left (<= 8 per axis). A thread's outputs are strided by the thread count: a
    warp's lanes read consecutive rows of a k-major shared tile (in distinct banks, see
    ``cuda_fetch_shared``) and store consecutive columns (coalesced). Virtual threads give each
    strided output its own register accumulator. With ``j_lanes`` > 1 every column a thread owns
    is a run of ``j_lanes`` contiguous ones (the innermost loop, returned last), for operands and
    outputs contiguous along j: one vector shared load, ``j_lanes`` FMAs, one vector store.
    Returns (block loop, thread-y loop, thread-x loop, thread-y factor, thread-x factor, j lanes
    loop or None)."""
    lane_loop = None
    if j_lanes > 1:
        j, lane_loop = sch.split(j, [None, j_lanes])
    loops = []
    for axis, (threads, per_thread) in ((i, rows), (j, cols)):
        rest, nthreads = knobs.tile(axis, 2, [threads], max_innermost_factor=32)
        outer, thread = sch.split(axis, [rest, nthreads])
        block, vthread = sch.split(outer, knobs.tile(outer, 2, [per_thread], max_innermost_factor=8))
        loops.append((block, vthread, thread, nthreads))
    (i0, i1, i2, nty), (j0, j1, j2, ntx) = loops
    sch.reorder(i0, j0, i1, j1, i2, j2)
    bx = sch.fuse(i0, j0)
    sch.bind(bx, "blockIdx.x")
    sch.bind(i1, "vthread.y")
    sch.bind(j1, "vthread.x")
    sch.bind(i2, "threadIdx.y")
    sch.bind(j2, "threadIdx.x")
    return bx, i2, j2, nty, ntx, lane_loop


def cuda_outputs_per_thread(sch, i, j, threads=16, wave=128):
    """Default outputs per thread along each axis of a 16x16-thread tile: 8 when 128x128 tiles
    still give a wave of ``wave`` blocks (the H200 has 132 SMs), else 4. A thread's shared loads
    per k step grow with the side of its tile and its FMAs with the area: at 4x4 a warp issues one
    shared load per two FMAs and shared-load issue caps the kernel near half the FMA peak (54%
    measured at 2048^3); at 8x8 one per four."""
    m, n = (sch.get(loop).extent for loop in (i, j))
    if not all(isinstance(e, tirx.IntImm) for e in (m, n)):
        return 4
    big = threads * 8
    return 8 if (int(m) // big) * (int(n) // big) >= wave else 4


def cuda_split_k(sch, knobs, loops, lanes, tile=16):
    """Split each reduction loop of ``loops`` (the same extent) into (k tile, k inner..., lanes):
    the k tile is a sampled multiple of ``lanes`` (default ``tile``), so the vectors of a
    k-contiguous shared tile never straddle two rows. Returns the k-tile loops."""
    outer = [sch.split(loop, [None, lanes])[0] for loop in loops]
    factors = knobs.tile(outer[0], 2, [max(1, tile // lanes)], max_innermost_factor=max(1, 32 // lanes))
    return [sch.split(loop, factors)[0] for loop in outer]


def cuda_fetch_shared(sch, block, index, at, threads, lanes, k_major, consumers=None):
    """Stage read ``index`` of ``block`` (a 2-D tile) through shared memory at loop ``at``, copied
    by all ``threads`` (thread-y, thread-x factors) of the block in ``lanes``-wide vectors,
    consecutive threads taking consecutive vectors of a row (coalesced). ``lanes`` must divide
    the tile's contiguous extent (``cuda_split_k``, ``cuda_tile_output``'s ``j_lanes``): a
    vector across rows is gathered, and TVM then hoists constant index vectors out of the kernel.

    A k-major tile (rows indexed by output, k contiguous) is read by a warp across rows at one k:
    its row stride is padded to ``lanes`` mod 16 elements (18 floats, 20 halves at a 16-wide k
    tile), an odd or twice-odd word stride, so 16 lanes hit 16 distinct banks; rows stay aligned
    for the vector stores. The copy goes through registers (``manifest_shared_memory_local_stage``)
    so the software pipeline of the k loop can issue the next tile's global loads before the
    current tile's FMAs and store them to shared after."""
    blk = sch.cache_read(block, index, "shared", consumer_blocks=consumers)
    sch.compute_at(blk, at, preserve_unit_loops=True)
    rows, cols = sch.get_loops(blk)[-2:]
    _, ty, tx, vec = sch.split(sch.fuse(rows, cols), [None, threads[0], threads[1], lanes])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    if k_major:
        sch.storage_align(blk, 0, axis=0, factor=16, offset=lanes)
    sch.annotate(blk, "tirx.manifest_shared_memory_local_stage", 1)
    return blk


def cuda_pipeline(sch, k0, fetches):
    """Software-pipeline the k-tile loop ``k0``, whose body holds the shared copies ``fetches``
    (from ``cuda_fetch_shared``: each becomes a global->register and a register->shared stage)
    and the blocks computing on them: the next tile's global loads are issued, this tile's FMAs
    run while they are in flight, then the next tile goes to shared (one shared buffer)."""
    names = {sch.get(f).name_hint for f in fetches}
    body = sch.get(k0).body
    keys, stages = [], []
    for pos, stmt in enumerate(body.seq if isinstance(body, tirx.SeqStmt) else [body]):
        while isinstance(stmt, tirx.For):
            stmt = stmt.body
        if isinstance(stmt, SBlockRealize) and stmt.block.name_hint in names:
            keys += [(0, pos), (2, pos)]
            stages += [0, 0]
        else:
            keys.append((1, pos))
            stages.append(1)
    rank = {key: n for n, key in enumerate(sorted(keys))}
    sch.annotate(k0, "software_pipeline_stage", stages)
    sch.annotate(k0, "software_pipeline_order", [rank[key] for key in keys])


def cuda_unroll(sch, knobs, loop):
    sch.annotate(loop, "pragma_auto_unroll_max_step", knobs.choice([0, 16, 64, 512], 512))
    sch.annotate(loop, "pragma_unroll_explicit", 1)


def cuda_drop_acc(sch, wb):
    """Inline ``wb`` (the copy of the accumulator tile into ``acc``) into the epilogue, when the
    function lets the schedule do so.

    ``build`` declares acc with ``T.alloc_buffer``, a statement rather than an allocation of the
    root block, and TVM's schedule treats a buffer it does not see allocated as an output whose
    writes must stay: then every element of acc is still stored to global memory once, from the
    register tile, by the thread that reads it back at once for the epilogue (an m*n*4-byte write
    the kernel would not need). Declared with ``T.sblock_alloc_buffer`` (a new structural hash:
    new tuning records) acc disappears and the epilogue reads the registers."""
    root = sch.get(sch.get_sblock("root"))
    if any(buf.name == "acc" for buf in root.alloc_buffers):
        sch.compute_inline(wb)


@template("cuda_tiled_epilogue", target_kinds=("cuda",))
def cuda_tiled_epilogue(sch, target, knobs):
    """Shared-memory tiled GEMM: one block per output tile, x and W k-tiles staged through padded
    shared memory by all threads (vector loads, software-pipelined through registers), each
    thread accumulating a strided register tile in float32, bias + ReLU applied to it on the way
    out (defaults: 16x16 threads, 4x4 or 8x8 outputs each, k tile 16)."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("bias_relu")
    x = sch.get(mm).reads[0].source
    lanes = cuda_vector_lanes(x.dtype, int(x.shape[1]))
    # The k loop accumulates into a register copy of acc (reindex: see cuda_drop_acc).
    wb = sch.reindex(mm, ("write", 0))
    sch.set_scope(mm, 0, "local")
    i, j, k = sch.get_loops(mm)
    per_thread = cuda_outputs_per_thread(sch, i, j)
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, i, j, rows=(16, per_thread), cols=(16, per_thread))
    (k0,) = cuda_split_k(sch, knobs, [k], lanes)
    sch.reverse_compute_at(wb, tx, preserve_unit_loops=True)
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    cuda_drop_acc(sch, wb)
    fetches = [cuda_fetch_shared(sch, mm, index, k0, (nty, ntx), lanes, k_major=True) for index in (0, 1)]
    sch.decompose_reduction(mm, k0)
    cuda_pipeline(sch, k0, fetches)
    cuda_unroll(sch, knobs, bx)


def cuda_wmma_group(trans_b):
    """Names of TVM's registered WMMA intrinsics (16x16x16, float16 in, float32 accumulator);
    importing them registers every CUDA intrinsic (tens of seconds, once per process)."""
    from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group
    return get_wmma_intrin_group(load_scope="shared", store_scope="shared.dyn", in_dtype="float16",
                                 out_dtype="float32", trans_b=trans_b)


def cuda_wmma_tile(sch, knobs, i, j, warps=(2, 2), frags=(2, 2)):
    """Split 16-wide fragment axes ``i``, ``j`` into (block, warp, fragments per warp), the last
    two sampled up to 4 each (<= 16 warps, <= 16 accumulator fragments a warp); warps are bound to
    threadIdx.y/z, their 32 lanes (threadIdx.x) being implicit in the WMMA calls.
    Returns (block loop, warp-y, warp-x loops, warp-y, warp-x factors, fragment loops)."""
    out = []
    for axis, w, f in ((i, warps[0], frags[0]), (j, warps[1], frags[1])):
        rest, frag = sch.split(axis, knobs.tile(axis, 2, [f], max_innermost_factor=4))
        factors = knobs.tile(rest, 2, [w], max_innermost_factor=4)
        block, warp = sch.split(rest, factors)
        out.append((block, warp, frag, factors[1]))
    (bi, wi, fi, nwi), (bj, wj, fj, nwj) = out
    sch.reorder(bi, bj, wi, wj, fi, fj)
    bx = sch.fuse(bi, bj)
    sch.bind(bx, "blockIdx.x")
    sch.bind(wi, "threadIdx.y")
    sch.bind(wj, "threadIdx.z")
    return bx, wi, wj, nwi, nwj, fi, fj


def cuda_wmma_fetch(sch, block, index, at, warps, consumers=None):
    """A float16 k-tile staged through shared memory for the WMMA fragment loads: all threads,
    8-byte vectors, rows padded by 8 halves (16 bytes: WMMA's ldm stays a multiple of 8 and the
    rows of a fragment spread over the banks), through registers for the software pipeline."""
    blk = sch.cache_read(block, index, "shared", consumer_blocks=consumers)
    sch.compute_at(blk, at, preserve_unit_loops=True)
    rows, cols = sch.get_loops(blk)[-2:]
    _, ty, tz, tx, vec = sch.split(sch.fuse(rows, cols), [None, warps[0], warps[1], 32, 4])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tz, "threadIdx.z")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.storage_align(blk, 0, axis=0, factor=16, offset=8)
    sch.annotate(blk, "tirx.manifest_shared_memory_local_stage", 1)
    return blk


def cuda_wmma_tensorize(sch, blk, intrin):
    """Tensorize the last two loops of ``blk`` (multiples of 16) as 16x16 tiles of ``intrin``."""
    rows, cols = sch.get_loops(blk)[-2:]
    r0, r1 = sch.split(rows, [None, 16])
    c0, c1 = sch.split(cols, [None, 16])
    sch.reorder(r0, c0, r1, c1)
    sch.tensorize(r1, intrin)
    return r0, c0


def cuda_wmma_stage_out(sch, blk, frag_store, fj, intrin):
    """Store each 16x16 accumulator fragment to a per-warp shared tile (``frag_store``) and run
    ``blk`` (the copy out of it, with the epilogue after) on it right away, by the warp's 32
    lanes in 4-wide vectors: the shared staging is one fragment per warp, not the block's tile."""
    sch.reverse_compute_at(frag_store, fj, preserve_unit_loops=True)
    sch.storage_align(frag_store, 0, axis=0, factor=16, offset=4)
    sch.reverse_compute_at(blk, fj, preserve_unit_loops=True)
    rows, cols = sch.get_loops(blk)[-2:]
    _, tx, vec = sch.split(sch.fuse(rows, cols), [None, 32, 4])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.tensorize(sch.get_loops(frag_store)[-2], intrin)
    return tx


@template("cuda_wmma", target_kinds=("cuda",))
def cuda_wmma(sch, target, knobs):
    """float16: tensor cores through TVM's WMMA intrinsics (16x16x16, float32 accumulator
    fragments): warps of a block each own (fragments x fragments) 16x16 output tiles, x and W
    k-tiles staged through padded shared memory (software-pipelined through registers), each
    accumulator fragment staged through shared memory for bias + ReLU. Defaults: 64x64 block of
    2x2 warps, 2x2 fragments each, k tile 32. float32/bfloat16 (no WMMA intrinsic in TVM for
    bfloat16; float32 would lose precision as tf32) and sizes not multiple of 16:
    ``cuda_tiled_epilogue``."""
    mm = sch.get_sblock("matmul")
    x, w = (r.source for r in sch.get(mm).reads[-2:])
    if str(x.dtype) != "float16" or any(int(d) % 16 for d in (*x.shape, w.shape[0])):
        cuda_tiled_epilogue.fn(sch, target, knobs)
        return
    group = cuda_wmma_group(trans_b=True)
    epi = sch.get_sblock("bias_relu")
    wb = sch.reindex(mm, ("write", 0))
    # Dynamic shared memory for the fragment staging: TVM's storage rewrite would otherwise fold
    # it into the float16 operand tiles once they are dead, and then reject the float32 store.
    sch.set_scope(mm, 0, "shared.dyn")
    frag_store = sch.cache_write(mm, 0, "wmma.accumulator")
    i, j, k = sch.get_loops(mm)
    i, ii = sch.split(i, [None, 16])
    j, jj = sch.split(j, [None, 16])
    k, kk = sch.split(k, [None, 16])
    sch.reorder(i, j, k, ii, jj, kk)
    outer = sch.blockize(ii)
    bx, _, wj, nwi, nwj, fi, fj = cuda_wmma_tile(sch, knobs, i, j)
    k0, k1 = sch.split(k, knobs.tile(k, 2, [2], max_innermost_factor=4))
    sch.reorder(k0, k1, fi, fj)
    tx = cuda_wmma_stage_out(sch, wb, frag_store, fj, group["store"])
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    cuda_drop_acc(sch, wb)
    sch.vectorize(sch.get_loops(epi)[-1])
    fetches = [cuda_wmma_fetch(sch, outer, index, k0, (nwi, nwj)) for index in (0, 1)]
    for index, scope, name in ((0, "wmma.matrix_a", "load_a"), (1, "wmma.matrix_b", "load_b")):
        frag = sch.cache_read(outer, index, scope)
        sch.compute_at(frag, k1)
        cuda_wmma_tensorize(sch, frag, group[name])
    init = sch.decompose_reduction(outer, k0)
    sch.tensorize(sch.get_loops(mm)[-3], group["compute"])
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], group["init"])
    cuda_pipeline(sch, k0, fetches)
    cuda_unroll(sch, knobs, bx)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x, w, b = wildcard(), wildcard(), wildcard()
    root = is_op("relax.nn.relu")(is_op("relax.add")(is_op("relax.matmul")(x, w), b))
    return root, {"x": x, "w": w, "b": b}


def _relax_rewrite(matched, kernel):
    """matmul(x, w[k, n]) + b[n] -> relu, x of any rank >= 2 (leading axes are rows)."""
    from tvm import relax
    from autofuse.model.fusion import dtype_of, static_shape
    x, w, b = matched["x"], matched["w"], matched["b"]
    xs, ws, bs = static_shape(x), static_shape(w), static_shape(b)
    if None in (xs, ws, bs) or len(xs) < 2 or len(ws) != 2 or bs != (ws[1],) or xs[-1] != ws[0]:
        return None
    if not dtype_of(x) == dtype_of(w) == dtype_of(b) == "float32":
        return None
    m = int(np.prod(xs[:-1]))
    rows = x if len(xs) == 2 else relax.op.reshape(x, (m, xs[-1]))
    out = kernel({"m": m, "n": ws[1], "k": ws[0]}, "float32",
                 [rows, relax.op.permute_dims(w, [1, 0]), b])
    return out if len(xs) == 2 else relax.op.reshape(out, (*xs[:-1], ws[1]))


def onnx_graph(shape, dtype):
    """Gemm (transB, as torch exports nn.Linear) then Relu."""
    from onnx import helper
    m, n, k = shape["m"], shape["n"], shape["k"]
    return onnx_model("linear_bias_relu", [helper.make_node("Gemm", ["x", "w", "b"], ["t"], transB=1),
                                           helper.make_node("Relu", ["t"], ["y"])],
                      [("x", (m, k)), ("w", (n, k)), ("b", (n,))], [("y", (m, n))], dtype)

PATTERN = Pattern(
    name="linear_bias_relu",
    family="gemm",
    description="relu(x @ W^T + b): GEMM with bias and ReLU fused in its epilogue",
    shape_params=[ShapeParam("m", 256, 16, "rows of x (tokens)"),
                  ShapeParam("n", 256, 32, "output features"),
                  ShapeParam("k", 256, 16, "input features")],
    build=build,
    reference=reference,
    make_inputs=make_inputs,
    onnx_graph=onnx_graph,
    flops=flops,
    bytes=nbytes,
    dtypes=("float32", "float16", "bfloat16"),
    templates=[tiled_epilogue, cuda_tiled_epilogue, cuda_wmma],
    relax_rules=[RelaxRule("matmul_add_relu", _relax_pattern, _relax_rewrite)],
)
