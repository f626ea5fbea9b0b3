"""Small kernels that index with an integer input, as the model importer's embedding lookups do:
shared by the tests of the runner's arguments (tests/test_tune.py, tests/test_rpc.py)."""

from tvm.script import tirx as T


@T.prim_func(s_tir=True)
def take(table: T.Buffer((64, 16), "float32"), ids: T.Buffer((32,), "int64"), out: T.Buffer((32, 16), "float32")):
    for i, j in T.grid(32, 16):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = table[ids[vi], vj]
