"""sparse24_matmul_gather: y = x[idx] @ W^T (+ b) with W 2:4 structured-sparse and stored compressed.

Rows come from a table through an int32 index (an embedding lookup, tokens routed to an expert):
x (rows, k), idx (m,). W (n, k) keeps 2 of every 4 consecutive k as ``values`` (n, k/2) and ``meta``
(n, k/4) uint8 (bits 0-1 and 2-3: the kept entries' positions; ``compress_24``/``decompress_24``).
``bias`` (0/1) adds b. Unfused, a Gather writes the gathered rows that a dense GEMM reads back;
fused, rows are read through idx into an on-chip (k, m-tile) slab and the weights cost half the
floats plus the meta bytes. The gathered row is innermost in both intermediates, so with it
vectorised every slab load is contiguous whatever position a weight picks. The matmul block declares
its slab read as its group's 4 columns: region analysis cannot bound the bit arithmetic.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import Pattern, ShapeParam, template
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cuda_gemm import cuda_fetch_shared, cuda_pipeline, cuda_tile_output, cuda_unroll
from search_spaces.lib.onnx_graphs import typed_model
from search_spaces.lib.tiling import unroll


def _dims(shape):
    rows, m, n, k = shape["rows"], shape["m"], shape["n"], shape["k"]
    bias = int(shape.get("bias", 1))
    if k % 4:
        raise ValueError(f"k ({k}) must be a multiple of 4 for 2:4 sparsity")
    if bias not in (0, 1):
        raise ValueError(f"bias must be 0 or 1, not {bias}")
    return rows, m, n, k, bias


def compress_24(dense):
    """(values (n, k/2), meta (n, k/4) uint8) keeping the 2 largest-magnitude entries of each group
    of 4 along the last axis (ties: the lower position), positions ascending within a group."""
    dense = np.asarray(dense)
    n, k = dense.shape
    if k % 4:
        raise ValueError(f"k ({k}) must be a multiple of 4 for 2:4 sparsity")
    groups = dense.reshape(n, k // 4, 4)
    keep = np.sort(np.argsort(-np.abs(groups), axis=-1, kind="stable")[..., :2], axis=-1)
    values = np.take_along_axis(groups, keep, axis=-1).reshape(n, k // 2)
    meta = (keep[..., 0] | (keep[..., 1] << 2)).astype(np.uint8)
    return values, meta


def decode_meta(meta):
    """The two positions (each (n, k/4), int64) held in each meta byte."""
    meta = np.asarray(meta).astype(np.int64)
    return meta & 3, (meta >> 2) & 3


def decompress_24(values, meta):
    """The dense (n, k) W: each group's two values added at their positions."""
    values = np.asarray(values)
    n, half = values.shape
    if half % 2 or np.shape(meta) != (n, half // 2):
        raise ValueError(f"meta {np.shape(meta)} does not fit values {values.shape}: want (n, k/4)")
    first, second = decode_meta(meta)
    pairs = values.reshape(n, half // 2, 2)
    dense = np.zeros((n, half // 2, 4), values.dtype)
    lanes = np.arange(4)
    dense += np.where(first[..., None] == lanes, pairs[..., :1], 0)
    dense += np.where(second[..., None] == lanes, pairs[..., 1:], 0)
    return dense.reshape(n, 2 * half)


def build(shape, dtype):
    R, M, N, K, bias = _dims(shape)
    G = K // 4

    # Everything but the signature, which has b only with a bias: the gathered x^T, the
    # compressed matmul and ``epilogue(acc, column)`` rounded into y.
    @T.macro
    def gather_matmul(x, idx, values, meta, y, epilogue):
        xg = T.sblock_alloc_buffer((K, M), dtype)
        acc = T.sblock_alloc_buffer((N, M), "float32")
        for c, i in T.grid(K, M):
            with T.sblock("gather"):
                vc, vi = T.axis.remap("SS", [c, i])
                # Said outright: the row is data, and the inferred region would not be tighter.
                T.reads(idx[vi], x[0:R, vc])
                T.writes(xg[vc, vi])
                xg[vc, vi] = x[idx[vi], vc]
        for i, j, g, s in T.grid(M, N, G, 2):
            with T.sblock("matmul"):
                vi, vj, vg, vs = T.axis.remap("SSRR", [i, j, g, s])
                # The decoded column stays inside group g's 4; declared, so regions (compute_at
                # of the gather, buffer compaction) need not bound the bit arithmetic.
                T.reads(values[vj, vg * 2 + vs], meta[vj, vg], xg[vg * 4:vg * 4 + 4, vi], acc[vj, vi])
                T.writes(acc[vj, vi])
                with T.init():
                    acc[vj, vi] = T.float32(0)
                acc[vj, vi] = acc[vj, vi] + T.Cast("float32", values[vj, vg * 2 + vs]) * T.Cast(
                    "float32", xg[vg * 4 + T.bitwise_and(T.shift_right(T.Cast("int32", meta[vj, vg]), vs * 2), 3),
                                  vi])
        for i, j in T.grid(M, N):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast(dtype, epilogue(acc[vj, vi], vj))

    if bias:
        @T.prim_func(s_tir=True)
        def sparse24_matmul_gather(x: T.Buffer((R, K), dtype), idx: T.Buffer((M,), "int32"),
                                   values: T.Buffer((N, K // 2), dtype), meta: T.Buffer((N, G), "uint8"),
                                   b: T.Buffer((N,), dtype), y: T.Buffer((M, N), dtype)):
            T.func_attr({"global_symbol": "sparse24_matmul_gather", "tirx.noalias": True})
            gather_matmul(x, idx, values, meta, y, lambda a, j: a + T.Cast("float32", b[j]))
    else:
        @T.prim_func(s_tir=True)
        def sparse24_matmul_gather(x: T.Buffer((R, K), dtype), idx: T.Buffer((M,), "int32"),
                                   values: T.Buffer((N, K // 2), dtype), meta: T.Buffer((N, G), "uint8"),
                                   y: T.Buffer((M, N), dtype)):
            T.func_attr({"global_symbol": "sparse24_matmul_gather", "tirx.noalias": True})
            gather_matmul(x, idx, values, meta, y, lambda a, j: a)

    return sparse24_matmul_gather


def reference(x, idx, values, meta, b=None):
    w = decompress_24(values, meta).astype(np.float64)
    y = x[idx].astype(np.float64) @ w.T
    if b is not None:
        y = y + b
    return y.astype(x.dtype)


def make_inputs(shape, dtype, seed):
    """x, idx (uniform over the table: repeats and any order), values, meta [, b]; W is a seeded
    dense matrix compressed by ``compress_24``."""
    R, M, N, K, bias = _dims(shape)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, K)).astype(dtype)
    idx = rng.integers(0, R, size=M).astype(np.int32)
    # Half of k survives, so scale for k/2 terms.
    values, meta = compress_24(rng.standard_normal((N, K)) * np.sqrt(2.0 / K))
    inputs = [x, idx, values.astype(dtype), meta]
    if bias:
        inputs.append(rng.standard_normal(N).astype(dtype))
    return inputs


def flops(shape):
    _, m, n, k, bias = _dims(shape)
    return 2.0 * m * n * (k // 2) + (m * n if bias else 0)


def nbytes(shape, dtype):
    _, m, n, k, bias = _dims(shape)
    item = np.dtype(dtype).itemsize
    return item * (m * k + n * (k // 2) + bias * n + m * n) + 4 * m + n * (k // 4)


@template("packed_gather")
def packed_gather(sch, target, knobs):
    """The library's CPU GEMM (``search_spaces.lib.cpu_gemm``) with the roles of the operands
    turned: rows of the register tile are output features (one weight value broadcast per row
    and k), its vectors run along the gathered rows, read from the (k, m) slab that the gather
    fills per parallel task in panels of the tile's width (as stored for few output features);
    bias on the accumulator tile."""
    mm = sch.get_sblock("matmul")
    epi = sch.get_sblock("epilogue")
    i, j, g, s = sch.get_loops(mm)
    sch.reorder(j, i, g, s)
    ei, ej = sch.get_loops(epi)
    sch.reorder(ej, ei)
    schedule_gemm(sch, mm, knobs, target, epilogue_blocks=[epi], weight_layout="kn",
                  weight_read=[str(r.source.name) for r in sch.get(mm).reads].index("xg"))


@template("row_tiles")
def row_tiles(sch, target, knobs):
    """(m, n) outer tiles in parallel, each gathering its x rows through idx into a (k, m-tile)
    slab; (n x m) register tiles vectorised along the gathered rows, bias as each one finishes."""
    mm = sch.get_sblock("matmul")
    gather = sch.get_sblock("gather")
    epi = sch.get_sblock("epilogue")
    i, j, g, s = sch.get_loops(mm)
    i0, i1, i2 = sch.split(i, knobs.tile(i, 3, [1, 16], max_innermost_factor=32))
    j0, j1, j2 = sch.split(j, knobs.tile(j, 3, [16, 8], max_innermost_factor=8))
    g0, g1 = sch.split(g, knobs.tile(g, 2, [2], max_innermost_factor=8))
    sch.reorder(i0, j0, i1, j1, g0, g1, j2, s, i2)
    outer = sch.fuse(i0, j0)
    sch.parallel(outer)
    # Once per outer tile: every n of the tile reuses the slab, so its cost shrinks with n1*n2.
    sch.compute_at(gather, outer, preserve_unit_loops=True)
    # At j1 the accumulator tile is a few vectors held in registers across the whole k loop.
    sch.reverse_compute_at(epi, j1, preserve_unit_loops=True)
    sch.vectorize(i2)
    init = sch.decompose_reduction(mm, g0)
    sch.vectorize(sch.get_loops(init)[-1])
    # Contiguous stores into the slab; the row reads through idx stay scalar.
    sch.vectorize(sch.get_loops(gather)[-1])
    sch.vectorize(sch.get_loops(epi)[-1])
    unroll(sch, knobs, outer)


@template("cuda_gather_tiles", target_kinds=("cuda",))
def cuda_gather_tiles(sch, target, knobs):
    """One block per (m, n) output tile; per k tile (``g`` groups of 4) the block gathers its x
    rows through idx into a shared (4g x m-tile) slab and stages the values and meta of its n rows
    in shared memory, all three software-pipelined through registers; each thread accumulates a
    strided register tile in float32, bias on the way out (defaults: 32x64 tile, 8x32 threads,
    4x2 outputs each, 8 groups = 32 k per tile)."""
    mm = sch.get_sblock("matmul")
    gather = sch.get_sblock("gather")
    epi = sch.get_sblock("epilogue")
    reads = [r.source.name for r in sch.get(mm).reads]
    # The compaction of the shared slab must bound the decoded column 4g + ((meta >> 2s) & 3) by
    # the region the block declares (group g's 4 columns); it cannot bound the bit arithmetic.
    sch.annotate(mm, "explicit_read_region", [reads.index("xg")])
    i, j, g, _ = sch.get_loops(mm)
    # A warp of 32 threads along n: its lanes read 32 weight rows (values/meta padded to odd word
    # strides) and at most 4 slab words (the 4 columns of one group at one row), and store 32
    # consecutive columns of y.
    bx, _, tx, nty, ntx, _ = cuda_tile_output(sch, knobs, i, j, rows=(8, 4), cols=(32, 2))
    g0, _ = sch.split(g, knobs.tile(g, 2, [8], max_innermost_factor=8))
    sch.set_scope(mm, 0, "local")
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    # The slab: x rows read along k (coalesced through idx), stored transposed into rows padded
    # to an odd word stride, so the stores across its rows and the reads across its 4 group
    # columns hit distinct banks.
    sch.set_scope(gather, 0, "shared")
    sch.compute_at(gather, g0, preserve_unit_loops=True)
    c, r = sch.get_loops(gather)[-2:]
    sch.reorder(r, c)
    _, fy, fx = sch.split(sch.fuse(r, c), [None, nty, ntx])
    sch.bind(fy, "threadIdx.y")
    sch.bind(fx, "threadIdx.x")
    sch.storage_align(gather, 0, axis=0, factor=32, offset=1)
    sch.annotate(gather, "tirx.manifest_shared_memory_local_stage", 1)
    # Scalar (4-byte, still coalesced) copies keep the value rows at an odd word stride; 8-byte
    # vectors would need an even one, a 2-way conflict for 32 lanes on 32 rows.
    fetches = [cuda_fetch_shared(sch, mm, reads.index(name), g0, (nty, ntx), 1, k_major=True)
               for name in ("values", "meta")]
    sch.decompose_reduction(mm, g0)
    cuda_pipeline(sch, g0, fetches + [gather])
    cuda_unroll(sch, knobs, bx)


def onnx_graph(shape, dtype):
    """W rebuilt from values and meta every call (BitwiseAnd/BitShift decode the positions, Equal
    against 0..3 and Where place each value, Add merges the two), Gather of the x rows through idx,
    Gemm with transB (and b). Opset 18 for BitwiseAnd."""
    import onnx
    from onnx import helper

    R, M, N, K, bias = _dims(shape)
    G = K // 4
    consts = {
        "three": np.array(3, np.uint8),
        "two": np.array(2, np.uint8),
        "lanes": np.arange(4, dtype=np.int32),
        "axis2": np.array([2], np.int64),
        "pair_shape": np.array([N, G, 2], np.int64),
        "dense_shape": np.array([N, K], np.int64),
        "first": np.array([0], np.int64),
        "second": np.array([1], np.int64),
        "zero": np.array(0, dtype),
    }
    nodes = [
        helper.make_node("BitwiseAnd", ["meta", "three"], ["p0_u8"]),
        helper.make_node("BitShift", ["meta", "two"], ["meta_hi"], direction="RIGHT"),
        helper.make_node("BitwiseAnd", ["meta_hi", "three"], ["p1_u8"]),
        helper.make_node("Cast", ["p0_u8"], ["p0"], to=onnx.TensorProto.INT32),
        helper.make_node("Cast", ["p1_u8"], ["p1"], to=onnx.TensorProto.INT32),
        helper.make_node("Unsqueeze", ["p0", "axis2"], ["p0e"]),                       # (N, G, 1)
        helper.make_node("Unsqueeze", ["p1", "axis2"], ["p1e"]),
        helper.make_node("Equal", ["p0e", "lanes"], ["at0"]),                           # (N, G, 4)
        helper.make_node("Equal", ["p1e", "lanes"], ["at1"]),
        helper.make_node("Reshape", ["values", "pair_shape"], ["pairs"]),               # (N, G, 2)
        helper.make_node("Gather", ["pairs", "first"], ["v0"], axis=2),                 # (N, G, 1)
        helper.make_node("Gather", ["pairs", "second"], ["v1"], axis=2),
        helper.make_node("Where", ["at0", "v0", "zero"], ["w0"]),
        helper.make_node("Where", ["at1", "v1", "zero"], ["w1"]),
        helper.make_node("Add", ["w0", "w1"], ["w_groups"]),
        helper.make_node("Reshape", ["w_groups", "dense_shape"], ["w"]),                # (N, K)
        helper.make_node("Gather", ["x", "idx"], ["rows"], axis=0),                     # (M, K)
        helper.make_node("Gemm", ["rows", "w", "b"] if bias else ["rows", "w"], ["y"], transB=1),
    ]
    inputs = [("x", (R, K), dtype), ("idx", (M,), "int32"), ("values", (N, K // 2), dtype), ("meta", (N, G), "uint8")]
    return typed_model("sparse24_matmul_gather", nodes, inputs + [("b", (N,), dtype)] * bias, [("y", (M, N), dtype)],
                       consts, opset=18)


PATTERN = Pattern.from_module(
    globals(),
    description="x[idx] @ W^T + b with W 2:4 sparse, compressed (values + 2-bit positions), rows "
                "gathered through idx inside the kernel",
    shape_params=[ShapeParam("rows", 1024, 8, "rows of the activation table x"),
                  ShapeParam("m", 256, 12, "gathered rows (length of idx)"),
                  ShapeParam("n", 512, 16, "output features (rows of W)"),
                  ShapeParam("k", 512, 16, "input features (multiple of 4)", minimum=4),
                  ShapeParam("bias", 1, 1, "1: add b (n,), 0: no bias", minimum=0)],
    dtypes=("float32",),
    templates=[packed_gather, row_tiles, cuda_gather_tiles],
)
