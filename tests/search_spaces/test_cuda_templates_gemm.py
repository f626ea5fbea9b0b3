"""The CUDA templates of the GEMM-like patterns (linear_bias_relu, swiglu_ffn, woq_matmul; the linear
patterns' WMMA schedule) compile for the H200 through nvcc, with their fixed defaults and with random
knob samples replayed the way MetaSchedule replays them, into kernels that stage tiles through shared
memory and bind threads. Nothing runs here (no GPU): benchmarks/gpu_check_templates.py runs and
checks them on one. Small shapes only."""

import pytest
from cuda_support import H200, cuda_source as _cuda_source, kernels as _kernels, replayed, require_nvcc
from cuda_support import assert_one_extent_per_thread_tag, template_named as _template

from autofuse.pattern import TEMPLATE_ANNOTATION
from autofuse.registry import get_pattern
from search_spaces.lib.cuda_gemm import cuda_vector_lanes

require_nvcc()

SAMPLES = 4
SIMT = [("linear_bias_relu", "cuda_tiled_epilogue"), ("swiglu_ffn", "cuda_two_gemms")]
GEMV = ("woq_matmul", "cuda_warp_per_row")


def _definitions(source):
    chunks = source.split('extern "C" __global__')[1:]
    return [chunk for chunk in chunks if chunk.split("\n", 1)[0].rstrip().endswith("{")]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name,tname", SIMT)
def test_default_compiles_to_a_shared_memory_kernel(name, tname, dtype):
    pattern = get_pattern(name)
    func = pattern.build(pattern.small_shape(), dtype)
    sch = _template(pattern, tname).apply(func, H200, tunable=False)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    assert_one_extent_per_thread_tag(sch.mod)
    source = _cuda_source(sch.mod)
    assert "__shared__" in source and "threadIdx.x" in source
    kernels = _kernels(source)
    # swiglu: the gate/up/product kernel and the down/dropout/residual kernel, in one PrimFunc.
    assert len(kernels) == (2 if name == "swiglu_ffn" else 1)
    for threads, shared in kernels:
        assert threads <= 1024 and 0 < shared <= 48 * 1024


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name,tname", SIMT)
def test_samples_replay_and_compile(name, tname, dtype):
    pattern = get_pattern(name)
    func = pattern.build(pattern.small_shape(), dtype)
    decisions = set()
    for sch in replayed(_template(pattern, tname), func, range(2, SAMPLES + 2)):
        decisions.add(str(sch.trace.decisions))
        assert_one_extent_per_thread_tag(sch.mod)
        source = _cuda_source(sch.mod)
        assert "__shared__" in source and "threadIdx" in source
    assert len(decisions) > 1, "the template's knobs should vary across samples"


def test_default_pipelines_the_k_loop_through_registers():
    pattern = get_pattern("linear_bias_relu")
    sch = _template(pattern, "cuda_tiled_epilogue").apply(pattern.build(pattern.default_shape(), "float32"),
                                                          H200, tunable=False)
    script = sch.mod.script()
    assert '"software_pipeline_stage": [0, 0, 0, 0, 1]' in script
    assert '"software_pipeline_order": [0, 3, 1, 4, 2]' in script
    source = _cuda_source(sch.mod)
    # 64x64 tile of 16x16 threads, 4x4 float32 accumulators each, 8-byte vector loads of the
    # 16-wide k tiles into rows padded to 18 floats.
    assert _kernels(source) == [(256, 2 * 64 * 18 * 4)]
    assert "float acc_reindex_local_ptr[16]" in source
    assert "*(float2*)(x_ptr" in source


def test_swiglu_computes_gate_and_up_in_one_k_loop():
    pattern = get_pattern("swiglu_ffn")
    sch = _template(pattern, "cuda_two_gemms").apply(pattern.build(pattern.small_shape(), "float32"),
                                                     H200, tunable=False)
    source = _cuda_source(sch.mod)
    first = _definitions(source)[0]
    assert "g_local" in first and "u_local" in first and "h_ptr[" in first
    assert first.count("__shared__") == 3  # x, w1 and w3 tiles; x staged once for both GEMMs


def test_wmma_uses_tensor_cores_for_float16_only():
    pattern = get_pattern("linear_bias_relu")
    wmma = _template(pattern, "cuda_wmma")
    shape = pattern.small_shape()
    source = _cuda_source(wmma.apply(pattern.build(shape, "float16"), H200, tunable=False).mod)
    assert "wmma::mma_sync" in source and "__shared__" in source
    # Samples are only scheduled, not compiled: each WMMA compile costs a minute of nvcc on 2 cores.
    for sch in replayed(wmma, pattern.build(shape, "float16"), range(2, 4)):
        assert "wmma.matrix_a" in sch.mod.script() and "wmma.accumulator" in sch.mod.script()
    # float32 (tf32 would miss the tolerance) and bfloat16 (no TVM intrinsic) fall back to SIMT:
    # the same TensorIR as cuda_tiled_epilogue's, so compiling it again would prove nothing.
    for dtype in ("float32", "bfloat16"):
        func = pattern.build(shape, dtype)
        ours = wmma.apply(func, H200, tunable=False)
        assert "wmma." not in ours.mod.script()  # no wmma.matrix_a/accumulator scopes, no tensorize
        simt = _template(pattern, "cuda_tiled_epilogue").apply(func, H200, tunable=False)
        assert ours.mod["main"].script().replace("cuda_wmma", "cuda_tiled_epilogue") == simt.mod["main"].script()


def test_linear_wmma_reads_w_as_stored():
    """The linear patterns' cuda_wmma (search_spaces/lib/linear.py): W (k, n) loaded row-major into
    the matrix_b fragments, no transposed intrinsic; float32 falls back to its SIMT template.
    Scheduled only (the WMMA compile costs a minute of nvcc on 2 cores)."""
    pattern = get_pattern("linear_bias_gelu")
    wmma = _template(pattern, "cuda_wmma")
    shape = pattern.small_shape()
    script = wmma.apply(pattern.build(shape, "float16"), H200, tunable=False).mod.script()
    assert "wmma.matrix_b" in script and "T.tvm_mma_sync" in script
    # linear_bias_relu's W (n, k) loads col_major (a transposed fragment); W (k, n) does not
    assert '"col_major"' not in script and script.count('"row_major"') >= 2
    func = pattern.build(shape, "float32")
    simt = _template(pattern, "cuda_tiled_epilogue").apply(func, H200, tunable=False)
    ours = wmma.apply(func, H200, tunable=False)
    assert ours.mod["main"].script().replace("cuda_wmma", "cuda_tiled_epilogue") == simt.mod["main"].script()


def test_vector_lanes_keep_rows_aligned():
    assert cuda_vector_lanes("float32", 256) == 2
    assert cuda_vector_lanes("float32", 256, max_bytes=16) == 4
    assert cuda_vector_lanes("float16", 256, max_bytes=16) == 4  # 8 lanes do not compile in TVM 0.27
    assert cuda_vector_lanes("float16", 6) == 2
    assert cuda_vector_lanes("float32", 7) == 1


@pytest.mark.parametrize("bits,group,m", [(4, 32, 2), (8, 32, 2), (4, 64, 1)])
def test_gemv_reduces_across_the_warp(bits, group, m):
    """group = k (64 at the small k) and bits = 8 leave unit loops the template must place."""
    pattern = get_pattern(GEMV[0])
    template = _template(pattern, GEMV[1])
    func = pattern.build(dict(pattern.small_shape(), bits=bits, group=group, m=m), "float32")
    source = _cuda_source(template.apply(func, H200, tunable=False).mod)
    assert "__shfl_down_sync" in source and "threadIdx.x" in source
    assert len(_kernels(source)) == 1
    decisions = set()
    for sch in replayed(template, func, range(2, SAMPLES + 2)):
        decisions.add(str(sch.trace.decisions))
        assert "threadIdx" in _cuda_source(sch.mod)
    assert len(decisions) > 1


@pytest.mark.parametrize("m,n,per_thread", [(2048, 2048, 8), (1024, 1024, 4), (256, 256, 4)])
def test_large_outputs_get_8x8_register_tiles_by_default(m, n, per_thread):
    # k is small: the tile choice depends on the output only, and compiling stays quick.
    pattern = get_pattern("linear_bias_relu")
    func = pattern.build(pattern.resolve_shape({"m": m, "n": n, "k": 32}), "float32")
    mod = _template(pattern, "cuda_tiled_epilogue").apply(func, H200, tunable=False).mod
    for axis in "yx":
        assert f'T.thread_binding({per_thread}, thread="vthread.{axis}")' in str(mod)
        assert f'T.thread_binding(16, thread="threadIdx.{axis}")' in str(mod)
    for threads, shared in _kernels(_cuda_source(mod)):
        assert threads == 256 and shared <= 48 * 1024
