"""torch-compile: torch-eager's function (the ONNX graph translated, or the model's module) under
``torch.compile`` (inductor, default mode) on the compare device; its compile time is the first
call's, which compare reports but does not time."""

from __future__ import annotations

from . import Context, Prepared, Subject
from .torch_eager import (no_grad_call, graph_function, import_torch, source_info, torch_device, torch_inputs,
                          torch_prepared)


class TorchCompile:
    name = "torch-compile"
    description = "torch.compile (inductor, default mode) of the same ONNX graph"
    runs_onnx_graph = True

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        torch = import_torch()
        device = torch_device(torch, ctx)
        fn = graph_function(subject, device)
        torch._dynamo.reset()  # every graph's function is the same Python code: no stale guards
        compiled = torch.compile(fn)
        args = torch_inputs(subject, device)
        return torch_prepared(torch, no_grad_call(torch, lambda: compiled(*args)), device,
                              {"mode": "default", **source_info(subject)})
