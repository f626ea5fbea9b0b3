"""CUDA GEMM schedule steps: output tiles bound to blocks, (virtual) threads and registers, k tiles
staged through padded shared memory and software-pipelined through registers, tensor cores through
TVM's WMMA intrinsics, int8 dot products through ``__dp4a``. Used by the GEMM-like patterns'
CUDA templates (linear_bias_relu, swiglu_ffn, int8_matmul_dequant, sparse24_matmul_gather, ...)."""

import importlib
import importlib.util
import os
import sys

import numpy as np
from tvm import tirx
from tvm.s_tir import SBlockRealize

from search_spaces.lib.tiling import unroll


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
    """The GEMM kernels' unroll knob: up to 512, unrolled in TIR."""
    unroll(sch, knobs, loop, depths=(0, 16, 64, 512), default=512)


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


_DP4A_MODULE = "tvm.s_tir.tensor_intrin.dot_product_common"


def cuda_wmma_gemm(sch, knobs, epilogue: str, trans_b: bool) -> bool:
    """The WMMA GEMM schedule of the matmul block ``matmul`` and its elementwise ``epilogue``
    block (float16 tensor cores, 16x16x16, float32 accumulator fragments): warps of a block each
    own (fragments x fragments) 16x16 output tiles, x and W k-tiles staged through padded shared
    memory (software-pipelined through registers), each accumulator fragment staged through
    shared memory for the epilogue. W is (n, k) with ``trans_b``, else (k, n). Defaults: 64x64
    block of 2x2 warps, 2x2 fragments each, k tile 32. False, and nothing scheduled, where WMMA
    does not apply (x not float16, a size not a multiple of 16): the caller's fallback then."""
    mm = sch.get_sblock("matmul")
    x, w = (r.source for r in sch.get(mm).reads[-2:])
    n = w.shape[0] if trans_b else w.shape[1]
    if str(x.dtype) != "float16" or any(int(d) % 16 for d in (*x.shape, n)):
        return False
    group = cuda_wmma_group(trans_b=trans_b)
    epi = sch.get_sblock(epilogue)
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
    return True


def dp4a_intrin():
    """Name of TVM's ``dp4a_s8s8s32`` tensor intrinsic (int8x4 . int8x4 + int32 -> ``__dp4a``),
    registered by ``tvm.s_tir.tensor_intrin.dot_product_common``.

    Importing that module the usual way first runs its package's ``__init__``, which registers
    every CUDA intrinsic (about 40 s on 2 cores, once per process). Where the package is not loaded
    yet, only this one file is loaded, under its own module name: a later import of the package
    (MetaSchedule's TuneContext does one) then finds it in ``sys.modules`` and does not register
    the same intrinsics twice."""
    if _DP4A_MODULE not in sys.modules:
        package = _DP4A_MODULE.rsplit(".", 1)[0]
        if package in sys.modules:
            importlib.import_module(_DP4A_MODULE)
        else:
            import tvm.s_tir
            path = os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin", "dot_product_common.py")
            spec = importlib.util.spec_from_file_location(_DP4A_MODULE, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[_DP4A_MODULE] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[_DP4A_MODULE]
                raise
    return sys.modules[_DP4A_MODULE].DP4A_S8S8S32_INTRIN
