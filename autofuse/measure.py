"""Running and timing built kernels on a device: argument allocation, warm-up, repeated runs,
median and spread."""

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

    @staticmethod
    def of(samples) -> "Timing":
        samples = [float(s) for s in samples]
        return Timing(float(np.median(samples)), float(np.percentile(samples, 10)),
                      float(np.percentile(samples, 90)), len(samples), samples)


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
    return Timing.of(samples)


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
