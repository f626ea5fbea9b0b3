"""This machine's roofline: measured memory bandwidth and peak FLOP/s, and where a measured kernel
sits under that roof.

The bandwidth roof depends on where the working set lives: a kernel whose buffers fit in L2 or
L3 moves them faster than DRAM allows, and against a DRAM-only roof it would score over 100%.
So copy bandwidth is measured at a ladder of sizes (a cache-aware roofline) and a kernel is
held to what a copy of its own working set achieves. Below L2 sizes a copy is bound by the cost
of starting the parallel loop, which the kernel pays too.

The compute roof is an upper bound, not a good library's figure (a fused kernel once reached
117% of numpy's sgemm): the ISA's FMA peak (fp32 lanes of the target's widest vector unit x FMA
ports x 2 FLOPs x cores x the clock, measured on a dependent add/xor chain built with TVM), or the
best of several measured GEMMs where that is higher; ``peak_label`` says which."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import tvm
from tvm.script import tirx as T
from tvm.target import Target, codegen

from .target import device_for, parse_target


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
    # What ``peak_gflops`` is: "FMA peak" or "measured GEMM" (whichever was higher), and both figures.
    peak_label: str = ""
    fma_peak_gflops: float | None = None
    gemm_gflops: float | None = None

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
        target = target if target is not None else parse_target("llvm")
        dev = device_for(target)
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


GEMM_SIZES = (1024, 2048, 3072)
# Steps of the dependent chain timing the clock: about a millisecond, so a run seldom loses its core.
CLOCK_STEPS = 1 << 20
FMA_PEAK, MEASURED_GEMM = "FMA peak", "measured GEMM"


def _gemm_gflops(threads: int) -> tuple[float, str]:
    """The best of numpy's BLAS sgemm at ``GEMM_SIZES``, each the best of 3."""
    rng = np.random.default_rng(0)
    best_gflops, best_n = 0.0, 0
    for n in GEMM_SIZES:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        np.matmul(a, b)
        secs = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            np.matmul(a, b)
            secs = min(secs, time.perf_counter() - start)
        if 2 * n ** 3 / secs / 1e9 > best_gflops:
            best_gflops, best_n = 2 * n ** 3 / secs / 1e9, n
    sizes = ", ".join(f"{n}^3" for n in GEMM_SIZES)
    return best_gflops, f"numpy BLAS sgemm, best of {sizes} (best of 3 each; {best_n}^3 fastest), {threads} threads"


# Cores whose FMA units are narrower than their widest vector instructions: Zen 4 runs each
# 512-bit FMA as two 256-bit halves, so AVX-512 does not double its peak.
FMA_DATAPATH_LANES = {"znver4": 8}


def vector_lanes(target: Target) -> int:
    """fp32 lanes an FMA unit of the target computes a cycle."""
    narrower = FMA_DATAPATH_LANES.get(str(target.attrs.get("mcpu", "")))
    if narrower is not None:
        return narrower
    if codegen.target_has_features(["avx512f"], target):
        return 16
    if codegen.target_has_features(["avx2"], target):
        return 8
    return 4


def fma_ports(target: Target) -> int:
    """Vector FMAs issued per cycle: 2 on x86 cores with FMA and on Arm cores with NEON; 1
    elsewhere (x86 without FMA: a multiply and an add a cycle, counted as one FMA)."""
    return 2 if codegen.target_has_features(["fma"], target) or codegen.target_has_features(["neon"], target) else 1


def measure_clock_hz(target: Target) -> float:
    """One core's clock: the best rate of a chain of dependent 1-cycle integer operations (an add
    and an xor a step, which no compiler folds and no core runs faster than one a cycle)."""
    steps = CLOCK_STEPS

    @T.prim_func
    def chain(a: T.Buffer((2,), "int64"), out: T.Buffer((1,), "int64")):
        T.func_attr({"global_symbol": "chain", "tir.noalias": True})
        c0: T.int64 = a[0]
        c1: T.int64 = a[1]
        x = T.decl_buffer((1,), "int64", scope="local")
        x[0] = c0
        for _ in range(steps):
            x[0] = (x[0] + c1) ^ c0
        out[0] = x[0]

    rt = tvm.tirx.build(chain, target=target)
    dev = device_for(target)
    a = tvm.runtime.tensor(np.array([12345, 678], dtype="int64"), dev)
    out = tvm.runtime.tensor(np.zeros(1, dtype="int64"), dev)
    results = rt.time_evaluator(rt.entry_name, dev, number=1, repeat=100)(a, out).results
    return 2 * steps / min(results)


def fma_peak_gflops(threads: int, target: Target) -> tuple[float, str]:
    lanes, ports, clock = vector_lanes(target), fma_ports(target), measure_clock_hz(target)
    peak = lanes * ports * 2 * threads * clock / 1e9
    return peak, (f"{lanes} fp32 lanes x {ports} FMA ports x 2 FLOPs x {threads} cores x {clock / 1e9:.2f} GHz "
                  f"(measured: dependent add/xor chain)")


def compute_roof(threads: int, target: Target | None = None) -> dict:
    """The compute roof's fields of ``Machine``: the FMA peak or the best measured GEMM, whichever
    is higher, labelled, with both figures."""
    target = target if target is not None else parse_target("llvm")
    fma, fma_how = fma_peak_gflops(threads, target)
    gemm, gemm_how = _gemm_gflops(threads)
    label, peak = (FMA_PEAK, fma) if fma >= gemm else (MEASURED_GEMM, gemm)
    return {"peak_gflops": peak, "peak_label": label, "fma_peak_gflops": fma, "gemm_gflops": gemm,
            "peak_method": f"{label}, the higher of {FMA_PEAK} {fma:.0f} GFLOP/s ({fma_how}) and "
                           f"{MEASURED_GEMM} {gemm:.0f} GFLOP/s ({gemm_how})"}


def measure_machine(threads: int, target=None) -> Machine:
    ladder, bandwidth_method = _copy_ladder(threads, target)
    return Machine(ladder[-1][1], bandwidth_method=bandwidth_method, threads=threads, bandwidth_ladder=ladder,
                   **compute_roof(threads, target))


def load_or_measure(cache_path: str | None, threads: int, target=None) -> Machine:
    """The stored figures when ``cache_path`` holds them for this thread count, else measured
    (and stored)."""
    if cache_path and os.path.exists(cache_path):
        try:
            with open(cache_path, encoding="utf-8") as f:
                machine = Machine(**json.load(f))
            # Without a label the peak is an older figure (numpy's sgemm alone), not an upper bound.
            if machine.threads == threads and machine.bandwidth_ladder and machine.peak_label:
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
