"""The patterns' Hopper kernel templates (tirx, sm_90a), without a GPU: where each applies and where
it falls back to the S-TIR templates (shape, dtype, target), its knob configurations default first,
its kernel taking the pattern's parameters in the pattern's order, and each default compiling with
nvcc for sm_90a at an LLM-sized shape, with the kernels it should have. Running and checking them
is tests/test_kernel_templates_gpu.py's, on the H200."""

import re
import shutil
import subprocess

import pytest

from autofuse import building as B
from autofuse import kernel_templates as K
from autofuse.measure import param_buffers
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from search_spaces.lib import cuda_attention

H200 = parse_target("h200")
A100 = parse_target('{"kind": "cuda", "arch": "sm_80"}')
LLVM = parse_target("llvm")

F16_MMA = "wgmma_f16_ss_mma_async_sync_aligned_"
S8_MMA = "wgmma_int_ss_mma_async_sync_aligned_"
# pattern -> (a shape its kernel template takes, the kernels its PrimFunc launches, a wgmma marker)
CASES = {
    "linear_bias_relu": ({"m": 2048, "n": 2048, "k": 256}, 1, F16_MMA + "m64n256k16"),
    # 128 rows: K split among 4 CTAs a 128 x 128 tile (128 CTAs), then the sum with bias and ReLU
    "linear_bias_relu:split_k": ({"m": 128, "n": 4096, "k": 1024}, 2, F16_MMA + "m64n128k16"),
    "swiglu_ffn": ({"tokens": 5632, "hidden": 256, "inter": 384, "p_permille": 100}, 2, F16_MMA + "m64n128k16"),
    "flash_attention": ({"batch": 1, "heads": 4, "kv_heads": 2, "seq_q": 128, "seq_kv": 256, "head_dim": 64,
                         "causal": 1}, 1, F16_MMA + "m64n128k16"),
    "cross_attention": ({"batch": 1, "heads": 4, "seq_q": 128, "seq_kv": 384, "head_dim": 128}, 1,
                        F16_MMA + "m64n128k16"),
    "gqa_decode_attention": ({"batch": 2, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "max_seq": 512,
                              "cache_len": 300}, 1, "cluster_ctarank"),   # splits merged in a cluster
    "paged_attention": ({"batch": 2, "q_len": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "page_size": 16,
                         "max_pages": 32, "num_pages": 80}, 2, None),
    # a chunk longer than the split-KV kernel takes: the tensor-core prefill over the pages
    "paged_attention:prefill": ({"batch": 2, "q_len": 200, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128,
                                 "page_size": 16, "max_pages": 32, "num_pages": 80}, 1, F16_MMA + "m64n128k16"),
    "masked_attention": ({"batch": 2, "heads": 4, "kv_heads": 2, "seq_q": 128, "seq_kv": 256, "head_dim": 64,
                          "mask_rows": 1}, 1, F16_MMA + "m64n128k16"),
    # padded tiles: the kernel that rotates its tiles in shared memory
    "rope_qk": ({"batch": 2, "heads": 4, "seq_q": 200, "seq_k": 334, "head_dim": 128}, 1, F16_MMA + "m64n128k16"),
    # whole tiles: every row rotated once, then every head's scores as one batched GEMM
    "rope_qk:gemm": ({"batch": 2, "heads": 4, "seq_q": 256, "seq_k": 384, "head_dim": 128}, 2, F16_MMA + "m64n128k16"),
    "spec_verify_attention": ({"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 128, "max_seq": 512, "cache_len": 300,
                               "k_draft": 8}, 2, None),
    # 32 (batch, K/V head) items: the tensor-core prefill first, a K/V head's 4 x 8 rows one query tile
    "spec_verify_attention:wgmma": ({"batch": 16, "heads": 8, "kv_heads": 2, "head_dim": 128, "max_seq": 512,
                                     "cache_len": 300, "k_draft": 8}, 1, F16_MMA + "m64n128k16"),
    # BN 256: two m64n128k32 per k step (TVM 0.27's s8 wgmma stops at N 224)
    "int8_matmul_dequant": ({"m": 2048, "n": 2048, "k": 1024, "relu": 1}, 1, S8_MMA + "m64n128k32_s32_s8_s8"),
    # W dequantised is wgmma's A (features), the 64 tokens its N
    "woq_matmul": ({"m": 64, "n": 512, "k": 512, "group": 64, "bits": 4}, 1, F16_MMA + "m64n64k16"),
    # zero, route, place, the two grouped GEMMs, combine
    "moe_gate_topk": ({"tokens": 256, "hidden": 512, "inter": 1024, "experts": 8, "k": 2}, 6,
                      F16_MMA + "m64n128k16"),
}
# The dtypes each kernel template computes: half types, but int8_matmul_dequant's is its output's
DTYPES = {"int8_matmul_dequant": ("float32",)}
# What each cannot take: (shape overrides, dtype)
REFUSED = {
    "linear_bias_relu": [({"m": 100}, "float16"), ({}, "float32")],
    # (over 256 rows or with too short a K the unsplit kernel's: test_split_k_sums_the_partials...)
    "linear_bias_relu:split_k": [({"m": 100}, "float16"), ({}, "float32")],
    "swiglu_ffn": [({"inter": 200}, "float16"), ({"tokens": 100}, "bfloat16"), ({}, "float32")],
    "cross_attention": [({"head_dim": 96}, "float16"), ({}, "float32")],
    "flash_attention": [({"head_dim": 96}, "float16"), ({}, "float32"), ({"seq_q": 300, "causal": 1}, "float16")],
    "gqa_decode_attention": [({"head_dim": 80}, "float16"),
                             ({}, "float32")],
    # 17 tokens on pages of 24 keys: too long for the split-KV kernel, pages the prefill cannot box
    "paged_attention": [({"q_len": 17, "page_size": 24}, "float16"), ({"head_dim": 80}, "float16"), ({}, "float32")],
    "paged_attention:prefill": [({"page_size": 24}, "float16"), ({"head_dim": 80}, "bfloat16"), ({}, "float32")],
    "spec_verify_attention": [({"head_dim": 80}, "float16"), ({"head_dim": 256}, "bfloat16"), ({}, "float32")],
    "spec_verify_attention:wgmma": [({"head_dim": 80}, "float16"), ({}, "float32")],
    "rope_qk": [({"seq_k": 335}, "float16"), ({"head_dim": 96}, "bfloat16"), ({}, "float32")],
    "rope_qk:gemm": [({"seq_k": 335}, "float16"), ({"head_dim": 96}, "bfloat16"), ({}, "float32")],
    "masked_attention": [({"seq_kv": 201}, "float16"),
                         ({"head_dim": 96}, "float16"), ({"mask_rows": 2}, "float16"), ({}, "float32")],
    "int8_matmul_dequant": [({"m": 500}, "float32"), ({"n": 600}, "float32"), ({"k": 1000}, "float32"),
                            ({}, "float16")],
    # decode's few tokens stay on the GEMV (cuda_warp_per_row); a scale per 4 values; float32
    "woq_matmul": [({"m": 8}, "float16"), ({"group": 4}, "float16"), ({"n": 500}, "float16"), ({}, "float32")],
    "moe_gate_topk": [({"experts": 65}, "float16"), ({"hidden": 400}, "float16"), ({"inter": 1000}, "bfloat16"),
                      ({}, "float32")],
}
# The shapes of compare's GPU session (benchmarks/gpu_session.sh kernels), compiled with nvcc
# (linear_bias_relu's and int8_matmul_dequant's defaults at 4096^3 are tests/search_spaces/test_cuda_wgmma.py's,
# the decode and verify kernels', whose code does not change with the cache length, test_cuda_attention.py's).
LARGE = {
    "swiglu_ffn": {"tokens": 4096, "hidden": 4096, "inter": 11008, "p_permille": 100},
    "flash_attention": {"batch": 8, "heads": 16, "kv_heads": 16, "seq_q": 2048, "seq_kv": 2048, "head_dim": 128,
                        "causal": 0},
    # not in the session: flash_attention's shape with a mask row per query (causal + padding)
    "masked_attention": {"batch": 8, "heads": 16, "kv_heads": 16, "seq_q": 2048, "seq_kv": 2048, "head_dim": 128,
                         "mask_rows": 2048},
    # not in the session: Llama's 32 heads' scores over 2048 positions
    "rope_qk": {"batch": 1, "heads": 32, "seq_q": 2000, "seq_k": 2000, "head_dim": 128},
    "rope_qk:gemm": {"batch": 1, "heads": 32, "seq_q": 2048, "seq_k": 2048, "head_dim": 128},
    # the GEMM sweep's skinny shape: 4 K splits of 128 x 128 tiles, 128 CTAs
    "linear_bias_relu:split_k": {"m": 128, "n": 4096, "k": 4096},
    # not in the session: a batch of 16 tokens through a 4096^2 int4 layer
    "woq_matmul": {"m": 16, "n": 4096, "k": 4096, "group": 128, "bits": 4},
    # not in the session: Mixtral's expert FFNs (ReLU for SwiGLU) over 4096 tokens
    "moe_gate_topk": {"tokens": 4096, "hidden": 4096, "inter": 14336, "experts": 8, "k": 2},
}


def _dtypes(name):
    return DTYPES.get(name, ("float16", "bfloat16"))


# The kernel template a case names where its pattern has several (the default: its only one)
TEMPLATE = {"linear_bias_relu": "cuda_wgmma", "linear_bias_relu:split_k": "cuda_wgmma_split_k",
            "swiglu_ffn": "cuda_wgmma", "paged_attention": "cuda_split_kv", "paged_attention:prefill": "cuda_wgmma_prefill",
            "spec_verify_attention": "cuda_split_kv", "spec_verify_attention:wgmma": "cuda_wgmma_verify",
            "rope_qk": "cuda_wgmma_scores", "rope_qk:gemm": "cuda_rotate_then_gemm"}


def _pattern(name):
    return get_pattern(name.split(":")[0])


def _template(name):
    kernels = [t for t in _pattern(name).templates if isinstance(t, K.KernelTemplate)]
    (template,) = [t for t in kernels if t.name == TEMPLATE[name]] if name in TEMPLATE else kernels
    return template


def _default(name, dtype=None, shape=None):
    """The kernel template's default kernel, built once per session (parsing takes about a second)."""
    shape, template, dtype = shape or CASES[name][0], _template(name), dtype or _dtypes(name)[0]
    return K.build_cached(_pattern(name), template, shape, dtype, template.default_for(shape, dtype))


def _source(func) -> str:
    return B.build_tirx(func, H200).imports[0].inspect_source()


def _signature(func):
    return [(tuple(int(d) for d in b.shape), str(b.dtype)) for b in param_buffers(func)]


def _epilogue(source: str) -> list[str]:
    """The wgmma GEMMs' epilogue: each element of C, into the pair of columns stored at once."""
    return [line for line in source.splitlines() if re.match(r"\s*out_pair_ptr\[[01]\] = ", line)]


def _kernels(source: str) -> list[str]:
    return re.findall(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) (\w+)\(.*\{', source)


@pytest.mark.parametrize("name", sorted(CASES))
def test_where_it_applies_and_where_the_schedule_rules_take_over(name):
    pattern, template = _pattern(name), _template(name)
    shape = CASES[name][0]
    for dtype in _dtypes(name):  # the first tried (spec_verify's split kernel stays behind the prefill)
        assert K.kernel_templates_for(pattern, shape, dtype, H200)[:1] == [template]
    for target in (A100, LLVM):
        assert K.kernel_templates_for(pattern, shape, _dtypes(name)[0], target) == []
    for overrides, dtype in REFUSED[name]:
        assert K.kernel_templates_for(pattern, {**shape, **overrides}, dtype, H200) == [], (overrides, dtype)
    assert pattern.templates_for(H200), "a CUDA schedule rule stays for the shapes it refuses"


@pytest.mark.parametrize("name", sorted(CASES))
def test_configs_default_first_and_the_default_replays(name):
    template, shape, dtype = _template(name), CASES[name][0], _dtypes(name)[0]
    configs = template.configs(shape, dtype)
    assert configs[0] == template.default_for(shape, dtype)
    assert len({K._knobs_key(c) for c in configs}) == len(configs) > 1
    assert set(configs[0]) == set(template.space)
    # built anew from its knobs, the default is the kernel that was built before (a record replays)
    assert K.func_hash(_default(name)) == K.func_hash(template.build(shape, dtype, configs[0]))
    assert K.func_hash(_default(name)) != K.func_hash(template.build(shape, dtype, configs[1]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_takes_the_patterns_parameters(name):
    pattern = _pattern(name)
    shape, launches, marker = CASES[name]
    for dtype in _dtypes(name):
        func = _default(name, dtype)
        assert B.is_tirx(func) and str(func.attrs[B.TIRX_ARCH_ATTR]) == "sm_90a"
        assert _signature(func) == _signature(pattern.build(shape, dtype))
    source = _source(_default(name))
    assert len(_kernels(source)) == launches
    if marker:
        assert marker in source


def test_swiglu_down_projection_applies_dropout_and_the_residual():
    shape = CASES["swiglu_ffn"][0]
    source = _source(_default("swiglu_ffn"))
    gate, down = source.split('extern "C" __global__')[-2:]
    assert "expf(" in gate and "acc_up_ptr" in gate  # silu(g) * u on the accumulators
    # weights as stored (in, out): N-major wgmma (its transpose flag) in both kernels
    assert "_1_1_0_1(" in gate and "_1_1_0_1(" in down and "_1_1_0_0(" not in source
    store = _epilogue(down)[0]
    assert "X_ptr[" in store and "(uint)" in store  # residual (the operand X) + the hashed dropout mask
    without = _source(_default("swiglu_ffn", shape={**shape, "p_permille": 0}))
    assert "(uint)" not in _epilogue(without.split('extern "C" __global__')[-1])[0]


def test_int8_dequant_wgmma_kernel():
    """int8_matmul_dequant on the H200: TMA copies of int8 tiles, s8 wgmma into int32 accumulators,
    then dequant, bias and (with relu=1) ReLU on them, stored float32; shapes off its tile refused."""
    pattern, template = get_pattern("int8_matmul_dequant"), _template("int8_matmul_dequant")
    shape = CASES["int8_matmul_dequant"][0]
    body = _source(_default("int8_matmul_dequant")).split('extern "C" __global__')[-1]
    assert "cp_async_bulk_tensor_g2s" in body and body.count(S8_MMA + "m64n128k32_s32_s8_s8(") == 2 * 128 // 32
    stores = _epilogue(body)
    relu = "max(((((float)(*(int *)"  # the ReLU around the dequantised accumulator (not the tile order's index max)
    assert stores and all(relu in line for line in stores), stores[:1]
    # relu=0, BN 128 (n = 640 takes no BN 256 tile; 66 x 5 CTAs of 128 x 128 fill the SMs): one
    # m64n128k32 per k step and no ReLU
    plain = {**shape, "m": 8448, "n": 640, "relu": 0}
    assert template.default_for(plain, "float32") == {**template.default, "block_n": 128}
    func = template.build(plain, "float32")
    assert func.attrs["global_symbol"] == "gemm_int8_dequant" and _signature(func) == _signature(
        pattern.build(plain, "float32"))
    body = _source(func).split('extern "C" __global__')[-1]
    assert body.count(S8_MMA + "m64n128k32_s32_s8_s8(") == 128 // 32
    stores = _epilogue(body)
    assert stores and not any(relu in line for line in stores)
    for bad in ({**shape, "m": 500}, {**shape, "k": 1000}):
        with pytest.raises(ValueError, match="not a positive multiple of the tile"):
            template.build(bad, "float32", template.default)
    with pytest.raises(ValueError, match="float32, not float16"):
        template.build(shape, "float16", template.default)


def test_masked_attention_kernel_adds_the_mask_per_batch_or_per_query():
    """masked_attention's cuda_wgmma_masked: flash_attention's prefill kernel with the mask buffer
    read per (batch, key) or per (batch, query, key), taken for either mask_rows; the unmasked
    flash_attention template is not offered for it, nor the masked one for flash_attention."""
    pattern, template = get_pattern("masked_attention"), _template("masked_attention")
    shape = CASES["masked_attention"][0]
    per_query = {**shape, "mask_rows": shape["seq_q"]}
    assert K.kernel_templates_for(pattern, per_query, "bfloat16", H200) == [template]
    assert template is not _template("flash_attention")
    assert pattern.templates.index(template) < [t.name for t in pattern.templates].index("cuda_flash")
    for rows in (1, shape["seq_q"]):
        func = template.build({**shape, "mask_rows": rows}, "float16")
        assert func.attrs["global_symbol"] == "attention_prefill_masked"
        assert _signature(func) == _signature(pattern.build({**shape, "mask_rows": rows}, "float16"))
        assert _signature(func)[3] == ((shape["batch"], 1, rows, shape["seq_kv"]), "float16")
        body = _source(func).split('extern "C" __global__')[-1]
        loads = re.findall(r"\(\(uint\*\)Mk_ptr\)\[", body)
        # default BN 128: a word per 8 keys (and row half), in the loop and, with overlap, the peeled first tile
        per_tile = 128 // 8 * (1 if rows == 1 else 2)
        assert len(loads) == per_tile * (2 if cuda_attention.PREFILL_DEFAULT_KNOBS["overlap"] else 1)
        assert "condval" in body                                    # the l == 0 guard: a row of -inf keys stores 0


def test_verify_attends_the_cache_then_the_drafts_under_the_tree():
    shape = CASES["spec_verify_attention"][0]
    text = _default("spec_verify_attention").script()
    assert text.count('T.attr({"tirx.device_entry"') == 2  # the split kernel (cache splits + drafts' split), the combine
    assert re.search(rf"length: T.let\[T.int32\] = {shape['cache_len']}\b", text) or \
        f"length = {shape['cache_len']}" in text, text[:3000]
    body = _source(_default("spec_verify_attention")).split('extern "C" __global__')[-2]
    assert "TR_ptr[" in body and "((uint4*)k_new_ptr)[" in body and "((uint4*)v_new_ptr)[" in body


def test_verify_takes_the_prefill_with_enough_items_and_the_split_kernel_with_few():
    pattern, shape = _pattern("spec_verify_attention"), CASES["spec_verify_attention:wgmma"][0]
    names = [t.name for t in K.kernel_templates_for(pattern, shape, "float16", H200)]
    assert names == ["cuda_wgmma_verify", "cuda_split_kv"]  # both searched; the prefill's default first
    few = dict(shape, batch=cuda_attention.VERIFY_MIN_ITEMS // shape["kv_heads"] - 1)
    assert [t.name for t in K.kernel_templates_for(pattern, few, "float16", H200)] == ["cuda_split_kv"]
    assert "attention_prefill_verify_kernel" in _source(_default("spec_verify_attention:wgmma"))


def test_rope_rotates_each_row_once_then_one_batched_gemm_scales_every_heads_scores():
    pattern, shape = _pattern("rope_qk"), CASES["rope_qk:gemm"][0]
    rotate, gemm = _source(_default("rope_qk:gemm")).split('extern "C" __global__')[-2:]
    assert "sin_ptr" in rotate and "wgmma" not in rotate and "A_map" not in rotate
    # a row tile's head (256 rows = 2 tiles of 128), the third coordinate of 3-D tensor maps
    assert "A_map" in gemm and ">> 1)" in gemm
    assert "tensor_3d_shared__cluster_global" in gemm and "tensor_2d_shared__cluster_global" not in gemm
    stores = _epilogue(gemm)
    assert stores and all("8.838835e-02" in line for line in stores)  # 1 / sqrt(128)
    # the scaled tile staged in shared memory (swizzled), then TMA stores of its 64 x 64 boxes
    assert gemm.count("tensor_3d_global_shared__cta_tile_bulk_group(") == 128 // 64
    assert "wait_group_read_0()" in gemm
    direct = _source(_template("rope_qk:gemm").build(shape, "float16", {**_template("rope_qk:gemm").default,
                                                                        "tma_store": 0}))
    assert "tile_bulk_group(" not in direct and "C_map" not in direct
    # seq_q a multiple of 64, not of 128: one consumer warpgroup's tiles; of no tile: padded tiles
    # (the direct store refused there); seq_k no multiple of 8: the tiles rotated in place
    template = _template("rope_qk:gemm")
    assert template.default_for(dict(shape, seq_q=320), "float16")["warpgroups"] == 1
    padded = dict(shape, seq_q=200, seq_k=1000)
    assert template.default_for(padded, "float16") == template.default
    assert [t.name for t in K.kernel_templates_for(pattern, padded, "float16", H200)][:1] == ["cuda_rotate_then_gemm"]
    with pytest.raises(ValueError, match="needs tma_store"):
        template.build(padded, "float16", {**template.default, "tma_store": 0})
    names = [t.name for t in K.kernel_templates_for(pattern, dict(shape, seq_k=334), "float16", H200)]
    assert names == ["cuda_wgmma_scores"]


def test_split_k_sums_the_partials_with_the_bias_and_relu():
    """The skinny GEMM's split: CTA z of a tile loads K slices from z x (its share), stores float32
    partials at row tile y + z; the second kernel waits for them (dependent launch), adds the
    splits, the bias and ReLU, and stores 4 columns at once."""
    pattern, shape = _pattern("linear_bias_relu"), CASES["linear_bias_relu:split_k"][0]
    template = _template("linear_bias_relu:split_k")
    assert [t.name for t in K.kernel_templates_for(pattern, shape, "float16", H200)] == [
        "cuda_wgmma_split_k", "cuda_wgmma"]  # both searched, the split's default first
    assert template.default_for(shape, "float16")["split_k"] == 4
    func = _default("linear_bias_relu:split_k")
    assert cuda_attention.DEPENDENT_LAUNCH_TAG in func.attrs["tirx.kernel_launch_params"]
    gemm, total = _source(func).split('extern "C" __global__')[-2:]
    assert "int kz = ((int)blockIdx.z);" in gemm and "griddepcontrol_wait();" in gemm
    assert "griddepcontrol_launch_dependents();" in gemm
    assert "(((int)blockIdx.z) * 256)" in gemm  # 1024 / 64 / 4 = 4 slices of 64 a split
    stores = re.findall(r"\(\(uint64_t\*\)partials_ptr\)\[(.*)\] = ", gemm)
    assert stores and all("((int)blockIdx.z) * 262144" in index for index in stores)  # 128 rows x 4096 / 2
    assert "X_ptr" not in gemm and "max(" not in gemm.split("out_pair_ptr[0] =")[-1].split(";")[0]
    assert "griddepcontrol_wait();" in total and total.count("((float4*)partials_ptr)[") == 4
    assert total.count("max((total_ptr[") == 4 and "((uint2*)c_ptr)[" in total
    # 192 rows: the one-warpgroup tile (64 rows), the one-role kernel; the unsplit kernel at 512 rows,
    # with 4 slices of K (no 2 shares of 4), and where the split leaves SMs idle (n 512: 16 tiles of 64 x 64)
    rows192 = template.default_for({**shape, "m": 192, "n": 2304}, "float16")
    assert (rows192["warpgroups"], rows192["specialised"], rows192["split_k"]) == (1, 0, 2)
    for unsplit in ({"m": 512}, {"k": 256}, {"n": 512}):
        assert [t.name for t in K.kernel_templates_for(pattern, {**shape, **unsplit}, "float16", H200)] == [
            "cuda_wgmma"]


def test_decode_appends_while_it_attends_over_cache_len_plus_one():
    shape = CASES["gqa_decode_attention"][0]
    text = _default("gqa_decode_attention").script()
    # the split kernel appends (no copy kernel) and merges its splits in a cluster (no combine)
    assert text.count('T.attr({"tirx.device_entry"') == 1
    # the split kernel's run-time length is bound to the cache_len + 1 positions attended
    assert re.search(rf"length: T.let\[T.int32\] = {shape['cache_len'] + 1}\b", text) or \
        f"length = {shape['cache_len'] + 1}" in text, text[:3000]
    template = _template("gqa_decode_attention")
    text = template.build(shape, "float16", {**template.default_for(shape, "float16"), "merge": "combine"}).script()
    assert text.count('T.attr({"tirx.device_entry"') == 2  # the split kernel and the combine
    # merged by the last split: one kernel, the partials in workspaces as for the combine
    text = template.build(shape, "float16", {**template.default_for(shape, "float16"), "merge": "last"}).script()
    assert text.count('T.attr({"tirx.device_entry"') == 1 and "part_o" in text and "part_ml" in text


# --- nvcc, once per kernel ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def large_sources():
    return {name: _source(_default(name, shape=LARGE[name])) for name in LARGE}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", sorted(LARGE))
def test_nvcc_compiles_the_default_at_llm_shapes(name, large_sources, tmp_path):
    assert _template(name).default_for(LARGE[name], "float16") is not None
    src = tmp_path / "kernel.cu"
    src.write_text(large_sources[name])
    result = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
                             "-o", str(tmp_path / "kernel.cubin"), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ptxas = result.stdout + result.stderr
    assert ptxas.count("0 bytes spill stores") == len(_kernels(large_sources[name])), ptxas[-2000:]
    assert "serialized" not in ptxas and "injected" not in ptxas  # wgmmas overlap as written
