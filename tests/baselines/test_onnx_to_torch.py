"""The torch baselines run the same computation as onnxruntime: every pattern's ONNX graph and every
bundled model through ``torch_function`` on CPU torch match it; half-precision graphs stay within
rounding of the reference; constants reach the device once; an op without translation is named."""

import glob
import os

import numpy as np
import pytest

from autofuse.errors import AutofuseError
from autofuse.registry import all_patterns
from conftest import REPO

import onnx_cases

torch = pytest.importorskip("torch")

PATTERNS = [p for p in all_patterns().values() if p.onnx_graph is not None]
MODELS = sorted(glob.glob(os.path.join(REPO, "models", "*.onnx")))
# A few ulps of the dtype: an ONNX graph rounds every intermediate, the fused reference does not.
HALF_TOLERANCE = {"float16": 4e-3, "bfloat16": 3.2e-2}


def _run(model, inputs):
    from autofuse.baselines.onnx_to_torch import to_numpy, to_torch, torch_function

    return [to_numpy(t) for t in torch_function(model)(*[to_torch(x) for x in inputs])]


def _onnxruntime(model, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(model, inputs):
    initializers = {i.name for i in model.graph.initializer}
    return dict(zip([v.name for v in model.graph.input if v.name not in initializers], inputs))


def _assert_close(got, expected, rtol, atol):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.astype(np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_pattern_graph_matches_onnxruntime(pattern):
    shape, dtype = pattern.small_shape(), pattern.dtypes[0]
    model = pattern.onnx_graph(shape, dtype)
    inputs = pattern.make_inputs(shape, dtype, 3)
    _assert_close(_run(model, inputs), _onnxruntime(model, _feeds(model, inputs)), 1e-4, 1e-4)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: os.path.basename(p))
def test_bundled_model_matches_onnxruntime(path):
    import onnx

    from autofuse.model.importer import random_inputs

    model = onnx.load(path)
    feeds = random_inputs(model, 1)
    _assert_close(_run(model, list(feeds.values())), _onnxruntime(model, feeds), 1e-4, 1e-4)


@pytest.mark.parametrize("pattern,dtype", [(p, d) for p in PATTERNS for d in p.dtypes if d in HALF_TOLERANCE],
                         ids=lambda x: getattr(x, "name", x))
def test_half_precision_graph_is_within_rounding_of_the_reference(pattern, dtype):
    shape = pattern.small_shape()
    inputs = pattern.make_inputs(shape, dtype, 3)
    tolerance = HALF_TOLERANCE[dtype]
    _assert_close(_run(pattern.onnx_graph(shape, dtype), inputs), pattern.run_reference(inputs, shape),
                  tolerance, tolerance)


def test_uint32_hash_arithmetic_wraps_as_in_onnxruntime():
    from onnx import helper

    from autofuse.pattern import onnx_model

    consts = {"c": np.array(0x85EBCA6B, np.uint32), "s": np.array(13, np.uint32)}
    nodes = [helper.make_node("BitShift", ["x", "s"], ["t"], direction="RIGHT"),
             helper.make_node("BitwiseXor", ["x", "t"], ["u"]), helper.make_node("Mul", ["u", "c"], ["v"]),
             helper.make_node("Add", ["v", "c"], ["y"])]
    model = onnx_model("hash", nodes, [("x", (64,))], [("y", (64,))], "uint32", consts, opset=18)
    x = np.arange(1 << 30, (1 << 30) + 64 * 997, 997, dtype=np.uint32)
    np.testing.assert_array_equal(_run(model, [x])[0], _onnxruntime(model, {"x": x})[0])


def test_static_operands_fold_and_shape_folds_by_inference():
    """Reshape's shape computed from Shape and constants folds when the function is made; a
    negative-step Slice and per-axis QuantizeLinear follow ONNX."""
    from onnx import helper

    from autofuse.pattern import onnx_model

    consts = {"zero": np.array([0], np.int64), "last": np.array([-1], np.int64), "start": np.array([-1], np.int64),
              "end": np.array([-100], np.int64), "axis": np.array([1], np.int64), "step": np.array([-2], np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "axis"], ["rows"]),
             helper.make_node("Concat", ["rows", "last"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("Slice", ["flat", "start", "end", "axis", "step"], ["y"])]
    model = onnx_model("shape", nodes, [("x", (3, 4, 5))], [("y", (3, 10))], "float32", consts)
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(_run(model, [x])[0], _onnxruntime(model, {"x": x})[0])


def test_constants_are_moved_to_the_device_once():
    import onnx

    from autofuse.baselines import onnx_to_torch
    from autofuse.model.importer import random_inputs

    model = onnx.load(os.path.join(REPO, "models", "mlp.onnx"))
    made = []
    real = onnx_to_torch.to_torch
    onnx_to_torch.to_torch = lambda *a, **k: made.append(1) or real(*a, **k)
    try:
        fn = onnx_to_torch.torch_function(model)
        before = len(made)
        inputs = [torch.from_numpy(x) for x in random_inputs(model, 1).values()]
        fn(*inputs)
        fn(*inputs)
    finally:
        onnx_to_torch.to_torch = real
    assert before > 0 and len(made) == before


def test_an_op_without_translation_is_named():
    from onnx import helper

    from autofuse.baselines.onnx_to_torch import torch_function, unsupported_ops
    from autofuse.pattern import onnx_model

    model = onnx_model("m", [helper.make_node("LpNormalization", ["x"], ["y"])], [("x", (4,))], [("y", (4,))],
                       "float32")
    assert unsupported_ops(model) == ["LpNormalization"]
    with pytest.raises(AutofuseError, match="torch baseline .*LpNormalization"):
        torch_function(model)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_torch_compile_traces_each_graph_whole(pattern):
    """A graph break inside the op loop makes dynamo run the whole function eagerly: the
    torch-compile baseline would then be eager in disguise."""
    from autofuse.baselines.onnx_to_torch import to_torch, torch_function

    shape = pattern.small_shape()
    for dtype in pattern.dtypes:
        fn = torch_function(pattern.onnx_graph(shape, dtype))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*[to_torch(x) for x in pattern.make_inputs(shape, dtype, 0)])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("case", onnx_cases.CASES, ids=lambda c: c.__name__)
def test_ops_of_exported_models_match_onnxruntime(case):
    """The ops HF and torchvision exports add, as in the XLA baseline's table."""
    model, feeds = case()
    got = _run(model, list(feeds.values()))
    expected = onnx_cases.onnxruntime_outputs(model, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
