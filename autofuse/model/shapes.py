"""Static shapes for ONNX graphs as exporters write them, before any backend sees them (pure onnx
and numpy: the Relax import and the translation baselines share it).

Exported models compute shapes at run time: ``Shape`` -> ``Gather`` -> ``Div`` -> ``Reshape`` in
ShuffleNet's channel shuffle, ``ConstantOfShape``/``Expand``/``Where`` for HF's attention masks,
and their inputs have symbolic batch and sequence axes. ``bind_input_shapes`` gives the symbolic
axes sizes (``--input-shape``); ``fold_constants`` evaluates every node whose inputs are constants,
or ``Shape``/``Size`` of a tensor whose shape is static, with onnx's reference evaluator and
replaces it by an initializer, to a fixed point; ``static_model`` does both.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx.reference

from ..errors import AutofuseError

# Not folded: their value is not a function of their inputs, or they hold subgraphs.
NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
              "Bernoulli", "If", "Loop", "Scan"}
# A folded value larger than this stays a computation (a model file should not grow by it).
MAX_FOLDED_BYTES = 64 << 20


def input_specs(model) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, numpy dtype) of each graph input that is not an initializer; a symbolic
    dimension is an error saying which input and how to bind it."""
    specs = []
    for value in _graph_inputs(model):
        tensor = value.type.tensor_type
        dims = _dims(value)
        if not all(isinstance(d, int) for d in dims):
            raise AutofuseError(f"input {value.name!r} has symbolic dimensions: give them sizes with --input-shape "
                                f"{value.name}={_shown(dims)} (each <axis> a size)")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        specs.append((value.name, tuple(dims), np.dtype(dtype).name))
    return specs


def _graph_inputs(model) -> list:
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def _dims(value) -> list:
    """A value's dimensions: an int where fixed, else its symbol (or "?")."""
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in value.type.tensor_type.shape.dim]


def bind_input_shapes(model, shapes: dict[str, tuple[int, ...]] | None, path: str = "model"):
    """A copy of ``model`` with its inputs' dimensions set from ``shapes`` (``--input-shape``):
    each named input must exist, have that rank and agree with its fixed dimensions; a symbol
    shared by several inputs (``batch``) gets one size, and an input left out whose symbols are
    all bound by the others (``attention_mask`` after ``input_ids=1x128``) gets theirs."""
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    if not shapes:
        return model_copy
    inputs = {value.name: value for value in _graph_inputs(model_copy)}
    unknown = [name for name in shapes if name not in inputs]
    if unknown:
        raise AutofuseError(f"--input-shape names {', '.join(repr(n) for n in unknown)}, not an input of {path} "
                            f"(its inputs: {', '.join(inputs) or 'none'})")
    symbols: dict[str, tuple[int, str]] = {}
    for name, dims in shapes.items():
        given = f"--input-shape {name}={'x'.join(map(str, dims))}"
        current = _dims(inputs[name])
        if len(current) != len(dims):
            raise AutofuseError(f"{given}: {name!r} has {len(current)} dimension(s) ({_shown(current)}), "
                                f"not {len(dims)}")
        for axis, (was, size) in enumerate(zip(current, dims)):
            if isinstance(was, int) and was != size:
                raise AutofuseError(f"{given}: dimension {axis} of {name!r} is fixed at {was} in {path}")
            if was != "?" and isinstance(was, str):
                bound, by = symbols.setdefault(was, (size, name))
                if bound != size:
                    raise AutofuseError(f"--input-shape gives dimension {was!r} two sizes: {bound} ({by}) and "
                                        f"{size} ({name})")
        _set_dims(inputs[name], dims)
    for name, value in inputs.items():
        current = _dims(value)
        if name not in shapes and all(isinstance(d, int) or d in symbols for d in current):
            _set_dims(value, [d if isinstance(d, int) else symbols[d][0] for d in current])
    return model_copy


def _shown(dims) -> str:
    return "x".join(str(d) if isinstance(d, int) else f"<{d}>" for d in dims)


def _set_dims(value, sizes) -> None:
    for d, size in zip(value.type.tensor_type.shape.dim, sizes):
        d.Clear()
        d.dim_value = size


def fold_constants(model) -> tuple[object, int]:
    """``model``, changed in place, with every node whose value is known before run time replaced
    by an initializer: inputs all constants, or ``Shape``/``Size`` of a tensor whose shape ONNX shape
    inference finds static. Repeated (shape inference again) until a pass folds nothing; then
    nodes and initializers nothing reads are dropped. Returns the model and how many nodes
    were folded. A node the reference evaluator cannot run stays for the frontend."""
    graph = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for node in graph.node:  # errors name nodes: give unnamed ones their first output's name
        if not node.name and node.output:
            node.name = node.output[0]
    outputs = {o.name for o in graph.output}
    total = 0
    while True:
        shapes = _static_shapes(model)
        values = {init.name: init for init in graph.initializer}
        kept, folded = [], 0
        for node in graph.node:
            result = None
            if not (set(node.output) & outputs) and node.domain in ("", "ai.onnx"):
                result = _fold(node, values, shapes, opsets)
            if result is None:
                kept.append(node)
                continue
            for name, array in zip(node.output, result):
                if name:  # an optional output left out has no name
                    values[name] = onnx.numpy_helper.from_array(np.asarray(array), name)
                    graph.initializer.append(values[name])
            folded += 1
        if not folded:
            break
        total += folded
        del graph.node[:]
        graph.node.extend(kept)
    _drop_unused(graph)
    del graph.value_info[:]
    return model, total


def _static_shapes(model) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, for every tensor whose shape ONNX shape inference finds static."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # inference gives up on some graphs: fold what the constants alone allow
        inferred = model
    shapes = {}
    graph = inferred.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims = _dims(value)
            if all(isinstance(d, int) for d in dims):
                shapes[value.name] = tuple(dims)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _fold(node, values: dict, shapes: dict, opsets: dict) -> list[np.ndarray] | None:
    """The values of ``node``'s outputs when known now, else None."""
    if node.op_type in NOT_FOLDED:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        shape = np.array(shapes[node.input[0]], dtype=np.int64)
        if node.op_type == "Size":
            return [np.array(shape.prod(), dtype=np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        return [shape[attrs.get("start", 0):attrs.get("end", len(shape))]]
    names = [name for name in node.input if name]
    if any(name not in values for name in names) or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
        return None
    feeds = {name: onnx.numpy_helper.to_array(values[name]) for name in names}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = onnx.reference.ReferenceEvaluator(node, opsets=opsets).run(None, feeds)
    except Exception:  # an op or case the reference evaluator lacks: the frontend converts it
        return None
    if any(not isinstance(r, np.ndarray) and not np.isscalar(r) for r in result):
        return None
    if sum(np.asarray(r).nbytes for r in result) > MAX_FOLDED_BYTES:
        return None
    return result


def _drop_unused(graph) -> None:
    """Remove nodes whose outputs nothing reads (a Reshape whose only reader was a folded Shape)
    and initializers nothing reads (what folded nodes read), with their graph-input entries where
    the model lists initializers as inputs."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        for attr_graph in (a.g for node in graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH):
            used |= {name for node in attr_graph.node for name in node.input}
        live = [node for node in graph.node if any(name in used for name in node.output)]
        if len(live) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(live)
    dropped = {init.name for init in graph.initializer if init.name not in used}
    kept = [init for init in graph.initializer if init.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [value for value in graph.input if value.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)


def static_model(model, input_shapes: dict[str, tuple[int, ...]] | None = None, path: str = "model"):
    """(``model`` with its input dimensions bound and its shape computations folded, how many
    nodes were folded); its inputs must then all be static (``input_specs`` says which is not)."""
    bound = bind_input_shapes(model, input_shapes, path)
    input_specs(bound)  # a symbolic input dimension is an error before any work
    return fold_constants(bound)
