"""The CUDA templates of the decode attentions (gqa_decode_attention, paged_attention: both
``cuda_kv_head``, sharing ``cuda_decode_attention``) compile for the H200 through nvcc, with fixed
knobs and with knob samples replayed as MetaSchedule replays them, and keep what makes them worth
having: one attention thread block per (batch, K/V head), warp shuffles, shared memory. Nothing
runs here (no GPU): benchmarks/gpu_check_templates.py checks the numbers on one. Small shapes."""

import pytest
from cuda_support import H200, assert_within_limits, cuda_source, kernels, replayed, require_nvcc
from cuda_support import assert_one_extent_per_thread_tag, template_named

from autofuse.errors import AutofuseError
from autofuse.pattern import TEMPLATE_ANNOTATION
from autofuse.registry import get_pattern
from search_spaces.lib.attention import KEY_PAD

require_nvcc()

NAMES = ("gqa_decode_attention", "paged_attention")
# gqa: the cache copy, then the attention; paged: the attention only.
KERNELS = {"gqa_decode_attention": 2, "paged_attention": 1}


def _template(name):
    return template_named(get_pattern(name), "cuda_kv_head")


def _attention_kernel(source):
    """(threads, static shared bytes) of the attention kernel, the last one."""
    return kernels(source)[-1]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", NAMES)
def test_fixed_knobs_compile(name, dtype):
    pattern = get_pattern(name)
    sch = _template(name).apply(pattern.build(pattern.small_shape(), dtype), H200, tunable=False)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert_within_limits(source)
    assert len(kernels(source)) == KERNELS[name]
    # The lanes of a key row sum their partial dot products by shuffles; scores, probabilities
    # and the slots' P*V partials sit in shared memory.
    assert "__shfl_down_sync" in source
    assert _attention_kernel(source)[1] > 0


@pytest.mark.parametrize("name", NAMES)
def test_default_shape_compiles(name):
    """The default shape's default: a thread block per (batch, K/V head), a warp per key row
    (head_dim 128 or 64 in 4-element vectors), within 48 KiB of shared memory."""
    pattern = get_pattern(name)
    shape = pattern.default_shape()
    sch = _template(name).apply(pattern.build(shape, "float16"), H200, tunable=False)
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert_within_limits(source)
    threads, shared = _attention_kernel(source)
    assert threads == 256 and 0 < shared <= 48 * 1024
    heads = shape["batch"] * shape["num_kv_heads"]
    assert f"T.thread_binding({heads}, thread=\"blockIdx.x\")" in sch.mod.script()


@pytest.mark.parametrize("name", NAMES)
def test_samples_replay_and_compile(name):
    pattern = get_pattern(name)
    func = pattern.build(pattern.small_shape(), "float32")
    decisions = set()
    for sch in replayed(_template(name), func, (3, 5)):
        decisions.add(str(sch.trace.decisions))
        assert_one_extent_per_thread_tag(sch.mod)
        source = cuda_source(sch.mod)
        assert_within_limits(source)
        assert "__shfl_down_sync" in source
    assert len(decisions) > 1, "the template's knobs should vary across samples"


@pytest.mark.parametrize("name", NAMES)
def test_metaschedule_postprocs_keep_the_schedule(name):
    """RewriteReductionBlock finds every init already decomposed; no loop has a dynamic extent."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    pattern = get_pattern(name)
    for shape in (pattern.small_shape(), pattern.default_shape()):
        sch = _template(name).apply(pattern.build(shape, "float32"), H200, tunable=False)
        before = sch.mod
        assert ms.postproc.RewriteReductionBlock().apply(sch)
        assert tvm_ffi.structural_equal(before, sch.mod)
        assert ms.postproc.DisallowDynamicLoop().apply(sch)


@pytest.mark.parametrize("name", NAMES)
def test_score_rows_padded_for_the_unpredicated_write_back(name):
    """At the small shape the keys (10 for gqa, 12 for paged) are not a multiple of the default
    slots x unroll: the score rows must be padded (see _pad_keys), or the lane sums of keys past
    the end land in the next row."""
    pattern = get_pattern(name)
    sch = _template(name).apply(pattern.build(pattern.small_shape(), "float32"), H200, tunable=False)
    script = sch.mod.script()
    assert f"// {KEY_PAD}, " in script and f"% {KEY_PAD}]" in script


def test_too_long_cache_is_a_one_line_error():
    pattern = get_pattern("gqa_decode_attention")
    shape = dict(pattern.small_shape(), max_seq=8192, cache_len=8000)
    with pytest.raises(AutofuseError) as err:
        _template("gqa_decode_attention").apply(pattern.build(shape, "float32"), H200, tunable=False)
    assert "shared memory" in str(err.value) and "\n" not in str(err.value)
