"""Every way a model file can be unusable is one clear line, exit 2, nothing written."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import REPO, run_cli


def _qlinear_matmul_model(path):
    # A valid ONNX graph whose op the Relax frontend does not import.
    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    zero = helper.make_tensor("z", TensorProto.UINT8, [], [0])
    node = helper.make_node("QLinearMatMul", ["a", "s", "z", "b", "s", "z", "s", "z"], ["y"])
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 2]),
                                            helper.make_tensor_value_info("b", TensorProto.UINT8, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 2])], [scale, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _bad_files(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    text = tmp_path / "text.onnx"
    text.write_text("this is not a protobuf at all \x00\x01 garbage")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((REPO_MODELS / "mlp.onnx").read_bytes()[:5000])
    unsupported = tmp_path / "qlinear.onnx"
    _qlinear_matmul_model(unsupported)
    return {"missing": (tmp_path / "nope.onnx", "does not exist"), "empty": (empty, "is empty"),
            "not onnx": (text, "ONNX"), "truncated": (truncated, "ONNX"),
            "directory": (tmp_path, "directory"), "unsupported op": (unsupported, "QLinearMatMul")}


import pathlib
REPO_MODELS = pathlib.Path(REPO) / "models"
CASES = ["missing", "empty", "not onnx", "truncated", "directory", "unsupported op"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["tune", "build"])
def test_bad_model_file_is_one_line_exit_2(tmp_path, case, command):
    path, expected = _bad_files(tmp_path)[case]
    db = tmp_path / "db"
    args = [command, str(path), "--db", str(db)]
    if command == "tune":
        args.append("--no-progress")
    else:
        args += ["-o", str(tmp_path / "out" / "m.so")]
    result = run_cli(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not db.exists() and not (tmp_path / "out").exists()


def test_run_rejects_inputs_of_the_wrong_shape(built_mlp, tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, x=np.zeros((3, 3), dtype="float32"))
    result = run_cli("run", str(built_mlp), "--inputs", str(bad))
    assert result.returncode == 2
    assert "shape" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    wrong_dtype = tmp_path / "x64.npz"
    np.savez(wrong_dtype, x=np.zeros((128, 256), dtype="float64"))
    result = run_cli("run", str(built_mlp), "--inputs", str(wrong_dtype))
    assert result.returncode == 2 and "dtype" in result.stderr
