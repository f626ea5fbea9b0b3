"""Small kernels that index with an integer input, as the model importer's embedding lookups do:
shared by the tests of the runner's arguments (tests/test_tune.py, tests/test_rpc.py) and of the
check's seeded data (tests/test_measure.py, tests/test_verify.py)."""

from tvm.script import tirx as T


@T.prim_func(s_tir=True)
def take(table: T.Buffer((64, 16), "float32"), ids: T.Buffer((32,), "int64"), out: T.Buffer((32, 16), "float32")):
    for i, j in T.grid(32, 16):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = table[ids[vi], vj]


@T.prim_func(s_tir=True)
def gather_nd(table: T.Buffer((1, 32), "float32"), idx: T.Buffer((1, 32, 2), "int64"),
              flags: T.Buffer((1, 32), "int32"), out: T.Buffer((1, 32), "float32")):
    # As TVM lowers an ONNX GatherND of a (1, 32) table (Llama's dynamo export): the (..., 2)
    # indices transposed first, component 0 then indexes the axis of extent 1, component 1 the
    # axis of 32; flags, an integer that indexes nothing.
    moved = T.sblock_alloc_buffer((2, 1, 32), "int64")
    for c, i, j in T.grid(2, 1, 32):
        with T.sblock("moved"):
            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
            moved[vc, vi, vj] = idx[vi, vj, vc]
    for i, j in T.grid(1, 32):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = table[moved[0, vi, vj], moved[1, vi, vj]] * T.Cast("float32", flags[vi, vj])
