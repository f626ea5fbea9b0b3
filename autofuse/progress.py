"""The terminal progress bar of a tuning session (tqdm on stderr, best latency so far)."""

from __future__ import annotations

import contextlib
import sys

from .tune import TuneStats


@contextlib.contextmanager
def tuning_bar(total: int, labels: list[str], enabled: bool = True):
    """Yields ``(on_phase, on_progress)`` callbacks for ``tune``."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="trial", desc="starting", disable=not enabled, file=sys.stderr,
               dynamic_ncols=True)

    def on_phase(message: str):
        bar.set_description(message)

    def on_progress(stats: TuneStats, task_id: int):
        bar.set_description(labels[task_id][:60])
        bar.update(stats.total_trials - bar.n)
        best = stats.best_secs.get(task_id)
        bar.set_postfix_str(f"best {best * 1e3:.4f} ms" if best else "no valid kernel yet")

    try:
        yield on_phase, on_progress
    finally:
        bar.close()
