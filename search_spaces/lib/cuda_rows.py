"""CUDA row kernels: a row per group of threads, its reductions across those threads.

Every pass over a row (the reductions, the elementwise prologue and epilogue) is split the same way,
so that element (row, col) belongs to the same thread in every pass. ``CudaRows`` lays out the
first pass and attaches the others; ``vector_load``/``vector_store`` make the per-chunk accesses
16-byte vectors; ``unroll_chunks`` keeps per-thread arrays in registers.
"""

VECTOR_BYTES = 16       # one 128-bit load or store per thread: the widest a CUDA thread issues
WARP = 32
MAX_CHUNKS = 8          # most vectors per thread among the sampled thread counts
ROW_THREADS = 256       # default threads of a row longer than a warp can hold
BLOCK_THREADS = 128     # default threads per block when a warp (or less) holds a row
MAX_ROWS_PER_BLOCK = 16
SHARED_SLACK = 2048     # shared bytes left to the cross-warp reductions next to a cached row


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` not above ``cap`` (at least 1)."""
    return max(d for d in range(1, max(1, min(cap, n)) + 1) if n % d == 0)


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
        lanes = largest_divisor(cols, max(1, VECTOR_BYTES // itemsize))
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


def output_rows(sch, target, knobs, out, reductions, itemsize, keep, keep_bytes=None):
    """The usual start of a row kernel whose last pass ``out`` writes the output rows: where the
    row can be kept (``row_keeping``, rows of ``keep_bytes`` per element, default ``itemsize``),
    the layout set up on ``out`` with its vector store, the ``reductions`` attached (consumers
    first). Returns (layout, keep, {block: its loops})."""
    keep, max_rows = row_keeping(sch, target, keep, out, keep_bytes or itemsize)
    rows = CudaRows(sch, knobs, out, itemsize, keep == "local", max_rows)
    loops = {out: rows.loops}
    vector_store(sch, out, rows.loops[2])
    for blk in reductions:
        loops[blk] = rows.reduction(sch, blk)
    return rows, keep, loops


def residual_norm_rows(sch, target, knobs, keep, reductions, params, inputs=("x", "r"), add="add", norm="norm"):
    """A residual-then-normalise row kernel on CUDA (``add`` writes h = x + r, an output; the
    ``reductions`` over each row of h; ``norm`` writes y from h and the per-column ``params``).
    ``keep``: where the row of h lives for the passes after the add: "local" (registers),
    "shared", or None (the passes read back the h just stored, each thread its own elements,
    through L1). In the first two, the add writes the row there and a copy of it stores h with
    vector stores."""
    from .tir_math import dtype_bytes

    add_block = sch.get_sblock(add)
    passes = [sch.get_sblock(n) for n in reductions]
    norm_block = sch.get_sblock(norm)
    itemsize = dtype_bytes(sch.get(add_block).writes[0].source.dtype)
    keep, max_rows = row_keeping(sch, target, keep, add_block, itemsize)
    if keep is not None:
        store_h = sch.cache_write(add_block, 0, keep, consumer_blocks=passes + [norm_block])
    # Laid out on the add: h is an output, and compute_at refuses output blocks.
    rows = CudaRows(sch, knobs, add_block, itemsize, keep == "local", max_rows)
    loops = {add_block: rows.loops}
    for name in inputs:
        vector_load(sch, add_block, name, rows.loops[2])
    if keep == "local":
        sch.reverse_compute_at(store_h, rows.loops[2], preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(store_h)[-1])
    elif keep == "shared":
        # Once the whole row is in shared memory (one barrier), not per chunk.
        _, _, kc, kv = rows.attach(sch, store_h, reverse=True)
        sch.unroll(kc)
        sch.vectorize(kv)
    for blk in passes:
        loops[blk] = rows.reduction(sch, blk, reverse=True)
    loops[norm_block] = rows.attach(sch, norm_block, reverse=True)
    vector_store(sch, norm_block, loops[norm_block][2])
    for name in params:
        vector_load(sch, norm_block, name, loops[norm_block][2])
    if keep is None:
        for blk in passes + [norm_block]:
            vector_load(sch, blk, "h", loops[blk][2])
    unroll_chunks(sch, loops.values())
