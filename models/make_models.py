"""Write small, deterministic ONNX models for autofuse's end-to-end runs.

    python models/make_models.py [--out DIR] [--only NAME] [--dtype float16]

Every model is opset 17 (default domain), ir_version 8, float32 (quant_mlp: int8 weights with
float32 scales), with its weights stored as initializers drawn from ``np.random.default_rng(seed)``
(one fixed seed per model). Nothing that changes between runs (timestamps, random names) goes into
a model, so building one twice gives byte-identical serialized bytes; the tests compare the
committed ``models/*.onnx`` with a fresh build. ``--dtype float16`` writes NAME-float16.onnx, every
float32 tensor cast to float16 (not committed: build it where it is needed).
Only ``onnx.helper`` / ``onnx.numpy_helper`` are used.
"""

import argparse
import math
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# onnxruntime 1.32 accepts IR versions up to 10 or so; 8 is the version of opset 17's release (onnx 1.12).
IR_VERSION = 8
PRODUCER = "autofuse"
PRODUCER_VERSION = "0.1.0"

DESCRIPTIONS = {
    "mlp": "x(128,256) -> MatMul(256x512)+Add+Relu -> Gemm(transB=1, W 256x512)+Relu -> (128,256)",
    "transformer_block": "pre-LN encoder block, x(1,128,256), 4 heads of 64, FFN 1024 with Erf-GELU -> (1,128,256)",
    "conv_block": "x(1,16,32,32) -> 2x [Conv 3x3 pad 1 (32) + BatchNormalization + Relu] -> GlobalAveragePool -> Flatten -> (1,32)",
    "decoder_block": "Llama-style pre-LN decoder block, x(1,128,256): causal GQA attention (4 query heads, "
                     "2 K/V heads of 64) with RoPE, SwiGLU FFN 704, no biases -> (1,128,256)",
    "quant_mlp": "x(64,256) -> QuantizeLinear(int8, per tensor) -> MatMulInteger(Transpose(W1 int8 512x256))"
                 "+Cast+Mul(x_scale*W1_scale, per channel)+Add+Relu -> QuantizeLinear -> the same with "
                 "W2 int8 256x512 -> (64,256)",
}

SEEDS = {"mlp": 0, "transformer_block": 1, "conv_block": 2, "decoder_block": 3, "quant_mlp": 4}


class _Graph:
    """Collects nodes and initializers with deterministic, readable names."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.nodes = []
        self.inits = []
        self._count = {}

    def _name(self, prefix):
        n = self._count.get(prefix, 0)
        self._count[prefix] = n + 1
        return f"{prefix}_{n}"

    def const(self, name, array):
        array = np.ascontiguousarray(array)
        self.inits.append(numpy_helper.from_array(array, name=name))
        return name

    def weight(self, name, shape, fan_in):
        """Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) float32, like the usual default init."""
        bound = 1.0 / math.sqrt(fan_in)
        return self.const(name, self.rng.uniform(-bound, bound, size=shape).astype(np.float32))

    def scalar(self, name, value):
        return self.const(name, np.array(value, dtype=np.float32))

    def op(self, op_type, inputs, out=None, **attrs):
        out = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self._name("n_" + op_type), **attrs))
        return out

    def model(self, name, inputs, outputs):
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits,
                                  doc_string=DESCRIPTIONS[name])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name=PRODUCER, producer_version=PRODUCER_VERSION,
                                  doc_string=DESCRIPTIONS[name])
        model.ir_version = IR_VERSION
        model.model_version = 1
        return model


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def build_mlp():
    g = _Graph(SEEDS["mlp"])
    w1 = g.weight("W1", (256, 512), 256)
    b1 = g.weight("b1", (512,), 256)
    w2 = g.weight("W2", (256, 512), 512)          # stored (out, in); Gemm uses transB=1
    b2 = g.weight("b2", (256,), 512)
    h = g.op("MatMul", ["x", w1])
    h = g.op("Add", [h, b1])
    h = g.op("Relu", [h])
    h = g.op("Gemm", [h, w2, b2], transB=1)
    g.op("Relu", [h], out="y")
    return g.model("mlp", [_vi("x", (128, 256))], [_vi("y", (128, 256))])


def build_transformer_block():
    B, S, D, H, DH, F = 1, 128, 256, 4, 64, 1024
    g = _Graph(SEEDS["transformer_block"])

    def layer_norm(x, tag):
        scale = g.const(f"{tag}_scale", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
        bias = g.const(f"{tag}_bias", (0.1 * g.rng.standard_normal(D)).astype(np.float32))
        return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-5)

    def linear(x, tag, d_in, d_out):
        w = g.weight(f"{tag}_W", (d_in, d_out), d_in)
        b = g.weight(f"{tag}_b", (d_out,), d_in)
        return g.op("Add", [g.op("MatMul", [x, w]), b])

    heads_shape = g.const("heads_shape", np.array([B, S, H, DH], dtype=np.int64))
    model_shape = g.const("model_shape", np.array([B, S, D], dtype=np.int64))

    def split_heads(x):                            # (1,128,256) -> (1,4,128,64)
        return g.op("Transpose", [g.op("Reshape", [x, heads_shape])], perm=[0, 2, 1, 3])

    # attention sub-block
    ln1 = layer_norm("x", "ln1")
    q = split_heads(linear(ln1, "q", D, D))
    k = split_heads(linear(ln1, "k", D, D))
    v = split_heads(linear(ln1, "v", D, D))
    kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])                      # (1,4,64,128)
    scores = g.op("MatMul", [q, kt])                                     # (1,4,128,128)
    scores = g.op("Mul", [scores, g.scalar("attn_scale", 1.0 / math.sqrt(DH))])
    probs = g.op("Softmax", [scores], axis=-1)
    ctx = g.op("MatMul", [probs, v])                                     # (1,4,128,64)
    ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), model_shape])
    attn = linear(ctx, "o", D, D)
    h1 = g.op("Add", [attn, "x"])

    # feed-forward sub-block, GELU written out as 0.5*x*(1+erf(x/sqrt(2)))
    ln2 = layer_norm(h1, "ln2")
    f = linear(ln2, "ffn1", D, F)
    erf = g.op("Erf", [g.op("Div", [f, g.scalar("sqrt2", math.sqrt(2.0))])])
    gelu = g.op("Mul", [g.op("Mul", [f, g.op("Add", [erf, g.scalar("one", 1.0)])]), g.scalar("half", 0.5)])
    f2 = linear(gelu, "ffn2", F, D)
    g.op("Add", [f2, h1], out="y")
    return g.model("transformer_block", [_vi("x", (B, S, D))], [_vi("y", (B, S, D))])


def build_conv_block():
    g = _Graph(SEEDS["conv_block"])

    def conv_bn_relu(x, tag, c_in, c_out):
        w = g.weight(f"{tag}_W", (c_out, c_in, 3, 3), c_in * 9)
        b = g.weight(f"{tag}_b", (c_out,), c_in * 9)
        scale = g.const(f"{tag}_bn_scale", g.rng.uniform(0.5, 1.5, c_out).astype(np.float32))
        bias = g.const(f"{tag}_bn_bias", g.rng.uniform(-0.1, 0.1, c_out).astype(np.float32))
        mean = g.const(f"{tag}_bn_mean", g.rng.uniform(-0.1, 0.1, c_out).astype(np.float32))
        var = g.const(f"{tag}_bn_var", g.rng.uniform(0.5, 1.5, c_out).astype(np.float32))
        h = g.op("Conv", [x, w, b], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
        h = g.op("BatchNormalization", [h, scale, bias, mean, var], epsilon=1e-5)
        return g.op("Relu", [h])

    h = conv_bn_relu("x", "conv1", 16, 32)
    h = conv_bn_relu(h, "conv2", 32, 32)
    h = g.op("GlobalAveragePool", [h])
    g.op("Flatten", [h], out="y", axis=1)
    return g.model("conv_block", [_vi("x", (1, 16, 32, 32))], [_vi("y", (1, 32))])


def build_decoder_block():
    B, S, D, H, KVH, DH, F = 1, 128, 256, 4, 2, 64, 704
    g = _Graph(SEEDS["decoder_block"])

    def layer_norm(x, tag):
        scale = g.const(f"{tag}_scale", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
        bias = g.const(f"{tag}_bias", (0.1 * g.rng.standard_normal(D)).astype(np.float32))
        return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-5)

    def linear(x, tag, d_in, d_out):
        return g.op("MatMul", [x, g.weight(f"{tag}_W", (d_in, d_out), d_in)])

    q_heads = g.const("q_heads_shape", np.array([B, S, H, DH], dtype=np.int64))
    kv_heads = g.const("kv_heads_shape", np.array([B, S, KVH, DH], dtype=np.int64))

    def split_heads(x, shape):                     # (1,S,heads*DH) -> (1,heads,S,DH)
        return g.op("Transpose", [g.op("Reshape", [x, shape])], perm=[0, 2, 1, 3])

    # Rotary tables for positions 0..S-1, "rotate half" (GPT-NeoX/Llama) layout: each frequency
    # in both halves. Built like rope_qk's (base 10000) so the two agree.
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, DH, 2, dtype=np.float64) / DH))
    angles = np.outer(np.arange(S, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    cos = g.const("rope_cos", np.cos(angles).astype(np.float32))
    sin = g.const("rope_sin", np.sin(angles).astype(np.float32))
    axis3 = g.const("axis_last", np.array([3], dtype=np.int64))
    half = g.const("half_start", np.array([DH // 2], dtype=np.int64))
    zero = g.const("zero_start", np.array([0], dtype=np.int64))
    end = g.const("full_end", np.array([DH], dtype=np.int64))

    def rope(x):
        x1 = g.op("Slice", [x, zero, half, axis3])
        x2 = g.op("Slice", [x, half, end, axis3])
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])

    group_axis = g.const("group_axis", np.array([2], dtype=np.int64))
    expanded = g.const("kv_expanded", np.array([B, KVH, H // KVH, S, DH], dtype=np.int64))
    repeated = g.const("kv_repeated", np.array([B, H, S, DH], dtype=np.int64))

    def repeat_kv(x):                              # (1,KVH,S,DH) -> (1,H,S,DH), each K/V head shared by H/KVH
        x = g.op("Expand", [g.op("Unsqueeze", [x, group_axis]), expanded])
        return g.op("Reshape", [x, repeated])

    # attention sub-block
    ln1 = layer_norm("x", "ln1")
    q = rope(split_heads(linear(ln1, "q", D, H * DH), q_heads))
    k = repeat_kv(rope(split_heads(linear(ln1, "k", D, KVH * DH), kv_heads)))
    v = repeat_kv(split_heads(linear(ln1, "v", D, KVH * DH), kv_heads))
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])     # (1,H,S,S)
    scores = g.op("Mul", [scores, g.scalar("attn_scale", 1.0 / math.sqrt(DH))])
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    scores = g.op("Add", [scores, g.const("causal_mask", np.where(j <= i, 0.0, -1e9).astype(np.float32))])
    ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])              # (1,H,S,DH)
    model_shape = g.const("model_shape", np.array([B, S, D], dtype=np.int64))
    ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), model_shape])
    h1 = g.op("Add", [linear(ctx, "o", H * DH, D), "x"])

    # SwiGLU feed-forward sub-block: (silu(x W1) * (x W3)) W2, silu(a) = a * sigmoid(a)
    ln2 = layer_norm(h1, "ln2")
    gate = linear(ln2, "w1", D, F)
    gate = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    up = linear(ln2, "w3", D, F)
    down = linear(g.op("Mul", [gate, up]), "w2", F, D)
    g.op("Add", [down, h1], out="y")
    return g.model("decoder_block", [_vi("x", (B, S, D))], [_vi("y", (B, S, D))])


def _pow2_scale(max_abs):
    """The int8 scale for values up to ``max_abs``: the power of two at or above max_abs / 127."""
    return 2.0 ** np.ceil(np.log2(max_abs / 127.0))


def build_quant_mlp():
    """A statically quantised 2-layer MLP in the form ONNX exporters write for a quantised Linear:
    QuantizeLinear of the activations, then MatMulInteger (int32) with the int8 weight, Cast,
    Mul by x_scale * w_scale, Add bias, Relu. Symmetric (zero points 0), per-tensor activation
    scales calibrated on a seeded batch, per-output-channel weight scales.

    Every scale is a power of two (as fixed-point int8 deployments use): the dequantising products
    are then exact in float32 and a QuantizeLinear's division is exact, so any two runtimes agree
    bit for bit, whatever FMA contraction or reciprocal each uses, and no int8 value of the second
    layer's input can round differently.
    """
    B, D, F = 64, 256, 512
    g = _Graph(SEEDS["quant_mlp"])
    zero = g.const("zero_point", np.array(0, dtype=np.int8))
    x_cal = g.rng.standard_normal((B, D)).astype(np.float64)

    def quant_linear(x_q, x_scale, x_scale_value, x_q_cal, tag, d_in, d_out):
        # Output channels of different magnitude, so the per-channel scales differ.
        bound = 1.0 / math.sqrt(d_in)
        gain = 2.0 ** g.rng.uniform(-1.5, 1.5, size=(d_out, 1))
        w = g.rng.uniform(-bound, bound, size=(d_out, d_in)) * gain
        w_scale = _pow2_scale(np.abs(w).max(axis=1))
        w_q = np.clip(np.rint(w / w_scale[:, None]), -127, 127).astype(np.int8)
        b = g.rng.uniform(-bound, bound, size=d_out).astype(np.float32)
        wq = g.const(f"{tag}_W_q", w_q)                # (out, in), as a Linear stores its weight
        ws = g.const(f"{tag}_W_scale", w_scale.astype(np.float32))
        acc = g.op("MatMulInteger", [x_q, g.op("Transpose", [wq], perm=[1, 0])])
        scale = g.op("Mul", [x_scale, ws])
        h = g.op("Add", [g.op("Mul", [g.op("Cast", [acc], to=TensorProto.FLOAT), scale]), g.const(f"{tag}_b", b)])
        h_cal = np.maximum((x_q_cal @ w_q.T.astype(np.int64)) * (x_scale_value * w_scale) + b, 0.0)
        return h, h_cal

    def quantize(x, x_cal_, tag):
        scale_value = _pow2_scale(np.abs(x_cal_).max())
        scale = g.scalar(f"{tag}_scale", scale_value)
        x_q_cal = np.clip(np.rint(x_cal_ / scale_value), -128, 127).astype(np.int64)
        return g.op("QuantizeLinear", [x, scale, zero]), scale, scale_value, x_q_cal

    h, h_cal = quant_linear(*quantize("x", x_cal, "x1"), "fc1", D, F)
    h = g.op("Relu", [h])
    y, _ = quant_linear(*quantize(h, h_cal, "x2"), "fc2", F, D)
    g.op("Relu", [y], out="y")
    return g.model("quant_mlp", [_vi("x", (B, D))], [_vi("y", (B, D))])


MODELS = {
    "mlp": build_mlp,
    "transformer_block": build_transformer_block,
    "conv_block": build_conv_block,
    "decoder_block": build_decoder_block,
    "quant_mlp": build_quant_mlp,
}

DEFAULT_OUT = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def cast_model(model, dtype):
    """``model`` with every float32 tensor (initializers, graph inputs and outputs) in ``dtype``:
    the same graph with half-precision weights and activations, as a float16 export stores it."""
    if dtype == "float32":
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            # a -1e9 mask becomes the dtype's lowest finite value, not -inf
            info = np.finfo(dtype)
            array = np.clip(numpy_helper.to_array(tensor), info.min, info.max).astype(dtype)
            graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))
    for value in (*graph.input, *graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = DTYPES[dtype]
    return model


def model_path(name, out_dir=DEFAULT_OUT, dtype="float32"):
    return os.path.join(out_dir, f"{name}.onnx" if dtype == "float32" else f"{name}-{dtype}.onnx")


def write_model(name, out_dir=DEFAULT_OUT, dtype="float32"):
    """Build, check and write one model (in ``dtype``: ``cast_model``; a float16 model is named
    NAME-float16.onnx and not committed)."""
    model = cast_model(MODELS[name](), dtype)
    onnx.checker.check_model(model, full_check=True)
    path = model_path(name, out_dir, dtype)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def write_all(out_dir=DEFAULT_OUT):
    """Build, check and write every model; returns {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    return {name: write_model(name, out_dir) for name in MODELS}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: this script's folder)")
    parser.add_argument("--only", choices=sorted(MODELS), help="write just this model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float16: every float32 tensor in float16, written as NAME-float16.onnx")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    names = [args.only] if args.only else list(MODELS)
    for name in names:
        path = write_model(name, args.out, args.dtype)
        print(f"{path}  {os.path.getsize(path)} bytes  {DESCRIPTIONS[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
