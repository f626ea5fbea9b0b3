"""benchmarks/first_batch.py finds the first measured trial in autofuse tune's progress output."""

import importlib.util
import io
import os
import time

_spec = importlib.util.spec_from_file_location(
    "first_batch", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "first_batch.py"))
first_batch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_batch)


def test_the_first_line_with_a_measured_trial_ends_the_wait():
    progress = (b"autofuse: tuning m\nstarting:   0%| | 0/512\rmeasuring:   0%| | 0/512 [00:06<?, ?trial/s]\r"
                b"conv:   0%| | 1/512 [00:21<2:50:53, best 0.0028 ms]\rmore")
    assert first_batch.first_measured(io.BytesIO(progress), 60, time.perf_counter()) is not None
    assert first_batch.first_measured(io.BytesIO(progress.split(b"conv")[0]), 60, time.perf_counter()) is None
