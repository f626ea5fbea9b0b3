"""search_spaces.lib.cpu_gemm on linear_bias_relu (its CPU default): the register tile per ISA,
the default schedule against numpy on shapes that take each path (rows or columns not a multiple
of the tile, fewer rows than the tile, odd k), no predicate in the micro-kernel, the packing copy
that MetaSchedule's layout rewrite removes, knob samples. Tuning the template space and replaying
its records: tests/test_tune.py (linear_bias_relu)."""

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.script import tirx as T
from tvm.target import Target

from autofuse.accuracy import compare
from autofuse.pattern import Knobs
from autofuse.target import parse_target
from autofuse.verify import check_module
from search_spaces.gemm import linear_bias_relu as lbr
from search_spaces.lib.cpu_gemm import LAYOUT_REWRITE, RegisterTile, VectorUnit, register_tile, schedule_packed_gemm, vector_unit

TARGET = parse_target("llvm")
DEV = tvm.cpu()
AVX512 = Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
AVX2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
NEON = Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1"})


def _shape(m, n, k):
    return {"m": m, "n": n, "k": k}


def _default(func):
    """What runs without records: the first of the pattern's templates for the target."""
    first = lbr.PATTERN.templates_for(TARGET)[0]
    assert first.name == "packed_tile", "the packed GEMM is linear_bias_relu's CPU default"
    return first.apply(func, TARGET, tunable=False)


def _schedule(shape, target=TARGET, tunable=False, seed=None):
    func = lbr.build(shape, "float32")
    sch = s_tir.Schedule(func, seed=seed) if seed is not None else s_tir.Schedule(func)
    tile = schedule_packed_gemm(sch, sch.get_sblock("matmul"), Knobs(sch, tunable), target,
                                epilogue_blocks=[sch.get_sblock("bias_relu")])
    return func, sch, tile


def _predicated(sch, name):
    """Whether block ``name`` carries a predicate (a ``T.where`` before its reads)."""
    script = sch.mod.script()
    head = script[script.index(f'with T.sblock("{name}")'):]
    return "T.where" in head[:head.index("T.reads")]


def test_vector_unit_and_tile_follow_the_target():
    assert vector_unit(AVX512) == VectorUnit(16, 32)
    assert vector_unit(AVX2) == VectorUnit(8, 16)
    assert vector_unit(NEON) == VectorUnit(4, 32)
    assert vector_unit(Target({"kind": "llvm"})) == VectorUnit(4, 16)
    assert register_tile(VectorUnit(16, 32), 512, 1024) == RegisterTile(6, 64, 16)
    assert register_tile(VectorUnit(8, 16), 512, 1024) == RegisterTile(6, 16, 8)
    # n = 1000: no multiple of 16 columns divides it, 8 does, and more rows fill the registers
    assert register_tile(VectorUnit(8, 16), 512, 1000) == RegisterTile(8, 8, 8)
    # n = 20 has no multiple of the lanes: full width, n padded; m = 3 < MR: 3 rows
    assert register_tile(VectorUnit(8, 16), 3, 20) == RegisterTile(3, 16, 8)


# Each shape takes a path: m % MR != 0 (padded rows), m < MR, NR of 8 (n % 16 == 8), n padded
# (n % 8 != 0) with odd k (KU 1), and the plain one.
CASES = [(7, 48, 24), (1, 32, 16), (16, 40, 8), (13, 20, 5), (24, 64, 32)]


@pytest.mark.parametrize("m,n,k", CASES)
def test_default_matches_reference(m, n, k):
    shape = _shape(m, n, k)
    func = lbr.build(shape, "float32")
    sch = _default(func)
    result = check_module(lbr.PATTERN, tvm.tirx.build(sch.mod, target=TARGET), func, shape, "float32", DEV)
    assert result.ok, result.message


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_default_matches_reference(dtype):
    shape = _shape(7, 32, 16)
    func = lbr.build(shape, dtype)
    sch = _default(func)
    result = check_module(lbr.PATTERN, tvm.tirx.build(sch.mod, target=TARGET), func, shape, dtype, DEV)
    assert result.ok, result.message


@pytest.mark.parametrize("m,n", [(13, 32), (12, 20)])
def test_micro_kernel_has_no_predicate(m, n):
    _, sch, tile = _schedule(_shape(m, n, 8), target=AVX2)
    assert tile.rows == 6 and tile.cols == 16
    assert not _predicated(sch, "matmul_init") and not _predicated(sch, "matmul_update")
    assert _predicated(sch, "bias_relu"), "the padded rows/columns are cut off in the epilogue"
    # W in panels of NR columns, [n/NR][k][NR] (n padded to a multiple of NR)
    panels = -(-n // tile.cols)
    assert f"T.sblock_alloc_buffer(({panels}, 8, {tile.cols}))" in sch.mod.script()


def test_packing_is_a_layout_rewrite_copy_that_can_be_dropped():
    shape = _shape(13, 32, 24)
    func, sch, tile = _schedule(shape)
    assert LAYOUT_REWRITE in sch.get(sch.get_sblock("w_global")).annotations
    # After MetaSchedule's builder pass the kernel takes W packed: [n/NR][k][NR].
    packed = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(sch.mod)
    rt = tvm.tirx.build(packed, target=TARGET)
    x, w, b = lbr.make_inputs(shape, "float32", 0)
    nr = tile.cols
    wp = np.ascontiguousarray(w.reshape(shape["n"] // nr, nr, shape["k"]).transpose(0, 2, 1))
    y = tvm.runtime.tensor(np.zeros((13, 32), np.float32), DEV)
    rt(*(tvm.runtime.tensor(a, DEV) for a in (x, wp, b)), y)
    check = compare([y.numpy()], [lbr.reference(x, w, b)], accumulation=shape["k"])
    assert check.ok, check.message


def test_builds_for_avx512_and_neon():
    """Other ISAs' tiles lower and compile (they cannot run here)."""
    for target, tile in ((AVX512, RegisterTile(6, 64, 16)), (NEON, RegisterTile(6, 16, 4))):
        _, sch, got = _schedule(_shape(13, 128, 16), target=target)
        assert got == tile
        tvm.tirx.build(sch.mod, target=target)


def test_knob_samples_vary_and_match():
    shape = _shape(24, 64, 32)
    decisions = set()
    for seed in (1, 2, 3):
        func, sch, _ = _schedule(shape, tunable=True, seed=seed)
        decisions.add(str(sch.trace.decisions))
        result = check_module(lbr.PATTERN, tvm.tirx.build(sch.mod, target=TARGET), func, shape, "float32", DEV)
        assert result.ok, result.message
    assert len(decisions) > 1


def _linear_kn(m, n, k):
    """y = x @ W + b with W stored (k, n), as swiglu_ffn's weights are."""
    @T.prim_func(s_tir=True)
    def linear_kn(x: T.Buffer((m, k), "float32"), w: T.Buffer((k, n), "float32"), b: T.Buffer((n,), "float32"),
                  y: T.Buffer((m, n), "float32")):
        T.func_attr({"global_symbol": "linear_kn", "tirx.noalias": True})
        acc = T.sblock_alloc_buffer((m, n), "float32")
        for i, j, kk in T.grid(m, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + x[vi, vk] * w[vk, vj]
        for i, j in T.grid(m, n):
            with T.sblock("bias"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = acc[vi, vj] + b[vj]
    return linear_kn


@pytest.mark.parametrize("m,n,k", [(13, 32, 24), (6, 20, 8)])
def test_weight_stored_k_by_n(m, n, k):
    """W[k, j] packs into the same panels; an accumulator the root block allocates is inlined, so
    the epilogue reads the registers and only y is stored."""
    func = _linear_kn(m, n, k)
    sch = s_tir.Schedule(func)
    schedule_packed_gemm(sch, sch.get_sblock("matmul"), Knobs(sch, False), TARGET,
                         epilogue_blocks=[sch.get_sblock("bias")], weight_layout="kn")
    assert "acc[" not in sch.mod.script()
    rt = tvm.tirx.build(sch.mod, target=TARGET)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    y = tvm.runtime.tensor(np.zeros((m, n), np.float32), DEV)
    rt(*(tvm.runtime.tensor(a, DEV) for a in (x, w, b)), y)
    check = compare([y.numpy()], [x.astype(np.float64) @ w + b], accumulation=k)
    assert check.ok, check.message
