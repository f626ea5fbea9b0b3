"""CPU row reductions vectorised through rfactor: a reduction's innermost loop split into (outer,
lanes) and the lanes rfactored into a partial per lane, a spatial axis that vectorises; after the
compute-at moves the lanes go innermost and the init is split out."""


def rfactor_lanes(sch, knobs, name, default_lanes, factor_axis=1, max_lanes=64):
    """Split block ``name``'s innermost (reduction) loop into (outer, lanes), ``default_lanes`` wide
    untuned, and rfactor the lanes to axis ``factor_axis`` of the partials buffer. rfactor must run
    before any compute_at (it needs the reduction as the first child of its loop).
    Returns (rf block, final block)."""
    block = sch.get_sblock(name)
    loop = sch.get_loops(block)[-1]
    _, lanes = sch.split(loop, knobs.tile(loop, 2, [default_lanes], max_innermost_factor=max_lanes))
    return sch.rfactor(lanes, factor_axis=factor_axis), block


def vectorize_rf(sch, rf):
    """An rf block under its row loop (compute_at or reverse_compute_at) sits under (lanes, unit
    row, k_outer), in block-iter order, whatever the sampled factors: lanes go innermost and
    vectorised, the init above k_outer."""
    lanes, unit, k_outer = sch.get_loops(rf)[-3:]
    sch.reorder(k_outer, unit, lanes)
    sch.vectorize(lanes)
    sch.decompose_reduction(rf, k_outer)


def lanes_innermost(sch, rf, lanes, loops):
    """The rf block's ``lanes`` loop moved below ``loops`` (its loops from the row on, the outer
    reduction last) and vectorised, the init split out above that reduction loop."""
    sch.reorder(*loops, lanes)
    sch.vectorize(lanes)
    sch.decompose_reduction(rf, loops[-1])


def parallel_rows(sch, knobs, block, lanes, rows=4):
    """``block``'s (row, col) loops: rows split (``rows`` a task untuned) and the outer part
    parallel, cols split with the inner ``lanes`` vectorised. Returns (parallel loop, row loop)."""
    i, j = sch.get_loops(block)[-2:]
    i0, i1 = sch.split(i, knobs.tile(i, 2, [rows], max_innermost_factor=16))
    sch.parallel(i0)
    _, j1 = sch.split(j, knobs.tile(j, 2, [lanes], max_innermost_factor=64))
    sch.vectorize(j1)
    return i0, i1


def residual_norm_rows(sch, knobs, reductions, norm="norm", add="add"):
    """A residual-then-normalise row kernel (``add`` writes h, an output; the ``reductions`` over
    each row of h; ``norm`` writes y): rows split and in parallel on the add (compute_at refuses
    an output block, so every later pass is reverse-computed at its row loop, in dataflow order),
    each reduction vectorised through an rfactor over a lane tile, the normalise pass vectorised."""
    from .tiling import unroll, vectorize_inner

    add_block, norm_block = sch.get_sblock(add), sch.get_sblock(norm)
    factored = [rfactor_lanes(sch, knobs, name, 16) for name in reductions]
    i0, i1 = parallel_rows(sch, knobs, add_block, 16)
    for block in [b for pair in factored for b in pair] + [norm_block]:
        sch.reverse_compute_at(block, i1, preserve_unit_loops=True)
    vectorize_inner(sch, knobs, sch.get_loops(norm_block)[-1])
    for rf, _ in factored:
        vectorize_rf(sch, rf)
    unroll(sch, knobs, i0)
