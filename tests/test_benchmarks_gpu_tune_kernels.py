"""benchmarks/gpu_tune_kernels.py off a GPU: one line and exit 2, before any work; with a stand-in GPU,
what it records, its budget and its template filter."""

import os
import subprocess
import sys
import types

import pytest

from autofuse.target import device_for, parse_target
from conftest import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_tune_kernels.py")


@pytest.mark.skipif(device_for(parse_target("h200")).exist, reason="a CUDA GPU is here")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--pattern", "linear_bias_relu", "--dtype", "float16",
                           "--db", str(tmp_path / "db"), "--out", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: no cuda device on this machine: kernel templates are searched on the GPU"]
    assert not (tmp_path / "out.json").exists()


@pytest.fixture()
def script(monkeypatch):
    """The script with a stand-in GPU: ``tune_kernels`` measures configurations of a fake space
    (median ms per config; None: the kernel crashes) into the real database."""
    import importlib.util

    from autofuse import kernel_templates as K
    from autofuse import report, target, verify

    spec = importlib.util.spec_from_file_location("gpu_tune_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "require_device", lambda *_: None)
    monkeypatch.setattr(target, "device_for", lambda _t: object())
    monkeypatch.setattr(report, "gpu_info", lambda _dev: {"name": "stand-in"})
    monkeypatch.setattr(verify, "device_measure", lambda _dev: None)
    monkeypatch.setattr(K, "kernel_templates_for", lambda *_: [types.SimpleNamespace(name="cuda_wgmma"),
                                                               types.SimpleNamespace(name="cuda_other")])
    space = {"value": [], "templates": []}

    def tune_kernels(jobs, _target, db, *, trials, templates=(), **_):
        space["templates"].append(list(templates))
        (job,) = jobs
        done = len(db.kernels.of(job.pattern.name, job.shape, job.dtype))
        if done == len(space["value"]):
            return {}
        ms = space["value"][done]
        checked = {"ok": ms is not None, "message": "ok" if ms is not None else "run failed: illegal address"}
        db.kernels.append(K.KernelRecord(job.pattern.name, dict(job.shape), job.dtype, "cuda_wgmma", {"stages": done},
                                         [ms / 1e3] * 3 if ms else [], checked, "hash"))
        return {0: K.KernelTuneStats(trials=1, failed=int(ms is None), crashed=ms is None)}

    monkeypatch.setattr(K, "tune_kernels", tune_kernels)
    return module, space


def _args(tmp_path, *extra):
    return ["--pattern", "linear_bias_relu", "--dtype", "float16", "--shape", "m=256,n=256,k=256",
            "--db", str(tmp_path / "db"), "--out", str(tmp_path / "out.json"), "--commit", "abc1234", *extra]


def test_every_configuration_is_recorded_and_the_fastest_valid_one_is_best(script, tmp_path):
    import json

    module, space = script
    space["value"] = [0.3, 0.2, 0.25]
    assert module.main(_args(tmp_path, "--trials", "10")) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["trials_added"], out["records"], out["valid"]) == (3, 3, 3)
    assert out["best"]["knobs"] == {"stages": 1} and out["best"]["median_ms"] == pytest.approx(0.2)
    assert out["commit"]["commit"] == "abc1234" and out["machine"] == {"name": "stand-in"}


def test_a_crash_ends_the_search_and_the_json_keeps_what_was_measured(script, tmp_path):
    import json

    module, space = script
    space["value"] = [0.3, None, 0.1]
    assert module.main(_args(tmp_path, "--trials", "10")) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["trials_added"], out["failed_added"], out["records"], out["valid"]) == (2, 1, 2, 1)
    assert out["rows"][-1]["message"].startswith("run failed")


def test_no_configuration_starts_once_the_budget_is_spent(script, tmp_path):
    import json

    module, space = script
    space["value"] = [0.3, 0.2]
    assert module.main(_args(tmp_path, "--budget-secs", "0")) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["trials_added"], out["records"], out["best"]) == (0, 0, None)


def test_templates_limits_the_search_and_an_unknown_name_is_one_line(script, tmp_path, capsys):
    module, space = script
    space["value"] = [0.3]
    assert module.main(_args(tmp_path, "--templates", "cuda_other")) == 0
    assert space["templates"] and all(names == ["cuda_other"] for names in space["templates"])
    assert module.main(_args(tmp_path, "--templates", "cuda_other,cuda_nope")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda_nope" in err[0] and "cuda_wgmma, cuda_other" in err[0]
