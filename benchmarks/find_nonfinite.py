"""Which kernel of a model first writes a non-finite value: the model built as ``autofuse compare``
builds ours (``--fusion patterns``, records from ``--db`` or the defaults), run once on its seeded
inputs with the Relax VM's instrument hook, which looks at every call's arguments after the call.

    python benchmarks/find_nonfinite.py MODEL.onnx --target h200 [--db none] [--against-cpu] [--out report.json]

Prints one line per call up to the first one whose outputs hold NaN or inf (its inputs' ranges and
which of them were already non-finite), and writes the same as JSON with ``--out``. With
``--against-cpu`` every kernel also runs as written (its TensorIR unscheduled, TVM's stock CPU
build) on a copy of the same inputs, and each call gets its scaled error against that, so a kernel
that loses precision (not only one that goes NaN) shows where the model's error comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def summary(array: np.ndarray) -> dict:
    values = array.astype(np.float64) if array.dtype.kind == "f" else array
    finite = np.isfinite(values) if array.dtype.kind == "f" else np.ones(array.shape, bool)
    shown = values[finite]
    return {"shape": list(array.shape), "dtype": str(array.dtype), "non_finite": int(finite.size - finite.sum()),
            "min": float(shown.min()) if shown.size else None, "max": float(shown.max()) if shown.size else None,
            "max_abs": float(np.abs(shown).max()) if shown.size else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--db", default="none", help="tuning database folder, or none (defaults)")
    parser.add_argument("--fusion", default="patterns", choices=("patterns", "auto"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against-cpu", action="store_true",
                        help="also run each kernel's TensorIR as written on this CPU and report its scaled error")
    parser.add_argument("--out", help="write the calls as JSON here")
    args = parser.parse_args(argv)

    import tvm
    from tvm import relax

    from autofuse.database import TuningDatabase
    from autofuse.compare import model_subject
    from autofuse.model import build as model_build
    from autofuse.model.jobs import prepare
    from autofuse.model.kernels import apply_database
    from autofuse.target import device_for, parse_target

    target = parse_target(args.target)
    dev = device_for(target)
    subject = model_subject(args.model, args.seed)
    prepared = prepare(args.model, args.fusion, subject.input_shapes)
    db = None if args.db == "none" else TuningDatabase(args.db, target)
    mod, decisions = apply_database(prepared.mod, db, target, dev)
    chosen = {d.name: f"{d.applied} ({d.default or d.source})" for d in decisions}
    vm = relax.VirtualMachine(model_build.build(mod, target), dev)
    calls: list[dict] = []
    state = {"done": False}
    cpu_kernels: dict[str, object] = {}

    def cpu_error(symbol: str, arrays: list[np.ndarray]) -> float | None:
        """The largest scaled error of this call's arguments against the kernel's TensorIR run
        as written on the CPU from the same inputs (inputs compare equal; outputs carry it)."""
        from tvm import tirx

        from autofuse.building import build_kernel
        from autofuse.target import parse_target as parse

        func = next((f for gv, f in prepared.mod.functions_items() if gv.name_hint == symbol), None)
        if not isinstance(func, tirx.PrimFunc):
            return None
        if symbol not in cpu_kernels:
            cpu_kernels[symbol] = build_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                               parse("llvm"), stock=True)
        host = [tvm.runtime.tensor(a, tvm.cpu()) for a in arrays]
        cpu_kernels[symbol](*host)
        worst = 0.0
        for got, want in zip(arrays, host):
            want = want.numpy().astype(np.float64)
            scale = float(np.abs(want).max()) if want.size else 0.0
            if got.dtype.kind == "f" and scale > 0:
                worst = max(worst, float(np.abs(got.astype(np.float64) - want).max()) / scale)
        return worst

    def instrument(func, symbol, before_run, ret_value, *call_args):
        if before_run or state["done"]:
            return 0
        dev.sync()
        tensors = [a for a in call_args if hasattr(a, "numpy") and hasattr(a, "shape")]
        if not tensors:  # the VM's own builtins (storage, null values)
            return 0
        arrays = [t.numpy() for t in tensors]
        entry = {"symbol": str(symbol), "args": [summary(a) for a in arrays]}
        if args.against_cpu:
            entry["cpu_scaled_error"] = cpu_error(str(symbol), arrays)
        calls.append(entry)
        # destination-passing style: a kernel's outputs are its last arguments
        if entry["args"] and entry["args"][-1]["non_finite"]:
            state["done"] = True
        return 0

    vm.set_instrument(instrument)
    vm["main"](*[tvm.runtime.tensor(x, dev) for x in subject.inputs])
    dev.sync()
    for i, call in enumerate(calls):
        shown = "; ".join(f"{a['dtype']}{a['shape']} nonfinite={a['non_finite']} max|x|={a['max_abs']}" for a in call["args"])
        versus = f" | against the CPU: {call['cpu_scaled_error']:.2e}" if call.get("cpu_scaled_error") is not None else ""
        print(f"{i:4d} {call['symbol']}: {shown}{versus}")
    first = next((c for c in calls if c["args"] and c["args"][-1]["non_finite"]), None)
    print("first non-finite output:", first["symbol"] if first else "none")
    if args.against_cpu:
        worst = sorted((c for c in calls if c.get("cpu_scaled_error")), key=lambda c: -c["cpu_scaled_error"])[:5]
        print("largest errors against the CPU:", ", ".join(f"{c['symbol']} {c['cpu_scaled_error']:.2e}" for c in worst))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "target": args.target, "first": first and first["symbol"],
                       "kernels": chosen, "calls": calls}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
