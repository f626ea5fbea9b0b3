"""Small ONNX graphs of the ops exported models use (HF transformers and torchvision through
torch.onnx), each with seeded inputs: both baseline translations are checked on them against
onnxruntime (``test_onnx_to_jax``, ``test_onnx_to_torch``)."""

import numpy as np
from onnx import TensorProto, helper

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _model(nodes, inputs, outputs, consts=None, opset=18):
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        [helper.make_tensor(n, {np.dtype("int64"): I64, np.dtype("float32"): F}[v.dtype], v.shape, v.reshape(-1).tolist())
         for n, v in (consts or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _x(shape, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def is_nan():
    x = _x((4, 6))
    x[1, 2], x[3, 0], x[0, 5] = np.nan, np.inf, -np.inf
    # HF's guard after a fully masked softmax row: NaN -> 0.
    nodes = [helper.make_node("IsNaN", ["x"], ["m"]), helper.make_node("Where", ["m", "zero", "x"], ["y"])]
    return _model(nodes, [("x", F, (4, 6))], [("y", F), ("m", B)], {"zero": np.zeros((), np.float32)}), {"x": x}


def constant_of_shape():
    # The shape comes from the input (folded before tracing), the value is an int64 tensor.
    value = helper.make_tensor("value", I64, (1,), [3])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["c"], value=value),
             helper.make_node("ConstantOfShape", ["s"], ["z"]),  # default: float 0
             helper.make_node("Cast", ["c"], ["cf"], to=F), helper.make_node("Add", ["x", "cf"], ["t"]),
             helper.make_node("Add", ["t", "z"], ["y"])]
    return _model(nodes, [("x", F, (2, 3, 5))], [("y", F)]), {"x": _x((2, 3, 5))}


def hard_sigmoid():
    nodes = [helper.make_node("HardSigmoid", ["x"], ["a"]),
             helper.make_node("HardSigmoid", ["x"], ["b"], alpha=0.3, beta=0.4)]
    return _model(nodes, [("x", F, (5, 8))], [("a", F), ("b", F)]), {"x": _x((5, 8))}


def hard_swish():
    x = _x((5, 8))
    x[0, :4] = [-3.0, 3.0, 0.0, -6.0]  # the kinks
    return _model([helper.make_node("HardSwish", ["x"], ["y"])], [("x", F, (5, 8))], [("y", F)]), {"x": x}


def max_pool(**attrs):
    def case():
        node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
        return _model([node], [("x", F, (1, 3, 11, 10))], [("y", F)]), {"x": _x((1, 3, 11, 10))}
    case.__name__ = "max_pool_" + "_".join(f"{k}{v}" for k, v in attrs.items() if k != "kernel_shape").replace(
        " ", "").replace("[", "").replace("]", "").replace(",", "-")
    return case


def split(opset, dim, **attrs):
    def case():
        consts = {}
        inputs = ["x"]
        node_attrs = dict(attrs)
        if "sizes" in node_attrs:
            consts["sizes"] = np.array(node_attrs.pop("sizes"), np.int64)
            inputs.append("sizes")
        node = helper.make_node("Split", inputs, ["a", "b", "c"], axis=1, **node_attrs)
        nodes = [node, helper.make_node("Concat", ["c", "a"], ["y"], axis=1)]
        return (_model(nodes, [("x", F, (2, dim, 3))], [("y", F), ("b", F)], consts, opset=opset),
                {"x": _x((2, dim, 3))})
    case.__name__ = f"split_opset{opset}_{dim}_" + "_".join(f"{k}" for k in attrs)
    return case


def gather_nd():
    indices = np.array([[[0, 1], [-1, 4]], [[2, -5], [1, 0]]], np.int64)
    nodes = [helper.make_node("GatherND", ["x", "i"], ["y"])]
    return _model(nodes, [("x", F, (3, 5, 6))], [("y", F)], {"i": indices}), {"x": _x((3, 5, 6))}


def range_from_shape():
    # position ids as exporters write them: Range(0, seq_len, 1), seq_len from Shape.
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Squeeze", ["s", "axis0"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=F), helper.make_node("Add", ["x", "rf"], ["y"])]
    consts = {"axis0": np.array([0], np.int64), "zero": np.array(0, np.int64), "one": np.array(1, np.int64)}
    return _model(nodes, [("x", F, (3, 9))], [("y", F)], consts), {"x": _x((3, 9))}


def sin_cos():
    nodes = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Cos", ["x"], ["c"])]
    return _model(nodes, [("x", F, (4, 16))], [("s", F), ("c", F)]), {"x": _x((4, 16), scale=10.0)}


CASES = [is_nan, constant_of_shape, hard_sigmoid, hard_swish,
         max_pool(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         max_pool(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
         max_pool(kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 1], pads=[0, 1, 1, 0]),
         max_pool(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
         split(18, 7, num_outputs=3), split(13, 7, sizes=[1, 4, 2]), split(13, 9), split(11, 7, split=[3, 3, 1]),
         gather_nd, range_from_shape, sin_cos]


def onnxruntime_outputs(model, feeds):
    import onnxruntime as ort
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
