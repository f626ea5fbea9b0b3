"""The tirx kernel templates' kernels compute the right numbers on the CPU: the CUDA source TVM
generates for the H200 runs under cuda_emulator (TMA tensor copies with their swizzles, wgmma from
shared-memory descriptors and from registers, mbarriers, named and cluster barriers, distributed
shared memory, the split-KV merge's atomic count; both thread orders) and is compared with the
pattern's numpy reference at its tolerance, as tests/test_kernel_templates_gpu.py does on a GPU.

One case a template family, at shapes that emulate in a few seconds: padded tiles, GQA, causal
masks, split-K, both half types. The last tests break a kernel (a dropped wait or barrier, a
transposed operand) and expect the emulator to notice, or passing would prove little.
"""

import pytest
from cuda_emulator import EmulatorError, NotEmulated, emulate, emulate_program, lower, unavailable_reason
from cuda_support import H200

from autofuse import kernel_templates as K
from autofuse.registry import get_pattern

_reason = unavailable_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

_GQA = {"batch": 1, "num_heads": 32, "num_kv_heads": 2, "head_dim": 128, "max_seq": 1024, "cache_len": 700}
_FLASH = {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 200, "seq_kv": 333, "head_dim": 128, "causal": 1}
CASES = [  # (pattern, template, shape, dtype, knobs over the template's defaults)
    # split-KV decode: the merges (a combine kernel, a cluster's distributed shared memory, the last split)
    # (and the ring's L2 policies: none where there is no ring)
    *(("gqa_decode_attention", "cuda_split_kv", _GQA, "float16", {"merge": merge, "stages": stages, "evict_first": evict})
      for merge, stages, evict in (("combine", 4, 2), ("cluster", 0, 0), ("last", 4, 1))),
    ("gqa_decode_attention", "cuda_split_kv", {"batch": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                                               "max_seq": 512, "cache_len": 300}, "bfloat16",
     {"merge": "cluster", "stages": 4, "warps": 4, "keys": 1}),  # 5 steps a split: the ring's waits reach parity 1
    ("paged_attention", "cuda_split_kv", {"batch": 3, "q_len": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                                          "page_size": 32, "max_pages": 8, "num_pages": 30}, "bfloat16", {}),
    ("paged_attention", "cuda_split_kv", {"batch": 2, "q_len": 16, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64,
                                          "page_size": 32, "max_pages": 8, "num_pages": 20}, "float16", {}),
    ("spec_verify_attention", "cuda_split_kv", {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 64, "max_seq": 512,
                                                "cache_len": 300, "k_draft": 5}, "bfloat16", {}),
    # tensor cores: TMA + wgmma
    ("flash_attention", "cuda_wgmma_flash", _FLASH, "float16", {}),
    ("flash_attention", "cuda_wgmma_flash", {"batch": 1, "heads": 4, "kv_heads": 4, "seq_q": 384, "seq_kv": 384,
                                             "head_dim": 64, "causal": 0}, "bfloat16", {}),
    ("masked_attention", "cuda_wgmma_masked", {"batch": 3, "heads": 4, "kv_heads": 4, "seq_q": 77, "seq_kv": 290,
                                               "head_dim": 64, "mask_rows": 1}, "bfloat16", {}),
    ("cross_attention", "cuda_wgmma_flash", {"batch": 2, "heads": 4, "seq_q": 77, "seq_kv": 257, "head_dim": 128},
     "float16", {}),
    ("rope_qk", "cuda_wgmma_scores", {"batch": 2, "heads": 4, "seq_q": 200, "seq_k": 334, "head_dim": 128}, "float16", {}),
    ("rope_qk", "cuda_rotate_then_gemm", {"batch": 1, "heads": 8, "seq_q": 256, "seq_k": 512, "head_dim": 64},
     "bfloat16", {}),
    ("paged_attention", "cuda_wgmma_prefill", {"batch": 2, "q_len": 100, "num_heads": 8, "num_kv_heads": 2,
                                               "head_dim": 128, "page_size": 256, "max_pages": 3, "num_pages": 7},
     "float16", {}),
    ("spec_verify_attention", "cuda_wgmma_verify", {"batch": 8, "heads": 16, "kv_heads": 2, "head_dim": 64,
                                                    "max_seq": 512, "cache_len": 0, "k_draft": 16}, "bfloat16", {}),
    ("linear_bias_relu", "cuda_wgmma", {"m": 512, "n": 384, "k": 512}, "bfloat16", {}),
    ("linear_bias_gelu", "cuda_wgmma_split_k", {"m": 192, "n": 2304, "k": 1024}, "bfloat16", {}),
    ("swiglu_ffn", "cuda_wgmma", {"tokens": 128, "hidden": 256, "inter": 704, "p_permille": 0}, "bfloat16", {}),
    ("swiglu_ffn", "cuda_wgmma_split_k", {"tokens": 128, "hidden": 512, "inter": 2048, "p_permille": 100}, "float16", {}),
    # routing, placement, the grouped wgmma GEMMs over the routed rows and the combine: six kernels
    ("moe_gate_topk", "cuda_wgmma", {"tokens": 130, "hidden": 256, "inter": 256, "experts": 40, "k": 4}, "bfloat16", {}),
    ("woq_matmul", "cuda_wgmma_woq", {"m": 16, "n": 768, "k": 512, "group": 128, "bits": 8}, "bfloat16", {}),
    ("int8_matmul_dequant", "cuda_wgmma_int8", {"m": 256, "n": 640, "k": 512, "relu": 0}, "float32", {}),
]


def _module(name, tname, shape, dtype, knobs):
    import tvm

    pattern = get_pattern(name)
    template = K.kernel_template(pattern, tname)
    assert template.applies(shape, dtype, H200), (name, tname, shape, dtype)
    func = template.build(shape, dtype, {**template.default_for(shape, dtype), **knobs})
    return pattern, tvm.IRModule({"main": func})


@pytest.mark.parametrize("name,tname,shape,dtype,knobs", CASES,
                         ids=[f"{n}-{t}-{d}" + (f"-{k}" if k else "") for n, t, _, d, k in CASES])
def test_kernel_template_matches_reference(name, tname, shape, dtype, knobs, tmp_path):
    pattern, mod = _module(name, tname, shape, dtype, knobs)
    inputs = pattern.make_inputs(shape, dtype, 1234)
    try:
        outputs = emulate(mod, inputs, tmp_path)
    except NotEmulated as err:
        pytest.fail(f"no longer emulated: {err}")
    result = pattern.check(outputs, inputs, shape, dtype)
    assert result.ok, f"{tname} {knobs} at {shape} {dtype}: {result.message} (max abs error {result.max_abs_err:.3g})"


def _broken(tmp_path, case, anchor, old, new, every=False):
    """The case's program with the first ``old`` after ``anchor`` (in the kernels; ``every``: all of
    them) made ``new``; the pattern's check of its outputs."""
    name, tname, shape, dtype, knobs = case
    pattern, mod = _module(name, tname, shape, dtype, knobs)
    program = lower(mod)
    at = program.source.index(old, program.source.index(anchor, program.source.index('extern "C"')))
    rest = program.source[at:].replace(old, new, -1 if every else 1)
    program.source = program.source[:at] + rest
    inputs = pattern.make_inputs(shape, dtype, 1234)
    outputs = emulate_program(program, inputs, tmp_path)
    return pattern.check(outputs, inputs, shape, dtype)


def test_a_last_split_merge_without_its_barrier_is_caught(tmp_path):
    """The barrier after the arrival count, which shares "this block merges" with the block,
    dropped: in one thread order some threads read the flag before it is written (poison), skip
    the merge and leave the merging thread alone at the merge's barriers."""
    case = next(c for c in CASES if c[4].get("merge") == "last")
    with pytest.raises(EmulatorError, match="between thread orders|different synchronisation points"):
        _broken(tmp_path, case, "autofuse_split_arrive(", "tvm_builtin_cuda_cta_sync();", ";")


def test_tma_copies_nobody_waits_for_are_caught(tmp_path):
    """flash attention's mbarrier waits removed (after the first copy is issued): in one thread
    order the consumers read Q and K/V slots before the producer's copies land."""
    case = next(c for c in CASES if c[1] == "cuda_wgmma_flash")
    with pytest.raises(EmulatorError, match="between thread orders"):
        _broken(tmp_path, case, "emu::tensor_load(", "tvm_builtin_cuda_mbarrier_wait(", "(void)(", every=True)


def test_a_transposed_wgmma_operand_is_caught(tmp_path):
    """O += P V with V read K-major instead of MN-major (the transpose flag of the register-A
    wgmma flipped): the numbers must be wrong."""
    case = next(c for c in CASES if c[1] == "cuda_wgmma_flash")
    result = _broken(tmp_path, case, "emu::wgmma_rs<", ", 1>(__LINE__", ", 0>(__LINE__")
    assert not result.ok
