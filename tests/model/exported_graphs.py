"""Small ONNX graphs in the shapes torch.onnx writes for Hugging Face modules (the TorchScript
exporter at opset 17, the dynamo one at opset 18), written with onnx.helper so the tests need no
torch: what the Relax rules must find in models/real/ at a test's size."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

F32 = onnx.TensorProto.FLOAT


def _const(name, value, dtype="float32"):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def save(nodes, inputs, outputs, initializers, path, opset=17):
    graph = helper.make_graph(nodes, "exported", [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, F32, s) for n, s in outputs], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def rms_norm(path, exporter="torchscript", residual=True, shape=(1, 8, 32), eps=1e-6, seed=0):
    """HF's LlamaRMSNorm after the residual add (``residual``), as ``exporter`` writes it: y, and
    the residual sum's other use (the next residual add) as a second output.

    TorchScript: Add -> Cast -> Pow 2 -> ReduceMean (axes attribute) -> Add eps -> Sqrt -> Div 1 by
    it -> Mul -> Cast -> Mul by the weight. Dynamo: Add -> Pow -> ReduceMean (axes input) -> Add ->
    Sqrt -> Reciprocal -> Mul -> Mul by the weight."""
    rng = np.random.default_rng(seed)
    hidden = shape[-1]
    inits = [_const("w", 1.0 + 0.1 * rng.standard_normal(hidden)), _const("two", 2.0), _const("eps", eps),
             _const("one", 1.0)]
    nodes = [helper.make_node("Add", ["x", "r"], ["h"])] if residual else [helper.make_node("Identity", ["x"], ["h"])]
    if exporter == "torchscript":
        opset = 17
        nodes += [helper.make_node("Cast", ["h"], ["hc"], to=F32), helper.make_node("Pow", ["hc", "two"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
                  helper.make_node("Add", ["ms", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["rms"]),
                  helper.make_node("Div", ["one", "rms"], ["inv"]), helper.make_node("Mul", ["hc", "inv"], ["nm"]),
                  helper.make_node("Cast", ["nm"], ["nc"], to=F32), helper.make_node("Mul", ["w", "nc"], ["y"])]
    else:
        opset = 18
        inits.append(_const("axes", [-1], "int64"))
        nodes += [helper.make_node("Pow", ["h", "two"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
                  helper.make_node("Add", ["ms", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["rms"]),
                  helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["h", "inv"], ["nm"]),
                  helper.make_node("Mul", ["w", "nm"], ["y"])]
    nodes.append(helper.make_node("Add", ["h", "x"], ["next"]))
    inputs = [("x", list(shape))] + ([("r", list(shape))] if residual else [])
    return save(nodes, inputs, [("y", list(shape)), ("next", list(shape))], inits, path, opset)


def conv_relu(path, stride=1, seed=0):
    """A torchvision Conv + BatchNorm + ReLU in eval mode as torch.onnx exports it: the batch norm
    folded into the Conv's weight and bias, then Relu; a second, 1x1 conv after it."""
    rng = np.random.default_rng(seed)
    inits = [_const("w", 0.3 * rng.standard_normal((8, 4, 3, 3))), _const("b", rng.standard_normal(8)),
             _const("w2", 0.3 * rng.standard_normal((8, 8, 1, 1))), _const("b2", rng.standard_normal(8))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride],
                              kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c2"], ["y"])]
    out = 8 // stride
    return save(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 8, out, out])], inits, path)


def layernorm_residual(path, eps=1e-12, shape=(1, 8, 32), seed=0):
    """BERT's `dense + residual -> LayerNormalization` (HF writes eps 1e-12), only the normalised
    output used."""
    rng = np.random.default_rng(seed)
    hidden = shape[-1]
    inits = [_const("gamma", 1.0 + 0.1 * rng.standard_normal(hidden)), _const("beta", 0.1 * rng.standard_normal(hidden))]
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["y"], axis=-1, epsilon=eps)]
    return save(nodes, [("x", list(shape)), ("r", list(shape))], [("y", list(shape))], inits, path)
