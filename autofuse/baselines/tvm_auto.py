"""tvm-auto: the XLA-style baseline inside TVM — FuseOps auto-fusion, each kernel tuned by
MetaSchedule's generic (Ansor-style) space; its records come from the same database as ours."""

from __future__ import annotations

from . import Context, Prepared, Subject
from .relax_vm import prepare_relax


class TvmAuto:
    name = "tvm-auto"
    description = "TVM Relax, FuseOps auto-fusion, generic-space records from the database"
    runs_onnx_graph = True

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        prepared = prepare_relax(subject, ctx, "auto", ctx.db, stock=True)[0]
        if ctx.db is not None and not prepared.info["records_applied"]:
            prepared.info["note"] = "no record applied: tune with `autofuse compare --trials N` or `autofuse tune MODEL --fusion auto --space generic`"
        return prepared
