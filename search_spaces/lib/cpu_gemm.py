"""CPU GEMM in the manner of BLIS/Goto, as schedule primitives on a GEMM-shaped TensorIR block.

A block ``C[i, j] += A[i, k] * W[j, k]`` (iterators spatial i, spatial j, reduction k, in that
order; casts around the operands are fine) becomes:

- W packed into panels ``Wp[j // NR, k, j % NR]`` (``NR`` columns, contiguous along k) by a
  ``cache_read`` copy inside each parallel task: a task packs its NC columns into a buffer of its
  own right before its rows use them, so the panels are still in cache (a separate pass over all
  of W writes the panels to memory and reads them back: 1.5-2x the time of the whole kernel at
  m = 64 here). W is packed at every call; where MC splits the rows, once per row block.
- An ``MR x NR`` register tile of accumulators: per k step one broadcast of x per row and
  ``NR / lanes`` vector FMAs per row, ``MR`` unrolled, ``NR`` split into vectors, ``KU`` k steps
  unrolled. The tile is sized from the target's vector width and register count
  (``register_tile``), not a knob: the target is fixed per tuning task.
- Cache blocking: MC rows x NC columns per parallel task, tasks over the M x N blocks fused into
  one parallel loop.
- The epilogue blocks (bias, activation, ...) run on the register tile right after its k loop.
  Intermediates between them that the function allocates in its root block are inlined, so only
  the output is stored; one declared by a statement (``T.alloc_buffer`` in a ``T.prim_func``
  body, as linear_bias_relu's ``acc``) is an output to TVM's schedule and is still stored once,
  from the registers.

Rows (columns) that are not a multiple of MR (NR): ``pad_einsum`` pads the block's domain, so the
micro-kernel has no predicate (one in its k loop costs 2-3x); x (W) is then copied once into the
zero-padded buffer and only the epilogue is predicated; padded W columns are zeroed by the
packing copy itself.

Knobs (``autofuse.pattern.Knobs``): tiles of the MR-row and NR-column tile counts (MC, NC) and
of k (KU). They only feed ``split``; every Python branch depends on shapes and the target.

Skinny GEMMs (m up to ``SKINNY_ROWS``, decoding and small batches; ``schedule_skinny_gemm``):
packing W costs more than the few rows gain from it, so W is read as stored. W (n, k): each
output is a dot product along contiguous k, split into vector lanes that ``rfactor`` makes a
spatial axis; an MR x NJ tile of lane-wide partial sums stays in registers over k (per step one
vector of x per row, one of W per column, MR * NJ FMAs), then each is summed across its lanes
and the epilogue runs. W (k, n): the register tile of the packed path over W as stored, which
is contiguous along n already. ``schedule_gemm`` picks the path by m.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.target import Target, codegen

@dataclasses.dataclass(frozen=True)
class VectorUnit:
    """fp32 lanes of one vector register and how many such registers the ISA has."""
    lanes: int
    registers: int


def vector_unit(target: Target) -> VectorUnit:
    """The target's vector unit, from the features its mcpu/mattr give LLVM."""
    def has(feature):
        return bool(codegen.target_has_features(feature, target))
    if has("avx512f"):
        return VectorUnit(16, 32)
    if has("avx"):
        return VectorUnit(8, 16)
    if has("neon") or has("sve"):
        return VectorUnit(4, 32)
    return VectorUnit(4, 16)  # SSE2: what LLVM assumes for x86-64 without mcpu


@dataclasses.dataclass(frozen=True)
class RegisterTile:
    rows: int        # MR
    cols: int        # NR, a multiple of lanes
    lanes: int


def register_tile(unit: VectorUnit, m: int, n: int) -> RegisterTile:
    """MR x NR: NR of ``vectors`` registers (4 with 32 registers, 2 with 16), MR rows so that the
    MR * vectors accumulators, one row of W vectors and a broadcast fit the registers (6x64 on
    AVX-512, 6x16 on AVX2, 6x16 on NEON); fewer rows when m is smaller. Where n is no multiple of
    NR, the widest smaller multiple of the lanes that divides n (with MR grown to fill the
    registers again), else NR and n padded."""
    top = 4 if unit.registers >= 32 else 2
    dividing = [v for v in range(top, 0, -1) if n % (v * unit.lanes) == 0]
    vectors = dividing[0] if dividing else top  # none divides n: n is padded
    # Fewer vectors leave room for more rows than the full tile's 6; 8 is plenty.
    rows = min(8, (unit.registers - vectors - 1) // vectors)
    return RegisterTile(rows=max(1, min(rows, m)), cols=vectors * unit.lanes, lanes=unit.lanes)


def _extent(sch, loop) -> int:
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        raise ValueError("the packed CPU GEMM needs static loop extents")
    return int(extent.value)


def _root_allocated(sch, buffer) -> bool:
    root = sch.get(sch.get_sblock("root"))
    return any(buf.same_as(buffer) for buf in root.alloc_buffers)


def _vectorize_cols(sch, loop, tile: RegisterTile):
    """NR columns as NR/lanes unrolled vectors of lanes: one wide vector spills."""
    if tile.cols > tile.lanes:
        outer, inner = sch.split(loop, [None, tile.lanes])
        sch.unroll(outer)
        sch.vectorize(inner)
    else:
        sch.vectorize(loop)


def _tile_loops(sch, block, tile: RegisterTile):
    """Unroll the rows and vectorize the columns of the last two loops of ``block``."""
    rows, cols = sch.get_loops(block)[-2:]
    sch.unroll(rows)
    _vectorize_cols(sch, cols, tile)


def _parallel_copy(sch, block):
    """A copy block (packing or padding) parallel over its outer loop; LLVM vectorizes the rest."""
    loops = sch.get_loops(block)
    sch.parallel(loops[0])


def _pack_panels(sch, block, task, tile: RegisterTile, layout: str):
    """The copy of W into panels at the parallel ``task`` loop. W stored (n, k): NR x 16 blocks
    transposed (LLVM shuffles them in registers; 2.8x faster than row by row); (k, n): NR
    contiguous columns at a time."""
    sch.compute_at(block, task, preserve_unit_loops=True)
    loops = sch.get_loops(block)[-2:]
    j, k = loops if layout == "nk" else loops[::-1]
    j0, j1 = sch.split(j, [None, tile.cols])
    if layout == "nk":
        depth = _extent(sch, k)
        k0, k1 = sch.split(k, [None, max(v for v in (1, 2, 4, 8, 16) if depth % v == 0)])
        sch.reorder(j0, k0, j1, k1)
        sch.unroll(j1)
        sch.vectorize(k1)
    else:
        sch.reorder(j0, k, j1)
        _vectorize_cols(sch, j1, tile)


def _divisor_below(count: int, want: int) -> int:
    """Largest divisor of ``count`` not above ``want``."""
    return max(d for d in range(1, max(1, min(want, count)) + 1) if count % d == 0)


def default_blocking(row_tiles: int, col_tiles: int, tile: RegisterTile, cores: int) -> tuple[int, int]:
    """Untuned (MC, NC) in register tiles: NC up to 4 panels and 128 columns (64 on AVX2, 128 on
    AVX-512), MC all rows, split only where fewer than two blocks per core would be left."""
    nc = _divisor_below(col_tiles, max(1, min(4, 128 // tile.cols)))
    row_blocks = -(-2 * cores // (col_tiles // nc))
    mc = _divisor_below(row_tiles, -(-row_tiles // row_blocks))
    return mc, nc


# Rows up to which a GEMM reads W as stored rather than packing it (``schedule_skinny_gemm``).
SKINNY_ROWS = 64


def _check_layout(weight_layout: str):
    if weight_layout not in ("nk", "kn"):
        raise ValueError(f"weight_layout must be 'nk' or 'kn', not {weight_layout!r}")


def _cores(target: Target, cores: int | None) -> int:
    return cores or int(target.attrs.get("num-cores", 1) or 1)


def schedule_gemm(sch, matmul, knobs, target: Target, epilogue_blocks=(), weight_read: int = 1,
                  weight_layout: str = "nk", cores: int | None = None):
    """The CPU GEMM for ``matmul`` and its ``epilogue_blocks`` (arguments as for
    ``schedule_packed_gemm``): skinny (W as stored) up to ``SKINNY_ROWS`` rows, packed above."""
    rows = _extent(sch, sch.get_loops(matmul)[0])
    path = schedule_skinny_gemm if rows <= SKINNY_ROWS else schedule_packed_gemm
    return path(sch, matmul, knobs, target, epilogue_blocks, weight_read, weight_layout, cores)


def schedule_packed_gemm(sch, matmul, knobs, target: Target, epilogue_blocks=(), weight_read: int = 1,
                         weight_layout: str = "nk", cores: int | None = None, pack: bool = True):
    """Schedule ``matmul`` (see the module docstring) and its ``epilogue_blocks``, consumers of its
    output in order (e.g. the bias + ReLU block), at the register tile. ``weight_read``: index in
    the block's reads of W, read as ``W[j, k]`` (``weight_layout`` "nk", as nn.Linear stores it)
    or ``W[k, j]`` ("kn"); either way packed into the same panels, unless ``pack`` is off (W
    "kn" read as stored). Returns the register tile used."""
    _check_layout(weight_layout)
    if not pack and weight_layout != "kn":
        raise ValueError("W stored (n, k) is read across n by the register tile: it must be packed")
    i, j, k = sch.get_loops(matmul)
    m, n = _extent(sch, i), _extent(sch, j)
    tile = register_tile(vector_unit(target), m, n)
    cores = _cores(target, cores)
    pad_rows, pad_cols = m % tile.rows != 0, n % tile.cols != 0
    epilogue_blocks = list(epilogue_blocks)
    if pad_rows or pad_cols:
        sch.pad_einsum(matmul, [tile.rows if pad_rows else 1, tile.cols if pad_cols else 1, 1])
        # The copy of the padded accumulator's valid part joins the epilogue, first.
        epilogue_blocks = [c for c in sch.get_consumers(matmul)] + epilogue_blocks

    # W panels [n/NR][k][NR]: a copy of W, or the padding copy.
    nr = tile.cols
    packing = None
    weight = sch.get(matmul).reads[weight_read].source
    for producer in sch.get_producers(matmul):
        if pack and sch.get(producer).writes[0].source.same_as(weight):
            packing = producer
        else:
            _parallel_copy(sch, producer)
    if pack:
        if packing is None:
            packing = sch.cache_read(matmul, weight_read, "global")
        panels = ((lambda jj, kk: (jj // nr, kk, jj % nr)) if weight_layout == "nk"
                  else (lambda kk, jj: (jj // nr, kk, jj % nr)))
        sch.transform_layout(matmul, ("read", weight_read), index_map=panels)

    i, j, k = sch.get_loops(matmul)
    m, n = _extent(sch, i), _extent(sch, j)
    row_tiles, col_tiles = m // tile.rows, n // tile.cols
    io, ir = sch.split(i, [row_tiles, tile.rows])
    jo, jr = sch.split(j, [col_tiles, tile.cols])
    mc, nc = default_blocking(row_tiles, col_tiles, tile, cores)
    i0, i1 = sch.split(io, knobs.tile(io, 2, [mc], max_innermost_factor=max(1, row_tiles)))
    j0, j1 = sch.split(jo, knobs.tile(jo, 2, [nc], max_innermost_factor=16))
    ko, ku = sch.split(k, knobs.tile(k, 2, [4], max_innermost_factor=8))
    sch.reorder(i0, j0, i1, j1, ko, ku, ir, jr)
    outer = sch.fuse(i0, j0)
    sch.parallel(outer)

    # Accumulators in a local tile; the write-back and the epilogue at the tile.
    # (reindex + set_scope: cache_write of a buffer the function declares by a statement, as
    # T.alloc_buffer does, defines the local buffer twice in TVM 0.27.)
    write_back = sch.reindex(matmul, ("write", 0))
    sch.set_scope(matmul, 0, "local")
    sch.reverse_compute_at(write_back, j1, preserve_unit_loops=True)
    for block in epilogue_blocks:
        sch.reverse_compute_at(block, j1, preserve_unit_loops=True)
    # Intermediates the function allocates in its root block go (the padded accumulator; the
    # function's own accumulator where it is declared so); one declared by a statement, as
    # T.alloc_buffer does, counts as an output to TVM and is stored once.
    chain = [write_back] + epilogue_blocks
    kept = []
    for block in chain[:-1]:
        if _root_allocated(sch, sch.get(block).writes[0].source):
            sch.compute_inline(block)
        else:
            kept.append(block)
    chain = kept + chain[-1:]

    # Vectorize/unroll before decompose_reduction: after it the update block is no longer a
    # complete reduction block and vectorize refuses it.
    sch.unroll(ir)
    _vectorize_cols(sch, jr, tile)
    sch.unroll(ku)
    init = sch.decompose_reduction(matmul, ko)
    _tile_loops(sch, init, tile)
    for block in chain:
        _tile_loops(sch, block, tile)
    if pack:
        _pack_panels(sch, packing, outer, tile, weight_layout)
    return tile


@dataclasses.dataclass(frozen=True)
class DotTile:
    """The skinny path's register tile over W (n, k): ``rows`` of x by ``cols`` rows of W, each
    output a ``lanes``-wide vector of partial sums along k."""
    rows: int        # MR
    cols: int        # NJ
    lanes: int       # k step of one vector FMA


def dot_tile(unit: VectorUnit, m: int, n: int, k: int) -> DotTile:
    """MR x NJ partial-sum vectors that fit the registers beside MR vectors of x (24 of 32, 12 of
    16): MR the largest divisor of m up to 4 (2 with 16 registers), NJ the largest divisor of n up
    to 8 that fits; the lanes the widest power of two up to the vector that divides k."""
    budget = unit.registers * 3 // 4
    rows = _divisor_below(m, 4 if unit.registers >= 32 else 2)
    cols = _divisor_below(n, min(8, budget // rows))
    lanes = max(v for v in (1, 2, 4, 8, 16, 32, 64) if v <= unit.lanes and k % v == 0)
    return DotTile(rows=rows, cols=cols, lanes=lanes)


def schedule_skinny_gemm(sch, matmul, knobs, target: Target, epilogue_blocks=(), weight_read: int = 1,
                         weight_layout: str = "nk", cores: int | None = None):
    """Few rows: W read as stored, no packing (see the module docstring); arguments as for
    ``schedule_packed_gemm``. W (k, n) takes the packed path's register tile without the packing.
    W (n, k): per parallel task ``NJ``-row groups of W (a knob, NC), for each the rows of x in
    MR tiles, each a k loop (``KU`` steps unrolled, a knob) of lane-wide FMAs into MR x NJ partial
    sums, then the lane sums and the epilogue on them. Returns the ``DotTile`` (or the packed
    path's ``RegisterTile`` for W (k, n))."""
    _check_layout(weight_layout)
    if weight_layout == "kn":
        return schedule_packed_gemm(sch, matmul, knobs, target, epilogue_blocks, weight_read, weight_layout,
                                    cores, pack=False)
    i, j, k = sch.get_loops(matmul)
    m, n, depth = _extent(sch, i), _extent(sch, j), _extent(sch, k)
    tile = dot_tile(vector_unit(target), m, n, depth)
    cores = _cores(target, cores)
    for producer in sch.get_producers(matmul):
        _parallel_copy(sch, producer)

    ko, kv = sch.split(k, [None, tile.lanes])
    partial = sch.rfactor(kv, factor_axis=2)  # partial[i, j, lane], a spatial lane axis
    i, j, ko, kv = sch.get_loops(partial)
    io, ir = sch.split(i, [None, tile.rows])
    groups = n // tile.cols
    jo, jr = sch.split(j, [groups, tile.cols])
    # Untuned: at least 4 tasks per core where there are enough groups, up to 8 groups a task.
    per_task = _divisor_below(groups, max(1, min(8, groups // (4 * cores))))
    ko, ku = sch.split(ko, knobs.tile(ko, 2, [4], max_innermost_factor=8))
    jp, jg = sch.split(jo, knobs.tile(jo, 2, [per_task], max_innermost_factor=16))
    # W's NJ rows serve every row tile of x from L1/L2 before the next group.
    sch.reorder(jp, jg, io, ko, ku, ir, jr, kv)
    sch.parallel(jp)
    sch.set_scope(partial, 0, "local")
    # The lane sums (the rfactored block) and the epilogue at the row tile, on the registers.
    chain = [matmul] + list(epilogue_blocks)
    for block in chain:
        sch.reverse_compute_at(block, io, preserve_unit_loops=True)
    kept = []
    for block in chain[1:-1]:
        if _root_allocated(sch, sch.get(block).writes[0].source):
            sch.compute_inline(block)
        else:
            kept.append(block)
    sch.unroll(ir)
    sch.unroll(jr)
    sch.vectorize(kv)
    sch.unroll(ku)
    init = sch.decompose_reduction(partial, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    # The lane sums: lanes innermost (a horizontal reduction), rows and columns unrolled.
    lane, row, col = sch.get_loops(matmul)[-3:]
    sch.reorder(row, col, lane)
    sch.unroll(row)
    sch.unroll(col)
    for block in kept + chain[-1:]:
        for loop in sch.get_loops(block)[-2:]:
            sch.unroll(loop)
    return tile
