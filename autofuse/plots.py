"""The compare report's figures: latency bars, the roofline, and search curves (best latency
versus trials). matplotlib is an optional extra, imported only here."""

from __future__ import annotations

import os

from .errors import AutofuseError

MARKERS = {"autofuse": "*", "tvm-untuned": "v", "tvm-auto": "s", "onnxruntime": "o", "xla": "D", "torch-eager": "^",
           "torch-compile": "P", "torch-sdpa": "X"}


def _where(report: dict) -> str:
    if report.get("device") == "cuda":
        return (report.get("machine", {}).get("gpu") or {}).get("name", "GPU")
    return f"{report.get('threads', '?')} threads"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise AutofuseError("plots need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, plt, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_bars(report: dict, path: str) -> None:
    plt = _pyplot()
    subjects = report["subjects"]
    names = ["autofuse", *report.get("baselines", [])]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(subjects) * len(names) / 3), 4))
    width = 0.8 / len(names)
    values = []
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, subject in enumerate(subjects):
            row = next((c for c in subject["contenders"] if c["name"] == name), None)
            if row is None or row["status"] != "ok":
                continue
            xs.append(i + (k - (len(names) - 1) / 2) * width)
            ys.append(row["median_ms"])
            lo.append(row["median_ms"] - row["p10_ms"])
            hi.append(row["p90_ms"] - row["median_ms"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
            values += ys
    if values and max(values) / max(min(values), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_xticks(range(len(subjects)))
    ax.set_xticklabels([s["name"] for s in subjects], rotation=20, ha="right")
    ax.set_ylabel("latency, ms (median, p10-p90)")
    ax.set_title(f"autofuse vs baselines, {_where(report)}")
    ax.legend(fontsize=8)
    _save(fig, plt, path)


def roofline(report: dict, path: str) -> None:
    plt = _pyplot()
    roof = report["machine"]["roofline"]
    peak, bandwidth = roof["peak_gflops"], roof["bandwidth_gbps"]
    fig, ax = plt.subplots(figsize=(7, 5))
    intensities = [0.01, 1000.0]
    for subject in report["subjects"]:
        intensities += [c["intensity"] for c in subject["contenders"] if c.get("intensity")]
        for kernel in subject.get("kernels", []):
            if kernel.get("intensity") and kernel.get("gflops"):
                ax.scatter(kernel["intensity"], kernel["gflops"], s=10, color="grey", alpha=0.6)
                intensities.append(kernel["intensity"])
        for c in subject["contenders"]:
            if c["status"] == "ok" and c.get("intensity") and c.get("gflops"):
                ax.scatter(c["intensity"], c["gflops"], marker=MARKERS.get(c["name"], "x"), s=40,
                           label=c["name"])
                ax.annotate(subject["name"], (c["intensity"], c["gflops"]), fontsize=6)
    lo, hi = min(intensities) / 2, max(intensities) * 2
    ax.plot([lo, peak / bandwidth, hi], [lo * bandwidth, peak, peak], color="black", lw=1, label="DRAM roof")
    cache = max((gbps for _, gbps in roof.get("bandwidth_ladder", [])), default=bandwidth)
    if cache > bandwidth * 1.1:
        # Kernels whose working set fits in cache are held to the copy bandwidth at their size,
        # up to this line.
        ax.plot([lo, peak / cache], [lo * cache, peak], color="black", lw=1, ls="--", label="cache roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP/byte")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"roofline: {bandwidth:.1f} GB/s DRAM, {cache:.1f} GB/s best cache copy, {peak:.0f} GFLOP/s\n"
                 "(grey: model kernels)", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8)
    _save(fig, plt, path)


def search_curves(curves: dict[str, dict[str, list]], path: str) -> None:
    """``curves[pattern][space]``: best-so-far ms after each trial (None before the first valid)."""
    plt = _pyplot()
    patterns = list(curves)
    cols = min(3, max(1, len(patterns)))
    rows = (len(patterns) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, pattern in zip(axes.flat, patterns):
        values = []
        for space, curve in curves[pattern].items():
            points = [(i, v) for i, v in enumerate(curve, 1) if v is not None]
            if points:
                ax.plot(*zip(*points), label=space)
                values += [v for _, v in points]
        if values and max(values) / max(min(values), 1e-9) > 20:
            ax.set_yscale("log")  # a slow first trial must not flatten the rest of the curve
        ax.set_title(pattern, fontsize=9)
        ax.set_xlabel("trial")
        ax.set_ylabel("best ms")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(patterns):]:
        ax.axis("off")
    _save(fig, plt, path)
