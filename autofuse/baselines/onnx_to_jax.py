"""ONNX graphs as JAX functions, so the XLA baseline (``jax.jit`` on the CPU) runs the very
computation onnxruntime runs.

This module owns the translation table ``OPS``: ONNX op type -> one small function
``(xp, node, *inputs) -> output(s)``, written to the ONNX spec for the opset the model imports.
``xp`` is ``jax.numpy``, or ``numpy`` when every input of the node is a constant: initializers,
Constant nodes and whatever is computed from them alone are evaluated eagerly as numpy, so that
Reshape's shape, Slice's starts and the like are static Python values when jax traces the graph.
An op outside the table is an ``AutofuseError`` naming it.

The graph walk (``parse_graph``: constants folded once, when the function is made; ``node_args``,
``folds``, ``store_results``) is shared with ``onnx_to_torch``, whose constants fold through this
module's numpy path too.

jax is an optional extra: it is imported inside the functions that run, never at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np

from ..errors import AutofuseError

_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclasses.dataclass
class Node:
    """What an op translation needs of its node: the attributes and the model's opset."""
    op_type: str
    attrs: dict
    opset: int
    outputs: int = 1    # how many outputs the node names (Split into equal parts needs it)

    def get(self, name: str, default=None):
        return self.attrs.get(name, default)

    def __getitem__(self, name: str):
        return self.attrs[name]


@dataclasses.dataclass
class Graph:
    """An ONNX graph ready to walk, shared by the JAX and torch translations: the constants
    (initializers, Constant nodes and what is computed from them alone, folded with numpy) and
    the nodes left to run on the graph inputs, in order, each with its ``Node``."""
    input_names: list[str]
    output_names: list[str]
    constants: dict[str, np.ndarray]
    nodes: list[tuple]


def parse_graph(model, ops: dict, missing_message: str) -> Graph:
    """The model's ``Graph`` with its constants folded; ``AutofuseError(missing_message + ops)``
    when ``ops`` lacks one of its op types."""
    from onnx import numpy_helper

    missing = unsupported_ops(model, ops)
    if missing:
        raise AutofuseError(f"{missing_message} {', '.join(missing)}")
    graph = model.graph
    opset = _opset(model)
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    # Old IR versions list initializers among the inputs too; those are not the caller's to give.
    input_names = [value.name for value in graph.input if value.name not in constants]
    nodes = []
    for node in graph.node:
        info = Node(node.op_type, _attrs(node), opset, len(node.output))
        args = node_args(node, constants)
        if args is not None and folds(node.op_type, args):
            store_results(node, OPS[node.op_type](np, info, *args), constants, folded=True)
        else:
            nodes.append((node, info))
    return Graph(input_names, [value.name for value in graph.output], constants, nodes)


def jax_function(model) -> Callable[..., list]:
    """A function of the graph's (non-initializer) inputs, in graph input order, returning the
    list of graph outputs as jax arrays. Pure jax.numpy/jax.lax, so jax.jit can trace it.
    Initializers become constants (jnp arrays)."""
    graph = parse_graph(model, OPS, "the XLA baseline has no JAX translation for ONNX op(s)")

    def run(*inputs):
        import jax.numpy as jnp

        if len(inputs) != len(graph.input_names):
            raise TypeError(f"the graph takes {len(graph.input_names)} input(s) {graph.input_names}, got {len(inputs)}")
        values = dict(graph.constants)
        # As jax arrays, so a graph input never takes the numpy (constant) path.
        values.update((name, jnp.asarray(x)) for name, x in zip(graph.input_names, inputs))
        for node, info in graph.nodes:
            _evaluate(node, info, values)
        return [jnp.asarray(values[name]) for name in graph.output_names]

    return run


def unsupported_ops(model, ops: dict | None = None) -> list[str]:
    """Op types in the graph that ``ops`` (default: ``OPS``) lacks (sorted, unique); ops of other
    domains are named ``domain.Op``."""
    ops = OPS if ops is None else ops
    missing = set()
    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            missing.add(f"{node.domain}.{node.op_type}")
        elif node.op_type not in ops:
            missing.add(node.op_type)
    return sorted(missing)


def node_args(node, values: dict) -> list | None:
    """The node's operands from ``values`` (None for inputs left out), or None when one is not
    there yet (computed from the graph inputs)."""
    if any(name and name not in values for name in node.input):
        return None
    args = [values[name] if name else None for name in node.input]
    while args and args[-1] is None:  # trailing optional inputs that were left out
        args.pop()
    return args


def folds(op_type: str, args) -> bool:
    """Whether a node is evaluated eagerly with numpy: all its operands are constants and its
    translation runs on numpy."""
    return op_type in OPS and op_type not in _JAX_ONLY and all(a is None or isinstance(a, np.ndarray) for a in args)


def store_results(node, results, values: dict, folded: bool) -> None:
    """Put an op's result(s) under the node's output names."""
    if not isinstance(results, tuple):
        results = (results,)
    wanted = [name for name in node.output[len(results):] if name]
    if wanted:
        raise AutofuseError(f"the baseline computes only the first {len(results)} output(s) of "
                            f"ONNX op {node.op_type}, the graph uses {', '.join(wanted)}")
    for name, value in zip(node.output, results):
        if name:
            # numpy turns 0-d results into scalars; keep constants ndarrays so they stay recognisable.
            values[name] = np.asarray(value) if folded else value


def _evaluate(node, info: Node, values: dict) -> None:
    import jax.numpy as jnp

    args = node_args(node, values)
    folded = folds(node.op_type, args)
    store_results(node, OPS[node.op_type](np if folded else jnp, info, *args), values, folded)


def _opset(model) -> int:
    versions = [o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS]
    if not versions:
        raise AutofuseError("the model imports no version of the default ONNX opset")
    return max(versions)


def _attrs(node) -> dict:
    from onnx import helper

    attrs = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
    return attrs


def _static(value, what: str) -> list[int]:
    """A shape-like operand as Python ints; it must be known before tracing."""
    if not isinstance(value, np.ndarray):
        raise AutofuseError(f"the XLA baseline needs static shapes, but {what} is computed from the graph inputs")
    return [int(v) for v in value.reshape(-1)]


def _axes(node: Node, axes_input, what: str):
    """Axes given as an input (newer opsets) or an attribute (older ones); None when absent."""
    if axes_input is not None:
        return _static(axes_input, what)
    return node.get("axes")


# --- elementwise -----------------------------------------------------------------------------

def _binary(name: str):
    def op(xp, node, x, y):
        return getattr(xp, name)(x, y)
    return op


def _unary(name: str):
    def op(xp, node, x):
        return getattr(xp, name)(x)
    return op


def _variadic(name: str):
    def op(xp, node, *inputs):
        return functools.reduce(getattr(xp, name), inputs)
    return op


def _div(xp, node, x, y):
    if xp.issubdtype(x.dtype, xp.integer):
        # ONNX integer division truncates toward zero; floor_divide rounds down.
        quotient = xp.floor_divide(xp.abs(x), xp.abs(y))
        return xp.where((x < 0) != (y < 0), -quotient, quotient).astype(x.dtype)
    return xp.divide(x, y)


def _pow(xp, node, x, y):
    # ONNX lets the exponent have another type; the result has the base's.
    return xp.power(x, y).astype(x.dtype)


def _relu(xp, node, x):
    return xp.maximum(x, xp.zeros((), x.dtype))


def _reciprocal(xp, node, x):
    return xp.ones((), x.dtype) / x


def _identity(xp, node, x):
    return x


def _erf(xp, node, x):
    import jax
    return jax.lax.erf(x)


def _sigmoid(xp, node, x):
    import jax
    return jax.nn.sigmoid(x)


def _hard_sigmoid(xp, node, x):
    alpha = xp.asarray(node.get("alpha", 0.2), x.dtype)
    beta = xp.asarray(node.get("beta", 0.5), x.dtype)
    return xp.clip(alpha * x + beta, xp.zeros((), x.dtype), xp.ones((), x.dtype))


def _hard_swish(xp, node, x):
    # The spec's function: x * max(0, min(1, x / 6 + 0.5)).
    gate = xp.clip(x * xp.asarray(1 / 6, x.dtype) + xp.asarray(0.5, x.dtype), xp.zeros((), x.dtype),
                   xp.ones((), x.dtype))
    return x * gate


def _where(xp, node, condition, x, y):
    return xp.where(condition, x, y)


def _bit_shift(xp, node, x, y):
    if node["direction"] == "RIGHT":
        return xp.right_shift(x, y)  # logical: ONNX BitShift is for unsigned types only
    return xp.left_shift(x, y)


def _cast(xp, node, x):
    from onnx import helper

    # Under jax without x64, 64-bit targets come out 32-bit: jax has no 64-bit arrays then.
    return x.astype(helper.tensor_dtype_to_np_dtype(node["to"]))


# --- linear algebra and neural-network ops ---------------------------------------------------

def _matmul(xp, node, a, b):
    return xp.matmul(a, b)


def _gemm(xp, node, a, b, c=None):
    a = a.T if node.get("transA", 0) else a
    b = b.T if node.get("transB", 0) else b
    out = node.get("alpha", 1.0) * xp.matmul(a, b)
    return out if c is None else out + node.get("beta", 1.0) * c


def _conv(xp, node, x, w, b=None):
    import jax

    spatial = x.ndim - 2
    auto_pad = node.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = node.get("pads", [0] * (2 * spatial))
        padding = [(pads[i], pads[i + spatial]) for i in range(spatial)]
    else:
        # lax's "SAME" puts the odd pad at the end, as ONNX's SAME_UPPER does.
        padding = {"SAME_UPPER": "SAME", "SAME_LOWER": "SAME_LOWER", "VALID": "VALID"}[auto_pad]
    out = jax.lax.conv_general_dilated(
        x, w, window_strides=node.get("strides", [1] * spatial), padding=padding,
        rhs_dilation=node.get("dilations", [1] * spatial), feature_group_count=node.get("group", 1),
        dimension_numbers=_conv_layout(spatial))
    return out if b is None else out + b.reshape((1, -1) + (1,) * spatial)


def _conv_layout(spatial: int) -> tuple[str, str, str]:
    dims = "DHW"[-spatial:] if spatial <= 3 else None
    if dims is None:
        raise AutofuseError(f"the XLA baseline supports Conv over 1 to 3 spatial dimensions, not {spatial}")
    return ("NC" + dims, "OI" + dims, "NC" + dims)


def _batch_norm(xp, node, x, scale, bias, mean, var):
    if node.get("training_mode", 0):
        raise AutofuseError("the XLA baseline supports BatchNormalization in inference mode only")
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv_std = scale / xp.sqrt(var + xp.asarray(node.get("epsilon", 1e-5), var.dtype))
    return (x - mean.reshape(shape)) * inv_std.reshape(shape) + bias.reshape(shape)


def _layer_norm(xp, node, x, scale, bias=None):
    from onnx import helper

    # Mean and variance in stash_type (float by default), as the spec's function body does.
    stash = helper.tensor_dtype_to_np_dtype(node.get("stash_type", 1))
    axis = node.get("axis", -1) % x.ndim
    axes = tuple(range(axis, x.ndim))
    xs = x.astype(stash)
    mean = xs.mean(axis=axes, keepdims=True)
    centred = xs - mean
    variance = (centred * centred).mean(axis=axes, keepdims=True)
    inv_std = 1 / xp.sqrt(variance + xp.asarray(node.get("epsilon", 1e-5), stash))
    out = (centred * inv_std).astype(x.dtype) * scale
    return (out if bias is None else out + bias), mean, inv_std


def _softmax(xp, node, x):
    import jax

    if node.opset >= 13:
        return jax.nn.softmax(x, axis=node.get("axis", -1))
    # Before opset 13 Softmax flattens to 2-D at axis and normalises over all trailing dims.
    axis = node.get("axis", 1) % x.ndim
    flat = x.reshape((math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))
    return jax.nn.softmax(flat, axis=1).reshape(x.shape)


def _global_average_pool(xp, node, x):
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)


def _max_pool(xp, node, x):
    import jax

    spatial = x.ndim - 2
    kernel = list(node["kernel_shape"])
    strides = list(node.get("strides", [1] * spatial))
    dilations = list(node.get("dilations", [1] * spatial))
    begins, ends = window_pads(node, x.shape[2:], kernel, strides, dilations)
    init = -xp.inf if xp.issubdtype(x.dtype, xp.floating) else xp.iinfo(x.dtype).min
    return jax.lax.reduce_window(x, xp.asarray(init, x.dtype), jax.lax.max, (1, 1, *kernel), (1, 1, *strides),
                                 [(0, 0), (0, 0), *zip(begins, ends)], window_dilation=(1, 1, *dilations))


def window_pads(node, sizes, kernel, strides, dilations) -> tuple[list[int], list[int]]:
    """A Conv's or pooling window's padding before and after each spatial axis: ``pads`` or
    ``auto_pad``, plus, with a pooling ``ceil_mode``, what makes the last partial window count."""
    spatial = len(sizes)
    auto_pad = node.get("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", "VALID"):
        pads = list(node.get("pads", [0] * (2 * spatial))) if auto_pad == "NOTSET" else [0] * (2 * spatial)
        begins, ends = pads[:spatial], pads[spatial:]
    else:
        begins, ends = [], []
        for size, k, stride, dilation in zip(sizes, kernel, strides, dilations):
            total = max((math.ceil(size / stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            # SAME_UPPER puts the odd pad at the end, SAME_LOWER at the beginning.
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
    if node.get("ceil_mode", 0):
        for i, (size, k, stride, dilation) in enumerate(zip(sizes, kernel, strides, dilations)):
            span = size + begins[i] + ends[i] - (k - 1) * dilation - 1
            windows = math.ceil(span / stride) + 1
            if (windows - 1) * stride >= size + begins[i]:  # a window may not start in the end padding
                windows -= 1
            ends[i] += max((windows - 1) * stride + (k - 1) * dilation + 1 - (size + begins[i] + ends[i]), 0)
    return begins, ends


def _reduce(name: str):
    def op(xp, node, x, axes=None):
        axes = _axes(node, axes, f"the axes of Reduce{name.capitalize()}")
        if not axes:
            if node.get("noop_with_empty_axes", 0):
                return x
            axes = None  # all axes
        return getattr(xp, name)(x, axis=None if axes is None else tuple(axes),
                                 keepdims=bool(node.get("keepdims", 1)))
    return op


# --- shapes and indexing ---------------------------------------------------------------------

def _constant(xp, node):
    from onnx import numpy_helper

    if "value" in node.attrs:
        return numpy_helper.to_array(node["value"])
    kinds = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for name, dtype in kinds.items():
        if name in node.attrs:
            return np.asarray(node[name], dtype)
    raise AutofuseError(f"the XLA baseline supports Constant with {', '.join(['value', *kinds])} only, "
                        f"not {', '.join(node.attrs)}")


def _constant_of_shape(xp, node, shape):
    from onnx import numpy_helper

    value = numpy_helper.to_array(node["value"]) if "value" in node.attrs else np.zeros(1, np.float32)
    return xp.full(tuple(_static(shape, "ConstantOfShape's shape")), value.reshape(()), dtype=value.dtype)


def _range(xp, node, start, limit, delta):
    # Its length depends on its operands' values: they must be known before tracing.
    bounds = [v for v in (start, limit, delta) if isinstance(v, np.ndarray)]
    if len(bounds) < 3:
        raise AutofuseError("the XLA baseline needs static shapes, but Range's bounds are computed from the graph inputs")
    return np.arange(start.item(), limit.item(), delta.item()).astype(start.dtype)


def _split(xp, node, x, split=None):
    axis = node.get("axis", 0) % x.ndim
    if split is not None:
        sizes = _static(split, "Split's sizes")
    elif "split" in node.attrs:  # an attribute before opset 13
        sizes = list(node["split"])
    else:
        parts = node.get("num_outputs") or node.outputs
        size = -(-x.shape[axis] // parts)  # the last part takes what is left (opset 18)
        sizes = [min(size, x.shape[axis] - i * size) for i in range(parts)]
    cuts = np.cumsum(sizes)[:-1].tolist()
    return tuple(xp.split(x, cuts, axis=axis))


def _gather_nd(xp, node, x, indices):
    if node.get("batch_dims", 0):
        raise AutofuseError("the XLA baseline supports GatherND with batch_dims = 0 only")
    depth = indices.shape[-1]
    index = tuple(_normalized(xp, indices[..., i], x.shape[i]) for i in range(depth))
    return x[index]


def _shape(xp, node, x):
    # Static under jax tracing too, so always a numpy constant.
    return np.asarray(x.shape[node.get("start", 0):node.get("end", None)], np.int64)


def _reshape(xp, node, x, shape):
    shape = _static(shape, "Reshape's shape")
    if not node.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]  # 0 copies the input's dim
    return xp.reshape(x, shape)


def _transpose(xp, node, x):
    return xp.transpose(x, node.get("perm"))  # no perm reverses the axes, in ONNX as in numpy


def _flatten(xp, node, x):
    axis = node.get("axis", 1) % (x.ndim + 1) if x.ndim else 0
    return xp.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


def _unsqueeze(xp, node, x, axes=None):
    return xp.expand_dims(x, tuple(_axes(node, axes, "Unsqueeze's axes")))


def _squeeze(xp, node, x, axes=None):
    axes = _axes(node, axes, "Squeeze's axes")
    return xp.squeeze(x, axis=None if axes is None else tuple(axes))


def _concat(xp, node, *inputs):
    return xp.concatenate(inputs, axis=node["axis"])


def _gather(xp, node, x, indices):
    axis = node.get("axis", 0) % x.ndim
    # Negative indices count from the end; normalise them rather than rely on take's index mode.
    indices = xp.where(indices < 0, indices + x.shape[axis], indices)
    return xp.take(x, indices, axis=axis)


def _slice(xp, node, x, starts=None, ends=None, axes=None, steps=None):
    if node.opset < 10:  # starts, ends and axes were attributes then
        starts, ends, axes = node["starts"], node["ends"], node.get("axes")
    else:
        starts, ends = _static(starts, "Slice's starts"), _static(ends, "Slice's ends")
        axes = None if axes is None else _static(axes, "Slice's axes")
        steps = None if steps is None else _static(steps, "Slice's steps")
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * x.ndim
    # Python slices clamp out-of-range starts and ends the way ONNX Slice does.
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis] = slice(start, end, step)
    return x[tuple(index)]


def _normalized(xp, indices, size: int):
    # Negative indices count from the end.
    return xp.where(indices < 0, indices + size, indices)


def _gather_elements(xp, node, x, indices):
    axis = node.get("axis", 0) % x.ndim
    return xp.take_along_axis(x, _normalized(xp, indices, x.shape[axis]), axis=axis)


def _scatter_elements(xp, node, x, indices, updates):
    axis = node.get("axis", 0) % x.ndim
    # Element (i0, .., in) of updates goes to x at the same position with axis ``axis`` replaced
    # by indices[i0, .., in]: an index tuple of broadcast position grids.
    grids = list(np.indices(indices.shape, sparse=True))
    grids[axis] = _normalized(xp, indices, x.shape[axis])
    index = tuple(grids)
    reduction = node.get("reduction", "none")
    if xp is np:
        out = np.array(x, copy=True)
        if reduction == "none":
            out[index] = updates
        else:
            {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction].at(out, index, updates)
        return out
    at = xp.asarray(x).at[index]  # x may be a folded constant (numpy) among traced operands
    return {"none": at.set, "add": at.add, "mul": at.multiply, "max": at.max, "min": at.min}[reduction](updates)


def _expand(xp, node, x, shape):
    # ONNX Expand broadcasts both ways: a 1 in ``shape`` keeps the input's dim.
    target = np.broadcast_shapes(x.shape, tuple(_static(shape, "Expand's shape")))
    return xp.broadcast_to(x, target)


# --- reductions over an axis, selection --------------------------------------------------------

def _cumsum(xp, node, x, axis):
    dim = _static(axis, "CumSum's axis")[0] % x.ndim
    if node.get("reverse", 0):
        x = xp.flip(x, dim)
    out = xp.cumsum(x, axis=dim, dtype=x.dtype)
    if node.get("exclusive", 0):  # shifted by one, a zero first: no cancellation from out - x
        head = [slice(None)] * x.ndim
        head[dim] = slice(0, 1)
        body = [slice(None)] * x.ndim
        body[dim] = slice(0, -1)
        out = xp.concatenate([xp.zeros_like(x[tuple(head)]), out[tuple(body)]], axis=dim)
    return xp.flip(out, dim) if node.get("reverse", 0) else out


def _top_k(xp, node, x, k):
    k = _static(k, "TopK's k")[0]
    axis = node.get("axis", -1) % x.ndim
    largest = bool(node.get("largest", 1))
    moved = xp.moveaxis(x, axis, -1)
    key = moved if largest else -moved
    if xp is np:
        # Stable on the negated key: among equal values the lower index first, as ONNX sorts.
        indices = np.argsort(-key, axis=-1, kind="stable")[..., :k]
        values = np.take_along_axis(moved, indices, axis=-1)
    else:
        import jax

        values, indices = jax.lax.top_k(key, k)  # equal values: the lower index first
        values = values if largest else -values
    # Always sorted (ONNX's sorted=0 leaves the order unspecified, so sorted is valid too).
    return xp.moveaxis(values, -1, axis), xp.moveaxis(indices, -1, axis).astype(xp.int64 if xp is np else indices.dtype)


def _einsum(xp, node, *inputs):
    return xp.einsum(node["equation"], *inputs)


def _matmul_integer(xp, node, a, b, a_zero=None, b_zero=None):
    if xp is not np and a_zero is None and b_zero is None and a.ndim == b.ndim == 2:
        import jax

        # int8 x int8 with int32 accumulation: what XLA can hand to an integer GEMM.
        return jax.lax.dot(a, b, preferred_element_type=xp.int32)
    a = a.astype(xp.int32)
    b = b.astype(xp.int32)
    if a_zero is not None:
        zero = a_zero.astype(xp.int32)
        a = a - (zero.reshape(-1, 1) if zero.ndim == 1 and zero.size > 1 else zero)  # 1-D: one per row of a
    if b_zero is not None:
        b = b - b_zero.astype(xp.int32)
    return xp.matmul(a, b)


OPS: dict[str, Callable] = {
    "Add": _binary("add"), "Sub": _binary("subtract"), "Mul": _binary("multiply"), "Div": _div,
    "Pow": _pow, "Max": _variadic("maximum"), "Min": _variadic("minimum"), "Sum": _variadic("add"),
    "Equal": _binary("equal"), "Less": _binary("less"), "Greater": _binary("greater"),
    "LessOrEqual": _binary("less_equal"), "GreaterOrEqual": _binary("greater_equal"),
    "And": _binary("logical_and"), "Or": _binary("logical_or"), "Not": _unary("logical_not"),
    "BitShift": _bit_shift, "BitwiseAnd": _binary("bitwise_and"), "BitwiseOr": _binary("bitwise_or"),
    "BitwiseXor": _binary("bitwise_xor"), "BitwiseNot": _unary("bitwise_not"),
    "Neg": _unary("negative"), "Abs": _unary("abs"), "Exp": _unary("exp"), "Log": _unary("log"),
    "Sqrt": _unary("sqrt"), "Tanh": _unary("tanh"), "Reciprocal": _reciprocal, "Relu": _relu,
    "Erf": _erf, "Sigmoid": _sigmoid, "Identity": _identity, "Where": _where, "Cast": _cast,
    "MatMul": _matmul, "Gemm": _gemm, "Conv": _conv, "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm, "Softmax": _softmax, "GlobalAveragePool": _global_average_pool,
    "ReduceMean": _reduce("mean"), "ReduceSum": _reduce("sum"), "ReduceMax": _reduce("max"),
    "ReduceMin": _reduce("min"),
    "Constant": _constant, "Shape": _shape, "Reshape": _reshape, "Transpose": _transpose,
    "Flatten": _flatten, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Concat": _concat,
    "Gather": _gather, "Slice": _slice, "Expand": _expand, "GatherElements": _gather_elements,
    "ScatterElements": _scatter_elements, "CumSum": _cumsum, "TopK": _top_k, "Einsum": _einsum,
    "MatMulInteger": _matmul_integer,
    "IsNaN": _unary("isnan"), "Cos": _unary("cos"), "Sin": _unary("sin"), "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish, "MaxPool": _max_pool, "ConstantOfShape": _constant_of_shape, "Range": _range,
    "Split": _split, "GatherND": _gather_nd,
}

# These call jax itself (jax.lax, jax.nn), so they never run on the numpy constant path.
_JAX_ONLY = {"Erf", "Sigmoid", "Conv", "Softmax", "MaxPool"}
