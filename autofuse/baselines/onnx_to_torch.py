"""ONNX graphs as torch functions, so the torch baselines (eager, ``torch.compile``) run the very
computation onnxruntime, XLA and TVM run.

The design is ``onnx_to_jax``'s, and so is the graph walk (``parse_graph``): constants (initializers,
Constant nodes and what is computed from them alone) are folded with numpy once, when the function
is made. The translation table ``OPS`` maps an ONNX op type to ``(node, *inputs) -> output(s)``
on torch tensors, written to the ONNX spec. Operands that must be Python values (Reshape's shape,
Slice's starts, TopK's k: ``STATIC_INPUTS``) are taken from the folded constants when the function
is made; every other constant becomes a tensor on the function's device once, so a call moves no
constant from the host. The call itself is a plain loop of torch ops over tensors and Python
values, which ``torch.compile`` traces as one graph.

torch is an optional extra: it is imported inside the functions that run, never at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import numpy as np

from ..errors import AutofuseError
from .onnx_to_jax import Node, folds, node_args, parse_graph, store_results, window_pads
from .onnx_to_jax import OPS as NUMPY_OPS

# Operand positions that must be known when the function is made (Python ints, not tensors).
STATIC_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,),
    "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "TopK": (1,),
    "CumSum": (1,), "Split": (1,),
}


def torch_function(model, device="cpu") -> Callable[..., list]:
    """A function of the graph's (non-initializer) inputs as torch tensors on ``device``, in graph
    input order, returning the list of graph outputs as torch tensors."""
    graph = parse_graph(model, OPS, "the torch baseline has no translation for ONNX op(s)")
    constants = dict(graph.constants)
    shapes = _inferred_shapes(model) if any(node.op_type == "Shape" for node, _ in graph.nodes) else {}
    tensors = _Tensors(constants, device)
    steps = []
    for node, info in graph.nodes:
        args = node_args(node, constants)
        if args is not None and folds(node.op_type, args):  # downstream of a folded Shape
            store_results(node, NUMPY_OPS[node.op_type](np, info, *args), constants, folded=True)
        elif node.op_type == "Shape" and node.input[0] in shapes:
            like = np.broadcast_to(np.zeros((), np.int8), shapes[node.input[0]])  # a shape, no memory
            store_results(node, NUMPY_OPS["Shape"](np, info, like), constants, folded=True)
        else:
            steps.append(_step(node, info, constants, tensors))
    input_names, output_names = graph.input_names, graph.output_names
    outputs = [tensors.get(name) if name in constants else _Input(name) for name in output_names]

    def run(*inputs):
        if len(inputs) != len(input_names):
            raise TypeError(f"the graph takes {len(input_names)} input(s) {input_names}, got {len(inputs)}")
        values = dict(zip(input_names, inputs))
        for step in steps:
            args = [values[a.name] if isinstance(a, _Input) else a for a in step.args]
            store_results(step.node, step.fn(step.info, *args), values, folded=False)
        return [values[o.name] if isinstance(o, _Input) else o for o in outputs]

    return run


def unsupported_ops(model) -> list[str]:
    from .onnx_to_jax import unsupported_ops as missing
    return missing(model, OPS)


def to_torch(array, device="cpu"):
    """A numpy array (bfloat16 from ml_dtypes included) as a torch tensor on ``device``."""
    import torch

    array = np.array(array, copy=True)  # contiguous and writable, 0-d kept, as torch.from_numpy wants
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy; bfloat16 comes back as float32, which holds it exactly."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


@dataclasses.dataclass(frozen=True)
class _Input:
    """A step's operand that is computed from the graph inputs: looked up by name at call time."""
    name: str


@dataclasses.dataclass(frozen=True)
class _Outputs:
    # What ``store_results`` reads of a node; a plain object rather than the protobuf, which
    # torch.compile cannot trace.
    op_type: str
    output: tuple[str, ...]


@dataclasses.dataclass
class _Step:
    node: _Outputs
    info: Node
    fn: Callable
    args: list


class _Tensors:
    """The constants as tensors on the device, each converted once."""

    def __init__(self, constants: dict, device):
        self.constants = constants
        self.device = device
        self.cache: dict[str, Any] = {}

    def get(self, name: str):
        if name not in self.cache:
            self.cache[name] = to_torch(self.constants[name], self.device)
        return self.cache[name]


def _step(node, info: Node, constants: dict, tensors: _Tensors) -> _Step:
    if OPS[node.op_type] is None:
        raise AutofuseError(f"the torch baseline needs static shapes, but the operands of {node.op_type} "
                            f"({', '.join(node.input)}) are not known before run time")
    static = STATIC_INPUTS.get(node.op_type, ())
    args = []
    for position, name in enumerate(node.input):
        if not name:
            args.append(None)
        elif position in static:
            if name not in constants:
                raise AutofuseError(f"the torch baseline needs static shapes, but input {position} of "
                                    f"{node.op_type} is computed from the graph inputs")
            args.append(_static(constants[name]))
        else:
            args.append(tensors.get(name) if name in constants else _Input(name))
    while args and args[-1] is None:
        args.pop()
    return _Step(_Outputs(node.op_type, tuple(node.output)), info, OPS[node.op_type], args)


def _static(value: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _inferred_shapes(model) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph's values by ONNX shape inference, so Shape folds."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    shapes = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
    return shapes


# ONNX TensorProto data types by number, as torch dtype names: a plain table, since torch.compile
# does not trace into onnx.helper.
_DTYPE_NAMES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
                10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}


def _torch_dtype(onnx_type: int):
    import torch

    if onnx_type not in _DTYPE_NAMES:
        raise AutofuseError(f"the torch baseline has no dtype for ONNX data type {onnx_type}")
    return getattr(torch, _DTYPE_NAMES[onnx_type])


# --- elementwise -----------------------------------------------------------------------------

def _wrapping(fn: Callable) -> Callable:
    """``fn`` on 16/32-bit unsigned integers, which torch has few kernels for: computed in int64,
    whose low bits wrap exactly as the narrow type's, and masked back."""
    def op(x, y):
        import torch

        bits = {torch.uint16: 16, torch.uint32: 32}.get(x.dtype)
        if bits is None:
            return fn(x, y)
        return (fn(x.to(torch.int64), y.to(torch.int64)) & ((1 << bits) - 1)).to(x.dtype)
    return op


def _binary(name: str, wrap: bool = False):
    def op(node, x, y):
        import torch
        fn = getattr(torch, name)
        return (_wrapping(fn) if wrap else fn)(x, y)
    return op


def _unary(name: str):
    def op(node, x):
        import torch
        return getattr(torch, name)(x)
    return op


def _variadic(name: str):
    def op(node, *inputs):
        import torch
        return functools.reduce(_wrapping(getattr(torch, name)), inputs)
    return op


def _div(node, x, y):
    import torch

    if x.is_floating_point():
        return torch.div(x, y)
    return torch.div(x, y, rounding_mode="trunc")  # ONNX integer division truncates toward zero


def _pow(node, x, y):
    import torch
    return torch.pow(x, y).to(x.dtype)  # ONNX lets the exponent have another type


def _bit_shift(node, x, y):
    import torch

    shift = torch.bitwise_right_shift if node["direction"] == "RIGHT" else torch.bitwise_left_shift
    return _wrapping(shift)(x, y)  # logical: ONNX BitShift is for unsigned types only


def _identity(node, x):
    return x


def _hard_sigmoid(node, x):
    import torch
    return torch.clamp(node.get("alpha", 0.2) * x + node.get("beta", 0.5), 0.0, 1.0)


def _hard_swish(node, x):
    import torch.nn.functional as F
    return F.hardswish(x)  # x * relu6(x + 3) / 6: the spec's alpha = 1/6, beta = 0.5


def _where(node, condition, x, y):
    import torch
    return torch.where(condition, x, y)


def _cast(node, x):
    return x.to(_torch_dtype(node["to"]))


# --- linear algebra and neural-network ops ---------------------------------------------------

def _matmul(node, a, b):
    import torch
    return torch.matmul(a, b)


def _gemm(node, a, b, c=None):
    import torch

    a = a.T if node.get("transA", 0) else a
    b = b.T if node.get("transB", 0) else b
    out = node.get("alpha", 1.0) * torch.matmul(a, b)
    return out if c is None else out + node.get("beta", 1.0) * c


def _matmul_integer(node, a, b, a_zero=None, b_zero=None):
    import torch

    if a_zero is None and b_zero is None and a.device.type == "cuda" and _int_mm_fits(a, b):
        return torch._int_mm(a, b)  # cuBLAS int8 GEMM with int32 accumulation
    a = a.to(torch.int32) - (0 if a_zero is None else _row_zero_point(a_zero, a))
    b = b.to(torch.int32) - (0 if b_zero is None else b_zero.to(torch.int32))
    if a.device.type == "cpu":
        return torch.matmul(a, b)
    # CUDA has no int32 matmul; float64 holds these sums exactly (below 2**53).
    return torch.matmul(a.to(torch.float64), b.to(torch.float64)).round().to(torch.int32)


def _int_mm_fits(a, b) -> bool:
    import torch
    return (a.dtype == b.dtype == torch.int8 and a.ndim == b.ndim == 2 and a.shape[0] > 16
            and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0)


def _row_zero_point(zero, a):
    import torch

    zero = zero.to(torch.int32)
    return zero.reshape(-1, 1) if zero.ndim == 1 and zero.numel() > 1 else zero  # 1-D: one per row of a


def _quantize_linear(node, x, scale, zero=None):
    import torch

    axis = node.get("axis", 1) % x.ndim if x.ndim else 0
    if scale.ndim == 1 and scale.numel() > 1:  # per axis
        shape = [1] * x.ndim
        shape[axis] = -1
        scale = scale.reshape(shape)
        zero = None if zero is None else zero.reshape(shape)
    dtype = torch.uint8 if zero is None else zero.dtype
    info = torch.iinfo(dtype)
    # torch.round rounds half to even, as ONNX specifies.
    q = torch.round(x.to(torch.float32) / scale) + (0 if zero is None else zero.to(torch.float32))
    return q.clamp(info.min, info.max).to(dtype)


def _conv(node, x, w, b=None):
    import torch.nn.functional as F

    spatial = x.ndim - 2
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(spatial)
    if conv is None:
        raise AutofuseError(f"the torch baseline supports Conv over 1 to 3 spatial dimensions, not {spatial}")
    strides = node.get("strides", [1] * spatial)
    dilations = node.get("dilations", [1] * spatial)
    begins, ends = window_pads(node, x.shape[2:], w.shape[2:], strides, dilations)
    if begins != ends:  # torch pads both sides alike: pad the input first
        x = F.pad(x, [p for i in reversed(range(spatial)) for p in (begins[i], ends[i])])
        begins = [0] * spatial
    return conv(x, w, b, strides, begins, dilations, node.get("group", 1))


def _batch_norm(node, x, scale, bias, mean, var):
    import torch.nn.functional as F

    if node.get("training_mode", 0):
        raise AutofuseError("the torch baseline supports BatchNormalization in inference mode only")
    return F.batch_norm(x, mean, var, scale, bias, training=False, eps=node.get("epsilon", 1e-5))


def _layer_norm(node, x, scale, bias=None):
    import torch

    axis = node.get("axis", -1) % x.ndim
    normalized = list(x.shape[axis:])
    stash = _torch_dtype(node.get("stash_type", 1))
    fits = list(scale.shape) == normalized and (bias is None or list(bias.shape) == normalized)
    out, mean, inv_std = torch.native_layer_norm(x, normalized, scale if fits else None,
                                                 bias if fits else None, node.get("epsilon", 1e-5))
    if not fits:  # a scale or bias that only broadcasts to the normalized shape
        out = out * scale if bias is None else out * scale + bias
    return out, mean.to(stash), inv_std.to(stash)


def _softmax(node, x):
    import torch

    if node.opset >= 13:
        return torch.softmax(x, dim=node.get("axis", -1))
    # Before opset 13 Softmax flattens to 2-D at axis and normalises over all trailing dims.
    axis = node.get("axis", 1) % x.ndim
    flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
    return torch.softmax(flat, dim=1).reshape(x.shape)


def _max_pool(node, x):
    import torch.nn.functional as F

    spatial = x.ndim - 2
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}.get(spatial)
    if pool is None:
        raise AutofuseError(f"the torch baseline supports MaxPool over 1 to 3 spatial dimensions, not {spatial}")
    kernel = list(node["kernel_shape"])
    strides = list(node.get("strides", [1] * spatial))
    dilations = list(node.get("dilations", [1] * spatial))
    begins, ends = window_pads(node, x.shape[2:], kernel, strides, dilations)
    # Padded with -inf first (torch pads both sides alike and limits the pad to half the window).
    x = F.pad(x, [p for i in reversed(range(spatial)) for p in (begins[i], ends[i])], value=float("-inf"))
    return pool(x, kernel, strides, 0, dilations)


def _global_average_pool(node, x):
    return x.mean(dim=tuple(range(2, x.ndim)), keepdim=True)


def _reduce(name: str):
    def op(node, x, axes=None):
        import torch

        axes = axes if axes is not None else node.get("axes")
        if not axes:
            if node.get("noop_with_empty_axes", 0):
                return x
            axes = range(x.ndim)
        # torch sums integers into int64; ONNX keeps the input's type.
        return getattr(torch, name)(x, dim=tuple(axes), keepdim=bool(node.get("keepdims", 1))).to(x.dtype)
    return op


def _cumsum(node, x, axis):
    import torch

    dim = axis[0] % x.ndim
    if node.get("reverse", 0):
        x = torch.flip(x, (dim,))
    out = torch.cumsum(x, dim=dim, dtype=x.dtype)
    if node.get("exclusive", 0):
        out = out - x
    return torch.flip(out, (dim,)) if node.get("reverse", 0) else out


def _einsum(node, *inputs):
    import torch
    return torch.einsum(node["equation"], *inputs)


def _top_k(node, x, k):
    import torch

    values, indices = torch.topk(x, k[0], dim=node.get("axis", -1), largest=bool(node.get("largest", 1)),
                                 sorted=bool(node.get("sorted", 1)))
    return values, indices.to(torch.int64)


# --- shapes and indexing ---------------------------------------------------------------------

def _reshape(node, x, shape):
    if not node.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]  # 0 copies the input's dim
    return x.reshape(shape)


def _transpose(node, x):
    perm = node.get("perm")
    return x.permute(list(perm) if perm is not None else list(reversed(range(x.ndim))))


def _flatten(node, x):
    axis = node.get("axis", 1) % (x.ndim + 1) if x.ndim else 0
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _unsqueeze(node, x, axes=None):
    axes = axes if axes is not None else node["axes"]
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _squeeze(node, x, axes=None):
    axes = axes if axes is not None else node.get("axes")
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(a % x.ndim for a in axes))


def _concat(node, *inputs):
    import torch
    return torch.cat(inputs, dim=node["axis"])


def _normalized_indices(indices, size: int):
    import torch
    # Negative indices count from the end.
    return torch.where(indices < 0, indices + size, indices).to(torch.int64)


def _gather(node, x, indices):
    axis = node.get("axis", 0) % x.ndim
    flat = _normalized_indices(indices, x.shape[axis]).reshape(-1)
    out = x.index_select(axis, flat)
    return out.reshape(x.shape[:axis] + indices.shape + x.shape[axis + 1:])


def _gather_elements(node, x, indices):
    import torch

    axis = node.get("axis", 0) % x.ndim
    return torch.gather(x, axis, _normalized_indices(indices, x.shape[axis]))


def _scatter_elements(node, x, indices, updates):
    axis = node.get("axis", 0) % x.ndim
    indices = _normalized_indices(indices, x.shape[axis])
    reduction = node.get("reduction", "none")
    if reduction == "none":
        return x.scatter(axis, indices, updates)
    reduce = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[reduction]
    return x.scatter_reduce(axis, indices, updates, reduce=reduce, include_self=True)


def _slice(node, x, starts=None, ends=None, axes=None, steps=None):
    import torch

    if node.opset < 10:  # starts, ends and axes were attributes then
        starts, ends, axes = node["starts"], node["ends"], node.get("axes")
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= x.ndim
        # Python slices clamp out-of-range starts and ends the way ONNX Slice does.
        begin, stop, stride = slice(start, end, step).indices(x.shape[axis])
        if stride > 0:
            x = x[(slice(None),) * axis + (slice(begin, stop, stride),)]
        else:  # torch slices take no negative steps
            x = x.index_select(axis, torch.arange(begin, stop, stride, device=x.device))
    return x


def _split(node, x, split=None):
    import torch
    axis = node.get("axis", 0) % x.ndim
    if split is None and "split" in node.attrs:
        split = list(node["split"])
    if split is None:
        parts = node.get("num_outputs") or node.outputs
        split = -(-x.shape[axis] // parts)  # equal parts, the last one smaller (opset 18)
    return tuple(torch.split(x, split, dim=axis))


def _gather_nd(node, x, indices):
    if node.get("batch_dims", 0):
        raise AutofuseError("the torch baseline supports GatherND with batch_dims = 0 only")
    return x[tuple(_normalized_indices(indices[..., i], x.shape[i]) for i in range(indices.shape[-1]))]


def _expand(node, x, shape):
    # ONNX Expand broadcasts both ways: a 1 in ``shape`` keeps the input's dim.
    return x.expand(np.broadcast_shapes(tuple(x.shape), tuple(shape)))


OPS: dict[str, Callable] = {
    "Add": _binary("add", wrap=True), "Sub": _binary("sub", wrap=True), "Mul": _binary("mul", wrap=True),
    "Div": _div, "Pow": _pow, "Max": _variadic("maximum"), "Min": _variadic("minimum"), "Sum": _variadic("add"),
    "Equal": _binary("eq"), "Less": _binary("lt"), "Greater": _binary("gt"),
    "LessOrEqual": _binary("le"), "GreaterOrEqual": _binary("ge"),
    "And": _binary("logical_and"), "Or": _binary("logical_or"), "Not": _unary("logical_not"),
    "BitShift": _bit_shift, "BitwiseAnd": _binary("bitwise_and"), "BitwiseOr": _binary("bitwise_or"),
    "BitwiseXor": _binary("bitwise_xor"), "BitwiseNot": _unary("bitwise_not"),
    "Neg": _unary("neg"), "Abs": _unary("abs"), "Exp": _unary("exp"), "Log": _unary("log"),
    "Sqrt": _unary("sqrt"), "Tanh": _unary("tanh"), "Reciprocal": _unary("reciprocal"), "Relu": _unary("relu"),
    "Erf": _unary("erf"), "Sigmoid": _unary("sigmoid"), "Identity": _identity, "Where": _where, "Cast": _cast,
    "MatMul": _matmul, "Gemm": _gemm, "MatMulInteger": _matmul_integer, "QuantizeLinear": _quantize_linear,
    "Conv": _conv, "BatchNormalization": _batch_norm, "LayerNormalization": _layer_norm, "Softmax": _softmax,
    "GlobalAveragePool": _global_average_pool, "ReduceMean": _reduce("mean"), "ReduceSum": _reduce("sum"),
    "ReduceMax": _reduce("amax"), "ReduceMin": _reduce("amin"), "CumSum": _cumsum, "Einsum": _einsum,
    "TopK": _top_k,
    # Never run: Constant always folds, Shape when shape inference knows its input's shape, and
    # ConstantOfShape and Range when their operands (shapes) are known, as they must be.
    "Constant": None, "Shape": None, "ConstantOfShape": None, "Range": None,
    "Reshape": _reshape, "Transpose": _transpose, "Flatten": _flatten, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Concat": _concat, "Gather": _gather, "GatherElements": _gather_elements,
    "ScatterElements": _scatter_elements, "Slice": _slice, "Expand": _expand,
    "IsNaN": _unary("isnan"), "Cos": _unary("cos"), "Sin": _unary("sin"), "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish, "MaxPool": _max_pool, "Split": _split, "GatherND": _gather_nd,
}
