"""The CUDA templates of rope_qk (score tiles), conv2d_bn_relu (direct convolution) and
moe_gate_topk (the routed layer in five kernels) compile for the H200 here, with nvcc, without a
GPU to run them on: fixed knobs in float32 and float16, knob samples replayed the way MetaSchedule
replays them, MetaSchedule's CUDA postprocessors, and what each template is for. Whether they
compute the right numbers is benchmarks/gpu_check_templates.py's job, on a GPU."""

import pytest
from cuda_support import H200, assert_within_limits, cuda_source, kernels, replayed, require_nvcc
from cuda_support import assert_one_extent_per_thread_tag, template_named

from autofuse.pattern import TEMPLATE_ANNOTATION
from autofuse.registry import get_pattern

require_nvcc()

CASES = [("rope_qk", "cuda_score_tiles"), ("conv2d_bn_relu", "cuda_direct"), ("moe_gate_topk", "cuda_routed")]
IDS = [name for name, _ in CASES]


def _template(name, tname):
    pattern = get_pattern(name)
    return pattern, template_named(pattern, tname)


def _compile(sch):
    assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_source(sch.mod)
    assert_within_limits(source)
    return source


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name,tname", CASES, ids=IDS)
def test_fixed_knobs_compile(name, tname, dtype):
    pattern, template = _template(name, tname)
    sch = template.apply(pattern.build(pattern.small_shape(), dtype), H200, tunable=False)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    source = _compile(sch)
    assert "threadIdx.x" in source


@pytest.mark.parametrize("name,tname", CASES, ids=IDS)
def test_samples_replay_and_compile(name, tname):
    pattern, template = _template(name, tname)
    func = pattern.build(pattern.small_shape(), "float32")
    decisions = set()
    for sch in replayed(template, func, range(2, 4)):
        decisions.add(str(sch.trace.decisions))
        _compile(sch)
    assert len(decisions) > 1, "the template's knobs should vary across samples"


@pytest.mark.parametrize("name,tname", CASES, ids=IDS)
def test_metaschedule_reduction_postproc_keeps_the_schedule(name, tname):
    """RewriteReductionBlock (run on every tuning candidate) must find no reduction left to
    decompose, and no loop may have a dynamic extent."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    pattern, template = _template(name, tname)
    sch = template.apply(pattern.build(pattern.small_shape(), "float32"), H200, tunable=False)
    before = sch.mod
    assert ms.postproc.RewriteReductionBlock().apply(sch)
    assert tvm_ffi.structural_equal(before, sch.mod)
    assert ms.postproc.DisallowDynamicLoop().apply(sch)


def test_rope_default_rotates_into_shared_tiles():
    """Default shape: one kernel of 8x16 threads with rotated Q and K chunks in shared memory
    (32 rows x (16 + 4 pad) + 16 x (64 + 1 pad) floats) and 16 register accumulators a thread."""
    pattern, template = _template("rope_qk", "cuda_score_tiles")
    sch = template.apply(pattern.build(pattern.default_shape(), "float16"), H200, tunable=False)
    source = cuda_source(sch.mod)
    assert kernels(source) == [(128, 4 * (32 * 20 + 16 * 65))]
    assert "float acc_local_ptr[16]" in source
    assert "qr_shared_ptr" in source and "kr_shared_ptr" in source
    # The rotation reads q and cos in 4-wide vectors.
    assert "half4" in source or "uint2" in source


def test_conv_default_stages_padded_rows_and_weights():
    """Default shape: 2x4x28 threads, the 8-channel chunk of 6 padded rows x 58 columns and its
    8x8x3x3 weights in shared memory, 8 accumulators a thread, zeros written for the border."""
    pattern, template = _template("conv2d_bn_relu", "cuda_direct")
    sch = template.apply(pattern.build(pattern.default_shape(), "float32"), H200, tunable=False)
    source = cuda_source(sch.mod)
    assert kernels(source) == [(224, 4 * (8 * 6 * 58 + 8 * 8 * 9))]
    assert "float acc_local_ptr[8]" in source
    assert "xp_shared_ptr" in source and "weight_shared_ptr" in source


def test_moe_kernels_reduce_across_threads():
    """Five kernels: router, top-k, grouping, expert tiles, combine; the expert tile reduces its up
    projection across warps (shared memory) and its down projection across lanes (shuffles), and
    keeps the lane's hidden tile (8 rows x 16 features) in registers."""
    pattern, template = _template("moe_gate_topk", "cuda_routed")
    sch = template.apply(pattern.build(pattern.default_shape(), "float32"), H200, tunable=False)
    # Nothing of the expert nest may be lost (inlining into it drops the nest in TVM 0.27).
    for name in ("router", "rank_update", "topk", "group", "up", "relu", "down", "gate", "combine_update"):
        sch.get_sblock(name)
    source = cuda_source(sch.mod)
    chunks = source.split('extern "C" __global__')[1:]
    bodies = [chunk for chunk in chunks if chunk.split("\n", 1)[0].endswith("{")]
    assert len(bodies) == 5
    experts = next(body for body in bodies if "w1_ptr" in body)
    assert "__shfl_down_sync" in experts and "__syncthreads" in experts
    assert "float hid_local_ptr[128]" in experts
    router = bodies[0]
    assert "__shfl_down_sync" in router and "wg_ptr" in router


def test_moe_half_precision_compiles_at_the_default_shape():
    pattern, template = _template("moe_gate_topk", "cuda_routed")
    sch = template.apply(pattern.build(pattern.default_shape(), "bfloat16"), H200, tunable=False)
    _compile(sch)

