"""autofuse compare: every contender measured or its absence explained, a wrong contender marked
invalid and never timed, and the report files complete and schema-valid."""

import json
import os
import sys

import pytest

from autofuse.compare import check_report
from conftest import REPO, run_cli


def _fake_roofline(db_root):
    """A stored roofline, so tests do not spend seconds measuring the machine."""
    from autofuse.target import parse_target, target_key
    folder = os.path.join(db_root, target_key(parse_target("llvm")))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "roofline.json"), "w") as f:
        json.dump({"bandwidth_gbps": 20.0, "peak_gflops": 200.0, "bandwidth_method": "test",
                   "peak_method": "test", "threads": len(os.sched_getaffinity(0)),
                   "bandwidth_ladder": [[1 << 20, 60.0], [1 << 28, 20.0]]}, f)


@pytest.fixture(scope="module")
def pattern_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    _fake_roofline(root / "db")
    result = run_cli("compare", "--pattern", "linear_bias_relu", "--small", "--db", str(root / "db"),
                     "--repeat", "3", "--report", str(root / "report"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "report", result


def test_pattern_compare_writes_every_file_and_a_valid_report(pattern_report):
    folder, result = pattern_report
    for name in ("report.json", "report.md", "report.png", "roofline.png"):
        assert (folder / name).stat().st_size > 0, name
    report = json.loads((folder / "report.json").read_text())
    assert check_report(report) == []
    contenders = {c["name"]: c for c in report["subjects"][0]["contenders"]}
    assert set(contenders) == {"autofuse", "tvm-untuned", "tvm-auto", "onnxruntime", "xla"}
    for c in contenders.values():
        assert c["status"] == "ok", c
        assert c["max_abs_err"] < 1e-3 and c["p10_ms"] <= c["median_ms"] <= c["p90_ms"]
        assert c["intensity"] > 0 and c["roofline_pct"] > 0
    assert "| autofuse" in (folder / "report.md").read_text()
    assert "linear_bias_relu" in result.stdout


def test_model_compare_breaks_the_tuned_model_down_per_kernel(tmp_path):
    _fake_roofline(tmp_path / "db")
    result = run_cli("compare", os.path.join(REPO, "models", "mlp.onnx"), "--db", str(tmp_path / "db"),
                     "--repeat", "3", "--baselines", "onnxruntime,xla", "--no-plots", "--report", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert check_report(report) == []
    subject = report["subjects"][0]
    assert subject["reference"] == "onnxruntime"
    assert [c["status"] for c in subject["contenders"]] == ["ok", "ok", "ok"]
    kernels = subject["kernels"]
    assert [k["pattern"] for k in kernels].count("linear_bias_relu") == 2
    assert all(k["ms"] > 0 and k["source"] for k in kernels)
    assert not (tmp_path / "r" / "report.png").exists()


def _in_process_subject(tmp_path):
    import tvm
    from autofuse.baselines import Context
    from autofuse.compare import pattern_subject
    from autofuse.registry import get_pattern
    from autofuse.roofline import Machine
    from autofuse.target import parse_target

    pattern = get_pattern("linear_bias_relu")
    subject = pattern_subject(pattern, pattern.small_shape(), "float32", str(tmp_path))
    ctx = Context(parse_target("llvm"), tvm.cpu(), 2, None)
    return subject, ctx, Machine(20.0, 200.0, "test", "test", 2, [[1 << 28, 20.0]])


def test_missing_optional_baselines_are_reported_not_crashed(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path)
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax -> ImportError
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    entry = compare_subject(subject, ctx, ["onnxruntime", "xla"], machine, repeat=2)
    status = {c["name"]: (c["status"], c["reason"]) for c in entry["contenders"]}
    assert status["autofuse"][0] == "ok"
    assert status["onnxruntime"][0] == "unavailable" and "onnxruntime" in status["onnxruntime"][1]
    assert status["xla"][0] == "unavailable" and "jax" in status["xla"][1]


def test_a_contender_that_disagrees_is_invalid_and_never_timed(tmp_path, monkeypatch):
    import numpy as np
    from autofuse import compare
    from autofuse.baselines.ort import OnnxRuntime

    real_prepare = OnnxRuntime.prepare

    def wrong(self, subject, ctx):
        prepared = real_prepare(self, subject, ctx)
        good = prepared.outputs
        prepared.outputs = lambda: [o + np.float32(0.5) for o in good()]
        return prepared

    monkeypatch.setattr(OnnxRuntime, "prepare", wrong)
    subject, ctx, machine = _in_process_subject(tmp_path)
    entry = compare.compare_subject(subject, ctx, ["onnxruntime"], machine, repeat=2)
    ort_row = entry["contenders"][1]
    assert ort_row["status"] == "invalid" and ort_row["median_ms"] is None
    assert "disagrees" in ort_row["reason"]
    assert entry["contenders"][0]["status"] == "ok"


H200_RUN = os.path.join(REPO, "benchmarks", "results", "h200", "gpu-large-float32.json")


def test_gpu_results_render_as_a_compare_report(tmp_path):
    """A benchmarks/gpu.py JSON brought back from the H200 becomes the same report.md/json/png."""
    result = run_cli("compare", "--from-json", H200_RUN, "--report", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert check_report(report) == []
    assert {p.name for p in tmp_path.iterdir()} >= {"report.md", "report.json", "report.png", "roofline.png"}
    flash = next(s for s in report["subjects"] if s["name"] == "flash_attention")
    ours, sdpa = flash["contenders"][0], next(c for c in flash["contenders"] if c["name"] == "torch-sdpa")
    # ratio: ours over the best GPU baseline, which for attention is SDPA
    assert ours["ratio_to_best_baseline"] == pytest.approx(ours["median_ms"] / sdpa["median_ms"])
    markdown = (tmp_path / "report.md").read_text()
    assert "NVIDIA H200" in markdown and "% copy BW" in markdown and "torch-compile" in markdown


def test_a_file_that_is_not_a_gpu_result_is_refused():
    from autofuse.compare import report_from_gpu
    from autofuse.errors import AutofuseError
    with pytest.raises(AutofuseError, match="not a benchmarks/gpu.py result"):
        report_from_gpu({"schema": "autofuse.compare/1", "subjects": []})
