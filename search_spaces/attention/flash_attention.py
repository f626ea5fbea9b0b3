"""flash_attention: o = softmax(q k^T * scale [+ causal mask]) v in one kernel, FlashAttention style.

scale = 1/sqrt(head_dim); the causal mask is aligned at the end (key j visible to query i when
j <= i + seq_kv - seq_q, as in decoding with a KV cache); grouped-query: query head h reads K/V head
h // (heads // kv_heads). Unfused, the score matrix is written and read back three times; here it
never exists: keys go by in tiles of ``KV_TILE`` (fixed at build time; a padded last tile is
masked) with the online-softmax recurrence per query row (running max m, rescale alpha, sum l,
output acc; o = acc / l after the last tile).

How the recurrence fits TensorIR: every buffer has one writer, and the running state is written
only by reduction blocks over the tile index ``t`` (``T.init`` is the state before the first tile),
so TVM takes the nest as compact dataflow and its loops can be scheduled. The per-tile blocks bind
``t`` as a spatial axis indexing no buffer: their KV_TILE-wide scratch is overwritten per tile,
right only because no template parallelises or reorders ``t``. seq_q and seq_kv may be int64
``tirx.Var``s, one function for every run-time length (``autofuse.dynamic``).

Templates: ``flash_tiles`` (CPU: query tiles in parallel, each K/V tile reused from L1 by a tile's
rows) and ``cuda_flash`` (FlashAttention-2 on SIMT cores: a block per (batch, head, query tile),
K/V tiles in shared memory, the running state in registers). Scores, statistics and acc are float32
in every dtype. On an sm_90 GPU in float16/bfloat16 the kernel template ``cuda_wgmma_flash`` comes
first where its tiles fit (``lib.cuda_attention``'s tensor-core prefill, written in the tirx script).
"""

import math

import numpy as np

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import FLOAT_DTYPES, Pattern, RelaxRule, ShapeParam, constant_value, dtype_of, static_shape
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (BATCH, HEAD_DIM, KV_TILE, attention_graph, cuda_flash,  # noqa: F401
                                         flash_attention_func, flash_tiles, gqa_heads, kv_tile, sdpa)
from search_spaces.lib.attention import attention_inputs as make_inputs
from search_spaces.lib.attention import attention_reference as reference
from search_spaces.lib.cuda_wgmma import HOPPER


def build(shape, dtype):
    return flash_attention_func(shape, dtype)


def visible_pairs(shape):
    """(query, key) pairs the mask lets through, per batch and head."""
    sq, skv = shape["seq_q"], shape["seq_kv"]
    if not int(shape.get("causal", 0)):
        return sq * skv
    off = skv - sq
    return sum(min(skv, max(0, i + off + 1)) for i in range(sq))


def flops(shape):
    # Two multiply-adds per (pair, head_dim element) for q.k and p.v, plus ~5 per score for the
    # scale/max/exp/sum; counted over the visible pairs (the useful work).
    bh = shape["batch"] * shape["heads"]
    return bh * visible_pairs(shape) * (4.0 * shape["head_dim"] + 5.0)


def nbytes(shape, dtype):
    b, h, kvh, sq, skv, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    # q and o per query head, K and V per K/V head.
    return np.dtype(dtype).itemsize * b * d * (2 * h * sq + 2 * kvh * skv)


def _wgmma_prefill(shape, dtype, knobs):
    """FlashAttention on Hopper tensor cores (``lib.cuda_attention.prefill_attention``): TMA
    producer warpgroup, two wgmma consumer warpgroups of 64 query rows, online softmax in
    registers; float16/bfloat16, head_dim 64 or 128, any seq_q and seq_kv (padded last tiles; other
    shapes fall back to ``cuda_flash``)."""
    return cuda_attention.prefill_attention(shape, dtype, knobs)


cuda_wgmma_flash = KernelTemplate("cuda_wgmma_flash", _wgmma_prefill, cuda_attention.PREFILL_KNOBS,
                                  cuda_attention.PREFILL_DEFAULT_KNOBS, cuda_attention.check_prefill, **HOPPER)


def onnx_graph(shape, dtype):
    return attention_graph("flash_attention", shape, dtype)


def _relax_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    named = {}

    def maybe_repeated(name):
        # K/V heads repeated for grouped-query attention, as exporters write it (Unsqueeze,
        # Expand, Reshape): matched so that the kernel gets the unrepeated heads.
        named[f"{name}0"], named[f"{name}_plain"] = wildcard(), wildcard()
        named[f"{name}_expand"] = is_op("relax.expand_dims")(named[f"{name}0"])
        named[f"{name}_broadcast"] = is_op("relax.broadcast_to")(named[f"{name}_expand"], wildcard())
        return is_op("relax.reshape")(named[f"{name}_broadcast"], wildcard()) | named[f"{name}_plain"]

    named.update(q=wildcard(), scale=is_const(), mask=is_const())
    named["kt"] = is_op("relax.permute_dims")(maybe_repeated("k"))
    scores = is_op("relax.multiply")(is_op("relax.matmul")(named["q"], named["kt"]), named["scale"])
    named["probs"] = is_op("relax.nn.softmax")(is_op("relax.add")(scores, named["mask"]) | scores)
    root = is_op("relax.matmul")(named["probs"], maybe_repeated("v"))
    return root, named


def _kv_heads(matched, name, batch, heads, seq, head_dim):
    """K/V heads behind a matched K or V: its own heads, or those a GQA repeat started from."""
    plain = matched.get(f"{name}_plain")
    if plain is not None:
        return static_shape(plain) == (batch, heads, seq, head_dim) and heads
    source = matched[f"{name}0"]
    shape = static_shape(source)
    if shape is None or len(shape) != 4:
        return None
    b, kv_heads, s, d = shape
    if (b, s, d) != (batch, seq, head_dim) or heads % kv_heads:
        return None
    # The repeat must put copy g of kv head j at head j*group + g (what h // group undoes):
    # expand_dims at axis 2, then broadcast to (b, kv_heads, group, seq, d).
    axes = [int(a) for a in matched[f"{name}_expand"].attrs.axis]
    if axes != [2] or static_shape(matched[f"{name}_broadcast"]) != (b, kv_heads, heads // kv_heads, s, d):
        return None
    return kv_heads


def _relax_rewrite(matched, kernel):
    """softmax(q @ k^T * 1/sqrt(d) [+ causal mask]) @ v over (batch, heads, seq, head_dim)
    tensors of one of the pattern's dtypes; k and v may be GQA-repeated from fewer heads (then the
    kernel gets the unrepeated ones). The mask must be the end-aligned causal one (0 visible, <= -1e4 hidden);
    any other mask, scale or softmax axis leaves the graph alone."""
    q, scale = matched["q"], matched["scale"]
    qs = static_shape(q)
    dtype = dtype_of(q)
    if qs is None or len(qs) != 4 or dtype not in FLOAT_DTYPES:
        return None
    batch, heads, seq_q, head_dim = qs
    probs_shape = static_shape(matched["probs"])
    if probs_shape is None or probs_shape[:3] != (batch, heads, seq_q):
        return None
    seq_kv = probs_shape[3]
    if [int(a) for a in matched["kt"].attrs.axes] != [0, 1, 3, 2]:
        return None
    if int(matched["probs"].attrs.axis) not in (-1, 3):
        return None
    factor = constant_value(scale)
    # 1/sqrt(d) as the graph's dtype holds it (a float16 graph's scale is rounded to float16)
    if factor.size != 1 or not math.isclose(float(factor.reshape(())),
                                            float(np.asarray(1.0 / math.sqrt(head_dim), factor.dtype)), rel_tol=1e-6):
        return None
    causal = 0
    if "mask" in matched:
        mask = constant_value(matched["mask"])
        if mask.shape[-2:] != (seq_q, seq_kv) or mask.size != seq_q * seq_kv:
            return None
        mask = mask.reshape(seq_q, seq_kv)
        i, j = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
        visible = j <= i + (seq_kv - seq_q)
        if not (np.all(mask[visible] == 0) and np.all(mask[~visible] <= -1e4)) or seq_q > seq_kv:
            return None
        causal = 1
    kv = [_kv_heads(matched, n, batch, heads, seq_kv, head_dim) for n in ("k", "v")]
    if not kv[0] or kv[0] != kv[1]:
        return None
    k = matched.get("k_plain", matched.get("k0"))
    v = matched.get("v_plain", matched.get("v0"))
    if dtype_of(k) != dtype or dtype_of(v) != dtype:
        return None
    shape = {"batch": batch, "heads": heads, "kv_heads": kv[0], "seq_q": seq_q, "seq_kv": seq_kv,
             "head_dim": head_dim, "causal": causal}
    return kernel(shape, dtype, [q, k, v])


PATTERN = Pattern.from_module(
    globals(),
    description="softmax(q k^T / sqrt(d) [+ causal mask]) v in one kernel, online softmax over key tiles",
    shape_params=[BATCH, *gqa_heads((8, 2), (8, 2)), ShapeParam("seq_q", 256, 16, "query positions"),
                  ShapeParam("seq_kv", 256, 16, "key/value positions (any length; tiles of KV_TILE)"), HEAD_DIM,
                  ShapeParam("causal", 1, 1, "1: key j visible to query i iff j <= i + seq_kv - seq_q",
                             minimum=0)],
    templates=[flash_tiles, cuda_wgmma_flash, cuda_flash],
    # Before softmax_dropout's rule, which would otherwise take the softmax out of the attention.
    relax_rules=[RelaxRule("attention", _relax_pattern, _relax_rewrite, priority=10)],
)
