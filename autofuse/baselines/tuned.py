"""autofuse: ours. A pattern runs as its PrimFunc with the best numerically checked record from
the database or its template default, whichever is faster; a model is fused by our patterns (the
rest auto) with records applied never-worse, as ``autofuse build`` does."""

from __future__ import annotations

from ..errors import AutofuseError
from . import Context, Prepared, Subject
from .relax_vm import prepare_relax


class Autofuse:
    name = "autofuse"
    description = "autofuse: pattern fusion, best checked records (template default otherwise)"
    runs_onnx_graph = False

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
        from ..tune_patterns import Job
        from ..verify import build_kernel, choose

        job = Job(subject.pattern, subject.shape, subject.dtype)
        choice, rejected = choose(job, ctx.db, ctx.target, ctx.dev)
        if choice is None:
            why = "; ".join(rejected) or f"the pattern has no template for {ctx.target.kind.name}"
            raise AutofuseError(f"{job.label}: no record or default passed its check: {why}")
        rt = build_kernel(choice.mod, ctx.target)  # a kernel template's tirx kernel: the tirx pipeline
        args = to_device(subject.inputs, ctx.dev)
        outs = empty_outputs(job.pattern.output_specs(job.func), ctx.dev)
        return Prepared(lambda: rt(*args, *outs), ctx.dev.sync, lambda: [o.numpy() for o in outs],
                        {"source": choice.source, "template": choice.template, "knobs": choice.knobs,
                         "records": choice.records,
                         "valid_records": choice.valid_records,
                         "record_ms": choice.record_secs * 1e3 if choice.record_secs else None,
                         "rejected": rejected})
