"""The CUDA templates of the row reductions (softmax_dropout, layernorm_residual,
gelu_add_layernorm) and of flash_attention compile for the H200 here, with nvcc, without a GPU to
run them on: fixed knobs in float32 and float16, knob samples replayed the way MetaSchedule
replays them, MetaSchedule's CUDA postprocessors, and flash_attention at symbolic lengths.
Whether they compute the right numbers is benchmarks/gpu_check_templates.py's job, on a GPU."""

import pytest
from cuda_support import H200, assert_within_limits as _within_limits, cuda_source as _compile
from cuda_support import assert_one_extent_per_thread_tag, replayed, require_nvcc
from tvm import tirx
from tvm.s_tir import Schedule

from autofuse.pattern import TEMPLATE_ANNOTATION, Template
from autofuse.registry import all_patterns

require_nvcc()

NAMES = ("softmax_dropout", "layernorm_residual", "gelu_add_layernorm", "flash_attention")
CASES = [(p, t) for p in (all_patterns()[n] for n in NAMES) for t in p.templates
         if isinstance(t, Template) and t.applies_to(H200)]  # kernel templates: test_hopper_kernel_templates
IDS = [f"{p.name}-{t.name}" for p, t in CASES]
SAMPLES = 3


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("pattern,template", CASES, ids=IDS)
def test_fixed_knobs_compile(pattern, template, dtype):
    shape = pattern.small_shape()
    sch = template.apply(pattern.build(shape, dtype), H200, tunable=False)
    assert TEMPLATE_ANNOTATION in str(sch.trace)
    assert_one_extent_per_thread_tag(sch.mod)
    source = _compile(sch.mod)
    _within_limits(source)
    assert "threadIdx.x" in source
    # The reductions across a row's threads are warp shuffles.
    assert "__shfl_down_sync" in source
    if template.name.endswith("_smem") or pattern.name == "flash_attention":
        assert "__shared__" in source


@pytest.mark.parametrize("pattern,template", CASES, ids=IDS)
def test_samples_replay_and_compile(pattern, template):
    shape = pattern.small_shape()
    func = pattern.build(shape, "float32")
    decisions = set()
    for sch in replayed(template, func, range(2, SAMPLES + 2)):
        decisions.add(str(sch.trace.decisions))
        assert_one_extent_per_thread_tag(sch.mod)
        _within_limits(_compile(sch.mod))
    assert decisions, "the template should draw knobs"


@pytest.mark.parametrize("pattern,template", CASES, ids=IDS)
def test_metaschedule_reduction_postproc_keeps_the_schedule(pattern, template):
    """Two of MetaSchedule's CUDA postprocessors, which tuning runs on every candidate (the others
    need a tuning context): RewriteReductionBlock must find nothing left to decompose (it once
    moved flash_tiles' per-tile inits to the wrong loop and every tuned record was wrong)."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    func = pattern.build(pattern.small_shape(), "float32")
    sch = template.apply(func, H200, tunable=False)
    before = sch.mod
    assert ms.postproc.RewriteReductionBlock().apply(sch)
    assert tvm_ffi.structural_equal(before, sch.mod)
    assert ms.postproc.DisallowDynamicLoop().apply(sch)


@pytest.mark.parametrize("over", [{"seq_kv": 70, "seq_q": 13}, {"seq_kv": 70, "seq_q": 70, "heads": 4, "kv_heads": 2}])
def test_flash_attention_padded_last_key_tile_passes_the_postprocs(over):
    """A seq_kv that is not a multiple of the key tile clamps the last tile's keys; the V copy
    still has a constant extent (a whole-window read), or tuning would reject every candidate."""
    from tvm.s_tir import meta_schedule as ms

    pattern = all_patterns()["flash_attention"]
    template = next(t for t in pattern.templates if t.name == "cuda_flash")
    func = pattern.build(pattern.resolve_shape(dict(pattern.small_shape(), **over)), "float32")
    for sch in [template.apply(func, H200, tunable=False), *replayed(template, func, [2, 3])]:
        assert ms.postproc.DisallowDynamicLoop().apply(sch)
        assert "T.min(t * 64, 6)" in sch.mod.script()
        _within_limits(_compile(sch.mod))


@pytest.mark.parametrize("names", [["seq_q"], ["seq_kv"], ["seq_q", "seq_kv"]], ids="+".join)
def test_flash_attention_symbolic_lengths_compile(names):
    pattern = all_patterns()["flash_attention"]
    template = next(t for t in pattern.templates if t.name == "cuda_flash")
    shape = {**pattern.small_shape(), **{n: tirx.Var(n, "int64") for n in names}}
    sch = template.apply(pattern.build(shape, "float32"), H200, tunable=False)
    source = _compile(sch.mod)
    assert "__shared__" in source and "__shfl_down_sync" in source


def test_flash_attention_large_head_dim_reads_v_through_l1():
    """head_dim 128 in float32: K (padded, float32) and V do not both fit 48 KiB; V is not staged."""
    pattern = all_patterns()["flash_attention"]
    template = next(t for t in pattern.templates if t.name == "cuda_flash")
    shape = {**pattern.small_shape(), "head_dim": 128, "seq_kv": 64}
    sch = template.apply(pattern.build(shape, "float32"), H200, tunable=False)
    assert not [b for b in ("v_shared",) if b in sch.mod.script()]
    _within_limits(_compile(sch.mod))


def test_flash_attention_short_static_trace_replays_on_symbolic_seq_kv():
    """A trace made at seq_kv = 16 (one 16-key tile) replayed on a symbolic seq_kv (64-key tiles),
    as autofuse.dynamic does: the staged V tile must index keys modulo 64, not 16, or keys 16
    apart would share a row."""
    from autofuse.dynamic import symbolic

    pattern = all_patterns()["flash_attention"]
    template = next(t for t in pattern.templates if t.name == "cuda_flash")
    shape = pattern.small_shape()
    assert shape["seq_kv"] < 64
    trace = template.apply(pattern.build(shape, "float32"), H200, tunable=False).trace
    sch = Schedule(pattern.build(symbolic(shape, ["seq_kv"]), "float32"))
    trace.apply_to_schedule(sch, remove_postproc=False)
    source = _compile(sch.mod)
    assert "& (int64_t)63" in source and "& (int64_t)15" not in source
