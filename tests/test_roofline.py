"""Roofline figures: the bound is min(peak, intensity x bandwidth); the machine's figures are
measured once and reused."""

import json

import pytest

from autofuse import roofline
from autofuse.roofline import Machine, load_or_measure, point

MACHINE = Machine(bandwidth_gbps=10.0, peak_gflops=100.0, bandwidth_method="t", peak_method="t", threads=2,
                  bandwidth_ladder=[[1 << 30, 10.0]])
CACHED = Machine(bandwidth_gbps=10.0, peak_gflops=100.0, bandwidth_method="t", peak_method="t", threads=2,
                 bandwidth_ladder=[[1 << 20, 40.0], [1 << 22, 80.0], [1 << 26, 10.0]])


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


def test_the_bandwidth_roof_follows_the_working_set():
    assert CACHED.bandwidth_for(1 << 10) == 40.0          # below the ladder: its smallest step
    assert CACHED.bandwidth_for(1 << 21) == pytest.approx(60.0)  # halfway in log size
    assert CACHED.bandwidth_for(1 << 22) == 80.0
    assert CACHED.bandwidth_for(1 << 30) == 10.0          # beyond the ladder: DRAM
    # A cache-resident kernel is held to the cache's bandwidth: 4 MiB in 0.1 ms is 42 GB/s, 52% of 80.
    fits = point(flops=None, nbytes=1 << 22, secs=1e-4, machine=CACHED)
    assert fits["roof_gbps"] == 80.0 and fits["roofline_pct"] == pytest.approx(100 * 41.94304 / 80)


def test_measured_machine_is_plausible_and_cached(tmp_path):
    cache = tmp_path / "roofline.json"
    measured = load_or_measure(str(cache), 2)
    assert 1 < measured.bandwidth_gbps < 1000 and 1 < measured.peak_gflops < 10000
    sizes = [size for size, _ in measured.bandwidth_ladder]
    assert sizes == sorted(sizes) and len(sizes) >= 2 and measured.bandwidth_ladder[-1][1] == measured.bandwidth_gbps
    assert json.loads(cache.read_text())["threads"] == 2


def test_a_stored_roofline_is_reused_without_measuring(tmp_path, monkeypatch):
    cache = tmp_path / "roofline.json"
    cache.write_text(json.dumps({**MACHINE.__dict__}))
    monkeypatch.setattr(roofline, "measure_machine", lambda *a, **k: pytest.fail("measured again"))
    assert load_or_measure(str(cache), 2) == MACHINE


def test_a_stored_roofline_without_the_ladder_is_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "roofline.json"
    cache.write_text(json.dumps({**MACHINE.__dict__, "bandwidth_ladder": []}))
    monkeypatch.setattr(roofline, "measure_machine", lambda *a, **k: CACHED)
    assert load_or_measure(str(cache), 2) == CACHED
