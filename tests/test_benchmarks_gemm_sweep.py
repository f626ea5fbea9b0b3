"""benchmarks/gemm_sweep.py: its shape list and flags, the summary figures the issue's targets
read, and one 16x256x256 shape at --trials 0 run as a user runs it (JSON and Markdown written,
every contender in them, --budget-secs stopping the next shape; bad input one line and exit 2)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from autofuse.errors import AutofuseError
from conftest import REPO, store_roofline

SCRIPT = os.path.join(REPO, "benchmarks", "gemm_sweep.py")


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("gemm_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grid_and_shapes_flag(sweep):
    grid = sweep.parse_shapes(None)
    assert len(grid) == 5 * 8 + 1 and (1, 3000, 1000) in grid and (2048, 2048, 2048) in grid
    assert sweep.parse_shapes("all") == grid
    assert sweep.parse_shapes("512x1024x1024, 2048X2048x2048,512x1024x1024") == [(512, 1024, 1024),
                                                                                  (2048, 2048, 2048)]
    for bad in ("512x1024", "0x256x256", "axbxc", "16x256x256x1", ","):
        with pytest.raises(AutofuseError):
            sweep.parse_shapes(bad)


def test_flags(sweep):
    args = sweep.parse_args([])
    assert args.trials == 64 and args.budget_secs is None and len(args.shape_list) == 41
    assert sweep.parse_args(["--trials", "0", "--shapes", "16x256x256"]).shape_list == [(16, 256, 256)]
    for bad in (["--trials", "-1"], ["--budget-secs", "0"], ["--repeat", "0"]):
        with pytest.raises(AutofuseError):
            sweep.parse_args(bad)


def _shape(label, ratio, *, default=None, tuned=None, numpy=None, first=None):
    rows = [{"name": "ours-default", "status": "ok", "median_ms": default},
            {"name": "ours-tuned", "status": "ok" if tuned else "not run", "median_ms": tuned},
            {"name": "numpy", "status": "ok", "median_ms": numpy}]
    tuning = {"ours-tuned": {"first_trial_secs": first}, "tvm-auto": {"first_trial_secs": None}} if first else None
    return {"label": label, "ratio": ratio, "contenders": rows, "tuning": tuning,
            "default_over_tuned": default / tuned if default and tuned else None,
            "ours_over_numpy": (tuned or default) / numpy if numpy else None}


def test_summary_figures(sweep):
    shapes = [_shape("16x256x256", 0.5, default=1.0, tuned=0.9, first=20.0),
              _shape("512x1024x1024", 0.8, default=3.0, tuned=2.0, first=30.0),
              _shape("2048x2048x2048", 1.2, default=10.0, tuned=10.0, numpy=8.0, first=40.0),
              _shape("1x256x256", None, default=1.0, tuned=1.0)]
    s = sweep.summarize(shapes, trials=64)
    assert s["ours"] == "ours-tuned" and s["shapes_with_ratio"] == 3
    assert s["fraction_at_or_below_0.8x_best"] == pytest.approx(2 / 3)
    assert s["shapes_above_1.0x_best"] == {"2048x2048x2048": 1.2}
    assert s["shapes_without_ratio"] == ["1x256x256"]
    assert s["ours_vs_numpy_2048x2048x2048"] == {"ours_ms": 10.0, "numpy_ms": 8.0, "ratio": 1.25}
    within = s["default_within_1.25x_of_tuned"]
    assert (within["within"], within["of"]) == (3, 4) and list(within["outside"]) == ["512x1024x1024"]
    first = s["time_to_first_measured_trial_secs"]
    assert first["ours-tuned"] == {"first_shape": 20.0, "median": 30.0, "max": 40.0} and first["tvm-auto"] is None
    untuned = sweep.summarize(shapes[:1], trials=0)
    assert untuned["ours"] == "ours-default" and untuned["default_within_1.25x_of_tuned"] is None
    assert untuned["ours_vs_numpy_2048x2048x2048"] is None


def _run(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *args], check=False, capture_output=True, text=True, cwd=cwd, timeout=600)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    result = _run("--shapes", "16x256", "--out", str(tmp_path / "x.json"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "MxNxK" in result.stderr and not os.path.exists(tmp_path / "x.json")


def test_one_small_shape_untuned(tmp_path):
    store_roofline(tmp_path / "db")
    out = tmp_path / "out" / "sweep.json"
    # One shape takes about a second (1.4 s on an idle 2-core machine, at times under 1 s, which let
    # a budget of 1 s start the second): --budget-secs 0.25, checked before each shape, is not spent
    # at the first (checked as the clock starts) and is after it, leaving the second unstarted.
    flags = ["--trials", "0", "--shapes", "16x256x256,32x256x256", "--budget-secs", "0.25", "--repeat", "3",
             "--warmup", "1", "--db", str(tmp_path / "db"), "--out", str(out), "--no-progress"]
    result = _run(*flags, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "autofuse.gemm_sweep/1" and report["code"]["commit"]
    assert report["command"][1:] == flags and report["not_started"] == ["32x256x256"]
    assert {"cpu_model", "cpu_flags", "mcpu", "cores"} <= set(report["machine"])
    (shape,) = report["shapes"]
    rows = {c["name"]: c for c in shape["contenders"]}
    assert list(rows) == ["ours-default", "ours-tuned", "tvm-auto", "onnxruntime", "xla", "numpy"]
    for name in ("ours-default", "onnxruntime", "numpy"):
        assert rows[name]["status"] == "ok", rows[name]
        assert len(rows[name]["samples_ms"]) == 3 and rows[name]["gflops"] > 0
        assert rows[name]["scaled_err"] <= shape["bound"]
    assert rows["ours-tuned"]["status"] == rows["tvm-auto"]["status"] == "not run"
    assert rows["ours-default"]["info"]["source"] == "template-default"
    best = min((rows[n] for n in ("onnxruntime", "xla") if rows[n]["status"] == "ok"), key=lambda r: r["median_ms"])
    assert shape["best_rival"] == best["name"]
    assert shape["ratio"] == pytest.approx(rows["ours-default"]["median_ms"] / best["median_ms"])
    assert report["summary"]["shapes_measured"] == 1
    markdown = out.with_suffix(".md").read_text()
    assert "| 16x256x256 |" in markdown and "ours-default" in markdown and "Not started" in markdown
