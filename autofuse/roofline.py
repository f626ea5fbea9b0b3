"""This machine's roofline: measured memory bandwidth and peak FLOP/s, and where a measured kernel
sits under that roof."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np


@dataclasses.dataclass
class Machine:
    bandwidth_gbps: float
    peak_gflops: float
    bandwidth_method: str
    peak_method: str
    threads: int


def point(flops: float | None, nbytes: float | None, secs: float, machine: Machine) -> dict:
    """GFLOP/s, GB/s, arithmetic intensity and % of the roofline bound of one measured run.

    With no FLOPs (a pure data-movement kernel) the bound is the bandwidth alone."""
    out = {"gflops": None, "gbps": None, "intensity": None, "bound_gflops": None, "roofline_pct": None}
    if not secs or secs <= 0:
        return out
    if nbytes:
        out["gbps"] = nbytes / secs / 1e9
    if flops:
        out["gflops"] = flops / secs / 1e9
    if flops and nbytes:
        out["intensity"] = flops / nbytes
        out["bound_gflops"] = min(machine.peak_gflops, out["intensity"] * machine.bandwidth_gbps)
        out["roofline_pct"] = 100.0 * out["gflops"] / out["bound_gflops"]
    elif nbytes:
        out["roofline_pct"] = 100.0 * out["gbps"] / machine.bandwidth_gbps
    return out


def _copy_bandwidth(threads: int, target) -> tuple[float, str]:
    """Best of a few runs of a parallel, vectorised TensorIR copy of 256 MiB (read + write counted)."""
    n = 64 * 1024 * 1024
    try:
        import tvm
        from tvm.script import tirx as T

        @T.prim_func(s_tir=True)
        def copy(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
            for i in range(n):
                with T.sblock("copy"):
                    vi = T.axis.spatial(n, i)
                    b[vi] = a[vi]

        sch = tvm.s_tir.Schedule(copy)
        (i,) = sch.get_loops(sch.get_sblock("copy"))
        outer, inner = sch.split(i, [None, 64])
        sch.parallel(outer)
        sch.vectorize(inner)
        if target is None:
            from .target import parse_target
            target = parse_target("llvm")
        rt = tvm.tirx.build(sch.mod, target=target)
        dev = tvm.cpu()
        a = tvm.runtime.tensor(np.ones(n, dtype="float32"), dev)
        b = tvm.runtime.tensor(np.zeros(n, dtype="float32"), dev)
        results = rt.time_evaluator(rt.entry_name, dev, number=3, repeat=3)(a, b).results
        return 2 * 4 * n / min(results) / 1e9, f"TensorIR parallel copy 256 MiB, {threads} threads, best of 3"
    except Exception as err:  # no working TVM build here: numpy's single-threaded copy still bounds it
        a, b = np.ones(n, dtype="float32"), np.zeros(n, dtype="float32")
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - start)
        return 2 * 4 * n / best / 1e9, f"np.copyto 256 MiB (TVM copy failed: {type(err).__name__})"


def _gemm_peak(threads: int) -> tuple[float, str]:
    n = 2048
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    np.matmul(a, b)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9, f"numpy BLAS sgemm {n}^3, {threads} threads, best of 3"


def measure_machine(threads: int, target=None) -> Machine:
    bandwidth, bandwidth_method = _copy_bandwidth(threads, target)
    peak, peak_method = _gemm_peak(threads)
    return Machine(bandwidth, peak, bandwidth_method, peak_method, threads)


def load_or_measure(cache_path: str | None, threads: int, target=None) -> Machine:
    """The stored figures when ``cache_path`` holds them for this thread count, else measured
    (and stored)."""
    if cache_path and os.path.exists(cache_path):
        try:
            with open(cache_path, encoding="utf-8") as f:
                machine = Machine(**json.load(f))
            if machine.threads == threads:
                return machine
        except (ValueError, TypeError, OSError):
            pass  # unreadable: measure again and overwrite it
    machine = measure_machine(threads, target)
    if cache_path:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        tmp = f"{cache_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(machine), f, indent=2)
        os.replace(tmp, cache_path)
    return machine
