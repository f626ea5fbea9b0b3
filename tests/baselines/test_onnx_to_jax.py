"""The XLA baseline runs the same computation as onnxruntime: every bundled model through
jax.jit matches it; an op without a translation is named."""

import os

import numpy as np
import pytest

from autofuse.errors import AutofuseError
from conftest import REPO

jax = pytest.importorskip("jax")


@pytest.mark.parametrize("name", ["mlp", "transformer_block", "conv_block"])
def test_bundled_models_match_onnxruntime(name):
    import onnx
    import onnxruntime as ort

    from autofuse.baselines.onnx_to_jax import jax_function
    from autofuse.model.importer import random_inputs

    path = os.path.join(REPO, "models", f"{name}.onnx")
    model = onnx.load(path)
    feeds = random_inputs(model, 1)
    got = jax.jit(jax_function(model))(*feeds.values())
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-4, atol=1e-4)


def test_uint32_hash_arithmetic_wraps_as_in_onnxruntime():
    import onnxruntime as ort
    from onnx import helper

    from autofuse.baselines.onnx_to_jax import jax_function
    from autofuse.pattern import onnx_model

    consts = {"c": np.array(0x85EBCA6B, np.uint32), "s": np.array(13, np.uint32)}
    nodes = [helper.make_node("BitShift", ["x", "s"], ["t"], direction="RIGHT"),
             helper.make_node("BitwiseXor", ["x", "t"], ["u"]), helper.make_node("Mul", ["u", "c"], ["y"])]
    model = onnx_model("hash", nodes, [("x", (64,))], [("y", (64,))], "uint32", consts, opset=18)
    x = np.arange(1 << 30, (1 << 30) + 64 * 997, 997, dtype=np.uint32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_function(model))(x)[0]), expected[0])


def test_an_op_without_translation_is_named():
    from onnx import helper

    from autofuse.baselines.onnx_to_jax import jax_function, unsupported_ops
    from autofuse.pattern import onnx_model

    model = onnx_model("m", [helper.make_node("HardSwish", ["x"], ["y"])], [("x", (4,))], [("y", (4,))], "float32")
    assert unsupported_ops(model) == ["HardSwish"]
    with pytest.raises(AutofuseError, match="HardSwish"):
        jax_function(model)
