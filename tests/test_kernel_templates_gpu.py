"""The Hopper kernel templates on the GPU (skipped without one; benchmarks/gpu_session.sh kernels
runs this file on the H200): each pattern's kernel template default passes the numerical check
(``verify.choose`` takes it before the S-TIR templates), a short search stores checked and timed
records that ``choose`` weighs never-worse, and the float16 decoder_block builds with the
flash_attention, swiglu_ffn and linear kernel templates and matches onnxruntime."""

import os
import subprocess
import sys

import pytest
import tvm

from autofuse import building as B
from autofuse import kernel_templates as K
from autofuse import verify
from autofuse.database import TuningDatabase
from autofuse.registry import get_pattern
from autofuse.target import device_for, parse_target
from autofuse.tune_patterns import Job
from conftest import REPO
from search_spaces.lib import cuda_wgmma

H200 = parse_target("h200")
DEV = device_for(H200)
pytestmark = pytest.mark.skipif(not DEV.exist, reason="no CUDA GPU here")

# Shapes that take every piece of each kernel (several k slices and CTAs, GQA, the causal
# diagonal, a cache length no multiple of a step) and check in seconds.
CASES = [
    ("linear_bias_relu", {"m": 2048, "n": 2048, "k": 512}, "float16"),     # the default 128 x 256 tile
    ("linear_bias_relu", {"m": 512, "n": 384, "k": 512}, "bfloat16"),       # few CTAs: 64 x 64 (fill_tile)
    # K split: 32 tiles of 128 x 128 x 4 splits of 4 slices; 54 tiles of 64 x 128 (the one-role
    # kernel) x 2, the float32 partials summed with the bias and the activation (W stored (k, n));
    # 128 x 11008: the unsplit kernel's 64 x 64 tiles on a ring of 4, three CTAs a SM
    ("linear_bias_relu", {"m": 128, "n": 4096, "k": 1024}, "float16"),
    ("linear_bias_gelu", {"m": 192, "n": 2304, "k": 1024}, "bfloat16"),
    ("linear_bias_relu", {"m": 128, "n": 11008, "k": 512}, "float16"),
    ("swiglu_ffn", {"tokens": 256, "hidden": 512, "inter": 1408, "p_permille": 100}, "float16"),
    ("swiglu_ffn", {"tokens": 128, "hidden": 256, "inter": 704, "p_permille": 0}, "bfloat16"),
    ("flash_attention", {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 256, "seq_kv": 512, "head_dim": 128,
                         "causal": 1}, "float16"),
    ("flash_attention", {"batch": 1, "heads": 4, "kv_heads": 4, "seq_q": 384, "seq_kv": 384, "head_dim": 64,
                         "causal": 0}, "bfloat16"),
    # 256 work items: the persistent CTAs take two each (the ring and query barriers' second phase)
    ("flash_attention", {"batch": 2, "heads": 16, "kv_heads": 4, "seq_q": 1024, "seq_kv": 1024, "head_dim": 128,
                         "causal": 1}, "float16"),
    # padded last tiles: query rows past seq_q not stored, keys past seq_kv masked (and causal)
    ("flash_attention", {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 200, "seq_kv": 333, "head_dim": 128,
                         "causal": 0}, "float16"),
    ("flash_attention", {"batch": 3, "heads": 4, "kv_heads": 4, "seq_q": 1000, "seq_kv": 1000, "head_dim": 64,
                         "causal": 1}, "bfloat16"),
    ("cross_attention", {"batch": 2, "heads": 4, "seq_q": 77, "seq_kv": 257, "head_dim": 128}, "float16"),
    ("gqa_decode_attention", {"batch": 4, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "max_seq": 2048,
                              "cache_len": 1500}, "float16"),
    ("gqa_decode_attention", {"batch": 2, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "max_seq": 512,
                              "cache_len": 0}, "bfloat16"),
    # 16 query heads per K/V head (two row sets; the first appends), an MQA head of 32 over pages
    ("gqa_decode_attention", {"batch": 2, "num_heads": 32, "num_kv_heads": 2, "head_dim": 128, "max_seq": 1024,
                              "cache_len": 700}, "float16"),
    ("paged_attention", {"batch": 2, "q_len": 1, "num_heads": 32, "num_kv_heads": 1, "head_dim": 64,
                         "page_size": 16, "max_pages": 16, "num_pages": 40}, "bfloat16"),
    # the split kernel (fewer than VERIFY_MIN_ITEMS (batch, K/V head) items): 8 drafts of 4 heads per
    # K/V head in sets of 8 rows over 1500 cached keys; 5 drafts, an empty cache
    ("spec_verify_attention", {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128, "max_seq": 2048,
                               "cache_len": 1500, "k_draft": 8}, "float16"),
    ("spec_verify_attention", {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 64, "max_seq": 512,
                               "cache_len": 0, "k_draft": 5}, "bfloat16"),
    # the tensor-core prefill: 32 rows an item over 1500 keys (a last tile of 92, its V tail zeroed);
    # 8 x 16 rows, one whole query tile, an empty cache; 4 x 5 rows, the tree's rows by row % 5
    ("spec_verify_attention", {"batch": 4, "heads": 32, "kv_heads": 8, "head_dim": 128, "max_seq": 2048,
                               "cache_len": 1500, "k_draft": 8}, "float16"),
    ("spec_verify_attention", {"batch": 8, "heads": 16, "kv_heads": 2, "head_dim": 64, "max_seq": 512,
                               "cache_len": 0, "k_draft": 16}, "bfloat16"),
    ("spec_verify_attention", {"batch": 16, "heads": 8, "kv_heads": 2, "head_dim": 128, "max_seq": 512,
                               "cache_len": 300, "k_draft": 5}, "float16"),
    ("linear", {"m": 512, "n": 768, "k": 1024}, "float16"),
    ("linear_bias", {"m": 256, "n": 384, "k": 512}, "bfloat16"),
    ("linear_bias_gelu", {"m": 512, "n": 768, "k": 1024}, "float16"),
    ("linear_bias_gelu_tanh", {"m": 256, "n": 384, "k": 512}, "bfloat16"),
    ("int8_matmul_dequant", {"m": 2048, "n": 2048, "k": 1024, "relu": 1}, "float32"),  # BN 256: two m64n128k32
    ("int8_matmul_dequant", {"m": 256, "n": 640, "k": 512, "relu": 0}, "float32"),    # 64 x 64
    # W int4/int8 dequantised by the producer: 64 features x 128 tokens; a decode batch of 16 tokens;
    # two consumer warpgroups (128 features) over 16 K slices, every ring refilled
    ("woq_matmul", {"m": 256, "n": 512, "k": 1024, "group": 64, "bits": 4}, "float16"),
    ("woq_matmul", {"m": 16, "n": 768, "k": 512, "group": 128, "bits": 8}, "bfloat16"),
    ("woq_matmul", {"m": 512, "n": 4096, "k": 1024, "group": 32, "bits": 4}, "float16"),
    # a padding mask (one row, seeded lengths) over GQA heads; then causal + padding, a row per query
    ("masked_attention", {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 256, "seq_kv": 512, "head_dim": 128,
                          "mask_rows": 1}, "float16"),
    ("masked_attention", {"batch": 2, "heads": 4, "kv_heads": 4, "seq_q": 384, "seq_kv": 384, "head_dim": 64,
                          "mask_rows": 384}, "bfloat16"),
    ("masked_attention", {"batch": 2, "heads": 16, "kv_heads": 16, "seq_q": 1024, "seq_kv": 1024, "head_dim": 64,
                          "mask_rows": 1}, "float16"),
    # padded last tiles under a mask: a row per query (padded rows read the last query's), one row
    ("masked_attention", {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 200, "seq_kv": 334, "head_dim": 128,
                          "mask_rows": 200}, "float16"),
    ("masked_attention", {"batch": 3, "heads": 4, "kv_heads": 4, "seq_q": 77, "seq_kv": 290, "head_dim": 64,
                          "mask_rows": 1}, "bfloat16"),
    ("cross_attention", {"batch": 2, "heads": 4, "seq_q": 256, "seq_kv": 384, "head_dim": 128}, "float16"),
    # rotary scores: padded query and key tiles (queries at the last positions), the tiles rotated in
    # shared memory; rotated once then a batched GEMM: D64 (pairs in one box), 320 queries (one
    # consumer warpgroup's 64-row tiles)
    ("rope_qk", {"batch": 2, "heads": 4, "seq_q": 200, "seq_k": 334, "head_dim": 128}, "float16"),
    ("rope_qk", {"batch": 1, "heads": 8, "seq_q": 256, "seq_k": 512, "head_dim": 64}, "bfloat16"),
    ("rope_qk", {"batch": 2, "heads": 4, "seq_q": 320, "seq_k": 384, "head_dim": 128}, "float16"),
    # padded tiles of the batched GEMM: its TMA copies zero-filled and its stores clipped per head
    ("rope_qk", {"batch": 3, "heads": 4, "seq_q": 200, "seq_k": 1000, "head_dim": 64}, "bfloat16"),
    # sequences of seeded lengths over scattered pages; a block table whose unused entries point anywhere
    ("paged_attention", {"batch": 4, "q_len": 1, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                         "page_size": 16, "max_pages": 64, "num_pages": 300}, "float16"),
    ("paged_attention", {"batch": 3, "q_len": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                         "page_size": 32, "max_pages": 8, "num_pages": 30}, "bfloat16"),
    # chunks: 3 tokens of 4 heads per K/V head (12 rows: sets of 6); 16 tokens of 8 query heads
    ("paged_attention", {"batch": 4, "q_len": 3, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                         "page_size": 16, "max_pages": 64, "num_pages": 300}, "float16"),
    ("paged_attention", {"batch": 2, "q_len": 16, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64,
                         "page_size": 32, "max_pages": 8, "num_pages": 20}, "bfloat16"),
    # longer chunks on the tensor-core prefill: 200 tokens (a padded query tile) over 16-key pages;
    # 300 tokens of MQA over pages of one 128-key tile; 100 tokens over pages of two tiles
    ("paged_attention", {"batch": 3, "q_len": 200, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128,
                         "page_size": 16, "max_pages": 48, "num_pages": 160}, "float16"),
    ("paged_attention", {"batch": 2, "q_len": 300, "num_heads": 4, "num_kv_heads": 1, "head_dim": 64,
                         "page_size": 128, "max_pages": 6, "num_pages": 15}, "bfloat16"),
    ("paged_attention", {"batch": 2, "q_len": 100, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128,
                         "page_size": 256, "max_pages": 3, "num_pages": 7}, "float16"),
]
IDS = [f"{name}-{dtype}-{'-'.join(str(v) for v in shape.values())}" for name, shape, dtype in CASES]


@pytest.mark.parametrize("name, shape, dtype", CASES, ids=IDS)
def test_the_kernel_template_default_passes_its_check(name, shape, dtype):
    job = Job(get_pattern(name), shape, dtype)
    template = K.kernel_templates_for(job.pattern, shape, dtype, H200)[0]  # the first tried
    choice, rejected = verify.choose(job, None, H200, DEV)
    assert choice.source == verify.TEMPLATE_DEFAULT, rejected
    assert choice.knobs == template.default_for(shape, dtype), rejected  # not an S-TIR template's
    assert B.is_tirx(choice.mod["main"])


@pytest.mark.parametrize("name, shape, dtype", CASES[::2], ids=IDS[::2])
def test_a_short_search_records_checked_configs_and_choose_is_never_worse(name, shape, dtype, tmp_path):
    db = TuningDatabase(str(tmp_path), H200)
    job = Job(get_pattern(name), shape, dtype)
    stats = K.tune_kernels([job], H200, db, trials=3, dev=DEV, measure=verify.device_measure(DEV))
    records = db.kernels.of(name, shape, dtype)
    assert stats[0].trials == len(records) == 3
    assert all(r.ok for r in records), [(r.label(), r.checked) for r in records if not r.ok]
    choice, _ = verify.choose(job, db, H200, DEV)
    assert choice.record_source.startswith(K.SOURCE_PREFIX)
    assert choice.secs == min(choice.record_secs, choice.default_secs)


@pytest.mark.parametrize("shape, dtype", [
    ({"m": 512, "n": 1024, "k": 1024, "group": 128, "bits": 4}, "float16"),
    ({"m": 256, "n": 768, "k": 512, "group": 64, "bits": 8}, "bfloat16"),
])
def test_woq_dequantised_first_passes_its_check(shape, dtype):
    """The woq knob no default takes: W dequantised once into a workspace, then the wgmma GEMM
    (two kernels in one PrimFunc), checked as a search's trial is."""
    pattern = get_pattern("woq_matmul")
    (template,) = K.kernel_templates_for(pattern, shape, dtype, H200)
    func = template.build(shape, dtype, {**cuda_wgmma.WOQ_DEFAULT_KNOBS, "dequant_first": 1})
    result = verify.check_module(pattern, B.build_tirx(func, H200), pattern.build(shape, dtype), shape, dtype, DEV)
    assert result.ok, result.message


@pytest.mark.parametrize("shape, dtype", [
    ({"tokens": 128, "hidden": 4096, "inter": 1024, "p_permille": 100}, "float16"),   # 32 tiles x 4 splits
    ({"tokens": 64, "hidden": 4096, "inter": 2048, "p_permille": 0}, "bfloat16"),     # 64-row tiles
])
def test_swiglu_with_the_down_projection_split_passes_its_check(shape, dtype):
    """swiglu_ffn's cuda_wgmma_split_k (searched, no default takes it): the gate kernel, the down
    projection's float32 partials, their sum with dropout and the residual, checked as a trial is."""
    pattern = get_pattern("swiglu_ffn")
    template = K.kernel_template(pattern, "cuda_wgmma_split_k")
    func = template.build(shape, dtype)
    result = verify.check_module(pattern, B.build_tirx(func, H200), pattern.build(shape, dtype), shape, dtype, DEV)
    assert result.ok, result.message


DECODE_CASES = [(shape, dtype) for name, shape, dtype in CASES if name == "gqa_decode_attention"]


DECODE_IDS = [f"{dtype}-{shape['max_seq']}-{shape['cache_len']}" for shape, dtype in DECODE_CASES]


def _check_decode(shape, dtype, knobs, calls=1):
    """cuda_split_kv at its defaults with ``knobs`` over them, checked as a search's trial is
    (output and both caches), ``calls`` times on one module."""
    pattern = get_pattern("gqa_decode_attention")
    template = K.kernel_template(pattern, "cuda_split_kv")
    module = B.build_tirx(template.build(shape, dtype, {**template.default_for(shape, dtype), **knobs}), H200)
    for _ in range(calls):
        result = verify.check_module(pattern, module, pattern.build(shape, dtype), shape, dtype, DEV)
        assert result.ok, result.message


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("shape, dtype", DECODE_CASES, ids=DECODE_IDS)
def test_decode_through_the_shared_memory_ring_passes_its_check(shape, dtype, stages):
    """gqa_decode_attention's split kernel with its keys bulk-copied through a ring of ``stages``
    steps and the append bulk-copied out of it (the new token's row patched in)."""
    _check_decode(shape, dtype, {"stages": stages})


@pytest.mark.parametrize("stages", [0, 4])
@pytest.mark.parametrize("shape, dtype", DECODE_CASES, ids=DECODE_IDS)
def test_decode_merged_in_a_cluster_passes_its_check(shape, dtype, stages):
    """gqa_decode_attention's split kernel with its splits' partials merged over distributed shared
    memory in their thread-block cluster (no combine kernel)."""
    _check_decode(shape, dtype, {"stages": stages, "merge": "cluster", "evict_first": min(stages, 1)})


@pytest.mark.parametrize("stages", [0, 4])
@pytest.mark.parametrize("shape, dtype", DECODE_CASES, ids=DECODE_IDS)
def test_decode_merged_by_the_last_split_passes_its_check(shape, dtype, stages):
    """gqa_decode_attention's split kernel whose last split to finish merges the partials (no
    combine kernel), twice on one module: the module's counters are zero again after each call."""
    _check_decode(shape, dtype, {"stages": stages, "merge": "last", "evict_first": min(stages, 1)}, calls=2)


@pytest.mark.parametrize("evict_first", [1, 2])
@pytest.mark.parametrize("shape, dtype", DECODE_CASES, ids=DECODE_IDS)
def test_decode_under_each_l2_policy_passes_its_check(shape, dtype, evict_first):
    """The ring's bulk copies with an evict-first L2 policy on the copies in, and on the copies out
    as well (the default: no policy)."""
    _check_decode(shape, dtype, {"evict_first": evict_first})


MOE_CASES = [
    # 64 routed rows an expert on average: 64-row tiles, one role
    ({"tokens": 256, "hidden": 512, "inter": 1024, "experts": 8, "k": 2}, "float16", None),
    # 40 experts (two a lane when routing), 130 tokens (a last route block part empty), k 4
    ({"tokens": 130, "hidden": 256, "inter": 256, "experts": 40, "k": 4}, "bfloat16", None),
    # the GEMMs' own defaults: 128 x 256 tiles, warp-specialised, 128-row expert segments
    ({"tokens": 1024, "hidden": 512, "inter": 1024, "experts": 4, "k": 2}, "float16", "wgmma defaults"),
]


@pytest.mark.parametrize("shape, dtype, knobs", MOE_CASES, ids=["e8-f16", "e40-k4-bf16", "e4-gemm-defaults"])
def test_moe_experts_on_tensor_cores_pass_their_check(shape, dtype, knobs):
    """moe_gate_topk's grouped wgmma GEMMs over the routed rows, with routing, placement and combine
    around them (six kernels in one PrimFunc), checked as a search's trial is."""
    from search_spaces.moe.moe_gate_topk import WGMMA_DEFAULT_KNOBS

    pattern = get_pattern("moe_gate_topk")
    (template,) = K.kernel_templates_for(pattern, shape, dtype, H200)
    func = template.build(shape, dtype, WGMMA_DEFAULT_KNOBS if knobs else template.default_for(shape, dtype))
    result = verify.check_module(pattern, B.build_tirx(func, H200), pattern.build(shape, dtype), shape, dtype, DEV)
    assert result.ok, result.message


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_moe_torch_function_computes_the_reference(dtype):
    """moe_gate_topk's torch_function (what torch-eager and torch-compile run: the per-expert loop
    over the routed rows) gives the reference's result to half-precision rounding."""
    import numpy as np

    torch = pytest.importorskip("torch")
    pattern = get_pattern("moe_gate_topk")
    shape = {"tokens": 300, "hidden": 256, "inter": 512, "experts": 8, "k": 2}
    args = [torch.from_numpy(a).cuda().to(getattr(torch, dtype)) for a in pattern.make_inputs(shape, "float32", 5)]
    (got,) = pattern.torch_function(torch, shape, *args)
    # the reference on the very inputs torch got (rounded to the dtype), in float32 and up
    want = pattern.run_reference([a.float().cpu().numpy() for a in args], shape)[0].astype(np.float64)
    err = np.abs(got.float().cpu().numpy() - want).max() / np.abs(want).max()
    assert err < (4e-3 if dtype == "float16" else 3e-2), err


@pytest.mark.parametrize("cache_len", [1000, 1020])
def test_spec_verify_sdpa_baseline_computes_the_reference(cache_len):
    """spec_verify_attention's torch-sdpa baseline: the drafts written into the caches' free rows
    (1000 + 8 <= 1024), or concatenated where they do not fit (1020), gives the reference."""
    import numpy as np

    torch = pytest.importorskip("torch")
    pattern = get_pattern("spec_verify_attention")
    shape = {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 64, "max_seq": 1024, "cache_len": cache_len,
             "k_draft": 8}
    inputs = pattern.make_inputs(shape, "float16", 3)
    args = [torch.from_numpy(a).cuda() for a in inputs]
    (got,) = pattern.sdpa(torch, shape, *args)
    want = pattern.run_reference([a.astype(np.float32) if a.dtype == np.float16 else a for a in inputs],
                                 shape)[0].astype(np.float64)
    err = np.abs(got.float().cpu().numpy() - want).max() / np.abs(want).max()
    assert err < 4e-3, err


@pytest.mark.parametrize("dtype,rows", [("bfloat16", 256), ("float16", 1)])
def test_the_masked_kernel_on_rows_without_a_visible_key(dtype, rows):
    """cuda_wgmma_masked where make_inputs' masks never go: a row (or, with one mask row, a batch)
    of -inf keys only stores 0, a row of finfo.min keys the average of V (bfloat16: its finfo.min
    times log2(e) would overflow float32), and leading key tiles with no visible key leave no NaN."""
    import numpy as np

    from autofuse.measure import to_device
    from search_spaces.attention.masked_attention import MASKED

    pattern = get_pattern("masked_attention")
    shape = {"batch": 2, "heads": 4, "kv_heads": 2, "seq_q": 256, "seq_kv": 384, "head_dim": 64, "mask_rows": rows}
    (template,) = K.kernel_templates_for(pattern, shape, dtype, H200)
    rt = B.build_tirx(template.build(shape, dtype), H200)
    q, k, v, mask = pattern.make_inputs(shape, dtype, 3)
    mask = mask.copy()
    if rows == 1:
        mask[1, 0, 0, :] = -np.inf                   # batch 1: every row 0
        mask[0, 0, 0, :300] = -np.inf                # batch 0: the first two 128-key tiles hidden
        mask[0, 0, 0, 300:] = 0
    else:
        mask[0, 0, 5, :] = -np.inf
        mask[0, 0, 6, :] = MASKED[dtype]
        mask[1, 0, 130, :] = -np.inf
        mask[1, 0, 130, 300:310] = 0
        mask[1, 0, 131, :128] = MASKED[dtype]
        mask[1, 0, 131, 128:] = 0
    inputs = [q, k, v, mask]
    func = pattern.build(shape, dtype)
    (out_shape, out_dtype), = pattern.output_specs(func)
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, dtype=out_dtype), DEV)  # rows left unwritten stay NaN
    rt(*to_device(inputs, DEV), out)
    got = out.numpy()
    assert not np.isnan(got.astype(np.float32)).any()
    result = pattern.check([got], inputs, shape, dtype, func)
    assert result.ok, result.message
    if rows == 1:
        assert not got[1].astype(np.float32).any()
    else:
        assert not got[0, :, 5].astype(np.float32).any()


def test_the_float16_decoder_block_builds_with_kernel_templates_and_matches_onnxruntime(tmp_path):
    from autofuse.model.jobs import build_model, prepare

    subprocess.run([sys.executable, os.path.join(REPO, "models", "make_models.py"), "--out", str(tmp_path),
                    "--only", "decoder_block", "--dtype", "float16"], check=True, capture_output=True, timeout=300)
    prepared = prepare(str(tmp_path / "decoder_block-float16.onnx"), "patterns")
    result = build_model(prepared, H200, None, str(tmp_path / "decoder.so"))
    assert result.verified, result.message
    tirx = {d.pattern for d in result.decisions if "tirx kernel" in d.note}
    # the projections are linear (x W) kernels on wgmma too
    assert tirx == {"flash_attention", "swiglu_ffn", "linear"}, [(d.name, d.note) for d in result.decisions]
