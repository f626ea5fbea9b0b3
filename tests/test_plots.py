"""The report figures are written from a report dict, skipping contenders that have no latency."""

import sys

import pytest

from autofuse.errors import AutofuseError

pytest.importorskip("matplotlib")

REPORT = {
    "machine": {"roofline": {"bandwidth_gbps": 20.0, "peak_gflops": 100.0}}, "threads": 2,
    "baselines": ["onnxruntime", "xla"],
    "subjects": [{"kind": "pattern", "name": "p", "contenders": [
        {"name": "autofuse", "status": "ok", "median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.2, "intensity": 2.0,
         "gflops": 30.0},
        {"name": "onnxruntime", "status": "ok", "median_ms": 2.0, "p10_ms": 1.9, "p90_ms": 2.1, "intensity": 2.0,
         "gflops": 15.0},
        {"name": "xla", "status": "unavailable", "median_ms": None, "p10_ms": None, "p90_ms": None}],
        "kernels": [{"name": "k", "ms": 0.5, "intensity": 1.0, "gflops": 5.0}]}],
}


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_figures_are_written(tmp_path):
    from autofuse import plots
    plots.latency_bars(REPORT, str(tmp_path / "a" / "report.png"))
    plots.roofline(REPORT, str(tmp_path / "roofline.png"))
    plots.search_curves({"p": {"template": [None, 2.0, 1.0], "generic": [3.0, 3.0, 2.5]}}, str(tmp_path / "s.png"))
    for name in ("a/report.png", "roofline.png", "s.png"):
        assert _is_png(tmp_path / name), name


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from autofuse import plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(AutofuseError, match="matplotlib"):
        plots.roofline(REPORT, str(tmp_path / "r.png"))
