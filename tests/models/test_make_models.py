"""models/make_models.py: checker-valid, deterministic ONNX models equal to the committed files."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS_DIR = os.path.join(REPO, "models")
SCRIPT = os.path.join(MODELS_DIR, "make_models.py")


def _load():
    spec = importlib.util.spec_from_file_location("autofuse_make_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mm = _load()
NAMES = sorted(mm.MODELS)


def test_registry():
    assert set(mm.MODELS) == {"mlp", "transformer_block", "conv_block", "decoder_block", "quant_mlp"}
    assert set(mm.DESCRIPTIONS) == set(mm.MODELS)
    assert mm.MODELS["mlp"] is mm.build_mlp
    assert mm.MODELS["transformer_block"] is mm.build_transformer_block
    assert mm.MODELS["conv_block"] is mm.build_conv_block
    assert mm.MODELS["decoder_block"] is mm.build_decoder_block
    assert mm.MODELS["quant_mlp"] is mm.build_quant_mlp


@pytest.mark.parametrize("name", NAMES)
def test_checker_and_metadata(name):
    model = mm.MODELS[name]()
    assert isinstance(model, onnx.ModelProto)
    onnx.checker.check_model(model, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.ir_version in (8, 9)
    assert model.producer_name == "autofuse"
    # Weights are float32 (quant_mlp's are int8, with an int8 zero point); the only other
    # initializers are the 1-D int64 shapes and axes that Reshape, Expand, Slice and Unsqueeze take.
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.INT8:
            assert name == "quant_mlp", init.name
        elif init.data_type != onnx.TensorProto.FLOAT:
            assert init.data_type == onnx.TensorProto.INT64 and len(init.dims) == 1, init.name


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_equal_to_committed(name):
    first = mm.MODELS[name]().SerializeToString()
    assert first == mm.MODELS[name]().SerializeToString()
    with open(os.path.join(MODELS_DIR, f"{name}.onnx"), "rb") as f:
        assert first == f.read(), f"models/{name}.onnx is stale: rerun python models/make_models.py"


def test_write_all_and_cli(tmp_path):
    paths = mm.write_all(str(tmp_path / "all"))
    assert sorted(paths) == NAMES
    for name, path in paths.items():
        with open(path, "rb") as f:
            assert f.read() == mm.MODELS[name]().SerializeToString()
    result = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "one"), "--only", "conv_block"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path / "one") == ["conv_block.onnx"]
    total = sum(os.path.getsize(p) for p in paths.values())
    assert total < 8 * 1024 * 1024  # committed to the repo: keep them small


EXPECTED_OUT = {"mlp": (128, 256), "transformer_block": (1, 128, 256), "conv_block": (1, 32),
                "decoder_block": (1, 128, 256), "quant_mlp": (64, 256)}


@pytest.mark.parametrize("name", NAMES)
def test_onnxruntime_runs(name):
    ort = pytest.importorskip("onnxruntime")
    model = mm.MODELS[name]()
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {model.graph.input[0].name: x})
    assert y.shape == EXPECTED_OUT[name]
    assert y.dtype == np.float32
    assert np.isfinite(y).all()


def test_a_float16_decoder_block_computes_what_the_float32_one_does(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    result = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--only", "decoder_block",
                             "--dtype", "float16"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr
    path = tmp_path / "decoder_block-float16.onnx"
    half = onnx.load(str(path))
    onnx.checker.check_model(half, full_check=True)
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    assert {t.data_type for t in half.graph.initializer} & floats == {onnx.TensorProto.FLOAT16}
    mask = next(t for t in half.graph.initializer if t.name.startswith("causal_mask"))
    assert onnx.numpy_helper.to_array(mask).min() == np.finfo(np.float16).min  # -1e9: the lowest finite
    x = np.random.default_rng(0).standard_normal((1, 128, 256)).astype(np.float32)
    (want,) = ort.InferenceSession(mm.build_decoder_block().SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.astype(np.float16)})
    assert got.dtype == np.float16
    assert np.abs(got.astype(np.float32) - want).max() < 1e-2 * np.abs(want).max()
