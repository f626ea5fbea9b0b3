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


COMPARE_COLUMNS = [("name", "contender"), ("status", "status"), ("median_ms", "median ms"), ("p10_ms", "p10 ms"),
                   ("p90_ms", "p90 ms"), ("gflops", "GFLOP/s"), ("gbps", "GB/s"), ("intensity", "FLOP/B"),
                   ("roofline_pct", "% roofline"), ("autofuse_speedup", "autofuse speed-up"),
                   ("trials_in_db", "trials in db")]
KERNEL_COLUMNS = [("name", "kernel"), ("pattern", "pattern"), ("applied", "applied"), ("source", "record from"),
                  ("ms", "ms"), ("gflops", "GFLOP/s"), ("gbps", "GB/s"), ("intensity", "FLOP/B"),
                  ("roofline_pct", "% roofline")]


def summary_rows(report: dict) -> list[dict]:
    """One row per subject: every contender's median and ours over the best real baseline."""
    rows = []
    for subject in report["subjects"]:
        row = {"subject": subject["name"], "kind": subject["kind"]}
        for c in subject["contenders"]:
            row[c["name"]] = c["median_ms"] if c["status"] == "ok" else c["status"]
        row["ratio"] = subject["contenders"][0].get("ratio_to_best_baseline")
        rows.append(row)
    return rows


def compare_markdown(report: dict) -> str:
    m = report["machine"]
    roof = m.get("roofline", {})
    names = ["autofuse", *report["baselines"]]
    rivals = ", ".join(report.get("rivals", ("tvm-auto", "onnxruntime", "xla")))
    columns = COMPARE_COLUMNS + ([("pct_copy_bw", "% copy BW")] if report.get("device_label") else [])
    if report.get("device_label"):  # measured on a GPU by benchmarks/gpu.py
        header = [f"Machine: {report['device_label']} ({m.get('mcpu', '?')}), Python {m.get('python')}, TVM "
                  f"{m.get('tvm')}; roofline: {roof.get('bandwidth_gbps', 0):.0f} GB/s copy "
                  f"({roof.get('bandwidth_method', '?')}), {roof.get('peak_gflops', 0):.0f} GFLOP/s "
                  f"({roof.get('peak_method', '?')}).",
                  f"Timing: median of {report['repeat']} calls (p10/p90 shown); trials added in this run: "
                  f"{report['trials_added']}.", "", *[f"- {note}" for note in report.get("notes", [])]]
    else:
        header = [f"Machine: {m.get('processor')} ({m.get('mcpu', '?')}), {report['threads']} threads, "
                  f"Python {m.get('python')}, TVM {m.get('tvm')}; roofline: {roof.get('bandwidth_gbps', 0):.1f} GB/s "
                  f"DRAM, up to {max((g for _, g in roof.get('bandwidth_ladder', [])), default=0):.1f} GB/s for "
                  f"cache-sized copies ({roof.get('bandwidth_method', '?')}), {roof.get('peak_gflops', 0):.1f} "
                  f"GFLOP/s ({roof.get('peak_method', '?')}).",
                  f"Timing: {report['warmup']} warm-up calls, median of {report['repeat']} repeats (p10/p90 shown); "
                  f"trials added in this run: {report['trials_added']} each for autofuse and tvm-auto; database "
                  f"{report['database']} ('trials in db': every trial stored for the contender's kernels).",
                  "% roofline: of min(peak, intensity x the copy bandwidth at the kernel's working set), so "
                  "kernels that live in cache are held to the cache's bandwidth, not DRAM's."]
    lines = [f"# autofuse compare — {report['created']}", "", *header, "",
             f"## Summary (median ms; ratio = autofuse / best of {rivals}; target <= 0.8)", "",
             table(summary_rows(report), [("subject", "subject"), *[(n, n) for n in names], ("ratio", "ratio")],
                   markdown=True), ""]
    for subject in report["subjects"]:
        shape = ", ".join(f"{k}={v}" for k, v in (subject.get("shape") or {}).items())
        lines += [f"## {subject['kind']} {subject['name']}" + (f" ({shape}, {subject['dtype']})" if shape else ""), "",
                  f"Checked against the {subject['reference']} at rtol/atol {subject['tolerance']}.", "",
                  table(subject["contenders"], columns, markdown=True), ""]
        for c in subject["contenders"]:
            if c["status"] != "ok":
                lines.append(f"- {c['name']}: {c['status']}: {c['reason']}")
            elif c.get("info", {}).get("note"):
                lines.append(f"- {c['name']}: {c['info']['note']}")
        ours = subject["contenders"][0]
        if ours.get("info", {}).get("source"):
            lines.append(f"- autofuse kernel from: {ours['info']['source']}")
        if subject.get("kernels"):
            lines += ["", "Per-kernel breakdown of the autofuse build:", "",
                      table(subject["kernels"], KERNEL_COLUMNS, markdown=True)]
        lines.append("")
    return "\n".join(lines)


def write_compare_report(report: dict, folder: str, plots: bool = True) -> list[str]:
    """report.json, report.md and (with matplotlib) report.png and roofline.png under ``folder``."""
    from .errors import AutofuseError
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise AutofuseError(f"cannot create report folder {folder}: {err.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise AutofuseError(f"report folder {folder} is not writable")
    written = [os.path.join(folder, "report.json"), os.path.join(folder, "report.md")]
    write_json(written[0], report)
    with open(written[1], "w", encoding="utf-8") as f:
        f.write(compare_markdown(report))
    if plots:
        from . import plots as figures
        figures.latency_bars(report, os.path.join(folder, "report.png"))
        figures.roofline(report, os.path.join(folder, "roofline.png"))
        written += [os.path.join(folder, "report.png"), os.path.join(folder, "roofline.png")]
        curves = {s["name"]: {"database": s["search_curve_ms"]} for s in report["subjects"] if s.get("search_curve_ms")}
        if curves:
            figures.search_curves(curves, os.path.join(folder, "search.png"))
            written.append(os.path.join(folder, "search.png"))
    return written
