"""masked_attention: o = softmax(q k^T * scale + mask) v in one kernel, the additive mask as
exporters write it (Hugging Face's attention_mask turned into 0 / finfo.min and broadcast).

scale = 1/sqrt(head_dim); ``mask`` is (batch, 1, mask_rows, seq_kv) in the dtype, added to the
scaled scores of every head, and of every query row when ``mask_rows`` is 1 (padding masks; a row
per query when seq_q: causal + padding as GPT-2 or BERT's SDPA path writes it). Grouped-query K/V
heads as in flash_attention; in a model, K/V that the graph repeats for the query groups (Llama's
Unsqueeze/Expand/Reshape) reach the kernel unrepeated. The kernel is flash_attention's (``lib.attention.flash_attention_func``
with the mask hook: key tiles, online softmax, scores and statistics in float32) and so are its
templates ``flash_tiles`` and ``cuda_flash``. On an sm_90 GPU in float16/bfloat16 the kernel template
``cuda_wgmma_masked`` comes first (head_dim 64 or 128, seq_kv even; elsewhere ``cuda_flash``): flash_attention's ``cuda_wgmma_flash``
(``lib.cuda_attention.prefill_attention``, TMA + wgmma) with ``mask_rows``, each thread adding the
mask words of its accumulator's (row, key) pairs to the scaled scores in float32 before the row max.

A query row whose keys are all masked, as onnxruntime computes the exported graphs: with finfo.min
(BERT's padding mask) every score of the row rounds to the same value, the softmax is uniform and
the row is the mean of V; with -inf (torch's SDPA export of a boolean mask: GPT-2's and Llama's
causal + padding) the softmax is NaN and the graph's IsNaN/Where guard makes the row 0, so a
-inf key adds exactly 0 here and a row without a finite score is 0. (Without the guard, an eager
graph's row would stay NaN; this kernel gives 0 there too.)
"""

import math

import numpy as np

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import FLOAT_DTYPES, Pattern, RelaxRule, ShapeParam, constant_value, dtype_of, static_shape
from search_spaces.lib import cuda_attention
from search_spaces.lib.attention import (BATCH, HEAD_DIM, attention_inputs, chain_top, cuda_flash,
                                         flash_attention_func, flash_tiles, gqa_heads, layout_calls, layout_chain,
                                         unrepeated_heads)
from search_spaces.lib.cuda_wgmma import HOPPER
from search_spaces.lib.onnx_graphs import typed_model

# What a masked key gets, per dtype: its finfo.min, as torch's exporters write it.
MASKED = {"float32": float(np.finfo(np.float32).min), "float16": float(np.finfo(np.float16).min),
          "bfloat16": -3.3895313892515355e38}


def build(shape, dtype):
    return flash_attention_func(shape, dtype, "masked_attention", mask_rows=shape["mask_rows"])


def reference(q, k, v, mask, shape=None):
    """float64: softmax(q k^T / sqrt(head_dim) + mask) v, K/V heads repeated for their query
    groups; a row whose every score is -inf is 0 (the exports' IsNaN/Where guard)."""
    qf, kf, vf, mf = (x.astype(np.float64) for x in (q, k, v, mask))
    group = q.shape[1] // k.shape[1]
    kf, vf = (np.repeat(x, group, axis=1) for x in (kf, vf))
    s = qf @ np.swapaxes(kf, -1, -2) / math.sqrt(q.shape[3]) + mf
    empty = np.isneginf(s).all(axis=-1, keepdims=True)
    s = s - np.where(empty, 0.0, s.max(axis=-1, keepdims=True))
    e = np.exp(s)
    total = np.where(empty, 1.0, e.sum(axis=-1, keepdims=True))
    return (e / total @ vf).astype(q.dtype)


def make_mask(shape, dtype, rng):
    """(batch, 1, mask_rows, seq_kv): batch b's keys past a seeded length masked (padding; batch 0
    keeps all), and with a row per query the end-aligned causal mask too."""
    b, sq, skv, rows = (shape[k] for k in ("batch", "seq_q", "seq_kv", "mask_rows"))
    lengths = [skv] + list(rng.integers(1, skv + 1, size=b - 1))
    j = np.arange(skv)
    visible = np.stack([np.broadcast_to(j < n, (rows, skv)) for n in lengths])[:, None]
    if rows != 1:
        i = np.arange(sq)[:, None]
        visible = visible & (j <= i + (skv - sq))
    return np.where(visible, 0.0, MASKED[dtype]).astype(np.float32).astype(dtype)


def make_inputs(shape, dtype, seed):
    q, k, v = attention_inputs(shape, dtype, seed)
    return [q, k, v, make_mask(shape, dtype, np.random.default_rng(seed + 1))]


def flops(shape):
    # As flash_attention's, every pair counted (the mask is data), plus the mask's add per score.
    pairs = shape["batch"] * shape["heads"] * shape["seq_q"] * shape["seq_kv"]
    return pairs * (4.0 * shape["head_dim"] + 6.0)


def nbytes(shape, dtype):
    b, h, kvh, sq, skv, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    return np.dtype(dtype).itemsize * (b * d * (2 * h * sq + 2 * kvh * skv) + b * shape["mask_rows"] * skv)


def _check_wgmma(shape, dtype, knobs):
    """``lib.cuda_attention.check_prefill`` for a masked shape: mask_rows must be 1 or seq_q."""
    if shape.get("mask_rows") not in (1, shape.get("seq_q")):
        raise cuda_attention.AttentionShapeError(f"mask_rows={shape.get('mask_rows')!r} must be 1 or seq_q")
    return cuda_attention.check_prefill(shape, dtype, knobs)


def _wgmma_prefill(shape, dtype, knobs):
    """FlashAttention with the additive mask on Hopper tensor cores (``lib.cuda_attention.prefill_attention``
    with ``mask_rows``): flash_attention's ``cuda_wgmma_flash`` kernel, each score scaled and its mask
    added in float32 before the row max, a row of -inf keys stored as 0; float16/bfloat16, head_dim
    64 or 128, any seq_q and an even seq_kv (padded last tiles; other shapes fall back to
    ``cuda_flash``)."""
    _check_wgmma(shape, dtype, knobs)
    return cuda_attention.prefill_attention(shape, dtype, knobs)


cuda_wgmma_masked = KernelTemplate("cuda_wgmma_masked", _wgmma_prefill, cuda_attention.PREFILL_KNOBS,
                                   cuda_attention.PREFILL_DEFAULT_KNOBS, _check_wgmma, **HOPPER)


def onnx_graph(shape, dtype):
    """The attention of a Hugging Face model as torch.onnx exports its SDPA path: q and K^T each
    multiplied by sqrt(scale), MatMul, Add mask, Softmax, the IsNaN/Where guard, MatMul v; K/V of
    kv_heads < heads repeated first (Unsqueeze, Expand, Reshape)."""
    from onnx import helper

    from search_spaces.lib.onnx_graphs import kv_repeat_constants, repeat_kv_heads

    b, h, kvh, sq, skv, d, rows = (shape[k] for k in
                                   ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim", "mask_rows"))
    consts = {"root_scale": np.array(math.sqrt(1.0 / math.sqrt(d)), dtype=dtype), "zero": np.array(0.0, dtype=dtype)}
    nodes, k_in, v_in = [], "k", "v"
    if kvh != h:
        consts.update(kv_repeat_constants(b, kvh, h, skv, d))
        nodes += repeat_kv_heads("k", "k") + repeat_kv_heads("v", "v")
        k_in, v_in = "k_heads", "v_heads"
    nodes += [helper.make_node("Mul", ["q", "root_scale"], ["qs"]),
              helper.make_node("Transpose", [k_in], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("Mul", ["kt", "root_scale"], ["kts"]),
              helper.make_node("MatMul", ["qs", "kts"], ["scores"]),
              helper.make_node("Add", ["scores", "mask"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("IsNaN", ["probs"], ["nan"]),
              helper.make_node("Where", ["nan", "zero", "probs"], ["guarded"]),
              helper.make_node("MatMul", ["guarded", v_in], ["o"])]
    return typed_model("masked_attention", nodes,
                       [("q", (b, h, sq, d), dtype), ("k", (b, kvh, skv, d), dtype), ("v", (b, kvh, skv, d), dtype),
                        ("mask", (b, 1, rows, skv), dtype)], [("o", (b, h, sq, d), dtype)], consts)


def sdpa(torch, shape, q, k, v, mask):
    """torch's scaled_dot_product_attention with the float mask added to the scores."""
    return [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=shape["kv_heads"] != shape["heads"])]


# ---- Relax rule ---------------------------------------------------------------------------------
#
# Two spellings of the scaled scores: torch.onnx's export of SDPA (transformers' default) multiplies
# q and K^T by sqrt(scale) each before the MatMul; eager attention multiplies or divides the
# MatMul's result. Then an optional additive mask, Softmax, the optional IsNaN/Where guard and the
# MatMul with v. K^T is taken as the graph has it (any permute/reshape chain: the rewrite
# transposes it back, a copy FuseOps merges into the chain), unless the chains above K^T and V
# repeat K/V heads for grouped-query attention: then the kernel reads the unrepeated heads.

def _relax_pattern(spelling):
    def make():
        from tvm.relax.dpl import is_const, is_op, wildcard

        named = {"q": wildcard(), "mask": wildcard(), "zero": is_const()}
        kt, v = layout_chain(named, "kt"), layout_chain(named, "v")
        if spelling == "sdpa":
            named.update(q_scale=is_const(), k_scale=is_const())
            scores = is_op("relax.matmul")(is_op("relax.multiply")(named["q"], named["q_scale"]),
                                           is_op("relax.multiply")(kt, named["k_scale"]))
        else:
            named.update(mul_scale=is_const(), div_scale=is_const())
            qk = is_op("relax.matmul")(named["q"], kt)
            scores = is_op("relax.multiply")(qk, named["mul_scale"]) | is_op("relax.divide")(qk, named["div_scale"])
        named["probs"] = is_op("relax.nn.softmax")(is_op("relax.add")(scores, named["mask"]) | scores)
        named["guard"] = is_op("relax.where")(is_op("relax.isnan")(named["probs"]), named["zero"], named["probs"])
        root = is_op("relax.matmul")(named["guard"] | named["probs"], v)
        return root, named
    return make


def _scalar(matched, name):
    value = constant_value(matched[name])
    return float(value.reshape(())) if value.size == 1 else None


def _scale(matched):
    """The factor the graph scales the scores by, or None."""
    if "q_scale" in matched:
        a, b = _scalar(matched, "q_scale"), _scalar(matched, "k_scale")
        return None if a is None or b is None else a * b
    if "mul_scale" in matched:
        return _scalar(matched, "mul_scale")
    div = _scalar(matched, "div_scale")
    return None if not div else 1.0 / div


def _relax_rewrite(matched, kernel):
    """softmax(q @ kt * 1/sqrt(d) [+ mask]) @ v over (batch, heads, seq, head_dim) tensors of one
    of the pattern's dtypes; the mask (an expression of the dtype; on the eager spelling not a
    constant) must broadcast to (batch, 1, 1 or seq_q, seq_kv), and the guard, when there, replace
    NaN by 0. K^T and V repeated head by head from kv_heads < heads (query head h reads K/V head
    h // group) give the kernel the unrepeated ones; a repeat in another order stays in the graph.
    Anything else is left alone."""
    import tvm
    from tvm import relax

    q, kt, v = matched["q"], chain_top(matched, "kt"), chain_top(matched, "v")
    dtype = dtype_of(q)
    qs, kts, vs = static_shape(q), static_shape(kt), static_shape(v)
    if dtype not in FLOAT_DTYPES or qs is None or len(qs) != 4 or any(dtype_of(x) != dtype for x in (kt, v)):
        return None
    batch, heads, seq_q, head_dim = qs
    if kts is None or len(kts) != 4 or kts[:3] != (batch, heads, head_dim):
        return None
    seq_kv = kts[3]
    if vs != (batch, heads, seq_kv, head_dim) or int(matched["probs"].attrs.axis) not in (-1, 3):
        return None
    if "guard" in matched and np.any(constant_value(matched["zero"]) != 0):
        return None
    factor = _scale(matched)
    # 1/sqrt(d) as the graph's dtype holds it (a half graph's sqrt(scale) is rounded twice).
    tol = 1e-6 if dtype == "float32" else 4e-3
    if factor is None or not math.isclose(factor, 1.0 / math.sqrt(head_dim), rel_tol=tol):
        return None
    if "mask" in matched:
        mask = matched["mask"]
        # A constant mask on the eager spelling is flash_attention's causal one (its rule ran
        # first) or none an exporter writes from attention_mask: left to the smaller rules.
        if "q_scale" not in matched and isinstance(mask, tvm.ir.expr.Constant):
            return None
        ms = static_shape(mask)
        if ms is None or len(ms) > 4 or dtype_of(mask) != dtype:
            return None
        mb, mh, rows, mk = (1,) * (4 - len(ms)) + ms
        if mb not in (1, batch) or mh != 1 or rows not in (1, seq_q) or mk != seq_kv:
            return None
        mask = relax.op.broadcast_to(relax.op.reshape(mask, (mb, 1, rows, seq_kv)), (batch, 1, rows, seq_kv))
    else:
        rows = 1
        mask = relax.const(np.zeros((batch, 1, 1, seq_kv), dtype), dtype)
    k, kv_heads = relax.op.permute_dims(kt, [0, 1, 3, 2]), heads
    # GQA: K/V read once per query group instead of the repeat's copies.
    k_src = unrepeated_heads(layout_calls(matched, "kt"), batch, heads, seq_kv, head_dim, transposed=True)
    v_src = unrepeated_heads(layout_calls(matched, "v"), batch, heads, seq_kv, head_dim)
    if k_src and v_src and k_src[1] == v_src[1]:
        (k, kv_heads), (v, _) = k_src, v_src
    shape = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq_q": seq_q, "seq_kv": seq_kv,
             "head_dim": head_dim, "mask_rows": rows}
    return kernel(shape, dtype, [q, k, v, mask])


PATTERN = Pattern.from_module(
    globals(),
    description="softmax(q k^T / sqrt(d) + mask) v in one kernel, the additive mask broadcast over heads "
                "(and query rows), online softmax over key tiles",
    shape_params=[BATCH.with_sizes(2, 2), *gqa_heads((8, 2), (8, 2)), ShapeParam("seq_q", 128, 16, "query positions"),
                  ShapeParam("seq_kv", 128, 16, "key/value positions"), HEAD_DIM,
                  ShapeParam("mask_rows", 1, 1, "rows of the mask: 1 (one per batch, e.g. padding) or seq_q")],
    templates=[flash_tiles, cuda_wgmma_masked, cuda_flash],
    # After flash_attention's rule (10: its causal constant mask and unmasked forms), before
    # softmax_dropout's (0), which would otherwise take the softmax out of the attention.
    relax_rules=[RelaxRule("attention_sdpa_export", _relax_pattern("sdpa"), _relax_rewrite, priority=5),
                 RelaxRule("attention_scaled_scores", _relax_pattern("eager"), _relax_rewrite, priority=5)],
)
