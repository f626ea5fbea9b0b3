"""Turning measured rows into what people read: terminal/Markdown tables and JSON files."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1e-3 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], markdown: bool = False) -> str:
    """``columns`` is (key, heading); the same text works in a terminal and as Markdown."""
    headings = [h for _, h in columns]
    body = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headings)]
    def line(cells):
        if markdown:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(headings), line(["-" * w for w in widths]), *map(line, body)])


TUNE_COLUMNS = [
    ("pattern", "pattern"), ("shape", "shape"), ("space", "space"), ("trials", "trials"),
    ("best_ms", "best ms"), ("gflops", "GFLOP/s"), ("gbps", "GB/s"), ("untuned_ms", "untuned ms"),
    ("speedup", "speed-up"), ("source", "best from"), ("tune_secs", "time s"),
]


def machine_info() -> dict:
    import tvm
    from .target import host_cores
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cores": host_cores(),
            "tvm": tvm.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        from tvm.target import codegen
        info["mcpu"] = codegen.llvm_get_system_cpu()
    except Exception:
        pass
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
