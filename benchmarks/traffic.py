"""Memory traffic of each pattern fused vs unfused, from the pattern's byte count and its ONNX graph.

    python benchmarks/traffic.py [--patterns all] [--small]

Fused: ``pattern.bytes(shape, dtype)``, what the one kernel must read and write (inputs once,
outputs once). Unfused: the same graph run op by op, as the baselines' graphs are written, where
every op reads its inputs from memory and writes its output to memory: the sum over the graph's
nodes of their input and output tensor sizes (ONNX shape inference gives every intermediate's
size). Constants count like inputs. This is a lower bound for an unfused run (no re-reads for
cache misses) and an upper bound for a fused one (no reuse across calls), so the ratio is what
fusion can save, not a measurement. Writes benchmarks/results/traffic.json.
"""

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.registry import resolve_patterns  # noqa: E402


def tensor_bytes(model) -> dict[str, int]:
    import onnx
    from onnx import numpy_helper, shape_inference

    inferred = shape_inference.infer_shapes(model)
    sizes = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        kind = info.type.tensor_type
        dims = [d.dim_value for d in kind.shape.dim]
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)).itemsize
        sizes[info.name] = int(np.prod(dims, dtype=np.int64)) * itemsize
    for init in inferred.graph.initializer:
        sizes[init.name] = numpy_helper.to_array(init).nbytes
    return sizes


def unfused_bytes(model) -> tuple[int, int]:
    """(bytes moved op by op, bytes of intermediates that a fused kernel keeps out of memory)."""
    sizes = tensor_bytes(model)
    moved = sum(sizes.get(name, 0) for node in model.graph.node for name in [*node.input, *node.output] if name)
    boundary = {v.name for v in [*model.graph.input, *model.graph.output]} | {i.name for i in model.graph.initializer}
    intermediates = {name for node in model.graph.node for name in node.output} - boundary
    return moved, sum(sizes.get(name, 0) for name in intermediates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default="all")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times
    rows = []
    for pattern in resolve_patterns(args.patterns):
        if pattern.onnx_graph is None:
            continue
        shape = pattern.small_shape() if args.small else pattern.default_shape()
        dtype = pattern.dtypes[0]
        fused = pattern.bytes(shape, dtype)
        moved, intermediate = unfused_bytes(pattern.onnx_graph(shape, dtype))
        rows.append({"pattern": pattern.name, "shape": shape, "fused_bytes": fused, "unfused_bytes": moved,
                     "intermediate_bytes": intermediate, "ratio": moved / fused})
        print(f"{pattern.name:24s} fused {fused / 2**20:8.2f} MiB  unfused {moved / 2**20:8.2f} MiB "
              f"({moved / fused:5.1f}x; intermediates {intermediate / 2**20:7.2f} MiB)")
    path = os.path.join(ROOT, "benchmarks", "results", "traffic.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"note": __doc__.split("\n\n")[1], "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
