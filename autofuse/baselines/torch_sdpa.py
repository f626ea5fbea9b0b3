"""torch-sdpa: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient /
cuDNN kernels on a GPU, torch's CPU kernel otherwise), for the patterns that say how they map
onto it (``Pattern.sdpa``, in the pattern's file or the schedule library)."""

from __future__ import annotations

from . import Context, Prepared, Subject, Unavailable
from .torch_eager import no_grad_call, import_torch, torch_device, torch_inputs, torch_prepared


class TorchSdpa:
    name = "torch-sdpa"
    description = "torch scaled_dot_product_attention (the attention patterns that map onto it)"
    runs_onnx_graph = False

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        adapter = subject.pattern.sdpa if subject.kind == "pattern" else None
        if adapter is None:
            raise Unavailable(f"no scaled_dot_product_attention form of {subject.name}")
        torch = import_torch()
        device = torch_device(torch, ctx)
        args = torch_inputs(subject, device)
        shape = dict(subject.shape)
        return torch_prepared(torch, no_grad_call(torch, lambda: list(adapter(torch, shape, *args))), device, {})
