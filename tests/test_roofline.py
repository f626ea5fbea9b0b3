"""Roofline figures: the bound is min(peak, intensity x bandwidth); the machine's figures are
measured once and reused."""

import json

import pytest

from autofuse import roofline
from autofuse.roofline import Machine, load_or_measure, point

MACHINE = Machine(bandwidth_gbps=10.0, peak_gflops=100.0, bandwidth_method="t", peak_method="t", threads=2)


def test_memory_bound_and_compute_bound_points():
    low = point(flops=1e9, nbytes=1e9, secs=0.2, machine=MACHINE)   # 1 FLOP/B: bound 10 GFLOP/s
    assert low["intensity"] == 1.0 and low["bound_gflops"] == 10.0
    assert low["gflops"] == pytest.approx(5.0) and low["roofline_pct"] == pytest.approx(50.0)
    high = point(flops=1e11, nbytes=1e8, secs=2.0, machine=MACHINE)  # 1000 FLOP/B: bound = peak
    assert high["bound_gflops"] == 100.0 and high["roofline_pct"] == pytest.approx(50.0)


def test_unknown_flops_fall_back_to_bandwidth_and_nothing_known_gives_none():
    copy = point(flops=None, nbytes=2e9, secs=0.4, machine=MACHINE)
    assert copy["gbps"] == pytest.approx(5.0) and copy["roofline_pct"] == pytest.approx(50.0)
    assert copy["intensity"] is None
    assert all(v is None for v in point(None, None, 0.1, MACHINE).values())


def test_measured_machine_is_plausible_and_cached(tmp_path):
    cache = tmp_path / "roofline.json"
    measured = load_or_measure(str(cache), 2)
    assert 1 < measured.bandwidth_gbps < 1000 and 1 < measured.peak_gflops < 10000
    assert json.loads(cache.read_text())["threads"] == 2


def test_a_stored_roofline_is_reused_without_measuring(tmp_path, monkeypatch):
    cache = tmp_path / "roofline.json"
    cache.write_text(json.dumps({**MACHINE.__dict__}))
    monkeypatch.setattr(roofline, "measure_machine", lambda *a, **k: pytest.fail("measured again"))
    assert load_or_measure(str(cache), 2) == MACHINE
