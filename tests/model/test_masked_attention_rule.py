"""masked_attention in real exports (issue #25): BERT's attention with its attention_mask, as the
TorchScript exporter writes it, becomes one masked_attention kernel per layer under --fusion
patterns (what ``autofuse build`` does: prepare, then build_model) and still matches onnxruntime;
the dynamo export and ViT's unmasked attention are matched too. Grouped-query K/V heads repeated
in front of the attention (Unsqueeze/Expand/Reshape, R.repeat) reach the kernel unrepeated when the
repeat gives query head h K/V head h // group, in the pattern's own graph and in Llama's exports;
a repeat in another order, or a broadcast that is no head repeat, stays in the graph."""

import os

import numpy as np
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import relax

from autofuse.accuracy import compare
from autofuse.measure import param_buffers
from autofuse.model import build as model_build
from autofuse.model.fusion import PATTERN_ATTR, fuse, kernel_names
from autofuse.model.importer import to_relax
from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from conftest import REPO
from search_spaces.attention import masked_attention as ma
from search_spaces.lib.onnx_graphs import typed_model

TARGET = parse_target("llvm")
REAL = os.path.join(REPO, "models", "real")


def test_bert_builds_with_masked_attention_and_matches_onnxruntime(tmp_path):
    prepared = prepare(os.path.join(REAL, "bert-torchscript-fixed.onnx"), "patterns")
    # Two layers: QK^T, the mask add, softmax, the IsNaN/Where guard and PV are one kernel each.
    assert prepared.matches.get("masked_attention") == 2, prepared.matches
    assert "softmax_dropout" not in prepared.matches
    result = build_model(prepared, TARGET, None, str(tmp_path / "bert.so"), repeat=1)
    assert result.verified, result.message
    assert "masked_attention" in result.kernels
    assert not any("isnan" in k or k.startswith("matmul") for k in result.kernels), result.kernels
    decision = next(d for d in result.decisions if d.name == "masked_attention")
    assert decision.pattern == "masked_attention" and decision.applied == "template-default", decision


@pytest.mark.parametrize("model", ["bert-dynamo-fixed", "vit-torchscript-fixed"])
def test_other_exports_match(model):
    matches = prepare(os.path.join(REAL, f"{model}.onnx"), "patterns").matches
    assert matches.get("masked_attention") == 2 and "softmax_dropout" not in matches, matches


# ---- grouped-query K/V repeats -------------------------------------------------------------------

GQA = {"batch": 2, "heads": 4, "kv_heads": 2, "seq_q": 12, "seq_kv": 20, "head_dim": 8, "mask_rows": 12}


def _kv_param_heads(mod):
    """The head counts of the masked_attention kernel's K and V parameters."""
    (func,) = [f for _, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and f.attrs.get(PATTERN_ATTR) == "masked_attention"]
    return [int(buf.shape[1]) for buf in param_buffers(func)[1:3]]


def _repeat_nodes(form, src, shape):
    """Nodes writing ``{src}_heads`` (batch, heads, seq_kv, head_dim) from K or V ``src`` (batch,
    kv_heads, ...), and their initializers, a broadcast that is not the repeat the kernel undoes:
    ``interleaved`` (Unsqueeze at 1, Expand, Reshape: head h gets K/V head h % kv_heads) or
    ``positions`` (Unsqueeze at 3, Expand, Reshape: a head holds rows of several positions)."""
    b, h, kvh, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_kv", "head_dim"))
    g = h // kvh
    axis, group_shape = {"interleaved": (1, [b, g, kvh, s, d]), "positions": (3, [b, kvh, s, g, d])}[form]
    consts = {f"{src}_axis": np.array([axis], np.int64), f"{src}_group_shape": np.array(group_shape, np.int64),
              f"{src}_shape": np.array([b, h, s, d], np.int64)}
    return [helper.make_node("Unsqueeze", [src, f"{src}_axis"], [f"{src}_1"]),
            helper.make_node("Expand", [f"{src}_1", f"{src}_group_shape"], [f"{src}_group"]),
            helper.make_node("Reshape", [f"{src}_group", f"{src}_shape"], [f"{src}_heads"])], consts


def _gqa_graph(form, shape=GQA):
    """masked_attention's ONNX graph at ``shape``, its K/V repeat (``repeat_kv_heads``: Unsqueeze,
    Expand, Reshape) kept (``repeat``) or written as ``_repeat_nodes(form)``."""
    model = ma.onnx_graph(shape, "float32")
    if form == "repeat":
        return model
    graph = model.graph
    repeated = {f"{x}_{suffix}" for x in "kv" for suffix in ("1", "group", "heads")}
    nodes = [n for n in graph.node if not set(n.output) & repeated]
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer
              if t.name not in ("axis2", "group_shape", "heads_shape")}
    for src in "kv":
        more, values = _repeat_nodes(form, src, shape)
        nodes, consts = more + nodes, {**consts, **values}

    def spec(value):
        return value.name, [x.dim_value for x in value.type.tensor_type.shape.dim], "float32"
    return typed_model("masked_attention_gqa", nodes, [spec(x) for x in graph.input], [spec(x) for x in graph.output],
                       consts)


def _fuse_and_run(model, inputs):
    mod, matches = fuse(to_relax(model, "masked_attention_gqa"), "patterns")
    (out,) = model_build.run_vm(model_build.build(mod, TARGET), inputs, tvm.cpu())
    import onnxruntime as ort
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, dict(zip([x.name for x in model.graph.input], inputs)))
    return mod, matches, out, expected


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_repeat_is_folded_into_the_kernel(kv_heads):
    """The repeat's output never reaches the kernel: its K and V parameters have kv_heads heads,
    no repeat is left (the one other kernel copies the mask), and the output is onnxruntime's and
    the reference's."""
    shape = {**GQA, "kv_heads": kv_heads}
    model = _gqa_graph("repeat", shape)
    inputs = ma.make_inputs(shape, "float32", 3)
    mod, matches, out, expected = _fuse_and_run(model, inputs)
    assert matches == {"masked_attention": 1}, matches
    assert _kv_param_heads(mod) == [kv_heads, kv_heads]
    assert kernel_names(mod) == ["fused_reshape_broadcast_to", "masked_attention"]
    for want in (expected, ma.reference(*inputs)):
        check = compare([out], [want], accumulation=shape["seq_kv"])
        assert check.ok, check.message


@pytest.mark.parametrize("form", ["interleaved", "positions"])
def test_other_broadcasts_are_not_folded(form):
    """Query head h reading K/V head h % kv_heads, or a broadcast over positions, is not what the
    kernel's h // group indexing computes: the attention is still matched, on the repeated K/V."""
    model = _gqa_graph(form)
    inputs = ma.make_inputs(GQA, "float32", 4)
    mod, matches, out, expected = _fuse_and_run(model, inputs)
    assert matches == {"masked_attention": 1}, matches
    assert _kv_param_heads(mod) == [GQA["heads"]] * 2
    check = compare([out], [expected], accumulation=GQA["seq_kv"])
    assert check.ok, check.message
    # Not the reference's GQA: folding it would have computed that instead.
    assert not compare([out], [ma.reference(*inputs)], accumulation=GQA["seq_kv"]).ok


@pytest.mark.parametrize("op,folded", [("repeat", True), ("tile", False)])
def test_relax_repeat_and_tile(op, folded):
    """R.repeat(k, group, axis=1) is the kernel's order; R.tile of the head axis (TVM's torch
    frontends write Tensor.repeat so) gives head h K/V head h % kv_heads and stays. (The ONNX
    frontend imports Tile as a TE kernel, not R.tile.) Eager spelling: MatMul, Mul by the scale,
    Add mask, Softmax, MatMul."""
    b, h, kvh, sq, skv, d = (GQA[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    params = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in
              (("q", (b, h, sq, d)), ("k", (b, kvh, skv, d)), ("v", (b, kvh, skv, d)), ("mask", (b, 1, sq, skv)))]
    q, k, v, mask = params
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            k_heads, v_heads = (bb.emit(relax.op.repeat(x, h // kvh, axis=1) if op == "repeat"
                                        else relax.op.tile(x, (1, h // kvh, 1, 1))) for x in (k, v))
            scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k_heads, [0, 1, 3, 2]))))
            scores = bb.emit(relax.op.multiply(scores, relax.const(1 / np.sqrt(d), "float32")))
            probs = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(scores, mask)), axis=-1))
            out = bb.emit_output(relax.op.matmul(probs, v_heads))
        bb.emit_func_output(out)
    mod, matches = fuse(bb.get(), "patterns")
    assert matches == {"masked_attention": 1}, matches
    assert _kv_param_heads(mod) == [kvh if folded else h] * 2
    inputs = ma.make_inputs(GQA, "float32", 5)
    (got,) = model_build.run_vm(model_build.build(mod, TARGET), inputs, tvm.cpu())

    def spread(x):  # the graph's K/V of every query head, for the reference
        return np.repeat(x, h // kvh, axis=1) if op == "repeat" else np.tile(x, (1, h // kvh, 1, 1))
    check = compare([got], [ma.reference(inputs[0], spread(inputs[1]), spread(inputs[2]), inputs[3])],
                    accumulation=skv)
    assert check.ok, check.message


@pytest.mark.parametrize("model", ["llama-torchscript-fixed", "llama-dynamo-fixed"])
def test_llama_attention_reads_unrepeated_kv_heads(model):
    """Llama (4 query heads on 2 K/V heads) repeats K after RoPE and V after its projection; the
    dynamo export reshapes the repeated K to (heads, seq, head_dim) and back around its
    transpose. Both kernels read the 2 K/V heads, and no repeat kernel is left."""
    prepared = prepare(os.path.join(REAL, f"{model}.onnx"), "patterns")
    assert prepared.matches.get("masked_attention") == 2, prepared.matches
    assert _kv_param_heads(prepared.mod) == [2, 2]
    names = kernel_names(prepared.mod)
    assert not any("expand_dims" in name for name in names), names


def test_float16_graph_on_hopper_gets_the_masked_kernel_template(tmp_path):
    """On an sm_90 target a float16 masked_attention at a shape the Hopper kernel takes (GQA, a
    mask row per query) is the tirx kernel template cuda_wgmma_masked (its call passes q, k, v and
    the mask in the PrimFunc's order), and the model's library holds its CUDA source; no GPU needed."""
    import onnx

    from autofuse.model.kernels import apply_database

    h200 = parse_target("h200")
    shape = {"batch": 2, "heads": 8, "kv_heads": 2, "seq_q": 256, "seq_kv": 256, "head_dim": 64, "mask_rows": 256}
    path = str(tmp_path / "masked.onnx")
    onnx.save(ma.onnx_graph(shape, "float16"), path)
    prepared = prepare(path, "patterns")
    assert prepared.matches == {"masked_attention": 1}, prepared.matches
    mod, decisions = apply_database(prepared.mod, None, h200, dev=None)
    (decision,) = [d for d in decisions if d.pattern == "masked_attention"]
    assert "tirx kernel" in decision.note, decision
    (func,) = [f for _, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and f.attrs.get(PATTERN_ATTR) == "masked_attention"]
    assert [tuple(int(d) for d in b.shape) for b in param_buffers(func)] == [
        (2, 8, 256, 64), (2, 2, 256, 64), (2, 2, 256, 64), (2, 1, 256, 256), (2, 8, 256, 64)]
    with h200:
        model_build.build(mod, h200).export_library(str(tmp_path / "masked.so"))
    library = (tmp_path / "masked.so").read_bytes()
    assert b"wgmma.mma_async" in library and b"Mk_ptr" in library
