"""autofuse: ours. A pattern runs as its PrimFunc with the best numerically checked record from
the database (its template default when there is none); a model is fused by our patterns (the
rest auto) with records applied never-worse, as ``autofuse build`` does."""

from __future__ import annotations

import tvm

from . import Context, Prepared, Subject
from .relax_vm import prepare_relax


class Autofuse:
    name = "autofuse"
    description = "autofuse: pattern fusion, best checked records (template default otherwise)"

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        if subject.kind == "pattern":
            return self._pattern(subject, ctx)
        from ..model.kernels import kernel_figures
        prepared, mod = prepare_relax(subject, ctx, "patterns", ctx.db)
        prepared.info["kernel_figures"] = kernel_figures(mod, ctx.target, ctx.dev)
        return prepared

    @staticmethod
    def _pattern(subject: Subject, ctx: Context) -> Prepared:
        from ..measure import empty_outputs, to_device
        from ..tune_patterns import Job, checker

        job = Job(subject.pattern, subject.shape, subject.dtype)
        chosen, rejected = (None, [])
        if ctx.db is not None:
            chosen, rejected = ctx.db.best(job.func, checker(job, ctx.target, ctx.dev))
        if chosen is not None:
            mod, source = chosen.schedule.mod, chosen.source
        else:
            mod, source = job.pattern.default_schedule(job.func, ctx.target).mod, "template-default"
        rt = tvm.tirx.build(mod, target=ctx.target)
        args = to_device(subject.inputs, ctx.dev)
        outs = empty_outputs(job.pattern.output_specs(job.func), ctx.dev)

        def call():
            rt(*args, *outs)
            ctx.dev.sync()

        valid, total = ctx.db.count(job.func) if ctx.db is not None else (0, 0)
        return Prepared(call, lambda: [o.numpy() for o in outs],
                        {"source": source, "records": total, "valid_records": valid, "rejected": rejected})
