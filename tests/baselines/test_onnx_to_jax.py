"""The XLA baseline runs the same computation as onnxruntime: every bundled model through
jax.jit matches it; an op without a translation is named."""

import os

import numpy as np
import pytest

from autofuse.errors import AutofuseError
from conftest import REPO

import onnx_cases

jax = pytest.importorskip("jax")


@pytest.mark.parametrize("name", ["mlp", "transformer_block", "conv_block"])
def test_bundled_models_match_onnxruntime(name):
    import onnx
    import onnxruntime as ort

    from autofuse.baselines.onnx_to_jax import jax_function
    from autofuse.model.importer import random_inputs

    path = os.path.join(REPO, "models", f"{name}.onnx")
    model = onnx.load(path)
    feeds = random_inputs(model, 1)
    got = jax.jit(jax_function(model))(*feeds.values())
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-4, atol=1e-4)


def test_uint32_hash_arithmetic_wraps_as_in_onnxruntime():
    import onnxruntime as ort
    from onnx import helper

    from autofuse.baselines.onnx_to_jax import jax_function
    from autofuse.pattern import onnx_model

    consts = {"c": np.array(0x85EBCA6B, np.uint32), "s": np.array(13, np.uint32)}
    nodes = [helper.make_node("BitShift", ["x", "s"], ["t"], direction="RIGHT"),
             helper.make_node("BitwiseXor", ["x", "t"], ["u"]), helper.make_node("Mul", ["u", "c"], ["y"])]
    model = onnx_model("hash", nodes, [("x", (64,))], [("y", (64,))], "uint32", consts, opset=18)
    x = np.arange(1 << 30, (1 << 30) + 64 * 997, 997, dtype=np.uint32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_function(model))(x)[0]), expected[0])


def test_an_op_without_translation_is_named():
    from onnx import helper

    from autofuse.baselines.onnx_to_jax import jax_function, unsupported_ops
    from autofuse.pattern import onnx_model

    model = onnx_model("m", [helper.make_node("LpNormalization", ["x"], ["y"])], [("x", (4,))], [("y", (4,))],
                       "float32")
    assert unsupported_ops(model) == ["LpNormalization"]
    with pytest.raises(AutofuseError, match="LpNormalization"):
        jax_function(model)


def _ort(model, feeds):
    import onnxruntime as ort
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("name", ["moe_gate_topk", "int8_matmul_dequant", "spec_accept"])
def test_pattern_graphs_with_selection_and_integer_ops_match_onnxruntime(name):
    """TopK, ScatterElements and Einsum (moe), MatMulInteger (int8), CumSum and GatherElements
    (spec_accept): the ops these patterns' graphs need for the XLA baseline."""
    from autofuse.baselines.onnx_to_jax import jax_function, unsupported_ops
    from autofuse.registry import get_pattern

    pattern = get_pattern(name)
    shape, dtype = pattern.small_shape(), pattern.dtypes[0]
    model = pattern.onnx_graph(shape, dtype)
    assert unsupported_ops(model) == []
    inputs = pattern.make_inputs(shape, dtype, 3)
    names = [value.name for value in model.graph.input]
    got = jax.jit(jax_function(model))(*inputs)
    for g, e in zip(got, _ort(model, dict(zip(names, inputs)))):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-5)


def _one_node_model(op, inputs, outputs, consts=None, dtype="float32", **attrs):
    from onnx import helper

    from autofuse.pattern import onnx_model

    node = helper.make_node(op, [name for name, _ in inputs] + list(consts or {}), [name for name, _ in outputs], **attrs)
    return onnx_model("m", [node], inputs, outputs, dtype, consts or {}, opset=18)


@pytest.mark.parametrize("attrs", [{}, {"largest": 0}, {"axis": 0}, {"axis": 0, "largest": 0}])
def test_top_k_orders_ties_by_index_on_any_axis(attrs):
    from onnx import TensorProto, helper

    from autofuse.baselines.onnx_to_jax import jax_function

    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], **attrs)
    graph = helper.make_graph([node], "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (6, 5))],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                              [helper.make_tensor("k", TensorProto.INT64, (1,), [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).integers(0, 3, (6, 5)).astype(np.float32)  # many ties
    got = jax.jit(jax_function(model))(x)
    for g, e in zip(got, _ort(model, {"x": x})):
        np.testing.assert_array_equal(np.asarray(g), e)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_exclusive_and_reverse(exclusive, reverse):
    from autofuse.baselines.onnx_to_jax import jax_function

    model = _one_node_model("CumSum", [("x", (3, 7))], [("y", (3, 7))], {"axis": np.array(1, np.int64)},
                            exclusive=exclusive, reverse=reverse)
    x = np.random.default_rng(1).standard_normal((3, 7)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(jax_function(model))(x)[0]), _ort(model, {"x": x})[0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_and_gather_elements_with_negative_indices(reduction):
    from autofuse.baselines.onnx_to_jax import OPS, Node

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    indices = np.array([[0, -1], [2, 1], [-4, 3]], np.int64)
    updates = np.full((3, 2), 10.0, np.float32)
    attrs = {"axis": 1} if reduction == "none" else {"axis": 1, "reduction": reduction}
    scatter = _one_node_model("ScatterElements", [("x", (3, 4)), ("i", (3, 2)), ("u", (3, 2))], [("y", (3, 4))],
                              **attrs)
    # The graph's inputs are all float32 in onnx_model: index tensors go through ORT as int64 anyway.
    scatter.graph.input[1].type.tensor_type.elem_type = 7
    expected = _ort(scatter, {"x": x, "i": indices, "u": updates})[0]
    node = Node("ScatterElements", attrs, 18)
    import jax.numpy as jnp
    np.testing.assert_array_equal(np.asarray(OPS["ScatterElements"](jnp, node, jnp.asarray(x), jnp.asarray(indices),
                                                                   jnp.asarray(updates))), expected)
    np.testing.assert_array_equal(OPS["ScatterElements"](np, node, x, indices, updates), expected)
    gathered = OPS["GatherElements"](jnp, Node("GatherElements", {"axis": 1}, 18), jnp.asarray(x), jnp.asarray(indices))
    np.testing.assert_array_equal(np.asarray(gathered), np.take_along_axis(x, indices % 4, axis=1))


def test_matmul_integer_with_zero_points_matches_onnxruntime():
    from onnx import TensorProto, helper

    from autofuse.baselines.onnx_to_jax import jax_function

    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    graph = helper.make_graph([node], "m", [helper.make_tensor_value_info("a", TensorProto.UINT8, (4, 8)),
                                            helper.make_tensor_value_info("b", TensorProto.UINT8, (8, 3))],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [helper.make_tensor("az", TensorProto.UINT8, (), [7]),
                               helper.make_tensor("bz", TensorProto.UINT8, (), [130])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 256, (4, 8)).astype(np.uint8), rng.integers(0, 256, (8, 3)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_function(model))(a, b)[0]), _ort(model, {"a": a, "b": b})[0])


@pytest.mark.parametrize("case", onnx_cases.CASES, ids=lambda c: c.__name__)
def test_ops_of_exported_models_match_onnxruntime(case):
    """IsNaN, ConstantOfShape, HardSigmoid, HardSwish, MaxPool, Split, GatherND, Range, Sin, Cos:
    what HF and torchvision exports add to the table."""
    from autofuse.baselines.onnx_to_jax import jax_function

    model, feeds = case()
    got = jax.jit(jax_function(model))(*feeds.values())
    expected = onnx_cases.onnxruntime_outputs(model, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-6, atol=1e-6)
