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


# Bytes moved (read + written) by the GPU's copy ladder: from a few MiB (a decode step's caches, where
# the launch is a good part of the time) to far beyond L2.
CUDA_LADDER_BYTES = tuple(1 << p for p in range(23, 32, 2))   # 8 MiB ... 2 GiB


def cuda_roofline(dtype: str = "float32", threads: int = 0):
    """A GPU's roofline: copy bandwidth at a ladder of sizes (``CUDA_LADDER_BYTES`` moved, device to
    device, each copy alone after an L2 flush as kernels are timed, so a kernel is held to a copy
    of its own working set; DRAM's figure is the largest) and the matmul peak for ``dtype``
    (8192^3 torch.matmul; float32 with TF32 off), each the median of runs timed with CUDA
    events."""
    import torch

    from .roofline import Machine

    def median_secs(call, n, flush=None):
        call()
        times = []
        for _ in range(n):
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    ladder = []
    for moved in CUDA_LADDER_BYTES:
        src = torch.ones(moved // 8, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        ladder.append([moved, moved / median_secs(lambda: dst.copy_(src), 10, flush) / 1e9])
    src = dst = flush = None  # freed before the matmuls
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
    return Machine(ladder[-1][1], peak, f"torch copy_ device to device, {CUDA_LADDER_BYTES[0] >> 20} MiB to "
                   f"{CUDA_LADDER_BYTES[-1] >> 30} GiB moved, each alone after a {FLUSH_BYTES >> 20} MiB L2 flush, "
                   "median of 10",
                   f"torch.matmul {n}^3 {str(kind).split('.')[-1]}{', TF32 off' if kind == torch.float32 else ''}, "
                   "median of 5", threads, ladder)


def param_buffers(func) -> list:
    """A PrimFunc's parameters as buffers (TVM 0.27's params are buffers; older ones map them)."""
    return [func.buffer_map[p] if hasattr(func, "buffer_map") else p for p in func.params]


def param_bytes(func) -> int:
    return sum(int(np.prod([int(d) for d in buf.shape])) * tvm.runtime.DataType(str(buf.dtype)).bits // 8
               for buf in param_buffers(func))


def is_integer(dtype) -> bool:
    """Whether ``dtype`` (a name or a DataType) is a signed or unsigned integer type."""
    return str(dtype).startswith(("int", "uint"))


def index_bounds(func) -> dict[int, list[tuple[tuple[tuple[int, int], ...], int]]]:
    """Where integer parameters of a PrimFunc index a buffer (an embedding lookup: ``take``,
    ``gather_nd``), directly or through an integer buffer computed from them (gather_nd's transpose
    of its indices), the exclusive upper bounds their values must keep to: per parameter position,
    ``(slice, bound)`` pairs, ``slice`` the ``(axis, value)`` pairs that select the elements bound
    (empty: all of them; gather_nd's last axis says which axis a component indexes) and ``bound``
    the static extent of the axis they index."""
    import tvm_ffi
    from tvm.ir.expr import TensorLoad
    from tvm.tirx.stmt import BufferStore

    def integer_loads(expr) -> list:
        found = []
        tvm_ffi.structural_walk(expr, [(TensorLoad, found.append)])
        return [load for load in found if is_integer(load.source.dtype)]

    def constants(indices) -> tuple:
        return tuple((axis, int(i)) for axis, i in enumerate(indices) if isinstance(i, tvm.tirx.IntImm))

    bounds: dict = {}   # buffer -> {slice: bound}
    copies: list = []   # (integer buffer stored, its indices there, an integer load of the stored value)

    def bind(buffer, where: tuple, bound: int) -> bool:
        mine = bounds.setdefault(buffer, {})
        if mine.get(where, bound + 1) <= bound:
            return False
        mine[where] = bound
        return True

    def indexed(buffer, indices):
        for extent, index in zip(buffer.shape, indices):
            if isinstance(extent, tvm.tirx.IntImm):
                for load in integer_loads(index):
                    bind(load.source, constants(load.indices), int(extent))

    def on_load(load):
        indexed(load.source, load.indices)

    def on_store(store):
        indexed(store.buffer, store.indices)
        if is_integer(store.buffer.dtype):
            copies.extend((store.buffer, store.indices, load) for load in integer_loads(store.value))

    def through(where, stored_at, load) -> tuple | None:
        """``where`` (a slice of the stored buffer) as a slice of the buffer ``load`` reads: an
        axis indexed by a loop variable maps to the axis the load indexes with it; one that
        cannot be mapped is dropped (more elements bound, never fewer). None: the store does not
        write that slice."""
        mapped = []
        for axis, value in where:
            index = stored_at[axis]
            if isinstance(index, tvm.tirx.IntImm):
                if int(index) != value:
                    return None
                continue
            for other, source_index in enumerate(load.indices):
                if source_index.same_as(index):
                    mapped.append((other, value))
                    break
        return tuple(sorted(set(mapped) | set(constants(load.indices))))

    tvm_ffi.structural_walk(func.body, [(TensorLoad, on_load), (BufferStore, on_store)])
    changed = True
    while changed:  # an input is bound wherever what it is copied into is
        changed = False
        for stored, stored_at, load in copies:
            for where, bound in list(bounds.get(stored, {}).items()):
                source_where = through(where, stored_at, load)
                if source_where is not None and bind(load.source, source_where, bound):
                    changed = True
    return {i: sorted(bounds[buf].items()) for i, buf in enumerate(param_buffers(func)) if buf in bounds}


def param_arrays(func, seed: int = 0) -> list[np.ndarray]:
    """Seeded random data for every parameter of a PrimFunc (inputs and outputs alike), for
    kernels that have no input maker of their own. Integers are small (0-7), except where the
    kernel indexes with them (``index_bounds``): there each keeps inside the axis it indexes."""
    rng = np.random.default_rng(seed)
    bounds = index_bounds(func)
    arrays = []
    for position, buf in enumerate(param_buffers(func)):
        shape = tuple(int(d) for d in buf.shape)
        dtype = str(buf.dtype)
        if dtype.startswith("float") or dtype == "bfloat16":
            arrays.append(rng.uniform(-1.0, 1.0, size=shape).astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.integers(0, 2, size=shape).astype(bool))
        else:
            limits = bounds.get(position, [])
            upper = np.full(shape, max([bound for _, bound in limits], default=8), dtype=np.int64)
            for where, bound in limits:
                select = [slice(None)] * len(shape)
                for axis, value in where:
                    select[axis] = value
                upper[tuple(select)] = np.minimum(upper[tuple(select)], bound)
            arrays.append(np.floor(rng.random(shape) * np.maximum(upper, 1)).astype(dtype))
    return arrays


def run_on(rt_mod, arrays, dev) -> list[np.ndarray]:
    """Run a kernel on copies of ``arrays``; every parameter's contents afterwards."""
    args = to_device(arrays, dev)
    rt_mod(*args)
    return [a.numpy() for a in args]
