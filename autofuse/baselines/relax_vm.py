"""An ONNX graph through Relax in one of autofuse's fusion modes, records applied from a database,
built and wrapped as a ``Prepared``: the shared path of autofuse's model contender, tvm-untuned
and tvm-auto. Every kernel without a record gets autofuse's default schedule (pattern templates,
then the CPU rules or dlight's), as ``autofuse build`` does, or for the TVM baselines what TVM
runs as shipped (the TensorIR as written on a CPU, dlight's rules on a GPU)."""

from __future__ import annotations

import dataclasses

import tvm

from . import Context, Prepared, Subject, Unavailable


def prepare_relax(subject: Subject, ctx: Context, fusion: str, db, stock: bool = False) -> tuple[Prepared, tvm.IRModule]:
    """``stock``: TVM as shipped without a record (its default schedules and math), as the TVM
    baselines run; else autofuse's defaults (``verify``)."""
    from tvm import relax

    from ..model import build as model_build
    from ..model.jobs import prepare
    from ..model.kernels import apply_database

    if subject.onnx_path is None:
        raise Unavailable(f"{subject.name} has no ONNX graph to import")
    prepared = prepare(subject.onnx_path, fusion, subject.input_shapes)
    mod, decisions = apply_database(prepared.mod, db, ctx.target, ctx.dev, stock=stock)
    main = relax.VirtualMachine(model_build.build(mod, ctx.target, stock=stock), ctx.dev)["main"]
    args = [tvm.runtime.tensor(x, ctx.dev) for x in subject.inputs]
    last = {}

    def launch():
        last["out"] = main(*args)

    info = {"fusion": fusion, "kernels": len(decisions), "matches": dict(prepared.matches),
            "folded": prepared.notes.folded, "import_warnings": len(prepared.notes.warnings),
            "records_applied": sum(d.applied == "record" for d in decisions),
            "records": sum(d.records for d in decisions),
            "decisions": [dataclasses.asdict(d) for d in decisions]}
    return Prepared(launch, ctx.dev.sync, lambda: model_build._flatten(last["out"]), info), mod
