"""Running and timing built kernels on a device: argument allocation, warm-up, repeated runs,
median and spread; the timers compare uses for any contender (``timer_for``: wall-clock on a CPU,
CUDA events on a GPU) and a GPU's roofline figures."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import tvm


@dataclasses.dataclass
class Timing:
    median_secs: float
    p10_secs: float
    p90_secs: float
    repeats: int
    samples_secs: list = dataclasses.field(default_factory=list)
    # Back-to-back calls without flushing, per call (the CUDA timer's second figure).
    batched_secs: float | None = None
    method: str = ""

    @staticmethod
    def of(samples, **extra) -> "Timing":
        samples = [float(s) for s in samples]
        return Timing(float(np.median(samples)), float(np.percentile(samples, 10)),
                      float(np.percentile(samples, 90)), len(samples), samples, **extra)


def to_device(arrays, dev) -> list:
    return [tvm.runtime.tensor(a, dev) for a in arrays]


def empty_outputs(specs, dev) -> list:
    return [tvm.runtime.tensor(np.zeros(shape, dtype=dtype), dev) for shape, dtype in specs]


def time_function(rt_mod, args, dev, *, repeat: int = 10, min_repeat_ms: int = 50) -> Timing:
    """Median and p10/p90 of ``repeat`` runs, each averaging enough calls to last ``min_repeat_ms``."""
    evaluator = rt_mod.time_evaluator(rt_mod.entry_name, dev, number=1, repeat=repeat,
                                      min_repeat_ms=min_repeat_ms)
    return Timing.of(evaluator(*args).results)


def time_calls(call: Callable[[], None], *, warmup: int = 3, repeat: int = 10,
               min_repeat_ms: float = 20.0) -> Timing:
    """``time_function`` for any Python callable that returns when its work is done: how the
    compare command times every contender alike (TVM, onnxruntime, jax), call overhead included."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-7)
    number = max(1, int(min_repeat_ms / 1e3 / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
    return Timing.of(samples, method=f"wall-clock, each sample the mean of {number} back-to-back calls")


class CpuTimer:
    """``time_calls`` on a contender: launch and wait, as one call."""

    def time(self, launch: Callable[[], None], wait: Callable[[], None], *, same_stream: bool = True,
             warmup: int = 3, repeat: int = 10, min_repeat_ms: float = 20.0) -> Timing:
        def call():
            launch()
            wait()
        return time_calls(call, warmup=warmup, repeat=repeat, min_repeat_ms=min_repeat_ms)


# Written before each timed GPU call: more than an H100/H200's 50-60 MB of L2.
FLUSH_BYTES = 256 << 20


class CudaTimer:
    """Each call alone after a write that evicts the last call's data from L2, bracketed by CUDA
    events on torch's current stream (where TVM's kernels run too, under tvm_ffi's
    ``use_torch_stream``); plus the wall-clock of back-to-back calls without flushing.

    Work on a stream of its own (XLA, onnxruntime: ``same_stream=False``) would not wait for the
    flush nor be bracketed by the events, so it is launched after a synchronize and waited for
    inside the events: its figure includes the dispatch and the wait."""

    def __init__(self, flush_bytes: int = FLUSH_BYTES):
        try:
            import torch
        except ImportError:
            from .errors import AutofuseError
            raise AutofuseError("timing on a GPU needs torch (CUDA events, L2 flush): pip install torch") from None
        self.torch = torch
        self.scratch = torch.empty(flush_bytes // 4, dtype=torch.float32, device="cuda")

    def time(self, launch: Callable[[], None], wait: Callable[[], None], *, same_stream: bool = True,
             warmup: int = 3, repeat: int = 10, min_repeat_ms: float = 0.0) -> Timing:
        torch = self.torch
        for _ in range(warmup):
            launch()
            wait()
        events = []
        for _ in range(repeat):
            self.scratch.zero_()
            if not same_stream:
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            if not same_stream:
                wait()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        samples = [start.elapsed_time(end) / 1e3 for start, end in events]
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(repeat):
            launch()
        wait()
        torch.cuda.synchronize()
        batched = (time.perf_counter() - begin) / repeat
        how = "CUDA events on torch's current stream" if same_stream else \
            "CUDA events around a synchronous call (own stream)"
        return Timing.of(samples, batched_secs=batched, method=f"{how}, each call alone after a "
                         f"{self.scratch.numel() * 4 >> 20} MiB L2 flush")


def timer_for(dev):
    """The timer for a device: CUDA events on a GPU, wall-clock on a CPU."""
    return CudaTimer() if dev.dlpack_device_type() == 2 else CpuTimer()  # kDLCUDA


def cuda_roofline(dtype: str = "float32", threads: int = 0):
    """A GPU's roofline: copy bandwidth (1 GiB device to device, read + written) and the matmul
    peak for ``dtype`` (8192^3 torch.matmul; float32 with TF32 off), each the median of runs
    timed with CUDA events."""
    import torch

    from .roofline import Machine

    def median_secs(call, n):
        call()
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    size = 1 << 30
    src = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * size / median_secs(lambda: dst.copy_(src), 10) / 1e9
    src = dst = None  # freed before the matmuls
    n = 8192
    kind = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(n, n, device="cuda").to(kind)
    b = torch.randn(n, n, device="cuda").to(kind)
    peak = 2 * n ** 3 / median_secs(lambda: torch.matmul(a, b), 5) / 1e9
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = b = None
    torch.cuda.empty_cache()
    return Machine(copy, peak, "torch copy_ of 1 GiB float32, device to device, 2 GiB moved, median of 10",
                   f"torch.matmul {n}^3 {str(kind).split('.')[-1]}{', TF32 off' if kind == torch.float32 else ''}, "
                   "median of 5", threads, [[2 * size, copy]])


def param_buffers(func) -> list:
    """A PrimFunc's parameters as buffers (TVM 0.27's params are buffers; older ones map them)."""
    return [func.buffer_map[p] if hasattr(func, "buffer_map") else p for p in func.params]


def param_bytes(func) -> int:
    return sum(int(np.prod([int(d) for d in buf.shape])) * tvm.runtime.DataType(str(buf.dtype)).bits // 8
               for buf in param_buffers(func))


def param_arrays(func, seed: int = 0) -> list[np.ndarray]:
    """Seeded random data for every parameter of a PrimFunc (inputs and outputs alike), for
    kernels that have no input maker of their own."""
    rng = np.random.default_rng(seed)
    arrays = []
    for buf in param_buffers(func):
        shape = tuple(int(d) for d in buf.shape)
        dtype = str(buf.dtype)
        if dtype.startswith("float") or dtype == "bfloat16":
            arrays.append(rng.uniform(-1.0, 1.0, size=shape).astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.integers(0, 2, size=shape).astype(bool))
        else:
            arrays.append(rng.integers(0, 8, size=shape).astype(dtype))
    return arrays


def run_on(rt_mod, arrays, dev) -> list[np.ndarray]:
    """Run a kernel on copies of ``arrays``; every parameter's contents afterwards."""
    args = to_device(arrays, dev)
    rt_mod(*args)
    return [a.numpy() for a in args]
