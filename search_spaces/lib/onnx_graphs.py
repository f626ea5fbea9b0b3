"""ONNX graph pieces: models whose inputs and outputs are not all of one dtype (``typed_model``:
integer indices, masks, quantised weights next to float activations, where
``autofuse.pattern.onnx_model`` gives every tensor the pattern's dtype), and the nodes of attention
as exporters write it (``attention_nodes``, ``repeat_kv_heads``). onnx is imported only when a
graph is built, as the baselines need it."""

import numpy as np


def hidden_score(dtype) -> float:
    """What an exported graph adds to a hidden score: finite, as exporters write it (exp underflows
    to exactly 0 either way): -1e9, or float16's lowest, -65504, where -1e9 would round to -inf."""
    return float(np.finfo(np.float16).min) if str(dtype) == "float16" else -1e9


def typed_model(name, nodes, inputs, outputs, initializers=None, opset=17):
    """A checked ONNX model of ``nodes``; ``inputs`` and ``outputs`` are (name, shape, dtype)
    triples (a numpy dtype or its name), ``initializers`` a dict of numpy constants."""
    import onnx
    from onnx import helper, numpy_helper

    def value_info(name_, shape, dtype):
        return helper.make_tensor_value_info(name_, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape))

    graph = helper.make_graph(list(nodes), name, [value_info(*t) for t in inputs], [value_info(*t) for t in outputs],
                              initializer=[numpy_helper.from_array(np.asarray(v), k)
                                           for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="autofuse")
    onnx.checker.check_model(model)
    return model


def kv_repeat_constants(batch, kv_heads, heads, length, head_dim):
    """The initializers ``repeat_kv_heads`` reads, for K/V of (batch, kv_heads, length, head_dim)."""
    return {"axis2": np.array([2], np.int64),
            "group_shape": np.array([batch, kv_heads, heads // kv_heads, length, head_dim], np.int64),
            "heads_shape": np.array([batch, heads, length, head_dim], np.int64)}


def repeat_kv_heads(src, name):
    """Nodes writing ``{name}_heads``: K or V ``src`` with each K/V head repeated for the query heads
    of its group (Unsqueeze, Expand, Reshape), as exporters write grouped-query attention."""
    from onnx import helper
    return [helper.make_node("Unsqueeze", [src, "axis2"], [f"{name}_1"]),
            helper.make_node("Expand", [f"{name}_1", "group_shape"], [f"{name}_group"]),
            helper.make_node("Reshape", [f"{name}_group", "heads_shape"], [f"{name}_heads"])]


def attention_nodes(q, k, v, out, mask=None):
    """Nodes writing ``out`` = softmax(q k^T * scale [+ mask]) v as exporters write attention:
    Transpose, MatMul, Mul by the initializer ``scale``, Add ``mask`` (when given), Softmax over
    the last axis, MatMul; the score matrix is materialised."""
    from onnx import helper
    nodes = [helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", [q, "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["scores"])]
    logits = "scores"
    if mask is not None:
        nodes.append(helper.make_node("Add", ["scores", mask], ["masked"]))
        logits = "masked"
    return nodes + [helper.make_node("Softmax", [logits], ["probs"], axis=-1),
                    helper.make_node("MatMul", ["probs", v], [out])]
