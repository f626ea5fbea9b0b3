"""Models build in every fusion mode and match onnxruntime; tuned records get applied, never to
the model's loss; the exported library runs with TVM alone."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from autofuse.model.fusion import MODES
from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from conftest import REPO, run_cli

MODELS = ["mlp", "transformer_block", "conv_block"]
TARGET = parse_target("llvm")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_in_every_mode_matches_onnxruntime(model, mode, tmp_path):
    prepared = prepare(os.path.join(REPO, "models", f"{model}.onnx"), mode)
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=2)
    assert result.verified, result.message
    assert result.max_abs_err < 1e-3
    if mode == "none":
        assert len(result.kernels) > len(build_model(prepare(os.path.join(REPO, "models", f"{model}.onnx"), "auto"),
                                                     TARGET, None, str(tmp_path / "a.so"), verify=False,
                                                     repeat=1).kernels)


def test_exported_library_runs_in_a_fresh_process_without_autofuse(built_mlp, tmp_path):
    meta = json.loads(open(str(built_mlp) + ".json").read())
    code = (
        "import sys, numpy as np, tvm\n"
        "from tvm import relax\n"
        f"lib = tvm.runtime.load_module({str(built_mlp)!r})\n"
        "vm = relax.VirtualMachine(lib, tvm.cpu())\n"
        "x = np.random.default_rng(0).standard_normal((128, 256)).astype('float32')\n"
        "y = vm['main'](tvm.runtime.tensor(x)).numpy()\n"
        "assert 'autofuse' not in sys.modules\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, y)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import onnxruntime as ort
    x = np.random.default_rng(0).standard_normal((128, 256)).astype("float32")
    ref = ort.InferenceSession(os.path.join(REPO, "models", "mlp.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), ref, rtol=1e-4, atol=1e-4)
    assert meta["inputs"] == [{"name": "x", "shape": [128, 256], "dtype": "float32"}]


def test_run_prints_and_saves_outputs(built_mlp, tmp_path):
    x = tmp_path / "x.npz"
    np.savez(x, x=np.ones((128, 256), dtype="float32"))
    result = run_cli("run", str(built_mlp), "--inputs", str(x), "--save", str(tmp_path / "y.npz"))
    assert result.returncode == 0, result.stderr
    assert "shape [128, 256]" in result.stdout
    assert np.load(tmp_path / "y.npz")["y"].shape == (128, 256)


@pytest.fixture(scope="module")
def tuned_mlp_db(tmp_path_factory):
    """mlp tuned for 8 trials shared by its two kernels (one tuning process for the module)."""
    db = tmp_path_factory.mktemp("tuned") / "db"
    tuned = run_cli("tune", os.path.join(REPO, "models", "mlp.onnx"), "--fusion", "patterns", "--trials", "8",
                    "--db", str(db), "--no-progress", "--seed", "1")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "linear_bias_relu" in tuned.stderr  # the matches are printed
    return db


def test_a_small_shared_budget_still_reaches_every_kernel(tuned_mlp_db, tmp_path):
    built = run_cli("build", os.path.join(REPO, "models", "mlp.onnx"), "--fusion", "patterns",
                    "--db", str(tuned_mlp_db), "-o", str(tmp_path / "m.so"))
    assert built.returncode == 0, built.stderr[-3000:]
    assert "matches onnxruntime" in built.stdout
    meta = json.loads((tmp_path / "m.so.json").read_text())
    assert all(k["source"] for k in meta["kernels"]), built.stdout  # every kernel found a record
    for kernel in meta["kernels"]:
        assert (kernel["applied"] == "record") == (kernel["tuned_ms"] <= kernel["default_ms"]), kernel


@pytest.mark.parametrize("record_faster", [True, False])
def test_a_record_is_applied_exactly_when_it_beats_the_default(tuned_mlp_db, monkeypatch, record_faster):
    import tvm
    from autofuse.database import TuningDatabase
    from autofuse.model import build

    def fake_time(mod, func, target, dev):  # the template default vs the record, by a wide margin
        is_default = any(mod.same_as(default) for default in default_mods)
        return (2.0 if is_default else 1.0) if record_faster else (1.0 if is_default else 2.0)

    default_mods = []
    real_default = build.default_schedule

    def recording_default(kernel, target):
        sch = real_default(kernel, target)
        default_mods.append(sch.mod)
        return sch

    monkeypatch.setattr(build, "default_schedule", recording_default)
    monkeypatch.setattr(build, "time_module", fake_time)
    prepared = prepare(os.path.join(REPO, "models", "mlp.onnx"), "patterns")
    mod, decisions = build.apply_database(prepared.mod, TuningDatabase(str(tuned_mlp_db), TARGET), TARGET,
                                          tvm.cpu())
    assert len(decisions) == 2
    expected = "record" if record_faster else "template-default"
    assert [d.applied for d in decisions] == [expected, expected], decisions
