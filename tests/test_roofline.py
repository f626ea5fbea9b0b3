"""Roofline figures: the bound is min(peak, intensity x bandwidth); the machine's figures are
measured once and reused."""

import json

import pytest

from autofuse import roofline
from autofuse.roofline import Machine, load_or_measure, point

MACHINE = Machine(bandwidth_gbps=10.0, peak_gflops=100.0, bandwidth_method="t", peak_method="t", threads=2,
                  bandwidth_ladder=[[1 << 30, 10.0]], peak_label="FMA peak")
CACHED = Machine(bandwidth_gbps=10.0, peak_gflops=100.0, bandwidth_method="t", peak_method="t", threads=2,
                 bandwidth_ladder=[[1 << 20, 40.0], [1 << 22, 80.0], [1 << 26, 10.0]], peak_label="FMA peak")


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
    # The compute roof is an upper bound: never below the GEMMs measured beside it.
    assert measured.peak_gflops >= measured.gemm_gflops > 0
    assert measured.peak_gflops == max(measured.fma_peak_gflops, measured.gemm_gflops)
    assert measured.peak_method.startswith(measured.peak_label)
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


def test_a_stored_roofline_from_before_the_upper_bound_is_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "roofline.json"
    cache.write_text(json.dumps({**MACHINE.__dict__, "peak_label": ""}))  # numpy's sgemm alone
    monkeypatch.setattr(roofline, "measure_machine", lambda *a, **k: CACHED)
    assert load_or_measure(str(cache), 2) == CACHED


@pytest.mark.parametrize("fma,gemm,label", [(300.0, 120.0, "FMA peak"), (80.0, 120.0, "measured GEMM")])
def test_the_compute_roof_is_the_higher_of_the_fma_peak_and_the_gemms_and_says_which(monkeypatch, fma, gemm,
                                                                                       label):
    monkeypatch.setattr(roofline, "fma_peak_gflops", lambda threads, target: (fma, "lanes x ports"))
    monkeypatch.setattr(roofline, "_gemm_gflops", lambda threads: (gemm, "sgemm"))
    roof = roofline.compute_roof(2)
    assert roof["peak_gflops"] == max(fma, gemm) >= gemm
    assert roof["peak_label"] == label and roof["peak_method"].startswith(label)
    assert roof["fma_peak_gflops"] == fma and roof["gemm_gflops"] == gemm


@pytest.mark.parametrize("mcpu,lanes,ports", [("skylake-avx512", 16, 2), ("znver4", 8, 2), ("znver3", 8, 2), ("x86-64", 4, 1)])
def test_vector_width_and_fma_ports_come_from_the_target(mcpu, lanes, ports):
    from tvm.target import Target
    target = Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu})
    assert roofline.vector_lanes(target) == lanes and roofline.fma_ports(target) == ports


def test_the_measured_clock_is_a_clock():
    from autofuse.target import parse_target
    assert 0.3e9 < roofline.measure_clock_hz(parse_target("llvm")) < 7e9
