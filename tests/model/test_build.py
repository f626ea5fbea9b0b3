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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each model built once in each mode (verified, timed twice): the "none" test compares its
    kernel count with the "auto" build, which its own test then checks."""
    results = {}

    def build(model, mode):
        if (model, mode) not in results:
            prepared = prepare(os.path.join(REPO, "models", f"{model}.onnx"), mode)
            results[model, mode] = build_model(prepared, TARGET, None,
                                               str(tmp_path_factory.mktemp(f"{model}-{mode}") / "m.so"), repeat=2)
        return results[model, mode]

    return build


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_in_every_mode_matches_onnxruntime(model, mode, built):
    result = built(model, mode)
    assert result.verified, result.message
    assert result.max_abs_err < 1e-3
    if mode == "none":
        assert len(result.kernels) > len(built(model, "auto").kernels)


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
                    "--db", str(db), "--no-progress", "--seed", "1", "--json", str(db.parent / "rows.json"))
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "linear_bias_relu" in tuned.stderr  # the matches are printed
    rows = json.loads((db.parent / "rows.json").read_text())  # --json as for patterns
    assert rows["session"]["trials"] >= 8 and any(r["kernel"].startswith("linear_bias_relu") for r in rows["rows"])
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
    from autofuse import verify
    from autofuse.database import TuningDatabase
    from autofuse.model.kernels import apply_database

    built = []  # (runtime module, the IRModule it was built from)
    real_build = verify.build_kernel

    def recording_build(mod, target, **kwargs):
        rt = real_build(mod, target, **kwargs)
        built.append((rt, mod))
        return rt

    defaults = []  # the default candidates (by identity: the best record may equal the default's schedule)
    real_default = verify._checked_default

    def recording_default(*args):
        choice = real_default(*args)
        defaults.append(choice.mod)
        return choice

    def fake_time(kernel, rt, dev, *args):  # the template default vs the record, by a wide margin
        mod = next(m for r, m in built if r is rt)
        is_default = any(mod is d for d in defaults)
        return (2.0 if is_default else 1.0) if record_faster else (1.0 if is_default else 2.0)

    monkeypatch.setattr(verify, "_checked_default", recording_default)
    monkeypatch.setattr(verify, "build_kernel", recording_build)
    monkeypatch.setattr(verify, "time_kernel", fake_time)
    prepared = prepare(os.path.join(REPO, "models", "mlp.onnx"), "patterns")
    mod, decisions = apply_database(prepared.mod, TuningDatabase(str(tuned_mlp_db), TARGET), TARGET, tvm.cpu())
    assert len(decisions) == 2
    expected = "record" if record_faster else "template-default"
    assert [d.applied for d in decisions] == [expected, expected], decisions


def test_a_library_that_fails_verification_never_reaches_the_output_path(monkeypatch, tmp_path):
    """Staged under a temporary name, checked, and dropped: the good library already at the path
    stays as it was, and no .json appears beside it."""
    from autofuse.accuracy import Check
    from autofuse.model import build as model_build

    monkeypatch.setattr(model_build, "check_against",
                        lambda *args: Check(False, 1.0, 1.0, 1e-5, "output 0: off (injected)"))
    output = tmp_path / "m.so"
    output.write_bytes(b"the previous good library")
    result = build_model(prepare(os.path.join(REPO, "models", "mlp.onnx"), "auto"), TARGET, None, str(output),
                         repeat=1)
    assert result.verified is False and result.library is None
    assert output.read_bytes() == b"the previous good library"
    assert sorted(os.listdir(tmp_path)) == ["m.so"], "nothing of the failed build is left behind"


def test_the_check_bound_comes_from_the_models_own_reductions(monkeypatch, tmp_path):
    """check_against reads the reductions of the model as imported, not of the kernels chosen for
    it (a Hopper tirx kernel has no blocks; reading it raised in the float16 decoder_block build)."""
    from autofuse.model import build as model_build

    seen = []
    real = model_build.check_against
    monkeypatch.setattr(model_build, "check_against", lambda out, exp, mod: seen.append(mod) or real(out, exp, mod))
    prepared = prepare(os.path.join(REPO, "models", "mlp.onnx"), "auto")
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    assert seen == [prepared.mod]


def test_a_template_default_that_fails_its_check_is_not_used_in_a_model(monkeypatch, tmp_path):
    """A deliberately broken template (the weights staged through float16) as linear_bias_relu's
    only one: each mlp kernel falls back to the untuned default (the CPU GEMM rule), the table
    says why, and the model still matches onnxruntime."""
    from autofuse.pattern import template
    from autofuse.registry import get_pattern

    @template("fp16_weights")
    def fp16_weights(sch, target, knobs):
        mm = sch.get_sblock("matmul")
        staged = sch.cache_read(mm, 1, "global")
        sch.unsafe_set_dtype(staged, 0, "float16")  # the bug: the weights lose precision

    monkeypatch.setattr(get_pattern("linear_bias_relu"), "templates", [fp16_weights])
    prepared = prepare(os.path.join(REPO, "models", "mlp.onnx"), "patterns")
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    kernels = [d for d in result.decisions if d.pattern == "linear_bias_relu"]
    assert len(kernels) == 2
    for decision in kernels:
        assert decision.applied == "default", decision
        assert "template default failed the numerical check (fp16_weights)" in decision.note, decision
        assert decision.default == "cpu_gemm", decision
        assert "cpu_gemm used: no template default passed" in decision.note, decision


def test_a_kernel_no_pattern_made_searches_from_its_default_rule():
    """Its task's templates are the CPU rule that schedules it untuned, so the union search
    measures that default first; tvm-auto's generic space stays generic."""
    from autofuse.model.tuning import model_tasks
    from autofuse.verify import untuned

    prepared = prepare(os.path.join(REPO, "models", "conv_block.onnx"), "auto")
    tasks = model_tasks(prepared.mod, TARGET, "union")
    assert tasks and all(len(t.templates) == 1 and t.space == "union" for t in tasks), \
        [(t.name, [r.name for r in t.templates]) for t in tasks]
    for task in tasks:
        assert task.templates[0].name == untuned(task.func["main"], TARGET)[1]
    assert {t.space for t in model_tasks(prepared.mod, TARGET, "generic")} == {"generic"}
