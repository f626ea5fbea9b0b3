"""The linear patterns (search_spaces/lib/linear.py: linear, linear_bias, linear_bias_gelu,
linear_bias_gelu_tanh): their references are the textbook GELUs, the TensorIR's polynomial GELUs
hold over the whole range (clamps included), the CPU templates compute the reference on the
packed path too (rows above SKINNY_ROWS, padded rows and columns), the GELU epilogue calls no
libm function, small GEMMs run on one thread; on an sm_90 GPU in half precision the wgmma kernel
template comes first with the activation the pattern computes, and the CUDA schedule templates
compile. The small shape's unscheduled, template-default and replayed-sample checks are
test_patterns.py's, the CUDA templates' numbers test_cuda_emulated.py's, the Relax rules
tests/model/test_linear_rules.py's."""

import math
import re

import numpy as np
import pytest
import tvm

from autofuse import building as B
from autofuse import kernel_templates as K
from autofuse.measure import param_buffers
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.verify import check_module
from search_spaces.lib.cpu_gemm import SKINNY_ROWS
from search_spaces.lib.linear import ACTIVATIONS

TARGET = parse_target("llvm")
H200 = parse_target("h200")
DEV = tvm.cpu()
NAMES = ["linear", "linear_bias", "linear_bias_gelu", "linear_bias_gelu_tanh"]
GELUS = {"linear_bias_gelu": "gelu_erf", "linear_bias_gelu_tanh": "gelu_tanh"}


def _run(func, mod, inputs):
    rt = tvm.tirx.build(mod, target=TARGET)
    (spec,) = [(tuple(int(d) for d in b.shape), str(b.dtype)) for b in param_buffers(func)[-1:]]
    out = tvm.runtime.tensor(np.zeros(*spec), DEV)
    rt(*(tvm.runtime.tensor(a, DEV) for a in inputs), out)
    return out.numpy()


def test_gelu_references_are_the_textbook_functions():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])
    exact = 0.5 * x * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    np.testing.assert_allclose(ACTIVATIONS["gelu_erf"][1](x), exact, rtol=1e-15, atol=0)
    assert ACTIVATIONS["gelu_erf"][1](np.array([1.0]))[0] == pytest.approx(0.8413447460685429, abs=1e-15)
    assert ACTIVATIONS["gelu_tanh"][1](np.array([1.0]))[0] == pytest.approx(0.8411919906082768, abs=1e-15)
    # The tanh form approximates the exact one to ~1e-3.
    assert np.max(np.abs(ACTIVATIONS["gelu_tanh"][1](x) - exact)) < 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_reference_is_act_of_x_w_plus_b(name):
    pattern = get_pattern(name)
    shape = {"m": 3, "n": 4, "k": 5}
    inputs = pattern.make_inputs(shape, "float32", 0)
    assert [a.shape for a in inputs] == [(3, 5), (5, 4)] + ([(4,)] if "bias" in name else [])
    h = inputs[0].astype(np.float64) @ inputs[1].astype(np.float64)
    h = h + inputs[2] if "bias" in name else h
    expected = ACTIVATIONS[GELUS.get(name, "none")][1](h)
    np.testing.assert_allclose(pattern.reference(*inputs), expected, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(GELUS))
def test_polynomial_gelu_holds_over_the_whole_range(name):
    """Pre-activations from -12 to 12 (erf's clamp at +-4 sqrt 2, exp's at -87 reached): the
    float32 kernel stays within 2e-6 of the float64 reference."""
    pattern = get_pattern(name)
    n = 64
    shape = {"m": 4, "n": n, "k": n}
    x = np.linspace(-12, 12, 4 * n, dtype=np.float32).reshape(4, n)
    inputs = [x, np.eye(n, dtype=np.float32), np.zeros(n, np.float32)]
    func = pattern.build(shape, "float32")
    y = _run(func, pattern.templates[0].apply(func, TARGET, tunable=False).mod, inputs)
    np.testing.assert_allclose(y, pattern.reference(*inputs), rtol=0, atol=2e-6)


PACKED = {"m": SKINNY_ROWS + 16, "n": 40, "k": 24}  # packed path; rows and columns padded to the tile


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("template", ["packed_tile", "tiled_epilogue"])
def test_cpu_templates_match_the_reference_on_the_packed_path(name, template):
    pattern = get_pattern(name)
    func = pattern.build(PACKED, "float32")
    sch = next(t for t in pattern.templates if t.name == template).apply(func, TARGET, tunable=False)
    result = check_module(pattern, tvm.tirx.build(sch.mod, target=TARGET), func, PACKED, "float32", DEV)
    assert result.ok, result.message


@pytest.mark.parametrize("name", sorted(GELUS))
def test_the_gelu_epilogue_is_vectorised_polynomials_not_libm(name):
    pattern = get_pattern(name)
    func = pattern.build({"m": 32, "n": 64, "k": 32}, "float32")
    sch = pattern.templates[0].apply(func, TARGET, tunable=False)
    ir = tvm.tirx.build(sch.mod, target=TARGET).inspect_source("ll")
    calls = set(re.findall(r"call [^@]*@([\w.]+)", ir))
    assert not {c for c in calls if re.match(r"(llvm\.)?(erf|tanh|exp)f?(\.|$)", c)}, calls
    assert re.search(r"fmul <\d+ x float>", ir), "the epilogue is vectorised"


def test_small_gemms_run_on_one_thread_large_ones_in_parallel():
    pattern = get_pattern("linear_bias")
    small, large = {"m": 32, "n": 64, "k": 64}, {"m": 128, "n": 256, "k": 256}
    scripts = [pattern.templates[0].apply(pattern.build(s, "float32"), TARGET, tunable=False).mod.script()
               for s in (small, large)]
    assert "T.parallel" not in scripts[0]
    assert "T.parallel" in scripts[1]


# ---- GPU --------------------------------------------------------------------------------------

WGMMA_SHAPE = {"m": 2048, "n": 2048, "k": 256}  # the default tile fills the GPU here


def _wgmma(name, template_name="cuda_wgmma"):
    (template,) = [t for t in get_pattern(name).templates if getattr(t, "name", None) == template_name]
    return template


def _signature(func):
    return [(tuple(int(d) for d in b.shape), str(b.dtype)) for b in param_buffers(func)]


@pytest.mark.parametrize("name", NAMES)
def test_the_wgmma_kernel_template_applies_in_half_precision_at_its_tiles(name):
    pattern, template = get_pattern(name), _wgmma(name)
    for dtype in ("float16", "bfloat16"):
        assert K.kernel_templates_for(pattern, WGMMA_SHAPE, dtype, H200) == [template]
        assert _signature(template.build(WGMMA_SHAPE, dtype)) == _signature(pattern.build(WGMMA_SHAPE, dtype))
    for shape, dtype, target in ((WGMMA_SHAPE, "float32", H200), ({**WGMMA_SHAPE, "m": 100}, "float16", H200),
                                 (WGMMA_SHAPE, "float16", TARGET)):
        assert K.kernel_templates_for(pattern, shape, dtype, target) == []
    assert pattern.templates_for(H200), "the CUDA schedule templates stay for what it refuses"


@pytest.mark.parametrize("name", NAMES)
def test_the_wgmma_kernel_reads_w_n_major_and_applies_the_activation(name):
    source = B.build_tirx(_wgmma(name).build(WGMMA_SHAPE, "float16"), H200).imports[0].inspect_source()
    # B (k, n) as stored: wgmma's transpose-B flag set, the m64n256k16 tile of the default knobs
    assert "m64n256k16" in source
    act = GELUS.get(name)
    assert ("erff(" in source) == (act == "gelu_erf")
    assert ("tanhf(" in source) == (act == "gelu_tanh")


SKINNY = {"m": 128, "n": 4096, "k": 1024}  # K split: 32 tiles of 128 x 128 x 4 splits = 128 CTAs


@pytest.mark.parametrize("name", NAMES)
def test_skinny_layers_split_k_and_sum_with_the_epilogue(name):
    pattern, template = get_pattern(name), _wgmma(name, "cuda_wgmma_split_k")
    assert K.kernel_templates_for(pattern, SKINNY, "bfloat16", H200) == [template, _wgmma(name)]
    assert K.kernel_templates_for(pattern, WGMMA_SHAPE, "bfloat16", H200) == [_wgmma(name)]
    func = template.build(SKINNY, "bfloat16")
    assert _signature(func) == _signature(pattern.build(SKINNY, "bfloat16"))
    gemm, total = B.build_tirx(func, H200).imports[0].inspect_source().split('extern "C" __global__')[-2:]
    assert "m64n128k16" in gemm and "_1_1_0_1(" in gemm  # W (k, n) as stored: the transpose flag
    act = GELUS.get(name)
    assert ("erff(" in total) == (act == "gelu_erf") and ("tanhf(" in total) == (act == "gelu_tanh")
    assert ("X_ptr[" in total) == (name != "linear") and "X_ptr" not in gemm


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["linear", "linear_bias_gelu_tanh"])
def test_the_simt_template_compiles_to_one_shared_memory_kernel(name, dtype):
    """cuda_tiled_epilogue through nvcc (its numbers: test_cuda_emulated.py; cuda_wmma's float16
    schedule: test_cuda_templates_gemm.py, where TVM's WMMA intrinsics are imported anyway)."""
    cuda_support = pytest.importorskip("cuda_support")
    if cuda_support.shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: CUDA kernels cannot be compiled here")
    pattern = get_pattern(name)
    # 16 rows: half the unrolled source of 64 (nvcc took 7-13 s a case there)
    func = pattern.build({"m": 16, "n": 64, "k": 64}, dtype)
    sch = cuda_support.template_named(pattern, "cuda_tiled_epilogue").apply(func, H200, tunable=False)
    cuda_support.assert_one_extent_per_thread_tag(sch.mod)
    source = cuda_support.cuda_source(sch.mod)
    assert len(cuda_support.kernels(source)) == 1 and "__shared__" in source
