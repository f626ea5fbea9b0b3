"""softmax_dropout: y = dropout(softmax(x, axis=-1)), the row softmax with its dropout fused.

Dropout keeps an element with probability 1-p and scales it by 1/(1-p). Its mask is not random
state but a 32-bit hash of (seed, flat index): murmur3's fmix32 finaliser of
``uint32(row*cols + col) ^ uint32(seed * 0x9E3779B9)``, and an element is kept when the top 24
bits of the hash, ``hash >> 8``, are ``>= round(p * 2**24)``. All of it is uint32 arithmetic that
wraps, so the kernel and the numpy reference (``dropout_mask``) agree bit for bit, and the kernel
needs no mask input and writes no mask output.

Three stages, each a separate sblock: ``row_max`` (max over the row), ``exp_sum`` (sum of
exp(x - max), float32 accumulator) and ``norm_dropout`` (exp(x - max) / sum, masked and scaled).
Unfused, the row max and the sum each round-trip through memory and the exponentials go through a
fourth buffer; fused, one row at a time stays in L1 across the three passes. The exponential is
written out as a polynomial (``_exp``): ``T.exp`` becomes a scalar ``expf`` call per vector lane on
x86, which made the whole kernel ~10x slower (3.3 ms against 0.34 ms at 512x1024, 2 cores).

CUDA templates (``CudaRows``, shared with the normalization patterns): a row per warp or less
(rows up to 32 x 8 vectors of 16 bytes: 1024 float32 or 2048 half values; several rows per block
on threadIdx.y) or per block (longer rows); max and sum are cross-thread reductions (warp
shuffles, through shared memory across warps) and every thread keeps the row statistics in a
register (short rows) or reads them from shared memory (long rows). ``cuda_rows`` loads the row
of x once into registers with 16-byte loads and writes y with 16-byte stores; ``cuda_rows_smem``
keeps the row in shared memory instead, ``cuda_rows_reread`` loads it again in each pass (L1).
Knobs: threads per row, rows per block. Compiled here (nvcc, sm_90), not yet run on a GPU.

The dropout probability is the shape parameter ``p_permille`` (p = p_permille / 1000, default
100; 0 is inference, plain softmax, which is what models match); the mask seed is ``SEED``.
``build_with`` takes any p and seed.

Precision: float32, float16 or bfloat16 inputs and outputs; the row max, the exponentials and their
sum are float32 in every dtype, and each output is rounded to the dtype once. (The half-precision
tolerance is stated at ``PATTERN``.)
"""

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autofuse.pattern import Pattern, RelaxRule, ShapeParam, fit_tiles, onnx_model, template

P = 0.1
SEED = 42

_GOLDEN = 0x9E3779B9          # seed spreading constant (2**32 / golden ratio)
_FMIX_C1 = 0x85EBCA6B         # murmur3 fmix32 multipliers
_FMIX_C2 = 0xC2B2AE35


def _seed_mix(seed):
    return (int(seed) * _GOLDEN) & 0xFFFFFFFF


def _mul_wrap(a, c):
    """a * c mod 2**32 for a uint32 expression a. TVM emits a uint32 multiply as LLVM ``mul nuw``
    (no unsigned wrap), so the wrapping multiplies of the hash are poison and LLVM may fold the
    keep test to a constant (seen: p = 0.25, threshold 2**22, kept every element). The product
    of the zero-extended operands cannot wrap in 64 bits; LLVM narrows it back to a plain 32-bit
    ``mul``, so this costs nothing."""
    return tirx.Cast("uint32", tirx.Cast("uint64", a) * tirx.const(c, "uint64"))


def hash_keep(flat_index, mix: int, thresh: int):
    """The keep test of the dropout mask in TIR: fmix32 of ``uint32(flat_index) ^ mix``, kept when
    its top 24 bits reach ``thresh``. ``dropout_mask`` is the same in numpy."""
    h0 = tirx.Cast("uint32", flat_index) ^ tirx.const(mix, "uint32")
    h1 = _mul_wrap(h0 ^ (h0 >> tirx.const(16, "uint32")), _FMIX_C1)
    h2 = _mul_wrap(h1 ^ (h1 >> tirx.const(13, "uint32")), _FMIX_C2)
    h3 = h2 ^ (h2 >> tirx.const(16, "uint32"))
    return (h3 >> tirx.const(8, "uint32")) >= tirx.const(thresh, "uint32")


def _threshold(p):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")
    return int(round(p * (1 << 24)))


# Cephes expf: exp(x) = 2**n * e**f, n = round(x*log2(e)), |f| <= ln2/2, e**f a degree-7 polynomial.
_LOG2E = 1.44269504088896341
_LN2 = 0.6931471805599453
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


def _exp(v):
    """exp(v) for float32 v <= 0 as plain arithmetic, so a vectorised loop stays vectorised.

    LLVM lowers ``T.exp`` on x86 to one scalar ``expf`` call per lane (no vector math library), which
    makes the exponentials most of the kernel's time. This is the polynomial topi's ``fast_exp``
    uses (relative error below 3.1e-7 on [-87, 0], measured). v is clamped below at -87, where
    2**n is still a normal float (topi's -88.376 sits on the edge where n + 127 can round to -1,
    i.e. -inf, under a different FMA contraction), so anything lower gives exp(-87) ~ 1.6e-38.
    """
    f32 = "float32"
    # Plain sub-expressions rather than Let bindings: MetaSchedule's FLOP estimator (used by its
    # task scheduler) has no rule for a Let expression; TIR's CSE pass shares the repeats again.
    x = tirx.max(tirx.min(v, tirx.const(88.3762626647950, f32)), tirx.const(-87.0, f32))
    n = tirx.floor(x * tirx.const(_LOG2E, f32) + tirx.const(0.5, f32))
    f = x - n * tirx.const(_LN2, f32)
    poly = tirx.const(_EXP_POLY[0], f32)
    for c in _EXP_POLY[1:]:
        poly = poly * f + tirx.const(c, f32)
    poly = poly * f * f + f + tirx.const(1.0, f32)
    two_n = tirx.reinterpret(f32, tirx.Cast("int32", n + tirx.const(127.0, f32)) << tirx.const(23, "int32"))
    return two_n * poly


def build(shape, dtype):
    return build_with(shape, dtype, _p(shape), SEED)


def _p(shape):
    return shape.get("p_permille", 100) / 1000.0


def build_with(shape, dtype, p, seed):
    """The kernel with dropout probability ``p`` and mask seed ``seed`` baked in as constants."""
    rows, cols = shape["rows"], shape["cols"]
    if rows * cols >= 1 << 31:
        raise ValueError("rows*cols must fit the int32 flat index the mask hashes")
    mix = _seed_mix(seed)
    thresh = _threshold(p)
    scale = 1.0 / (1.0 - p)

    @T.prim_func(s_tir=True)
    def softmax_dropout(x: T.Buffer((rows, cols), dtype), y: T.Buffer((rows, cols), dtype)):
        T.func_attr({"global_symbol": "softmax_dropout", "tirx.noalias": True})
        row_max = T.sblock_alloc_buffer((rows,), "float32")
        row_sum = T.sblock_alloc_buffer((rows,), "float32")
        for i, k in T.grid(rows, cols):
            with T.sblock("row_max"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    row_max[vi] = T.min_value("float32")
                row_max[vi] = T.max(row_max[vi], T.Cast("float32", x[vi, vk]))
        for i, k in T.grid(rows, cols):
            with T.sblock("exp_sum"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    row_sum[vi] = T.float32(0)
                row_sum[vi] = row_sum[vi] + _exp(T.Cast("float32", x[vi, vk]) - row_max[vi])
        for i, j in T.grid(rows, cols):
            with T.sblock("norm_dropout"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast(dtype, T.Select(
                    hash_keep(vi * cols + vj, mix, thresh),
                    _exp(T.Cast("float32", x[vi, vj]) - row_max[vi])
                    * (T.float32(scale) / row_sum[vi]),
                    T.float32(0)))

    return softmax_dropout


def dropout_mask(rows, cols, p=P, seed=SEED):
    """The keep mask (bool, rows x cols) the kernel computes, in numpy uint32 arithmetic."""
    h = np.arange(rows * cols, dtype=np.uint32).reshape(rows, cols) ^ np.uint32(_seed_mix(seed))
    h = (h ^ (h >> np.uint32(16))) * np.uint32(_FMIX_C1)
    h = (h ^ (h >> np.uint32(13))) * np.uint32(_FMIX_C2)
    h = h ^ (h >> np.uint32(16))
    return (h >> np.uint32(8)) >= np.uint32(_threshold(p))


def reference_with(x, p, seed):
    xf = x.astype(np.float64)
    e = np.exp(xf - xf.max(axis=-1, keepdims=True))
    soft = e / e.sum(axis=-1, keepdims=True)
    keep = dropout_mask(x.shape[0], x.shape[1], p, seed)
    return np.where(keep, soft / (1.0 - p), 0.0).astype(x.dtype)


def reference(x, shape=None):
    return reference_with(x, _p(shape or {}), SEED)


def make_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
    return [(rng.standard_normal((shape["rows"], shape["cols"])) * 2.0).astype(np.float32).astype(dtype)]


def flops(shape):
    # max, sub+exp+add, sub+exp+mul+select per element (exp counted as one op), the hash ignored.
    return 9.0 * shape["rows"] * shape["cols"]


def nbytes(shape, dtype):
    return np.dtype(dtype).itemsize * 2 * shape["rows"] * shape["cols"]


def _vector_reduce(sch, knobs, name, default_width):
    """Split the reduction block's column loop into (outer, lanes) and rfactor the lanes: the rf
    block keeps one partial per lane (a spatial axis, so it vectorises) and the original block
    becomes a short reduction over the lanes. Returns (rf block, final block).

    rfactor runs before any compute_at: it needs the reduction to be the first child of its loop.
    """
    block = sch.get_sblock(name)
    _, k = sch.get_loops(block)
    _, lanes = sch.split(k, knobs.tile(k, 2, [default_width], max_innermost_factor=32))
    rf = sch.rfactor(lanes, factor_axis=1)
    return rf, block


@template("row_parallel")
def row_parallel(sch, target, knobs):
    """Rows split and run in parallel; both reductions compute_at the inner row loop, each
    vectorised through an rfactor over a lane tile; the normalise+dropout pass vectorised."""
    norm = sch.get_sblock("norm_dropout")
    i, j = sch.get_loops(norm)
    max_rf, max_fin = _vector_reduce(sch, knobs, "row_max", 32)
    sum_rf, sum_fin = _vector_reduce(sch, knobs, "exp_sum", 16)

    i0, i1 = sch.split(i, knobs.tile(i, 2, [4], max_innermost_factor=16))
    sch.parallel(i0)
    j0, j1 = sch.split(j, knobs.tile(j, 2, [32], max_innermost_factor=64))
    sch.vectorize(j1)
    # All four reduction blocks join the row loop (consumers first), so a row's max and sum are
    # per-thread scalars and the row stays in L1 across the three passes.
    for blk in (sum_fin, sum_rf, max_fin, max_rf):
        sch.compute_at(blk, i1, preserve_unit_loops=True)

    for rf in (max_rf, sum_rf):
        # compute_at regenerates the rf block's loops in its iter order: lanes, row (unit), k0.
        _, _, lanes, row, k0 = sch.get_loops(rf)
        sch.reorder(row, k0, lanes)
        sch.vectorize(lanes)
        sch.decompose_reduction(rf, k0)
    sch.annotate(i0, "pragma_auto_unroll_max_step", knobs.choice([0, 16, 64], 16))
    sch.annotate(i0, "pragma_unroll_explicit", 1)


# ---- CUDA: a row per group of threads, its reductions across those threads -------------------
#
# Shared by the row-reduction patterns (softmax_dropout here, layernorm_residual and
# gelu_add_layernorm): each pass over a row (the reductions, the elementwise prologue and epilogue)
# is split the same way, so that element (row, col) belongs to the same thread in every pass.

VECTOR_BYTES = 16       # one 128-bit load or store per thread: the widest a CUDA thread issues
WARP = 32
MAX_CHUNKS = 8          # most vectors per thread among the sampled thread counts
ROW_THREADS = 256       # default threads of a row longer than a warp can hold
BLOCK_THREADS = 128     # default threads per block when a warp (or less) holds a row
MAX_ROWS_PER_BLOCK = 16
SHARED_SLACK = 2048     # shared bytes left to the cross-warp reductions next to a cached row


def dtype_bytes(dtype) -> int:
    from tvm import DataType
    return DataType(str(dtype)).bits // 8


def rows_in_shared_memory(target, row_bytes: int) -> int:
    """How many rows of ``row_bytes`` a block's shared memory holds (0: not even one), leaving
    SHARED_SLACK bytes for the reductions' staging buffers."""
    limit = int(target.attrs.get("max_shared_memory_per_block", 48 * 1024)) - SHARED_SLACK
    return max(0, min(MAX_ROWS_PER_BLOCK, limit // row_bytes))


def row_keeping(sch, target, keep, block, item_bytes: int):
    """``(keep, rows per block)`` for a row kernel laid out on ``block``: where the row is to be
    kept in shared memory, as many rows as fit there, or none, and then the row is re-read
    (``keep`` None) instead."""
    if keep != "shared":
        return keep, MAX_ROWS_PER_BLOCK
    rows = rows_in_shared_memory(target, int(sch.get(sch.get_loops(block)[-1]).extent) * item_bytes)
    return (keep if rows else None), max(1, rows)


class CudaRows:
    """The thread layout of a row-reduction kernel, set up on ``block`` (a (row, col) pass; its
    loops become blockIdx.x, threadIdx.y | threadIdx.x, chunk, lane) and repeated on every other
    pass with ``attach``.

    A row is split into (threads, chunks, lanes): lanes a 16-byte vector (or the widest divisor of
    the row below it), threads per row a knob, chunks what is left per thread. ``contiguous`` puts
    the thread outermost, so that a thread owns one contiguous slice of each row (chunks x lanes
    values), which lets a per-thread ("local") buffer of the row compact to a register array;
    otherwise the chunk is outermost and consecutive threads read consecutive vectors (coalesced).

    Two modes, by the row's length (a shape fact, so no knob steers Python): a row of at most
    32 x MAX_CHUNKS vectors is held by a warp or less (up to 32 threads; rows per block a knob, on
    threadIdx.y), and its reductions are warp shuffles whose result stays in a register. A longer
    row gets a block of its own (up to 1024 threads): its reductions go across warps through shared
    memory, and their results are "shared" buffers. Why not a local result there too: TVM 0.27 maps
    a local result of a multi-warp reduction onto its volatile shared staging word, and every read
    of it (the polynomial exp reads the max ~20 times per element) becomes a volatile load; a
    register copy of it is merged back by storage rewriting. And why not several long rows per block
    with shared results: the barrier between threadIdx.x == 0 writing the result and the row's other
    threads reading it is left out when the buffer is indexed by threadIdx.y (the sync planner
    takes equal indices for a thread-private access).

    ``max_rows`` caps the rows per block (what a shared-memory copy of the rows allows).
    """

    def __init__(self, sch, knobs, block, itemsize, contiguous, max_rows=MAX_ROWS_PER_BLOCK):
        i, j = sch.get_loops(block)[-2:]
        cols = int(sch.get(j).extent)
        lanes = fit_tiles(cols, [max(1, VECTOR_BYTES // itemsize)])[-1]
        vectors = cols // lanes
        self.warp = vectors <= WARP * MAX_CHUNKS
        # Threads per row: a divisor of the row's vectors (a perfect split, no predicate), a
        # categorical knob over those leaving at most MAX_CHUNKS vectors per thread, so that the
        # unrolled per-thread code stays small. Default: the fewest chunks within the mode's
        # thread budget.
        cap = WARP if self.warp else ROW_THREADS
        fits = [d for d in range(1, min(WARP if self.warp else 1024, vectors) + 1) if vectors % d == 0]
        few = [d for d in fits if vectors // d <= MAX_CHUNKS and (self.warp or d > WARP)]
        # Powers of two only: TVM reduces other group sizes through a shared-memory tree whose
        # last steps assume a warp runs in lockstep (volatile, no __syncwarp), which CUDA has not
        # guaranteed since Volta. Where no power of two divides the row (vocab 32000: 8000
        # vectors), a power of two anyway, its last chunk predicated.
        choices = [d for d in few if d & (d - 1) == 0]
        if not choices:
            top = WARP if self.warp else 1024
            choices = [d for d in (2 ** e for e in range(11)) if d <= top and -(-vectors // d) <= MAX_CHUNKS
                       and (self.warp or d > WARP)]
        # A row too long for MAX_CHUNKS vectors even at 1024 threads: as many as the budget allows.
        choices = choices or [max(d for d in fits if d <= cap)]
        default = max([d for d in choices if d <= cap] or [min(choices)])
        threads = knobs.choice(sorted(choices), default)
        if self.warp:
            per_block = max(1, min(max_rows, BLOCK_THREADS // default))
            self.row_factors = knobs.tile(i, 2, [per_block], max_innermost_factor=max(1, max_rows))
        else:
            self.row_factors = [None, 1]
        self.stat_scope = "local" if self.warp else "shared"
        self.contiguous = contiguous
        jo, jv = sch.split(j, [None, lanes])
        self.col_factors = (threads, lanes)
        if contiguous:
            tx, jc = sch.split(jo, [threads, None])
        else:
            jc, tx = sch.split(jo, [None, threads])
        bx, ty = sch.split(i, self.row_factors)
        sch.reorder(bx, ty, tx, jc, jv)
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        self.block_loop = bx
        self.loops = (ty, tx, jc, jv)

    def attach(self, sch, block, reverse=False):
        """Move ``block`` (another pass over the same rows) under the thread block's loop and split
        it like the first. On a reduction, threadIdx.x binds a reduction loop: TVM lowers that to a
        cross-thread reduction (each thread's chunks first, then shuffles). Returns its (row,
        thread, chunk, lane) loops."""
        (sch.reverse_compute_at if reverse else sch.compute_at)(block, self.block_loop, preserve_unit_loops=True)
        r, k = sch.get_loops(block)[-2:]
        threads, lanes = self.col_factors
        ko, kv = sch.split(k, [None, lanes])
        if self.contiguous:
            tx, kc = sch.split(ko, [threads, None])
        else:
            kc, tx = sch.split(ko, [None, threads])
            sch.reorder(tx, kc)
        sch.bind(r, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        return r, tx, kc, kv

    def reduction(self, sch, block, reverse=False):
        """``attach`` for a row reduction, its result kept where this mode's readers want it."""
        sch.set_scope(block, 0, self.stat_scope)
        return self.attach(sch, block, reverse)


def vector_load(sch, block, buffer, chunk_loop):
    """What ``block`` reads of ``buffer`` in one chunk, through a register vector: one wide load."""
    cache = sch.cache_read(block, buffer, "local", consumer_blocks=[block])
    sch.compute_at(cache, chunk_loop, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(cache)[-1])
    return cache


def vector_store(sch, block, chunk_loop):
    """``block``'s output of one chunk through a register vector: one wide store."""
    cache = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(cache, chunk_loop, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(cache)[-1])
    return cache


def unroll_chunks(sch, loops):
    """Every pass's chunk and lane loops unrolled: a per-thread array is only registers when each
    index into it is a constant (and the lane loops compute one element at a time between a vector
    load and a vector store)."""
    for _, _, kc, kv in loops:
        sch.unroll(kc)
        sch.unroll(kv)


def _softmax_cuda(sch, target, knobs, keep):
    """``keep``: where the row of x lives across the three passes: "local" (registers), "shared"
    or None (each pass loads it again, through L1). A row too long for shared memory is re-read."""
    norm = sch.get_sblock("norm_dropout")
    row_max, exp_sum = sch.get_sblock("row_max"), sch.get_sblock("exp_sum")
    itemsize = dtype_bytes(sch.get(norm).reads[0].source.dtype)
    keep, max_rows = row_keeping(sch, target, keep, norm, itemsize)
    rows = CudaRows(sch, knobs, norm, itemsize, keep == "local", max_rows)
    loops = {norm: rows.loops}
    vector_store(sch, norm, rows.loops[2])
    for blk in (exp_sum, row_max):
        loops[blk] = rows.reduction(sch, blk)
    if keep is None:
        for blk, (_, _, kc, _) in loops.items():
            vector_load(sch, blk, "x", kc)
    else:
        # Read by all three passes; placed before the first, under the thread block's loop.
        _, _, kc, kv = rows.attach(sch, sch.cache_read(row_max, "x", keep))
        sch.unroll(kc)
        sch.vectorize(kv)
    unroll_chunks(sch, loops.values())


@template("cuda_rows", target_kinds=("cuda",))
def cuda_rows(sch, target, knobs):
    """A warp (short rows) or a block (long rows) per row; the row of x loaded once into
    registers, vectorised; max and sum as cross-thread reductions (warp shuffles, and shared
    memory across warps); the normalise+dropout pass writes y from the registers, vectorised."""
    _softmax_cuda(sch, target, knobs, "local")


@template("cuda_rows_smem", target_kinds=("cuda",))
def cuda_rows_smem(sch, target, knobs):
    """As cuda_rows, with the row of x staged in shared memory (loads coalesced across threads)
    instead of registers."""
    _softmax_cuda(sch, target, knobs, "shared")


@template("cuda_rows_reread", target_kinds=("cuda",))
def cuda_rows_reread(sch, target, knobs):
    """As cuda_rows, but each of the three passes loads its part of x again (L1/L2 hits after the
    first): no limit on the row length from registers or shared memory."""
    _softmax_cuda(sch, target, knobs, None)


def _relax_pattern():
    from tvm.relax.dpl import is_op, wildcard
    x = wildcard()
    root = is_op("relax.nn.softmax")(x)
    # The root is in the dict too: the rewriter gets matches by name only, and the axis is an
    # attribute of the matched call.
    return root, {"x": x, "call": root}


def _relax_rewrite(matched, kernel):
    """softmax(x, axis=last) on float32 x of rank >= 2 -> the kernel with p = 0 (inference), the
    leading axes flattened into rows."""
    from tvm import relax
    from autofuse.model.fusion import dtype_of, static_shape
    x, call = matched["x"], matched["call"]
    xs = static_shape(x)
    if xs is None or len(xs) < 2 or dtype_of(x) != "float32":
        return None
    if int(call.attrs.axis) not in (-1, len(xs) - 1):
        return None
    rows, cols = int(np.prod(xs[:-1])), xs[-1]
    if rows * cols >= 1 << 31:
        return None
    x2d = x if len(xs) == 2 else relax.op.reshape(x, (rows, cols))
    out = kernel({"rows": rows, "cols": cols, "p_permille": 0}, "float32", [x2d])
    return out if len(xs) == 2 else relax.op.reshape(out, xs)


def onnx_graph(shape, dtype):
    """Softmax times a constant keep/(1-p) mask. seed and p are compile-time constants, so the mask
    is one too: the baselines read it from memory where our kernel hashes it in registers."""
    from onnx import helper
    rows, cols = shape["rows"], shape["cols"]
    p = _p(shape)
    scale = np.where(dropout_mask(rows, cols, p, SEED), 1.0 / (1.0 - p), 0.0).astype(dtype)
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1), helper.make_node("Mul", ["s", "keep_scale"], ["y"])]
    return onnx_model("softmax_dropout", nodes, [("x", (rows, cols))], [("y", (rows, cols))], dtype,
                      {"keep_scale": scale})

PATTERN = Pattern(
    name="softmax_dropout",
    family="reduction",
    description="dropout(softmax(x, axis=-1)) with a hashed (seed, index) keep mask, p=0.1",
    shape_params=[ShapeParam("rows", 512, 8, "rows (softmax is over each row)"),
                  ShapeParam("cols", 1024, 64, "columns (the softmax axis)"),
                  ShapeParam("p_permille", 100, 100, "dropout probability in 1/1000 (0: inference)", minimum=0)],
    build=build,
    reference=reference,
    make_inputs=make_inputs,
    onnx_graph=onnx_graph,
    flops=flops,
    bytes=nbytes,
    dtypes=("float32", "float16", "bfloat16"),
    # The first CUDA template is the default of builds without records: the fastest default on the
    # H200 at both shapes measured (benchmarks/results/h200/check-rows-*.json, check-large-*.json).
    templates=[row_parallel, cuda_rows_reread, cuda_rows, cuda_rows_smem],
    relax_rules=[RelaxRule("softmax_last_axis", _relax_pattern, _relax_rewrite)],
)
