"""torch-eager: the same ONNX graph as torch ops (``onnx_to_torch``), or the model's own module
where the subject has its torch.export program (a pattern's ``torch_function`` where it has one),
run eagerly on the compare device. On a GPU its
matmuls are cuBLAS calls (float32 without TF32, like every contender) and it is the framework's
own result that sets the accuracy a contender must reach; on a CPU it runs
torch's CPU kernels on the compare run's threads.

torch is optional: without it the torch contenders are ``Unavailable``.
"""

from __future__ import annotations

from typing import Callable

from ..errors import AutofuseError
from . import Context, Prepared, Subject, Unavailable


def import_torch():
    try:
        import torch
    except ImportError:
        raise Unavailable("torch is not installed (pip install torch)") from None
    return torch


def torch_device(torch, ctx: Context) -> str:
    """torch's name for the compare device, with torch set up the way every contender runs."""
    if ctx.device == "cpu":
        torch.set_num_threads(ctx.threads)
        return "cpu"
    if not torch.cuda.is_available():
        raise Unavailable("this torch has no CUDA (a CPU build?)")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for every contender
    torch.backends.cudnn.allow_tf32 = False
    return f"cuda:{ctx.dev.index}"


def graph_function(subject: Subject, device: str) -> Callable:
    """The subject as a function of torch tensors returning a list: its module (a torch.export
    program) or the pattern's ``torch_function`` where it has one, else the ONNX graph translated."""
    if subject.torch_program is not None:
        return program_function(subject.torch_program, device)
    if not subject.runs_onnx_graph(TorchEager):
        import torch
        function, shape = subject.pattern.torch_function, dict(subject.shape)
        return lambda *args: list(function(torch, shape, *args))
    if subject.onnx_path is None:
        raise Unavailable(f"{subject.name} has no ONNX graph")
    from .onnx_to_torch import torch_function
    try:
        return torch_function(subject.static_graph(), device)
    except AutofuseError as err:  # an op without translation
        raise Unavailable(str(err)) from None


def program_function(path: str, device: str) -> Callable:
    import torch
    try:
        module = torch.export.load(path).module().to(device)
    except Exception as err:  # a program this torch cannot load
        text = str(err).strip()
        raise AutofuseError(f"{path}: torch.export.load failed: "
                            f"{text.splitlines()[0] if text else type(err).__name__}") from None

    def run(*args):
        out = module(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]
    return run


def source_info(subject: Subject) -> dict:
    if subject.torch_program:
        return {"runs": "torch.export program " + subject.torch_program}
    if not subject.runs_onnx_graph(TorchEager):
        return {"runs": f"{subject.name}'s torch_function (the same work in plain torch)"}
    return {"runs": "ONNX graph"}


def torch_prepared(torch, call: Callable[[], list], device: str, info: dict) -> Prepared:
    """``call()`` runs on torch's current stream (a GPU's) or synchronously (the CPU)."""
    from .onnx_to_torch import to_numpy

    last = {}

    def launch():
        last["out"] = call()

    wait = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return Prepared(launch, wait, lambda: [to_numpy(t) for t in last["out"]],
                    {"version": torch.__version__, "device": device, **info})


def torch_inputs(subject: Subject, device: str) -> list:
    from .onnx_to_torch import to_torch
    return [to_torch(x, device) for x in subject.inputs]


class TorchEager:
    name = "torch-eager"
    description = "torch eager of the same ONNX graph (cuBLAS matmuls on a GPU)"
    runs_onnx_graph = True

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        torch = import_torch()
        device = torch_device(torch, ctx)
        fn = graph_function(subject, device)
        args = torch_inputs(subject, device)
        return torch_prepared(torch, no_grad_call(torch, lambda: fn(*args)), device, source_info(subject))


def no_grad_call(torch, call: Callable[[], list]) -> Callable[[], list]:
    def run():
        with torch.no_grad():
            return call()
    return run
