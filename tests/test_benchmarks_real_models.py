"""benchmarks/real_models.py: its model selection and flags, and one corpus model at --trials 0 run
as a user runs it (JSON and Markdown written, every contender in them, --budget-secs stopping the
next model; bad input one line and exit 2)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from autofuse.errors import AutofuseError
from conftest import REPO, store_roofline

SCRIPT = os.path.join(REPO, "benchmarks", "real_models.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("real_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_models_flag_selects_architectures_and_files(bench):
    everything = bench.select(None)
    assert everything == bench.select("all") and len(everything) == len(bench.corpus()) >= 16
    assert {e["exporter"] for e in bench.select("bert")} == {"torchscript", "dynamo"}
    picked = bench.select("vit-dynamo-fixed,vit,vit-dynamo-fixed")
    assert [bench.stem(e) for e in picked] == ["vit-dynamo-fixed", "vit-torchscript-fixed"]
    for bad in ("alexnet", ","):
        with pytest.raises(AutofuseError):
            bench.select(bad)


def test_flags(bench):
    args = bench.parse_args([])
    assert args.trials == 512 and args.budget_secs is None and len(args.entries) == len(bench.corpus())
    for bad in (["--trials", "-1"], ["--budget-secs", "0"], ["--repeat", "0"], ["--models", "nope"]):
        with pytest.raises(AutofuseError):
            bench.parse_args(bad)


def _run(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *args], check=False, capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    result = _run("--models", "alexnet", "--out", str(tmp_path / "x.json"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "alexnet" in result.stderr and not os.path.exists(tmp_path / "x.json")


def test_one_model_untuned(tmp_path):
    store_roofline(tmp_path / "db")
    out = tmp_path / "out" / "real.json"
    # One model takes more than a second: --budget-secs 1 leaves the second one unstarted.
    flags = ["--trials", "0", "--models", "vit-torchscript-fixed,resnet18-torchscript-fixed", "--budget-secs", "1",
             "--repeat", "3", "--warmup", "1", "--db", str(tmp_path / "db"), "--out", str(out), "--no-progress"]
    result = _run(*flags, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "autofuse.real_models/1" and report["code"]["commit"]
    assert report["command"][1:] == flags and report["not_started"] == ["resnet18-torchscript-fixed"]
    (model,) = report["models"]
    assert model["status"] == "ok" and model["matches_onnxruntime"]
    assert model["matches"] == {"masked_attention": 2, "layernorm_residual": 5, "linear_bias": 10, "linear_bias_gelu": 2}
    assert model["folded"] > 0 and model["input_shapes"] == {"pixel_values": [1, 3, 32, 32]}
    rows = {c["name"]: c for c in model["contenders"]}
    assert list(rows) == ["autofuse-untuned", "autofuse-tuned", "tvm-auto", "onnxruntime", "xla"]
    for name in ("autofuse-untuned", "onnxruntime", "xla"):
        assert rows[name]["status"] == "ok", rows[name]
        assert len(rows[name]["samples_ms"]) == 3 and rows[name]["scaled_err"] <= model["bound"]
    assert rows["autofuse-tuned"]["status"] == rows["tvm-auto"]["status"] == "not run"
    assert model["untuned_over_onnxruntime"] == pytest.approx(rows["autofuse-untuned"]["median_ms"]
                                                              / rows["onnxruntime"]["median_ms"])
    assert model["tuning"] is None and model["tuned_over_onnxruntime"] is None
    markdown = out.with_suffix(".md").read_text()
    assert ("| vit-torchscript-fixed | torchscript | fixed | layernorm_residual x5, linear_bias x10, linear_bias_gelu x2, "
            "masked_attention x2 |") in markdown
    assert "Not started" in markdown
