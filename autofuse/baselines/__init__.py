"""Baselines autofuse is compared against, one module per contender, behind one small interface.

A contender turns a ``Subject`` (a pattern at a shape, or an ONNX model) into a ``Prepared``: a
call that runs the computation once on the subject's seeded inputs and a way to read the outputs.
A contender that cannot run here (optional package missing, op it cannot express) raises
``Unavailable`` with the reason; the compare report says so instead of failing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import numpy as np

# Everything autofuse is compared against, in report order.
BASELINES = ("tvm-untuned", "tvm-auto", "onnxruntime", "xla")


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
    tolerance: tuple[float, float] = (1e-4, 1e-4)

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(self.input_names, self.inputs))


@dataclasses.dataclass
class Context:
    """What every contender shares: one target and device, one thread count, one database."""
    target: Any
    dev: Any
    threads: int
    db: Any = None                  # TuningDatabase, or None for contenders that need no records
    work_dir: str = "."


@dataclasses.dataclass
class Prepared:
    call: Callable[[], None]                    # one complete run (synchronised), as timed
    outputs: Callable[[], list[np.ndarray]]     # the outputs of the last call, as numpy
    info: dict = dataclasses.field(default_factory=dict)   # records applied, trials, kernels, ...


class Contender(Protocol):
    name: str
    description: str

    def prepare(self, subject: Subject, ctx: Context) -> Prepared: ...
