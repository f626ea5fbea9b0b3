"""The terminal progress bar of a tuning session (tqdm on stderr, best latency so far)."""

from __future__ import annotations

import contextlib
import sys
import time

from .tune import TuneStats


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when the bar writes: while ``tune`` sends fd 2 (TVM's native
    warnings) to its log, sys.stderr is the terminal."""

    def write(self, text):  # tqdm keeps the bound write it was given: this one looks each time
        return sys.stderr.write(text)

    def flush(self):
        return sys.stderr.flush()

    def __getattr__(self, name):
        return getattr(sys.stderr, name)


@contextlib.contextmanager
def tuning_bar(total: int, labels: list[str], enabled: bool = True, status=None, status_every: float = 5.0):
    """Yields ``(on_phase, on_progress)`` callbacks for ``tune``. ``status()``, when given, is a
    short text shown after the best latency (the RPC servers in use), asked at most every
    ``status_every`` seconds."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="trial", desc="starting", disable=not enabled, file=_CurrentStderr(),
               dynamic_ncols=True)

    asked = [float("-inf"), ""]

    def on_phase(message: str):
        bar.set_description(message)

    def on_progress(stats: TuneStats, task_id: int):
        bar.set_description(labels[task_id][:60])
        bar.update(stats.total_trials - bar.n)
        best = stats.best_secs.get(task_id)
        text = f"best {best * 1e3:.4f} ms" if best else "no valid kernel yet"
        if status is not None:
            now = time.monotonic()
            if now - asked[0] >= status_every:
                asked[:] = [now, status()]
            text += f", {asked[1]}"
        bar.set_postfix_str(text)

    try:
        yield on_phase, on_progress
    finally:
        bar.close()
