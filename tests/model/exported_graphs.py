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


# linear(): the forms torch.onnx writes an nn.Linear (and its activation) in. A weight is (k, n)
# as MatMul reads it; Gemm's is (n, k) with transB.
LINEAR_FORMS = ("bias", "bias_2d", "gemm", "plain", "gelu_erf", "gelu_erf_dynamo", "gelu_op", "gelu_tanh",
                "gelu_tanh_op", "relu", "gelu_bad_constant", "residual", "weight_input", "activations", "scores")


def linear(path, form, rows=8, k=32, n=48, seed=0):
    """x (1, rows, k) through one linear layer in ``form``:

    - ``bias``: MatMul(x, W) then Add(b, .) (BERT's and ViT's operand order);
    - ``bias_2d``: GPT-2's Conv1D: Reshape to (rows, k), MatMul, Add(., b), Reshape back;
    - ``gemm``: Gemm(x (rows, k), W (n, k), b, transB=1), as nn.Linear on 2-D input;
    - ``plain``: MatMul only (Llama's projections);
    - ``gelu_erf``: ``bias`` then BERT's GELU: Div by sqrt 2, Erf, Add 1, Mul by the input, Mul 0.5;
    - ``gelu_erf_dynamo``: the same GELU as the dynamo exporter groups it: Mul(0.5, Erf + 1), then Mul
      by the input;
    - ``gelu_op``: ``bias`` then ONNX Gelu (opset 20);
    - ``gelu_tanh``: ``bias_2d`` then GPT-2's gelu_new: Pow 3, Mul 0.044715, Add, Mul sqrt(2/pi),
      Tanh, Mul 0.5 by the input, Add 1, Mul;
    - ``gelu_tanh_op``: ``bias`` then ONNX Gelu(approximate="tanh") (opset 20);
    - ``relu``: ``bias`` then Relu (linear_bias_relu's);
    - ``gelu_bad_constant``: ``gelu_erf`` dividing by 2 instead of sqrt 2 (no GELU);
    - ``residual``: MatMul then Add of a (1, rows, n) input (a residual, not a bias);
    - ``weight_input``: ``bias`` with W a graph input (weights kept as inputs);
    - ``activations``: MatMul of two computed activations (Relu(x) @ Relu(w), w an input): no weight;
    - ``scores``: attention's batched Q K^T, (1, 4, rows, 16) @ Transpose(K): no weight.
    """
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    inits = [_const("w", w.T if form == "gemm" else w), _const("b", rng.standard_normal(n))]
    inputs, opset = [("x", [1, rows, k])], 17
    out = [1, rows, n]
    mm = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    bias = mm + [helper.make_node("Add", ["b", "mm"], ["h"])]
    if form in ("bias_2d", "gelu_tanh"):
        inits += [_const("rows_shape", [rows, k], "int64"), _const("out_shape", out, "int64")]
        bias = [helper.make_node("Reshape", ["x", "rows_shape"], ["x2"]), helper.make_node("MatMul", ["x2", "w"], ["mm"]),
                helper.make_node("Add", ["mm", "b"], ["h2"]), helper.make_node("Reshape", ["h2", "out_shape"], ["h"])]
    if form == "gemm":
        inputs, out = [("x", [rows, k])], [rows, n]
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    elif form == "plain":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    elif form in ("bias", "bias_2d", "weight_input"):
        nodes = bias
        nodes[-1].output[0] = "y"
        if form == "weight_input":
            inits = inits[1:]
            inputs.append(("w", [k, n]))
    elif form in ("gelu_erf", "gelu_bad_constant", "gelu_erf_dynamo"):
        inits += [_const("sqrt2", 2.0 if form == "gelu_bad_constant" else np.sqrt(2.0)), _const("one", 1.0),
                  _const("half", 0.5)]
        nodes = bias + [helper.make_node("Div", ["h", "sqrt2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
                        helper.make_node("Add", ["e", "one"], ["e1"])]
        if form == "gelu_erf_dynamo":
            nodes += [helper.make_node("Mul", ["half", "e1"], ["g"]), helper.make_node("Mul", ["h", "g"], ["y"])]
        else:
            nodes += [helper.make_node("Mul", ["h", "e1"], ["g"]), helper.make_node("Mul", ["g", "half"], ["y"])]
    elif form in ("gelu_op", "gelu_tanh_op"):
        opset = 20
        nodes = bias + [helper.make_node("Gelu", ["h"], ["y"], approximate="tanh" if form == "gelu_tanh_op" else "none")]
    elif form == "gelu_tanh":
        inits += [_const("three", 3.0), _const("cubic", 0.044715), _const("c", np.sqrt(2.0 / np.pi)),
                  _const("half", 0.5), _const("one", 1.0)]
        nodes = bias + [helper.make_node("Pow", ["h", "three"], ["p"]), helper.make_node("Mul", ["p", "cubic"], ["pc"]),
                        helper.make_node("Add", ["h", "pc"], ["i"]), helper.make_node("Mul", ["i", "c"], ["ic"]),
                        helper.make_node("Tanh", ["ic"], ["t"]), helper.make_node("Mul", ["h", "half"], ["hh"]),
                        helper.make_node("Add", ["t", "one"], ["t1"]), helper.make_node("Mul", ["hh", "t1"], ["y"])]
    elif form == "relu":
        nodes = bias + [helper.make_node("Relu", ["h"], ["y"])]
    elif form == "residual":
        inputs.append(("r", out))
        nodes = mm + [helper.make_node("Add", ["mm", "r"], ["y"])]
    elif form == "activations":
        inits, inputs = [], inputs + [("w", [k, n])]
        nodes = [helper.make_node("Relu", ["x"], ["rx"]), helper.make_node("Relu", ["w"], ["rw"]),
                 helper.make_node("MatMul", ["rx", "rw"], ["y"])]
    elif form == "scores":
        inits, inputs, out = [], [("x", [1, 4, rows, 16]), ("k", [1, 4, rows, 16])], [1, 4, rows, rows]
        nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                 helper.make_node("MatMul", ["x", "kt"], ["y"])]
    else:
        raise ValueError(f"form {form!r} is not one of {', '.join(LINEAR_FORMS)}")
    return save(nodes, inputs, [("y", out)], inits, path, opset)
