"""On a GPU every pattern has a template (its own, or dlight's rules through ``DLIGHT``), and its
fixed default compiles for the H200 here, with nvcc, without a GPU to run it on."""

import shutil

import pytest
import tvm

from autofuse.pattern import DLIGHT, TEMPLATE_ANNOTATION
from autofuse.registry import all_patterns
from autofuse.target import parse_target

if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found: CUDA kernels cannot be compiled here", allow_module_level=True)

H200 = parse_target("h200")
LLVM = parse_target("llvm")
PATTERNS = list(all_patterns().values())

# Where dlight has no rule for the TensorIR (TVM's limits, not ours); gpu.py reports these as
# unavailable until the pattern has a CUDA template of its own.
NO_DLIGHT_RULE: dict[str, str] = {}  # none since every pattern has a CUDA template of its own


def _compile_cuda(mod) -> bytes:
    """What the device does when it loads the module: the generated CUDA source through nvcc."""
    from tvm.support import nvcc

    rt = tvm.tirx.build(mod, target=H200)
    source = rt.imports[0].inspect_source("")
    with H200:  # nvcc reads the arch off the current target
        return nvcc.compile_cuda(source, target_format="fatbin", arch="sm_90", compiler="nvcc")


@pytest.fixture(scope="module", autouse=True)
def cuda_compiles():
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def scale(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("b"):
                vi = T.axis.spatial(64, i)
                b[vi] = a[vi] * T.float32(2)

    try:
        _compile_cuda(tvm.IRModule({"main": scale}))
    except Exception as err:  # no CUDA codegen in this TVM, or an nvcc that cannot target sm_90
        pytest.skip(f"TVM cannot compile CUDA here: {str(err).strip().splitlines()[-1]}")


def _cases():
    for pattern in PATTERNS:
        reason = NO_DLIGHT_RULE.get(pattern.name)
        marks = [pytest.mark.xfail(reason=reason, raises=ValueError, strict=False)] if reason else []
        yield pytest.param(pattern, id=pattern.name, marks=marks)


@pytest.mark.parametrize("pattern", _cases())
def test_default_gpu_schedule_compiles_for_cuda(pattern):
    templates = pattern.templates_for(H200)
    assert templates, "every pattern needs a template on a GPU"
    func = pattern.build(pattern.small_shape(), pattern.dtypes[0])
    sch = templates[0].apply(func, H200, tunable=False)
    assert sch is not None and TEMPLATE_ANNOTATION in str(sch.trace)
    assert _compile_cuda(sch.mod)


def test_dlight_only_where_the_pattern_has_no_template_of_its_own():
    for pattern in PATTERNS:
        assert DLIGHT not in pattern.templates_for(LLVM)
        own = [t for t in pattern.templates if t.applies_to(H200)]
        assert pattern.templates_for(H200) == (own or [DLIGHT])


def test_tuning_gets_dlight_only_where_it_schedules_the_function():
    for pattern in PATTERNS:
        if [t for t in pattern.templates if t.applies_to(H200)]:
            continue  # a CUDA template of its own
        func = pattern.build(pattern.small_shape(), pattern.dtypes[0])
        expected = [] if pattern.name in NO_DLIGHT_RULE else [DLIGHT]
        assert pattern.templates_for(H200, func) == expected, pattern.name


def test_dlight_replays_dlight_exactly():
    """The template reproduces what dlight's own rule does to the same (annotated) function."""
    import tvm_ffi
    from tvm import s_tir
    from tvm.s_tir.dlight import gpu

    pattern = all_patterns()["softmax_dropout"]
    func = pattern.build(pattern.small_shape(), "float32")
    ours = DLIGHT.apply(func, H200, tunable=False)
    annotated = s_tir.Schedule(func)
    annotated.annotate(annotated.get_child_blocks(annotated.get_sblock("root"))[0], TEMPLATE_ANNOTATION, "dlight")
    theirs = gpu.GeneralReduction().apply(annotated.mod["main"], H200, False)
    assert tvm_ffi.structural_equal(ours.mod, theirs.mod)


def test_dlight_says_when_no_rule_applies():
    pattern = all_patterns()["flash_attention"]
    with pytest.raises(ValueError, match="no dlight GPU rule applies"):
        DLIGHT.apply(pattern.build(pattern.small_shape(), "float32"), H200, tunable=False)
