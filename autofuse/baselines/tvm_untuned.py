"""tvm-untuned: what TVM gives without tuning — the ONNX graph through Relax's automatic fusion
(FuseOps/FuseTIR) with every kernel on its default schedule (TVM's lowering on a CPU, dlight's
rules on a GPU)."""

from __future__ import annotations

from . import Context, Prepared, Subject
from .relax_vm import prepare_relax


class TvmUntuned:
    name = "tvm-untuned"
    description = "TVM Relax, FuseOps auto-fusion, default schedules (dlight on a GPU), no records"
    runs_onnx_graph = True

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        return prepare_relax(subject, ctx, "auto", None, stock=True)[0]
