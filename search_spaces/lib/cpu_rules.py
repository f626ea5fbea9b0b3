"""Default CPU schedules for kernels no pattern made (a model's FuseOps kernels), as dlight's rules
give GPU kernels theirs: each rule recognises one kind of kernel and schedules it, or raises
``NotApplicable``; ``RULES`` in the order they are tried, the first that applies being the
kernel's default (``autofuse.verify`` checks it against the unscheduled kernel).

- ``gemm``: one GEMM-shaped reduction (``C[i, j] += A[i, k] * W[j, k]`` or ``W[k, j]``; unit axes
  dropped, as TVM's dlight matmul analysis classifies the iterators) with elementwise stages
  around it: the stages after it inlined into one epilogue, the whole on ``cpu_gemm``'s GEMM (W in
  panels, or as stored for a few rows; register tile, epilogue on the tile before the only store).
- ``batched_gemm``: the same with both operands batched (attention's QK^T and PV): batches and
  register tiles in parallel, the accumulator tile in registers, W read along its columns.
- ``rows``: reductions over the trailing axes of the same rows (softmax, LayerNorm, RMSNorm, mean)
  with elementwise stages around them: stages inlined where they can be, rows in parallel, every
  stage computed per row, each reduction vectorised through an rfactor over a lane tile, the
  elementwise passes vectorised.
- ``injective``: elementwise, broadcast, transpose, reshape, slice, concatenate: inlined into the
  outputs, each output's outer loops fused and parallel, its innermost loop vectorised where its
  reads are contiguous.
- ``conv``: an NCHW convolution (depthwise too) with elementwise stages around it: output rows of
  a block of channels in parallel, an accumulator tile in registers, the epilogue on the tile;
  for a dense convolution (any stride) the tile is a few positions x vectors of channels, W
  repacked so that one window point's channels load as one vector (``channel_tile_conv``); for
  a depthwise one, and a dense one whose channels fill only half-width vectors where those are
  half rate, channels x a vector along the row (a strided one over the padding copy's columns
  deinterleaved by the stride; a depthwise one only where its row fits one vector); a pointwise
  (1x1, unit stride, unpadded) one whose output plane fills whole vectors as the GEMM it is, over
  the flattened plane (``flat_pointwise_conv``).
- ``parallel``: anything else with enough work (a wider strided depthwise convolution, pooling): each block's
  leading spatial loops, as few as give PARALLEL_TASKS tasks, fused and parallel, nothing else
  changed.

Rules are ``fn(sch, target, knobs)`` like a pattern's templates (``autofuse.pattern.Knobs``): knob
values feed only schedule primitives, so a rule's trace replays with sampled knobs; every Python
branch depends on the kernel's structure and shapes only.
"""

from __future__ import annotations

import functools
import operator

from tvm import DataType, tirx
from tvm.s_tir.dlight.gpu.matmul import IterKind
from tvm.tirx.analysis import undefined_vars

from .cpu_gemm import register_tile, schedule_gemm, vector_unit

# Below this many iterations (output elements of an elementwise kernel, multiply-adds of a
# reduction) a kernel runs on one thread: waking the thread pool costs more.
PARALLEL_MIN_ELEMENTS = 1 << 18
# Parallel tasks enough to balance a few cores (the ``parallel`` rule fuses no more loops).
PARALLEL_TASKS = 64


class NotApplicable(ValueError):
    """The rule does not describe this kernel."""


# --- structure -------------------------------------------------------------------------------------

def root_blocks(sch):
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def is_reduction(sch, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _allocated(sch) -> list:
    return list(sch.get(sch.get_sblock("root")).alloc_buffers)


def is_output(sch, block) -> bool:
    """Whether ``block`` writes a buffer the function does not allocate (a parameter)."""
    allocated = _allocated(sch)
    return any(not any(w.source.same_as(b) for b in allocated) for w in sch.get(block).writes)


def _static(extent) -> int:
    if not isinstance(extent, tirx.IntImm):
        raise NotApplicable("symbolic extents")
    return int(extent.value)


def _extent(iter_var) -> int:
    return _static(iter_var.dom.extent)


def _extent_of(sch, loop) -> int:
    return _static(sch.get(loop).extent)


def _product(values) -> int:
    return functools.reduce(operator.mul, values, 1)


def _dom_kind(sch, block) -> str:
    return "".join("R" if iv.iter_type == tirx.IterVar.CommReduce else "S" for iv in sch.get(block).iter_vars)


def _upstream(sch, block) -> list:
    """Every block ``block`` depends on, transitively."""
    seen, todo = [], list(sch.get_producers(block))
    while todo:
        b = todo.pop()
        if not any(sch.get(b).same_as(sch.get(s)) for s in seen):
            seen.append(b)
            todo.extend(sch.get_producers(b))
    return seen


def _same(sch, a, b) -> bool:
    return sch.get(a).same_as(sch.get(b))


def inline_intermediates(sch, keep=()) -> None:
    """Inline every spatial block that writes a buffer the function allocates (not ``keep``) into
    its consumers, or else into its producer, until none will go."""
    changed = True
    while changed:
        changed = False
        for block in root_blocks(sch):
            if (is_reduction(sch, block) or is_output(sch, block)
                    or any(_same(sch, block, k) for k in keep)):
                continue
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(block)
                except Exception:  # TVM refuses this block here (e.g. a non-affine read): keep it
                    continue
                changed = True
                break
            if changed:
                break


def lanes_for(target, dtype) -> int:
    """Elements of ``dtype`` in one vector register of the target."""
    return max(1, vector_unit(target).lanes * 32 // max(8, DataType(str(dtype)).bits))


def _write_dtype(sch, block):
    return sch.get(block).writes[0].source.dtype


# --- elementwise ------------------------------------------------------------------------------------

def _strided_inner(sch, block) -> bool:
    """Whether a read of ``block`` walks a non-last axis along its innermost iterator (a
    transpose): vector loads would be gathers, slower than scalar code."""
    inner = sch.get(block).iter_vars[-1].var
    for read in sch.get(block).reads:
        used = [any(v.same_as(inner) for v in undefined_vars(r.min)) for r in read.region]
        if used and any(used[:-1]) and not used[-1]:
            return True
    return False


def _guarded(sch, block) -> bool:
    """Whether ``block`` reads under a condition (a padding copy: ``if_then_else(in bounds, x[..],
    0)``). TVM vectorizes such a loop lane by lane; LLVM's own vectorizer does it with masks (a
    3 x 226 x 226 padding copy: 14 us as written, 57 us split into TVM vectors of 2, 42 of 16)."""
    return "if_then_else(" in str(sch.get(block).body)


def parallel_vectorize(sch, knobs, target, block) -> None:
    """``block``'s innermost loop split into a vector of up to the target's lanes (when its extent
    has a divisor of at least 2 that fits and its reads are contiguous along it), the loops above
    fused and parallel (when the block writes enough elements to pay for the thread pool)."""
    loops = sch.get_loops(block)
    extents = [_extent_of(sch, loop) for loop in loops]
    lanes = lanes_for(target, _write_dtype(sch, block))
    inner = extents[-1]
    if not _strided_inner(sch, block) and not _guarded(sch, block) and any(inner % d == 0 for d in range(2, min(lanes, inner) + 1)):
        outer, vector = sch.split(loops[-1], knobs.tile(loops[-1], 2, [lanes], max_innermost_factor=lanes))
        sch.vectorize(vector)
        loops = loops[:-1] + [outer]
    if _product(extents) >= PARALLEL_MIN_ELEMENTS:
        sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])


def injective(sch, target, knobs) -> None:
    """Elementwise/injective kernels: intermediates inlined, each output parallel over its outer
    loops and vectorised along its innermost one."""
    if any(is_reduction(sch, b) for b in root_blocks(sch)):
        raise NotApplicable("the kernel reduces")
    inline_intermediates(sch)
    for block in root_blocks(sch):
        parallel_vectorize(sch, knobs, target, block)


# --- GEMM -------------------------------------------------------------------------------------------

def _point_indices(region) -> list | None:
    """The indices of a single-element access, or None when it covers more than one element."""
    if any(not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1) for r in region):
        return None
    return [r.min for r in region]


def _plain_access(region) -> bool:
    """Each index a block iterator or a constant: what the GEMM loads assume."""
    indices = _point_indices(region)
    return indices is not None and all(isinstance(i, (tirx.Var, tirx.IntImm)) for i in indices)


def _gemm_kinds(stmt) -> list:
    """Each block iterator's role in C[S, I, J] += A[S, I, K] * W[S, J, K], as dlight's
    ``detect_iter_traits`` classifies them (unit ones T), without its demand for a row axis (a
    GEMV has none); NotApplicable for any other use."""
    axes = [{v for r in access.region for v in undefined_vars(r.min)} for access in (*stmt.reads, *stmt.writes)]
    a, w, c = axes
    kinds = []
    for iv in stmt.iter_vars:
        var = iv.var
        if _extent(iv) == 1:
            kinds.append(IterKind.kIter_T)
        elif iv.iter_type == tirx.IterVar.DataPar and var in c:
            kind = {(True, True): IterKind.kIter_S, (True, False): IterKind.kIter_I,
                    (False, True): IterKind.kIter_J}.get((var in a, var in w))
            if kind is None:
                raise NotApplicable("not GEMM-shaped")
            kinds.append(kind)
        elif iv.iter_type == tirx.IterVar.CommReduce and var in a and var in w and var not in c:
            kinds.append(IterKind.kIter_K)
        else:
            raise NotApplicable("not GEMM-shaped")
    return kinds


def _gemm_block(sch):
    """The kernel's one GEMM-shaped reduction, laid out as (batch..., i, j, k) with W (the operand
    indexed by j) read second: C[b.., i, j] += A[b.., i, k] * W[b.., j|k, k|j] (unit iterators
    dropped). Returns (block, batch count). NotApplicable otherwise."""
    reductions = [b for b in root_blocks(sch) if is_reduction(sch, b)]
    if len(reductions) != 1:
        raise NotApplicable("not exactly one reduction")
    matmul = reductions[0]
    stmt = sch.get(matmul)
    if len(stmt.reads) != 2 or not all(_plain_access(r.region) for r in (*stmt.reads, *stmt.writes)):
        raise NotApplicable("not a GEMM with plain operand accesses")
    kinds = _gemm_kinds(stmt)
    if IterKind.kIter_I not in kinds and IterKind.kIter_T in kinds:
        kinds[kinds.index(IterKind.kIter_T)] = IterKind.kIter_I  # a GEMV: one row
    if any(kinds.count(k) != 1 for k in (IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K)):
        # Fusing several row (or column) axes into one would index C through div/mod, which
        # compute-at cannot see through.
        raise NotApplicable("more than one row, column or reduction axis")
    for iv in stmt.iter_vars:
        _extent(iv)
    order = [IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K]
    positions = sorted((i for i, k in enumerate(kinds) if k != IterKind.kIter_T),
                       key=lambda i: (order.index(kinds[i]), i))
    sch.transform_block_layout(matmul, tirx.IndexMap.from_func(
        lambda *vs: [vs[i] for i in positions], ndim=len(kinds)))
    return matmul, kinds.count(IterKind.kIter_S)


def _weight_layout(sch, matmul) -> str:
    """How the block reads W: "nk" (W[.., j, k]) or "kn" (W[.., k, j])."""
    stmt = sch.get(matmul)
    *_, vj, vk = (iv.var for iv in stmt.iter_vars)
    last_two = _point_indices(stmt.reads[1].region)[-2:]
    if last_two[0].same_as(vj) and last_two[1].same_as(vk):
        return "nk"
    if last_two[0].same_as(vk) and last_two[1].same_as(vj):
        return "kn"
    raise NotApplicable("W is not indexed by (j, k) or (k, j) last")


def _split_around(sch, matmul):
    """Inline the elementwise stages after the GEMM (and inputs only they read) into one epilogue;
    the stages feeding A stay. Returns (stages before, epilogue blocks in order)."""
    upstream = _upstream(sch, matmul)
    inline_intermediates(sch, keep=upstream)
    downstream = [b for b in root_blocks(sch)
                  if not _same(sch, b, matmul) and not any(_same(sch, b, u) for u in upstream)]
    return upstream, downstream


def gemm(sch, target, knobs) -> None:
    """A GEMM whose W is shared by all rows (no batch axis), elementwise stages around it: on
    ``cpu_gemm``'s GEMM (W packed in panels, or read as stored for a few rows), the epilogue on
    the register tile; on one thread below PARALLEL_MIN_ELEMENTS multiply-adds."""
    matmul, batch = _gemm_block(sch)
    if batch:
        raise NotApplicable("both operands batched (no shared weight to pack)")
    if len(sch.get(matmul).reads[1].region) != 2:
        raise NotApplicable("W is not a matrix")
    layout = _weight_layout(sch, matmul)
    upstream, epilogue = _split_around(sch, matmul)
    for block in upstream:
        parallel_vectorize(sch, knobs, target, block)
    work = _product(_extent(iv) for iv in sch.get(matmul).iter_vars)
    schedule_gemm(sch, matmul, knobs, target, epilogue_blocks=epilogue, weight_read=1, weight_layout=layout,
                  parallel=work >= PARALLEL_MIN_ELEMENTS)


def _tile_in_registers(sch, block, epilogue, tile_loop, outer, layout=None):
    """``block``'s accumulator tile (everything below ``tile_loop``) in a local buffer, written
    back and run through the ``epilogue`` blocks right there (intermediates inlined), the
    ``outer`` loops fused and parallel where the block has the work for it. Returns the blocks
    after the accumulation, the one writing the output last. ``layout``: an index map of the
    accumulator (its order in registers)."""
    accumulate = sch.cache_write(block, 0, "local")
    if layout is not None:
        sch.transform_layout(block, ("write", 0), index_map=layout)
    sch.reverse_compute_at(accumulate, tile_loop, preserve_unit_loops=True)
    chain = [accumulate]
    for consumer in epilogue:
        sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
        chain.append(consumer)
    for stage in chain[:-1]:
        if not is_output(sch, stage):
            sch.compute_inline(stage)
            chain.remove(stage)
    # Fused after the epilogue moved in: its iterators then bind to the split loops.
    tasks = sch.fuse(*outer)
    if _product(_extent(iv) for iv in sch.get(block).iter_vars) >= PARALLEL_MIN_ELEMENTS:
        sch.parallel(tasks)
    return chain


def _vectorize_tile(sch, block, reduce_loop, chain):
    """The accumulator's init split out above ``reduce_loop`` and vectorised, as every stage of the
    ``chain`` along its innermost loop (vectorize refuses a block once its init is split out,
    so the accumulation's own loops are set before)."""
    init = sch.decompose_reduction(block, reduce_loop)
    sch.vectorize(sch.get_loops(init)[-1])
    for stage in chain:
        sch.vectorize(sch.get_loops(stage)[-1])


def batched_gemm(sch, target, knobs) -> None:
    """A GEMM batched on both operands (attention's QK^T and PV): batches and MR x NR output tiles
    in parallel, the accumulator tile in registers (rows unrolled, columns in vectors, W read
    along j), the epilogue on the tile."""
    matmul, batch = _gemm_block(sch)
    if not batch:
        raise NotApplicable("no batch axis")
    _weight_layout(sch, matmul)
    upstream, epilogue = _split_around(sch, matmul)
    for block in upstream:
        parallel_vectorize(sch, knobs, target, block)
    *batches, i, j, k = sch.get_loops(matmul)
    tile = register_tile(vector_unit(target), _extent_of(sch, i), _extent_of(sch, j))
    i0, i1 = sch.split(i, knobs.tile(i, 2, [tile.rows], max_innermost_factor=16))
    # NR columns as NR / lanes unrolled vectors: one wide vector spills.
    j0, j1, lanes = sch.split(j, knobs.tile(j, 3, [tile.cols // tile.lanes, tile.lanes], max_innermost_factor=16))
    k0, k1 = sch.split(k, knobs.tile(k, 2, [4], max_innermost_factor=8))
    sch.reorder(*batches, i0, j0, k0, k1, i1, j1, lanes)
    chain = _tile_in_registers(sch, matmul, epilogue, j0, [*batches, i0, j0])
    sch.unroll(i1)
    sch.unroll(j1)
    sch.vectorize(lanes)
    sch.unroll(k1)
    _vectorize_tile(sch, matmul, k0, chain)


# --- convolution --------------------------------------------------------------------------------

def conv(sch, target, knobs) -> None:
    """An NCHW convolution (the one reduction: output [n, f, y, x] over its window's reduction
    axes, any stride, depthwise too) with elementwise stages around it: output rows of a block of
    channels in parallel, an accumulator tile of channels x a vector along the row in registers,
    the epilogue on the tile; the padding copy (and other stages before) parallel, vectorised by
    LLVM where it reads under a condition and by TVM otherwise."""
    reductions = [b for b in root_blocks(sch) if is_reduction(sch, b)]
    if len(reductions) != 1:
        raise NotApplicable("not exactly one reduction")
    block = reductions[0]
    stmt = sch.get(block)
    kinds = _dom_kind(sch, block)
    out = _point_indices(stmt.writes[0].region)
    if kinds[:4] != "SSSS" or "S" in kinds[4:] or len(kinds) == 4 or out is None or len(out) != 4:
        raise NotApplicable("not an NCHW convolution")
    if not all(isinstance(v, tirx.Var) and v.same_as(iv.var) for v, iv in zip(out, stmt.iter_vars[:4])):
        raise NotApplicable("the output is not indexed by the spatial iterators in order")
    if not _window_access(sch, block):
        raise NotApplicable("no sliding window (a GEMM or a row reduction)")
    for iv in stmt.iter_vars:
        _extent(iv)
    lanes = lanes_for(target, _write_dtype(sch, block))
    weight = _channel_only_read(sch, block)
    channel_lanes = channel_vector(target, _write_dtype(sch, block), _extent(stmt.iter_vars[1])) \
        if weight is not None else None
    channel_vectors = channel_lanes is not None
    if channel_vectors and channel_lanes < lanes and not vector_unit(target).half_rate_free \
            and _extent(stmt.iter_vars[3]) >= channel_lanes and (_unit_stride(sch, block) or _deinterleavable(sch, block)):
        # Half-width channel vectors run at half the FMA rate where the full width is as fast
        # per instruction (AVX-512 on Intel): vectors along output rows at least as wide instead,
        # a weight broadcast per FMA (the 8-channel 7x7 stride-2 stems of ResNet-18/50 on
        # emeraldrapids: 0.55x the channel tile's time untuned, MobileNetV3's 8-72 channel 1x1
        # convs at 14-56 columns 0.6-0.8x; at 7 columns 1.4x, so narrower rows keep the channels).
        channel_vectors = False
    if not channel_vectors and not _unit_stride(sch, block):
        # Vectors along a strided row would be gathers, and so would the channels of a
        # depthwise one. Where an output row fits one vector, the padded input's columns are
        # deinterleaved by the stride, so that a row vector is contiguous again (MobileNetV3's
        # and ShuffleNetV2's at 7 and 14 columns: 0.2-0.6x the time of the loops as written); on
        # wider depthwise rows LLVM vectorizes the loops as written, and the deinterleaving copy
        # cost more than it saved (1.1-2x at 28 and 56 columns, 2-core znver4, one thread); a
        # dense convolution reuses each copied column for all its output channels.
        if weight is None and _extent(stmt.iter_vars[3]) > lanes:
            raise NotApplicable("a strided depthwise window over rows wider than a vector")
        _deinterleave_columns(sch, block)
    upstream, epilogue = _split_around(sch, block)
    if weight is not None and len(epilogue) <= 1 and _flat_pointwise(sch, block, lanes):
        flat_pointwise_conv(sch, block, upstream, epilogue, knobs, target)
        return
    for producer in upstream:
        if _guarded(sch, producer):
            parallel_copy(sch, producer)
        else:
            parallel_vectorize(sch, knobs, target, producer)
    if channel_vectors:
        # A dense convolution: channel vectors (any stride; at unit stride 0.6-0.9x the row
        # vectors' time on resnet18/50's kernels with residual epilogues, 8-256 channels, and
        # level on MobileNet's small ones, 2-core znver4, one thread, interleaved).
        channel_tile_conv(sch, block, epilogue, weight, knobs, target)
        return
    n, f, y, x, *reduce = sch.get_loops(block)
    # a dense convolution's channels share the input vector: 8 accumulators cover the FMA latency
    f0, f1 = sch.split(f, knobs.tile(f, 2, [4 if weight is None else 8], max_innermost_factor=8))
    x0, x1 = sch.split(x, knobs.tile(x, 2, [lanes], max_innermost_factor=lanes))
    sch.reorder(n, f0, y, x0, *reduce, f1, x1)
    chain = _tile_in_registers(sch, block, epilogue, x0, [n, f0, y])
    sch.unroll(f1)
    sch.vectorize(x1)
    _vectorize_tile(sch, block, reduce[0], chain)


# Output positions (in vectors) from which a pointwise convolution runs over its flattened plane:
# 7 x 7 = 49 positions padded to 4 vectors of 16 wastes a quarter of its FMAs.
FLAT_MIN_VECTORS = 3


def _flat_pointwise(sch, block, lanes: int) -> bool:
    """Whether ``block`` is a pointwise convolution (a 1 x 1 window, unit stride, no padding: its
    input rows are its output rows) whose output plane holds ``FLAT_MIN_VECTORS`` vectors or more
    and either fills whole vectors or has more output channels than one vector: a GEMM of W (f, c)
    by the input's (c, y * W + x) plane."""
    stmt = sch.get(block)
    ivs = stmt.iter_vars
    height, width = _extent(ivs[2]), _extent(ivs[3])
    if _product(_extent(iv) for iv in ivs[5:]) != 1 or height * width < FLAT_MIN_VECTORS * lanes:
        return False
    if (height * width) % lanes and _extent(ivs[1]) <= lanes:
        # a padded plane costs a copy; one vector of output channels is what the channel tile
        # does well (MobileNetV3's 16-channel 1x1 convs at 14 x 14: 1.6-2.4x slower padded)
        return False
    y, x = ivs[2].var, ivs[3].var
    for read in stmt.reads:
        used = {v for r in read.region for v in undefined_vars(r.min)}
        if not any(v.same_as(x) for v in used):
            continue
        rows, cols = (_static(e) for e in read.source.shape[-2:])
        last_two = [r.min for r in read.region[-2:]]
        if (rows, cols) != (height, width) or not all(
                isinstance(i, tirx.Var) and i.same_as(v) or isinstance(i, tirx.Add) and any(
                    isinstance(side, tirx.Var) and side.same_as(v) for side in (i.a, i.b))
                for i, v in zip(last_two, (y, x))):
            return False
    return True


def flat_pointwise_conv(sch, block, upstream, epilogue, knobs, target) -> None:
    """A pointwise convolution (``_flat_pointwise``) as the GEMM it is: output positions flattened
    (y * W + x), so that vectors run along whole planes rather than rows (a row of 28, 14 or 7 is
    no multiple of a vector; 28 x 28 is, and 14 x 14 is padded to one, ``_pad_plane``); a register
    tile of 8 output channels x vectors of positions, a weight broadcast per FMA, the (single)
    epilogue block on the tile; copies in front inlined where they will go. Channel blocks in
    parallel. The accumulator is flattened as a buffer, so that compute-at sees the tile's
    positions as one range."""
    stmt = sch.get(block)
    height, width = _extent(stmt.iter_vars[2]), _extent(stmt.iter_vars[3])
    lanes = lanes_for(target, _write_dtype(sch, block))
    padded = (height * width) % lanes != 0
    if padded:
        plane = _flat_input(sch, block)
    else:
        for producer in upstream:
            try:
                sch.compute_inline(producer)
            except Exception:  # a padding copy under a condition, say: kept, in parallel
                parallel_vectorize(sch, knobs, target, producer)
    accumulate = sch.cache_write(block, 0, "local")
    if epilogue:
        sch.reverse_compute_inline(epilogue[0])
    flat = lambda n, f, y, x: (n, f, y * width + x)  # noqa: E731
    # the 1 x 1 window's unit axes dropped: an einsum, as pad_einsum wants it
    sch.transform_block_layout(block, tirx.IndexMap.from_func(
        lambda n, f, y, x, c, *unit: (n, f, y * width + x, c), ndim=len(stmt.iter_vars)))
    sch.transform_layout(block, ("write", 0), index_map=flat)
    sch.transform_block_layout(accumulate, flat)
    if padded:
        _pad_plane(sch, block, accumulate, plane, flat, lanes)
    n, f, p, *reduce = sch.get_loops(block)
    f0, f1 = sch.split(f, knobs.tile(f, 2, [8], max_innermost_factor=8))
    pp, p1 = sch.split(p, [None, lanes])
    p0, pv = sch.split(pp, knobs.tile(pp, 2, [2], max_innermost_factor=4))
    sch.reorder(n, f0, p0, *reduce, f1, pv, p1)
    sch.reverse_compute_at(accumulate, p0, preserve_unit_loops=True)
    tasks = sch.fuse(n, f0)
    if _product(_extent(iv) for iv in sch.get(block).iter_vars) >= PARALLEL_MIN_ELEMENTS:
        sch.parallel(tasks)
    sch.unroll(f1)
    sch.unroll(pv)
    sch.vectorize(p1)
    init = sch.decompose_reduction(block, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])
    if not padded:  # padded, the last tile's positions are guarded: LLVM's vectorizer masks them
        sch.vectorize(sch.split(sch.get_loops(accumulate)[-1], [None, lanes])[1])


def _flat_input(sch, block) -> str:
    """The name of the buffer whose plane ``block`` (a pointwise convolution) reads, made an
    intermediate (a copy of a parameter, whose layout is fixed) so that it can be flattened."""
    stmt = sch.get(block)
    x = stmt.iter_vars[3].var
    (source,) = [i for i, r in enumerate(stmt.reads)
                 if any(v.same_as(x) for reg in r.region for v in undefined_vars(reg.min))]
    if not any(stmt.reads[source].source.same_as(b) for b in _allocated(sch)):
        sch.cache_read(block, source, "global")
    return sch.get(block).reads[source].source.name


def _pad_plane(sch, block, accumulate, plane: str, flat, lanes: int) -> None:
    """``flat_pointwise_conv``'s plane when it is no multiple of a vector (14 x 14 = 196), after
    the block and its accumulator are flattened: the input ``plane`` flattened too, the block
    padded to whole vectors of positions (``pad_einsum``), its input copied once into a
    zero-padded plane (``parallel_copy``), the accumulator (the epilogue) storing the real
    positions."""
    (source,) = [i for i, r in enumerate(sch.get(block).reads) if r.source.name == plane]
    sch.transform_layout(block, ("read", source), index_map=flat)
    sch.pad_einsum(block, [1, 1, lanes, 1])
    for producer in sch.get_producers(accumulate):  # the padded accumulator's copy back
        sch.compute_inline(producer)
    (padded,) = [p for p in sch.get_producers(block) if _guarded(sch, p)]
    for producer in sch.get_producers(padded):  # the input's copy (pad_temp), read once here
        try:
            sch.compute_inline(producer)
        except Exception:  # read elsewhere too: it stays a copy of its own
            parallel_copy(sch, producer)
    parallel_copy(sch, padded)


# A copy before a convolution that runs in parallel (the padded input, the repacked W) runs in
# parallel from this many elements: the thread pool is awake for the convolution anyway.
CONV_COPY_PARALLEL_MIN_ELEMENTS = 1 << 13


def parallel_copy(sch, block) -> None:
    """A copy feeding a parallel convolution (padding, W repacked): its two outer loops fused and
    parallel from ``CONV_COPY_PARALLEL_MIN_ELEMENTS``, the rest left to LLVM's vectorizer (which
    masks a padding copy's condition, see ``_guarded``)."""
    if _product(_extent(iv) for iv in sch.get(block).iter_vars) >= CONV_COPY_PARALLEL_MIN_ELEMENTS:
        loops = sch.get_loops(block)
        sch.parallel(sch.fuse(*loops[:2]))


def channel_vector(target, dtype, channels: int):
    """Lanes of the output-channel vector of ``channel_tile_conv``: the target's vector where it
    divides ``channels``, else half of it (on AVX-512 a ymm FMA does as many flops per cycle as a
    zmm one on znver4), else None."""
    lanes = lanes_for(target, dtype)
    return next((v for v in (lanes, lanes // 2) if v >= 4 and channels % v == 0), None)


# Bytes of the largest accumulator tile: TVM puts a local buffer of more than this
# (runtime::kMaxStackAlloca) in a workspace it allocates from the heap in every parallel task,
# which is slow and serialises the threads (a 48 x 7 tile ran 2.4x slower on 2 threads than on 1).
MAX_STACK_BYTES = 1024


# At most this many accumulator vectors in a channel tile: with half-width (8-lane) channel vectors
# the stack limit allows 28, and fewer ran faster (ShuffleNetV2's stem, 24 channels: 1 x 16
# positions 0.88x the time of 3 x 8; ResNet-50's 1x1 stride-2 conv 0.81x; the rest of the four
# CNNs' convs 0.9-1.08x, one thread, interleaved).
CHANNEL_TILE_ACCUMULATORS = 16


def channel_tile_shape(unit, vectors: int, lanes: int, width: int, itemsize: int = 4) -> tuple[int, int]:
    """(F, P): F channel vectors (a divisor of ``vectors``, the output channels over the lanes) by
    P output positions (a divisor of the output row ``width``), F * P accumulators and F weight
    vectors within the registers (a broadcast input is an FMA's memory operand), the tile on the
    stack (``MAX_STACK_BYTES``) and at most ``CHANNEL_TILE_ACCUMULATORS``: as many accumulators
    as fit, then the fewest loads per FMA ((F + P) / (F * P))."""
    budget = min(unit.registers - 4, MAX_STACK_BYTES // (lanes * itemsize), CHANNEL_TILE_ACCUMULATORS)
    best = None
    for f in (d for d in range(1, min(vectors, 4) + 1) if vectors % d == 0):
        for p in (d for d in range(1, width + 1) if width % d == 0):
            if f * p > budget or f * p + f > unit.registers - 4:
                continue
            key = (f * p, -(f + p) / (f * p))
            if best is None or key > best[0]:
                best = (key, (f, p))
    return best[1]


def channel_tile_conv(sch, block, epilogue, weight: int, knobs, target) -> None:
    """A dense convolution ``block`` (loops n, f, y, x, then its reductions; ``weight`` the index
    of its read indexed by f alone) on a register tile of F vectors of output channels x P output
    positions along the row: W repacked as [f / V][window][V] (one contiguous vector of V output
    channels per window point, copied in parallel), per window point F weight vectors and one
    broadcast input value per position (any stride: no vector is a gather), the accumulators kept
    channel-innermost ([P][F * V]) in registers; the ``epilogue`` blocks on the tile, which they
    store position by position along the output row. Output rows x channel blocks in parallel."""
    stmt = sch.get(block)
    channels, width = _extent(stmt.iter_vars[1]), _extent(stmt.iter_vars[3])
    lanes = channel_vector(target, _write_dtype(sch, block), channels)
    if lanes is None:
        raise NotApplicable("output channels are no multiple of a vector")
    vectors, positions = channel_tile_shape(vector_unit(target), channels // lanes, lanes, width,
                                            DataType(_write_dtype(sch, block)).bits // 8)
    packed = sch.cache_read(block, weight, "global")
    sch.transform_layout(block, ("read", weight), index_map=lambda co, *window: (
        co // lanes, *window, co % lanes))
    parallel_copy(sch, packed)
    n, f, y, x, *reduce = sch.get_loops(block)
    fo, f2 = sch.split(f, [None, lanes])
    f0, f1 = sch.split(fo, knobs.tile(fo, 2, [vectors], max_innermost_factor=4))
    x0, x1 = sch.split(x, knobs.tile(x, 2, [positions], max_innermost_factor=16))
    sch.reorder(n, f0, y, x0, *reduce, x1, f1, f2)
    chain = _tile_in_registers(sch, block, epilogue, x0, [n, f0, y],
                               layout=lambda b, c, i, j: (b, i, j, c))
    sch.unroll(x1)
    sch.unroll(f1)
    sch.vectorize(f2)
    init = sch.decompose_reduction(block, reduce[0])
    for loop in sch.get_loops(init)[-3:-1]:
        sch.unroll(loop)
    sch.vectorize(sch.get_loops(init)[-1])
    for stage in chain:
        sch.vectorize(sch.get_loops(stage)[-1])


def _column_stride(index, x):
    """s where ``index`` is ``s * x + r`` (or ``r + x * s``, ...) with a constant s > 1, else None."""
    if not isinstance(index, tirx.Add):
        return None
    for side in (index.a, index.b):
        if isinstance(side, tirx.Mul):
            for var, coef in ((side.a, side.b), (side.b, side.a)):
                if isinstance(var, tirx.Var) and var.same_as(x) and isinstance(coef, tirx.IntImm) and coef.value > 1:
                    return int(coef.value)
    return None


def _strided_columns(sch, block) -> list:
    """(read index, stride s) of each read of ``block`` whose column index is s * x + r, s > 1."""
    x = sch.get(block).iter_vars[3].var
    strided = [(index, _column_stride(read.region[-1].min, x)) for index, read in enumerate(sch.get(block).reads)]
    return [(index, stride) for index, stride in strided if stride is not None]


def _can_deinterleave(sch, buffer, stride: int) -> bool:
    """Whether ``buffer``'s columns can be stored deinterleaved by ``stride``: the function
    allocates it (the padding copy) and the stride divides its column count."""
    width = buffer.shape[-1]
    return any(buffer.same_as(b) for b in _allocated(sch)) and isinstance(width, tirx.IntImm) \
        and int(width.value) % stride == 0


def _deinterleavable(sch, block) -> bool:
    """Whether ``_deinterleave_columns`` makes ``block``'s one strided read contiguous."""
    strided = _strided_columns(sch, block)
    return len(strided) == 1 and _can_deinterleave(sch, sch.get(block).reads[strided[0][0]].source, strided[0][1])


def _deinterleave_columns(sch, block) -> None:
    """A convolution of stride s whose input is a buffer the function allocates (the padding
    copy): that buffer's columns stored as [row][j % s][j // s], so the read at column
    s * x + rx becomes [rx % s][x + rx // s], contiguous along x. NotApplicable where the input
    is not so (a parameter, a column count that s does not divide)."""
    strided = _strided_columns(sch, block)
    if not strided:
        raise NotApplicable("a strided window without channel vectors")
    index, stride = strided[0]
    if not _can_deinterleave(sch, sch.get(block).reads[index].source, stride):
        raise NotApplicable("a strided depthwise window over a buffer that cannot be deinterleaved")
    sch.transform_layout(block, ("read", index), index_map=lambda *axes: (
        *axes[:-1], axes[-1] % stride, axes[-1] // stride))
    # The copy's loops in the order it now stores (contiguous writes, strided reads).
    for producer in sch.get_producers(block):
        if sch.get(producer).writes[0].source.same_as(sch.get(block).reads[index].source):
            sch.transform_block_layout(producer, tirx.IndexMap.from_func(
                lambda *axes: (*axes[:-1], axes[-1] % stride, axes[-1] // stride),
                ndim=len(sch.get(producer).iter_vars)))
    if not _unit_stride(sch, block):
        raise NotApplicable("the deinterleaved columns are still strided")


def _channel_only_read(sch, block):
    """The index of ``block``'s read indexed by the output channel but not the output row (the
    weight of a dense convolution; a depthwise one's input is indexed by both), or None."""
    ivs = sch.get(block).iter_vars
    f, y, x = ivs[1].var, ivs[2].var, ivs[3].var
    uses = [{v for r in read.region for v in undefined_vars(r.min)} for read in sch.get(block).reads]
    by_channel = [i for i, used in enumerate(uses) if any(v.same_as(f) for v in used)]
    if len(by_channel) != 1 or any(v.same_as(y) or v.same_as(x) for v in uses[by_channel[0]]):
        return None
    return by_channel[0]


def _unit_stride(sch, block) -> bool:
    """Whether every read of ``block`` walks its last axis one element per step of the output's
    last iterator (an index x + rx, not 2x + rx)."""
    x = sch.get(block).iter_vars[3].var
    for read in sch.get(block).reads:
        last = read.region[-1].min
        if not any(v.same_as(x) for v in undefined_vars(last)):
            continue
        if not (isinstance(last, tirx.Var) or isinstance(last, tirx.Add) and any(
                isinstance(side, tirx.Var) and side.same_as(x) for side in (last.a, last.b))):
            return False
    return True


# --- rows -------------------------------------------------------------------------------------------

def _window_access(sch, block) -> bool:
    """Whether a read index of ``block`` mixes a spatial and a reduction iterator (y + ry)."""
    kinds = {iv.var: iv.iter_type for iv in sch.get(block).iter_vars}
    for read in sch.get(block).reads:
        for r in read.region:
            used = {kinds[v] for v in undefined_vars(r.min) if v in kinds}
            if len(used) > 1:
                return True
    return False


def _row_axes(sch, block, rows: int) -> int:
    """How many leading spatial iterators of ``block`` make up ``rows`` rows (unit ones after them
    included), the rest being its columns; NotApplicable where none do."""
    ivs = list(sch.get(block).iter_vars)
    kinds = _dom_kind(sch, block)
    count, prod = 0, 1
    while prod < rows and count < len(ivs) and kinds[count] == "S":
        prod *= _extent(ivs[count])
        count += 1
    while count < len(ivs) and kinds[count] == "S" and _extent(ivs[count]) == 1:
        count += 1
    if prod != rows or "S" in kinds[count:] and "R" in kinds[count:]:
        raise NotApplicable(f"block {sch.get(block).name_hint} is not {rows} rows")
    return count


def _vectorize_cols(sch, knobs, target, block, loops) -> None:
    """``loops`` (a block's columns, spatial) fused and split into vectors of the target's lanes."""
    if not loops:
        return
    col = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = _extent_of(sch, col)
    lanes = lanes_for(target, _write_dtype(sch, block))
    if any(extent % d == 0 for d in range(2, min(lanes, extent) + 1)):
        _, vector = sch.split(col, knobs.tile(col, 2, [lanes], max_innermost_factor=lanes))
        sch.vectorize(vector)


def rows(sch, target, knobs) -> None:
    """Reductions over the trailing axes of the same rows, elementwise stages around them: rows
    in parallel (the output's row loops fused and split), every stage computed per row, each
    reduction vectorised through an rfactor over a lane tile of its (fused) reduction loops."""
    if not any(is_reduction(sch, b) for b in root_blocks(sch)):
        raise NotApplicable("no reduction")
    inline_intermediates(sch)
    blocks = root_blocks(sch)
    if sum(is_output(sch, b) for b in blocks) != 1 or not is_output(sch, blocks[-1]):
        raise NotApplicable("not one output, written last")
    counts = set()
    for block in blocks:
        if is_reduction(sch, block):
            kinds = _dom_kind(sch, block)
            lead = len(kinds) - len(kinds.lstrip("S"))
            if lead == 0 or "S" in kinds[lead:]:
                raise NotApplicable("a reduction over a non-trailing axis")
            counts.add(_product(_extent(iv) for iv in sch.get(block).iter_vars[:lead]))
    if len(counts) != 1:
        raise NotApplicable("reductions over different rows")
    if any(_window_access(sch, b) for b in blocks if is_reduction(sch, b)):
        raise NotApplicable("a sliding-window reduction (a convolution)")
    row_count = counts.pop()
    names = [sch.get(b).name_hint for b in blocks]
    row_axes = {name: _row_axes(sch, sch.get_sblock(name), row_count) for name in names}

    # rfactor first: it needs the reduction loops as they are at the root.
    lanes = lanes_for(target, "float32")
    factored = {}
    for name in names:
        block = sch.get_sblock(name)
        if is_reduction(sch, block):
            reduce_loops = sch.get_loops(block)[row_axes[name]:]
            fused = sch.fuse(*reduce_loops) if len(reduce_loops) > 1 else reduce_loops[0]
            _, lane = sch.split(fused, knobs.tile(fused, 2, [lanes], max_innermost_factor=64))
            factored[name] = sch.rfactor(lane, factor_axis=row_axes[name])

    last = sch.get_sblock(names[-1])
    loops = sch.get_loops(last)
    lead, cols = loops[:row_axes[names[-1]]], loops[row_axes[names[-1]]:]
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    outer, row = sch.split(fused, knobs.tile(fused, 2, [max(1, min(16, row_count // 16))], max_innermost_factor=16))
    if row_count >= 2 and sum(_product(_extent(iv) for iv in sch.get(b).iter_vars) for b in blocks) \
            >= PARALLEL_MIN_ELEMENTS:
        sch.parallel(outer)
    if not is_reduction(sch, last):
        _vectorize_cols(sch, knobs, target, last, cols)
    for name in reversed(names[:-1]):
        sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
        if name in factored:
            sch.compute_at(factored[name], row, preserve_unit_loops=True)
    for name in names[:-1]:
        block = sch.get_sblock(name)
        if name in factored:
            # Under (outer, row): the lane loop, one unit loop per row axis, the outer reduction
            # loop (the rf block's iterators in order). Lanes go innermost and vectorised.
            rf = factored[name]
            lane, *units, reduce_outer = sch.get_loops(rf)[2:]
            sch.reorder(reduce_outer, *units, lane)
            sch.vectorize(lane)
            sch.decompose_reduction(rf, reduce_outer)
        elif not is_reduction(sch, block):
            n_cols = len(sch.get(block).iter_vars) - row_axes[name]
            loops = sch.get_loops(block)
            _vectorize_cols(sch, knobs, target, block, loops[len(loops) - n_cols:] if n_cols else [])


# --- anything else ----------------------------------------------------------------------------------

def parallel(sch, target, knobs) -> None:
    """Every block with enough work: its leading spatial loops, as few as give PARALLEL_TASKS
    tasks, fused and parallel; the loops inside left as written for LLVM."""
    changed = False
    for block in root_blocks(sch):
        if _product(_extent(iv) for iv in sch.get(block).iter_vars) < PARALLEL_MIN_ELEMENTS:
            continue
        kinds = _dom_kind(sch, block)
        lead = sch.get_loops(block)[:len(kinds) - len(kinds.lstrip("S"))]
        count, tasks = 0, 1
        while count < len(lead) and tasks < PARALLEL_TASKS:
            tasks *= _extent_of(sch, lead[count])
            count += 1
        if tasks < 2:
            continue
        sch.parallel(sch.fuse(*lead[:count]) if count > 1 else lead[0])
        changed = True
    if not changed:
        raise NotApplicable("no block with enough work to run in parallel")


# The rules in the order they are tried.
RULES = (("cpu_gemm", gemm), ("cpu_batched_gemm", batched_gemm), ("cpu_conv", conv), ("cpu_rows", rows),
         ("cpu_injective", injective), ("cpu_parallel", parallel))
