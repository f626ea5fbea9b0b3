"""This machine's roofline: measured memory bandwidth and peak FLOP/s, and where a measured kernel
sits under that roof.

The bandwidth roof depends on where the working set lives: a kernel whose buffers fit in L2 or
L3 moves them faster than DRAM allows, and against a DRAM-only roof it would score over 100%.
So copy bandwidth is measured at a ladder of sizes (a cache-aware roofline) and a kernel is
held to what a copy of its own working set achieves. Below L2 sizes a copy is bound by the cost
of starting the parallel loop, which the kernel pays too."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np


# Bytes moved (read + write) by the copies of the bandwidth ladder: L2-sized up to far beyond L3.
LADDER_BYTES = tuple(1 << p for p in range(18, 29, 2))   # 256 KiB ... 256 MiB


@dataclasses.dataclass
class Machine:
    bandwidth_gbps: float           # DRAM: the largest copy of the ladder
    peak_gflops: float
    bandwidth_method: str
    peak_method: str
    threads: int
    # [bytes moved, GB/s] for each size of the ladder, ascending.
    bandwidth_ladder: list = dataclasses.field(default_factory=list)

    def bandwidth_for(self, nbytes: float | None) -> float:
        """The bandwidth roof for a kernel moving ``nbytes``: what a copy of that size achieves,
        interpolated between ladder steps in log size (clamped at both ends)."""
        if not self.bandwidth_ladder or not nbytes:
            return self.bandwidth_gbps
        sizes = np.log2([size for size, _ in self.bandwidth_ladder])
        return float(np.interp(np.log2(nbytes), sizes, [gbps for _, gbps in self.bandwidth_ladder]))


def point(flops: float | None, nbytes: float | None, secs: float, machine: Machine) -> dict:
    """GFLOP/s, GB/s, arithmetic intensity and % of the roofline bound of one measured run.

    The bandwidth roof is the one for the kernel's working set (``Machine.bandwidth_for``). With
    no FLOPs (a pure data-movement kernel) the bound is that bandwidth alone."""
    out = {"gflops": None, "gbps": None, "intensity": None, "bound_gflops": None, "roofline_pct": None,
           "roof_gbps": None}
    if not secs or secs <= 0:
        return out
    bandwidth = machine.bandwidth_for(nbytes)
    if nbytes:
        out["gbps"] = nbytes / secs / 1e9
        out["roof_gbps"] = bandwidth
    if flops:
        out["gflops"] = flops / secs / 1e9
    if flops and nbytes:
        out["intensity"] = flops / nbytes
        out["bound_gflops"] = min(machine.peak_gflops, out["intensity"] * bandwidth)
        out["roofline_pct"] = 100.0 * out["gflops"] / out["bound_gflops"]
    elif nbytes:
        out["roofline_pct"] = 100.0 * out["gbps"] / bandwidth
    return out


def _copy_ladder(threads: int, target) -> tuple[list, str]:
    """[bytes moved, GB/s] of a parallel, vectorised TensorIR copy at each ``LADDER_BYTES`` size
    (read + write counted; each the best of repeats lasting at least 20 ms)."""
    try:
        import tvm
        from tvm.script import tirx as T

        if target is None:
            from .target import parse_target
            target = parse_target("llvm")
        dev = tvm.cpu()
        ladder = []
        for moved in LADDER_BYTES:
            n = moved // 8  # float32 elements: each read once and written once

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
            rt = tvm.tirx.build(sch.mod, target=target)
            a = tvm.runtime.tensor(np.ones(n, dtype="float32"), dev)
            b = tvm.runtime.tensor(np.zeros(n, dtype="float32"), dev)
            results = rt.time_evaluator(rt.entry_name, dev, number=1, repeat=5, min_repeat_ms=20)(a, b).results
            ladder.append([moved, moved / min(results) / 1e9])
        return ladder, f"TensorIR parallel copy, {threads} threads, 256 KiB to 256 MiB moved, best of 5"
    except Exception as err:  # no working TVM build here: numpy's single-threaded copy still bounds it
        n = LADDER_BYTES[-1] // 8
        a, b = np.ones(n, dtype="float32"), np.zeros(n, dtype="float32")
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - start)
        return [[LADDER_BYTES[-1], LADDER_BYTES[-1] / best / 1e9]], \
            f"np.copyto 256 MiB moved (TVM copy failed: {type(err).__name__})"


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
    ladder, bandwidth_method = _copy_ladder(threads, target)
    peak, peak_method = _gemm_peak(threads)
    return Machine(ladder[-1][1], peak, bandwidth_method, peak_method, threads, ladder)


def load_or_measure(cache_path: str | None, threads: int, target=None) -> Machine:
    """The stored figures when ``cache_path`` holds them for this thread count, else measured
    (and stored)."""
    if cache_path and os.path.exists(cache_path):
        try:
            with open(cache_path, encoding="utf-8") as f:
                machine = Machine(**json.load(f))
            if machine.threads == threads and machine.bandwidth_ladder:
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
