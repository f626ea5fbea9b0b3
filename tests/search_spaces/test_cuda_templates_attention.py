"""The CUDA templates of cross_attention (``cuda_query_rows``) and spec_verify_attention
(``cuda_verify_rows``) compile for the H200 here, with nvcc, without a GPU to run them on: fixed
knobs in each dtype, knob samples replayed the way MetaSchedule replays them, MetaSchedule's
reduction and dynamic-loop postprocessors, and the shapes where the schedule changes its plan (a
padded last key tile, an empty cache, more query rows than one thread block holds). Whether they
compute the right numbers is benchmarks/gpu_check_templates.py's job, on a GPU."""

import pytest
from cuda_support import H200, assert_within_limits, cuda_source, kernels, replayed, require_nvcc
from cuda_support import assert_one_extent_per_thread_tag, template_named

from autofuse.pattern import TEMPLATE_ANNOTATION
from autofuse.registry import get_pattern

require_nvcc()

CASES = [("cross_attention", "cuda_query_rows"), ("spec_verify_attention", "cuda_verify_rows")]
IDS = [name for name, _ in CASES]
# spec_verify_attention is float32 only.
DTYPES = {"cross_attention": ("float32", "float16"), "spec_verify_attention": ("float32",)}


def _apply(name, tname, shape=None, dtype="float32"):
    pattern = get_pattern(name)
    func = pattern.build(shape or pattern.small_shape(), dtype)
    return template_named(pattern, tname).apply(func, H200, tunable=False)


@pytest.mark.parametrize("name,tname,dtype", [(n, t, d) for n, t in CASES for d in DTYPES[n]],
                         ids=[f"{n}-{d}" for n, _ in CASES for d in DTYPES[n]])
def test_fixed_knobs_compile(name, tname, dtype):
    sch = _apply(name, tname, dtype=dtype)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert_within_limits(source)
    # One kernel; the row statistics are shuffles across a row's threads; K/V tiles and the
    # probabilities a row's threads exchange are in shared memory.
    assert len(kernels(source)) == 1
    assert "__shfl_down_sync" in source and "__shared__" in source


@pytest.mark.parametrize("name,tname", CASES, ids=IDS)
def test_samples_replay_and_compile(name, tname):
    pattern = get_pattern(name)
    func = pattern.build(pattern.small_shape(), "float32")
    decisions = set()
    for sch in replayed(template_named(pattern, tname), func, range(2, 4)):
        decisions.add(str(sch.trace.decisions))
        assert_within_limits(cuda_source(sch.mod))
    assert decisions, "the template should draw knobs"


POSTPROC_SHAPES = {
    # seq_kv = 70: a K/V tile loop with a short last tile.
    "cross_attention": {"seq_kv": 70, "seq_q": 13},
    # cache_len 70 of 80: the last key tile is padded, its keys clamped to the last cached row.
    "spec_verify_attention": {"max_seq": 80, "cache_len": 70, "k_draft": 6},
}


@pytest.mark.parametrize("name,tname", CASES, ids=IDS)
@pytest.mark.parametrize("shape", ["small", "edge"])
def test_metaschedule_postprocs_keep_the_schedule(name, tname, shape):
    """RewriteReductionBlock must find nothing left to decompose, and DisallowDynamicLoop (which
    rejects a candidate with a loop of symbolic extent) must pass, also where the last key tile
    is shorter than the others."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    pattern = get_pattern(name)
    over = POSTPROC_SHAPES[name] if shape == "edge" else {}
    sch = _apply(name, tname, dict(pattern.small_shape(), **over))
    before = sch.mod
    assert ms.postproc.RewriteReductionBlock().apply(sch)
    assert tvm_ffi.structural_equal(before, sch.mod)
    assert ms.postproc.DisallowDynamicLoop().apply(sch)


def test_cross_attention_default_shape():
    """8 query rows of 16 threads per block; the scores accumulate in registers (not in the
    shared score row), against K^T read from shared memory, with the q row in registers."""
    pattern = get_pattern("cross_attention")
    source = cuda_source(_apply("cross_attention", "cuda_query_rows", pattern.default_shape()).mod)
    [(threads, shared)] = kernels(source)
    assert threads == 8 * 16 and shared <= 48 * 1024
    assert "s_local_ptr[1]" in source and "q_local_ptr[64]" in source and "k_shared_ptr" in source


def test_spec_verify_padded_tile_loads_whole_tiles():
    """The staged K/V tiles are always a whole tile (a constant loop), the last one read from the
    window that ends at max_seq, so no load leaves the cache."""
    shape = dict(get_pattern("spec_verify_attention").small_shape(), **POSTPROC_SHAPES["spec_verify_attention"])
    sch = _apply("spec_verify_attention", "cuda_verify_rows", shape)
    script = sch.mod.script()
    # cache_len 70: two 64-key tiles; the second window starts at min(64, 80 - 64) = 16.
    assert "T.min(t * 64, 16)" in script
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert "k_cache_shared" in source and "v_cache_shared" in source


def test_spec_verify_empty_cache_reads_only_the_drafts():
    shape = dict(get_pattern("spec_verify_attention").small_shape(), cache_len=0)
    source = cuda_source(_apply("spec_verify_attention", "cuda_verify_rows", shape).mod)
    assert "k_cache_ptr[" not in source and "v_cache_ptr[" not in source and "__shfl_down_sync" in source


def test_spec_verify_many_rows_split_over_blocks():
    """64 query heads on one K/V head x 16 drafts: 1024 rows of one (batch, K/V head), more than
    one thread block holds; the row tiles go to blockIdx.y."""
    pattern = get_pattern("spec_verify_attention")
    shape = dict(pattern.small_shape(), heads=64, kv_heads=1, k_draft=16)
    source = cuda_source(_apply("spec_verify_attention", "cuda_verify_rows", shape).mod)
    assert "blockIdx.y" in source
    assert_within_limits(source)


@pytest.mark.parametrize("name,tname,over", [
    ("cross_attention", "cuda_query_rows", {"seq_q": 5}),
    ("cross_attention", "cuda_query_rows", {"seq_q": 13, "seq_kv": 70}),
    ("spec_verify_attention", "cuda_verify_rows", {}),
    ("spec_verify_attention", "cuda_verify_rows", {"heads": 64, "kv_heads": 1, "k_draft": 16}),
], ids=["cross-short-q", "cross-ragged", "verify", "verify-many-rows"])
def test_every_stage_binds_the_same_thread_extents(name, tname, over):
    """TVM launches a kernel with the largest extent bound to a thread axis and does not guard a
    loop bound to fewer threads: a stage whose row loop covered fewer rows than the block has
    (cross_attention's stages once did, at a query tile taller than seq_q) would index its
    shared rows past their end on the extra threads."""
    import re

    script = _apply(name, tname, dict(get_pattern(name).small_shape(), **over)).mod.script()
    for axis in ("threadIdx.x", "threadIdx.y", "blockIdx.y"):
        extents = set(re.findall(rf'T\.thread_binding\((\d+), thread="{axis}"\)', script))
        assert len(extents) <= 1, (axis, extents)


def test_spec_verify_long_head_dim_reads_the_cache_through_l1():
    """head_dim 256 in float32: neither a K nor a V tile of 64 keys fits 48 KiB, and q * scale
    moves from registers to shared memory. (The schedule only: nvcc takes ~10 s on the unrolled
    256-wide score loop; the GPU check compiles and runs it.)"""
    from tvm.s_tir import meta_schedule as ms

    shape = dict(get_pattern("spec_verify_attention").small_shape(), head_dim=256, max_seq=64, cache_len=64)
    sch = _apply("spec_verify_attention", "cuda_verify_rows", shape)
    script = sch.mod.script()
    assert "k_cache_shared" not in script and "v_cache_shared" not in script
    assert 'qt_shared = T.sblock_alloc_buffer' in script
    assert ms.postproc.DisallowDynamicLoop().apply(sch)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_masked_attention_flash_compiles_at_a_small_vit_shape(dtype):
    """A small ViT's attention (17 tokens, head_dim 16, the mask's rows): the vectorised
    normalisation of a masked row once put a ushort4 condition into a float4, which NVRTC refused
    on an H100 (the float16 ViT did not build)."""
    shape = {"batch": 1, "heads": 4, "kv_heads": 4, "seq_q": 17, "seq_kv": 17, "head_dim": 16, "mask_rows": 17}
    sch = _apply("masked_attention", "cuda_flash", shape, dtype)
    assert_within_limits(cuda_source(sch.mod))
