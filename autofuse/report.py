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


def machine_info(dev=None) -> dict:
    """This host (CPU model and flags, cores, Python, TVM) and, given a GPU ``dev``, that GPU."""
    import tvm
    from .target import host_cores
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cores": host_cores(),
            "tvm": tvm.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    info.update(_cpu_model_and_flags())
    try:
        from tvm.target import codegen
        info["mcpu"] = codegen.llvm_get_system_cpu()
    except Exception:
        pass
    if dev is not None and dev.dlpack_device_type() == 2 and dev.exist:  # kDLCUDA
        info["gpu"] = gpu_info(dev)
    return info


def _cpu_model_and_flags() -> dict:
    found = {"cpu_model": None, "cpu_flags": []}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not found["cpu_model"]:
                    found["cpu_model"] = value.strip()
                elif key in ("flags", "Features") and not found["cpu_flags"]:
                    found["cpu_flags"] = value.split()
    except OSError:  # not Linux
        pass
    found["cpu_model"] = found["cpu_model"] or platform.processor() or platform.machine()
    return found


def gpu_info(dev) -> dict:
    """The GPU's name, memory, compute capability and CUDA versions (torch's view where torch is
    here, TVM's otherwise)."""
    info = {"name": dev.device_name, "compute_capability": dev.compute_version,
            "memory_gib": dev.total_global_memory / 2 ** 30 if dev.total_global_memory else None,
            "driver_version": dev.driver_version}
    try:
        import torch
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(dev.index)
            info.update(name=props.name, memory_gib=props.total_memory / 2 ** 30,
                        compute_capability=f"{props.major}.{props.minor}", torch_cuda=torch.version.cuda,
                        multiprocessors=props.multi_processor_count)
    except Exception:  # no torch, or a torch without CUDA: TVM's figures stand
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
                   ("p90_ms", "p90 ms"), ("batched_ms", "batched ms"), ("scaled_err", "error"),
                   ("max_abs_err", "max abs err"), ("gflops", "GFLOP/s"), ("gbps", "GB/s"),
                   ("intensity", "FLOP/B"), ("roofline_pct", "% roofline"), ("autofuse_speedup", "autofuse speed-up"),
                   ("trials_in_db", "trials in db")]
KERNEL_COLUMNS = [("name", "kernel"), ("pattern", "pattern"), ("applied", "applied"), ("default", "default"),
                  ("source", "record from"),
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
        row["best"] = subject["contenders"][0].get("best_baseline")
        rows.append(row)
    return rows


def _err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def _time_and_error(c: dict) -> str:
    """A summary cell: the median with its scaled error beside it; a dagger for more work."""
    mark = " †" if c.get("same_work") is False else ""
    if c["status"] == "ok":
        return f"{_cell(c['median_ms'], 4)} ({_err(c.get('scaled_err'))}){mark}"
    if c["status"] == "invalid" and c.get("scaled_err") is not None:
        return f"invalid ({_err(c['scaled_err'])} > {_err(c.get('bound'))}){mark}"
    return {"unavailable": "n/a"}.get(c["status"], c["status"]) + mark


def _machine_lines(report: dict) -> list[str]:
    m = report["machine"]
    roof = m.get("roofline", {})
    cpu = f"{m.get('cpu_model') or m.get('processor')} ({m.get('mcpu', '?')})"
    if report.get("device") == "cuda":
        gpu = m.get("gpu") or {}
        memory = f", {gpu['memory_gib']:.0f} GiB" if gpu.get("memory_gib") else ""
        return [f"Machine: {gpu.get('name', 'GPU')} (compute {gpu.get('compute_capability', '?')}{memory}, CUDA "
                f"{gpu.get('torch_cuda') or '?'}), host {cpu}, {report['threads']} threads, Python {m.get('python')}, "
                f"TVM {m.get('tvm')}; roofline: {roof.get('bandwidth_gbps', 0):.0f} GB/s copy "
                f"({roof.get('bandwidth_method', '?')}), {roof.get('peak_gflops', 0):.0f} GFLOP/s "
                f"({roof.get('peak_method', '?')}).",
                f"Timing: {report['warmup']} warm-up calls, then {report['repeat']} calls each alone after an L2 flush, "
                "timed with CUDA events (median, p10/p90; contenders on streams of their own are waited for inside "
                "the events); 'batched': back-to-back calls without flushing, per call. float32 is float32 "
                f"everywhere (no TF32). Trials added in this run: {report['trials_added']} each for autofuse and "
                f"tvm-auto; database {report['database']}."]
    return [f"Machine: {cpu}, {report['threads']} threads, Python {m.get('python')}, TVM {m.get('tvm')}; roofline: "
            f"{roof.get('bandwidth_gbps', 0):.1f} GB/s DRAM, up to "
            f"{max((g for _, g in roof.get('bandwidth_ladder', [])), default=0):.1f} GB/s for cache-sized copies "
            f"({roof.get('bandwidth_method', '?')}), {roof.get('peak_gflops', 0):.1f} GFLOP/s "
            f"({roof.get('peak_method', '?')}).",
            f"Timing: {report['warmup']} warm-up calls, median of {report['repeat']} repeats (p10/p90 shown); "
            f"trials added in this run: {report['trials_added']} each for autofuse and tvm-auto; database "
            f"{report['database']} ('trials in db': every trial stored for the contender's kernels).",
            "% roofline: of min(peak, intensity x the copy bandwidth at the kernel's working set), so "
            "kernels that live in cache are held to the cache's bandwidth, not DRAM's."]


def _check_line(subject: dict) -> str:
    framework = subject.get("framework") or {}
    errs = framework.get("scaled_errs")
    if errs:
        own = f"{framework['name']}'s own error {_err(max(errs))}"
    else:
        own = f"{framework.get('name', 'the framework')} gave no error ({framework.get('status') or 'no reference'})"
    return (f"Checked against the {subject['reference']}: error = max |got - want| / max |want|; valid up to "
            f"{_err(subject.get('bound'))}, the larger of the dtype bound {_err(subject.get('dtype_bound'))} "
            f"(accumulation {subject.get('accumulation')}) and 1.25 x {own}.")


def compare_markdown(report: dict) -> str:
    names = ["autofuse", *report["baselines"]]
    rivals = ", ".join(n for n in report.get("rivals", ()) if n in names) or "none compared"
    code = report.get("code") or {}
    dirty = " with local changes" if code.get("dirty") else ""
    command = " ".join(report.get("command") or [])
    summary = [{"subject": s["name"], **{c["name"]: _time_and_error(c) for c in s["contenders"]},
                "ratio": s["contenders"][0].get("ratio_to_best_baseline"),
                "best": s["contenders"][0].get("best_baseline")} for s in report["subjects"]]
    lines = [f"# autofuse compare — {report['created']}", "", *_machine_lines(report), "",
             f"Code: commit {code.get('commit', 'unknown')}{dirty} ({code.get('source', '?')}); command: `{command}`.",
             "",
             f"## Summary (median ms, error in brackets; ratio = autofuse / best of {rivals} doing the same work; "
             "target <= 0.8)", "",
             table(summary, [("subject", "subject"), *[(n, n) for n in names], ("ratio", "ratio"),
                             ("best", "best baseline")], markdown=True), ""]
    if any(c.get("same_work") is False for s in report["subjects"] for c in s["contenders"]):
        lines += ["†: does more work than ours (below), left out of the ratio.", ""]
    for subject in report["subjects"]:
        shape = ", ".join(f"{k}={v}" for k, v in (subject.get("shape") or {}).items())
        lines += [f"## {subject['kind']} {subject['name']}" + (f" ({shape}, {subject['dtype']})" if shape else ""), "",
                  _check_line(subject), "", table(subject["contenders"], COMPARE_COLUMNS, markdown=True), ""]
        for c in subject["contenders"]:
            if c["status"] != "ok":
                lines.append(f"- {c['name']}: {c['status']}: {c['reason']}")
            elif c.get("info", {}).get("note"):
                lines.append(f"- {c['name']}: {c['info']['note']}")
            if c.get("same_work") is False:
                lines.append(f"- {c['name']} does more work than ours (not in the ratio): {c['more_work']}")
        ours = subject["contenders"][0]
        if ours.get("info", {}).get("source"):
            info = ours["info"]
            made_by = f" ({info['template']}, knobs {info.get('knobs')})" if info.get("template") else ""
            lines.append(f"- autofuse kernel from: {info['source']}{made_by}")
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
    tmp = f"{written[1]}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(compare_markdown(report))
    os.replace(tmp, written[1])
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
