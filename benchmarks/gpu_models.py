"""The ONNX models built for a CUDA GPU and checked against onnxruntime (CPU), with and without
CUDA graphs, written to one JSON file.

    python benchmarks/gpu_models.py [--models mlp,decoder_block] [--fusion auto,patterns]
                                    [--db none] [--repeat 50] [--out gpu-models.json]

For each model and fusion mode: ``autofuse build`` (jobs.build_model) for the h200 target, once
plain and once with ``--cuda-graph`` (Relax's RewriteCUDAGraph: the first call captures the
kernel launches of ``main``, later calls replay the graph). Latency is the VM's time_evaluator
median (warm L2, back-to-back calls: the launch overhead a graph saves is what it shows). Each
build's outputs are compared with onnxruntime on the CPU. Needs TVM with CUDA and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.errors import AutofuseError  # noqa: E402

MODELS = ("mlp", "conv_block", "transformer_block", "decoder_block", "quant_mlp")


def build_one(path: str, fusion: str, target, db, cuda_graph: bool, repeat: int, work: str) -> dict:
    from autofuse.model.jobs import build_model, prepare

    row = {"fusion": fusion, "cuda_graph": cuda_graph}
    start = time.perf_counter()
    try:
        prepared = prepare(path, fusion)
        result = build_model(prepared, target, db, os.path.join(work, f"{fusion}-{cuda_graph}.so"),
                             repeat=repeat, cuda_graph=cuda_graph)
    except Exception as err:  # one build's failure is its row
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        return {**row, "status": "error", "error": f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]}
    applied = {}
    for decision in result.decisions:
        applied[decision.applied] = applied.get(decision.applied, 0) + 1
    return {**row, "status": "ok" if result.verified else ("unverified" if result.verified is None else "MISMATCH"),
            "latency_ms": result.latency_ms, "max_abs_err": result.max_abs_err, "kernels": len(result.kernels),
            "matches": prepared.matches, "applied": applied, "build_secs": time.perf_counter() - start,
            "message": result.message}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fusion", default="auto,patterns")
    parser.add_argument("--db", default="none", help="database root with cuda records, or none")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", default="gpu-models.json")
    args = parser.parse_args(argv)

    from autofuse.database import TuningDatabase
    from autofuse.target import parse_target

    try:
        target = parse_target(args.target)
        db = None if args.db == "none" else TuningDatabase(args.db, target)
    except AutofuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from autofuse.compare import code_commit
    from autofuse.report import machine_info
    from autofuse.target import device_for

    report = {"schema": "autofuse.gpu_models/1", "target": str(target), "args": vars(args), "code": code_commit(),
              "command": sys.argv, "machine": machine_info(device_for(target)), "models": {}}
    with tempfile.TemporaryDirectory(prefix="autofuse-gpu-models-") as work:
        for model in args.models.split(","):
            path = os.path.join(ROOT, "models", f"{model}.onnx")
            rows = report["models"][model] = []
            for fusion in args.fusion.split(","):
                for graph in (False, True):
                    row = build_one(path, fusion, target, db, graph, args.repeat, work)
                    rows.append(row)
                    latency = f"{row['latency_ms']:.4f} ms" if "latency_ms" in row else row.get("error", "")
                    print(f"{model:18s} {fusion:9s} graph={graph!s:5s} {row['status']:9s} {latency}"
                          f"  err {row.get('max_abs_err')}", flush=True)
                    with open(args.out, "w", encoding="utf-8") as f:
                        json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
