"""Loop steps the templates share: the unroll knob (CPU and GPU), and CPU register tiling of a
GEMM-shaped block (outer tiles in parallel, a register tile vectorised along j, the epilogue on the
tile while it is hot)."""


def unroll(sch, knobs, loop, depths=(0, 16, 64), default=16, explicit=1):
    """The auto-unroll depth of ``loop``'s body a knob over ``depths``; ``explicit`` 1 unrolls in
    TIR, 0 leaves a ``#pragma unroll`` to the backend compiler."""
    sch.annotate(loop, "pragma_auto_unroll_max_step", knobs.choice(list(depths), default))
    sch.annotate(loop, "pragma_unroll_explicit", explicit)


def parallel_register_tile(sch, knobs, block, i_tiles, j_tiles, k_tile, max_i=16, max_j=64, max_k=64,
                           k_innermost=False):
    """The (i, j, k) loops of ``block`` split into (outer, middle, register) tiles along i and j
    (``i_tiles``, ``j_tiles``: the inner two defaults) and (outer, inner) along k, ordered
    i0 j0 i1 j1 k0 [k1] i2 j2 [k1] (k1 last for a dot product along contiguous k), the outer tiles
    fused and parallel. Returns (parallel loop, j1 the register-tile loop, k0, j2 the vector loop)."""
    i, j, k = sch.get_loops(block)[-3:]
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, i_tiles, max_innermost_factor=max_i))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, j_tiles, max_innermost_factor=max_j))
    k0, k1 = sch.split(k, knobs.tile(k, 2, [k_tile], max_innermost_factor=max_k))
    sch.reorder(i0, j0, i1, j1, k0, *((i2, j2, k1) if k_innermost else (k1, i2, j2)))
    outer = sch.fuse(i0, j0)
    sch.parallel(outer)
    return outer, j1, k0, j2


def epilogue_on_tile(sch, block, epilogue, tile_loop, k_outer, vector_loop=None, vectorize_init=False):
    """``epilogue`` joins ``block`` at its register tile (read back while hot); ``vector_loop`` and
    the epilogue's innermost loop vectorised, the accumulator's init split out above ``k_outer``."""
    sch.reverse_compute_at(epilogue, tile_loop, preserve_unit_loops=True)
    if vector_loop is not None:
        sch.vectorize(vector_loop)
    init = sch.decompose_reduction(block, k_outer)
    if vectorize_init:
        sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(epilogue)[-1])


def vectorize_inner(sch, knobs, loop, lanes=16, max_lanes=64):
    """``loop`` split into (outer, ``lanes`` untuned) with the inner part vectorised."""
    _, inner = sch.split(loop, knobs.tile(loop, 2, [lanes], max_innermost_factor=max_lanes))
    sch.vectorize(inner)
