"""ONNX files into Relax, with one clear error for each way a file can be unusable.

The op set the Relax ONNX frontend converts is the op set autofuse supports; anything else is
named in the error before the frontend is asked.
"""

from __future__ import annotations

import os

import google.protobuf.message
import numpy as np
import onnx
from tvm.relax.frontend.onnx import from_onnx, onnx_frontend

from ..errors import AutofuseError


def load_onnx(path: str):
    """Read and check an ONNX model file."""
    if not os.path.exists(path):
        raise AutofuseError(f"model file {path} does not exist")
    if os.path.isdir(path):
        raise AutofuseError(f"model path {path} is a directory, not an ONNX file")
    if os.path.getsize(path) == 0:
        raise AutofuseError(f"model file {path} is empty")
    try:
        model = onnx.load(path)
    except (google.protobuf.message.DecodeError, ValueError, RuntimeError, OSError) as err:
        raise AutofuseError(f"{path} is not a readable ONNX model ({type(err).__name__}: "
                            f"{_first_line(err)})") from None
    if not model.graph.node:
        raise AutofuseError(f"{path} holds no ONNX graph (not an ONNX model, or an empty one)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        raise AutofuseError(f"{path} fails the ONNX checker: {_first_line(err)}") from None
    return model


def unsupported_ops(model) -> list[str]:
    known = set(onnx_frontend._get_convert_map()) | {"If", "Constant"}
    return sorted({node.op_type for node in model.graph.node if node.op_type not in known})


def to_relax(model, path: str = "model"):
    """The Relax IRModule of ``model``, weights embedded as constants."""
    missing = unsupported_ops(model)
    if missing:
        raise AutofuseError(f"{path} uses ONNX op(s) the Relax frontend cannot import: {', '.join(missing)}")
    try:
        return from_onnx(model, keep_params_in_input=False)
    except Exception as err:  # the frontend raises many types for graphs it cannot convert
        raise AutofuseError(f"importing {path} into Relax failed: {_first_line(err)}") from None


def input_specs(model) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, numpy dtype) of each graph input that is not an initializer."""
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = []
        for d in tensor.shape.dim:
            if not d.HasField("dim_value"):
                raise AutofuseError(f"input {value.name!r} has a symbolic dimension {d.dim_param!r}: "
                                    "give it a fixed size in the model")
            dims.append(int(d.dim_value))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        specs.append((value.name, tuple(dims), np.dtype(dtype).name))
    return specs


def random_inputs(model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, shape, dtype in input_specs(model):
        if np.issubdtype(np.dtype(dtype), np.floating):
            inputs[name] = rng.standard_normal(shape).astype(dtype)
        else:
            inputs[name] = rng.integers(0, 8, size=shape).astype(dtype)
    return inputs


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
