"""masked_attention: the additive mask as exporters write it (0 / finfo.min or -inf, broadcast over
heads and over query rows or not), padded keys, a query row with every key masked, flash_tiles on the
new pattern, flash_attention's TensorIR unchanged by the shared builder, and the Relax rules on
small ONNX graphs of Hugging Face's forms (tests/model/test_masked_attention_rule.py builds BERT)."""

import math

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import helper

from autofuse.accuracy import compare
from autofuse.model import build as model_build
from autofuse.model.fusion import fuse
from autofuse.model.importer import to_relax
from autofuse.target import parse_target
from search_spaces.attention import flash_attention as fa
from search_spaces.attention import masked_attention as ma

TARGET = parse_target("llvm")
DEV = tvm.cpu()


def _shape(seq_q, seq_kv, mask_rows=1, heads=2, kv_heads=None, batch=3, head_dim=8):
    return {"batch": batch, "heads": heads, "kv_heads": heads if kv_heads is None else kv_heads, "seq_q": seq_q,
            "seq_kv": seq_kv, "head_dim": head_dim, "mask_rows": mask_rows}


def _run(shape, schedule, inputs):
    func = ma.build(shape, "float32")
    mod = ma.flash_tiles.apply(func, TARGET, tunable=False).mod if schedule else tvm.IRModule({"main": func})
    rt = tvm.tirx.build(mod, target=TARGET)
    out = tvm.runtime.tensor(np.zeros_like(inputs[0]), DEV)
    rt(*[tvm.runtime.tensor(x, DEV) for x in inputs], out)
    return out.numpy()


def _naive(q, k, v, mask):
    """Row by row from the definition (float64): scores / sqrt(d) + the mask's row, softmax, P.V."""
    group = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                s = k[b, h // group].astype(np.float64) @ q[b, h, i] / math.sqrt(q.shape[3])
                s = s + mask[b, 0, i if mask.shape[2] > 1 else 0]
                p = np.exp(s - s.max())
                out[b, h, i] = p / p.sum() @ v[b, h // group].astype(np.float64)
    return out


# 70 keys: a 64-key tile and a padded tile of 6; 40 < KV_TILE: one tile; 12 x 12 a row per query
# (causal + padding); GQA 4 query heads on 2 K/V heads.
CASES = [dict(seq_q=12, seq_kv=70), dict(seq_q=12, seq_kv=70, mask_rows=12), dict(seq_q=5, seq_kv=40),
         dict(seq_q=12, seq_kv=12, mask_rows=12, heads=4, kv_heads=2)]


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "flash_tiles"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_kernel_matches_definition(case, schedule):
    shape = _shape(**case)
    inputs = ma.make_inputs(shape, "float32", 5)
    mask = inputs[3]
    # make_inputs pads: batch 0's last row sees every key, the other batches fewer (finfo.min)
    assert np.all(mask[0, 0, -1] == 0) and np.any(mask[1:] == np.finfo(np.float32).min)
    out = _run(shape, schedule, inputs)
    np.testing.assert_allclose(out, _naive(*inputs), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, ma.reference(*inputs), rtol=1e-4, atol=1e-5)


def test_masked_keys_change_nothing():
    # Batch 1's keys past its length are masked: any change to their K or V leaves the output as it was.
    shape = _shape(12, 70)
    q, k, v, mask = ma.make_inputs(shape, "float32", 6)
    hidden = mask[1, 0, 0] != 0
    assert hidden.any() and not hidden.all()
    out = _run(shape, True, [q, k, v, mask])
    k2, v2 = k.copy(), v.copy()
    k2[1, :, hidden] += 3.0
    v2[1, :, hidden] += 10.0
    np.testing.assert_array_equal(_run(shape, True, [q, k2, v2, mask]), out)


def test_one_mask_row_is_every_query_rows_mask():
    shape = _shape(12, 70)
    q, k, v, mask = ma.make_inputs(shape, "float32", 7)
    rows = {**shape, "mask_rows": 12}
    np.testing.assert_allclose(_run(shape, True, [q, k, v, mask]),
                               _run(rows, True, [q, k, v, np.repeat(mask, 12, axis=2)]), rtol=1e-6, atol=1e-7)


def _ort(model, inputs):
    import onnxruntime as ort
    names = [i.name for i in model.graph.input]
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))[0]


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "flash_tiles"])
def test_fully_masked_row_gives_what_onnxruntime_gives(schedule):
    """finfo.min on every key of a row (a query that is itself padding): every score rounds to
    finfo.min, the softmax is uniform and the row is the mean of V; onnxruntime computes the same
    (no NaN, so the IsNaN/Where guard of the exported graph changes nothing)."""
    shape = _shape(12, 70, mask_rows=12)
    q, k, v, mask = ma.make_inputs(shape, "float32", 8)
    mask[2, 0, 3] = np.finfo(np.float32).min
    mask[0, 0, 11] = np.finfo(np.float32).min
    out = _run(shape, schedule, [q, k, v, mask])
    expected = _ort(ma.onnx_graph(shape, "float32"), [q, k, v, mask])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[2, :, 3], v[2].mean(axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, ma.reference(q, k, v, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "flash_tiles"])
def test_minus_inf_mask_gives_what_the_guarded_graph_gives(schedule):
    """-inf (torch's SDPA export of a boolean mask, GPT-2's and Llama's causal + padding): a masked
    key adds exactly 0, and a row with no finite score is 0, what onnxruntime's NaN becomes
    through the graph's IsNaN/Where guard."""
    shape = _shape(12, 70, mask_rows=12)
    q, k, v, mask = ma.make_inputs(shape, "float32", 9)
    mask = np.where(mask == 0, 0.0, -np.inf).astype(np.float32)
    mask[1, 0, 4] = -np.inf
    out = _run(shape, schedule, [q, k, v, mask])
    assert np.isfinite(out).all() and np.all(out[1, :, 4] == 0)
    np.testing.assert_allclose(out, _ort(ma.onnx_graph(shape, "float32"), [q, k, v, mask]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, ma.reference(q, k, v, mask), rtol=1e-4, atol=1e-5)


def test_shape_rule():
    with pytest.raises(ValueError, match="mask_rows must be 1 or seq_q"):
        ma.build(_shape(12, 70, mask_rows=5), "float32")


# flash_attention's TensorIR, as built before its builder moved to lib.attention (structural
# hashes key its stored tuning records): the shared builder must leave it alone.
FLASH_HASHES = {"default": 9598951557438930317, "small": 15745302171169774356}


@pytest.mark.parametrize("which", sorted(FLASH_HASHES))
def test_flash_attention_tensorir_unchanged(which):
    shape = fa.PATTERN.default_shape() if which == "default" else fa.PATTERN.small_shape()
    assert tvm_ffi.structural_hash(fa.build(shape, "float32")) == FLASH_HASHES[which]


# ---- the Relax rules on graphs of the exporters' forms -------------------------------------------

def _hf_graph(form, b=2, h=2, s=12, d=8, mask="padding", scale=None):
    """Attention over inputs q (b, h, s, d), k as the projection writes it (b, s, h, d) and v
    (b, h, s, d), as torch.onnx writes transformers' attention:

    - ``sdpa``: q and K^T (Transpose perm 0,2,3,1) each multiplied by sqrt(scale), MatMul, Add
      mask, Softmax, IsNaN/Where guard, MatMul v (the TorchScript export of the SDPA path);
    - ``eager``: MatMul(q, K^T), Div by sqrt(d), Add mask, Softmax, MatMul v;
    mask ``padding`` (b, 1, 1, s) from a float input, ``rows`` (b, 1, s, s), ``heads`` (b, h, s, s:
    not one the kernel takes), ``none`` (ViT), ``constant`` (s, s) shifted causal, an initializer."""
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    inits = {"root": np.array(math.sqrt(scale), np.float32), "div": np.array(1.0 / scale, np.float32),
             "zero": np.array(0.0, np.float32)}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1])]
    if form == "sdpa":
        nodes += [helper.make_node("Mul", ["q", "root"], ["qs"]), helper.make_node("Mul", ["kt", "root"], ["kts"]),
                  helper.make_node("MatMul", ["qs", "kts"], ["scores"])]
    else:
        nodes += [helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Div", ["qk", "div"], ["scores"])]
    logits = "scores"
    mask_shape = {"padding": (b, 1, 1, s), "rows": (b, 1, s, s), "heads": (b, h, s, s)}.get(mask)
    if mask_shape or mask == "constant":
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"]))
        logits = "masked"
    if mask == "constant":
        inits["mask"] = np.where(np.arange(s)[None, :] <= np.arange(s)[:, None] + 1, 0.0, -1e9).astype(np.float32)
    nodes.append(helper.make_node("Softmax", [logits], ["probs"], axis=-1))
    probs = "probs"
    if form == "sdpa":
        nodes += [helper.make_node("IsNaN", ["probs"], ["nan"]), helper.make_node("Where", ["nan", "zero", "probs"],
                                                                                  ["guarded"])]
        probs = "guarded"
    nodes.append(helper.make_node("MatMul", [probs, "v"], ["o"]))
    inputs = [("q", (b, h, s, d), "float32"), ("k", (b, s, h, d), "float32"), ("v", (b, h, s, d), "float32")]
    if mask_shape:
        inputs.append(("mask", mask_shape, "float32"))
    from search_spaces.lib.onnx_graphs import typed_model
    return typed_model("hf_attention", nodes, inputs, [("o", (b, h, s, d), "float32")], inits)


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    feeds = []
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "mask":
            # padding of the last keys of batch 1, one query row of batch 1 fully masked where it has rows
            x = np.zeros(shape, np.float32)
            x[1, ..., -5:] = np.finfo(np.float32).min
            if shape[2] > 1:
                x[1, ..., 2, :] = np.finfo(np.float32).min
            feeds.append(x)
        else:
            feeds.append(rng.standard_normal(shape).astype(np.float32))
    return feeds


def _matches_and_run(model):
    mod, matches = fuse(to_relax(model, "hf_attention"), "patterns")
    feeds = _feeds(model)
    out = model_build.run_vm(model_build.build(mod, TARGET), feeds, DEV)
    return matches, out, _ort(model, feeds)


@pytest.mark.parametrize("form,mask", [("sdpa", "padding"), ("sdpa", "rows"), ("eager", "padding"),
                                       ("sdpa", "none")])
def test_rule_takes_the_exported_attention(form, mask):
    model = _hf_graph(form, mask=mask)
    onnx.checker.check_model(model)
    matches, (out,), expected = _matches_and_run(model)
    assert matches == {"masked_attention": 1}
    check = compare([out], [expected], accumulation=12)
    assert check.ok, check.message


@pytest.mark.parametrize("why", ["per-head mask", "other scale", "constant mask, eager"])
def test_rule_leaves_other_attention_alone(why):
    model = {"per-head mask": lambda: _hf_graph("sdpa", mask="heads"),
             "other scale": lambda: _hf_graph("eager", scale=0.5 / math.sqrt(8)),
             "constant mask, eager": lambda: _hf_graph("eager", mask="constant")}[why]()
    matches, (out,), expected = _matches_and_run(model)
    assert "masked_attention" not in matches and matches.get("softmax_dropout") == 1
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
