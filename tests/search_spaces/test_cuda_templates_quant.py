"""The CUDA templates of int8_matmul_dequant (cuda_tiled_dp4a), sparse24_matmul_gather
(cuda_gather_tiles) and spec_accept (cuda_rows_then_batch) compile for the H200 through nvcc: fixed
knobs, knob samples replayed the way MetaSchedule replays them, one extent per thread tag in each
kernel, MetaSchedule's reduction postprocessor, and the structure each template exists for. All
three patterns are float32 only.
Nothing runs here (no GPU): benchmarks/gpu_check_templates.py checks the numbers on one."""

import sys

import pytest
from cuda_support import H200, assert_one_extent_per_thread_tag, assert_within_limits, cuda_source, kernels, replayed
from cuda_support import require_nvcc, template_named

from autofuse.pattern import TEMPLATE_ANNOTATION
from autofuse.registry import get_pattern

require_nvcc()

CASES = [("int8_matmul_dequant", "cuda_tiled_dp4a"), ("sparse24_matmul_gather", "cuda_gather_tiles"),
         ("spec_accept", "cuda_rows_then_batch")]
IDS = [name for name, _ in CASES]
# spec_accept's greedy kernel is a different TensorIR (row_argmax, pick): checked as a case of its own.
SHAPES = [(name, tname, {}) for name, tname in CASES] + [("spec_accept", "cuda_rows_then_batch", {"greedy": 1})]
SHAPE_IDS = IDS + ["spec_accept-greedy"]


def _schedule(name, tname, overrides=None, base="small"):
    pattern = get_pattern(name)
    shape = {**(pattern.small_shape() if base == "small" else pattern.default_shape()), **(overrides or {})}
    func = pattern.build(shape, "float32")
    return template_named(pattern, tname), func


def _definitions(source):
    chunks = source.split('extern "C" __global__')[1:]
    return [chunk for chunk in chunks if chunk.split("\n", 1)[0].rstrip().endswith("{")]


@pytest.mark.parametrize("name,tname,overrides", SHAPES, ids=SHAPE_IDS)
def test_fixed_knobs_compile(name, tname, overrides):
    template, func = _schedule(name, tname, overrides)
    sch = template.apply(func, H200, tunable=False)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert_within_limits(source)
    assert "threadIdx.x" in source


@pytest.mark.parametrize("name,tname,overrides", SHAPES, ids=SHAPE_IDS)
def test_samples_replay_and_compile(name, tname, overrides):
    template, func = _schedule(name, tname, overrides)
    decisions = set()
    for sch in replayed(template, func, (2, 3)):
        decisions.add(str(sch.trace.decisions))
        assert_one_extent_per_thread_tag(sch.mod)
        assert_within_limits(cuda_source(sch.mod))
    assert len(decisions) > 1, "the template's knobs should vary across samples"


@pytest.mark.parametrize("name,tname,overrides", SHAPES, ids=SHAPE_IDS)
def test_metaschedule_reduction_postproc_keeps_the_schedule(name, tname, overrides):
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    template, func = _schedule(name, tname, overrides)
    sch = template.apply(func, H200, tunable=False)
    before = sch.mod
    assert ms.postproc.RewriteReductionBlock().apply(sch)
    assert tvm_ffi.structural_equal(before, sch.mod)
    assert ms.postproc.DisallowDynamicLoop().apply(sch)


def test_int8_accumulates_four_products_per_dp4a():
    template, func = _schedule("int8_matmul_dequant", "cuda_tiled_dp4a", base="default")
    source = cuda_source(template.apply(func, H200, tunable=False).mod)
    # 32x64 tile of 8x16 threads, 4x4 int32 accumulators each; x_q and w_q k-tiles of 32 int8 in
    # rows padded to 36 bytes (9 words: 16 lanes on 16 rows hit 16 banks), read as int words.
    assert kernels(source) == [(128, (32 + 64) * 36)]
    assert "int acc_reindex_local_ptr[16]" in source
    # A k tile is 8 dp4a per accumulator: once in the pipelined loop's body, once in its epilogue.
    assert source.count(" + __dp4a(x_q_shared_ptr[") == 2 * 8 * 16
    assert "*(int*)(x_q_ptr" in source and "*(int*)(w_q_ptr" in source
    for sch in replayed(template, func, (2,)):
        assert "__dp4a(" in cuda_source(sch.mod)


def test_int8_without_four_aligned_k_multiplies_bytes():
    """k not a multiple of 4: rows of x_q and w_q are not 4-byte aligned, no dp4a, plain IMADs."""
    template, func = _schedule("int8_matmul_dequant", "cuda_tiled_dp4a", {"k": 30})
    source = cuda_source(template.apply(func, H200, tunable=False).mod)
    assert "__dp4a" not in source and "__shared__" in source


def test_dp4a_intrinsic_does_not_import_every_cuda_intrinsic():
    from tvm.s_tir import TensorIntrin

    from search_spaces.lib.cuda_gemm import dp4a_intrin

    loaded = "tvm.s_tir.tensor_intrin" in sys.modules
    name = dp4a_intrin()
    assert name == "dp4a_s8s8s32" and TensorIntrin.get(name) is not None
    assert dp4a_intrin() == name
    if not loaded:  # another test may have imported the package (tens of seconds) already
        assert "tvm.s_tir.tensor_intrin" not in sys.modules


def test_sparse_stages_gathered_rows_and_weights_per_k_tile():
    template, func = _schedule("sparse24_matmul_gather", "cuda_gather_tiles", base="default")
    sch = template.apply(func, H200, tunable=False)
    assert '"software_pipeline_stage"' in sch.mod.script()
    source = cuda_source(sch.mod)
    # 32 gathered rows x 32 k (rows padded to 33 floats), 64 x 16 values (17), 64 x 8 meta (17):
    # the slab is one k tile, not all of k (the explicit read region lets it compact).
    assert kernels(source) == [(256, 32 * 33 * 4 + 64 * 17 * 4 + 64 * 17)]
    first = _definitions(source)[0]
    assert first.count("__shared__") == 3
    assert "x_ptr[((idx_ptr[" in first  # the rows come through idx inside the kernel


def test_spec_accept_rows_then_batch_kernels():
    template, func = _schedule("spec_accept", "cuda_rows_then_batch", base="default")
    source = cuda_source(template.apply(func, H200, tunable=False).mod)
    rows, batch = _definitions(source)
    # vocab 32000: a block per row (1024 threads: no power of two divides the 8000 float4s, so
    # the last chunk is predicated; warp shuffles, then across warps through shared memory); the
    # exp pass reads the max from shared memory, not from the global copy thread 0 alone stores.
    assert "__launch_bounds__(1024)" in rows and "__shfl_down_sync" in rows and "red_buf0_ptr" in rows
    assert "(logits_local_ptr_1[0] - mx_shared_ptr[0])" in rows and "- mx_ptr[" not in rows
    # The residual's chunk sums reduce across lanes; the accept scan stays in registers.
    assert "__shfl_down_sync" in batch and "accepted_local_ptr[0]" in batch
    assert "csum_shared_ptr" in batch


def test_spec_accept_short_rows_keep_the_max_in_registers():
    for greedy in (0, 1):
        template, func = _schedule("spec_accept", "cuda_rows_then_batch", {"greedy": greedy})
        source = cuda_source(template.apply(func, H200, tunable=False).mod)
        rows, batch = _definitions(source)
        assert "__shfl_down_sync" in rows and "mx_local_ptr" in rows
        assert "accepted_local_ptr[0]" in batch
