"""The model commands' work: ``tune MODEL``, ``build MODEL`` and ``run LIBRARY``."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from ..database import TuningDatabase
from ..errors import AutofuseError
from ..kernel_templates import tune_kernels
from ..progress import tuning_bar
from ..target import device_for
from ..tune import TuneStats, tune
from ..verify import device_measure
from . import build as model_build
from .fusion import fuse, kernel_names
from .importer import (ImportNotes, captured_tvm_output, input_specs, load_onnx, random_feeds, random_inputs,
                       to_relax)
from .shapes import static_model
from .kernels import apply_database, pattern_share
from .tuning import model_tasks


@dataclasses.dataclass
class PreparedModel:
    path: str
    onnx: object
    fusion: str
    mod: tvm.IRModule
    matches: dict[str, int]
    notes: ImportNotes = dataclasses.field(default_factory=ImportNotes)

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def prepare(path: str, fusion: str, input_shapes: dict[str, tuple[int, ...]] | None = None) -> PreparedModel:
    """Load, bind ``input_shapes`` (``--input-shape``), fold shape computations, import and fuse.
    ``onnx`` is the static, folded model; onnxruntime checks against the file at ``path``."""
    model, folded = static_model(load_onnx(path), input_shapes, path)
    notes = ImportNotes(folded=folded)
    imported = to_relax(model, path, notes)
    try:
        with captured_tvm_output(notes):
            mod, matches = fuse(imported, fusion)
    except AutofuseError:
        raise
    except Exception as err:  # TVM's lowering of a construct the import let through
        raise AutofuseError(f"{path}: lowering to kernels ({fusion} fusion) failed: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None
    return PreparedModel(path, model, fusion, mod, matches, notes)


def tune_model(prepared: PreparedModel, target: Target, db: TuningDatabase, *, trials: int, space: str,
               seed: int | None, progress: bool = True, run_timeout: float = 30.0,
               runner=None, runner_status=None) -> tuple[list, TuneStats]:
    tasks = model_tasks(prepared.mod, target, space)
    with tuning_bar(trials, [t.name for t in tasks], progress, runner_status) as (on_phase, on_progress):
        stats = tune(tasks, target, db.ms, db.work_dir, trials_per_task=trials, trials_total=trials,
                     space=space, seed=seed, cost_model_path=db.cost_model_path, run_timeout=run_timeout,
                     runner=runner, on_progress=on_progress, on_phase=on_phase)
        if space != "generic":  # its pattern kernels' kernel templates, as ``tune --pattern`` searches them
            dev = device_for(target)
            tune_kernels(_pattern_jobs(prepared.mod), target, db, trials=trials, dev=dev, measure=device_measure(dev),
                         on_phase=on_phase)
    return tasks, stats


def _pattern_jobs(mod: tvm.IRModule) -> list:
    """One pattern workload per distinct pattern kernel of a fused model."""
    from ..tune_patterns import Job
    from .kernels import kernels

    found = {}
    for kernel in kernels(mod):
        if kernel.pattern is not None:
            key = (kernel.pattern.name, json.dumps(kernel.shape, sort_keys=True), kernel.dtype)
            found.setdefault(key, (kernel.pattern, kernel.shape, kernel.dtype))
    return [Job(*args) for args in found.values()]


@dataclasses.dataclass
class BuildResult:
    decisions: list
    kernels: list[str]
    latency_ms: float
    max_abs_err: float | None
    scaled_err: float | None   # max abs error over the outputs' scale (``autofuse.accuracy``)
    verified: bool | None      # None: not checked (--no-verify or no onnxruntime)
    message: str = ""
    library: str | None = None  # where the library was written; None: it failed its check
    # The pattern kernels' share of the model's FLOPs and bytes (``kernels.pattern_share``).
    pattern_share: dict | None = None


def build_model(prepared: PreparedModel, target: Target, db: TuningDatabase | None, output: str, *,
                verify: bool = True, seed: int = 0, repeat: int = 10, cuda_graph: bool = False) -> BuildResult:
    """Build, export under temporary names, check the exported library against onnxruntime, and
    only then move it (and its ``.json``) to ``output``."""
    dev = device_for(target)
    if not dev.exist:
        raise AutofuseError(f"no {target.kind.name} device on this machine: cannot run or check the build")
    mod, decisions = apply_database(prepared.mod, db, target, dev)
    executable = model_build.build(mod, target, cuda_graph)
    feeds = random_inputs(prepared.onnx, seed)
    with model_build.StagedLibrary(executable, output) as staged:
        # Checked and timed as exported: the library is compiled once, for the file (a VM on the
        # in-memory executable JIT-compiled every kernel a second time: 2 s for a small CNN).
        library = staged.load()
        result = BuildResult(decisions, kernel_names(mod), None, None, None, None,
                             pattern_share=pattern_share(prepared.mod))
        if verify:
            expected = model_build.onnxruntime_outputs(prepared.path, feeds)
            if expected is None:
                result.message = "onnxruntime is not installed: not verified (pip install -e '.[bench]')"
            else:
                outputs = model_build.run_vm(library, list(feeds.values()), dev)
                # The model's own reductions set the bound, whatever kernels now run them (a tirx
                # kernel has no blocks to read them from).
                check = model_build.check_against(outputs, expected, prepared.mod)
                result.verified, result.max_abs_err, result.scaled_err = check.ok, check.max_abs_err, check.scaled_err
                result.message = check.message
        result.latency_ms = _vm_latency_ms(library, feeds, dev, repeat)
        if result.verified is not False:
            staged.commit(_library_meta(prepared, target, cuda_graph, decisions, result))
            result.library = output
    return result


def _library_meta(prepared: PreparedModel, target: Target, cuda_graph: bool, decisions: list,
                  result: BuildResult) -> dict:
    return {
        "model": os.path.abspath(prepared.path), "fusion": prepared.fusion, "target": str(target),
        "cuda_graph": cuda_graph,
        "inputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in input_specs(prepared.onnx)],
        "outputs": [o.name for o in prepared.onnx.graph.output],
        "kernels": [dataclasses.asdict(d) for d in decisions],
        "verified": result.verified, "max_abs_err": result.max_abs_err, "scaled_err": result.scaled_err,
        "pattern_share": result.pattern_share, "built": time.strftime("%Y-%m-%d %H:%M:%S")}


def _vm_latency_ms(executable, feeds, dev, repeat: int) -> float:
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(x, dev) for x in feeds.values()]
    timer = vm.time_evaluator("main", dev, number=1, repeat=repeat, min_repeat_ms=50)
    return float(np.median(timer(*args).results)) * 1e3


def load_inputs(meta: dict, inputs_path: str | None, seed: int) -> dict[str, np.ndarray]:
    """Inputs for ``run``: from an .npz (checked against the library's input specs) or random."""
    if inputs_path is None:
        return random_feeds([(i["name"], i["shape"], i["dtype"]) for i in meta["inputs"]], seed)
    if not os.path.exists(inputs_path):
        raise AutofuseError(f"inputs file {inputs_path} does not exist")
    try:
        data = np.load(inputs_path)
    except Exception as err:
        raise AutofuseError(f"{inputs_path} is not a readable .npz file: {err}") from None
    feeds = {}
    for spec in meta["inputs"]:
        if spec["name"] not in data:
            raise AutofuseError(f"{inputs_path} has no array named {spec['name']!r} (has: {', '.join(data.files)})")
        array = data[spec["name"]]
        if list(array.shape) != spec["shape"]:
            raise AutofuseError(f"input {spec['name']!r} has shape {list(array.shape)}, the model takes {spec['shape']}")
        if array.dtype.name != spec["dtype"]:
            raise AutofuseError(f"input {spec['name']!r} has dtype {array.dtype.name}, the model takes {spec['dtype']}")
        feeds[spec["name"]] = array
    return feeds


def _check_built_shapes(meta: dict, shapes: dict[str, tuple[int, ...]] | None, library: str) -> None:
    """A library runs at the shapes it was built for: ``--input-shape`` must name those."""
    built = {i["name"]: tuple(i["shape"]) for i in meta["inputs"]}
    for name, dims in (shapes or {}).items():
        if name not in built:
            raise AutofuseError(f"--input-shape names {name!r}, not an input of {library} (its inputs: "
                                f"{', '.join(built) or 'none'})")
        if dims != built[name]:
            raise AutofuseError(f"{library} was built for {name}={'x'.join(map(str, built[name]))}, not "
                                f"{'x'.join(map(str, dims))}: build another with autofuse build --input-shape "
                                f"{name}={'x'.join(map(str, dims))}")


def run_library(library: str, inputs_path: str | None, seed: int = 0,
                input_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    meta_path = library + ".json"
    if not os.path.exists(library):
        raise AutofuseError(f"library {library} does not exist")
    if not os.path.exists(meta_path):
        raise AutofuseError(f"{meta_path} is missing: build the library with `autofuse build`")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    _check_built_shapes(meta, input_shapes, library)
    feeds = load_inputs(meta, inputs_path, seed)
    try:
        with model_build.native_stderr_silenced():  # TVM logs a "Scope Loaded" warning per constant scope
            lib = tvm.runtime.load_module(library)
    except Exception as err:
        raise AutofuseError(f"cannot load {library}: {str(err).strip().splitlines()[0]}") from None
    target = Target(json.loads(meta["target"])) if meta["target"].startswith("{") else Target(meta["target"])
    outputs = model_build.run_vm(lib, list(feeds.values()), device_for(target))
    names = meta.get("outputs") or [f"output{i}" for i in range(len(outputs))]
    return meta, dict(zip(names, outputs))
