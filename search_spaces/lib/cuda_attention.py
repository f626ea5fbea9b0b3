"""Hopper (sm_90a) attention kernels: a tensor-core prefill forward, split-KV decoding and rotary
scores (rope_qk's, ``rope_scores``).

All are kernel templates, functions ``(shape, dtype, knobs) -> tirx PrimFunc`` written in the tirx
script and built with ``tvm.compile(IRModule, target=TARGET, tir_pipeline="tirx")`` (``build``):
TVM 0.27's schedule primitives reach tensor cores only through WMMA / mma.sync, and the H200 wants
TMA copies, mbarrier rings and asynchronous warpgroup MMAs (wgmma), which only the script expresses.
Functions carry ``autofuse.tirx`` = True (a mixed Relax pipeline sends them through the tirx
lowering) and ``tirx.is_scheduled`` = True (dlight leaves them alone). Any shape, dtype or knob a
kernel cannot take raises ``AttentionShapeError`` (a ValueError) naming the rule.

Prefill: ``prefill_attention`` -> ``(q, k, v, out)``, or ``(q, k, v, mask, out)`` with ``mask_rows``
    q, out (batch, heads, seq_q, head_dim); k, v (batch, kv_heads, seq_kv, head_dim); float16 or
    bfloat16, head_dim 64 or 128. out = softmax(q k^T * scale [+ causal mask]) v, float32
    accumulation, out rounded once. Grouped-query: query head h reads K/V head h // (heads /
    kv_heads). Causal masking is aligned at the end as in the flash_attention pattern (key j is
    visible to query i when j <= i + seq_kv - seq_q, so seq_q <= seq_kv); equal lengths give the
    usual lower triangle.

    With ``mask_rows`` 1 or seq_q (masked_attention; not with causal) an additive mask (batch, 1,
    mask_rows, seq_kv) in the dtype: out = softmax(q k^T * scale + mask) v. Each thread reads the
    mask at its accumulator's (row, key) pairs straight from global memory (one 4-byte load per
    two adjacent keys) and adds it to S * scale in float32 before the row max; the softmax then
    stays in the natural-log domain (P = 2^((S - m') log2 e)), since a bfloat16 finfo.min times
    log2 e overflows float32. m starts at the float32 minimum, so -inf keys give P = 0 without
    inf - inf, a row of finfo.min keys the average of V (as the reference), and a row of -inf keys
    (l = 0) stores 0, as the exports' IsNaN/Where guard makes it. mask_rows 0 is the unmasked
    kernel, unchanged.

    The FlashAttention-3 layout without its ping-pong: per (128-row query tile, batch x head) work
    item, three warpgroups. Warpgroup 0 is the producer: one thread issues the TMA copies (128-byte
    swizzle, boxes of 64 columns) of the query tile and then of each key/value tile (BN rows) into a
    ring of ``stages`` shared-memory slots, each slot with a "full" mbarrier (the bytes landed) and
    an "empty" one (both consumers are done with it), so loads run ahead of the math without any
    CTA-wide barrier. Warpgroups 1 and 2 each own 64 query rows. Per key tile:
        S = Q K^T          wgmma m64nBNk16, both operands from shared memory (K K-major)
        m' = max(m, rowmax(S) * c),  alpha = 2^(m - m')          c = scale * log2(e)
        P = 2^(S * c - m'),  l = l * alpha + rowsum(P)
        O = O * alpha + P V  wgmma m64n{head_dim}k16, P straight from registers (the S accumulator
                             has the A fragment's element order), V as stored (MN-major)
    A thread holds two rows of each 8-column group, and the four threads of a quad share rows, so
    row max and sum are two shuffles. Causal: key tiles wholly above the diagonal are never loaded
    or computed (the tile count is per item), only the BM / BN tiles that cross it are masked, and
    a head's longest query tiles go first. At the end O / l is stored from registers.

    ``persistent`` 1: one CTA per SM, each taking every grid-th work item (causal: every grid-th
    pair of a head's items of complementary length, so that the CTAs' shares are even); the
    producer loads the next item's query tile (a "q_empty" mbarrier: both consumers issued their
    last Q K^T) and first key tiles while the consumers finish the last tile and store. 0: a CTA
    per work item.
    ``overlap`` 1: tile j's Q K^T is issued ahead of tile j - 1's P V, which then runs on the
    tensor cores during tile j's softmax (FlashAttention-3's intra-warpgroup pipelining); S, P and
    O are all live then; the accumulators are pinned after each wait so that ptxas keeps the wgmma
    pipeline. In every variant the producer gives its registers to the consumers (setmaxnreg 24 /
    240): at the 168 each of 384 threads gets otherwise, the masked and persistent kernels spill.

    Knobs (``PREFILL_KNOBS``): ``block_n`` BN, keys per tile (64, 128); ``stages`` (2, 3);
    ``persistent`` (0, 1); ``overlap`` (0, 1). Defaults (``PREFILL_DEFAULT_KNOBS``, at every
    shape): BN 128, 3 stages, overlap, persistent (causal: paired). Overlap needs the third stage:
    the consumers hold tile j - 1's V and tile j's K at once, so with two stages the producer cannot
    load ahead (in an H100 sweep overlap was the slowest with two stages and the fastest with
    three). Any seq_q and seq_kv: a last tile past the end copies the next head's rows (or TMA's
    zeros past the tensor), its keys masked (non-causal; causal masks them already), its query
    rows not stored. With a mask the same, its loads clamped to the mask (a padded row reads the
    last query's words, keys past seq_kv some word of the mask, then -inf); seq_kv must be even (the
    mask is read two keys at a time).

    With ``paged`` (page_size, max_pages, num_pages): paged_attention's chunked prefill, causal,
    q and out (batch, seq_q, heads, head_dim), K/V in pages (num_pages, kv_heads, page_size,
    head_dim) through block_table (batch, max_pages) and seq_lens (batch,), both int32. A head's
    query tile is a 64-column box of the (batch x seq_q, heads x head_dim) matrix; a key tile is
    BN / page_size page boxes (or a BN-row part of one page), each TMA copy's row looked up in
    the block table by the producer, all completing on the slot's one barrier. The work item's
    length seq_lens[b] sets, at run time, the causal offset seq_lens[b] - seq_q and how many key
    tiles it visits; keys past it in the last tile are masked as above the diagonal.

    With ``verify`` (drafts, cache_len) and a ``verify_prefill_shape``: spec_verify_attention's
    drafts, not causal. A work item is a (batch, K/V head): its group's heads x drafts query rows,
    contiguous in q, are the item's queries (one wgmma tile from 1 x 128 to 8 x 16 rows). Its key
    tiles are the cache's first cache_len rows (``verify_key_tiles``), then one tile of the drafts'
    own K/V (k_new, v_new, a BN-row box from the item's first draft) masked by tree[row % drafts,
    key]. The last cache tile's keys past cache_len are masked and their V rows zeroed in shared
    memory by each consumer warpgroup before its P V (rows nobody wrote may hold NaN, which P = 0
    would not cancel); fence.proxy.async and a warpgroup barrier, then the wgmma. Needs
    VERIFY_MIN_ITEMS items or more, and drafts <= BN.

Decode: ``decode_attention`` -> ``(split, combine)``, flash-decoding for one new token per sequence
    split (q, k_cache, v_cache, part_o, part_ml, length) attends q (batch, heads, head_dim) over
    positions [0, length) of the caches (batch, kv_heads, max_seq, head_dim) (length is a run-time
    int32, 1 <= length <= max_seq: one build serves every length) and writes per key split its
    unnormalised output part_o (batch, heads, splits, head_dim) and (max, sum) part_ml (batch,
    heads, splits, 2), float32, in the exp2 domain. combine (part_o, part_ml, out) merges the
    splits: out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.

    Decoding reads each cache row once and does 2 x group multiply-adds per element: memory-bound,
    so CUDA cores, but every byte must come in 16-byte coalesced loads and there must be enough of
    them in flight. A CTA per (key split, K/V head, batch) owns a contiguous range of
    ceil(length / splits) keys (rounded to its step) and serves the whole query group of that K/V
    head, so each K/V row is read once for all of it. head_dim / 8 lanes share a key row, one
    16-byte load each (a warp's load instruction covers consecutive rows, 512 contiguous bytes at
    head_dim 128); each such lane group runs its own online softmax over its keys, ``keys`` rows per
    step (all loads of a step issued before any math), with q in registers, pre-multiplied by
    scale * log2(e). Dot products are summed by shuffles within the lane group. At the end the lane
    groups of the CTA merge through shared memory and the CTA writes one partial per query head.
    Lengths are unbounded: no buffer is sized by the cache length.

    With ``append`` (patterns whose caches are outputs) the split kernel also appends: it reads row
    length - 1 from the new token's k_new/v_new instead of the caches, stores every row it loads
    to k_out/v_out, and the CTAs share out the copy of the rows from length on, so the copy adds
    the writes and no second pass over the caches.

    Several query tokens per sequence (a speculative step's drafts, ``drafts``; a paged chunk,
    ``queries``): a K/V head's group x tokens query rows are shared out ``decode_rows`` (at most
    DECODE_MAX_GROUP) to a CTA, the CTAs of one split reading the same keys (from L2 after the
    first); the drafts' own keys are one more split, masked by their tree.

    Only a split's last step checks row bounds. Knobs (``DECODE_KNOBS``): ``warps`` per CTA (4, 8);
    ``keys`` rows per lane group and step (1, 2, 4, 8); ``splits`` (None: ``default_splits``).
    Defaults: 8 warps, 2 keys (the faster from a 4k cache on in an H100 sweep). The appending
    kernel adds ``stages`` (APPEND_KNOBS): with 2 or 4, one thread bulk-copies each step's K and V
    rows (contiguous in the cache) into a ring of that many shared-memory slots, so a CTA's next
    steps are in flight while it computes, and bulk-copies each landed slot out to the output
    caches; the lane groups read their rows from the slot. 0: loads to registers, stores from them.
    Default 4 (all of a 128-key split's loads issued at once). And ``merge``, who merges a row
    set's splits (MERGES): "combine", the combine kernel; "cluster", the splits are one thread-block
    cluster (at most CLUSTER_MAX), which merges them without a combine kernel: each CTA stores its
    partial output elements into the shared memory of the CTA that merges them (a share of rows x
    head_dim each) and its rows' (max, sum) into every CTA's, over distributed shared memory (mapa,
    st.shared::cluster), then one cluster barrier (release, acquire), and each CTA writes its share
    of out (a relaxed cluster arrive at the start, waited on before the first remote store, makes
    sure every CTA of the cluster has started); "last", each split writes its partials to global
    memory and counts itself in (one release/acquire atomic per CTA on a zero-initialised counter of
    the module, ``_ARRIVE_SOURCE``), and the split that arrives last merges them from L2 and writes
    out, setting the counter back to zero: no second launch, no grid-wide wait. Default (None):
    ``default_merge``, by shape. And ``evict_first``, the L2 policy of the ring's bulk copies
    (createpolicy, ``.L2::cache_hint``): 1, the cache lines they read are the first L2 evicts, so a
    step's stream of K/V replaces its own lines instead of what other kernels left there (dirty
    lines that would be written back first); 2, the lines they write out as well; 0, no policy.
    Default 0, until a GPU has timed the others (README); only with stages (with stages 0 it
    resolves to 0, and 1 or 2 asked for is refused).

    Both kernels are launched with programmatic dependent launch (sm_90): the split kernel waits
    for the kernel before it (griddepcontrol.wait) and at once allows its dependents, so the
    combine's CTAs are resident, waiting on the split kernel's completion, when its last CTA ends.
"""

from __future__ import annotations

import itertools
import math

from tvm.script import tirx as T

from search_spaces.lib.cuda_wgmma import (DEPENDENT_LAUNCH_TAG, DTYPES, SHARED_MEMORY_LIMIT, SM_COUNT, TARGET,
                                         batched_check, dependent_launch, pin_registers)

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
BLOCK_M = 128                     # query rows per CTA: two consumer warpgroups of 64
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240  # per thread, setmaxnreg: 128 x 24 + 256 x 240 <= 65536

PREFILL_KNOBS = {"block_n": (64, 128), "stages": (2, 3), "persistent": (0, 1), "overlap": (0, 1)}
PREFILL_DEFAULT_KNOBS = {"block_n": 128, "stages": 3, "persistent": 1, "overlap": 1}
DECODE_KNOBS = {"warps": (4, 8), "keys": (1, 2, 4, 8), "splits": None}  # splits: None or a positive int
DECODE_DEFAULT_KNOBS = {"warps": 8, "keys": 2, "splits": None}
SPLIT_MIN_KEYS = 128     # keys per split (at max_seq) below which a CTA's fixed costs dominate
SPLIT_MAX = 32           # splits per (batch, K/V head)
SPLIT_MAX_CTAS = 4096    # split CTAs in all
# A decode kernel template's knobs: the split count left to its heuristic (a function of the shape)
SPLIT_KV_KNOBS = {name: values for name, values in DECODE_KNOBS.items() if values is not None}
SPLIT_KV_DEFAULT_KNOBS = {name: DECODE_DEFAULT_KNOBS[name] for name in SPLIT_KV_KNOBS}
# appending split kernels may stream their keys through shared memory: ``stages`` slots of a step's
# K and V rows, bulk-copied in and (the append) bulk-copied out; 0 = 16-byte loads to registers
MERGES = ("combine", "cluster", "last")  # who merges a row set's splits (module docstring)
APPEND_KNOBS = {**DECODE_KNOBS, "stages": (0, 2, 4), "merge": MERGES, "evict_first": (0, 1, 2)}
# stages: the fastest of 0/2/4 on an H100 (README); merge None: ``default_merge``
APPEND_DEFAULT_KNOBS = {**DECODE_DEFAULT_KNOBS, "stages": 4, "merge": None, "evict_first": 0}
CLUSTER_MAX = 16         # CTAs of a thread-block cluster (over 8: non-portable, sm_90)
ARRIVAL_SLOTS = 1 << 16  # row sets whose splits merge "last" in one launch: the module's counters
_APPEND_ONLY = ("stages", "merge", "evict_first")
APPEND_SPLIT_KV_KNOBS = {**SPLIT_KV_KNOBS, **{name: APPEND_KNOBS[name] for name in _APPEND_ONLY}}
APPEND_SPLIT_KV_DEFAULT_KNOBS = {**SPLIT_KV_DEFAULT_KNOBS,
                                 **{name: APPEND_DEFAULT_KNOBS[name] for name in _APPEND_ONLY}}
COMBINE_UNROLL = SPLIT_MAX       # splits whose partials the combine kernel loads at once
LAST_LOADS = 2 * SPLIT_MAX       # partials a thread of the last split's merge loads at once
DECODE_MAX_GROUP = 8              # query rows a split CTA keeps (q and O in registers); more: more CTAs
# (batch, K/V head) work items below which a verify prefill leaves most SMs idle: the split kernel
# spreads the cache over more CTAs there
VERIFY_MIN_ITEMS = 16

_SWIZZLE_128B = 3  # CUtensorMapSwizzle and the wgmma descriptor's layout code for 128-byte swizzle
_TMA_LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
_BULK_LOAD = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"  # contiguous bytes, no tensor map
_BULK_STORE = "cp.async.bulk.global.shared::cta.bulk_group"
# without and with an L2 policy (one more operand, createpolicy's)
_BULK_LOADS = {False: _BULK_LOAD, True: _BULK_LOAD + ".L2::cache_hint"}
_BULK_STORES = {False: _BULK_STORE, True: _BULK_STORE + ".L2::cache_hint"}
_EVICT_FIRST = "createpolicy.fractional.L2::evict_first.b64"
_INIT_MAX = -1.0e30  # running max before the first key: finite, so 2^(m - m') never sees inf - inf
# merge "last": a split counts itself in after its partials (release) and learns whether it is the
# row set's last (acquire: the others' partials visible); the last sets the counter back to zero.
# A __device__ array is zero when the module loads; calls on one stream never overlap on it (each
# kernel waits for the one before, griddepcontrol.wait, before it counts); two streams running the
# module's kernel at once would share it (TVM launches on one).
_ARRIVE_SOURCE = f"""
__device__ unsigned int autofuse_split_arrivals[{ARRIVAL_SLOTS}];
__forceinline__ __device__ int autofuse_split_arrive(int row_set, int splits) {{
  unsigned int before;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
               : "=r"(before) : "l"(autofuse_split_arrivals + row_set) : "memory");
  if (before + 1 != (unsigned int)splits) return 0;
  autofuse_split_arrivals[row_set] = 0u;
  return 1;
}}
"""


class AttentionShapeError(ValueError):
    """A shape, dtype or knob these kernels cannot take (the message names the rule)."""


def _mark(func, name: str):
    return (func.with_attr("global_symbol", name).with_attr("autofuse.tirx", True)
            .with_attr("tirx.is_scheduled", True))


def _resolve(knobs: dict | None, space: dict, default: dict) -> dict:
    out = dict(default)
    for name, value in (knobs or {}).items():
        if name not in space:
            raise AttentionShapeError(f"unknown knob {name!r}; knobs are {', '.join(space)}")
        out[name] = value
    for name, value in out.items():
        if space[name] is not None and value not in space[name] and not (value is None and default[name] is None):
            raise AttentionShapeError(f"knob {name}={value!r} is not one of {list(space[name])}")
    return out


def _ints(shape: dict, names) -> list[int]:
    try:
        values = [int(shape[name]) for name in names]
    except (KeyError, TypeError, ValueError):
        raise AttentionShapeError(f"shape needs integers {', '.join(names)}; got {shape!r}") from None
    for name, value in zip(names, values):
        if value <= 0:
            raise AttentionShapeError(f"{name}={value} must be positive")
    return values


def _check_dtype_heads(dtype: str, heads: int, kv_heads: int, head_dim: int) -> None:
    if dtype not in DTYPES:
        raise AttentionShapeError(f"attention kernels take {' or '.join(DTYPES)}, not {dtype}")
    if head_dim not in HEAD_DIMS:
        raise AttentionShapeError(f"head_dim={head_dim} is not one of {list(HEAD_DIMS)}")
    if heads % kv_heads:
        raise AttentionShapeError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")


def _scale(shape: dict, head_dim: int) -> float:
    scale = float(shape.get("scale") or 1.0 / math.sqrt(head_dim))
    if not scale > 0:
        raise AttentionShapeError(f"scale={scale} must be positive")
    return scale


# ---- prefill --------------------------------------------------------------------------------------

PREFILL_SHAPE_KEYS = ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim")


def prefill_shared_memory_bytes(head_dim: int, knobs: dict) -> int:
    """Dynamic shared memory of a prefill CTA: the query tile, the K/V ring, the barriers (plus the
    1 KiB alignment of the swizzled tiles)."""
    itemsize = 2
    return (BLOCK_M * head_dim + 2 * knobs["stages"] * knobs["block_n"] * head_dim) * itemsize \
        + 8 * (2 * knobs["stages"] + 2) + 1024


def check_prefill(shape: dict, dtype: str, knobs: dict | None = None,
                  paged: tuple[int, int, int] | None = None,
                  verify: tuple[int, int] | None = None) -> tuple[dict, dict]:
    """(dims, resolved knobs) when ``prefill_attention`` takes ``shape`` (keys PREFILL_SHAPE_KEYS,
    optional ``causal`` 0/1, ``scale`` and ``mask_rows`` 0/1/seq_q), ``dtype``, ``knobs`` and
    ``paged`` or ``verify``; AttentionShapeError otherwise."""
    knobs = _resolve(knobs, PREFILL_KNOBS, PREFILL_DEFAULT_KNOBS)
    nb, hq, hkv, sq, skv, hd = _ints(shape, PREFILL_SHAPE_KEYS)
    _check_dtype_heads(dtype, hq, hkv, hd)
    causal = int(shape.get("causal", 0) or 0)
    if causal not in (0, 1):
        raise AttentionShapeError(f"causal={causal} must be 0 or 1")
    bn = knobs["block_n"]
    mask_rows = shape.get("mask_rows", 0) or 0
    if mask_rows and skv % 2:
        raise AttentionShapeError(f"seq_kv={skv} is odd: with a mask (mask_rows > 0) the kernel reads the mask "
                                  "two keys (4 bytes) at a time, so its rows must have an even length")
    if causal and sq > skv:
        raise AttentionShapeError(f"causal attention needs seq_q={sq} <= seq_kv={skv} "
                                  "(the mask is aligned at the end: otherwise early queries see no key)")
    if mask_rows not in (0, 1, sq):
        raise AttentionShapeError(f"mask_rows={mask_rows} must be 0 (no mask), 1 or seq_q={sq}")
    if mask_rows and causal:
        raise AttentionShapeError("causal=1 with a mask (mask_rows > 0) is not supported: the mask can "
                                  "carry the causal part")
    if max(nb * hq * sq, nb * hkv * skv) * hd >= 1 << 31 or nb * mask_rows * skv >= 1 << 31:
        raise AttentionShapeError("q, k/v or the mask has 2^31 elements or more (int32 indices)")
    if paged is not None:
        page_size, max_pages, num_pages = paged
        if not causal or mask_rows:
            raise AttentionShapeError("a paged chunk is causal (token t sees the keys up to seq_lens - seq_q + t) "
                                      "and takes no mask")
        if skv != page_size * max_pages:
            raise AttentionShapeError(f"seq_kv={skv} must be the block table's context, page_size x max_pages "
                                      f"= {page_size * max_pages}")
        if page_size % 8 or (bn % page_size and page_size % bn):
            raise AttentionShapeError(f"page_size={page_size}: a key tile is loaded as whole pages of 8-row "
                                      f"swizzle atoms, so the page size must be a multiple of 8 that divides "
                                      f"block_n={bn} or is a multiple of it")
        if num_pages * hkv * page_size * hd >= 1 << 31:
            raise AttentionShapeError("the page pool has 2^31 elements or more (int32 indices)")
    if verify is not None:
        _check_verify(nb, hq, hkv, sq, skv, bn, causal or mask_rows or paged is not None, verify)
    smem = prefill_shared_memory_bytes(hd, knobs)
    if smem > SHARED_MEMORY_LIMIT:
        raise AttentionShapeError(f"{smem} bytes of shared memory (stages={knobs['stages']}, block_n={bn}, "
                                  f"head_dim={hd}) exceed the {SHARED_MEMORY_LIMIT} a CTA may have")
    dims = dict(zip(PREFILL_SHAPE_KEYS, (nb, hq, hkv, sq, skv, hd)), causal=causal, scale=_scale(shape, hd),
                mask_rows=int(mask_rows), paged=paged)
    return dims, knobs


def _check_verify(nb, hq, hkv, sq, skv, bn, other_mode, verify):
    drafts, cache_len = verify
    if other_mode:
        raise AttentionShapeError("a verify prefill is neither causal, masked nor paged: the tree masks its drafts")
    if hq != hkv:
        raise AttentionShapeError("a verify prefill's heads are its K/V heads (a group's rows packed, "
                                  "``verify_prefill_shape``)")
    if drafts < 1 or sq % drafts:
        raise AttentionShapeError(f"seq_q={sq} must be the group's heads x drafts={drafts}")
    if not 0 <= cache_len <= skv:
        raise AttentionShapeError(f"cache_len={cache_len} must be in [0, max_seq={skv}]")
    if drafts > bn:
        raise AttentionShapeError(f"{drafts} drafts do not fit one key tile (block_n={bn})")
    if nb * hkv < VERIFY_MIN_ITEMS:
        raise AttentionShapeError(f"{nb * hkv} (batch, K/V head) work items, fewer than {VERIFY_MIN_ITEMS}: "
                                  "most SMs would idle (cuda_split_kv splits the cache instead)")
    if nb * hkv * drafts < bn or nb * hq * sq < BLOCK_M:
        raise AttentionShapeError(f"the drafts' K/V ({nb * hkv * drafts} rows) or q ({nb * hq * sq} rows) are "
                                  f"shorter than one TMA box (block_n={bn}, {BLOCK_M} query rows)")


def verify_prefill_shape(shape: dict, drafts: int) -> dict:
    """The prefill shape of speculative verification: shape {batch, num_heads, num_kv_heads,
    head_dim, max_seq} with ``drafts`` tokens a query head run as one head per (batch, K/V head)
    whose queries are its group's heads x drafts rows (contiguous in q (batch, heads, drafts,
    head_dim)), over max_seq keys; ``prefill_attention(..., verify=(drafts, cache_len))``."""
    nb, hq, hkv, hd, smax = _ints(shape, DECODE_SHAPE_KEYS)
    return {"batch": nb, "heads": hkv, "kv_heads": hkv, "seq_q": hq // hkv * drafts, "seq_kv": smax,
            "head_dim": hd, **({"scale": shape["scale"]} if "scale" in shape else {})}


def verify_key_tiles(cache_len: int, block_n: int) -> int:
    """Key tiles of the cache a verify prefill visits (its drafts' tile comes after them)."""
    return -(-cache_len // block_n)


def prefill_configs(shape: dict, dtype: str) -> list[dict]:
    """Every knob configuration ``check_prefill`` accepts for ``shape``, in product order."""
    return _configs(PREFILL_KNOBS, lambda knobs: check_prefill(shape, dtype, knobs))


def prefill_paired(knobs: dict, causal) -> bool:
    """Whether persistent CTAs take causal work items in pairs of complementary length (a head's
    longest query tile with its shortest, ...): static shares of single items of unequal length
    leave CTAs idle (B8 H16 S1024: with every 132nd item, one CTA drew 48 key tiles against a mean
    of 35)."""
    return bool(knobs["persistent"] and causal)


def prefill_grid(tiles: int, knobs: dict, causal=False) -> int:
    """CTAs of a prefill launch over ``tiles`` work items: one each, or with ``persistent`` one per
    SM, each looping over every grid-th item (every grid-th pair when paired) so that the next
    item's query tile and first keys load while this one finishes its last tile and stores."""
    if not knobs["persistent"]:
        return tiles
    return min((tiles + 1) // 2 if prefill_paired(knobs, causal) else tiles, SM_COUNT)


def prefill_cta_items(cta, grid: int, tiles: int, paired: bool):
    """Work items CTA ``cta`` (an int or the kernel's expression) takes; the u-th is
    ``prefill_cta_item``. Paired: pairs cta, cta + grid, ...; the last pair of an odd count is one
    item."""
    if not paired:
        return (tiles - 1 - cta) // grid + 1
    return ((tiles + 1) // 2 - 1 - cta) // grid + 1 + (tiles // 2 - 1 - cta) // grid + 1


def prefill_cta_item(cta, u, grid: int, paired: bool):
    """The work item index of CTA ``cta``'s u-th item (``prefill_work_item`` maps it to a tile)."""
    if not paired:
        return cta + u * grid
    return 2 * (cta + u // 2 * grid) + u % 2


def prefill_work_item(t, q_tiles: int, heads: int, causal: bool, paired: bool = False):
    """(query tile, batch x head) of work item t (an int or the kernel's expression) of q_tiles x
    heads: a head's query tiles together, so that they share its K/V in L2 (taking every head's
    longest causal tile first instead made each head's K/V come from memory once per query tile:
    B8 H16 S1024 causal 0.114 -> 0.134 ms on an H100); causal the longest first, or paired
    longest, shortest, second longest, second shortest, ... so that items 2p and 2p + 1 visit
    q_tiles + 1 key tiles (BN = BM) together."""
    pos, head = t % q_tiles, t // q_tiles
    if causal and paired:
        odd = pos % 2
        return odd * (pos // 2) + (1 - odd) * (q_tiles - 1 - pos // 2), head
    if causal:
        return q_tiles - 1 - pos, head
    return pos, head


def _configs(space: dict, accept) -> list[dict]:
    out = []
    names = [n for n, values in space.items() if values is not None]
    for values in itertools.product(*(space[n] for n in names)):
        knobs = dict(zip(names, values))
        try:
            accept(knobs)
        except AttentionShapeError:
            continue
        out.append(knobs)
    return out


def _tensor_map_args(rows: int, cols: int, box_rows: int) -> list[int]:
    """cuTensorMapEncodeTiled's arguments after (map, dtype, rank, pointer) for a row-major (rows,
    cols) 2-byte matrix read in boxes of box_rows x 64 columns (one 128-byte swizzle row)."""
    return [cols, rows, cols * 2, 64, box_rows, 1, 1, 0, _SWIZZLE_128B, 0, 0]


def causal_key_tiles(q_first, offset: int, block_n: int, padded: bool = False, kv_tiles=None):
    """(key tiles to visit, of which unmasked) for the causal query tile starting at row q_first
    (a Python int or the kernel's index expression): tiles wholly above the diagonal are never
    visited; tile j is unmasked when its last key, (j + 1) BN - 1, is visible to the tile's first
    query, i.e. <= q_first + offset. ``padded`` (seq_q or seq_kv no multiple of its tile): every
    tile holding a key visible to the tile's last row, q_first + BM - 1, up to ``kv_tiles``; equal
    to the unpadded count when the tiles divide both lengths."""
    unmasked = (q_first + offset) // block_n
    if not padded:
        return (q_first + BLOCK_M + offset) // block_n, unmasked
    visit = (q_first + BLOCK_M - 1 + offset) // block_n + 1
    return (min(visit, kv_tiles) if isinstance(visit, int) else T.min(visit, kv_tiles)), unmasked


def paged_key_row(block_table, b, kv_head, key, page_size: int, max_pages: int, kv_heads: int):
    """Row of the page pool viewed as (num_pages x kv_heads x page_size, head_dim) holding key
    position ``key`` of sequence b's K/V head kv_head (Python ints and a numpy block table, or the
    kernel's expressions and buffer). A key past the table's last entry reads that entry's page:
    such keys are past seq_lens[b], masked."""
    entry = key // page_size
    entry = min(entry, max_pages - 1) if isinstance(entry, int) else T.min(entry, max_pages - 1)
    return (block_table[b, entry] * kv_heads + kv_head) * page_size + key % page_size


# The steps of one key tile in a consumer warpgroup. Register layout of an m64nN float32
# accumulator (wgmma): thread t of the warpgroup holds, in acc[4c .. 4c+3], the elements
# (r, 8c + q), (r, 8c + q + 1), (r + 8, 8c + q), (r + 8, 8c + q + 1) with r = 16 (t / 32) + (t % 32) / 4
# and q = 2 (t % 4). Index i of such an accumulator is thus in row half (i % 4) / 2 (0: r, 1: r + 8).

@T.macro
def _issue_scores(s, n_s, q_smem, k_smem, slot, wg, head_dim, mma, desc_a, desc_b):
    """Issue S = Q K^T for this warpgroup's 64 rows and the BN keys in ring slot ``slot`` as one
    wgmma group (not waited for)."""
    for i in T.unroll(n_s):
        s[i] = T.float32(0)
    T.ptx.wgmma.fence.sync.aligned()
    for kk in T.unroll(head_dim // 16):
        # K-major, 128-byte swizzle: leading offset 1, stride 64 (8 rows of 128 B), in 16 B units;
        # column box kk // 4, 16 columns further per k step
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a), q_smem.ptr_to([kk // 4, wg * 64, kk % 4 * 16]),
                                              1, 64, _SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), k_smem.ptr_to([slot, kk // 4, 0, kk % 4 * 16]),
                                              1, 64, _SWIZZLE_128B)
        T.ptx[mma](*[s[i] for i in range(n_s)], desc_a, desc_b, True, 1, 1, 0, 0)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro
def _mask_keys_from(s, n_s, first_key, seq_kv, lane, hidden):
    """Padded last key tile: keys seq_kv and on (the next head's rows, or TMA's zero fill past the
    tensor) are hidden from every query, their scores set to ``hidden``: the float32 minimum, or
    with a mask -inf after it is added (with the minimum a row whose keys are all -inf would
    average the padding)."""
    for i in T.unroll(n_s):
        key = T.meta_var(first_key + i // 4 * 8 + lane % 4 * 2 + i % 2)
        s[i] = T.if_then_else(key < seq_kv, s[i], hidden)


@T.macro
def _mask_above_diagonal(s, n_s, first_key, first_row, offset, lane):
    """Causal mask of a tile crossing the diagonal: key first_key + col is hidden from query
    first_row + row when it lies past first_row + row + offset."""
    for i in T.unroll(n_s):
        row = T.meta_var(first_row + lane // 32 * 16 + lane % 32 // 4 + i % 4 // 2 * 8)
        key = T.meta_var(first_key + i // 4 * 8 + lane % 4 * 2 + i % 2)
        s[i] = T.if_then_else(key <= row + offset, s[i], T.min_value("float32"))


@T.macro
def _mask_draft_keys(s, n_s, tree, first_row, lane, drafts):
    """Verify's drafts' key tile: draft key k is seen by the item's query row r (a group head x drafts
    + its draft) when tree[r % drafts, k] != 0; keys from ``drafts`` on (the next item's drafts, or
    TMA's zero fill) are hidden from every row."""
    for i in T.unroll(n_s):
        row = T.meta_var(first_row + lane // 32 * 16 + lane % 32 // 4 + i % 4 // 2 * 8)
        key = T.meta_var(i // 4 * 8 + lane % 4 * 2 + i % 2)
        s[i] = T.if_then_else(T.And(key < drafts, tree[row % drafts, T.min(key, drafts - 1)] != 0), s[i],
                              T.min_value("float32"))


def mask_word_index(batch, first_row, first_key, lane, mask_rows: int, seq_kv: int, last_row=None):
    """Index of the 4-byte word of the (batch, 1, mask_rows, seq_kv) mask that holds this thread's
    keys first_key + 2 (lane % 4), +1 of its first row (first_row + 16 (lane / 32) + (lane % 32) / 4
    of the warpgroup's tile; row 0 when the mask has one row); its next 8-key group is 4 words on,
    its row + 8 4 seq_kv words on (ints or the kernel's expressions). ``last_row`` (a padded query
    tile): rows past it read its words (they are not stored)."""
    row = 0 if mask_rows == 1 else first_row + lane // 32 * 16 + lane % 32 // 4
    if last_row is not None and mask_rows > 1:
        row = min(row, last_row) if isinstance(row, int) else T.min(row, last_row)
    return (batch * mask_rows + row) * (seq_kv // 2) + first_key // 2 + lane % 4


@T.macro
def _add_mask(s, n_s, mask_words, mask_pair, mask_word, word, at, second_row, scale):
    """S = S scale + mask, in float32, the additive mask read straight from global memory (small,
    and L2-resident across heads and query tiles): per 8-key group j one 4-byte load of the
    thread's two adjacent keys for row r, word ``word(at, j, False)``, and for row r + 8 another,
    ``word(at, j, True)``, where the mask has a row per query (``second_row``; else both rows add the
    same pair). Not scaled by log2(e) here: a bfloat16 finfo.min times log2(e) overflows float32,
    which would turn a row of finfo.min keys (the reference's uniform softmax) into one of -inf
    keys (0)."""
    for j in T.unroll(n_s // 4):
        mask_word[0] = mask_words[word(at, j, False)]
        for e in T.unroll(2):
            s[j * 4 + e] = s[j * 4 + e] * T.float32(scale) + T.Cast("float32", mask_pair[e])
        if second_row:
            mask_word[0] = mask_words[word(at, j, True)]
        for e in T.unroll(2):
            s[j * 4 + 2 + e] = s[j * 4 + 2 + e] * T.float32(scale) + T.Cast("float32", mask_pair[e])


@T.macro
def _softmax_tile(s, n_s, m, l, m_new, alpha, tile_sum, c, masked):
    """Running max and sum of this thread's two rows over one more tile: S becomes P = 2^(S c - m')
    in float32 and alpha = 2^(m - m') the factor for O (``_rescale_cast``). Touches neither O nor
    the P registers, so it may run while the previous tile's P V is in flight.

    ``masked``: S is already scaled with the mask added (``_add_mask``), in the natural-log
    domain, and so are m and m'; P = 2^((S - m') log2(e)), alpha = 2^((m - m') log2(e)). m is
    finite (the float32 minimum or more), so a -inf score gives P = 0 and a tile that leaves m
    unchanged alpha = 1, never inf - inf."""
    for r in T.unroll(2):
        m_new[r] = m[r]
    for j in T.unroll(n_s // 4):
        if masked:
            m_new[0] = T.max(m_new[0], T.max(s[j * 4], s[j * 4 + 1]))
            m_new[1] = T.max(m_new[1], T.max(s[j * 4 + 2], s[j * 4 + 3]))
        else:
            m_new[0] = T.max(m_new[0], T.max(s[j * 4], s[j * 4 + 1]) * T.float32(c))
            m_new[1] = T.max(m_new[1], T.max(s[j * 4 + 2], s[j * 4 + 3]) * T.float32(c))
    for r in T.unroll(2):
        m_new[r] = T.cuda.warp_reduce(m_new[r], "max", 4)  # the quad shares the row
        if masked:
            alpha[r] = T.exp2((m[r] - m_new[r]) * T.float32(LOG2E))
        else:
            alpha[r] = T.exp2(m[r] - m_new[r])
        m[r] = m_new[r]
        tile_sum[r] = T.float32(0)
    for i in T.unroll(n_s):
        if masked:
            s[i] = T.exp2((s[i] - m[i % 4 // 2]) * T.float32(LOG2E))
        else:
            s[i] = T.exp2(s[i] * T.float32(c) - m[i % 4 // 2])
        tile_sum[i % 4 // 2] = tile_sum[i % 4 // 2] + s[i]
    for r in T.unroll(2):
        l[r] = l[r] * alpha[r] + tile_sum[r]  # a partial sum over this thread's columns; quad-summed at the end


@T.macro
def _rescale_cast(s, p, n_s, o, n_o, alpha, dtype):
    """O *= alpha and P in the dtype for the P V product (after the previous P V completed)."""
    for i in T.unroll(n_o):
        o[i] = o[i] * alpha[i % 4 // 2]
    for i in T.unroll(n_s):
        p[i] = T.Cast(dtype, s[i])


@T.macro
def _issue_pv(o, n_o, p_regs, v_smem, slot, block_n, mma, v_box_units, desc_b):
    """Issue O += P V as one wgmma group (not waited for), P (this warpgroup's 64 x BN
    probabilities) as the register A operand and the BN x head_dim V tile of ring slot ``slot`` read
    MN-major (head_dim contiguous): the descriptor starts at row 16 kk of the first 64-column box,
    the leading offset is one box."""
    T.ptx.wgmma.fence.sync.aligned()
    for kk in T.unroll(block_n // 16):
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), v_smem.ptr_to([slot, 0, kk * 16, 0]),
                                              v_box_units, 64, _SWIZZLE_128B)
        T.ptx[mma](*[o[i] for i in range(n_o)], p_regs[kk * 4], p_regs[kk * 4 + 1], p_regs[kk * 4 + 2],
                   p_regs[kk * 4 + 3], desc_b, True, 1, 1, 1)
    T.ptx.wgmma.commit_group.sync.aligned()


def prefill_attention(shape: dict, dtype: str = "float16", knobs: dict | None = None,
                      paged: tuple[int, int, int] | None = None, verify: tuple[int, int] | None = None):
    """The tirx PrimFunc ``(q, k, v, out)`` of the prefill forward (module docstring) for ``shape``
    {batch, heads, kv_heads, seq_q, seq_kv, head_dim, causal (0), scale (1/sqrt(head_dim)),
    mask_rows (0)}; global symbol ``attention_prefill``. With ``mask_rows`` 1 or seq_q it is
    ``(q, k, v, mask, out)``, the additive mask (batch, 1, mask_rows, seq_kv) in the dtype, global
    symbol ``attention_prefill_masked``. With ``paged`` (page_size, max_pages, num_pages) it is
    paged_attention's chunked prefill ``(q, k_pages, v_pages, block_table, seq_lens, out)``, global
    symbol ``attention_prefill_paged`` (module docstring). With ``verify`` (drafts, cache_len) and a
    ``verify_prefill_shape`` it is spec_verify_attention's ``(q, k_cache, v_cache, k_new, v_new,
    tree, out)``, global symbol ``attention_prefill_verify`` (module docstring). AttentionShapeError
    when shape, dtype or knobs do not fit."""
    dims, knobs = check_prefill(shape, dtype, knobs, paged, verify)
    nb, hq, hkv, sq, skv, hd = (dims[key] for key in PREFILL_SHAPE_KEYS)
    causal = bool(dims["causal"])
    mask_rows = dims["mask_rows"]
    masked = mask_rows > 0
    bm, bn, stages = BLOCK_M, knobs["block_n"], knobs["stages"]
    overlap = bool(knobs["overlap"])
    group = hq // hkv
    offset = skv - sq                  # causal: query i sees keys <= i + offset
    boxes = hd // 64                   # 64-column TMA boxes per row
    n_s, n_o = bn // 2, hd // 2        # accumulator registers per thread: S, O
    # Padded tiles (seq_q or seq_kv no multiple of its tile): a tile's TMA copy runs on into the
    # next head's rows (or zeros past the tensor's end); those keys are masked, those query rows
    # computed and not stored. Python bools, so the divisible shapes' kernels are unchanged.
    is_verify = verify is not None
    drafts, cache_len = verify or (0, 0)
    n_cache = verify_key_tiles(cache_len, bn)
    tail = cache_len % bn  # verify: the last cache tile's rows from here on are past the cache
    pad_q, pad_kv = sq % bm != 0, skv % bn != 0 and not is_verify
    padded = pad_q or pad_kv
    q_tiles, kv_tiles = -(-sq // bm), -(-skv // bn)
    c = dims["scale"] * LOG2E
    op = DTYPES[dtype]
    mma_s = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{op}.{op}"
    mma_o = f"wgmma.mma_async.sync.aligned.m64n{hd}k16.f32.{op}.{op}"
    q_rows, kv_rows = nb * hq * sq, nb * hkv * skv
    tma_q = _tensor_map_args(q_rows, hd, bm)
    tma_kv = _tensor_map_args(kv_rows, hd, bn)
    is_paged = paged is not None
    if is_paged:
        # q and out (batch, seq_q, heads, head_dim): a head's query tile is a column box of the
        # (batch x seq_q, heads x head_dim) matrix; a key tile is bn / box_kv boxes of page rows
        page_size, max_pages, num_pages = paged
        box_kv = min(page_size, bn)
        tma_q = _tensor_map_args(nb * sq, hq * hd, bm)
        tma_kv = _tensor_map_args(num_pages * hkv * page_size, hd, box_kv)
        padded = True  # the sequence's length is a run-time value
    if is_verify:
        tma_kd = _tensor_map_args(nb * hkv * drafts, hd, bn)
    kv_tile_bytes = 2 * bn * hd * 2
    v_box_units = bn * 64 * 2 // 16    # one 64-column box of the V tile, in 16-byte units
    tiles = q_tiles * nb * hq          # (query tile, batch x head) work items
    paired = prefill_paired(knobs, causal)
    grid = prefill_grid(tiles, knobs, causal)

    def work_item(cta, it):
        """(query tile, batch x head) of this CTA's it-th work item."""
        return prefill_work_item(prefill_cta_item(cta, it, grid, paired), q_tiles, nb * hq, causal, paired)

    def mask_word_at(at, g, row8):
        """The mask word of key tile j's 8-key group g for this thread's row r (or r + 8), ``at`` =
        (batch x head, the warpgroup's first row, j, lane): padded, rows clamped to the last query
        and every word to the mask's last (``mask_word_index``)."""
        head, first_row, j, lane = at
        if padded:
            word = mask_word_index(head // hq, first_row + 8 * row8, j * bn, lane, mask_rows, skv, sq - 1)
            return T.min(word + g * 4, nb * mask_rows * skv // 2 - 1)
        word = mask_word_index(head // hq, first_row, j * bn, lane, mask_rows, skv) + g * 4
        return word + 4 * skv if row8 else word

    def item_keys(q_first, length):
        """(key tiles visited, of which unmasked (causal), the causal offset) of a work item whose
        query tile starts at row q_first; paged, ``length`` holds its sequence's seq_lens entry;
        verify: the cache's tiles, then the drafts'."""
        if is_verify:
            return n_cache + 1, 0, 0
        key_offset = offset if length is None else length[0] - sq
        n_kv = kv_tiles if length is None else (length[0] + bn - 1) // bn
        visit = causal_key_tiles(q_first, key_offset, bn, padded, n_kv)[0] if causal else kv_tiles
        return visit, causal_key_tiles(q_first, key_offset, bn)[1], key_offset

    @T.macro
    def key_tile_softmax(s, m, l, m_new, alpha, tile_sum, j, n_tiles, n_unmasked, key_offset, first_row, head, lane,
                         q_empty, M_words, mask_pair, mask_word, TR):
        """After key tile j's scores landed: release the query tile after the item's last one, mask,
        and the online softmax's update (``_softmax_tile``)."""
        if j == n_tiles - 1:
            if lane == 0:  # the query tile is read: the producer may load the next item's
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(q_empty[0]))
        if causal:
            if j >= n_unmasked:
                _mask_above_diagonal(s, n_s, j * bn, first_row, key_offset, lane)
        elif is_verify:
            if tail > 0:
                if j == n_cache - 1:
                    _mask_keys_from(s, n_s, j * bn, cache_len, lane, T.min_value("float32"))
            if j == n_cache:
                _mask_draft_keys(s, n_s, TR, first_row, lane, drafts)
        elif pad_kv and not masked:
            if j == n_tiles - 1:
                _mask_keys_from(s, n_s, j * bn, skv, lane, T.min_value("float32"))
        if masked:
            _add_mask(s, n_s, M_words, mask_pair, mask_word, mask_word_at, (head, first_row, j, lane), mask_rows > 1,
                      dims["scale"])
            if pad_kv:
                if j == n_tiles - 1:
                    _mask_keys_from(s, n_s, j * bn, skv, lane, T.float32(-math.inf))
        _softmax_tile(s, n_s, m, l, m_new, alpha, tile_sum, c, masked)

    @T.macro
    def load_key_tile(Ks, Vs, st, k_map, v_map, row, full):
        """TMA copies of the K and V rows row .. row + BN into ring slot st, completing on its barrier."""
        for h in T.unroll(boxes):
            T.ptx[_TMA_LOAD](Ks.ptr_to([st, h, 0, 0]), T.address_of(k_map), h * 64, row, T.address_of(full[st]))
            T.ptx[_TMA_LOAD](Vs.ptr_to([st, h, 0, 0]), T.address_of(v_map), h * 64, row, T.address_of(full[st]))

    @T.macro
    def zero_cache_tail(Vs, slot, j, wg, lane):
        """Verify: the last cache tile's V rows past cache_len (rows of the cache nobody wrote, maybe
        NaN, which P = 0 would not cancel) set to 0 in the landed slot, before its P V; each consumer
        warpgroup zeroes them all for itself (the other's stores write the same zeros)."""
        if is_verify and tail > 0:
            if j == n_cache - 1:
                for t in T.serial(-(-(bn - tail) * boxes * 64 // 128)):
                    if t * 128 + lane < (bn - tail) * boxes * 64:
                        Vs[slot, (t * 128 + lane) // 64 % boxes, tail + (t * 128 + lane) // (64 * boxes),
                           (t * 128 + lane) % 64] = T.Cast(dtype, 0)
                T.ptx.fence.proxy.async_.shared__cta()  # to wgmma's async proxy
                T.cuda.warpgroup_sync(1 + wg)

    # One body for every signature, spliced into each.
    @T.macro
    def body(Q, K, V, Mk, BT, SL, O, KD, VD, TR):
        Q_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", Q_map, dtype, 2, Q.data, *tma_q)
        K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", K_map, dtype, 2, K.data, *tma_kv)
        V_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", V_map, dtype, 2, V.data, *tma_kv)
        if is_verify:
            KD_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", KD_map, dtype, 2, KD.data, *tma_kd)
            VD_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", VD_map, dtype, 2, VD.data, *tma_kd)
        T.device_entry()
        cta = T.cta_id([grid])
        tx = T.thread_id([384])  # warpgroup 0: TMA producer (one thread); 1 and 2: consumers
        pool = T.SMEMPool()
        Qs = pool.alloc((boxes, bm, 64), dtype, align=1024)
        Ks = pool.alloc((stages, boxes, bn, 64), dtype, align=1024)
        Vs = pool.alloc((stages, boxes, bn, 64), dtype, align=1024)
        full = pool.alloc((stages,), "uint64", align=8)
        empty = pool.alloc((stages,), "uint64", align=8)
        q_full = pool.alloc((1,), "uint64", align=8)
        q_empty = pool.alloc((1,), "uint64", align=8)
        pool.commit()
        desc_a: T.uint64
        desc_b: T.uint64
        s = T.alloc_buffer((n_s,), "float32", scope="local")
        o = T.alloc_buffer((n_o,), "float32", scope="local")
        p = T.alloc_buffer((n_s,), dtype, scope="local")
        p_regs = T.decl_buffer((n_s // 2,), "uint32", data=p.data, scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        l = T.alloc_buffer((2,), "float32", scope="local")
        m_new = T.alloc_buffer((2,), "float32", scope="local")
        alpha = T.alloc_buffer((2,), "float32", scope="local")
        tile_sum = T.alloc_buffer((2,), "float32", scope="local")
        ring = T.alloc_buffer((1,), "int32", scope="local")  # key tiles through the ring before this work item
        out_pair = T.alloc_buffer((2,), dtype, scope="local")
        out_word = T.decl_buffer((1,), "uint32", data=out_pair.data, scope="local")
        if is_paged:
            O_words = T.decl_buffer((nb * sq, hq, hd // 2), "uint32", data=O.data)
        else:
            O_words = T.decl_buffer((q_rows, hd // 2), "uint32", data=O.data)
        if masked:
            # the mask as 4-byte words: a thread's two adjacent keys of a row in one load
            M_words = T.decl_buffer((nb * mask_rows * skv // 2,), "uint32", data=Mk.data)
            mask_pair = T.alloc_buffer((2,), dtype, scope="local")
            mask_word = T.decl_buffer((1,), "uint32", data=mask_pair.data, scope="local")
        else:
            M_words = T.meta_var(None)
            mask_pair = T.meta_var(None)
            mask_word = T.meta_var(None)
        if is_paged:
            length = T.alloc_buffer((1,), "int32", scope="local")    # the work item's seq_lens entry
            page_row = T.alloc_buffer((1,), "int32", scope="local")  # a key box's row in the page pool
        else:
            length = T.meta_var(None)
        # This CTA's work items: cta, cta + grid, ... (one each unless persistent), or pairs of them
        items = T.meta_var(prefill_cta_items(cta, grid, tiles, paired))
        wg = T.meta_var(tx // 128 - 1)
        if tx == 0:
            for st in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(T.address_of(full[st]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(empty[st]), T.uint32(2))
            T.ptx.mbarrier.init.shared.b64(T.address_of(q_full[0]), T.uint32(1))
            T.ptx.mbarrier.init.shared.b64(T.address_of(q_empty[0]), T.uint32(2))
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        ring[0] = 0
        if tx < 128:
            # the producer's registers to the consumers (S, P, O, the mask's words and, with
            # overlap, all of them live at once; at the 168 a thread of 384 gets they spill)
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGISTERS)
            if tx == 0:
                for it in T.serial(items):
                    q_tile = T.meta_var(work_item(cta, it)[0])
                    head = T.meta_var(work_item(cta, it)[1])
                    q_first = T.meta_var(q_tile * bm)
                    kv_row0 = T.meta_var(head // group * skv)  # (b * heads + h) // group = b * kv_heads + h // group
                    if is_paged:
                        length[0] = SL[head // hq]
                    n_tiles = T.meta_var(item_keys(q_first, length)[0])
                    if it > 0:  # both consumers issued their last Q K^T of the previous item
                        T.cuda.mbarrier_wait(T.address_of(q_empty[0]), (it - 1) % 2)
                    for h in T.unroll(boxes):
                        if is_paged:
                            T.ptx[_TMA_LOAD](Qs.ptr_to([h, 0, 0]), T.address_of(Q_map), head % hq * hd + h * 64,
                                             head // hq * sq + q_first, T.address_of(q_full[0]))
                        else:
                            T.ptx[_TMA_LOAD](Qs.ptr_to([h, 0, 0]), T.address_of(Q_map), h * 64, head * sq + q_first,
                                             T.address_of(q_full[0]))
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(q_full[0]), T.uint32(bm * hd * 2))
                    for j in T.serial(n_tiles):
                        g = T.meta_var(ring[0] + j)
                        st = T.meta_var(g % stages)
                        if g >= stages:  # wait until both consumers released the slot's previous tile
                            T.cuda.mbarrier_wait(T.address_of(empty[st]), (g // stages + 1) % 2)
                        if is_verify:
                            if j < n_cache:
                                load_key_tile(Ks, Vs, st, K_map, V_map, kv_row0 + j * bn, full)
                            else:  # the drafts' own keys: one box from the item's first draft row
                                load_key_tile(Ks, Vs, st, KD_map, VD_map, head * drafts, full)
                        elif is_paged:
                            for e in T.unroll(bn // box_kv):
                                page_row[0] = paged_key_row(BT, head // hq, head % hq // group, j * bn + e * box_kv,
                                                            page_size, max_pages, hkv)
                                for h in T.unroll(boxes):
                                    T.ptx[_TMA_LOAD](Ks.ptr_to([st, h, e * box_kv, 0]), T.address_of(K_map), h * 64,
                                                     page_row[0], T.address_of(full[st]))
                                    T.ptx[_TMA_LOAD](Vs.ptr_to([st, h, e * box_kv, 0]), T.address_of(V_map), h * 64,
                                                     page_row[0], T.address_of(full[st]))
                        else:
                            load_key_tile(Ks, Vs, st, K_map, V_map, kv_row0 + j * bn, full)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(full[st]), T.uint32(kv_tile_bytes))
                    ring[0] = ring[0] + n_tiles
        else:
            lane = T.meta_var(tx % 128)
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGISTERS)
            for it in T.serial(items):
                q_tile = T.meta_var(work_item(cta, it)[0])
                head = T.meta_var(work_item(cta, it)[1])
                q_first = T.meta_var(q_tile * bm)
                # out's row of the tile's first query: (batch x head, seq_q) rows, paged (batch, seq_q)
                q_row0 = T.meta_var(head // hq * sq + q_first if is_paged else head * sq + q_first)
                if is_paged:
                    length[0] = SL[head // hq]
                # Key tiles this item visits; the last BM / BN of them (causal) cross the diagonal.
                n_tiles = T.meta_var(item_keys(q_first, length)[0])
                n_unmasked = T.meta_var(item_keys(q_first, length)[1])
                key_offset = T.meta_var(item_keys(q_first, length)[2])
                for i in T.unroll(n_o):
                    o[i] = T.float32(0)
                for r in T.unroll(2):
                    if masked:
                        # the float32 minimum: no finite score with its mask is below it (a bfloat16
                        # finfo.min is about -3.39e38), and m stays finite through rows of -inf keys
                        m[r] = T.min_value("float32")
                    else:
                        m[r] = T.float32(_INIT_MAX)
                    l[r] = T.float32(0)
                T.cuda.mbarrier_wait(T.address_of(q_full[0]), it % 2)
                if overlap:
                    # Tile j's Q K^T is issued before tile j - 1's P V, which then runs on the
                    # tensor cores while tile j's softmax does (FlashAttention-3's intra-warpgroup
                    # pipelining). The first tile is peeled, so no wgmma is issued under a branch.
                    T.cuda.mbarrier_wait(T.address_of(full[ring[0] % stages]), ring[0] // stages % 2)
                    zero_cache_tail(Vs, ring[0] % stages, 0, wg, lane)
                    _issue_scores(s, n_s, Qs, Ks, ring[0] % stages, wg, hd, mma_s, desc_a, desc_b)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pin_registers(s, n_s, "float32")
                    key_tile_softmax(s, m, l, m_new, alpha, tile_sum, 0, n_tiles, n_unmasked, key_offset, q_first + wg * 64,
                                     head, lane, q_empty, M_words, mask_pair, mask_word, TR)
                    _rescale_cast(s, p, n_s, o, n_o, alpha, dtype)
                    for j1 in T.serial(n_tiles - 1):
                        g = T.meta_var(ring[0] + j1 + 1)
                        T.cuda.mbarrier_wait(T.address_of(full[g % stages]), g // stages % 2)
                        zero_cache_tail(Vs, g % stages, j1 + 1, wg, lane)
                        _issue_scores(s, n_s, Qs, Ks, g % stages, wg, hd, mma_s, desc_a, desc_b)
                        _issue_pv(o, n_o, p_regs, Vs, (g - 1) % stages, bn, mma_o, v_box_units, desc_b)
                        T.ptx.wgmma.wait_group.sync.aligned(1)
                        pin_registers(s, n_s, "float32")
                        key_tile_softmax(s, m, l, m_new, alpha, tile_sum, j1 + 1, n_tiles, n_unmasked, key_offset,
                                         q_first + wg * 64, head, lane, q_empty, M_words, mask_pair, mask_word, TR)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        pin_registers(o, n_o, "float32")
                        pin_registers(p_regs, n_s // 2, "uint32")
                        if lane == 0:
                            T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(g - 1) % stages]))
                        _rescale_cast(s, p, n_s, o, n_o, alpha, dtype)
                    last = T.meta_var((ring[0] + n_tiles - 1) % stages)
                    _issue_pv(o, n_o, p_regs, Vs, last, bn, mma_o, v_box_units, desc_b)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pin_registers(o, n_o, "float32")
                    if lane == 0:
                        T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[last]))
                else:
                    for j in T.serial(n_tiles):
                        g = T.meta_var(ring[0] + j)
                        st = T.meta_var(g % stages)
                        T.cuda.mbarrier_wait(T.address_of(full[st]), g // stages % 2)
                        zero_cache_tail(Vs, st, j, wg, lane)
                        _issue_scores(s, n_s, Qs, Ks, st, wg, hd, mma_s, desc_a, desc_b)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        key_tile_softmax(s, m, l, m_new, alpha, tile_sum, j, n_tiles, n_unmasked, key_offset,
                                         q_first + wg * 64, head, lane, q_empty, M_words, mask_pair, mask_word, TR)
                        _rescale_cast(s, p, n_s, o, n_o, alpha, dtype)
                        _issue_pv(o, n_o, p_regs, Vs, st, bn, mma_o, v_box_units, desc_b)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        if lane == 0:
                            T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[st]))
                ring[0] = ring[0] + n_tiles
                for r in T.unroll(2):
                    if masked:
                        # a row of -inf keys only has l = 0 (and O = 0): it stores 0, as the exports'
                        # IsNaN/Where guard makes of the softmax's NaN
                        m_new[r] = T.cuda.warp_reduce(l[r], "sum", 4)
                        l[r] = T.if_then_else(m_new[r] > T.float32(0), T.float32(1) / m_new[r], T.float32(0))
                    else:
                        l[r] = T.float32(1) / T.cuda.warp_reduce(l[r], "sum", 4)
                for i in T.unroll(n_o // 2):
                    # pair i: columns 8 (i // 2) + q, +1 of row half i % 2
                    row = T.meta_var(q_row0 + wg * 64 + lane // 32 * 16 + lane % 32 // 4 + i % 2 * 8)
                    out_pair[0] = T.Cast(dtype, o[i * 2] * l[i % 2])
                    out_pair[1] = T.Cast(dtype, o[i * 2 + 1] * l[i % 2])
                    if pad_q:  # rows past seq_q belong to the next head (paged: sequence)
                        if q_first + wg * 64 + lane // 32 * 16 + lane % 32 // 4 + i % 2 * 8 < sq:
                            if is_paged:
                                O_words[row, head % hq, i // 2 * 4 + lane % 4] = out_word[0]
                            else:
                                O_words[row, i // 2 * 4 + lane % 4] = out_word[0]
                    elif is_paged:
                        O_words[row, head % hq, i // 2 * 4 + lane % 4] = out_word[0]
                    else:
                        O_words[row, i // 2 * 4 + lane % 4] = out_word[0]

    # a prim_func is parsed where it is defined: only the variant asked for
    if masked:
        @T.prim_func
        def attention_masked(q: T.handle, k: T.handle, v: T.handle, mask: T.handle, out: T.handle):
            Q = T.match_buffer(q, (nb, hq, sq, hd), dtype, align=16)
            K = T.match_buffer(k, (nb, hkv, skv, hd), dtype, align=16)
            V = T.match_buffer(v, (nb, hkv, skv, hd), dtype, align=16)
            Mk = T.match_buffer(mask, (nb, 1, mask_rows, skv), dtype, align=16)
            O = T.match_buffer(out, (nb, hq, sq, hd), dtype, align=16)
            body(Q, K, V, Mk, None, None, O, None, None, None)

        return _mark(attention_masked, "attention_prefill_masked")

    if is_paged:
        @T.prim_func
        def attention_paged(q: T.handle, k_pages: T.handle, v_pages: T.handle, block_table: T.handle,
                            seq_lens: T.handle, out: T.handle):
            Q = T.match_buffer(q, (nb, sq, hq, hd), dtype, align=16)
            K = T.match_buffer(k_pages, (num_pages, hkv, page_size, hd), dtype, align=16)
            V = T.match_buffer(v_pages, (num_pages, hkv, page_size, hd), dtype, align=16)
            BT = T.match_buffer(block_table, (nb, max_pages), "int32")
            SL = T.match_buffer(seq_lens, (nb,), "int32")
            O = T.match_buffer(out, (nb, sq, hq, hd), dtype, align=16)
            body(Q, K, V, None, BT, SL, O, None, None, None)

        return _mark(attention_paged, "attention_prefill_paged")

    if is_verify:
        heads = sq // drafts * hkv  # the query heads: a K/V head's group x drafts rows are one item's queries

        @T.prim_func
        def attention_verify(q: T.handle, k_cache: T.handle, v_cache: T.handle, k_new: T.handle, v_new: T.handle,
                             tree: T.handle, out: T.handle):
            Q = T.match_buffer(q, (nb, heads, drafts, hd), dtype, align=16)
            K = T.match_buffer(k_cache, (nb, hkv, skv, hd), dtype, align=16)
            V = T.match_buffer(v_cache, (nb, hkv, skv, hd), dtype, align=16)
            KD = T.match_buffer(k_new, (nb, hkv, drafts, hd), dtype, align=16)
            VD = T.match_buffer(v_new, (nb, hkv, drafts, hd), dtype, align=16)
            TR = T.match_buffer(tree, (drafts, drafts), "int32")
            O = T.match_buffer(out, (nb, heads, drafts, hd), dtype, align=16)
            body(Q, K, V, None, None, None, O, KD, VD, TR)

        return _mark(attention_verify, "attention_prefill_verify")

    @T.prim_func
    def attention(q: T.handle, k: T.handle, v: T.handle, out: T.handle):
        Q = T.match_buffer(q, (nb, hq, sq, hd), dtype, align=16)
        K = T.match_buffer(k, (nb, hkv, skv, hd), dtype, align=16)
        V = T.match_buffer(v, (nb, hkv, skv, hd), dtype, align=16)
        O = T.match_buffer(out, (nb, hq, sq, hd), dtype, align=16)
        body(Q, K, V, None, None, None, O, None, None, None)

    return _mark(attention, "attention_prefill")


def prefill_flops(shape: dict) -> float:
    """Multiply-adds x 2 of both products, halved for causal (the convention of FlashAttention's
    TFLOP/s figures)."""
    nb, hq, _, sq, skv, hd = _ints(shape, PREFILL_SHAPE_KEYS)
    full = 4.0 * nb * hq * sq * skv * hd
    return full / 2 if int(shape.get("causal", 0) or 0) else full


# ---- rotary scores -------------------------------------------------------------------------------

ROPE_SHAPE_KEYS = ("batch", "heads", "seq_q", "seq_k", "head_dim")
ROPE_KNOBS = {"block_n": (64, 128, 256)}
ROPE_DEFAULT_KNOBS = {"block_n": 128}
_ROPE_THREADS = 256  # two warpgroups of 64 query rows


def _rope_dims(shape: dict, dtype: str) -> list[int]:
    """rope_qk's (batch, heads, seq_q, seq_k, head_dim) when both its kernels could take them."""
    nb, hq, sq, sk, hd = _ints(shape, ROPE_SHAPE_KEYS)
    _check_dtype_heads(dtype, hq, hq, hd)
    if sq > sk:
        raise AttentionShapeError(f"seq_q={sq} must be <= seq_k={sk}: queries are the last seq_q positions")
    if nb * hq * max(sq, sk) * max(hd, sk) >= 1 << 31:
        raise AttentionShapeError("q, k or the scores have 2^31 elements or more (int32 indices)")
    return [nb, hq, sq, sk, hd]


def check_rope_scores(shape: dict, dtype: str, knobs: dict | None = None) -> tuple[dict, dict]:
    """(dims, resolved knobs) when ``rope_scores`` takes ``shape`` (keys ROPE_SHAPE_KEYS), ``dtype``
    and ``knobs``; AttentionShapeError otherwise."""
    knobs = _resolve(knobs, ROPE_KNOBS, ROPE_DEFAULT_KNOBS)
    nb, hq, sq, sk, hd = _rope_dims(shape, dtype)
    if sk % 2:
        raise AttentionShapeError(f"seq_k={sk} is odd: scores are stored two keys (4 bytes) at a time")
    smem = (BLOCK_M + knobs["block_n"]) * hd * 2 + 8 + 1024
    if smem > SHARED_MEMORY_LIMIT:
        raise AttentionShapeError(f"{smem} bytes of shared memory exceed the {SHARED_MEMORY_LIMIT} a CTA may have")
    return dict(zip(ROPE_SHAPE_KEYS, (nb, hq, sq, sk, hd))), knobs


@T.macro(hygienic=False)
def _rotate_pair():
    # A rotate-half pair of 8-value chunks, xa of the first half and xb of the second: xa cos - xb
    # sin and xb cos' + xa sin' in float32, rounded to the dtype (as a framework's RoPE before its
    # matmul). The caller's registers xa, xb, ca, sa, cb, sb, r and its dtype.
    for e in T.unroll(8):
        a = T.meta_var(T.Cast("float32", xa[e]))
        b = T.meta_var(T.Cast("float32", xb[e]))
        r[0] = a * T.Cast("float32", ca[e]) - b * T.Cast("float32", sa[e])
        r[1] = b * T.Cast("float32", cb[e]) + a * T.Cast("float32", sb[e])
        xa[e] = T.Cast(dtype, r[0])
        xb[e] = T.Cast(dtype, r[1])


def rope_scores(shape: dict, dtype: str = "float16", knobs: dict | None = None):
    """The tirx PrimFunc ``(q, k, cos, sin, scores)`` of rope_qk on tensor cores: scores = rope(q)
    rope(k)^T / sqrt(head_dim), q (batch, heads, seq_q, head_dim) at the last seq_q of the seq_k
    positions, k (batch, heads, seq_k, head_dim), cos and sin (seq_k, head_dim), scores (batch,
    heads, seq_q, seq_k), rotate-half RoPE; global symbol ``rope_scores``.

    A CTA per (128-query tile, BN-key tile, batch x head), key tiles of a query tile adjacent in
    launch order (its Q tile from L2). Thread 0 copies the Q and K tiles by TMA (128-byte swizzle,
    as the prefill's); every thread then rotates 16-byte chunks of them in shared memory: the chunk
    of columns 8c.. of the first half and its partner half a row on (the same swizzled chunk of the
    next 64-column box at head_dim 128; chunk c + 4 of the same box at 64), with the cos/sin rows of
    its position, in float32, rounded back to the dtype (as a framework's RoPE before its matmul).
    After a proxy fence, each warpgroup's S = Qr Kr^T is one wgmma chain over head_dim, scaled and
    stored two keys per 4-byte store; rows past seq_q and keys past seq_k (a padded tile's TMA copy
    of the next head, or zeros) read their position clamped to the last one and are not stored.
    Knob ``block_n`` (64, 128, 256), keys per tile."""
    dims, knobs = check_rope_scores(shape, dtype, knobs)
    nb, hq, sq, sk, hd = (dims[key] for key in ROPE_SHAPE_KEYS)
    bm, bn = BLOCK_M, knobs["block_n"]
    boxes, cpr = hd // 64, hd // 16          # 64-column boxes; 16-byte chunks in a half row
    off = sk - sq
    q_tiles, k_tiles = -(-sq // bm), -(-sk // bn)
    grid = q_tiles * k_tiles * nb * hq
    pad_q, pad_k = sq % bm != 0, sk % bn != 0
    n_s = bn // 2
    scale = 1.0 / math.sqrt(hd)
    op = DTYPES[dtype]
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{op}.{op}"
    tma_q = _tensor_map_args(nb * hq * sq, hd, bm)
    tma_k = _tensor_map_args(nb * hq * sk, hd, bn)
    tile_bytes = (bm + bn) * hd * 2

    @T.macro(hygienic=False)
    def rotate(X16, row, c, pos):
        """Rotate one chunk pair of row ``row`` of a swizzled tile in place, at position ``pos``, in
        the kernel's registers (the names of ``rope_qk``'s body, where it is expanded)."""
        xa16[0] = X16[0, row, T.bitwise_xor(c, row % 8)]
        # the partner chunk, half a row on: box (c + cpr) * 8 // 64, chunk (c + cpr) % 8 before the swizzle
        xb16[0] = X16[(c + cpr) * 8 // 64, row, T.bitwise_xor((c + cpr) % 8, row % 8)]
        ca16[0] = C16[pos, c]
        sa16[0] = S16[pos, c]
        cb16[0] = C16[pos, c + cpr]
        sb16[0] = S16[pos, c + cpr]
        _rotate_pair()
        X16[0, row, T.bitwise_xor(c, row % 8)] = xa16[0]
        X16[(c + cpr) * 8 // 64, row, T.bitwise_xor((c + cpr) % 8, row % 8)] = xb16[0]

    @T.prim_func
    def rope_qk(q: T.handle, k: T.handle, cos: T.handle, sin: T.handle, scores: T.handle):
        Q = T.match_buffer(q, (nb, hq, sq, hd), dtype, align=16)
        K = T.match_buffer(k, (nb, hq, sk, hd), dtype, align=16)
        C = T.match_buffer(cos, (sk, hd), dtype, align=16)
        S = T.match_buffer(sin, (sk, hd), dtype, align=16)
        O = T.match_buffer(scores, (nb, hq, sq, sk), dtype, align=16)
        Q_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", Q_map, dtype, 2, Q.data, *tma_q)
        K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", K_map, dtype, 2, K.data, *tma_k)
        T.device_entry()
        cta = T.cta_id([grid])
        tx = T.thread_id([_ROPE_THREADS])
        pool = T.SMEMPool()
        Qs = pool.alloc((boxes, bm, 64), dtype, align=1024)
        Ks = pool.alloc((1, boxes, bn, 64), dtype, align=1024)
        bar = pool.alloc((1,), "uint64", align=8)
        pool.commit()
        Q16 = T.decl_buffer((boxes, bm, 8), "uint32x4", data=Qs.data, elem_offset=Qs.elem_offset // 8,
                            scope="shared.dyn")
        K16 = T.decl_buffer((boxes, bn, 8), "uint32x4", data=Ks.data, elem_offset=Ks.elem_offset // 8,
                            scope="shared.dyn")
        C16 = T.decl_buffer((sk, hd // 8), "uint32x4", data=C.data)
        S16 = T.decl_buffer((sk, hd // 8), "uint32x4", data=S.data)
        O_words = T.decl_buffer((nb * hq * sq, sk // 2), "uint32", data=O.data)
        desc_a: T.uint64
        desc_b: T.uint64
        s = T.alloc_buffer((n_s,), "float32", scope="local")
        xa16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        xb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        ca16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        sa16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        cb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        sb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        xa = T.decl_buffer((8,), dtype, data=xa16.data, scope="local")
        xb = T.decl_buffer((8,), dtype, data=xb16.data, scope="local")
        ca = T.decl_buffer((8,), dtype, data=ca16.data, scope="local")
        sa = T.decl_buffer((8,), dtype, data=sa16.data, scope="local")
        cb = T.decl_buffer((8,), dtype, data=cb16.data, scope="local")
        sb = T.decl_buffer((8,), dtype, data=sb16.data, scope="local")
        r = T.alloc_buffer((2,), "float32", scope="local")  # a chunk pair's rotated elements
        out_pair = T.alloc_buffer((2,), dtype, scope="local")
        out_word = T.decl_buffer((1,), "uint32", data=out_pair.data, scope="local")
        kt = T.meta_var(cta % k_tiles)
        qt = T.meta_var(cta // k_tiles % q_tiles)
        head = T.meta_var(cta // (k_tiles * q_tiles))
        wg = T.meta_var(tx // 128)
        lane = T.meta_var(tx % 128)
        if tx == 0:
            T.ptx.mbarrier.init.shared.b64(T.address_of(bar[0]), T.uint32(1))
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        if tx == 0:
            for h in T.unroll(boxes):
                T.ptx[_TMA_LOAD](Qs.ptr_to([h, 0, 0]), T.address_of(Q_map), h * 64, head * sq + qt * bm,
                                 T.address_of(bar[0]))
                T.ptx[_TMA_LOAD](Ks.ptr_to([0, h, 0, 0]), T.address_of(K_map), h * 64, head * sk + kt * bn,
                                 T.address_of(bar[0]))
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bar[0]), T.uint32(tile_bytes))
        T.cuda.mbarrier_wait(T.address_of(bar[0]), 0)
        for u in T.unroll(bm * cpr // _ROPE_THREADS):
            rotate(Q16, (tx + u * _ROPE_THREADS) // cpr, (tx + u * _ROPE_THREADS) % cpr,
                   T.min(qt * bm + (tx + u * _ROPE_THREADS) // cpr, sq - 1) + off)
        for u in T.unroll(bn * cpr // _ROPE_THREADS):
            rotate(K16, (tx + u * _ROPE_THREADS) // cpr, (tx + u * _ROPE_THREADS) % cpr,
                   T.min(kt * bn + (tx + u * _ROPE_THREADS) // cpr, sk - 1))
        T.ptx.fence.proxy.async_.shared__cta()  # the rotated tiles, to wgmma's async proxy
        T.cuda.cta_sync()
        _issue_scores(s, n_s, Qs, Ks, 0, wg, hd, mma, desc_a, desc_b)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        for i in T.unroll(n_s // 2):
            # pair i: keys 8 (i // 2) + q, +1 of row half i % 2 (the accumulator's layout above)
            row = T.meta_var(qt * bm + wg * 64 + lane // 32 * 16 + lane % 32 // 4 + i % 2 * 8)
            key = T.meta_var(kt * bn + i // 2 * 8 + lane % 4 * 2)
            out_pair[0] = T.Cast(dtype, s[i * 2] * T.float32(scale))
            out_pair[1] = T.Cast(dtype, s[i * 2 + 1] * T.float32(scale))
            if pad_q or pad_k:
                if row < sq and key < sk:
                    O_words[head * sq + row, key // 2] = out_word[0]
            else:
                O_words[head * sq + row, key // 2] = out_word[0]

    return _mark(rope_qk, "rope_scores")


# rope_qk as two kernels: every row rotated once (``rope_rotate``), then every head's scores as a
# batched wgmma GEMM (``cuda_wgmma.batched_gemm``). The GEMM's K is head_dim, so a tile is two k
# slices at most and storing the scores is the work: its default is the one-role kernel with two
# slots (several CTAs per SM, one's stores behind another's loads), the tile written by TMA stores
# from shared memory (whole lines; the accumulators' own 4-byte stores reached half the bandwidth).
ROPE_GEMM_KNOBS = {"block_n": (64, 128, 256), "warpgroups": (1, 2), "stages": (2,), "block_k": (64,),
                   "wait_depth": (0, 1), "specialised": (0, 1), "raster": (1, 8), "tma_store": (0, 1)}
ROPE_GEMM_DEFAULT_KNOBS = {"block_n": 128, "warpgroups": 2, "stages": 2, "block_k": 64, "wait_depth": 1,
                           "specialised": 0, "raster": 1, "tma_store": 1}
_ROTATE_THREADS = 256


def rope_gemm_shape(shape: dict) -> tuple[dict, int]:
    """(the batched GEMM's {m, n, k}, its batches) of rope_qk's ``shape``: a head's seq_q rotated
    query rows against its seq_k rotated keys, batch x heads of them."""
    nb, hq, sq, sk, hd = _ints(shape, ROPE_SHAPE_KEYS)
    return {"m": nb * hq * sq, "n": sk, "k": hd}, nb * hq


def check_rope_gemm(shape: dict, dtype: str, knobs: dict | None = None) -> dict:
    """The batched GEMM's constants when ``rope_rotate`` + ``batched_gemm`` take ``shape``, ``dtype``
    and ``knobs``; AttentionShapeError otherwise (with ``tma_store`` 0, seq_q and seq_k whole
    tiles; with it, seq_k a multiple of 8)."""
    _rope_dims(shape, dtype)
    gemm, batches = rope_gemm_shape(shape)
    try:
        return batched_check(gemm, batches, dtype, knobs, ROPE_GEMM_KNOBS, ROPE_GEMM_DEFAULT_KNOBS)
    except ValueError as err:
        raise AttentionShapeError(f"the scores' batched GEMM: {err}") from None


def rope_rotate(shape: dict, dtype: str = "float16"):
    """The tirx PrimFunc ``(q, k, cos, sin, q_rot, k_rot)``: rotate-half RoPE of every row of q
    (batch, heads, seq_q, head_dim), at the last seq_q of the seq_k positions, and of k (batch,
    heads, seq_k, head_dim) into q_rot and k_rot (their shapes), in float32 and rounded to the dtype
    as a framework's RoPE before its matmul (``rope_scores`` rotates the same way). A thread per
    16-byte chunk of a row's first half and its partner half a row on; global symbol
    ``rope_rotate``."""
    nb, hq, sq, sk, hd = _ints(shape, ROPE_SHAPE_KEYS)
    _check_dtype_heads(dtype, hq, hq, hd)
    cpr = hd // 16                             # 16-byte chunks in half a row
    q_rows, k_rows = nb * hq * sq, nb * hq * sk
    pairs = (q_rows + k_rows) * cpr
    grid = -(-pairs // _ROTATE_THREADS)
    off = sk - sq

    @T.prim_func
    def rotate(q: T.handle, k: T.handle, cos: T.handle, sin: T.handle, q_rot: T.handle, k_rot: T.handle):
        Q = T.match_buffer(q, (q_rows, hd), dtype, align=16)
        K = T.match_buffer(k, (k_rows, hd), dtype, align=16)
        C = T.match_buffer(cos, (sk, hd), dtype, align=16)
        S = T.match_buffer(sin, (sk, hd), dtype, align=16)
        QR = T.match_buffer(q_rot, (q_rows, hd), dtype, align=16)
        KR = T.match_buffer(k_rot, (k_rows, hd), dtype, align=16)
        T.device_entry()
        cta = T.cta_id([grid])
        tx = T.thread_id([_ROTATE_THREADS])
        Q16 = T.decl_buffer((q_rows, hd // 8), "uint32x4", data=Q.data)
        K16 = T.decl_buffer((k_rows, hd // 8), "uint32x4", data=K.data)
        QR16 = T.decl_buffer((q_rows, hd // 8), "uint32x4", data=QR.data)
        KR16 = T.decl_buffer((k_rows, hd // 8), "uint32x4", data=KR.data)
        C16 = T.decl_buffer((sk, hd // 8), "uint32x4", data=C.data)
        S16 = T.decl_buffer((sk, hd // 8), "uint32x4", data=S.data)
        xa16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        xb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        ca16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        sa16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        cb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        sb16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        xa = T.decl_buffer((8,), dtype, data=xa16.data, scope="local")
        xb = T.decl_buffer((8,), dtype, data=xb16.data, scope="local")
        ca = T.decl_buffer((8,), dtype, data=ca16.data, scope="local")
        sa = T.decl_buffer((8,), dtype, data=sa16.data, scope="local")
        cb = T.decl_buffer((8,), dtype, data=cb16.data, scope="local")
        sb = T.decl_buffer((8,), dtype, data=sb16.data, scope="local")
        r = T.alloc_buffer((2,), "float32", scope="local")
        t = T.meta_var(cta * _ROTATE_THREADS + tx)
        row = T.meta_var(t // cpr)
        c = T.meta_var(t % cpr)
        pos = T.meta_var(T.if_then_else(row < q_rows, row % sq + off, (row - q_rows) % sk))
        if t < pairs:
            if row < q_rows:
                xa16[0] = Q16[row, c]
                xb16[0] = Q16[row, c + cpr]
            else:
                xa16[0] = K16[row - q_rows, c]
                xb16[0] = K16[row - q_rows, c + cpr]
            ca16[0] = C16[pos, c]
            sa16[0] = S16[pos, c]
            cb16[0] = C16[pos, c + cpr]
            sb16[0] = S16[pos, c + cpr]
            _rotate_pair()
            if row < q_rows:
                QR16[row, c] = xa16[0]
                QR16[row, c + cpr] = xb16[0]
            else:
                KR16[row - q_rows, c] = xa16[0]
                KR16[row - q_rows, c + cpr] = xb16[0]

    return _mark(rotate, "rope_rotate")


def rope_flops(shape: dict) -> float:
    """Multiply-adds x 2 of Q K^T (the rotation's few per element left out)."""
    nb, hq, sq, sk, hd = _ints(shape, ROPE_SHAPE_KEYS)
    return 2.0 * nb * hq * sq * sk * hd


# ---- decode ---------------------------------------------------------------------------------------

DECODE_SHAPE_KEYS = ("batch", "num_heads", "num_kv_heads", "head_dim", "max_seq")
_LOAD_ELEMS = 8  # 16 bytes of a 2-byte dtype
_INT32_ELEMS = 1 << 31  # a buffer of this many elements or more is declared (and indexed) in int64


def _dims(shape: tuple) -> tuple:
    """``shape`` as a buffer's dims: int64 when its elements do not fit int32 (flattening a batch 64
    x 32768-key cache of 2^31 elements in int32 fails), else as given (cheaper address math)."""
    return tuple(T.int64(d) for d in shape) if math.prod(shape) >= _INT32_ELEMS else shape


def decode_geometry(head_dim: int, knobs: dict) -> dict:
    """Thread layout of the split kernel: lanes per key row, key rows per warp load instruction,
    lane groups per CTA (each with its own softmax state), keys per CTA step."""
    lanes = head_dim // _LOAD_ELEMS
    rows_per_load = 32 // lanes
    groups = knobs["warps"] * rows_per_load
    return {"lanes": lanes, "rows_per_load": rows_per_load, "groups": groups,
            "step": groups * knobs["keys"], "threads": 32 * knobs["warps"]}


def default_splits(batch: int, kv_heads: int, max_seq: int, head_dim: int, knobs: dict) -> int:
    """Key splits per (batch, K/V head): as many as keep SPLIT_MIN_KEYS keys or more each, at most
    SPLIT_MAX (each adds a partial per query head to combine; CLUSTER_MAX merged in a cluster) and
    SPLIT_MAX_CTAS CTAs in all, then only those that get keys at max_seq. More, shorter CTAs than
    one wave hide the loads' latency better, up to where the combine's reads cost more (H100 sweep:
    README, "decode split sweep")."""
    step = decode_geometry(head_dim, knobs)["step"]
    most = CLUSTER_MAX if knobs.get("merge") == "cluster" else SPLIT_MAX
    splits = max(1, min(most, max_seq // max(SPLIT_MIN_KEYS, step), SPLIT_MAX_CTAS // (batch * kv_heads)))
    chunk = decode_key_range(0, max_seq, splits, step)[1]
    return -(-max_seq // chunk)


def default_merge(row_sets: int, splits: int) -> str:
    """"cluster" where that costs no parallelism: the combine's ``splits`` would fit one cluster
    anyway, or ``row_sets`` (batch x K/V heads x row CTAs) of CLUSTER_MAX splits still fill two CTAs
    on every SM. Else "last": at batch 1, 32 splits merged without a second launch (README, "decode
    merged by the last split")."""
    return "cluster" if splits <= CLUSTER_MAX or row_sets * CLUSTER_MAX >= 2 * SM_COUNT else "last"


def decode_rows(group: int, queries: int = 1) -> int:
    """Query rows a split CTA keeps in registers: the K/V head's whole query group when decoding
    one token; with ``queries`` tokens a head (drafts, a chunk), the largest divisor of its group x
    queries rows up to DECODE_MAX_GROUP (the rest go to further CTAs over the same keys)."""
    return max(r for r in range(1, DECODE_MAX_GROUP + 1) if group * queries % r == 0)


def check_decode(shape: dict, dtype: str, knobs: dict | None = None, drafts: int = 0,
                 queries: int = 1, append: bool = False) -> tuple[dict, dict]:
    """(dims, resolved knobs with ``splits`` set) when ``decode_attention`` takes ``shape`` (keys
    DECODE_SHAPE_KEYS, optional ``scale``; with ``drafts``, also ``cache_len``), ``dtype`` and
    ``knobs`` (and ``drafts``, ``queries`` or ``append``, as it does; ``append`` adds the knob
    ``stages``, APPEND_KNOBS); AttentionShapeError otherwise. With ``drafts`` the splits share
    cache_len keys."""
    space, default = (APPEND_KNOBS, APPEND_DEFAULT_KNOBS) if append else (DECODE_KNOBS, DECODE_DEFAULT_KNOBS)
    if append and knobs and knobs.get("evict_first") and knobs.get("stages", default["stages"]) == 0:
        raise AttentionShapeError(f"knob evict_first={knobs['evict_first']} hints the ring's bulk copies; "
                                  "stages=0 has none")
    knobs = _resolve(knobs, space, default)
    if append and knobs["stages"] == 0:
        knobs["evict_first"] = 0
    nb, hq, hkv, hd, smax = _ints(shape, DECODE_SHAPE_KEYS)
    _check_dtype_heads(dtype, hq, hkv, hd)
    group = hq // hkv
    queries = drafts or queries
    if nb * hkv * smax * hd // _LOAD_ELEMS >= 1 << 31:
        raise AttentionShapeError("the K/V cache has 2^31 16-byte vectors or more (int32 indices)")
    rows = decode_rows(group, queries)
    row_ctas = group * queries // rows
    keys, keys_name = smax, "max_seq"
    if drafts:
        length = int(shape["cache_len"])
        if not 0 <= length <= smax:
            raise AttentionShapeError(f"cache_len={length} must be in [0, max_seq={smax}]")
        keys, keys_name = max(length, 1), "max(cache_len, 1)"
    if append and knobs["merge"] is None:
        knobs["merge"] = default_merge(nb * row_ctas * hkv, default_splits(nb * row_ctas, hkv, keys, hd,
                                                                           dict(knobs, merge="combine")))
    splits = knobs["splits"]
    if splits is None:
        splits = default_splits(nb * row_ctas, hkv, keys, hd, knobs)
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= keys:
        raise AttentionShapeError(f"knob splits={splits!r} must be an integer in [1, {keys_name}={keys}]")
    if knobs.get("merge") == "cluster" and splits > CLUSTER_MAX:
        raise AttentionShapeError(f"knob splits={splits} with merge cluster: a cluster holds at most "
                                  f"{CLUSTER_MAX} CTAs")
    if knobs.get("merge") == "last" and nb * row_ctas * hkv > ARRIVAL_SLOTS:
        raise AttentionShapeError(f"merge last counts the splits of at most {ARRIVAL_SLOTS} row sets "
                                  f"(batch x K/V heads x row CTAs); this shape has {nb * row_ctas * hkv}")
    knobs = dict(knobs, splits=splits)
    smem = decode_split_shared_memory_bytes(hd, rows, knobs)
    if smem > SHARED_MEMORY_LIMIT:
        raise AttentionShapeError(f"the split kernel's {smem} bytes of shared memory (knobs {knobs}) exceed the "
                                  f"{SHARED_MEMORY_LIMIT} a CTA may have")
    dims = dict(zip(DECODE_SHAPE_KEYS, (nb, hq, hkv, hd, smax)), group=group, scale=_scale(shape, hd),
                rows=rows, row_ctas=row_ctas, drafts=drafts, queries=queries)
    return dims, knobs


def decode_key_range(split, length, splits: int, step: int):
    """[begin, end) of the keys of key split ``split`` before clipping end to ``length`` (ints or the
    kernel's expressions): ceil(length / splits) rounded up to whole steps each, so every step but a
    split's last is full (and unchecked) and trailing splits of a short cache may be empty."""
    chunk = ((length + splits - 1) // splits + step - 1) // step * step
    return split * chunk, split * chunk + chunk


def decode_tail_range(split, length, splits: int, max_seq: int):
    """[begin, end) of the cache rows past the attended ``length`` that key split ``split`` copies
    (append), before clipping end to ``max_seq``: an equal share of the max_seq - length rows each."""
    share = (max_seq - length + splits - 1) // splits
    return length + split * share, length + split * share + share


def decode_configs(shape: dict, dtype: str, append: bool = False) -> list[dict]:
    """Every (warps, keys[, stages]) configuration ``check_decode`` accepts, splits left to the
    default."""
    space = APPEND_KNOBS if append else DECODE_KNOBS
    return _configs(space, lambda knobs: check_decode(shape, dtype, knobs, append=append))


def decode_split_shared_memory_bytes(head_dim: int, rows: int, knobs: dict) -> int:
    """The lane groups' partials of ``rows`` query rows and their weights, with ``stages`` the ring
    of K and V steps (2-byte dtypes), merged in a cluster the splits' partials of this CTA's share
    of the outputs, merged by the last split the flag that says so and its rows' (max, sum, weight)
    of every split."""
    geo = decode_geometry(head_dim, knobs)
    stages = knobs.get("stages", 0)
    ring = stages * (2 * geo["step"] * head_dim * 2 + 8) + (256 if stages else 0)  # slots, barriers, alignment
    merge = knobs.get("merge")
    gather = 4 * knobs["splits"] * (cluster_share(rows, head_dim, knobs["splits"]) + 2 * rows) + 32 \
        if merge == "cluster" else 4 * rows * (3 * knobs["splits"] + 1) + 64 if merge == "last" else 0
    return 4 * geo["groups"] * rows * (head_dim + 3) + 8 * rows + 32 + ring + gather


def cluster_share(rows: int, head_dim: int, splits: int) -> int:
    """Outputs (query row x column) whose splits' partials each CTA of a merging cluster gathers
    and merges: CTA r the r-th run of this many."""
    return -(-rows * head_dim // splits)


def _paged_row(row, page_size: int, length):
    """Row ``row`` of a sequence as (block-table column, row in its page), clamped to its last key
    (``length`` - 1) so that a masked lane of the last step reads no table entry past the sequence."""
    row = T.min(row, length - 1)
    return row // page_size, row % page_size


def _seq_length(lengths, b, length):
    """Keys of sequence ``b``: its ``seq_lens`` entry (paged), else the kernel's ``length``."""
    return lengths[b] if lengths is not None else length


def decode_partials(knobs: dict, drafts: int = 0) -> int:
    """Partials per query row that the combine merges: one per key split, and the drafts' own."""
    return knobs["splits"] + (1 if drafts else 0)


def _append_guard(row, key_end, checked: bool, cta_row, row_ctas: int):
    """When a split CTA stores a loaded cache row (append): the row is attended (``checked``
    steps only) and the CTA is its K/V head's first row set (with several); True: always."""
    conds = ([row < key_end] if checked else []) + ([cta_row % row_ctas == 0] if row_ctas > 1 else [])
    return T.And(*conds) if len(conds) == 2 else conds[0] if conds else True


def _kv_head(cta_row, row_ctas: int):
    """The K/V head of a split CTA's row index (its query rows' CTA over the K/V heads)."""
    return cta_row if row_ctas == 1 else cta_row // row_ctas


def decode_attention(shape: dict, dtype: str = "float16", knobs: dict | None = None, append: bool = False,
                     paged: tuple[int, int, int] | None = None, dependent: bool = True, drafts: int = 0,
                     queries: int = 1):
    """(split, combine) tirx PrimFuncs of split-KV decoding (module docstring) for ``shape``
    {batch, num_heads, num_kv_heads, head_dim, max_seq, scale (1/sqrt(head_dim))}; global symbols
    ``attention_decode_split`` (``attention_decode_append_split`` with ``append``) and
    ``attention_decode_combine``; the partials' split count is
    ``check_decode(shape, dtype, knobs)[1]["splits"]``. With ``append`` the split kernel is
    ``(q, k_new, v_new, k_cache, v_cache, k_out, v_out, part_o, part_ml, length)``: it attends over
    the caches with row length - 1 replaced by the new token's rows and writes the whole appended
    caches to k_out, v_out on the way (each row it attends as it loads it, rows from length on
    shared out among the splits), so the copy costs no second read of the caches. Where the knob
    ``merge`` resolves to "cluster" the splits merge in their cluster: the split kernel is ``(q,
    k_new, v_new, k_cache, v_cache, k_out, v_out, out, length)`` and combine is None; to "last", the
    last split to finish merges: ``(q, k_new, v_new, k_cache, v_cache, k_out, v_out, part_o, part_ml,
    out, length)`` and combine is None.

    With ``paged`` = (page_size, max_pages, num_pages) the caches are vLLM's pages instead: the split
    kernel is ``(q, k_pages, v_pages, block_table, seq_lens, part_o, part_ml)``, pages (num_pages,
    kv_heads, page_size, head_dim), block_table (batch, max_pages) and seq_lens (batch,) int32;
    sequence b attends its first seq_lens[b] keys, key j in page block_table[b, j // page_size] at
    row j % page_size (max_seq = max_pages * page_size). No append.

    With ``drafts`` > 0 (speculative verification, ``check_decode(shape, dtype, knobs, drafts)``)
    each query head brings ``drafts`` rows: the split kernel is ``(q, k_cache, v_cache, k_new, v_new,
    tree, part_o, part_ml, length)``, q (batch, heads, drafts, head_dim), k_new/v_new (batch,
    kv_heads, drafts, head_dim) the drafts' own K/V, tree (drafts, drafts) int32; every row sees
    the cache's first ``length`` keys and draft j when tree[its draft, j] != 0. The group x drafts
    rows of a K/V head are shared out ``decode_rows`` at a time among CTAs over the same keys, and
    one more split CTA per row set attends the drafts; the partials and out are per (head, draft).

    With ``paged`` and ``queries`` > 1 (a chunk of a sequence's last tokens, causal) q and out are
    (batch, queries, heads, head_dim), and query t of sequence b sees keys j <= seq_lens[b] -
    queries + t; its rows are shared out among CTAs as the drafts' are.

    With ``dependent`` (the default) both kernels are launched with programmatic dependent launch
    (``dependent_launch``): the combine is resident and waiting when the split kernel's last CTA
    ends, instead of being launched then, a few microseconds of a short step."""
    if paged and append:
        raise ValueError("a paged decode kernel does not append")
    if knobs and (knobs.get("stages") or knobs.get("merge")) and not append:
        raise ValueError("only an appending decode kernel streams its keys through shared memory (stages) "
                         "or merges its splits without the combine kernel (merge)")
    if drafts and (paged or append):
        raise ValueError("a verifying decode kernel neither appends nor reads pages")
    if queries > 1 and not paged:
        raise ValueError("several query tokens a sequence: drafts (verifying) or a paged chunk only")
    dims, knobs = check_decode(shape, dtype, knobs, drafts, queries, append)
    nb, hq, hkv, hd, smax = (dims[key] for key in DECODE_SHAPE_KEYS)
    group, splits, keys, warps = dims["group"], knobs["splits"], knobs["keys"], knobs["warps"]
    stages = knobs.get("stages", 0)
    bulk = stages > 0                     # keys through a shared-memory ring, the append by bulk copies
    # the caches' lines the ring's bulk copies bring into L2 evicted first (1), and those they write out (2)
    evict = knobs.get("evict_first", 0) if bulk else 0
    rows, row_ctas, queries = dims["rows"], dims["row_ctas"], dims["queries"]
    cluster = knobs.get("merge") == "cluster"  # the splits of a row set merge in their cluster: no combine kernel
    last = knobs.get("merge") == "last"        # the last split of a row set to finish merges: no combine kernel
    share = cluster_share(rows, hd, splits) if cluster else 0
    chunk = bool(paged) and queries > 1  # q and out (batch, queries, heads, head_dim), causal over the last keys
    partials = decode_partials(knobs, drafts)
    geo = decode_geometry(hd, knobs)
    lanes, rows_per_load, groups, step, threads = (geo[k] for k in ("lanes", "rows_per_load", "groups", "step", "threads"))
    c = dims["scale"] * LOG2E
    vec = _LOAD_ELEMS
    outputs_per_thread = -(-rows * hd // threads)
    chunks = -(-partials // COMBINE_UNROLL)
    # merge "last": a thread's outputs x splits loaded at once, at most LAST_LOADS (in batches of
    # outputs, each over chunks of splits)
    last_chunk = min(partials, LAST_LOADS)
    last_batch = max(1, min(outputs_per_thread, LAST_LOADS // last_chunk))
    last_batches, last_chunks = -(-outputs_per_thread // last_batch), -(-partials // last_chunk)
    copy_rows = threads // lanes  # cache rows a CTA copies per pass
    page_size, max_pages, num_pages = paged or (0, 0, 0)
    if paged and max_pages * page_size != smax:
        raise ValueError(f"max_seq={smax} is not max_pages x page_size = {max_pages * page_size}")
    kv_shape = (num_pages, hkv, page_size, hd // _LOAD_ELEMS) if paged else (nb, hkv, smax, hd // _LOAD_ELEMS)

    @T.macro(hygienic=False)
    def _step(first, checked, key_end, draft):
        # One step of this lane group: rows first + u * rows_per_load (u < keys), all loads issued
        # before any math; `checked` (the last, partial step only) masks rows from key_end on;
        # `draft`: the rows are the drafts', masked by the tree. Expanded in `_split_body`, whose
        # names it uses.
        for u in T.unroll(keys):
            row = T.meta_var(first + u * rows_per_load)
            if draft:
                k_vec = T.meta_var(KD16[b, kvh, row, sub])
                v_vec = T.meta_var(VD16[b, kvh, row, sub])
            elif bulk:  # from this step's ring slot, the new token's row patched in
                k_vec = T.meta_var(KS16[slot, row - stage_first, sub])
                v_vec = T.meta_var(VS16[slot, row - stage_first, sub])
            elif append:  # row length - 1 is the new token's
                k_vec = T.meta_var(T.if_then_else(row == length - 1, KN16[b, kvh, sub], K16[b, kvh, row, sub]))
                v_vec = T.meta_var(T.if_then_else(row == length - 1, VN16[b, kvh, sub], V16[b, kvh, row, sub]))
            elif PAGED:  # through the block table
                page = T.meta_var(BT[b, _paged_row(row, PAGE_SIZE, length)[0]])
                k_vec = T.meta_var(K16[page, kvh, _paged_row(row, PAGE_SIZE, length)[1], sub])
                v_vec = T.meta_var(V16[page, kvh, _paged_row(row, PAGE_SIZE, length)[1], sub])
            else:
                k_vec = T.meta_var(K16[b, kvh, row, sub])
                v_vec = T.meta_var(V16[b, kvh, row, sub])
            if checked:  # no load past key_end
                kv16[u] = T.if_then_else(row < key_end, k_vec, T.Broadcast(T.uint32(0), 4))
                kv16[keys + u] = T.if_then_else(row < key_end, v_vec, T.Broadcast(T.uint32(0), 4))
            else:
                kv16[u] = k_vec
                kv16[keys + u] = v_vec
        if append and not bulk:  # the rows loaded, stored to the output caches (by a K/V head's first row set)
            for u in T.unroll(keys):
                if _append_guard(first + u * rows_per_load, key_end, checked, hk, row_ctas):
                    KO16[b, kvh, first + u * rows_per_load, sub] = kv16[u]
                    VO16[b, kvh, first + u * rows_per_load, sub] = kv16[keys + u]
        for u in T.unroll(keys):
            for g in T.unroll(rows):
                sc[u * rows + g] = T.float32(0)
                for e in T.unroll(vec):
                    sc[u * rows + g] = sc[u * rows + g] + qf[g * vec + e] * T.Cast("float32", kv[u * vec + e])
                sc[u * rows + g] = T.cuda.warp_reduce(sc[u * rows + g], "sum", lanes)  # the row's lanes
                if checked:
                    if first + u * rows_per_load >= key_end:
                        sc[u * rows + g] = T.min_value("float32")
                if draft:  # draft j = the row, seen by query row (hk * rows + g) when its tree says so
                    if first + u * rows_per_load < key_end:
                        if TR[(hk * rows + g) % drafts, first + u * rows_per_load] == 0:
                            sc[u * rows + g] = T.min_value("float32")
                if chunk:  # query t of the chunk sees keys up to length - queries + t
                    if first + u * rows_per_load > length - queries + (hk * rows + g) % queries:
                        sc[u * rows + g] = T.min_value("float32")
        # online softmax per query row: running max m, sum l, output acc (this lane's 8 columns)
        for g in T.unroll(rows):
            m_new[0] = m[g]
            for u in T.unroll(keys):
                m_new[0] = T.max(m_new[0], sc[u * rows + g])
            alpha[0] = T.exp2(m[g] - m_new[0])
            m[g] = m_new[0]
            l[g] = l[g] * alpha[0]
            for e in T.unroll(vec):
                acc[g * vec + e] = acc[g * vec + e] * alpha[0]
            for u in T.unroll(keys):
                sc[u * rows + g] = T.exp2(sc[u * rows + g] - m_new[0])
                l[g] = l[g] + sc[u * rows + g]
                for e in T.unroll(vec):
                    acc[g * vec + e] = acc[g * vec + e] + sc[u * rows + g] * T.Cast("float32", kv[(keys + u) * vec + e])

    @T.macro(hygienic=False)
    def _copy_tail(copy_rows):
        # append: rows from length on are copied as they are, a share of them per split
        tail_begin = T.meta_var(decode_tail_range(sp, length, splits, smax)[0])
        tail_end = T.meta_var(T.min(decode_tail_range(sp, length, splits, smax)[1], smax))
        for t in T.serial((tail_end - tail_begin + copy_rows - 1) // copy_rows):
            if tail_begin + t * copy_rows + tx // lanes < tail_end:
                KO16[b, kvh, tail_begin + t * copy_rows + tx // lanes, sub] = K16[
                    b, kvh, tail_begin + t * copy_rows + tx // lanes, sub]
                VO16[b, kvh, tail_begin + t * copy_rows + tx // lanes, sub] = V16[
                    b, kvh, tail_begin + t * copy_rows + tx // lanes, sub]

    @T.macro(hygienic=False)
    def _cache_keys():
        # This CTA's split of the cache: full steps unchecked, then the partial one. Expanded in
        # `_split_body`, whose names it uses (key_begin, key_end, n_keys: this CTA's split).
        # this warp's rows of a step: keys * rows_per_load consecutive rows
        warp_first = T.meta_var(key_begin + warp * rows_per_load * keys + tx % 32 // lanes)
        for t in T.serial(n_keys // step):
            _step(warp_first + t * step, False, key_end, False)
        if n_keys % step > 0:
            _step(warp_first + n_keys // step * step, True, key_end, False)

    @T.macro(hygienic=False)
    def _bulk_load(s):
        # One thread: step s's K and V rows (up to key_end) into ring slot s % stages, completing
        # on its barrier (byte counts clamped at 0 for the bound analysis of the uint32 casts).
        # Expanded in `_bulk_prologue` and `_bulk_cache_keys`.
        rows_bytes = T.meta_var(T.max(T.min(step, key_end - key_begin - s * step), 0) * hd * 2)
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(full[s % stages]), T.Cast("uint32", 2 * rows_bytes))
        hint = T.meta_var([policy[0]] if evict > 0 else [])  # the L2 policy operand, where there is one
        T.ptx[_BULK_LOADS[evict > 0]](KS16.ptr_to([s % stages, 0, 0]), Kc.ptr_to([b, kvh, key_begin + s * step, 0]),
                                      T.Cast("uint32", rows_bytes), T.address_of(full[s % stages]), *hint)
        T.ptx[_BULK_LOADS[evict > 0]](VS16.ptr_to([s % stages, 0, 0]), Vc.ptr_to([b, kvh, key_begin + s * step, 0]),
                                      T.Cast("uint32", rows_bytes), T.address_of(full[s % stages]), *hint)

    @T.macro(hygienic=False)
    def _bulk_prologue(load_step):
        # The ring's first `stages` steps requested before anything else, q's loads included.
        if tx == 0:
            for s in T.serial(T.min((n_keys + step - 1) // step, stages)):
                load_step(s)

    @T.macro(hygienic=False)
    def _bulk_cache_keys(load_step):
        # `_cache_keys` through the ring (append only): thread 0 keeps `stages` steps of K and V in
        # flight as bulk copies (the first issued at the kernel's start, `_bulk_prologue`); each
        # landed step gets the new token's row (if it holds row length - 1), is bulk-copied on to
        # the output caches by thread 0 and read by every lane group from shared memory; once all
        # have read it (and the copy out has), its slot takes the step `stages` on (``load_step``:
        # `_bulk_load`, which a non-hygienic macro cannot name itself). Expanded in `_split_body`,
        # whose names it uses.
        n_steps = T.meta_var((n_keys + step - 1) // step)
        local_first = T.meta_var(warp * rows_per_load * keys + tx % 32 // lanes)
        for t in T.serial(n_steps):
            slot = T.meta_var(t % stages)
            stage_first = T.meta_var(key_begin + t * step)
            T.cuda.mbarrier_wait(T.address_of(full[t % stages]), t // stages % 2)
            if stage_first <= length - 1 and length - 1 < stage_first + step:  # the same for the whole CTA
                if tx < lanes:
                    KS16[slot, length - 1 - stage_first, tx] = KN16[b, kvh, tx]
                    VS16[slot, length - 1 - stage_first, tx] = VN16[b, kvh, tx]
                    T.ptx.fence.proxy.async_.shared__cta()  # the patched row, to the bulk copy out
                T.cuda.cta_sync()
            if tx == 0:
                if _append_guard(0, 0, False, hk, row_ctas):
                    rows_bytes = T.meta_var(T.Cast("uint32", T.max(T.min(step, key_end - stage_first), 0) * hd * 2))
                    hint = T.meta_var([policy[0]] if evict == 2 else [])
                    T.ptx[_BULK_STORES[evict == 2]](KO.ptr_to([b, kvh, stage_first, 0]), KS16.ptr_to([slot, 0, 0]),
                                                    rows_bytes, *hint)
                    T.ptx[_BULK_STORES[evict == 2]](VO.ptr_to([b, kvh, stage_first, 0]), VS16.ptr_to([slot, 0, 0]),
                                                    rows_bytes, *hint)
                    T.ptx["cp.async.bulk.commit_group"]()
            if t < n_keys // step:
                _step(stage_first + local_first, False, key_end, False)
            else:
                _step(stage_first + local_first, True, key_end, False)
            T.cuda.cta_sync()  # every lane group is done with the slot
            if tx == 0:
                if t + stages < n_steps:
                    T.ptx["cp.async.bulk.wait_group.read"](0)  # and so is the copy out
                    load_step(t + stages)
        if tx == 0:
            T.ptx["cp.async.bulk.wait_group.read"](0)  # the copies out have read the ring before the CTA ends

    @T.macro
    def _merge_splits(PO, PML, b, h, d, total, part, w):
        # total = (max, sum, output element d) of query row h over its partials, in one pass over
        # them in chunks of COMBINE_UNROLL: a chunk's loads are all issued before its math (one
        # memory round trip per chunk), the running total rescaled per chunk.
        total[0] = T.float32(_INIT_MAX)
        total[1] = T.float32(0)
        total[2] = T.float32(0)
        for s0 in T.serial(chunks):
            for s1 in T.unroll(COMBINE_UNROLL):
                if s0 * COMBINE_UNROLL + s1 < partials:
                    part[0, s1] = PML[b, h, s0 * COMBINE_UNROLL + s1, 0]
                    part[1, s1] = PML[b, h, s0 * COMBINE_UNROLL + s1, 1]
                    part[2, s1] = PO[b, h, s0 * COMBINE_UNROLL + s1, d]
            w[0] = total[0]
            for s1 in T.unroll(COMBINE_UNROLL):
                if s0 * COMBINE_UNROLL + s1 < partials:
                    w[0] = T.max(w[0], part[0, s1])
            w[1] = T.exp2(total[0] - w[0])
            total[0] = w[0]
            total[1] = total[1] * w[1]
            total[2] = total[2] * w[1]
            for s1 in T.unroll(COMBINE_UNROLL):
                if s0 * COMBINE_UNROLL + s1 < partials:
                    w[1] = T.exp2(part[0, s1] - total[0])
                    total[1] = total[1] + w[1] * part[1, s1]
                    total[2] = total[2] + w[1] * part[2, s1]

    def _last_output(batch, i, tx):
        # merge "last": thread tx's i-th output element of `batch` (a row x column index) and whether it is one
        o = (batch * last_batch + i) * threads + tx
        return o, T.And(batch * last_batch + i < outputs_per_thread, o < rows * hd)

    @T.macro
    def _load_last_partials(PO, b, hk, tx, batch, chunk, part):
        # this thread's output elements of `batch`, their partials of the splits of `chunk`
        for i in T.unroll(last_batch):
            for s in T.unroll(last_chunk):
                o = T.meta_var(_last_output(batch, i, tx)[0])
                if _last_output(batch, i, tx)[1] and chunk * last_chunk + s < partials:
                    part[i * last_chunk + s] = PO[b, hk * rows + o // hd, chunk * last_chunk + s, o % hd]

    @T.macro
    def _merge_last(PO, PML, O, b, hk, tx, last_ml, last_w, last_sum):
        # The last split's merge of its row set, in one memory round trip where the registers allow
        # (LAST_LOADS): each thread's partials in flight while the rows' (max, sum) of every split
        # go to shared memory, where one thread a row turns them into weights (one exp2 per split,
        # not one per output element) and the row's sum.
        part = T.alloc_buffer((last_batch * last_chunk,), "float32", scope="local")
        acc_last = T.alloc_buffer((last_batch,), "float32", scope="local")
        row_ml = T.alloc_buffer((3,), "float32", scope="local")  # the row's max, sum, a weight
        _load_last_partials(PO, b, hk, tx, 0, 0, part)
        for e in T.unroll(-(-rows * partials // threads)):
            if e * threads + tx < rows * partials:
                for k in T.unroll(2):
                    last_ml[(e * threads + tx) // partials, (e * threads + tx) % partials, k] = PML[
                        b, hk * rows + (e * threads + tx) // partials, (e * threads + tx) % partials, k]
        T.cuda.cta_sync()
        if tx < rows:
            row_ml[0] = T.float32(_INIT_MAX)
            for s in T.serial(partials):
                row_ml[0] = T.max(row_ml[0], last_ml[tx, s, 0])
            row_ml[1] = T.float32(0)
            for s in T.serial(partials):
                row_ml[2] = T.exp2(last_ml[tx, s, 0] - row_ml[0])
                last_w[tx, s] = row_ml[2]
                row_ml[1] = row_ml[1] + row_ml[2] * last_ml[tx, s, 1]
            last_sum[tx] = row_ml[1]
        T.cuda.cta_sync()
        for batch in T.serial(last_batches):
            for i in T.unroll(last_batch):
                acc_last[i] = T.float32(0)
            for chunk in T.serial(last_chunks):
                if batch + chunk > 0:
                    _load_last_partials(PO, b, hk, tx, batch, chunk, part)
                for i in T.unroll(last_batch):
                    for s in T.unroll(last_chunk):
                        o = T.meta_var(_last_output(batch, i, tx)[0])
                        if _last_output(batch, i, tx)[1] and chunk * last_chunk + s < partials:
                            acc_last[i] = acc_last[i] + last_w[o // hd, chunk * last_chunk + s] * part[i * last_chunk + s]
            for i in T.unroll(last_batch):
                o = T.meta_var(_last_output(batch, i, tx)[0])
                if _last_output(batch, i, tx)[1]:
                    O[b, hk * rows + o // hd, o % hd] = T.Cast(dtype, acc_last[i] / last_sum[o // hd])

    @T.macro
    def _split_body(Q, Kc, Vc, PO, PML, O, KN, VN, KO, VO, cache_length, BT, SL, KD, VD, TR):
        # The split kernels' body (PO, PML: the partials, or None merged in a cluster; O: out, or
        # None with the combine; KN .. VO: the append buffers, or None; BT, SL: the block table
        # and sequence lengths of a paged cache, or None; KD, VD, TR: the drafts' K/V and tree, or
        # None). hk: this CTA's set of query rows, kvh: their K/V head.
        T.device_entry()
        sp, hk, b = T.cta_id([partials, hkv * row_ctas, nb])
        if cluster:  # a row set's splits are one cluster, CTA sp its rank sp
            _rank, _cy, _cz = T.cta_id_in_cluster([splits, 1, 1])
        tx = T.thread_id([threads])
        kvh = T.meta_var(_kv_head(hk, row_ctas))
        # Programmatic dependent launch: wait for the kernel before (it may still be running),
        # then let the next (the combine, where there is one) be scheduled at once, so its launch
        # hides behind this kernel.
        T.ptx.griddepcontrol.wait()
        T.ptx.griddepcontrol.launch_dependents()
        if cluster:  # this CTA has started: its shared memory may take the others' partials (waited on there)
            T.ptx["barrier.cluster.arrive.relaxed.aligned"]()
        pool = T.SMEMPool()
        merge_o = pool.alloc((groups, rows, hd), "float32", align=16)
        merge_m = pool.alloc((groups, rows), "float32", align=16)
        merge_l = pool.alloc((groups, rows), "float32", align=16)
        merge_w = pool.alloc((groups, rows), "float32", align=16)  # each lane group's weight in its row
        merge_row = pool.alloc((rows, 2), "float32", align=16)     # each row's merged (max, sum)
        if cluster:  # every split's partials of this CTA's share of the outputs, and of their rows' (max, sum)
            gather_o = pool.alloc((splits, share), "float32", align=16)
            gather_ml = pool.alloc((splits, rows, 2), "float32", align=16)
        if last:  # 1: this CTA is the last of its row set's splits to finish; if so, its rows' (max, sum)
            # of every split, a weight per (row, split) and each row's sum of weighted sums
            arrived = pool.alloc((1,), "int32", align=16)
            last_ml = pool.alloc((rows, partials, 2), "float32", align=16)
            last_w = pool.alloc((rows, partials), "float32", align=16)
            last_sum = pool.alloc((rows,), "float32", align=16)
        if bulk:
            KS = pool.alloc((stages, step, hd), dtype, align=128)
            VS = pool.alloc((stages, step, hd), dtype, align=128)
            full = pool.alloc((stages,), "uint64", align=8)
        pool.commit()
        # 16-byte views: one element = 8 consecutive values of a row
        Q16 = T.decl_buffer((nb, hq * queries, hd // vec), "uint32x4", data=Q.data)
        if chunk:
            QC16 = T.decl_buffer((nb, queries, hq, hd // vec), "uint32x4", data=Q.data)
        K16 = T.decl_buffer(kv_shape, "uint32x4", data=Kc.data)
        V16 = T.decl_buffer(kv_shape, "uint32x4", data=Vc.data)
        if append:
            KN16 = T.decl_buffer((nb, hkv, hd // vec), "uint32x4", data=KN.data)
            VN16 = T.decl_buffer((nb, hkv, hd // vec), "uint32x4", data=VN.data)
            KO16 = T.decl_buffer((nb, hkv, smax, hd // vec), "uint32x4", data=KO.data)
            VO16 = T.decl_buffer((nb, hkv, smax, hd // vec), "uint32x4", data=VO.data)
        if drafts > 0:
            KD16 = T.decl_buffer((nb, hkv, drafts, hd // vec), "uint32x4", data=KD.data)
            VD16 = T.decl_buffer((nb, hkv, drafts, hd // vec), "uint32x4", data=VD.data)
        O4 = T.decl_buffer((groups, rows, hd // 4), "float32x4", data=merge_o.data, scope="shared.dyn")
        kv16 = T.alloc_buffer((2 * keys,), "uint32x4", scope="local")     # K rows, then V rows
        kv = T.decl_buffer((2 * keys * vec,), dtype, data=kv16.data, scope="local")
        q16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        q_h = T.decl_buffer((vec,), dtype, data=q16.data, scope="local")
        qf = T.alloc_buffer((rows * vec,), "float32", scope="local")     # q * scale * log2(e)
        acc = T.alloc_buffer((rows * vec,), "float32", scope="local")
        acc4 = T.decl_buffer((rows * vec // 4,), "float32x4", data=acc.data, scope="local")
        sc = T.alloc_buffer((keys * rows,), "float32", scope="local")
        m = T.alloc_buffer((rows,), "float32", scope="local")
        l = T.alloc_buffer((rows,), "float32", scope="local")
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        alpha = T.alloc_buffer((1,), "float32", scope="local")
        merged = T.alloc_buffer((4,), "float32", scope="local")  # max, sum, output element, weight
        if cluster:
            remote = T.alloc_buffer((1,), "uint32", scope="local")  # a shared-memory address in another CTA
        if evict > 0:
            policy = T.alloc_buffer((1,), "uint64", scope="local")  # the bulk copies' L2 policy (thread 0's)
        length = T.meta_var(_seq_length(SL, b, cache_length))
        # this CTA's split of the cache (`_cache_keys`, the ring's macros)
        key_begin = T.meta_var(decode_key_range(sp, length, splits, step)[0])
        key_end = T.meta_var(T.min(decode_key_range(sp, length, splits, step)[1], length))
        n_keys = T.meta_var(T.max(key_end - key_begin, 0))
        PAGED, PAGE_SIZE = T.meta_var((bool(paged), page_size))  # for `_step`
        warp = T.meta_var(tx // 32)
        sub = T.meta_var(tx % lanes)                  # which 8 values of a row this lane loads
        lane_group = T.meta_var(warp * rows_per_load + tx % 32 // lanes)
        if bulk:
            # 16-byte views, their offsets in 16-byte units (a vector dtype's pool offset would count lanes as one)
            KS16 = T.decl_buffer((stages, step, hd // vec), "uint32x4", data=KS.data, elem_offset=KS.elem_offset // vec,
                                 scope="shared.dyn")
            VS16 = T.decl_buffer((stages, step, hd // vec), "uint32x4", data=VS.data, elem_offset=VS.elem_offset // vec,
                                 scope="shared.dyn")
            if tx == 0:
                for st in T.unroll(stages):
                    T.ptx.mbarrier.init.shared.b64(T.address_of(full[st]), T.uint32(1))
                if evict > 0:
                    T.ptx[_EVICT_FIRST](policy[0])
            T.ptx.fence.proxy.async_.shared__cta()
            T.cuda.cta_sync()
            _bulk_prologue(_bulk_load)
        for g in T.unroll(rows):
            if chunk:  # query row (head, t) = hk * rows + g, t the fastest
                q16[0] = QC16[b, (hk * rows + g) % queries, (hk * rows + g) // queries, sub]
            else:
                q16[0] = Q16[b, hk * rows + g, sub]
            for e in T.unroll(vec):
                qf[g * vec + e] = T.Cast("float32", q_h[e]) * T.float32(c)
            m[g] = T.float32(_INIT_MAX)
            l[g] = T.float32(0)
        for i in T.unroll(rows * vec):
            acc[i] = T.float32(0)
        if append:
            if row_ctas > 1:
                if hk % row_ctas == 0:
                    _copy_tail(copy_rows)
            else:
                _copy_tail(copy_rows)
        if drafts > 0:
            if sp == splits:  # the drafts' split
                draft_first = T.meta_var(warp * rows_per_load * keys + tx % 32 // lanes)
                if drafts >= step:
                    for t in T.serial(drafts // step):
                        _step(draft_first + t * step, False, drafts, True)
                if drafts % step > 0:
                    _step(draft_first + drafts // step * step, True, drafts, True)
            else:
                _cache_keys()
        elif bulk:
            _bulk_cache_keys(_bulk_load)
        else:
            _cache_keys()
        # merge the CTA's lane groups, one partial per query row
        for g in T.unroll(rows):
            for h in T.unroll(vec // 4):
                O4[lane_group, g, sub * (vec // 4) + h] = acc4[g * (vec // 4) + h]
            if sub == 0:
                merge_m[lane_group, g] = m[g]
                merge_l[lane_group, g] = l[g]
        T.cuda.cta_sync()
        if tx < rows:  # one thread a row: its lane groups' weights (one exp2 each, not one per output element)
            merged[0] = T.float32(_INIT_MAX)
            for r in T.unroll(groups):
                merged[0] = T.max(merged[0], merge_m[r, tx])
            merged[1] = T.float32(0)
            for r in T.unroll(groups):
                merged[3] = T.exp2(merge_m[r, tx] - merged[0])
                merge_w[r, tx] = merged[3]
                merged[1] = merged[1] + merged[3] * merge_l[r, tx]
            merge_row[tx, 0] = merged[0]
            merge_row[tx, 1] = merged[1]
        T.cuda.cta_sync()
        if cluster:
            T.ptx["barrier.cluster.wait.aligned"]()  # every CTA of the cluster has started
        for i in T.unroll(outputs_per_thread):
            idx = T.meta_var(i * threads + tx)
            if idx < rows * hd:
                g = T.meta_var(idx // hd)
                d = T.meta_var(idx % hd)
                merged[0] = merge_row[g, 0]
                merged[1] = merge_row[g, 1]
                merged[2] = T.float32(0)
                for r in T.unroll(groups):
                    merged[2] = merged[2] + merge_w[r, g] * merge_o[r, g, d]
                if cluster:  # the output element to the CTA that merges it, the row's (max, sum) to CTA d
                    T.ptx["mapa.shared::cluster.u32"](remote[0], T.cuda.cvta_generic_to_shared(
                        gather_o.ptr_to([sp, idx % share])), T.Cast("uint32", idx // share))
                    T.ptx["st.shared::cluster.f32"](remote[0], merged[2])
                    if d < splits:
                        T.ptx["mapa.shared::cluster.u32"](remote[0], T.cuda.cvta_generic_to_shared(
                            gather_ml.ptr_to([sp, g, 0])), T.Cast("uint32", d))
                        T.ptx["st.shared::cluster.v2.f32"](remote[0], merged[0], merged[1])
                else:
                    PO[b, hk * rows + g, sp, d] = merged[2]
                    if d == 0:
                        PML[b, hk * rows + g, sp, 0] = merged[0]
                        PML[b, hk * rows + g, sp, 1] = merged[1]
        if cluster:
            # the partials in place (release / acquire), then this CTA merges its share into out
            T.ptx["barrier.cluster.arrive.aligned"]()  # (T.cuda.cluster_sync's asm has no memory clobber)
            T.ptx["barrier.cluster.wait.aligned"]()
            for i in T.unroll(-(-share // threads)):
                own = T.meta_var(sp * share + i * threads + tx)
                if i * threads + tx < share and own < rows * hd:
                    g = T.meta_var(own // hd)
                    merged[0] = T.float32(_INIT_MAX)
                    for r in T.unroll(splits):
                        merged[0] = T.max(merged[0], gather_ml[r, g, 0])
                    merged[1] = T.float32(0)
                    merged[2] = T.float32(0)
                    for r in T.unroll(splits):
                        merged[3] = T.exp2(gather_ml[r, g, 0] - merged[0])
                        merged[1] = merged[1] + merged[3] * gather_ml[r, g, 1]
                        merged[2] = merged[2] + merged[3] * gather_o[r, i * threads + tx]
                    O[b, hk * rows + g, own % hd] = T.Cast(dtype, merged[2] / merged[1])
        if last:
            # the CTA's partials stored (bar.sync, then thread 0's release), counted in; the last
            # of the row set's splits merges them all (thread 0's acquire, then bar.sync)
            T.cuda.cta_sync()
            if tx == 0:
                arrived[0] = T.cuda.func_call("autofuse_split_arrive", b * (hkv * row_ctas) + hk, splits,
                                              source_code=_ARRIVE_SOURCE, return_type="int32")
            T.cuda.cta_sync()
            if arrived[0] == 1:
                _merge_last(PO, PML, O, b, hk, tx, last_ml, last_w, last_sum)


    # a prim_func is parsed where it is defined: only the variant asked for. The appending
    # variants' parameters as annotations, a new buffer each (a match_buffer of this shape)
    def arg(shape, dt=dtype):
        return T.Buffer(_dims(shape), dt, align=16)

    q_rows, new_rows, cache_rows = (nb, hq, hd), (nb, hkv, hd), (nb, hkv, smax, hd)
    part_o_rows, part_ml_rows = (nb, hq, splits, hd), (nb, hq, splits, 2)
    if cluster:
        @T.prim_func
        def split(Q: arg(q_rows), KN: arg(new_rows), VN: arg(new_rows), Kc: arg(cache_rows), Vc: arg(cache_rows),
                  KO: arg(cache_rows), VO: arg(cache_rows), O: arg(q_rows), length: T.int32):
            _split_body(Q, Kc, Vc, None, None, O, KN, VN, KO, VO, length, None, None, None, None, None)
    elif last:
        @T.prim_func
        def split(Q: arg(q_rows), KN: arg(new_rows), VN: arg(new_rows), Kc: arg(cache_rows), Vc: arg(cache_rows),
                  KO: arg(cache_rows), VO: arg(cache_rows), PO: arg(part_o_rows, "float32"),
                  PML: arg(part_ml_rows, "float32"), O: arg(q_rows), length: T.int32):
            _split_body(Q, Kc, Vc, PO, PML, O, KN, VN, KO, VO, length, None, None, None, None, None)
    elif append:
        @T.prim_func
        def split(Q: arg(q_rows), KN: arg(new_rows), VN: arg(new_rows), Kc: arg(cache_rows), Vc: arg(cache_rows),
                  KO: arg(cache_rows), VO: arg(cache_rows), PO: arg(part_o_rows, "float32"),
                  PML: arg(part_ml_rows, "float32"), length: T.int32):
            _split_body(Q, Kc, Vc, PO, PML, None, KN, VN, KO, VO, length, None, None, None, None, None)
    elif paged:
        @T.prim_func
        def split(q: T.handle, k_pages: T.handle, v_pages: T.handle, block_table: T.handle, seq_lens: T.handle,
                  part_o: T.handle, part_ml: T.handle):
            Q = T.match_buffer(q, (nb, hq * queries, hd), dtype, align=16)
            Kc = T.match_buffer(k_pages, _dims((num_pages, hkv, page_size, hd)), dtype, align=16)
            Vc = T.match_buffer(v_pages, _dims((num_pages, hkv, page_size, hd)), dtype, align=16)
            BT = T.match_buffer(block_table, (nb, max_pages), "int32", align=16)
            SL = T.match_buffer(seq_lens, (nb,), "int32", align=16)
            PO = T.match_buffer(part_o, (nb, hq * queries, splits, hd), "float32", align=16)
            PML = T.match_buffer(part_ml, (nb, hq * queries, splits, 2), "float32", align=16)
            _split_body(Q, Kc, Vc, PO, PML, None, None, None, None, None, 0, BT, SL, None, None, None)
    elif drafts:
        @T.prim_func
        def split(q: T.handle, k_cache: T.handle, v_cache: T.handle, k_new: T.handle, v_new: T.handle,
                  tree: T.handle, part_o: T.handle, part_ml: T.handle, length: T.int32):
            Q = T.match_buffer(q, (nb, hq, drafts, hd), dtype, align=16)
            Kc = T.match_buffer(k_cache, _dims((nb, hkv, smax, hd)), dtype, align=16)
            Vc = T.match_buffer(v_cache, _dims((nb, hkv, smax, hd)), dtype, align=16)
            KD = T.match_buffer(k_new, (nb, hkv, drafts, hd), dtype, align=16)
            VD = T.match_buffer(v_new, (nb, hkv, drafts, hd), dtype, align=16)
            TR = T.match_buffer(tree, (drafts, drafts), "int32", align=16)
            PO = T.match_buffer(part_o, (nb, hq * drafts, partials, hd), "float32", align=16)
            PML = T.match_buffer(part_ml, (nb, hq * drafts, partials, 2), "float32", align=16)
            _split_body(Q, Kc, Vc, PO, PML, None, None, None, None, None, length, None, None, KD, VD, TR)
    else:
        @T.prim_func
        def split(q: T.handle, k_cache: T.handle, v_cache: T.handle, part_o: T.handle, part_ml: T.handle,
                  length: T.int32):
            Q = T.match_buffer(q, (nb, hq, hd), dtype, align=16)
            Kc = T.match_buffer(k_cache, _dims((nb, hkv, smax, hd)), dtype, align=16)
            Vc = T.match_buffer(v_cache, _dims((nb, hkv, smax, hd)), dtype, align=16)
            PO = T.match_buffer(part_o, (nb, hq, splits, hd), "float32", align=16)
            PML = T.match_buffer(part_ml, (nb, hq, splits, 2), "float32", align=16)
            _split_body(Q, Kc, Vc, PO, PML, None, None, None, None, None, length, None, None, None, None, None)

    @T.prim_func
    def combine(part_o: T.handle, part_ml: T.handle, out: T.handle):
        PO = T.match_buffer(part_o, (nb, hq * queries, partials, hd), "float32", align=16)
        PML = T.match_buffer(part_ml, (nb, hq * queries, partials, 2), "float32", align=16)
        O = T.match_buffer(out, (nb, hq * queries, hd), dtype, align=16)
        T.device_entry()
        h, b = T.cta_id([hq * queries, nb])
        d = T.thread_id([hd])
        T.ptx.griddepcontrol.wait()  # the split kernel's partials, complete and visible
        total = T.alloc_buffer((3,), "float32", scope="local")  # max, sum, output element
        part = T.alloc_buffer((3, COMBINE_UNROLL), "float32", scope="local")  # a chunk's (max, sum, output)
        w = T.alloc_buffer((2,), "float32", scope="local")  # the chunk's max, a weight
        _merge_splits(PO, PML, b, h, d, total, part, w)
        if chunk:  # out (batch, queries, heads, head_dim)
            OC = T.decl_buffer((nb, queries, hq, hd), dtype, data=O.data)
            OC[b, h % queries, h // queries, d] = T.Cast(dtype, total[2] / total[1])
        else:
            O[b, h, d] = T.Cast(dtype, total[2] / total[1])

    name = "attention_decode_append_split" if append else "attention_decode_paged_split" if paged \
        else "attention_verify_split" if drafts else "attention_decode_split"
    split = _mark(split, name)
    if cluster or last:
        return (dependent_launch(split) if dependent else split), None
    combine = _mark(combine, "attention_decode_combine")
    if dependent:
        split, combine = dependent_launch(split), dependent_launch(combine)
    return split, combine


def decode_kv_bytes(shape: dict, length: int, dtype: str = "float16") -> int:
    """K and V bytes a decode step must read: the ``length`` valid rows of both caches."""
    nb, _, hkv, hd, _ = _ints(shape, DECODE_SHAPE_KEYS)
    return 2 * nb * hkv * length * hd * (2 if dtype in DTYPES else 4)


# ---- building -------------------------------------------------------------------------------------

def build(func):
    """``func`` compiled for ``TARGET`` through the tirx pipeline (an Executable; ``.mod`` is the
    runtime module, callable on a GPU, whose CUDA source ``cuda_source`` reads anywhere)."""
    import tvm

    name = func.attrs["global_symbol"]
    return tvm.compile(tvm.IRModule({name: func}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")


def cuda_source(executable) -> str:
    """The CUDA C source of a ``build`` result."""
    return executable.mod.imports[0].inspect_source()
