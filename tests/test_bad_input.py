"""Every bad invocation is one line on stderr, exit code 2, no traceback, and leaves the
database exactly as it was (an existing one byte for byte; a missing one not created)."""

import hashlib
import os
import pathlib
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import REPO, run_cli

MODELS = pathlib.Path(REPO) / "models"


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


def _nonzero_model(path):
    # Imports, but NonZero's output shape is known only at run time.
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"], name="nz")], "nz",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [2, "n"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.onnx").write_bytes(b"")
    (root / "text.onnx").write_text("this is not a protobuf at all \x00\x01 garbage")
    (root / "truncated.onnx").write_bytes((MODELS / "mlp.onnx").read_bytes()[:5000])
    _qlinear_matmul_model(root / "qlinear.onnx")
    _nonzero_model(root / "nonzero.onnx")
    (root / "a-file").write_text("blocks any folder beneath it")
    np.savez(root / "x-wrong-shape.npz", x=np.zeros((3, 3), dtype="float32"))
    np.savez(root / "x-float64.npz", x=np.zeros((128, 256), dtype="float64"))
    return root


@pytest.fixture
def db(tuned_db, tmp_path):
    """A copy of a real database, to prove a rejected command does not touch it."""
    copy = tmp_path / "db"
    shutil.copytree(tuned_db[0], copy, ignore=shutil.ignore_patterns("ms-logs", "*.json.*", "rows.json"))
    return copy


def _digest(folder: pathlib.Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# (arguments; {F} is the folder of bad files, {DB} the database, {LIB} a built library), expected text
CASES = [
    ("tune --pattern no_such_pattern", "unknown pattern"),
    ("tune --pattern linear_bias_relu --shape m=abc", "not an integer"),
    ("tune --pattern linear_bias_relu --shape m=-4", "must be positive"),
    ("tune --pattern linear_bias_relu --shape m=0", "must be positive"),
    ("tune --pattern linear_bias_relu --shape q=4", "no shape parameter"),
    ("tune --pattern linear_bias_relu --shape m", "key=value"),
    ("tune --pattern all --shape m=8", "one pattern"),
    ("tune --target tpu", "unknown target"),
    ("tune --target {{not-json", "target JSON"),
    ("tune --pattern flash_attention --shape heads=4", "must divide heads"),
    ("compare --pattern flash_attention --shape heads=4", "must divide heads"),
    ("tune --rpc 127.0.0.1:9190", "HOST:PORT:KEY"),
    ("tune --rpc-workers 2", "needs --rpc"),
    ("rpc status --tracker nowhere", "HOST:PORT"),
    ("tune --trials 0", "must be positive"),
    ("tune --trials -3", "must be positive"),
    ("tune --trials many", "not an integer"),
    ("tune --space ansor", "invalid choice"),
    ("tune --dtype int3", "dtype"),
    ("tune --timeout 0", "must be positive"),
    ("tune --db {F}/a-file/db", "not writable"),
    ("tune {F}/nope.onnx", "does not exist"),
    ("tune {F}/empty.onnx", "is empty"),
    ("tune {F}/text.onnx", "ONNX"),
    ("tune {F}/truncated.onnx", "ONNX"),
    ("tune {F}", "directory"),
    ("tune {F}/qlinear.onnx", "QLinearMatMul"),
    ("tune models/mlp.onnx --pattern linear_bias_relu", "apply to pattern tuning"),
    ("build {F}/qlinear.onnx -o {F}/out/m.so", "QLinearMatMul"),
    ("build {F}/truncated.onnx -o {F}/out/m.so", "ONNX"),
    ("build models/mlp.onnx --fusion xla -o {F}/out/m.so", "invalid choice"),
    ("compare", "MODEL.onnx or --pattern"),
    ("compare --pattern linear_bias_relu --baselines tvm-auto,pytorch", "unknown baseline"),
    ("compare --pattern nope", "nope"),
    ("compare --pattern linear_bias_relu --threads 999", "--threads"),
    ("compare models/mlp.onnx --small", "apply to patterns"),
    ("compare --pattern linear_bias_relu --trials -1", "zero or more"),
    ("compare --pattern linear_bias_relu --report {F}/a-file/report", "cannot be written"),
    ("compare {F}/empty.onnx", "is empty"),
    ("compare --pattern linear_bias_relu --torch-program {F}/m.pt2", "--torch-program applies to a model"),
    ("compare models/mlp.onnx --torch-program {F}/nope.pt2", "no such .pt2 file"),
    ("run {LIB} --inputs {F}/x-wrong-shape.npz", "shape"),
    ("run {LIB} --inputs {F}/x-float64.npz", "dtype"),
    ("run {F}/nope.so", "nope.so"),
    ("tune {F}/nonzero.onnx", "node 'nz' (NonZero) gives a tensor whose shape is known only at run time"),
    ("build models/real/bert-torchscript-dynamic.onnx -o {F}/out/m.so", "--input-shape input_ids=<batch>x<seq>"),
    ("build models/real/bert-torchscript-dynamic.onnx --input-shape input_ids -o {F}/out/m.so", "NAME=DIMS"),
    ("tune models/real/bert-torchscript-dynamic.onnx --input-shape tokens=1x8", "'tokens', not an input"),
    ("compare models/real/bert-torchscript-dynamic.onnx --input-shape input_ids=1x8,attention_mask=2x8",
     "dimension 'batch' two sizes"),
    ("tune --pattern linear_bias_relu --input-shape x=1x8", "--input-shape applies to a model"),
    ("run {LIB} --input-shape x=1x256", "was built for x=128x256, not 1x256"),
    ("db check --db {F}/no-db-here", "no database"),
    ("db compact --db {DB} --keep 0", "must be positive"),
    ("list --target tpu", "unknown target"),
]


@pytest.mark.parametrize("command, expected", CASES, ids=[c for c, _ in CASES])
def test_bad_invocation_is_one_line_exit_2_and_the_database_is_untouched(command, expected, files, db, built_mlp):
    args = command.format(F=files, DB=db, LIB=built_mlp).split()
    takes_db = args[0] in ("tune", "build", "compare", "list") and "--db" not in args
    before = _digest(db)
    result = run_cli(*args, *(["--db", str(db)] if takes_db else []),
                     *(["--no-progress"] if args[0] == "tune" else []))
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert _digest(db) == before
    assert not (files / "out").exists()
    assert not os.path.exists(os.path.join(REPO, "reports", "nope"))
