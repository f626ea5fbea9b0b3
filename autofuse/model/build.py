"""Building a model once its kernels are scheduled (``kernels.apply_database``): ``relax.build``,
a library TVM's runtime loads alone, staged under temporary names until it has been checked
against onnxruntime, and that check."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.target import Target

from ..accuracy import Check, compare, reduction_length
from ..errors import AutofuseError
from ..building import fast_math, relax_build_options


def build(mod: tvm.IRModule, target: Target, cuda_graph: bool = False, stock: bool = False):
    """``cuda_graph``: Relax's RewriteCUDAGraph captures the static parts of ``main`` into CUDA
    graphs on the first call and replays them after, one launch instead of one per kernel.
    ``stock``: as TVM builds it; otherwise the kernels' math as ``building.fast_math`` makes it."""
    if cuda_graph and target.kind.name != "cuda":
        raise AutofuseError(f"--cuda-graph needs a cuda target, not {target.kind.name}")
    config = {"relax.backend.use_cuda_graph": True} if cuda_graph else {}
    with tvm.transform.PassContext(opt_level=3, config=config):
        # a kernel template's tirx kernel in ``mod``: its arch and the mixed tirx/s_tir pipeline
        return relax.build(mod if stock else fast_math(mod, target), **relax_build_options(mod, target))


class StagedLibrary:
    """A library and its ``.json`` written beside ``path`` under temporary names: ``commit`` moves
    them into place, ``discard`` (or leaving the ``with`` block uncommitted) removes them, so a
    library that failed its check never reaches ``path`` and a good one already there stays."""

    def __init__(self, executable, path: str):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise AutofuseError(f"cannot create output folder {folder}: {err.strerror}") from None
        if not os.access(folder, os.W_OK):
            raise AutofuseError(f"output folder {folder} is not writable")
        self.path = path
        stem, ext = os.path.splitext(os.path.basename(path))
        # The same suffix: export_library picks the format (shared library, tar) from it.
        self.library = os.path.join(folder, f".{stem}.partial-{os.getpid()}{ext}")
        with native_stderr_silenced():  # TVM logs a "Scope Saving" warning per constant scope
            executable.export_library(self.library)

    def load(self):
        """The staged library as TVM's runtime loads it."""
        with native_stderr_silenced():  # TVM logs a "Scope Loaded" warning per constant scope
            return tvm.runtime.load_module(self.library)

    def commit(self, meta: dict) -> None:
        with open(self.library + ".json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, default=str)
        os.replace(self.library, self.path)
        os.replace(self.library + ".json", self.path + ".json")

    def discard(self) -> None:
        for leftover in (self.library, self.library + ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.discard()


@contextlib.contextmanager
def native_stderr_silenced():
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_vm(executable_or_lib, inputs: list[np.ndarray], dev) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable_or_lib, dev)
    out = vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs])
    return _flatten(out)


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for item in out for a in _flatten(item)]


def onnxruntime_outputs(model_path: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check_against(outputs, expected, mod: tvm.IRModule) -> Check:
    """A model's outputs against onnxruntime's, at the bound of its longest reduction."""
    return compare(outputs, expected, accumulation=model_reduction_length(mod))


def model_reduction_length(mod: tvm.IRModule) -> int:
    return max([reduction_length(f) for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)], default=1)
