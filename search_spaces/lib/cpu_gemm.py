"""CPU GEMM in the manner of BLIS/Goto, as schedule primitives on a GEMM-shaped TensorIR block.

A block ``C[i, j] += A[i, k] * W[j, k]`` (its loops ending with the row loop i, the column loop
j and the reduction loop(s) k, fused into one; casts around the operands are fine) becomes:

- W packed into panels ``Wp[j // NR, k, j % NR]`` (``NR`` columns, contiguous along k) by a
  ``cache_read`` copy inside each parallel task: a task packs its NC columns into a buffer of its
  own right before its rows use them, so the panels are still in cache (a separate pass over all
  of W writes the panels to memory and reads them back: the kernel took 1.3-1.6x as long at
  m = 32-64, k = 4096 here). W is packed at every call; where MC splits the rows, once per row
  block. A producer of W (a dequantisation, a gather) becomes the packing copy itself.
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

Rows (columns) that are not a multiple of MR (NR), where no tile a row or two smaller (nor, on
Zen 4, one of half-width vectors) divides them (``register_tile``): ``pad_einsum`` pads the
block's domain, so the micro-kernel has no predicate (one in its k loop costs 2-3x); x (W) is
then copied once into the zero-padded buffer (in parallel only when large) and only the
epilogue is predicated; padded W columns are zeroed by the packing copy itself.

Knobs (``autofuse.pattern.Knobs``): tiles of the MR-row and NR-column tile counts (MC, NC) and
of k (KU). They only feed ``split``; every Python branch depends on shapes and the target.

Beyond the plain GEMM: loops before (i, j) are leading (batch) loops, fused into the parallel
loop; ``siblings`` are GEMMs over the same domain computed at the same tile (swiglu's gate and
up); int8 x int8 -> int32 multiplies two k per int32 lane and instruction (``pair_dot``); a
block pad_einsum cannot pad (reads through data, sliding windows) gets tiles that divide its
extents; a GEMM under an ``if`` (moe's skip test) accumulates in place, with nothing moved into
its nest (TVM 0.27's reverse_compute_at drops such nests).

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
import functools

from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.target import Target, codegen

@dataclasses.dataclass(frozen=True)
class VectorUnit:
    """fp32 lanes of one vector register and how many such registers the ISA has; ``half_rate_free``:
    a half-width FMA does as many flops a cycle as a full one (AVX-512 on 256-bit units)."""
    lanes: int
    registers: int
    half_rate_free: bool = False


# CPUs whose AVX-512 runs on 256-bit units (a zmm FMA issues as two ymm ones): Zen 4. Not Intel's
# (two 512-bit FMA units on servers: a ymm FMA does half the flops) nor Zen 5 (512-bit units).
HALF_RATE_FREE_CPUS = ("znver4",)


def vector_unit(target: Target) -> VectorUnit:
    """The target's vector unit, from the features its mcpu/mattr give LLVM."""
    def has(feature):
        return bool(codegen.target_has_features(feature, target))
    if has("avx512f"):
        return VectorUnit(16, 32, str(target.attrs.get("mcpu", "")) in HALF_RATE_FREE_CPUS)
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


# Rows fewer than MR a tile may take to divide m instead of padding it: no copy of x into a padded
# buffer and no predicated epilogue beat the two rows' FMAs (float32, 2-core znver4, interleaved:
# 4 rows against 6 padded ones, 128 x 256 x 256 156 against 164 us, 32 x 256 x 64 16.4 against
# 19.2, 512 x 1024 x 1024 9.46 against 9.66 ms).
ROWS_BELOW_MR = 2


def register_tile(unit: VectorUnit, m: int, n: int, pad: bool = True) -> RegisterTile:
    """MR x NR: NR of ``vectors`` registers (4 with 32 registers, 2 with 16), MR rows so that the
    MR * vectors accumulators, one row of W vectors and a broadcast fit the registers (6x64 on
    AVX-512, 6x16 on AVX2, 6x16 on NEON). Up to 8 rows (a row tile of moe_gate_topk's experts)
    take all of them, with as many vectors as then fit (8x48 or 8x32 on AVX-512). Where n is no
    multiple of NR, the widest smaller multiple of the lanes that divides n (with MR grown to
    fill the registers again), else, where half-width vectors cost no flops
    (``VectorUnit.half_rate_free``), several of them that divide n (5 x 8 lanes for n = 1000),
    else NR and n padded. Where m is no multiple of MR, up to ``ROWS_BELOW_MR`` rows fewer if
    that divides m (4 of 6 for m = 128), else m padded. Without ``pad`` (a block pad_einsum
    cannot pad), MR divides m and NR divides n: where no multiple of the lanes does, NR is
    several narrower vectors, else one partial vector."""
    top = 4 if unit.registers >= 32 else 2
    if m <= 8:
        top = max(1, min(top, (unit.registers - 1) // (m + 1)))
    dividing = [v for v in range(top, 0, -1) if n % (v * unit.lanes) == 0]
    vectors = dividing[0] if dividing else top  # none divides n: n is padded
    # Fewer vectors leave room for more rows than the full tile's 6; 8 is plenty.
    rows = max(1, min(8, (unit.registers - vectors - 1) // vectors, m))
    cols = vectors * unit.lanes
    lanes = unit.lanes
    if not dividing and (not pad or unit.half_rate_free):
        # Half-width vectors that divide n (56 = 7 x 8 lanes; on znver4 a ymm FMA does as many
        # flops per cycle as a zmm one), else (without pad) one partial vector. Padded columns
        # would cost more: their T.where makes TVM scalarise the epilogue of every tile.
        narrow = [(w, v) for w in (lanes // 2,) if w >= 8 and n % w == 0
                  for v in range(2 * top, 0, -1) if n % (v * w) == 0][:1]
        if narrow:
            lanes, vectors = narrow[0]
            rows = max(1, min(8, (unit.registers - vectors - 1) // vectors, m))
            cols = vectors * lanes
        elif not pad:
            cols = _divisor_below(n, lanes)
    if not pad:
        rows = _divisor_below(m, rows)
    elif m % rows:
        rows = next((r for r in range(rows, max(1, rows - ROWS_BELOW_MR) - 1, -1) if m % r == 0), rows)
    return RegisterTile(rows=rows, cols=cols, lanes=lanes)


def _einsum(sch, block) -> bool:
    """Whether every buffer access of ``block`` is indexed by its iteration variables alone (what
    pad_einsum can pad)."""
    names = {iv.var.name for iv in sch.get(block).iter_vars}
    regions = [*sch.get(block).reads, *sch.get(block).writes]
    return all(isinstance(r.min, tirx.Var) and r.min.name in names and int(r.extent) == 1
               for region in regions for r in region.region)


# ---- int8 x int8 -> int32: pairs of k per 32-bit lane --------------------------------------
#
# x86's int8 dot products (vpdpbusd, vpmaddubsw) take one operand unsigned; x and W are both
# signed here, so the dot runs on int16: two k at a time per int32 lane, both operands sign-
# extended (vpmovsxbw) and multiplied pairwise and summed into the lane (vpdpwssd with AVX-512
# VNNI, vpmaddwd + vpaddd without), exact for all int8 values. Two forms: ``broadcast`` (the
# packed tile: x's pair for every lane, W packed as [n/NR][k/2][NR][2] so a vector of lanes x 2
# bytes is one load) and per lane (the skinny dot: lane l takes its own pair of x and of W,
# 2 x lanes consecutive k of each).


def _pair_dot(lanes: int, broadcast: bool, intrinsic: str | None = None, accumulates: bool = False):
    """The description (``intrinsic`` None) or the implementation of a pair dot over ``lanes``
    int32 lanes: ``intrinsic`` on (x's pairs, W's pairs) as int16; vpdpwssd accumulates into c
    itself (``accumulates``), vpmaddwd returns the pair sums."""
    # broadcast: a (2,), b (lanes, 2) as packed; per lane: a and b 2 x lanes consecutive k.
    a_shape, b_shape = ((2,), (lanes, 2)) if broadcast else ((2 * lanes,), (2 * lanes,))

    def a_at(buf, vi, vk):
        return buf[vk] if broadcast else buf[vi * 2 + vk]

    def b_at(buf, vi, vk):
        return buf[vi, vk] if broadcast else buf[vi * 2 + vk]

    def whole(buf, shape):
        return buf[0:shape[0]] if len(shape) == 1 else buf[0:shape[0], 0:shape[1]]

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer(a_shape, "int8", offset_factor=1), b: T.Buffer(b_shape, "int8", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads(c[0:lanes], whole(a, a_shape), whole(b, b_shape))
            T.writes(c[0:lanes])
            for i, k in T.grid(lanes, 2):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    c[vi] = c[vi] + T.cast(a_at(a, vi, vk), "int32") * T.cast(b_at(b, vi, vk), "int32")

    if intrinsic is None:
        return desc
    wide = f"int16x{2 * lanes}"

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer(a_shape, "int8", offset_factor=1), b: T.Buffer(b_shape, "int8", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads(c[0:lanes], whole(a, a_shape), whole(b, b_shape))
            T.writes(c[0:lanes])
            xs = (T.reinterpret(T.broadcast(T.reinterpret(T.Cast("int16x2", a.vload([0], "int8x2")), dtype="int32"),
                                            lanes), dtype=wide)
                  if broadcast else T.Cast(wide, a.vload([0], dtype=f"int8x{2 * lanes}")))
            ws = T.Cast(wide, b.vload([0] * len(b_shape), dtype=f"int8x{2 * lanes}"))
            if accumulates:
                c[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id(intrinsic), c.vload([0], dtype=f"int32x{lanes}"), xs, ws,
                    dtype=f"int32x{lanes}")
            else:
                c[T.ramp(T.int32(0), 1, lanes)] = c.vload([0], dtype=f"int32x{lanes}") + T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id(intrinsic), xs, ws, dtype=f"int32x{lanes}")

    return impl


# name -> (target feature, lanes, LLVM intrinsic, accumulates); the first the target has wins.
PAIR_DOTS = {
    "vnni16": ("avx512vnni", 16, "llvm.x86.avx512.vpdpwssd.512", True),
    "avx512_16": ("avx512bw", 16, "llvm.x86.avx512.pmaddw.d.512", False),
    "avx2_8": ("avx2", 8, "llvm.x86.avx2.pmadd.wd", False),
}
PAIR_DOT_PREFIX = "autofuse_pair_dot_"


@functools.cache
def register_pair_dots() -> None:
    """Register the pair-dot intrinsics with TVM, once: at first use, not at import (parsing their
    12 TensorIR functions took 3 s of every command's start). Whatever replays a trace calls it
    first (``search_spaces.lib.register_intrinsics``)."""
    for name, (_, lanes, intrinsic, accumulates) in PAIR_DOTS.items():
        for broadcast in (True, False):
            TensorIntrin.register(f"{PAIR_DOT_PREFIX}{'bcast' if broadcast else 'lanes'}_{name}",
                                  _pair_dot(lanes, broadcast), _pair_dot(lanes, broadcast, intrinsic, accumulates),
                                  override=True)


def pair_dot(target: Target, lanes: int, broadcast: bool) -> str | None:
    """The int8 pair-dot intrinsic for ``target`` with ``lanes`` int32 lanes (x's pair broadcast
    to every lane, or a pair per lane), registered; or None."""
    name = next((f"{PAIR_DOT_PREFIX}{'bcast' if broadcast else 'lanes'}_{name}"
                 for name, (feature, width, _, _) in PAIR_DOTS.items()
                 if width == lanes and codegen.target_has_features(feature, target)), None)
    if name is not None:
        register_pair_dots()
    return name


def _int8_gemm(sch, block) -> bool:
    """Whether ``block`` multiplies int8 by int8 into int32."""
    reads = [str(r.source.dtype) for r in sch.get(block).reads]
    return str(sch.get(block).writes[0].source.dtype) == "int32" and reads.count("int8") >= 2


def _extent(sch, loop) -> int:
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        raise ValueError("the packed CPU GEMM needs static loop extents")
    return int(extent.value)


def _root_allocated(sch, buffer) -> bool:
    root = sch.get(sch.get_sblock("root"))
    return any(buf.same_as(buffer) for buf in root.alloc_buffers)


def _vectorize_cols(sch, loop, tile: RegisterTile, lanes: int | None = None):
    """NR columns as NR/lanes unrolled vectors of lanes (or of ``lanes``): one wide vector spills."""
    lanes = lanes or tile.lanes
    if tile.cols > lanes:
        outer, inner = sch.split(loop, [None, lanes])
        sch.unroll(outer)
        sch.vectorize(inner)
    else:
        sch.vectorize(loop)


def _tile_loops(sch, block, tile: RegisterTile, lanes: int | None = None):
    """Unroll the rows and vectorize the columns of the last two loops of ``block`` (where their
    extents are constant: an epilogue whose index is a fused one's quotient and remainder, as a
    convolution's output rows and columns, gets the extents of what the tile covers), in vectors
    of ``lanes`` (default the tile's)."""
    rows, cols = sch.get_loops(block)[-2:]
    if not all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in (rows, cols)):
        return
    sch.unroll(rows)
    _vectorize_cols(sch, cols, tile, lanes)


def _epilogue_lanes(n: int, tile: RegisterTile) -> int:
    """Lanes of the epilogue's vectors where n is padded to the tile: the widest power of two up to
    the tile's lanes dividing n, so the padded columns' predicate holds for a whole vector or for
    none; one that differs between a vector's lanes makes TVM scalarise the whole epilogue loop."""
    lanes = tile.lanes
    while lanes > 1 and n % lanes:
        lanes //= 2
    return lanes


# Copies of fewer elements run on one thread: waking the thread pool for a few KB (x's rows of a
# short sequence padded to MR) took 6 of a 32 x 64 x 64 GEMM's 15 us here (with 32 rows padded to
# 36, before ROWS_BELOW_MR).
PARALLEL_COPY_MIN_ELEMENTS = 1 << 18


def _parallel_copy(sch, block):
    """A copy block (padding) parallel over its outer loop where it is large enough; LLVM
    vectorizes the rest."""
    elements = 1
    for iv in sch.get(block).iter_vars:
        elements *= int(iv.dom.extent)
    if elements >= PARALLEL_COPY_MIN_ELEMENTS:
        sch.parallel(sch.get_loops(block)[0])


def _reduction_count(sch, block) -> int:
    return sum(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _gemm_loops(sch, block):
    """``block``'s loops as (leading, i, j, k): its loops must end with the row loop, the column
    loop and the reduction loops (several are fused into one k), any loops before them are
    leading (batch) loops."""
    loops = sch.get_loops(block)
    realize = _realize(sch, block)
    reducing = set()
    for iv, value in zip(sch.get(block).iter_vars, realize.iter_values):
        if iv.iter_type == tirx.IterVar.CommReduce:
            reducing.update(tirx.analysis.undefined_vars(value))

    def reduces(loop):
        return any(var.same_as(sch.get(loop).loop_var) for var in reducing)

    count = 0
    while count < len(loops) and reduces(loops[-1 - count]):
        count += 1
    if count < 1 or len(loops) < count + 2:
        raise ValueError(f"block {sch.get(block).name_hint!r} is no GEMM: its loops must end with (i, j, k...)")
    k = loops[-1] if count == 1 else sch.fuse(*loops[-count:])
    return list(loops[:-count - 2]), loops[-count - 2], loops[-count - 1], k


def _realize(sch, block):
    """The SBlockRealize of ``block`` (its iteration bindings): the body of its innermost loop."""
    node = sch.get(sch.get_loops(block)[-1]).body
    nodes = list(node.seq) if isinstance(node, tirx.SeqStmt) else [node]
    return next(n for n in nodes if isinstance(n, s_tir.SBlockRealize) and n.block.same_as(sch.get(block)))


def _pad(sch, block, i, j, rows: int, cols: int):
    """pad_einsum of ``block``'s domain: the iteration variables bound to loops ``i`` and ``j``
    padded to multiples of ``rows`` and ``cols``. Returns the padding copies it made (producers
    of the padded inputs, consumers of the padded output)."""
    loop_vars = {sch.get(i).loop_var: rows, sch.get(j).loop_var: cols}
    realize = _realize(sch, block)
    padding = [next((f for v, f in loop_vars.items() if value.same_as(v)), 1) for value in realize.iter_values]
    before = {sch.get(b).name_hint for b in sch.get_producers(block) + sch.get_consumers(block)}
    sch.pad_einsum(block, padding)
    made_in = [b for b in sch.get_producers(block) if sch.get(b).name_hint not in before]
    made_out = [b for b in sch.get_consumers(block) if sch.get(b).name_hint not in before]
    return made_in, made_out


def _pack_panels(sch, block, task, tile: RegisterTile, layout: str):
    """The copy of W into panels at the parallel ``task`` loop. W stored (n, k): 8 x 16 blocks
    transposed (LLVM shuffles them in registers; 2.8x faster than row by row, and NR x 16
    blocks were no faster and took 2-3 s more to compile); (k, n): NR contiguous columns at a
    time."""
    sch.compute_at(block, task, preserve_unit_loops=True)
    loops = sch.get_loops(block)
    loops = loops[1 + next(n for n, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(task))):]
    j, ks = (loops[0], loops[1:]) if layout == "nk" else (loops[-1], loops[:-1])
    k = sch.fuse(*ks) if len(ks) > 1 else ks[0]
    if layout == "nk":
        width = _divisor_below(tile.cols, 8)
        j0, j1, j2 = sch.split(j, [None, tile.cols // width, width])
        depth = _extent(sch, k)
        k0, k1 = sch.split(k, [None, max(v for v in (1, 2, 4, 8, 16) if depth % v == 0)])
        sch.reorder(j0, k0, j1, j2, k1)
        sch.unroll(j2)
        sch.vectorize(k1)
    else:
        j0, j1 = sch.split(j, [None, tile.cols])
        sch.reorder(j0, k, j1)
        _vectorize_cols(sch, j1, tile)


def _panels(nr: int, layout: str, rank: int, pairs: bool = False):
    """Index map of W (``rank`` axes: W[j, k...] for "nk", W[k..., j] for "kn") into panels
    [n/NR][k...][NR]; ``pairs`` (W (n, k)): [n/NR][k/2][NR][2], for the int8 pair dot."""
    if pairs:
        return lambda jj, kk: (jj // nr, kk // 2, jj % nr, kk % 2)
    if layout == "nk":
        return lambda jj, *ks: (jj // nr, *ks, jj % nr)
    return lambda *idx: (idx[-1] // nr, *idx[:-1], idx[-1] % nr)


def _divisor_below(count: int, want: int) -> int:
    """Largest divisor of ``count`` not above ``want``."""
    return max(d for d in range(1, max(1, min(want, count)) + 1) if count % d == 0)


def default_blocking(row_tiles: int, col_tiles: int, tile: RegisterTile, cores: int) -> tuple[int, int]:
    """Untuned (MC, NC) in register tiles: NC up to 4 panels and 128 columns (64 on AVX2, 128 on
    AVX-512), MC all rows. Where the blocks would be fewer than two per core or not spread
    evenly over the cores (11 column blocks on 2 cores: 6 and 5), fewer columns per block first
    (a task packs only its own columns), then fewer rows (each row block packs its columns
    again), until they spread evenly or there are 8 a core."""
    def even(blocks):
        return blocks >= 2 * cores and (blocks % cores == 0 or blocks >= 8 * cores)

    nc = _divisor_below(col_tiles, max(1, min(4, 128 // tile.cols)))
    while nc > 1 and not even(col_tiles // nc):
        nc = _divisor_below(col_tiles, nc - 1)
    mc = row_tiles
    for row_blocks in range(1, row_tiles + 1):
        mc = _divisor_below(row_tiles, -(-row_tiles // row_blocks))
        if even(col_tiles // nc * (row_tiles // mc)):
            break
    return mc, nc


# Rows up to which a GEMM reads W as stored rather than packing it (``schedule_skinny_gemm``).
SKINNY_ROWS = 64


def _check_layout(weight_layout: str):
    if weight_layout not in ("nk", "kn"):
        raise ValueError(f"weight_layout must be 'nk' or 'kn', not {weight_layout!r}")


def _cores(target: Target, cores: int | None) -> int:
    return cores or int(target.attrs.get("num-cores", 1) or 1)


def _inline_intermediates(sch, chain):
    """Inline the blocks of ``chain`` but its last whose output the function allocates in its
    root block; returns the others (their outputs are stored)."""
    kept = []
    for block in chain[:-1]:
        if _root_allocated(sch, sch.get(block).writes[0].source):
            sch.compute_inline(block)
        else:
            kept.append(block)
    return kept + chain[-1:]


def schedule_gemm(sch, matmul, knobs, target: Target, epilogue_blocks=(), weight_read: int = 1,
                  weight_layout: str = "nk", cores: int | None = None, siblings=(), parallel: bool = True):
    """The CPU GEMM for ``matmul`` and its ``epilogue_blocks`` (arguments as for
    ``schedule_packed_gemm``): skinny (W as stored) up to ``SKINNY_ROWS`` rows, packed above."""
    _, i, _, _ = _gemm_loops(sch, matmul)
    path = schedule_skinny_gemm if _extent(sch, i) <= SKINNY_ROWS else schedule_packed_gemm
    return path(sch, matmul, knobs, target, epilogue_blocks, weight_read, weight_layout, cores,
                siblings=siblings, parallel=parallel)


def _iter_index(sch, block, loop) -> int:
    """Index of the iteration variable of ``block`` bound to ``loop``."""
    var = sch.get(loop).loop_var
    return next(n for n, value in enumerate(_realize(sch, block).iter_values) if value.same_as(var))


def _loops_below(sch, block, loop):
    """``block``'s loops under ``loop``, in order."""
    loops = sch.get_loops(block)
    return loops[1 + next(n for n, rv in enumerate(loops) if sch.get(rv).same_as(sch.get(loop))):]


def _compute_at(sch, block, loop):
    """``compute_at`` keeping unit loops; returns the loops made, one per iteration variable of
    ``block`` in the order of its iteration variables (compute_at orders them its own way)."""
    sch.compute_at(block, loop, preserve_unit_loops=True)
    made = {int(sch.get(rv).loop_var.name[2:]): rv for rv in _loops_below(sch, block, loop)}
    return [made[n] for n in range(len(made))]


def schedule_packed_gemm(sch, matmul, knobs, target: Target, epilogue_blocks=(), weight_read: int = 1,
                         weight_layout: str = "nk", cores: int | None = None, pack: bool = True,
                         siblings=(), parallel: bool = True):
    """Schedule ``matmul`` (see the module docstring) and its ``epilogue_blocks``, consumers of its
    output in order (e.g. the bias + ReLU block), at the register tile.

    ``matmul``'s loops end with (i, j, k...): rows, columns, reduction(s). ``weight_read``: index
    in the block's reads of W, the operand read along j: stored ``W[j, k...]`` (``weight_layout``
    "nk", as nn.Linear stores it) or ``W[k..., j]`` ("kn"); either way packed into the same
    panels, unless ``pack`` is off (W "kn" read as stored). W's producer, if any (a
    dequantisation, a gather), becomes the packing copy. ``siblings``: further GEMM blocks over
    the same domain (swiglu's up projection beside its gate), each with its W packed and its own
    accumulators, computed at the same tile before the epilogue.

    The tile loops are those of the write-back (or the first epilogue block where the write-back
    is inlined): its last two loops are the rows and columns, any before them leading (batch)
    loops, fused into the parallel task loop (``parallel``; off where the caller runs them in
    parallel itself). Everything else is computed at its register tile. int8 x int8 -> int32
    GEMMs over W (n, k) with even k multiply pairs of k per instruction (``pair_dot``).
    Returns the tile."""
    _check_layout(weight_layout)
    if not pack and weight_layout != "kn":
        raise ValueError("W stored (n, k) is read across n by the register tile: it must be packed")
    gemms = [matmul, *siblings]
    _, i, j, _ = _gemm_loops(sch, matmul)
    m, n = _extent(sch, i), _extent(sch, j)
    tile = register_tile(vector_unit(target), m, n, pad=all(_einsum(sch, gemm) for gemm in gemms))
    cores = _cores(target, cores)
    pad_rows, pad_cols = m % tile.rows != 0, n % tile.cols != 0
    reductions = _reduction_count(sch, matmul)
    depth = _extent(sch, sch.get_loops(matmul)[-1])
    dot = (pair_dot(target, tile.lanes, broadcast=True) if _int8_gemm(sch, matmul) and pack and weight_layout == "nk"
           and reductions == 1 and depth % 2 == 0 and not siblings else None)
    padded_outputs, roles = [], []
    for gemm in gemms:
        _, gi, gj, _ = _gemm_loops(sch, gemm)
        if siblings:  # which iteration variables are rows and columns, for compute_at's loops
            roles.append((_iter_index(sch, gemm, gi), _iter_index(sch, gemm, gj)))
        if pad_rows or pad_cols:
            made_in, made_out = _pad(sch, gemm, gi, gj, tile.rows if pad_rows else 1, tile.cols if pad_cols else 1)
            weight = sch.get(gemm).reads[weight_read].source
            for copy in made_in:
                if not (pack and sch.get(copy).writes[0].source.same_as(weight)):
                    _parallel_copy(sch, copy)
            padded_outputs += made_out

    # W panels [n/NR][k...][NR]: a copy of W, its producer, or the padding copy.
    packings = {}
    for gemm in gemms if pack else ():
        weight = sch.get(gemm).reads[weight_read].source
        packing = next((p for p in sch.get_producers(gemm) if sch.get(p).writes[0].source.same_as(weight)), None)
        packing = packing if packing is not None else sch.cache_read(gemm, weight_read, "global")
        sch.transform_layout(gemm, ("read", weight_read),
                             index_map=_panels(tile.cols, weight_layout, len(weight.shape), pairs=dot is not None))
        packings[sch.get(gemm).name_hint] = packing

    # Accumulators in a local tile (for a buffer the function declares by a statement, as
    # T.alloc_buffer does, reindex + set_scope: cache_write of it defines the local buffer twice
    # in TVM 0.27), written back at the tile. Intermediates the function allocates in its root block go
    # (the padded accumulators; the function's own accumulator where it is declared so); one
    # declared by a statement, as T.alloc_buffer does, counts as an output to TVM and is stored.
    write_backs = []
    # Under an if (moe_gate_topk's skip test), TVM 0.27's reverse_compute_at drops the whole
    # nest: the GEMM then accumulates where it writes (LLVM keeps the tile in registers).
    guarded = any(isinstance(sch.get(loop).body, tirx.IfThenElse) for loop in sch.get_loops(matmul))
    if guarded and (siblings or epilogue_blocks or pack or padded_outputs):
        raise ValueError("a GEMM under an if takes no siblings, epilogue, packing or padding")
    for gemm in gemms if not guarded else ():
        if _root_allocated(sch, sch.get(gemm).writes[0].source):
            # cache_write keeps the output's layout (reindex would order the tile as the block's
            # spatial variables: sparse24's rows are its second, and its columns would not be
            # contiguous).
            write_backs.append(sch.cache_write(gemm, 0, "local"))
        else:
            write_backs.append(sch.reindex(gemm, ("write", 0)))
            sch.set_scope(gemm, 0, "local")
    chain = _inline_intermediates(sch, write_backs + padded_outputs + list(epilogue_blocks))

    row_tiles, col_tiles = -(-m // tile.rows), -(-n // tile.cols)
    mc, nc = default_blocking(row_tiles, col_tiles, tile, cores)

    def tile_loops(i, j):
        """(i0, j0, i1, j1, ir, jr): MC x NC blocks of MR x NR tiles (the MC, NC knobs)."""
        io, ir = sch.split(i, [None, tile.rows])
        jo, jr = sch.split(j, [None, tile.cols])
        i0, i1 = sch.split(io, knobs.tile(io, 2, [mc], max_innermost_factor=max(1, row_tiles)))
        j0, j1 = sch.split(jo, knobs.tile(jo, 2, [nc], max_innermost_factor=16))
        return i0, j0, i1, j1, ir, jr

    k_factors = []

    def k_loops(k):
        """(ko, ku, [pair]): KU steps unrolled (one knob for every GEMM), a pair for the dot."""
        pair = []
        if dot is not None:
            k, k2 = sch.split(k, [None, 2])
            pair = [k2]
        if not k_factors:
            k_factors.append(knobs.tile(k, 2, [4], max_innermost_factor=8))
        return (*sch.split(k, k_factors[0]), pair)

    if siblings:
        # The tile loops on the first block of the chain left, the GEMMs computed at its tile:
        # reverse_compute_at of the epilogue needs every GEMM under the loop first. (compute_at
        # refuses blocks that write an output, T.alloc_buffer's count as such: the blocks after
        # the first are moved by reverse_compute_at, which takes them.)
        *lead, ai, aj = sch.get_loops(chain[0])
        i0, j0, i1, j1, ir, jr = tile_loops(ai, aj)
        sch.reorder(i0, j0, i1, j1, ir, jr)
        sch.unroll(ir)
        _vectorize_cols(sch, jr, tile)
        nests = []
        for gemm, (row, col) in reversed(list(zip(gemms, roles))):
            loops = _compute_at(sch, gemm, j1)
            reductions = [loop for n, loop in enumerate(loops) if n not in (row, col) and
                          sch.get(gemm).iter_vars[n].iter_type == tirx.IterVar.CommReduce]
            units = [loop for n, loop in enumerate(loops) if n not in (row, col) and loop not in reductions]
            sch.reorder(*units, loops[row], loops[col], *reductions)
            ko, ku, pair = k_loops(sch.fuse(*reductions) if len(reductions) > 1 else reductions[0])
            sch.reorder(ko, ku, loops[row], loops[col], *pair)
            nests.append((gemm, ko, ku, loops[row], loops[col]))
        rest = chain[1:]
    else:
        # The tile loops on the GEMM's own loops (its output index may be no plain iteration
        # variable, as moe_gate_topk's, which compute_at cannot solve), the chain at its tile.
        lead, i, j, k = _gemm_loops(sch, matmul)
        i0, j0, i1, j1, ir, jr = tile_loops(i, j)
        ko, ku, pair = k_loops(k)
        sch.reorder(i0, j0, i1, j1, ko, ku, ir, jr, *pair)
        nests = [(matmul, ko, ku, ir, jr)]
        rest = chain if not guarded else []
    outer = sch.fuse(*(lead if parallel else []), i0, j0)
    if parallel:
        sch.parallel(outer)
    for block in rest:
        sch.reverse_compute_at(block, j1, preserve_unit_loops=True)
        _tile_loops(sch, block, tile, _epilogue_lanes(n, tile) if pad_cols else None)

    # The micro-kernels (W packed first: compute_at fails on a tensorized consumer).
    for gemm, ko, ku, row, col in nests:
        if pack:
            _pack_panels(sch, packings[sch.get(gemm).name_hint], outer, tile, weight_layout)
        # Vectorize/unroll before decompose_reduction: after it the update block is no longer a
        # complete reduction block and vectorize refuses it.
        sch.unroll(row)
        sch.unroll(ku)
        if dot is None:
            _vectorize_cols(sch, col, tile)
            init = sch.decompose_reduction(gemm, ko)
        else:
            vectors, lanes = sch.split(col, [None, tile.lanes])
            sch.unroll(vectors)
            init = sch.decompose_reduction(gemm, ko)
            sch.tensorize(lanes, dot)
        _tile_loops(sch, init, tile)
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
                         weight_layout: str = "nk", cores: int | None = None, siblings=(), parallel: bool = True):
    """Few rows: W read as stored, no packing (see the module docstring); arguments as for
    ``schedule_packed_gemm``. W (k, n) takes the packed path's register tile without the packing.
    W (n, k): per parallel task ``NJ``-row groups of W (a knob, NC), for each the rows of x in
    MR tiles, each a k loop (``KU`` steps unrolled, a knob) of lane-wide FMAs into MR x NJ partial
    sums, then the lane sums and the epilogue on them. W's producer (a dequantisation) is
    inlined where x is one row tile (each weight computed where it is read), else computed per
    group of NJ rows of W, which all row tiles then read. Returns the
    ``DotTile`` (or the packed path's ``RegisterTile`` for W (k, n))."""
    _check_layout(weight_layout)
    if weight_layout == "kn":
        return schedule_packed_gemm(sch, matmul, knobs, target, epilogue_blocks, weight_read, weight_layout,
                                    cores, pack=False, siblings=siblings, parallel=parallel)
    if siblings:
        raise ValueError("the skinny GEMM over W (n, k) takes one GEMM block")
    leading, i, j, k = _gemm_loops(sch, matmul)
    m, n, depth = _extent(sch, i), _extent(sch, j), _extent(sch, k)
    unit = vector_unit(target)
    tile = dot_tile(unit, m, n, depth)
    cores = _cores(target, cores)
    # W's producer (a dequantisation): inlined for one row tile, else computed per group of W
    # rows, for all row tiles to read.
    weight = sch.get(matmul).reads[weight_read].source
    producers = [p for p in sch.get_producers(matmul) if sch.get(p).writes[0].source.same_as(weight)]
    if m == tile.rows:
        for producer in producers:
            sch.compute_inline(producer)
        producers = []

    dot = (pair_dot(target, unit.lanes, broadcast=False) if _int8_gemm(sch, matmul) and depth % (2 * unit.lanes) == 0
           else None)
    if dot is not None:  # a pair of k per lane (see pair_dot)
        tile = dataclasses.replace(tile, lanes=unit.lanes)
        ko, kv, k2 = sch.split(k, [None, tile.lanes, 2])
    else:
        ko, kv = sch.split(k, [None, tile.lanes])
    partial = sch.rfactor(kv, factor_axis=len(leading) + 2)  # partial[..., i, j, lane], a spatial lane axis
    *_, i, j, ko, kv = sch.get_loops(partial)[:len(leading) + 4]
    io, ir = sch.split(i, [None, tile.rows])
    groups = n // tile.cols
    jo, jr = sch.split(j, [groups, tile.cols])
    # Untuned: at least 4 tasks per core where there are enough groups, up to 8 groups a task.
    per_task = _divisor_below(groups, max(1, min(8, groups // (4 * cores))))
    ko, ku = sch.split(ko, knobs.tile(ko, 2, [4], max_innermost_factor=8))
    jp, jg = sch.split(jo, knobs.tile(jo, 2, [per_task], max_innermost_factor=16))
    # W's NJ rows serve every row tile of x from L1/L2 before the next group.
    pair = [sch.get_loops(partial)[-1]] if dot is not None else []
    sch.reorder(jp, jg, io, ko, ku, ir, jr, kv, *pair)
    if parallel:
        sch.parallel(sch.fuse(*leading, jp) if leading else jp)
    sch.set_scope(partial, 0, "local")
    for producer in producers:
        sch.compute_at(producer, jg, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(producer)[-1])
    # The lane sums (the rfactored block) and the epilogue at the row tile, on the registers.
    chain = [matmul] + list(epilogue_blocks)
    for block in chain:
        sch.reverse_compute_at(block, io, preserve_unit_loops=True)
    chain = [matmul] + (_inline_intermediates(sch, chain[1:]) if len(chain) > 1 else [])
    sch.unroll(ir)
    sch.unroll(jr)
    sch.unroll(ku)
    if dot is None:
        sch.vectorize(kv)
    init = sch.decompose_reduction(partial, ko)
    if dot is not None:
        sch.tensorize(kv, dot)
    sch.vectorize(sch.get_loops(init)[-1])
    # The lane sums: lanes innermost (a horizontal reduction), rows and columns unrolled.
    lane, row, col = sch.get_loops(matmul)[-3:]
    sch.reorder(row, col, lane)
    sch.unroll(row)
    sch.unroll(col)
    for block in chain[1:]:
        for loop in sch.get_loops(block)[-2:]:
            sch.unroll(loop)
    return tile
