"""search_spaces.lib.cpu_gemm on linear_bias_relu (its CPU default): the register tile per ISA,
the default schedule against numpy on shapes that take each path (skinny m; rows or columns not a
multiple of the tile, fewer rows than the tile, odd k), no predicate in the micro-kernel, the
packing inside each parallel task, the skinny path reading W as stored, knob samples. Tuning the
template space and replaying its records: tests/test_tune.py (linear_bias_relu)."""

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import ForKind

from autofuse.accuracy import compare
from autofuse.pattern import Knobs
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.verify import check_module
from search_spaces.gemm import linear_bias_relu as lbr
from search_spaces.lib.cpu_gemm import (SKINNY_ROWS, DotTile, RegisterTile, VectorUnit, default_blocking, dot_tile,
                                        register_tile, schedule_gemm, schedule_packed_gemm, schedule_skinny_gemm,
                                        vector_unit)

TARGET = parse_target("llvm")
DEV = tvm.cpu()
AVX512 = Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
AVX2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
NEON = Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1"})
ZNVER4 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})


def _shape(m, n, k):
    return {"m": m, "n": n, "k": k}


def _default(func):
    """What runs without records: the first of the pattern's templates for the target."""
    first = lbr.PATTERN.templates_for(TARGET)[0]
    assert first.name == "packed_tile", "the packed GEMM is linear_bias_relu's CPU default"
    return first.apply(func, TARGET, tunable=False)


def _schedule(shape, target=TARGET, tunable=False, seed=None, path=schedule_packed_gemm):
    func = lbr.build(shape, "float32")
    sch = s_tir.Schedule(func, seed=seed) if seed is not None else s_tir.Schedule(func)
    tile = path(sch, sch.get_sblock("matmul"), Knobs(sch, tunable), target,
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
    assert register_tile(VectorUnit(16, 32), 516, 1024) == RegisterTile(6, 64, 16)
    assert register_tile(VectorUnit(8, 16), 516, 1024) == RegisterTile(6, 16, 8)
    # m = 512 is no multiple of 6: 4 rows divide it (no padding); 13 has no divisor near 6: padded
    assert register_tile(VectorUnit(16, 32), 512, 1024) == RegisterTile(4, 64, 16)
    assert register_tile(VectorUnit(16, 32), 13, 1024) == RegisterTile(6, 64, 16)
    # n = 1000: no multiple of 16 columns divides it, 8 does, and more rows fill the registers
    assert register_tile(VectorUnit(8, 16), 512, 1000) == RegisterTile(8, 8, 8)
    # n = 20 has no multiple of the lanes: full width, n padded; m = 3 < MR: 3 rows
    assert register_tile(VectorUnit(8, 16), 3, 20) == RegisterTile(3, 16, 8)


def test_half_width_vectors_replace_padded_columns_where_they_cost_no_flops():
    """AVX-512 on 256-bit units (znver4): n = 1000 or 3000 (no multiple of 16 lanes) takes 5 ymm
    vectors of 8 lanes, no padding; where a zmm FMA does twice a ymm one's flops, n is padded."""
    assert vector_unit(ZNVER4) == VectorUnit(16, 32, half_rate_free=True)
    assert not vector_unit(AVX512).half_rate_free
    for m, n in ((128, 1000), (512, 1000), (2048, 3000)):
        assert register_tile(vector_unit(ZNVER4), m, n) == RegisterTile(4, 40, 8)
        assert register_tile(vector_unit(AVX512), m, n) == RegisterTile(4, 64, 16)
    # A multiple of 16 lanes keeps full-width vectors; no multiple of 8 either: still padded.
    assert register_tile(vector_unit(ZNVER4), 512, 1024) == RegisterTile(4, 64, 16)
    assert register_tile(vector_unit(ZNVER4), 128, 1004) == RegisterTile(4, 64, 16)
    _, sch, tile = _schedule(_shape(72, 120, 16), target=ZNVER4)
    assert tile == RegisterTile(4, 40, 8)
    # No padded copy and no predicated epilogue (which TVM scalarises, the cause of issue #21).
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    assert not any(name.endswith("_pad") for name in names), names
    assert not _predicated(sch, "bias_relu")
    _, padded, _ = _schedule(_shape(72, 120, 16), target=AVX512)
    assert _predicated(padded, "bias_relu")


def test_a_padded_epilogue_stays_vectorised():
    """n = 120 padded to the 64-column tile (skylake-avx512: no half-width tile): the epilogue runs
    in vectors of 8 lanes, which the padded columns' predicate covers whole, so TVM keeps it
    vector code (with 16 lanes the predicate splits one vector and the whole loop was scalar)."""
    import re

    _, sch, tile = _schedule(_shape(72, 120, 16), target=AVX512)
    assert tile.cols == 64 and _predicated(sch, "bias_relu")
    code = tvm.tirx.build(sch.mod, target=AVX512).inspect_source("ll")
    assert not re.search(r"fadd float ", code)
    assert re.search(r"fadd <8 x float>", code)


@pytest.mark.skipif(str(TARGET.attrs.get("mcpu", "")) != "znver4", reason="runs znver4 code")
def test_half_width_tile_matches_reference():
    shape = _shape(72, 120, 16)
    func, sch, _ = _schedule(shape, target=ZNVER4)
    result = check_module(lbr.PATTERN, tvm.tirx.build(sch.mod, target=ZNVER4), func, shape, "float32", DEV)
    assert result.ok, result.message


# Each shape takes a path. Skinny: m = 1, m prime (MR 1) with n = 100 and odd k (one lane), m = 16
# with n % 8 != 0. Packed (m > SKINNY_ROWS): m % MR != 0 (padded rows) with n padded (n % 8 != 0)
# and odd k (KU 1), NR of 8 (n % 16 == 8), and the plain one.
CASES = [(1, 32, 16), (7, 100, 5), (16, 20, 24), (67, 20, 5), (72, 40, 8), (72, 64, 32)]


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


def test_each_task_packs_its_own_panels():
    """The packing copy runs inside the parallel loop, into a buffer of the task's columns only."""
    _, sch, tile = _schedule(_shape(13, 512, 24))
    outer = sch.get_loops(sch.get_sblock("w_global"))[0]
    assert sch.get(outer).kind == ForKind.PARALLEL
    assert sch.get(sch.get_loops(sch.get_sblock("matmul_update"))[0]).same_as(sch.get(outer))
    lowered = tvm.s_tir.transform.LowerOpaqueBlock()(tvm.s_tir.transform.CompactBufferAllocation()(
        tvm.s_tir.transform.ConvertBlocksToOpaque()(tvm.s_tir.transform.PlanAndUpdateBufferAllocationLocation()(
            tvm.s_tir.transform.LowerInitBlock()(sch.mod))))).script()
    parallel_at = lowered.index("T.parallel(")
    alloc_at = lowered.index("w_global = T.alloc_buffer(")
    _, panels = default_blocking(-(-13 // tile.rows), 512 // tile.cols, tile, 2)
    assert panels == 2 and tile.cols == 64, "8 column panels, 4 tasks on 2 cores"
    assert alloc_at > parallel_at and f"T.alloc_buffer(({panels}, 24, {tile.cols})" in lowered, "a task's panels"


def test_only_a_large_padding_copy_runs_in_parallel():
    """x's rows padded to MR: a short sequence's copy is a few KB, not worth waking the thread pool
    for (the GEMM itself stays parallel); a large one is split over the cores."""
    for m, k, parallel in ((31, 64, False), (4099, 64, True)):
        _, sch, tile = _schedule(_shape(m, 64, k), target=AVX512)
        assert m % tile.rows, "the rows are padded"
        kinds = [sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock("x_pad"))]
        assert (ForKind.PARALLEL in kinds) == parallel, (m, kinds)
        assert ForKind.PARALLEL in [sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock("matmul_update"))]


def test_untuned_blocking_spreads_evenly_over_the_cores():
    tile = RegisterTile(6, 64, 16)
    assert default_blocking(86, 16, tile, 2) == (86, 2)   # 512 x 1024: 8 blocks of 2 panels, all rows
    assert default_blocking(43, 4, tile, 2) == (43, 1)    # 256^3: one panel a block before splitting rows
    assert default_blocking(22, 11, tile, 2) == (11, 1)   # 11 panels: rows halved, 22 blocks
    assert default_blocking(1, 11, tile, 2) == (1, 1)     # nothing left to split


def test_dot_tile_and_path_follow_the_shape():
    unit = VectorUnit(16, 32)
    assert dot_tile(unit, 1, 768, 768) == DotTile(1, 8, 16)
    assert dot_tile(unit, 16, 768, 768) == DotTile(4, 6, 16)
    assert dot_tile(unit, 7, 100, 5) == DotTile(1, 5, 1)
    assert dot_tile(VectorUnit(8, 16), 16, 1000, 1000) == DotTile(2, 5, 8)
    for m, packs in ((SKINNY_ROWS, False), (SKINNY_ROWS + 1, True)):
        func = lbr.build(_shape(m, 32, 16), "float32")
        sch = s_tir.Schedule(func)
        schedule_gemm(sch, sch.get_sblock("matmul"), Knobs(sch, False), TARGET,
                      epilogue_blocks=[sch.get_sblock("bias_relu")])
        assert ('"w_global"' in sch.mod.script()) == packs


def test_skinny_reads_w_as_stored():
    """m <= SKINNY_ROWS: no copy of W; the lanes of the k loop are a vectorised spatial axis of
    a local partial-sum tile, summed across after the k loop."""
    _, sch, tile = _schedule(_shape(4, 64, 32), path=schedule_skinny_gemm)
    script = sch.mod.script()
    assert tile == DotTile(4, 4, 16)
    assert '"w_global"' not in script and "w[" in script
    update = sch.get_sblock("matmul_rf_update")
    assert sch.get(sch.get_loops(update)[-1]).kind == ForKind.VECTORIZED
    assert sch.get(sch.get_loops(update)[0]).kind == ForKind.PARALLEL
    assert "acc_rf_local" in script


def test_builds_for_avx512_and_neon():
    """Other ISAs' tiles lower and compile (they cannot run here)."""
    for target, tile in ((AVX512, RegisterTile(6, 64, 16)), (NEON, RegisterTile(6, 16, 4))):
        _, sch, got = _schedule(_shape(13, 128, 16), target=target)
        assert got == tile
        tvm.tirx.build(sch.mod, target=target)
    _, sch, got = _schedule(_shape(3, 64, 32), target=NEON, path=schedule_skinny_gemm)
    assert got == DotTile(3, 8, 4)
    tvm.tirx.build(sch.mod, target=NEON)


@pytest.mark.parametrize("path,shape", [(schedule_packed_gemm, _shape(24, 64, 32)),
                                        (schedule_skinny_gemm, _shape(8, 256, 512))], ids=["packed", "skinny"])
def test_knob_samples_vary_and_match(path, shape):
    decisions = set()
    for seed in (1, 2, 3):
        func, sch, _ = _schedule(shape, tunable=True, seed=seed, path=path)
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


# The GEMM-shaped patterns whose CPU default stands on this library, at shapes off the tile:
# skinny (rows <= SKINNY_ROWS) and packed, columns not a multiple of the vector.
PATTERN_CASES = [
    ("swiglu_ffn", {"tokens": 7, "hidden": 16, "inter": 100, "p_permille": 0}, "packed_gemms"),
    ("swiglu_ffn", {"tokens": 70, "hidden": 24, "inter": 40}, "packed_gemms"),
    # int8: pair dots (k even; k % 32 == 0 for the skinny one) and plain int32 tiles (odd k)
    ("int8_matmul_dequant", {"m": 7, "n": 100, "k": 64}, "int8_packed"),
    ("int8_matmul_dequant", {"m": 7, "n": 100, "k": 24, "relu": 0}, "int8_packed"),
    ("int8_matmul_dequant", {"m": 70, "n": 100, "k": 24}, "int8_packed"),
    ("int8_matmul_dequant", {"m": 67, "n": 20, "k": 5}, "int8_packed"),
    # woq: dequantised in the dot (one row tile), per group of W rows (several), into the panels
    ("woq_matmul", {"m": 2, "n": 32, "k": 64, "group": 32, "bits": 4}, "packed_dequant"),
    ("woq_matmul", {"m": 7, "n": 100, "k": 64, "group": 32, "bits": 8}, "packed_dequant"),
    ("woq_matmul", {"m": 70, "n": 20, "k": 64, "group": 32, "bits": 4}, "packed_dequant"),
    # sparse24: tile rows are output features (skinny: the slab as stored), tiles that divide
    # (no padding: the matmul reads its slab through the meta bits)
    ("sparse24_matmul_gather", {"rows": 20, "m": 30, "n": 12, "k": 24}, "packed_gather"),
    ("sparse24_matmul_gather", {"rows": 20, "m": 7, "n": 100, "k": 24}, "packed_gather"),
    ("sparse24_matmul_gather", {"rows": 20, "m": 100, "n": 70, "k": 24, "bias": 0}, "packed_gather"),
    # moe: under the experts' skip test (accumulated in place), not the default (see its docstring)
    ("moe_gate_topk", {"tokens": 13, "hidden": 24, "inter": 40, "experts": 4, "k": 2}, "packed_experts"),
    # conv: tile rows are output channels, columns output columns (a partial vector; 7 x 8 lanes)
    ("conv2d_bn_relu", {"n": 2, "c_in": 5, "h": 7, "w": 9, "c_out": 6, "kernel": 3}, "gemm_direct"),
    ("conv2d_bn_relu", {"n": 1, "c_in": 3, "h": 4, "w": 56, "c_out": 8, "kernel": 3}, "gemm_direct"),
]
# The library's template second: the first ran faster at the pattern's default shape (see the
# templates' docstrings). (conv2d_bn_relu's gemm_direct is third, after channel_tile and tiled_direct.)
NOT_DEFAULT = {"packed_experts": 1, "gemm_direct": 2}


@pytest.mark.parametrize("name,shape,template", PATTERN_CASES,
                         ids=[f"{n}-{'-'.join(map(str, s.values()))}" for n, s, _ in PATTERN_CASES])
def test_pattern_templates_off_the_tile(name, shape, template):
    pattern = get_pattern(name)
    names = [t.name for t in pattern.templates_for(TARGET)]
    assert names.index(template) == NOT_DEFAULT.get(template, 0), "the library's GEMM is the CPU default"
    shape = pattern.resolve_shape(shape)
    dtype = pattern.dtypes[0]
    func = pattern.build(shape, dtype)
    result = check_module(pattern, tvm.tirx.build(_applied(pattern, shape, template).mod, target=TARGET),
                          func, shape, dtype, DEV)
    assert result.ok, result.message


def _applied(pattern, shape, name=None):
    """``pattern``'s template ``name`` (default: its first for the CPU) at ``shape``, untuned."""
    template = next(t for t in pattern.templates_for(TARGET) if name in (None, t.name))
    return template.apply(pattern.build(shape, pattern.dtypes[0]), TARGET, tunable=False)


@pytest.mark.parametrize("target,instruction", [(Target({"kind": "llvm", "mcpu": "icelake-server"}), "vpdpwssd"),
                                                (Target({"kind": "llvm", "mcpu": "skylake-avx512"}), "vpmaddwd"),
                                                (AVX2, "vpmaddwd")], ids=["vnni", "avx512bw", "avx2"])
def test_int8_gemms_multiply_pairs_of_k(target, instruction):
    """int8 x int8 -> int32, packed and skinny: two k per int32 lane and instruction."""
    pattern = get_pattern("int8_matmul_dequant")
    for m in (70, 7):
        shape = pattern.resolve_shape({"m": m, "n": 64, "k": 64})
        sch = pattern.templates_for(target)[0].apply(pattern.build(shape, "float32"), target, tunable=False)
        assert "autofuse_pair_dot" in str(sch.trace)
        assert instruction in tvm.tirx.build(sch.mod, target=target).inspect_source("asm")


@pytest.mark.parametrize("m", [70, 4])
def test_int8_pair_dots_are_exact_at_the_extremes(m):
    """-128 * -128 twice per lane and instruction: 2**15, past int16, exact in the int32 lane."""
    pattern = get_pattern("int8_matmul_dequant")
    shape = pattern.resolve_shape({"m": m, "n": 64, "k": 64, "relu": 0})
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([-128, 127, -127], np.int8), size=(m, 64))
    w = rng.choice(np.array([-128, 127, -1], np.int8), size=(64, 64))
    x[0], w[0] = -128, -128
    inputs = [x, w, np.ones(1, np.float32), np.ones(64, np.float32), np.zeros(64, np.float32)]
    rt = tvm.tirx.build(_applied(pattern, shape).mod, target=TARGET)
    y = tvm.runtime.tensor(np.zeros((m, 64), np.float32), DEV)
    rt(*(tvm.runtime.tensor(a, DEV) for a in inputs), y)
    np.testing.assert_array_equal(y.numpy(), (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32))
