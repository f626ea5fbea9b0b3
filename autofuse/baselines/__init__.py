"""Baselines autofuse is compared against, one module per contender, behind one small interface.

A contender turns a ``Subject`` (a pattern at a shape, or an ONNX model) into a ``Prepared``: a
way to launch one run of the computation on the subject's seeded inputs, to wait for it, and to
read the outputs. A contender that cannot run here (optional package missing, op it cannot
express, no such device) raises ``Unavailable`` with the reason; the compare report says so
instead of failing. Each name means the same on a CPU and on a GPU: the contender runs on the
compare context's device (``Context.device``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import numpy as np

# Everything autofuse is compared against, in report order.
BASELINES = ("tvm-untuned", "tvm-auto", "onnxruntime", "xla", "torch-eager", "torch-compile", "torch-sdpa")
# Those that count for "ours / best": not tvm-untuned, which nobody would deploy.
RIVALS = ("tvm-auto", "onnxruntime", "xla", "torch-eager", "torch-compile", "torch-sdpa")
# Whose result in the subject's dtype sets how accurate a contender must be (compare's validity rule):
# what a user of that device runs today.
FRAMEWORK = {"cpu": "onnxruntime", "cuda": "torch-eager"}
# Those that run a pattern's ``torch_function`` (the same work in plain torch) instead of its ONNX graph.
TORCH_FUNCTION_CONTENDERS = ("torch-eager", "torch-compile")


class Unavailable(Exception):
    """This contender cannot run on this subject or machine; the message says why."""


@dataclasses.dataclass
class Subject:
    kind: str                       # "pattern" or "model"
    name: str
    inputs: list[np.ndarray]        # in graph input / PrimFunc parameter order
    input_names: list[str]
    onnx_path: str | None           # the same computation as ONNX (the model, or the pattern's graph)
    flops: float | None = None
    bytes: float | None = None
    shape: dict | None = None       # patterns only
    dtype: str = "float32"
    pattern: Any = None             # the Pattern, for patterns
    # How the outputs are checked (autofuse.accuracy.compare): the longest reduction behind an
    # output, and a bound overriding the dtype-derived one (None: derived).
    accumulation: int = 1
    bound: float | None = None
    # Contenders that do more work than ours on this subject: name (or "onnx_graph": every contender
    # running the ONNX graph) -> why. They are reported, labelled, and left out of ours / best.
    more_work: dict = dataclasses.field(default_factory=dict)
    # A model's module as a torch.export program (.pt2): what the torch baselines run, if given.
    torch_program: str | None = None

    def runs_onnx_graph(self, contender) -> bool:
        """Whether ``contender`` runs this subject's ONNX graph (what ``more_work["onnx_graph"]``
        is about): the torch contenders run a pattern's ``torch_function`` instead where it has one."""
        if contender.name in TORCH_FUNCTION_CONTENDERS and self.pattern is not None \
                and self.pattern.torch_function is not None:
            return False
        return contender.runs_onnx_graph

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(self.input_names, self.inputs))

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each input: what a model's symbolic axes are bound to (``--input-shape``)."""
        return {name: tuple(x.shape) for name, x in self.feeds.items()}

    def static_graph(self):
        """The subject's ONNX graph with its inputs bound to the subject's shapes and its shape
        computations folded (``model.shapes``): the same computation, for the baselines that
        translate the graph (XLA, torch)."""
        import onnx

        from ..model.shapes import static_model
        return static_model(onnx.load(self.onnx_path), self.input_shapes, self.onnx_path)[0]


@dataclasses.dataclass
class Context:
    """What every contender shares: one target and device, one thread count, one database."""
    target: Any
    dev: Any
    threads: int
    db: Any = None                  # TuningDatabase, or None for contenders that need no records
    work_dir: str = "."

    @property
    def device(self) -> str:
        """"cuda" or "cpu": where every contender runs."""
        return "cuda" if self.target.kind.name == "cuda" else "cpu"


@dataclasses.dataclass
class Prepared:
    launch: Callable[[], None]                  # start one complete run (on a GPU it may return early)
    wait: Callable[[], None]                    # block until the last launch is done
    outputs: Callable[[], list[np.ndarray]]     # the outputs of the last run, as numpy
    info: dict = dataclasses.field(default_factory=dict)   # records applied, trials, kernels, ...
    # On a GPU: the work runs on torch's current stream, so CUDA events recorded there bracket it.
    same_stream: bool = True

    def call(self) -> None:
        self.launch()
        self.wait()


class Contender(Protocol):
    name: str
    description: str
    runs_onnx_graph: bool           # runs the subject's ONNX graph (see Subject.more_work)

    def prepare(self, subject: Subject, ctx: Context) -> Prepared: ...


def contenders() -> dict:
    """Every contender by name, ours first."""
    from .ort import OnnxRuntime
    from .torch_compile import TorchCompile
    from .torch_eager import TorchEager
    from .torch_sdpa import TorchSdpa
    from .tuned import Autofuse
    from .tvm_auto import TvmAuto
    from .tvm_untuned import TvmUntuned
    from .xla import Xla
    return {c.name: c for c in (Autofuse(), TvmUntuned(), TvmAuto(), OnnxRuntime(), Xla(), TorchEager(),
                                TorchCompile(), TorchSdpa())}
