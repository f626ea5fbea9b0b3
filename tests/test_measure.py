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
