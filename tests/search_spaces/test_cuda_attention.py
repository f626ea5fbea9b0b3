"""search_spaces.lib.cuda_attention on the CPU: every knob configuration builds to CUDA source for
sm_90a, shapes the kernels cannot take raise AttentionShapeError, nvcc compiles one configuration of
each kernel (where nvcc is on PATH), and the tiling arithmetic both kernels rely on (causal tile
ranges, decode key ranges, the split/merge/combine recurrence, the masked prefill's online softmax)
is checked numerically in numpy.
Nothing runs on a GPU here; benchmarks/gpu_attention.py checks the kernels' numbers on one."""

import hashlib
import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from autofuse.measure import param_buffers
from search_spaces.lib import cuda_attention as ca
from search_spaces.lib.cuda_wgmma import SM_COUNT

PREFILL = dict(batch=1, heads=4, kv_heads=2, seq_q=256, seq_kv=384, head_dim=128, causal=1)
MASKED = dict(PREFILL, causal=0, mask_rows=1, batch=2)
DECODE = dict(batch=2, num_heads=8, num_kv_heads=2, head_dim=128, max_seq=1000)
VERIFY = dict(DECODE, cache_len=700)  # with drafts: spec_verify_attention's split-KV kernels
# paged_attention's chunk of 200 tokens over 16-key pages (a 512-key table: 32 pages)
PAGED_CHUNK = dict(batch=2, heads=8, kv_heads=2, seq_q=200, seq_kv=512, head_dim=128, causal=1)
PAGES = (16, 32, 80)  # page_size, max_pages, num_pages
# spec_verify_attention on the tensor-core prefill: 16 sequences, 8 drafts of 4 heads per K/V head
VERIFY_PREFILL = dict(batch=16, num_heads=32, num_kv_heads=8, head_dim=128, max_seq=4096)


def _verify_prefill(drafts=8, cache_len=4000, knobs=None, dtype="float16", **change):
    shape = dict(VERIFY_PREFILL, **change)
    return ca.prefill_attention(ca.verify_prefill_shape(shape, drafts), dtype, knobs, verify=(drafts, cache_len))


def _source(func) -> str:
    return ca.cuda_source(ca.build(func))


# ---- building ------------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs", ca.prefill_configs(PREFILL, "float16"), ids=str)
def test_every_prefill_config_builds(knobs):
    source = _source(ca.prefill_attention(PREFILL, "float16", knobs))
    bn, hd = knobs["block_n"], PREFILL["head_dim"]
    assert f"m64n{bn}k16_f32_f16_f16" in source      # S = Q K^T
    assert f"m64n{hd}k16_f32_f16_f16" in source      # O += P V, P from registers
    assert "__launch_bounds__(384)" in source
    assert "attention_prefill_kernel" in source


def test_prefill_configs_are_the_whole_space():
    assert len(ca.prefill_configs(PREFILL, "float16")) == 16


def _shares(q_tiles, heads, causal, persistent):
    """Each CTA's work items, (query tile, head), in the order it takes them."""
    knobs = {"persistent": persistent}
    tiles, paired = q_tiles * heads, ca.prefill_paired(knobs, causal)
    grid = ca.prefill_grid(tiles, knobs, causal)
    return [[ca.prefill_work_item(ca.prefill_cta_item(cta, u, grid, paired), q_tiles, heads, causal, paired)
             for u in range(ca.prefill_cta_items(cta, grid, tiles, paired))] for cta in range(grid)]


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("q_tiles,heads", [(8, 40), (7, 41), (8, 16)])
def test_prefill_ctas_take_every_work_item_once(causal, persistent, q_tiles, heads):
    # 320 items: a persistent CTA takes 2 or 3 (pairs: 1 or 2); 287: an odd count, the last pair one
    # item; 128: fewer pairs than SMs
    shares = _shares(q_tiles, heads, causal, persistent)
    assert len(shares) == (min(q_tiles * heads // (1 + causal), ca.SM_COUNT) if persistent else q_tiles * heads)
    assert sorted(sum(shares, [])) == [(q, h) for q in range(q_tiles) for h in range(heads)]
    # in item order a head's query tiles come together (its K/V stays in L2), causal the longest first
    order = [ca.prefill_work_item(t, q_tiles, heads, causal) for t in range(q_tiles * heads)]
    assert [h for _, h in order] == sorted(h for _, h in order)
    assert [q for q, _ in order[:q_tiles]] == (list(range(q_tiles))[::-1] if causal else list(range(q_tiles)))


def test_persistent_causal_shares_are_even():
    # B8 H16 S1024 at BN = BM: query tile q visits q + 1 key tiles. Every 132nd single item gave a
    # CTA 48 key tiles (the mean is 35); pairs of a head's longest and shortest give at most 36
    q_tiles, heads = 8, 128
    shares = _shares(q_tiles, heads, 1, 1)
    loads = [sum(q + 1 for q, _ in share) for share in shares]
    assert sum(loads) == heads * q_tiles * (q_tiles + 1) // 2
    assert max(loads) <= 4 * (q_tiles + 1)
    assert all(share[0][1] == share[1][1] and share[0][0] + share[1][0] == q_tiles - 1 for share in shares)


def test_prefill_is_persistent_by_default():
    for causal in (0, 1):
        assert ca.check_prefill(dict(PREFILL, causal=causal), "float16")[1]["persistent"] == 1


@pytest.mark.parametrize("dtype,head_dim,causal", [("bfloat16", 64, 0), ("bfloat16", 128, 1), ("float16", 64, 1)])
def test_prefill_dtypes_and_head_dims_build(dtype, head_dim, causal):
    shape = dict(PREFILL, head_dim=head_dim, causal=causal, kv_heads=4)
    source = _source(ca.prefill_attention(shape, dtype))
    op = ca.DTYPES[dtype]
    assert f"m64n{head_dim}k16_f32_{op}_{op}" in source
    # causal: a masked copy of the softmax input exists only with the flag
    assert ("-0x1.fffffep+127f" in source) == bool(causal)


# sha256 of the CUDA source of the unmasked prefill kernel (PREFILL in float16, default knobs; and
# non-causal bfloat16 at head_dim 64) as generated since the work-item loop (the persistent and
# overlap knobs): mask_rows 0 must leave it byte for byte (and flash_attention's kernel records
# replaying). Update only for a deliberate change to the unmasked kernel.
UNMASKED_SOURCE_SHA256 = {
    "float16": "64aeef0b4e72f7580eebcd418a242f165329f7c374530f6570af60c426fb0528",
    "bfloat16": "326b843e41801b447a39dde075554f56fa75b8bf1351f1577b13a67e83d82706",
}


def _unmasked(dtype):
    return PREFILL if dtype == "float16" else dict(PREFILL, causal=0, head_dim=64, kv_heads=4)


# the knobs the hashes were taken with (the defaults until overlap on three stages became them)
HASHED_KNOBS = {"float16": dict(block_n=128, stages=2, persistent=0, overlap=0),
                "bfloat16": dict(block_n=128, stages=2, persistent=1, overlap=0)}


@pytest.mark.parametrize("dtype", sorted(UNMASKED_SOURCE_SHA256))
def test_unmasked_prefill_source_is_unchanged(dtype):
    knobs = HASHED_KNOBS[dtype]
    source = _source(ca.prefill_attention(_unmasked(dtype), dtype, knobs))
    assert hashlib.sha256(source.encode()).hexdigest() == UNMASKED_SOURCE_SHA256[dtype]
    assert source == _source(ca.prefill_attention(dict(_unmasked(dtype), mask_rows=0), dtype, knobs))
    assert "Mk_ptr" not in source and "mask_pair" not in source


def _masked_loads(source: str) -> list[str]:
    return re.findall(r"\(\(uint\*\)Mk_ptr\)\[([^;]*)\];", source)


@pytest.mark.parametrize("dtype,head_dim,block_n,rows", [("float16", 128, 128, 1), ("bfloat16", 64, 64, 256),
                                                         ("float16", 128, 64, 256), ("bfloat16", 128, 128, 1)])
def test_masked_prefill_reads_the_mask_and_guards_empty_rows(dtype, head_dim, block_n, rows):
    shape = dict(MASKED, head_dim=head_dim, mask_rows=rows)
    # the plain pipeline: each step once in the source (overlap peels the first key tile)
    func = ca.prefill_attention(shape, dtype, dict(block_n=block_n, stages=2, persistent=0, overlap=0))
    assert func.attrs["global_symbol"] == "attention_prefill_masked"
    assert [p.name for p in func.params] == ["Q", "K", "V", "Mk", "O"]  # TVM 0.27's params are the buffers
    mask_buffer = func.params[3]
    assert [int(d) for d in mask_buffer.shape] == [2, 1, rows, 384] and str(mask_buffer.dtype) == dtype
    source = _source(func)
    assert "attention_prefill_masked_kernel" in source
    # per key tile and thread: one 4-byte load per 8-key group, and per row half with a row per query
    loads = _masked_loads(source)
    assert len(loads) == block_n // 8 * (1 if rows == 1 else 2), loads[:3]
    # the batch's mask: work item // (2 query tiles x 4 heads)
    assert all("((int)blockIdx.x) >> 3)" in index for index in loads)
    # the query tile's rows: this thread's row of the warpgroup's 64
    assert all(("((int)threadIdx.x) >> 5)" in index) == (rows > 1) for index in loads)
    # the mask is added to the scaled scores in float32, before the row max
    scale = f"{1 / math.sqrt(head_dim):.6e}"
    added = re.findall(r"s_ptr\[(\d+)\] = \(\(s_ptr\[\1\] \* [^/]*/\*" + re.escape(scale)
                       + r"\*/\) \+ \(\(float\)mask_pair_ptr\[[01]\]\)\);", source)
    assert sorted(map(int, added)) == list(range(block_n // 2))
    assert source.index("mask_pair_ptr[0])") < source.index("m_new_ptr[0] = max(")
    # natural-log domain: exp2 of (s - m) * log2(e), never of a log2(e)-scaled mask
    assert source.count("exp2f(((s_ptr[") == block_n // 2
    assert re.search(r"exp2f\(\(\(s_ptr\[0\] - m_ptr\[0\]\) \* 0x1\.71547652b82fep\+0f", source)
    # m starts at the float32 minimum; a row with l == 0 (only -inf keys) stores 0, not 0 * inf
    assert source.count("m_ptr[0] = -0x1.fffffep+127f") == 1
    guards = re.findall(r"if \(0x0p\+0f/\*0\.000000e\+00\*/ < m_new_ptr\[([01])\]\) \{\s*condval\w* = "
                        r"\(0x1p\+0f/\*1\.000000e\+00\*/ / m_new_ptr\[\1\]\);\s*\} else \{\s*condval\w* = "
                        r"0x0p\+0f", source)
    assert sorted(guards) == ["0", "1"], source[source.index("warp_reduce_sum_4(l_ptr[0])") - 200:][:800]


@pytest.mark.parametrize("knobs", ca.decode_configs(DECODE, "float16"), ids=str)
def test_every_decode_config_builds(knobs):
    split, combine = ca.decode_attention(DECODE, "float16", knobs)
    source = _source(split)
    assert f"__launch_bounds__({32 * knobs['warps']})" in source
    assert "int length" in source                     # the valid length is a run-time argument
    assert "uint4" in source                          # 16-byte loads of the caches
    assert "__shfl_xor_sync" in source
    assert "attention_decode_combine_kernel" in _source(combine)


@pytest.mark.parametrize("knobs", [k for k in ca.decode_configs(DECODE, "float16", append=True) if k["stages"]
                                   and k["keys"] in (2, 8) and k["merge"] == "combine" and k["evict_first"] == 0],
                         ids=str)
def test_appending_decode_streams_its_keys_through_a_shared_memory_ring(knobs):
    split, _ = ca.decode_attention(DECODE, "float16", knobs, append=True)
    body = _source(split).split("__global__")[-1]
    # K and V: bulk copies in (the first `stages` steps, then each refill) and out (the append)
    assert body.count("cp_async_bulk_g2s_cluster") == 4 and body.count("cp_async_bulk_s2g") == 2
    assert body.count("mbarrier_init") == knobs["stages"]
    assert body.index("bulk_wait_group_read_0") > body.index("cp_async_bulk_s2g")  # the copy out read the slot
    assert "= kv16_ptr[" not in body                  # no thread stores the rows it read
    assert re.search(r"\(\(uint4\*\)KN_ptr\)", body)     # the new token's row, patched into its slot
    register, _ = ca.decode_attention(DECODE, "float16", dict(knobs, stages=0), append=True)
    assert "= kv16_ptr[" in _source(register) and "cp_async_bulk" not in _source(register)


def test_the_rings_copies_carry_an_evict_first_policy_as_the_knob_says():
    # evict_first 1: the copies in (two a step, in the prologue and each refill); 2: and the two out
    counts = {}
    for level in (0, 1, 2):
        split, _ = ca.decode_attention(DECODE, "float16", dict(evict_first=level), append=True)
        body = _source(split).split("__global__")[-1]
        counts[level] = (body.count("createpolicy_fractional_fractional_L2__evict_first"),
                         body.count("complete_tx__bytes_L2__cache_hint"), body.count("bulk_group_L2__cache_hint"))
    assert counts == {0: (0, 0, 0), 1: (1, 4, 0), 2: (1, 4, 2)}
    assert ca.check_decode(DECODE, "float16", dict(stages=0), append=True)[1]["evict_first"] == 0
    with pytest.raises(ca.AttentionShapeError, match="stages=0 has none"):
        ca.check_decode(DECODE, "float16", dict(stages=0, evict_first=1), append=True)


@pytest.mark.parametrize("knobs", [dict(stages=4), dict(stages=0, warps=4, keys=1), dict(stages=4, splits=3)], ids=str)
def test_appending_decode_merges_its_splits_in_a_cluster(knobs):
    knobs = dict(knobs, merge="cluster")
    dims, resolved = ca.check_decode(DECODE, "float16", knobs, append=True)
    splits, rows, hd = resolved["splits"], dims["rows"], DECODE["head_dim"]
    split, combine = ca.decode_attention(DECODE, "float16", knobs, append=True)
    assert combine is None
    source = _source(split)
    assert source.count("__global__ void") == 2  # declared and defined: one kernel, no combine
    signature = source[source.index("attention_decode_append_split_kernel("):].split(")")[0]
    assert "O_ptr" in signature and "PO" not in signature and "PML" not in signature
    body = source.split("__global__")[-1]
    # started (relaxed arrive) before the others may store into this CTA; waited on before storing
    assert body.index("cluster_arrive_relaxed_aligned()") < body.index("cp_async_bulk") \
        if knobs["stages"] else "cluster_arrive_relaxed_aligned()" in body
    first_wait = body.index("cluster_wait_aligned()")
    assert first_wait < body.index("mapa_u32_shared__cluster_u32(remote")
    # each output element to its merging CTA, each row's (max, sum) to CTAs 0 .. splits - 1
    assert body.count("st_shared__cluster_f32(remote") == -(-rows * hd // (32 * resolved["warps"]))
    assert body.count("st_vec_shared__cluster_v2_f32(remote") == -(-rows * hd // (32 * resolved["warps"]))
    assert "cluster_ctarank" in source and "cluster_sync" not in body   # its asm has no memory clobber
    last_wait = body.rindex("cluster_wait_aligned()")
    out_stores = [m.start() for m in re.finditer(r"[^KV]O_ptr\[", body)]
    assert out_stores and body.index("cluster_arrive_aligned()") < last_wait < min(out_stores)
    assert body[last_wait:].count("exp2f(") == splits                # this CTA's share, over every split
    assert "(half)(merged_ptr[2] / merged_ptr[1])" in body[last_wait:].replace("((half)", "(half)")


@pytest.mark.parametrize("knobs", [dict(stages=4), dict(stages=0, warps=4, keys=1), dict(stages=4, splits=3)], ids=str)
def test_appending_decode_merges_its_splits_in_the_last_split_to_finish(knobs):
    knobs = dict(knobs, merge="last")
    dims, resolved = ca.check_decode(DECODE, "float16", knobs, append=True)
    split, combine = ca.decode_attention(DECODE, "float16", knobs, append=True)
    assert combine is None and len(split.params) == 11
    source = _source(split)
    assert source.count("__global__ void") == 2  # declared and defined: one kernel, no combine
    signature = source[source.index("attention_decode_append_split_kernel("):].split(")")[0]
    assert all(name in signature for name in ("PO_ptr", "PML_ptr", "O_ptr"))
    # the module's counters, zero when it loads; one acquire-release add a CTA, the last resets
    assert source.count(f"__device__ unsigned int autofuse_split_arrivals[{ca.ARRIVAL_SLOTS}];") == 1
    assert "atom.add.acq_rel.gpu.global.u32" in source
    body = source.split("__global__")[-1]
    arrive = body.index("autofuse_split_arrive(")
    assert f", {resolved['splits']});" in body[arrive:arrive + 200]
    # every thread's partials stored, then the CTA's barrier, thread 0 counts in, the barrier again
    assert max(body.index("PO_ptr["), body.index("PML_ptr[")) < body.rindex("cta_sync()", 0, arrive)
    assert body.index("cta_sync()", arrive) < min(m.start() for m in re.finditer(r"[^KVP]O_ptr\[", body))
    # the last split's merge: its partials loaded before the barrier after which one thread a row
    # turns the splits' (max, sum) into weights (one exp2 in a loop), out stored after the next
    merge = body.index("cta_sync()", arrive + 1)
    merge = body.index("cta_sync()", merge + 1)
    assert body.index("PO_ptr[", arrive) < merge < body.index("exp2f(", merge)
    assert body.count("exp2f(", arrive) == 1 and "for (int s" in body[merge:body.index("exp2f(", merge)]
    assert body.index("cta_sync()", merge + 1) < min(m.start() for m in re.finditer(r"[^KVP]O_ptr\[", body))
    assert "barrier_cluster" not in body and "mapa" not in body


def test_the_last_split_merges_at_most_arrival_slots_row_sets():
    many = dict(DECODE, batch=ca.ARRIVAL_SLOTS // DECODE["num_kv_heads"] + 1, max_seq=64)
    ca.check_decode(dict(many, batch=many["batch"] - 1), "float16", dict(merge="last"), append=True)
    with pytest.raises(ca.AttentionShapeError, match=f"at most {ca.ARRIVAL_SLOTS} row sets"):
        ca.check_decode(many, "float16", dict(merge="last"), append=True)
    ca.check_decode(many, "float16", dict(merge="combine"), append=True)


def test_a_merging_cluster_holds_at_most_sixteen_splits():
    long = dict(DECODE, max_seq=32768)
    assert ca.check_decode(long, "float16", None, append=True)[1]["splits"] == ca.SPLIT_MAX
    assert ca.check_decode(long, "float16", dict(merge="cluster"), append=True)[1]["splits"] == ca.CLUSTER_MAX == 16
    assert ca.check_decode(long, "float16", dict(merge="last"), append=True)[1]["splits"] == ca.SPLIT_MAX
    with pytest.raises(ca.AttentionShapeError, match="at most 16"):
        ca.check_decode(long, "float16", dict(merge="cluster", splits=17), append=True)
    for merge in ("cluster", "last"):
        with pytest.raises(ValueError, match="merge"):
            ca.decode_attention(DECODE, "float16", dict(merge=merge))
    with pytest.raises(ca.AttentionShapeError, match="unknown knob 'merge'"):
        ca.check_decode(DECODE, "float16", dict(merge="cluster"))
    with pytest.raises(ca.AttentionShapeError, match="merge=1 is not one of"):
        ca.check_decode(DECODE, "float16", dict(merge=1), append=True)


@pytest.mark.parametrize("batch, max_seq, merge, splits", [
    (1, 1024, "cluster", 8),      # the combine's 8 splits fit one cluster
    (1, 4096, "last", 32),        # 8 clusters of 16 would leave the GPU half empty: 32 splits, merged by the last
    (1, 32768, "last", 32),
    (4, 4096, "cluster", 16),     # 32 row sets x 16 fill two CTAs on every SM
    (64, 4096, "cluster", 8),
])
def test_the_cluster_is_the_default_where_it_costs_no_parallelism(batch, max_seq, merge, splits):
    shape = dict(batch=batch, num_heads=32, num_kv_heads=8, head_dim=128, max_seq=max_seq)
    knobs = ca.check_decode(shape, "float16", append=True)[1]
    assert (knobs["merge"], knobs["splits"]) == (merge, splits)
    for other in ca.MERGES:
        assert ca.check_decode(shape, "float16", dict(merge=other), append=True)[1]["merge"] == other


def test_only_appending_decode_takes_stages_and_the_ring_fits_shared_memory():
    with pytest.raises(ValueError, match="stages"):
        ca.decode_attention(DECODE, "float16", dict(stages=2))
    with pytest.raises(ca.AttentionShapeError, match="unknown knob 'stages'"):
        ca.check_decode(DECODE, "float16", dict(stages=2))
    with pytest.raises(ca.AttentionShapeError, match="shared memory"):   # 4 slots of 128 keys of K and V
        ca.check_decode(DECODE, "float16", dict(stages=4, keys=8), append=True)
    assert dict(warps=8, keys=8, stages=4, merge="combine", evict_first=1) not in ca.decode_configs(
        DECODE, "float16", append=True)
    assert dict(warps=8, keys=2, stages=4, merge="combine", evict_first=1) in ca.decode_configs(
        DECODE, "float16", append=True)


@pytest.mark.parametrize("append", [False, True])
def test_decode_kernels_use_dependent_launch(append):
    # the combine waits for the split kernel's partials before reading them; the split kernel
    # waits for whatever ran before it, then lets the combine be scheduled
    split, combine = ca.decode_attention(DECODE, "float16", dict(merge="combine") if append else None, append=append)
    for func in (split, combine):
        assert ca.DEPENDENT_LAUNCH_TAG in func.attrs["tirx.kernel_launch_params"]
    split_body, combine_body = (_source(func).split("__global__")[-1] for func in (split, combine))
    wait = split_body.index("griddepcontrol_wait()")
    assert wait < split_body.index("griddepcontrol_launch_dependents()") < split_body.index("Q_ptr)[")
    assert combine_body.index("griddepcontrol_wait()") < combine_body.index("PML_ptr[")
    # without it, neither the tag nor the instructions
    split, combine = ca.decode_attention(DECODE, "float16", dict(merge="combine") if append else None, append=append,
                                         dependent=False)
    assert "tirx.kernel_launch_params" not in split.attrs and "tirx.kernel_launch_params" not in combine.attrs
    for merge in ("cluster", "last") if append else ():  # the one kernel waits for the one before
        split, combine = ca.decode_attention(DECODE, "float16", dict(merge=merge), append=True)
        body = _source(split).split("__global__")[-1]
        assert combine is None and ca.DEPENDENT_LAUNCH_TAG in split.attrs["tirx.kernel_launch_params"]
        assert body.index("griddepcontrol_wait()") < body.index("Q_ptr)[")


def test_decode_bfloat16_head_dim_64_builds():
    shape = dict(DECODE, head_dim=64, num_kv_heads=8)
    split, combine = ca.decode_attention(shape, "bfloat16")
    assert "nv_bfloat16" in _source(split) and "nv_bfloat16" in _source(combine)


@pytest.mark.parametrize("drafts,knobs", [(8, None), (40, dict(warps=4, keys=1))])  # drafts within a step, over two
def test_verify_kernels_read_the_drafts_under_the_tree(drafts, knobs):
    split, combine = ca.decode_attention(VERIFY, "float16", knobs, drafts=drafts)
    source = _source(split)
    assert "attention_verify_split_kernel" in source
    for name in ("KD_ptr", "VD_ptr", "Kc_ptr", "Vc_ptr"):     # 16-byte loads of the drafts' and the cache's K/V
        assert re.search(rf"\(\(uint4\*\){name}\)\[", source), name
    assert "TR_ptr[" in source
    _, resolved = ca.check_decode(VERIFY, "float16", knobs, drafts=drafts)
    assert f"blockIdx.x) == {resolved['splits']})" in source   # the split past the cache's: the drafts'
    assert len(split.params) == 9                     # q, the caches, the drafts' K/V, tree, 2 partials, length
    assert "attention_decode_combine_kernel" in _source(combine)


def test_paged_chunk_kernels_mask_each_tokens_later_keys():
    paged = (16, 64, 200)
    split, combine = ca.decode_attention(dict(DECODE, max_seq=1024), "float16", paged=paged, queries=5)
    source = _source(split)
    assert "attention_decode_paged_split_kernel" in source and "BT_ptr[" in source
    # key row > seq_lens[b] - 5 + t hidden, as seq_lens[b] < row + 5 - t (t = 0 for the first row)
    assert re.search(r"if \(SL_ptr\[\(\(int\)blockIdx\.z\)\] < \(.*\+ 5\)\) \{", source), "the chunk's causal bound"
    assert "O_ptr[" in _source(combine)
    with pytest.raises(ValueError, match="a paged chunk only"):
        ca.decode_attention(DECODE, "float16", queries=5)


def test_decode_long_caches_build_without_shared_memory_growth():
    # shared memory holds the lane groups' partials only: the same bytes at 1k and 128k positions
    sizes = []
    for max_seq in (1024, 131072):
        shape = dict(DECODE, max_seq=max_seq)
        _, knobs = ca.check_decode(shape, "float16")
        sizes.append(ca.decode_split_shared_memory_bytes(128, 4, knobs))
        assert "__global__" in _source(ca.decode_attention(shape, "float16")[0])
    assert sizes[0] == sizes[1] < 48 * 1024


def test_a_cache_of_2_31_elements_is_addressed_in_int64():
    # batch 64 x 8 K/V heads x 32768 keys x 128: the ring's bulk copies take the cache's element
    # addresses, whose flattening in int32 failed (that grid cell did not build)
    shape = dict(DECODE, batch=64, num_heads=32, num_kv_heads=8, max_seq=32768)
    split, _ = ca.decode_attention(shape, "float16", append=True)
    assert re.search(r"Kc_ptr\[\(+\(int64_t\)", _source(split))
    small, _ = ca.decode_attention(DECODE, "float16", append=True)
    assert "int64_t)" not in _source(small).split("__global__")[-1]  # int32 address math below 2^31


# ---- shape rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change,fragment", [
    (dict(seq_kv=321, causal=0, mask_rows=1), "seq_kv=321 is odd"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(seq_q=512, seq_kv=384), "seq_q=512 <= seq_kv=384"),
    (dict(causal=2), "causal=2"),
    (dict(causal=0, mask_rows=2), "mask_rows=2"),
    (dict(causal=1, mask_rows=1), "causal=1 with a mask"),
    (dict(causal=0, mask_rows=1, batch=1 << 13, seq_kv=1 << 18, seq_q=128, heads=1, kv_heads=1, head_dim=64),
     "the mask has 2^31"),
    (dict(scale=-1.0), "must be positive"),
    (dict(batch=0), "batch=0"),
])
def test_prefill_shape_errors(change, fragment):
    with pytest.raises(ca.AttentionShapeError, match=re.escape(fragment)):
        ca.prefill_attention(dict(PREFILL, **change), "float16")


@pytest.mark.parametrize("change,pages,fragment", [
    (dict(causal=0), PAGES, "a paged chunk is causal"),
    (dict(seq_kv=384), PAGES, "page_size x max_pages = 512"),
    (dict(seq_kv=24 * 32), (24, 32, 80), "page_size=24"),
    (dict(seq_kv=4 * 128), (4, 128, 300), "page_size=4"),
])
def test_paged_prefill_errors(change, pages, fragment):
    with pytest.raises(ca.AttentionShapeError, match=re.escape(fragment)):
        ca.check_prefill(dict(PAGED_CHUNK, **change), "float16", None, pages)


def test_prefill_other_errors():
    with pytest.raises(ca.AttentionShapeError, match="float32"):
        ca.prefill_attention(PREFILL, "float32")
    with pytest.raises(ca.AttentionShapeError, match="block_n=96"):
        ca.prefill_attention(PREFILL, "float16", dict(block_n=96))
    with pytest.raises(ca.AttentionShapeError, match="unknown knob"):
        ca.prefill_attention(PREFILL, "float16", dict(tile=1))
    with pytest.raises(ca.AttentionShapeError, match="needs integers"):
        ca.prefill_attention({"batch": 1}, "float16")
    # with a mask, lengths no multiple of the tiles take every configuration
    masked = dict(PREFILL, causal=0, mask_rows=200, seq_q=200, seq_kv=334)
    assert len(ca.prefill_configs(masked, "float16")) == 16


@pytest.mark.parametrize("rows,block_n", [(200, 128), (1, 64)])
def test_padded_masked_prefill_clamps_its_mask_loads_and_hides_keys_past_seq_kv(rows, block_n):
    shape = dict(MASKED, seq_q=200, seq_kv=334, mask_rows=rows)
    source = _source(ca.prefill_attention(shape, "float16", dict(block_n=block_n, stages=2, persistent=0,
                                                                  overlap=0)))
    loads = _masked_loads(source)
    # a load per 8-key group and row half (one with one mask row), clamped to the mask's last word
    # (where the simplifier cannot prove a group's words inside the mask: the last groups of a tile)
    last = 2 * rows * 334 // 2 - 1
    assert len(loads) == block_n // 8 * (1 if rows == 1 else 2) and any(index.startswith("min(") and index.endswith(f", {last})")
                                                  for index in loads)
    if rows > 1:  # a padded query row reads the last query's words
        assert all(", 199) * 167)" in index for index in loads)
    # keys past seq_kv: -inf after the mask is added, so a row of -inf keys still stores 0
    assert 0 < source.count("-CUDART_INF_F") <= block_n // 2  # (not where a key is provably < seq_kv)
    assert source.index("mask_pair_ptr[0])") < source.index("-CUDART_INF_F")


def test_padded_query_rows_read_the_last_querys_mask_words():
    for rows in (200, 1):
        for row in range(192, 256, 8):  # a thread's row r of the last query tile (lane 0), and r + 8
            got = ca.mask_word_index(1, row, 128, 0, rows, 334, 199)
            want = ca.mask_word_index(1, min(row, 199) if rows > 1 else 0, 128, 0, rows, 334)
            assert got == want and got < 2 * rows * 334 // 2


@pytest.mark.parametrize("pages,lookups", [(PAGES, 128 // 16), ((256, 2, 5), 1), ((64, 8, 20), 2)])
def test_paged_prefill_loads_whole_pages_through_the_block_table(pages, lookups):
    shape = dict(PAGED_CHUNK, seq_kv=pages[0] * pages[1])
    func = ca.prefill_attention(shape, "float16", None, paged=pages)
    assert func.attrs["global_symbol"] == "attention_prefill_paged"
    assert [tuple(int(d) for d in b.shape) for b in param_buffers(func)] == [
        (2, 200, 8, 128), (pages[2], 2, pages[0], 128), (pages[2], 2, pages[0], 128), (2, pages[1]), (2,),
        (2, 200, 8, 128)]
    source = _source(func)
    # a block-table lookup per page box of a 128-key tile (the producer's tile loop is not unrolled),
    # each feeding a K and a V copy of both 64-column boxes
    assert source.count("BT_ptr[") == lookups
    assert "SL_ptr[" in source and "m64n128k16_f32_f16_f16" in source


ROPE = dict(batch=2, heads=4, seq_q=200, seq_k=334, head_dim=128)


@pytest.mark.parametrize("head_dim,block_n", [(128, 128), (64, 256), (64, 64)])
def test_rope_scores_rotate_chunk_pairs_in_shared_memory_then_one_wgmma_chain(head_dim, block_n):
    shape = dict(ROPE, head_dim=head_dim)
    func = ca.rope_scores(shape, "bfloat16", dict(block_n=block_n))
    assert func.attrs["global_symbol"] == "rope_scores"
    assert [tuple(int(d) for d in b.shape) for b in param_buffers(func)] == [
        (2, 4, 200, head_dim), (2, 4, 334, head_dim), (334, head_dim), (334, head_dim), (2, 4, 200, 334)]
    source = _source(func)
    # per thread: a 16-byte chunk and its partner half a row on, for each of its Q and K units
    units = (ca.BLOCK_M + block_n) * head_dim // 16 // 256
    assert source.count("xb16_ptr[0] = ((uint4*)pool_buf_ptr)[") == units
    assert source.count("sb16_ptr[0] = ((uint4*)S_ptr)[") == units
    # the rotated tiles reach wgmma through the async proxy: a fence after the rotation
    rotated = source.rindex("((uint4*)pool_buf_ptr)[")
    assert "fence_proxy_proxy_async_shared__cta();" in source[rotated:source.index("wgmma_fence_fence_sync_aligned();")]
    assert source.count(f"m64n{block_n}k16_f32_bf16_bf16_1_1_0_0(") == head_dim // 16 + 1  # calls + definition
    # padded tiles: only real (query, key) pairs stored
    stores = [line for line in source.splitlines() if "((uint*)O_ptr)[" in line]
    assert len(stores) == block_n // 2 // 2


@pytest.mark.parametrize("cache_len,tail", [(4000, True), (3968, False), (0, False)])
def test_verify_prefill_reads_the_drafts_after_the_cache_under_the_tree(cache_len, tail):
    source = _source(_verify_prefill(cache_len=cache_len))
    loads = re.findall(r"cp_async_bulk_tensor\w*\(.*?&\((\w+_map)\)", source)
    assert {"Q_map", "KD_map", "VD_map"} <= set(loads) and ("K_map" in loads) == (cache_len > 0)
    assert "TR_ptr[" in source
    # the last cache tile's V rows past cache_len zeroed by each consumer warpgroup, fenced for wgmma
    assert source.count("tvm_builtin_cuda_warpgroup_sync((") == int(tail)
    assert ("__float2half_rn(0x0p+0f" in source) == tail


@pytest.mark.parametrize("change,fragment", [
    (dict(batch=1), "fewer than 16"), (dict(drafts=129), "do not fit one key tile"),
    (dict(cache_len=4097), "cache_len=4097"), (dict(batch=2, drafts=4, num_heads=16), "shorter than one TMA box")])
def test_verify_prefill_errors(change, fragment):
    change = dict(change)
    drafts, cache_len = change.pop("drafts", 8), change.pop("cache_len", 4000)
    shape = dict(VERIFY_PREFILL, **change)
    with pytest.raises(ca.AttentionShapeError, match=re.escape(fragment)):
        ca.check_prefill(ca.verify_prefill_shape(shape, drafts), "float16", verify=(drafts, cache_len))
    with pytest.raises(ca.AttentionShapeError, match="neither causal"):
        ca.check_prefill(dict(ca.verify_prefill_shape(VERIFY_PREFILL, 8), causal=1), "float16", verify=(8, 10))
    with pytest.raises(ca.AttentionShapeError, match="heads are its K/V heads"):
        ca.check_prefill(dict(ca.verify_prefill_shape(VERIFY_PREFILL, 8), heads=32), "float16", verify=(8, 10))


def test_rope_scores_shape_errors():
    for change, fragment in ((dict(seq_k=335), "seq_k=335 is odd"), (dict(seq_q=400), "seq_q=400 must be <="),
                             (dict(head_dim=96), "head_dim=96")):
        with pytest.raises(ca.AttentionShapeError, match=re.escape(fragment)):
            ca.check_rope_scores(dict(ROPE, **change), "float16")


# Lengths no multiple of the tiles: the last query tile half past seq_q, the last key tile too
PADDED = [dict(PREFILL, seq_q=200, seq_kv=333, causal=0), dict(PREFILL, seq_q=200, seq_kv=333, causal=1),
          dict(PREFILL, seq_q=77, seq_kv=77, causal=1, head_dim=64), dict(PREFILL, seq_q=256, seq_kv=300, causal=1)]


@pytest.mark.parametrize("shape", PADDED, ids=lambda s: f"q{s['seq_q']}-kv{s['seq_kv']}-c{s['causal']}")
def test_padded_prefill_masks_the_last_key_tile_and_stores_only_real_rows(shape):
    # (the simplifier rewrites the guards' bounds, so their presence is checked, not their text)
    lines = [line.strip() for line in _source(ca.prefill_attention(shape, "float16")).splitlines()]
    stores = [i for i, line in enumerate(lines) if line.startswith("((uint*)O_ptr)[")]
    assert stores and all(lines[i - 1].startswith("if (") for i in stores) == bool(shape["seq_q"] % ca.BLOCK_M)
    unpadded = dict(shape, seq_q=256, seq_kv=384)
    plain = [line.strip() for line in _source(ca.prefill_attention(unpadded, "float16")).splitlines()]
    assert not any(plain[i - 1].startswith("if (") for i, line in enumerate(plain) if line.startswith("((uint*)O_ptr)["))
    if not shape["causal"]:  # keys past seq_kv get the float32 minimum; the unpadded kernel masks none
        assert any(_FLOAT32_MIN in line for line in lines) and not any(_FLOAT32_MIN in line for line in plain)


_FLOAT32_MIN = "-0x1.fffffep+127f"


@pytest.mark.parametrize("change,knobs,fragment", [
    (dict(num_kv_heads=3), {}, "multiple of kv_heads"),
    (dict(head_dim=256), {}, "head_dim=256"),
    (dict(batch=128, num_kv_heads=8, num_heads=8, max_seq=1 << 20), {}, "2^31"),
    ({}, dict(splits=0), "splits=0"),
    ({}, dict(keys=3), "keys=3"),
])
def test_decode_shape_errors(change, knobs, fragment):
    with pytest.raises(ca.AttentionShapeError, match=re.escape(fragment)):
        ca.decode_attention(dict(DECODE, **change), "float16", knobs)


def test_decode_shares_a_large_group_out_in_row_sets():
    # 32 query heads per K/V head: 4 CTAs of 8 rows over the same keys; only the first row set of a
    # K/V head stores the appended caches (the loaded rows and the tail)
    shape = dict(DECODE, num_heads=64, num_kv_heads=2)
    dims, _ = ca.check_decode(shape, "float16")
    assert (dims["rows"], dims["row_ctas"]) == (8, 4)
    source = _source(ca.decode_attention(shape, "float16", append=True)[0])
    assert len(re.findall(r"if \(\(\(\(int\)blockIdx\.y\) % 4\) == 0\)", source)) >= 2


def test_verify_shape_errors():
    with pytest.raises(ca.AttentionShapeError, match=re.escape("cache_len=1001")):
        ca.decode_attention(dict(VERIFY, cache_len=1001), "float16", drafts=4)
    with pytest.raises(ca.AttentionShapeError, match=re.escape("max(cache_len, 1)=700")):
        ca.decode_attention(VERIFY, "float16", dict(splits=701), drafts=4)
    with pytest.raises(ValueError, match="neither appends nor reads pages"):
        ca.decode_attention(VERIFY, "float16", append=True, drafts=4)
    # more query heads per K/V head than a CTA's registers hold: shared out among more CTAs
    dims, _ = ca.check_decode(dict(VERIFY, num_heads=32, num_kv_heads=2), "float16", drafts=4)
    assert (dims["rows"], dims["row_ctas"]) == (8, 8)


# ---- nvcc ----------------------------------------------------------------------------------------

def _ptxas(source: str, tmp_path) -> list[tuple[int, int]]:
    """(registers, spill bytes) per kernel of ``source`` compiled for sm_90a."""
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    done = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"),
                           str(cu), "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # C7514/C7515: ptxas serialised the wgmma pipeline (a register of one in flight touched)
    assert "wgmma.mma_async instructions are serialized" not in done.stderr, done.stderr[-3000:]
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", done.stderr)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)]
    return list(zip(regs, spills))


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@needs_nvcc
@pytest.mark.parametrize("shape", [PREFILL, dict(PREFILL, causal=0, head_dim=64), dict(MASKED, mask_rows=256),
                                   PADDED[0], PADDED[1], PAGED_CHUNK])
def test_nvcc_compiles_prefill_defaults(tmp_path, shape):
    # 384 threads: at most 168 registers each, or the CTA does not fit the register file
    pages = PAGES if shape is PAGED_CHUNK else None
    [(regs, spills)] = _ptxas(_source(ca.prefill_attention(shape, "float16", None, pages)), tmp_path)
    assert regs <= 168 and spills == 0


@needs_nvcc
@pytest.mark.parametrize("knobs", [None, dict(block_n=64, stages=2, persistent=0, overlap=0)])
def test_nvcc_compiles_verify_prefill(tmp_path, knobs):
    [(regs, spills)] = _ptxas(_source(_verify_prefill(knobs=knobs)), tmp_path)
    assert regs <= 168 and spills == 0


@needs_nvcc
@pytest.mark.parametrize("rows,block_n", [(256, 128), (1, 64), (1, 128)])
def test_nvcc_compiles_masked_prefill(tmp_path, rows, block_n):
    # one CTA per item, no overlap: one mask row at BN 128 spilled 52 bytes at 168 registers (nvcc
    # 13.0) before the producer gave the consumers its registers
    knobs = dict(block_n=block_n, stages=2, persistent=0, overlap=0)
    func = ca.prefill_attention(dict(MASKED, mask_rows=rows), "float16", knobs)
    [(regs, spills)] = _ptxas(_source(func), tmp_path)
    assert regs <= 168 and spills == 0


@needs_nvcc
@pytest.mark.parametrize("shape,block_n", [(PREFILL, 128), (dict(PREFILL, causal=0), 64),
                                           (dict(MASKED, mask_rows=1), 128)])
def test_nvcc_keeps_the_overlapped_prefill_pipelined(tmp_path, shape, block_n):
    # the consumers hold S, P and O at once: 240 registers after setmaxnreg, no spills, and the P V
    # product of one tile runs under the next tile's softmax (no serialised wgmma, checked in _ptxas)
    func = ca.prefill_attention(shape, "float16", dict(block_n=block_n, stages=2, persistent=1, overlap=1))
    [(regs, spills)] = _ptxas(_source(func), tmp_path)
    assert regs <= 168 and spills == 0


@needs_nvcc
@pytest.mark.parametrize("append, knobs", [(False, None), *((True, dict(merge=merge)) for merge in ca.MERGES)])
def test_nvcc_compiles_decode(tmp_path, append, knobs):
    split, combine = ca.decode_attention(DECODE, "float16", knobs, append=append)
    for func in (split, combine) if combine else (split,):
        [(regs, spills)] = _ptxas(_source(func), tmp_path)
        assert spills == 0 and regs <= 255


@needs_nvcc
@pytest.mark.parametrize("knobs", [dict(warps=4, merge="last"), dict(warps=4, merge="last", splits=100, stages=2)], ids=str)
def test_nvcc_compiles_the_last_splits_merge_in_batches_and_chunks(tmp_path, knobs):
    # 8 query rows on 128 threads: a thread's 8 outputs x 32 splits loaded in 4 batches of 2; 100
    # splits in 2 chunks of LAST_LOADS
    shape = dict(DECODE, num_heads=8 * DECODE["num_kv_heads"], max_seq=8192)
    split, _ = ca.decode_attention(shape, "float16", knobs, append=True)
    body = _source(split).split("__global__")[-1]
    merge = body[body.index("autofuse_split_arrive("):]
    assert merge.count("PO_ptr[") == 2 * ca.LAST_LOADS   # the first batch before the barrier, the rest in a loop
    [(regs, spills)] = _ptxas(_source(split), tmp_path)
    assert spills == 0 and regs <= 255


@needs_nvcc
def test_nvcc_compiles_verify_without_spills(tmp_path):
    # 8 query rows a CTA (4 heads x 8 drafts shared out in sets of 8), the most registers, at the
    # default knobs (8 keys a step compiled without spills too, but takes nvcc 13 s)
    split, _ = ca.decode_attention(dict(VERIFY, num_heads=16, num_kv_heads=4), "float16", drafts=8)
    [(regs, spills)] = _ptxas(_source(split), tmp_path)
    assert spills == 0 and regs <= 255


# ---- the arithmetic, in numpy --------------------------------------------------------------------

@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("seq_q,seq_kv", [(256, 256), (256, 512), (384, 640), (200, 333), (77, 77), (256, 300),
                                          (1, 1000)])
def test_causal_key_tiles_visit_every_visible_key_and_mask_only_where_needed(block_n, seq_q, seq_kv):
    padded = bool(seq_q % ca.BLOCK_M or seq_kv % block_n)
    kv_tiles = -(-seq_kv // block_n)
    offset = seq_kv - seq_q
    visible = np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None] + offset
    for q_first in range(0, seq_q, ca.BLOCK_M):
        rows = visible[q_first:q_first + ca.BLOCK_M]
        n_tiles, n_unmasked = ca.causal_key_tiles(q_first, offset, block_n, padded, kv_tiles)
        if not padded:
            assert (n_tiles, n_unmasked) == ca.causal_key_tiles(q_first, offset, block_n, True, kv_tiles)
        assert n_tiles <= kv_tiles
        assert not rows[:, n_tiles * block_n:].any()           # skipped tiles: nothing visible
        assert rows[:, (n_tiles - 1) * block_n:n_tiles * block_n].any()  # the last visited tile is needed
        assert n_unmasked * block_n <= seq_kv and rows[:, :n_unmasked * block_n].all()  # unmasked: all visible
        if (n_unmasked + 1) * block_n <= seq_kv:                 # the next whole tile is not
            assert not rows[:, n_unmasked * block_n:(n_unmasked + 1) * block_n].all()


@pytest.mark.parametrize("page_size,block_n", [(16, 128), (64, 64), (256, 128), (8, 64)])
def test_paged_key_rows_gather_each_sequences_keys(page_size, block_n):
    # the producer's TMA rows (a box of min(page_size, block_n) rows per lookup), read from the pool
    # viewed as (num_pages x kv_heads x page_size) rows, are paged_attention's gathered keys
    from search_spaces.attention.paged_attention import gather_cache

    rng = np.random.default_rng(0)
    batch, kv_heads, max_pages = 3, 2, max(2, 1024 // page_size)
    num_pages = batch * max_pages + 3
    pool = rng.standard_normal((num_pages, kv_heads, page_size, 4))
    table = rng.integers(0, num_pages, (batch, max_pages))
    table[:, :] = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    rows, keys = pool.reshape(-1, 4), gather_cache(pool, table)
    box = min(page_size, block_n)
    for b, length in enumerate((1, 333, max_pages * page_size)):
        for h in range(kv_heads):
            for j in range(-(-length // block_n)):                     # the key tiles a chunk visits
                for e in range(block_n // box):
                    first = j * block_n + e * box
                    row = ca.paged_key_row(table, b, h, first, page_size, max_pages, kv_heads)
                    real = min(box, max(0, length - first))                # keys past seq_lens are masked
                    np.testing.assert_array_equal(rows[row:row + real], keys[b, h, first:first + real])
                    assert 0 <= row and row + box <= len(rows)


@pytest.mark.parametrize("page_size,block_n", [(16, 128), (128, 64)])
def test_paged_prefill_tiles_match_the_pattern_reference(page_size, block_n):
    # The paged kernel's work items in float64: per (query tile, sequence, head) the key tiles its
    # run-time length gives (causal_key_tiles from seq_lens[b] - q_len), each gathered box by box
    # through the block table (paged_key_row), the tiles from n_unmasked on masked above the
    # diagonal, then the softmax over what was visited: paged_attention's reference
    from search_spaces.attention import paged_attention as pa

    shape = dict(batch=3, q_len=150, num_heads=4, num_kv_heads=2, head_dim=16, page_size=page_size,
                 max_pages=320 // page_size, num_pages=3 * 320 // page_size + 2)
    q, k_pages, v_pages, table, lengths = pa.make_inputs(shape, "float32", 1)
    want = pa.reference(q, k_pages, v_pages, table, lengths)
    ql, hq, hkv, hd = 150, 4, 2, 16
    box = min(page_size, block_n)
    k_rows, v_rows = (x.reshape(-1, hd).astype(np.float64) for x in (k_pages, v_pages))
    got = np.full_like(want, np.nan, dtype=np.float64)
    for b, length in enumerate(int(n) for n in lengths):
        offset = length - ql
        for h in range(hq):
            for q_first in range(0, ql, ca.BLOCK_M):
                n_tiles, n_unmasked = ca.causal_key_tiles(q_first, offset, block_n, True, -(-length // block_n))
                rows = [ca.paged_key_row(table, b, h // (hq // hkv), j * block_n + e * box, page_size,
                                         shape["max_pages"], hkv) + r
                        for j in range(n_tiles) for e in range(block_n // box) for r in range(box)]
                keys = np.arange(n_tiles * block_n)
                t = np.arange(q_first, min(q_first + ca.BLOCK_M, ql))
                s = q[b, t, h].astype(np.float64) @ k_rows[rows].T / math.sqrt(hd)
                hidden = (keys[None, :] >= n_unmasked * block_n) & (keys[None, :] > t[:, None] + offset)
                s = np.where(hidden, -np.inf, s)
                p = np.exp(s - s.max(axis=1, keepdims=True))
                got[b, t, h] = (p / p.sum(axis=1, keepdims=True)) @ v_rows[rows]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _masked_prefill_model(q, k, v, mask, block_n, scale):
    """The masked prefill kernel's recurrence for one (batch, head), in float32 as the kernel
    computes it: S = q k^T scale + mask, key tiles of block_n (a padded last tile's keys past
    seq_kv with some other mask value, then -inf), m from the float32 minimum, m' = max(m,
    rowmax S), alpha = 2^((m - m') log2 e), P = 2^((S - m') log2 e), and O / l stored as 0 where
    l = 0. NaN anywhere raises (np.errstate)."""
    f32 = np.float32
    seq_kv, pad = k.shape[0], -k.shape[0] % block_n
    k, v = (np.concatenate([x, np.ones((pad, x.shape[1]), x.dtype)]) for x in (k, v))
    mask = np.concatenate([mask, np.full((mask.shape[0], pad), 7.0, mask.dtype)], axis=1)  # another row's words
    s = (q.astype(f32) @ k.astype(f32).T) * f32(scale) + mask.astype(f32)
    s[:, seq_kv:] = -np.inf
    rows = s.shape[0]
    m = np.full(rows, np.finfo(f32).min, f32)
    l, o = np.zeros(rows, f32), np.zeros((rows, v.shape[1]), f32)
    for t in range(0, s.shape[1], block_n):
        tile = s[:, t:t + block_n]
        m_new = np.maximum(m, tile.max(axis=1))
        alpha = np.exp2((m - m_new) * f32(ca.LOG2E))
        p = np.exp2((tile - m_new[:, None]) * f32(ca.LOG2E))
        l = l * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + p @ v[t:t + block_n].astype(f32)
        m = m_new
    inv = np.where(l > 0, f32(1) / np.where(l > 0, l, f32(1)), f32(0))
    return o * inv[:, None]


@pytest.mark.parametrize("seq_kv", [384, 334])
@pytest.mark.parametrize("block_n", [64, 128])
def test_masked_prefill_recurrence_matches_the_pattern_reference(block_n, seq_kv):
    from search_spaces.attention import masked_attention as ma

    rng = np.random.default_rng(block_n)
    head_dim = 64
    q = rng.standard_normal((1, 1, 8, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, seq_kv, head_dim)).astype(np.float32) for _ in range(2))
    bf16_min, f16_min = np.float32(ma.MASKED["bfloat16"]), np.float32(ma.MASKED["float16"])
    mask = np.zeros((1, 1, 8, seq_kv), np.float32)
    mask[..., 1, :] = -np.inf                          # no visible key: 0, as the exports' guard makes it
    mask[..., 2, :] = bf16_min                         # only finfo.min keys: the uniform average of V
    mask[..., 3, :300] = -np.inf                       # the first tiles without a visible key
    mask[..., 4, :block_n] = bf16_min                  # a first tile of finfo.min keys, then visible ones
    mask[..., 4, 200:] = -np.inf
    mask[..., 5, ::3] = f16_min                        # float16's finfo.min and -inf between visible keys
    mask[..., 5, 1::7] = -np.inf
    mask[..., 6, :-1] = -np.inf                        # one visible key, the last
    mask[..., 7, :] = rng.standard_normal(seq_kv) * 4  # any additive bias
    with np.errstate(invalid="raise", over="ignore"):
        got = _masked_prefill_model(q[0, 0], k[0, 0], v[0, 0], mask[0, 0], block_n, 1 / math.sqrt(head_dim))
    want = ma.reference(q, k, v, mask)[0, 0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not got[1].any() and np.allclose(got[2], v[0, 0].mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(got[6], v[0, 0, -1], atol=1e-6)
    # why the kernel does not add mask * log2(e) in the exp2 domain: bfloat16's finfo.min overflows
    with np.errstate(over="ignore"):
        assert np.isneginf(bf16_min * np.float32(ca.LOG2E))


def _split_part(qs, k, v, begin, end, geo, visible=None):
    """One split CTA's partial (max, sum, output) over keys [begin, end) of k, v, in float64: per
    lane group an online softmax in the exp2 domain over its rows of each step, then the CTA's
    merge of its lane groups. ``visible`` (query rows x keys), where given, hides scores as the
    drafts' tree does (the float32 minimum)."""
    group, hd = qs.shape
    step, groups, keys, per_load = geo["step"], geo["groups"], geo["step"] // geo["groups"], geo["rows_per_load"]
    state = [(np.full(group, ca._INIT_MAX), np.zeros(group), np.zeros((group, hd))) for _ in range(groups)]
    for first in range(begin, max(end, begin), step):
        for lg in range(groups):
            warp, row = divmod(lg, per_load)
            rows = [first + warp * per_load * keys + row + u * per_load for u in range(keys)]
            rows = [r for r in rows if r < end]
            m, l, acc = state[lg]
            if not rows:
                continue
            s = qs @ k[rows].T                                   # (group, rows)
            if visible is not None:
                s = np.where(visible[:, rows], s, float(np.finfo(np.float32).min))
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.exp2(m - m_new)
            p = np.exp2(s - m_new[:, None])
            state[lg] = (m_new, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ v[rows])
    ms = np.array([st[0] for st in state])
    big_m = ms.max(axis=0)
    w = np.exp2(ms - big_m)
    return (big_m, (w * np.array([st[1] for st in state])).sum(axis=0),
            np.einsum("rg,rgd->gd", w, np.array([st[2] for st in state])))


def _decode_model(q, k, v, length, splits, geo, scale, drafts=None):
    """The split kernel's recurrence for one (batch, K/V head) (one row set when verifying), in
    float64: key ranges from decode_key_range, a partial per split (``_split_part``), with
    ``drafts`` = (k_draft, v_draft, visible) one more over the drafts' keys, then the combine."""
    qs = q * scale * ca.LOG2E
    parts = []
    for sp in range(splits):
        begin, end = ca.decode_key_range(sp, length, splits, geo["step"])
        parts.append(_split_part(qs, k, v, begin, min(end, length), geo))
    if drafts is not None:
        k_draft, v_draft, visible = drafts
        parts.append(_split_part(qs, k_draft, v_draft, 0, len(k_draft), geo, visible))
    big_m = np.max([p[0] for p in parts], axis=0)
    w = [np.exp2(p[0] - big_m) for p in parts]
    total = sum(wi * p[1] for wi, p in zip(w, parts))
    out = sum(wi[:, None] * p[2] for wi, p in zip(w, parts))
    return out / total[:, None]


@pytest.mark.parametrize("length,splits,knobs", [
    (1, 7, dict(warps=4, keys=4)), (17, 5, dict(warps=4, keys=2)), (300, 3, dict(warps=8, keys=4)),
    (1000, None, dict(warps=8, keys=4)), (513, 40, dict(warps=4, keys=1))])
def test_decode_split_and_combine_recurrence(length, splits, knobs):
    rng = np.random.default_rng(length)
    group, hd, smax = 4, 128, 1024
    q = rng.standard_normal((group, hd))
    k, v = rng.standard_normal((smax, hd)), rng.standard_normal((smax, hd))
    shape = dict(DECODE, max_seq=smax)
    _, resolved = ca.check_decode(shape, "float16", dict(knobs, splits=splits))
    scale = 1 / math.sqrt(hd)
    got = _decode_model(q, k, v, length, resolved["splits"], ca.decode_geometry(hd, resolved), scale)
    s = q @ k[:length].T * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ v[:length]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("group,drafts,rows", [(4, 8, 8), (4, 5, 5), (1, 7, 7), (16, 1, 8), (8, 3, 8), (2, 11, 2)])
def test_verify_row_sets_cover_each_query_row_once_under_its_kv_head(group, drafts, rows):
    # a row set is up to 8 consecutive (head, draft) rows; all of a set belong to one K/V head
    assert ca.decode_rows(group, drafts) == rows
    kv_heads, row_ctas = 3, group * drafts // rows
    seen = []
    for hk in range(kv_heads * row_ctas):
        for g in range(rows):
            qr = hk * rows + g                                  # (head, draft) = divmod(qr, drafts)
            assert qr // drafts // group == ca._kv_head(hk, row_ctas)
            seen.append(qr)
    assert sorted(seen) == list(range(kv_heads * group * drafts))


@pytest.mark.parametrize("cache_len,drafts,knobs", [
    (300, 8, dict(warps=8, keys=2)), (0, 5, dict(warps=4, keys=1)), (1000, 40, dict(warps=4, keys=2)),
    (77, 3, dict(warps=8, keys=4, splits=5))])
def test_verify_splits_and_draft_split_match_the_pattern_reference(cache_len, drafts, knobs):
    # the kernel's row sets (rows = the K/V head's (head, draft) pairs, up to 8 a CTA), its cache
    # splits and the drafts' split under the tree, modelled in float64, against spec_verify_attention
    from search_spaces.speculative import spec_verify_attention as sv
    shape = dict(batch=1, heads=8, kv_heads=2, head_dim=64, max_seq=1024, cache_len=cache_len, k_draft=drafts)
    q, kc, vc, kn, vn, tree = sv.make_inputs(shape, "float32", drafts)
    q, kc, vc, kn, vn = (x.astype(np.float64) for x in (q, kc, vc, kn, vn))
    decode = sv._decode_shape(shape)
    dims, resolved = ca.check_decode(decode, "float16", knobs, drafts=drafts)
    rows, row_ctas, group = dims["rows"], dims["row_ctas"], dims["group"]
    geo = ca.decode_geometry(64, resolved)
    flat = q[0].reshape(8 * drafts, 64)                        # query row (head, draft) -> head * drafts + draft
    got = np.empty_like(flat)
    for hk in range(2 * row_ctas):
        kvh, qr = ca._kv_head(hk, row_ctas), [hk * rows + g for g in range(rows)]
        visible = tree[[r % drafts for r in qr]] != 0
        got[qr] = _decode_model(flat[qr], kc[0, kvh], vc[0, kvh], cache_len, resolved["splits"], geo,
                                1 / math.sqrt(64), (kn[0, kvh], vn[0, kvh], visible))
    want = sv.reference(q, kc, vc, kn, vn, tree, shape)[0].reshape(8 * drafts, 64)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _box(rows, first, n):
    """TMA's box of n rows from row ``first`` of a row-major matrix: zeros past its end."""
    out = np.zeros((n, rows.shape[1]), rows.dtype)
    part = rows[first:first + n]
    out[:len(part)] = part
    return out


@pytest.mark.parametrize("cache_len,drafts,block_n", [(300, 8, 128), (256, 8, 128), (0, 5, 64), (1000, 16, 64)])
def test_verify_prefill_tiles_match_the_pattern_reference(cache_len, drafts, block_n):
    # The verify prefill's work items in float64: a (batch, K/V head) item's group x drafts query
    # rows are q's rows in memory order, in BLOCK_M-row tiles (rows past the item's are the next
    # item's or zeros, not stored); its cache tiles (verify_key_tiles) with keys from cache_len on
    # hidden and their V rows zeroed (the cache past cache_len is NaN here: nobody wrote it), then
    # one block_n-row box of the drafts' K/V from the item's first draft (running on into the next
    # item's), keys past the drafts hidden and the rest under the tree by row % drafts
    from search_spaces.speculative import spec_verify_attention as sv
    shape = dict(batch=8, heads=8, kv_heads=2, head_dim=64, max_seq=1024, cache_len=cache_len, k_draft=drafts)
    nb, hq, hkv, hd, smax = 8, 8, 2, 64, 1024
    prefill, verify = sv._verify_prefill(shape)
    dims, _ = ca.check_prefill(prefill, "float16", dict(block_n=block_n, stages=2), verify=verify)
    q, kc, vc, kn, vn, tree = sv.make_inputs(shape, "float32", 3)
    kc[:, :, cache_len:] = np.nan
    vc[:, :, cache_len:] = np.nan
    want = sv.reference(q, kc, vc, kn, vn, tree, shape)
    rows_q, sq = q.astype(np.float64).reshape(-1, hd), dims["seq_q"]
    k_rows, v_rows = (x.astype(np.float64).reshape(-1, hd) for x in (kc, vc))
    kd_rows, vd_rows = (x.astype(np.float64).reshape(-1, hd) for x in (kn, vn))
    n_cache = ca.verify_key_tiles(cache_len, block_n)
    got = np.full_like(rows_q, np.nan)
    for head in range(nb * hkv):
        for q_first in range(0, sq, ca.BLOCK_M):
            r = q_first + np.arange(ca.BLOCK_M)                      # the item's rows (and on)
            qt = _box(rows_q, head * sq + q_first, ca.BLOCK_M)
            ks, vs, hidden = [], [], []
            for j in range(n_cache):
                key = j * block_n + np.arange(block_n)
                ks.append(_box(k_rows, head * smax + j * block_n, block_n))
                vs.append(np.where((key < cache_len)[:, None], _box(v_rows, head * smax + j * block_n, block_n), 0))
                hidden.append(np.broadcast_to(key >= cache_len, (ca.BLOCK_M, block_n)))
            col = np.arange(block_n)
            ks.append(_box(kd_rows, head * drafts, block_n))
            vs.append(_box(vd_rows, head * drafts, block_n))
            seen = (col[None, :] < drafts) & (tree[r[:, None] % drafts, np.minimum(col, drafts - 1)[None, :]] != 0)
            hidden.append(~seen)
            s = np.where(np.concatenate(hidden, axis=1), -np.inf, qt @ np.concatenate(ks).T / math.sqrt(hd))
            p = np.exp(s - s.max(axis=1, keepdims=True))
            o = (p / p.sum(axis=1, keepdims=True)) @ np.concatenate(vs)
            stored = r < sq
            got[head * sq + r[stored]] = o[stored]
    np.testing.assert_allclose(got, want.astype(np.float64).reshape(-1, hd), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,queries,knobs", [(300, 3, dict(warps=8, keys=2)), (16, 16, dict(warps=4, keys=1)),
                                                  (1000, 5, dict(warps=8, keys=4, splits=9))])
def test_paged_chunk_rows_see_the_keys_up_to_their_own(length, queries, knobs):
    # a chunk's query t (heads x tokens in row sets of up to 8, t the fastest) sees keys up to
    # length - queries + t: the split kernel's mask in each step, modelled in float64
    rng = np.random.default_rng(length)
    heads, kv_heads, hd = 8, 2, 64
    q = rng.standard_normal((queries, heads, hd))
    k, v = rng.standard_normal((kv_heads, length, hd)), rng.standard_normal((kv_heads, length, hd))
    shape = dict(batch=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, max_seq=1024)
    dims, resolved = ca.check_decode(shape, "float16", knobs, queries=queries)
    rows, row_ctas, geo = dims["rows"], dims["row_ctas"], ca.decode_geometry(hd, resolved)
    for hk in range(kv_heads * row_ctas):
        kvh, qr = ca._kv_head(hk, row_ctas), [hk * rows + g for g in range(rows)]
        t = np.array([r % queries for r in qr])
        visible = np.arange(length)[None, :] <= length - queries + t[:, None]
        qs = q[t, [r // queries for r in qr]] * (1 / math.sqrt(hd)) * ca.LOG2E
        parts = []
        for sp in range(resolved["splits"]):
            begin, end = ca.decode_key_range(sp, length, resolved["splits"], geo["step"])
            parts.append(_split_part(qs, k[kvh], v[kvh], begin, min(end, length), geo, visible))
        big_m = np.max([p[0] for p in parts], axis=0)
        w = [np.exp2(p[0] - big_m) for p in parts]
        got = sum(wi[:, None] * p[2] for wi, p in zip(w, parts)) / sum(wi * p[1] for wi, p in zip(w, parts))[:, None]
        s = q[t, [r // queries for r in qr]] @ k[kvh].T / math.sqrt(hd)
        s = np.where(visible, s, -np.inf)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(got, (e / e.sum(axis=1, keepdims=True)) @ v[kvh], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("length,splits,step", [(1, 7, 32), (1000, 16, 64), (4097, 33, 64), (131072, 32, 64)])
def test_decode_key_ranges_cover_each_key_once(length, splits, step):
    covered = np.zeros(length, dtype=int)
    for sp in range(splits):
        begin, end = ca.decode_key_range(sp, length, splits, step)
        assert (end - begin) % step == 0
        covered[begin:min(end, length)] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("length,splits,step,max_seq", [(1, 7, 32, 1000), (1000, 16, 64, 1000), (4001, 33, 64, 4096),
                                                        (97, 8, 64, 131072)])
def test_append_writes_each_cache_row_once(length, splits, step, max_seq):
    # the attended rows through the key ranges, the rest through the tail shares
    written = np.zeros(max_seq, dtype=int)
    for sp in range(splits):
        begin, end = ca.decode_key_range(sp, length, splits, step)
        written[begin:min(end, length)] += 1
        begin, end = ca.decode_tail_range(sp, length, splits, max_seq)
        assert begin >= length
        written[begin:min(end, max_seq)] += 1
    assert (written == 1).all()


def test_append_split_reads_the_new_row_and_writes_the_caches():
    # loads to registers (stages 0); the ring's: test_appending_decode_streams_its_keys_through_...
    split, combine = ca.decode_attention(DECODE, "float16", dict(stages=0, merge="combine"), append=True)
    source = _source(split)
    assert "attention_decode_append_split_kernel" in source
    assert "(length - 1)" in source                   # the new token's row comes from k_new / v_new
    for name in ("KN_ptr", "VN_ptr"):
        assert re.search(rf"\(\(uint4\*\){name}\)\[", source), name
    for name in ("KO_ptr", "VO_ptr"):                 # 16-byte stores of the output caches
        assert re.search(rf"\(\(uint4\*\){name}\)\[[^\]]*\] = ", source), name
    assert len(split.params) == 10                    # q, k_new, v_new, the caches in and out, 2 partials, length
    # without append, the split kernel has none of it
    plain = _source(ca.decode_attention(DECODE, "float16")[0])
    assert "KO_ptr" not in plain and "KN_ptr" not in plain


@pytest.mark.parametrize("batch", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("max_seq", [100, 1024, 4000, 32768])
def test_default_splits_fill_the_gpu_without_tiny_or_empty_splits(batch, max_seq):
    shape = dict(batch=batch, num_heads=32, num_kv_heads=8, head_dim=128, max_seq=max_seq)
    _, knobs = ca.check_decode(shape, "float16")
    splits, step = knobs["splits"], ca.decode_geometry(128, knobs)["step"]
    assert 1 <= splits <= ca.SPLIT_MAX
    assert splits == 1 or batch * 8 * splits <= ca.SPLIT_MAX_CTAS
    ranges = [ca.decode_key_range(sp, max_seq, splits, step) for sp in range(splits)]
    assert all(begin < max_seq for begin, _ in ranges)                       # none empty at max_seq
    assert splits == 1 or ranges[0][1] >= ca.SPLIT_MIN_KEYS                  # none tiny
    if batch * 8 < SM_COUNT and max_seq >= 32768:
        assert batch * 8 * splits >= SM_COUNT  # a long cache of few sequences still spreads over all SMs
