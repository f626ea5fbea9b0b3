"""ONNX files into Relax, with one clear error for each way a file can be unusable.

Before the Relax frontend sees a model, its symbolic input dimensions are bound (``--input-shape``)
and its shape computations folded (``shapes.static_model``): what reaches Relax has static
shapes. The op set the Relax ONNX frontend
converts is the op set autofuse supports; anything else is named in the error before the
frontend is asked, and an op it fails on is named with its node. TVM's warnings during import are
collected (``ImportNotes``), not printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
import warnings

import google.protobuf.message
import numpy as np
import onnx
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from ..errors import AutofuseError
from .shapes import input_specs

@dataclasses.dataclass
class ImportNotes:
    """What happened on the way into Relax, for one summary line."""
    folded: int = 0                                  # nodes replaced by constants
    warnings: list[str] = dataclasses.field(default_factory=list)   # TVM's, captured

    def summary(self) -> str:
        parts = [f"{self.folded} shape/constant node(s) folded"]
        if self.warnings:
            parts.append(f"{len(self.warnings)} TVM import warning(s) not shown")
        return ", ".join(parts)


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


def unsupported_ops(model) -> dict[str, str]:
    """Op types the Relax frontend cannot convert, each with the first node that uses it."""
    known = set(onnx_frontend._get_convert_map()) | {"If", "Constant"}
    missing: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in known:
            missing.setdefault(node.op_type, node.name or (node.output[0] if node.output else "(unnamed)"))
    return dict(sorted(missing.items()))


def to_relax(model, path: str = "model", notes: ImportNotes | None = None):
    """The Relax IRModule of ``model``, weights embedded as constants. An op the frontend cannot
    convert is one error naming the op, its node and the model; TVM's warnings (Python's and
    its C++ log on stderr) go to ``notes`` instead of the terminal."""
    missing = unsupported_ops(model)
    if missing:
        named = ", ".join(f"{op} (node {node!r})" for op, node in missing.items())
        raise AutofuseError(f"{path} uses ONNX op(s) the Relax frontend cannot import: {named}")
    notes = notes if notes is not None else ImportNotes()
    importer = _NamingImporter(None, "float32", keep_params_in_input=False, sanitize=True)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    try:
        with captured_tvm_output(notes):
            mod = importer.from_onnx(model.graph, opset)
    except _NodeFailed as failed:
        raise AutofuseError(f"{path}: node {failed.node!r} ({failed.op}) cannot be imported into Relax: "
                            f"{_first_line(failed.cause)}") from None
    except Exception as err:  # the frontend raises many types for graphs it cannot convert
        raise AutofuseError(f"importing {path} into Relax failed: {_first_line(err)}") from None
    if importer.dynamic is not None:
        op, node = importer.dynamic
        raise AutofuseError(f"{path}: node {node!r} ({op}) gives a tensor whose shape is known only at run time "
                            "(data-dependent); autofuse builds models of static shapes")
    return mod


class _NodeFailed(Exception):
    def __init__(self, op: str, node: str, cause: BaseException):
        super().__init__(op, node)
        self.op, self.node, self.cause = op, node, cause


class _NamingImporter(onnx_frontend.ONNXGraphImporter):
    """TVM's importer, knowing which node it was converting when a conversion fails, and the
    first node whose output shape is not static."""

    dynamic: tuple[str, str] | None = None

    def _convert_operator(self, op_name, inputs, attrs, opset):
        node = attrs.get("tvm_custom", {}).get("name") or "(unnamed)"
        try:
            out = super()._convert_operator(op_name, inputs, attrs, opset)
        except Exception as err:
            raise _NodeFailed(op_name, node, err) from err
        if self.dynamic is None and not _static(out):
            self.dynamic = (op_name, node)
        return out


def _static(expr) -> bool:
    """Every tensor in ``expr``'s type has a shape of integer constants."""
    ty = getattr(expr, "ty", None)
    return ty is None or _static_type(ty)


def _static_type(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_static_type(field) for field in ty.fields)
    if isinstance(ty, relax.TensorType):
        shape = ty.shape
        return isinstance(shape, relax.ShapeExpr) and all(isinstance(v, tirx.IntImm) for v in shape.values)
    return True


@contextlib.contextmanager
def captured_tvm_output(notes: ImportNotes):
    """TVM's Python warnings, its prints and its C++ log (fd 2) into ``notes``."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()), \
            tempfile.TemporaryFile(mode="w+b") as native:
        warnings.simplefilter("always")
        saved = os.dup(2)
        os.dup2(native.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            notes.warnings.extend(str(w.message).splitlines()[0] for w in caught if str(w.message).strip())
            native.seek(0)
            notes.warnings.extend(line for line in native.read().decode(errors="replace").splitlines()
                                  if line.strip())


def random_inputs(model, seed: int = 0) -> dict[str, np.ndarray]:
    return random_feeds(input_specs(model), seed)


def random_feeds(specs, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for (name, shape, dtype) specs: standard normal floats; integers in [0, 8),
    valid token ids (a negative id would index out of bounds); an integer input named as a mask
    (HF's attention_mask) 0 or 1, the only values a tokenizer writes: other values send a model's
    mask arithmetic ((1 - mask) x finfo.min) past float16's range, and the module itself (torch's
    own mask handling) computes something else than its exported graph."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, shape, dtype in specs:
        if np.issubdtype(np.dtype(dtype), np.floating):
            inputs[name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in name.lower():
            inputs[name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            inputs[name] = rng.integers(0, 8, size=shape).astype(dtype)
    return inputs


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
