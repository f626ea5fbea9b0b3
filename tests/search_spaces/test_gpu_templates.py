"""On a GPU every pattern has a template (its own, or dlight's rules through ``DLIGHT``), and its
fixed default compiles for the H200 here, with nvcc, without a GPU to run it on."""

import pytest
from cuda_support import H200, cuda_source, require_nvcc

from autofuse.pattern import DLIGHT, TEMPLATE_ANNOTATION, Template
from autofuse.registry import all_patterns
from autofuse.target import parse_target

require_nvcc()

LLVM = parse_target("llvm")
PATTERNS = list(all_patterns().values())


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.name for p in PATTERNS])
def test_default_gpu_schedule_compiles_for_cuda(pattern):
    templates = pattern.templates_for(H200)
    assert templates, "every pattern needs a template on a GPU"
    func = pattern.build(pattern.small_shape(), pattern.dtypes[0])
    sch = templates[0].apply(func, H200, tunable=False)
    assert sch is not None and TEMPLATE_ANNOTATION in str(sch.trace)
    assert cuda_source(sch.mod)


def test_dlight_only_where_the_pattern_has_no_template_of_its_own():
    for pattern in PATTERNS:
        assert DLIGHT not in pattern.templates_for(LLVM)
        own = [t for t in pattern.templates if isinstance(t, Template) and t.applies_to(H200)]
        assert pattern.templates_for(H200) == (own or [DLIGHT])


def test_tuning_gets_dlight_only_where_it_schedules_the_function():
    for pattern in PATTERNS:
        if [t for t in pattern.templates if isinstance(t, Template) and t.applies_to(H200)]:
            continue  # a CUDA template of its own
        func = pattern.build(pattern.small_shape(), pattern.dtypes[0])
        assert pattern.templates_for(H200, func) == [DLIGHT], pattern.name


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
