"""The timers compare uses: wall-clock on a CPU; on a GPU each call alone after an L2 flush, between
CUDA events, waited for inside them when its work runs on a stream of its own, plus the
back-to-back figure. The CUDA timer runs here against a recording stand-in for torch."""

import sys
import types

import pytest
import tvm

from autofuse.measure import CpuTimer, CudaTimer, timer_for


def test_a_cpu_device_gets_the_wall_clock_timer():
    calls = []
    timing = timer_for(tvm.cpu()).time(lambda: calls.append("launch"), lambda: calls.append("wait"),
                                       warmup=2, repeat=3, min_repeat_ms=0.0)
    assert isinstance(timer_for(tvm.cpu()), CpuTimer)
    assert timing.repeats == 3 and len(timing.samples_secs) == 3 and timing.batched_secs is None
    assert calls[:4] == ["launch", "wait", "launch", "wait"]  # every call waited for


def _recording_torch(log):
    """Just enough of torch for CudaTimer: events that tick 1 ms per recorded event."""
    clock = {"ms": 0.0}

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            clock["ms"] += 1.0
            self.at = clock["ms"]
            log.append("event")

        def elapsed_time(self, end):
            return end.at - self.at

    class Scratch:
        def zero_(self):
            log.append("flush")

        def numel(self):
            return 64 << 20

    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync"))
    return types.SimpleNamespace(cuda=cuda, float32="float32", empty=lambda *a, **k: Scratch())


@pytest.mark.parametrize("same_stream", [True, False])
def test_the_cuda_timer_flushes_before_each_call_and_brackets_it(monkeypatch, same_stream):
    log = []
    monkeypatch.setitem(sys.modules, "torch", _recording_torch(log))
    timer = CudaTimer()
    timing = timer.time(lambda: log.append("launch"), lambda: log.append("wait"), same_stream=same_stream,
                        warmup=1, repeat=4)
    assert timing.repeats == 4 and timing.batched_secs is not None and "L2 flush" in timing.method
    # After the warm-up's launch and wait: own-stream work starts after the flush is done and is
    # waited for between the events.
    one = ["flush", "event", "launch", "event"] if same_stream else ["flush", "sync", "event", "launch", "wait", "event"]
    assert log[2:2 + 4 * len(one)] == one * 4 and log[2 + 4 * len(one)] == "sync"
    assert timing.samples_secs == [pytest.approx(1e-3)] * 4  # the events' elapsed time
    # Then back to back, unflushed: the batched figure.
    assert log[-7:] == ["sync", "launch", "launch", "launch", "launch", "wait", "sync"]


def test_the_cuda_timer_without_torch_is_one_line(monkeypatch):
    from autofuse.errors import AutofuseError
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(AutofuseError, match="needs torch"):
        CudaTimer()


def _gather_nd():
    from index_kernels import gather_nd
    return gather_nd


def _take():
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def take(table: T.Buffer((300, 4), "float32"), ids: T.Buffer((2, 16), "int64"),
             out: T.Buffer((2, 16, 4), "float32")):
        for i, j, k in T.grid(2, 16, 4):
            with T.sblock("out"):
                vi, vj, vk = T.axis.remap("SSS", [i, j, k])
                out[vi, vj, vk] = table[T.if_then_else(ids[vi, vj] < 0, ids[vi, vj] + 300, ids[vi, vj]), vk]
    return take


def test_integer_inputs_a_kernel_indexes_with_stay_inside_the_axes_they_index():
    """The seeded data of a kernel without an input maker (the check's and the timing's): gather_nd's
    index components each inside the axis it indexes (through the transpose), take's ids inside
    the table's 300 rows and spread over them; integers that index nothing stay small."""
    from autofuse.measure import index_bounds, param_arrays

    func = _gather_nd()
    assert index_bounds(func) == {1: [(((2, 0),), 1), (((2, 1),), 32)]}
    for seed in range(3):
        table, idx, flags, _ = param_arrays(func, seed=seed)
        assert (idx[..., 0] == 0).all()
        assert idx[..., 1].min() >= 0 and idx[..., 1].max() < 32 and len(set(idx[..., 1].ravel())) > 8
        assert flags.min() >= 0 and flags.max() < 8

    table, ids, _ = param_arrays(_take(), seed=0)
    assert ids.min() >= 0 and ids.max() < 300 and ids.max() >= 8


def test_a_kernel_on_its_seeded_data_reads_only_its_inputs():
    """gather_nd's output on its seeded data is the table's rows, the same on every run (indices
    out of range read whatever memory lies past the table)."""
    import numpy as np

    from autofuse.building import build_kernel
    from autofuse.measure import param_arrays, run_on
    from autofuse.target import parse_target

    func = _gather_nd()
    arrays = param_arrays(func, seed=7)
    rt = build_kernel(tvm.IRModule({"main": func}), parse_target("llvm"), stock=True)
    table, idx, flags, _ = arrays
    expected = table[idx[..., 0], idx[..., 1]] * flags.astype("float32")
    for _ in range(3):
        np.testing.assert_array_equal(run_on(rt, arrays, tvm.cpu())[3], expected)
