"""Our patterns against GPU baselines on one machine, written to one JSON file.

    python benchmarks/gpu.py [--patterns all|a,b] [--trials 0] [--repeat 50] [--dtype float32]
                             [--budget-secs 500] [--out gpu.json] [--device cuda] [--small]

For each pattern (default shape; ``--small``: small shape) the numpy reference is computed once on
the pattern's seeded inputs; then each contender of ``CONTENDERS`` is built, run once, checked
against the reference at the pattern's tolerance and timed, whatever the check said (a
half-precision ONNX graph rounds every intermediate and may miss a tolerance set for a fused
kernel: its row says ``invalid`` but keeps its timing). A contender that cannot run says why
(``unavailable``); one that fails records ``error`` and the run goes on. The JSON is rewritten after
every pattern, so a cut run keeps what it has; no new pattern starts once ``--budget-secs`` is spent.

Timing (CUDA): each call alone, after a 256 MiB write that evicts the last call's data from L2,
bracketed by torch CUDA events on torch's current stream, where TVM's kernels run too (tvm_ffi's
stream context). XLA runs on streams of its own, so its calls are bracketed the same way but
synchronously (the flush completed first): that figure includes jax's dispatch and the wait. A
second figure, ``batched_ms``, is the wall-clock of ``--repeat`` back-to-back calls without flushing,
the same for all. ``--device cpu`` runs the same plumbing on this machine (llvm target, CPU torch and
jax, wall-clock per call, no flush, no roofline), for testing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# torch, jax and TVM share the GPU: jax must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from autofuse.baselines import Unavailable  # noqa: E402
from autofuse.errors import AutofuseError  # noqa: E402

SCHEMA = "autofuse.gpu/1"
FLUSH_BYTES = 256 << 20
WARMUP = 3


@dataclasses.dataclass
class Env:
    device: str                 # "cuda" or "cpu"
    target: object              # TVM target: the h200 dict, or this CPU
    tvm_dev: object
    trials: int
    repeat: int
    work: str                   # ONNX files and the tuning database of this run

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclasses.dataclass
class Case:
    """One pattern at one shape and dtype: inputs, ONNX graph and reference, shared by all contenders."""
    pattern: object
    shape: dict
    dtype: str
    subject: object             # autofuse.baselines.Subject: inputs, onnx_path, flops, bytes, tolerance
    reference: list

    @property
    def inputs(self) -> list:
        return self.subject.inputs

    def onnx_model(self):
        import onnx
        return onnx.load(self.subject.onnx_path)


@dataclasses.dataclass
class Run:
    """A prepared contender: ``launch`` starts one run (it may return before the device is done),
    ``wait`` blocks until it is, ``outputs`` reads the last run's outputs as numpy."""
    launch: Callable[[], None]
    wait: Callable[[], None]
    outputs: Callable[[], list]
    same_stream: bool = True    # the work runs on torch's current stream, so events bracket it
    info: dict = dataclasses.field(default_factory=dict)


# --- contenders ----------------------------------------------------------------------------------

def _sync(env: Env) -> Callable[[], None]:
    if not env.cuda:
        return lambda: None
    import torch
    return torch.cuda.synchronize


def autofuse(case: Case, env: Env) -> Run:
    """autofuse: the pattern's TensorIR under its first template for the target with fixed knobs
    (dlight's rules where the pattern has no GPU template); with --trials, the best checked record
    when it beats that default."""
    import tvm

    from autofuse.measure import empty_outputs, to_device
    from autofuse.tune_patterns import Job

    job = Job(case.pattern, case.shape, case.dtype)
    templates = case.pattern.templates_for(env.target)
    if not templates:
        raise Unavailable(f"no template applies on target {env.target.kind.name}")
    try:
        default = templates[0].apply(job.func, env.target, tunable=False)
    except ValueError as err:  # dlight with no rule for this TensorIR
        raise Unavailable(f"template {templates[0].name}: {err}") from None
    mod, info = default.mod, {"template": templates[0].name, "source": "template-default"}
    if env.trials > 0:
        mod, info = _tuned(job, env, templates, mod, info)
    rt = tvm.tirx.build(mod, target=env.target)
    args = to_device(case.inputs, env.tvm_dev)
    outs = empty_outputs(case.pattern.output_specs(job.func), env.tvm_dev)
    return Run(lambda: rt(*args, *outs), _sync(env), lambda: [o.numpy() for o in outs], info=info)


def _tuned(job, env: Env, templates, default_mod, info: dict):
    """--trials N of the union space into this run's database, then the faster of the best
    checked record and the template default (``tune_patterns.choose``)."""
    from autofuse.database import TuningDatabase
    from autofuse.tune import Task, tune
    from autofuse.tune_patterns import choose

    db = TuningDatabase(os.path.join(env.work, "db"), env.target)
    start = time.perf_counter()
    stats = tune([Task(job.label, job.func, templates)], env.target, db.ms, db.work_dir,
                 trials_per_task=env.trials, space="union", seed=0, cost_model_path=db.cost_model_path)
    choice, rejected = choose(job, db, env.target, env.tvm_dev)
    tuned = {"trials": stats.total_trials, "failed_trials": sum(stats.failed.values()),
             "tune_secs": time.perf_counter() - start, "rejected": rejected}
    if choice is None:
        return default_mod, {**info, **tuned}
    return choice.mod, {**info, **tuned, "source": choice.source}


def tvm_untuned(case: Case, env: Env) -> Run:
    """tvm-untuned: the ONNX graph through Relax, one kernel per op (LegalizeOps, no FuseOps),
    dlight's default GPU schedules (TVM's own CPU lowering on llvm)."""
    return _relax(case, env, "none")


def tvm_auto(case: Case, env: Env) -> Run:
    """tvm-auto: the ONNX graph through Relax with TVM's auto-fusion (FuseOps + FuseTIR), dlight's
    default GPU schedules (TVM's own CPU lowering on llvm); untuned."""
    return _relax(case, env, "auto")


def _relax(case: Case, env: Env, fusion: str) -> Run:
    import tvm
    from tvm import relax

    from autofuse.model import build as model_build

    executable, kernels = relax_executable(case, env, fusion)
    main = relax.VirtualMachine(executable, env.tvm_dev)["main"]
    args = [tvm.runtime.tensor(x, env.tvm_dev) for x in case.inputs]
    last = {}

    def launch():
        last["out"] = main(*args)

    return Run(launch, _sync(env), lambda: model_build._flatten(last["out"]), info={"kernels": kernels})


def relax_executable(case: Case, env: Env, fusion: str):
    """The ONNX graph lowered in autofuse's ``fusion`` mode (``model.fusion``), dlight-scheduled on
    a GPU, built; with its number of kernels."""
    import tvm
    from tvm import relax

    from autofuse.model.fusion import fuse
    from autofuse.model.importer import to_relax

    backend = relax.backend.cuda.pipeline if env.cuda else relax.backend.cpu_generic.pipeline
    with env.target:
        # Sort, scan and top-k get the backend's own kernels before the generic legalization.
        mod = tvm.transform.Sequential(backend.library_dispatch_passes(env.target))(
            to_relax(case.onnx_model(), case.pattern.name))
    mod, _ = fuse(mod, fusion)
    if env.cuda:
        mod = _dlight_kernels(mod, env.target)
    # The backend's pipeline less its legalization, which would fuse the "none" module again.
    passes = backend.dataflow_lower_passes(env.target) + backend.finalize_passes(env.target)
    with env.target, tvm.transform.PassContext(opt_level=3):
        executable = relax.build(mod, target=env.target, relax_pipeline=tvm.transform.Sequential(passes))
    return executable, sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items())


def _dlight_kernels(mod, target):
    """Every kernel not yet scheduled under dlight's GPU rules (the ``DLIGHT`` template)."""
    import tvm

    from autofuse.pattern import DLIGHT

    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tvm.tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled")):
            continue
        try:
            sch = DLIGHT.apply(func, target, tunable=False)
        except Exception as err:  # no rule applies, or TIR without blocks (an opaque legalization)
            lines = [line for line in str(err).splitlines() if line.strip()]
            raise Unavailable(f"dlight cannot schedule kernel {gv.name_hint}: {lines[-1].strip() if lines else err}") from None
        mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return mod


def torch_eager(case: Case, env: Env) -> Run:
    """torch-eager: the ONNX graph as torch ops (onnx_to_torch), eager."""
    return _torch(case, env, compiled=False)


def torch_compile(case: Case, env: Env) -> Run:
    """torch-compile: the same torch function under torch.compile (inductor, default mode); its
    compile time is the first call's."""
    return _torch(case, env, compiled=True)


def _torch(case: Case, env: Env, compiled: bool) -> Run:
    torch = _import("torch")
    from autofuse.baselines.onnx_to_torch import to_torch, torch_function

    try:
        fn = torch_function(case.onnx_model(), env.device)
    except AutofuseError as err:
        raise Unavailable(str(err)) from None
    if compiled:
        torch._dynamo.reset()  # every graph's function is the same Python code: no stale guards
        fn = torch.compile(fn)
    args = [to_torch(x, env.device) for x in case.inputs]
    return _torch_run(lambda: fn(*args), env, {"version": torch.__version__})


def _torch_run(call, env: Env, info: dict) -> Run:
    from autofuse.baselines.onnx_to_torch import to_numpy

    last = {}

    def launch():
        last["out"] = call()

    return Run(launch, _sync(env), lambda: [to_numpy(t) for t in last["out"]], info=info)


def xla(case: Case, env: Env) -> Run:
    """xla-gpu: the ONNX graph as a JAX function (onnx_to_jax) under jax.jit on the device (float32
    matmuls at 'highest' precision, no TF32)."""
    jax = _import("jax")
    from autofuse.baselines.onnx_to_jax import jax_function

    platforms = ("gpu", "cuda") if env.cuda else ("cpu",)
    devices = [d for d in jax.devices() if d.platform in platforms] if env.cuda else jax.devices("cpu")
    if not devices:
        raise Unavailable(f"jax sees no {env.device} device (has: {', '.join(d.platform for d in jax.devices())})")
    try:
        fn = jax.jit(jax_function(case.onnx_model()))
    except AutofuseError as err:
        raise Unavailable(str(err)) from None
    args = [jax.device_put(x, devices[0]) for x in case.inputs]
    last = {}

    def launch():
        last["out"] = fn(*args)

    return Run(launch, lambda: jax.block_until_ready(last["out"]), lambda: [np.asarray(o) for o in last["out"]],
               same_stream=False, info={"version": jax.__version__, "device": str(devices[0])})


def torch_sdpa(case: Case, env: Env) -> Run:
    """torch-sdpa: torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient
    kernels), for the attention patterns it expresses."""
    torch = _import("torch")
    from autofuse.baselines.onnx_to_torch import to_torch

    adapter = SDPA.get(case.pattern.name)
    if adapter is None:
        raise Unavailable(f"no scaled_dot_product_attention form of {case.pattern.name}")
    args = [to_torch(x, env.device) for x in case.inputs]
    return _torch_run(lambda: adapter(torch, case.shape, *args), env, {"version": torch.__version__})


def _sdpa_flash(torch, shape, q, k, v):
    sq, skv = shape["seq_q"], shape["seq_kv"]
    mask, causal = None, bool(shape.get("causal", 0))
    if causal and sq != skv:  # the pattern aligns the causal mask at the end; torch's is_causal at the start
        from torch.nn.attention.bias import causal_lower_right
        mask, causal = causal_lower_right(sq, skv), False
    gqa = shape["kv_heads"] != shape["heads"]
    return [torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                             enable_gqa=gqa)]


def _sdpa_cross(torch, shape, q, k, v):
    return [torch.nn.functional.scaled_dot_product_attention(q, k, v)]


def _sdpa_gqa_decode(torch, shape, q, k_new, v_new, k_cache, v_cache):
    # The pattern's caches are outputs: copied with the new row at cache_len, then attended.
    length = shape["cache_len"]
    k_out, v_out = k_cache.clone(), v_cache.clone()
    k_out[:, :, length] = k_new
    v_out[:, :, length] = v_new
    o = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k_out[:, :, :length + 1], v_out[:, :, :length + 1],
        enable_gqa=shape["num_heads"] != shape["num_kv_heads"])
    return [o.squeeze(2), k_out, v_out]


# Pattern name -> fn(torch, shape, *inputs) -> outputs, in the pattern's input and output order.
SDPA = {"flash_attention": _sdpa_flash, "cross_attention": _sdpa_cross, "gqa_decode_attention": _sdpa_gqa_decode}

CONTENDERS: dict[str, Callable[[Case, Env], Run]] = {
    "autofuse": autofuse, "tvm-untuned": tvm_untuned, "tvm-auto": tvm_auto, "torch-eager": torch_eager,
    "torch-compile": torch_compile, "xla-gpu": xla, "torch-sdpa": torch_sdpa,
}


def _import(name: str):
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        raise Unavailable(f"{name} is not installed") from None


# --- timing --------------------------------------------------------------------------------------

class CudaTimer:
    def __init__(self):
        import torch
        self.torch = torch
        self.scratch = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")

    def per_call(self, run: Run, repeat: int) -> list[float]:
        torch = self.torch
        events = []
        for _ in range(repeat):
            self.scratch.zero_()  # evicts the last call's data from L2
            if not run.same_stream:
                torch.cuda.synchronize()  # its stream would not wait for the flush
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run.launch()
            if not run.same_stream:
                run.wait()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]

    def batched(self, run: Run, repeat: int) -> float:
        self.torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            run.launch()
        run.wait()
        self.torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeat


class CpuTimer:
    def per_call(self, run: Run, repeat: int) -> list[float]:
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            run.launch()
            run.wait()
            samples.append(time.perf_counter() - start)
        return samples

    def batched(self, run: Run, repeat: int) -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            run.launch()
        run.wait()
        return (time.perf_counter() - start) / repeat


# --- one pattern ---------------------------------------------------------------------------------

def make_case(pattern, shape: dict, dtype: str, env: Env) -> Case:
    from autofuse.compare import pattern_subject

    subject = pattern_subject(pattern, shape, dtype, os.path.join(env.work, "graphs"))
    return Case(pattern, shape, dtype, subject, pattern.run_reference(subject.inputs, shape))


def measure(name: str, case: Case, env: Env, timer, machine) -> dict:
    """One contender on one case: prepared, checked, timed; failures become the row's status."""
    from autofuse.verify import compare

    row = {"description": " ".join(CONTENDERS[name].__doc__.split())}
    try:
        start = time.perf_counter()
        run = CONTENDERS[name](case, env)
        row["build_secs"] = time.perf_counter() - start
        start = time.perf_counter()
        run.launch()
        run.wait()
        row["first_call_secs"] = time.perf_counter() - start  # torch.compile's and XLA's compile time
        outputs = run.outputs()
    except Unavailable as err:
        return {**row, "status": "unavailable", "reason": str(err)}
    except Exception as err:  # a contender's failure is its row, never the run's end
        return {**row, **_error(err)}
    row["info"] = run.info
    check = compare(outputs, case.reference, *case.subject.tolerance)
    row.update(ok=check.ok, max_abs_err=check.max_abs_err, check=check.message or None)
    try:
        for _ in range(WARMUP):
            run.launch()
            run.wait()
        samples = timer.per_call(run, env.repeat)
        batched = timer.batched(run, env.repeat)
    except Exception as err:
        return {**row, **_error(err)}
    median = float(np.median(samples))
    row.update(status="ok" if check.ok else "invalid", median_ms=median * 1e3,
               p10_ms=float(np.percentile(samples, 10)) * 1e3, p90_ms=float(np.percentile(samples, 90)) * 1e3,
               batched_ms=batched * 1e3, timing="events" if env.cuda and run.same_stream else
               ("events around a synchronous call" if env.cuda else "wall-clock"),
               **figures(case, median, machine))
    return row


def _error(err: BaseException) -> dict:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return {"status": "error", "error": f"{type(err).__name__}: {lines[0][:300] if lines else ''}".rstrip(": "),
            "traceback": traceback.format_exc(limit=-6)[-3000:]}


def figures(case: Case, secs: float, machine) -> dict:
    flops, nbytes = case.subject.flops, case.subject.bytes
    out = {"gflops": flops / secs / 1e9 if flops else None, "gbps": nbytes / secs / 1e9 if nbytes else None}
    if machine is not None and secs > 0:
        from autofuse.roofline import Machine, point

        peak = machine["fp32_gflops"] if case.dtype == "float32" else machine["bf16_gemm_gflops"]
        roof = Machine(machine["copy_gbps"], peak, machine["copy_method"], machine["peak_method"], 0)
        bound = point(flops, nbytes, secs, roof)
        out.update(pct_copy_bw=100.0 * out["gbps"] / machine["copy_gbps"] if out["gbps"] else None,
                   intensity=bound["intensity"], roofline_pct=bound["roofline_pct"])
    return out


def shapes_by_pattern(items: list[str] | None) -> dict[str, dict[str, str]]:
    """``--shape softmax_dropout:rows=8192,cols=4096`` (repeatable) as {pattern: overrides}."""
    from autofuse.cli import _shape_overrides

    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        name, sep, rest = item.partition(":")
        if not sep or not name:
            raise AutofuseError(f"--shape expects PATTERN:key=value[,key=value], got {item!r}")
        out.setdefault(name.strip(), {}).update(_shape_overrides([rest]))
    return out


def run_pattern(pattern, args, env: Env, timer, machine, names: list[str], log) -> dict:
    shape = pattern.resolve_shape(args.shapes.get(pattern.name), "small" if args.small else "default")
    entry = {"shape": shape, "dtype": args.dtype, "flops": pattern.flops(shape),
             "bytes": pattern.bytes(shape, args.dtype), "tolerance": list(pattern.tolerance_for(args.dtype))}
    if args.dtype not in pattern.dtypes:
        return {**entry, "skipped": f"dtype {args.dtype} not supported (has {', '.join(pattern.dtypes)})"}
    start = time.perf_counter()
    try:
        case = make_case(pattern, shape, args.dtype, env)
    except Exception as err:  # its ONNX graph or reference: nothing to compare against
        return {**entry, **_error(err)}
    entry["reference_secs"] = time.perf_counter() - start
    entry["contenders"] = {}
    for name in names:
        log(f"{pattern.name}: {name}")
        entry["contenders"][name] = measure(name, case, env, timer, machine)
        _free(env)
    return entry


def _free(env: Env) -> None:
    import gc
    gc.collect()
    if env.cuda:
        import torch
        torch.cuda.empty_cache()


# --- the machine -----------------------------------------------------------------------------------

def measure_machine() -> dict:
    """Copy bandwidth (1 GiB device to device, read + written), fp32 FMA peak (8192^3 matmul, TF32
    off) and bf16 GEMM peak (8192^3), each the median of 10 runs timed with CUDA events."""
    import torch

    def median_secs(call, n=10):
        call()
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    size = 1 << 30
    src = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * size / median_secs(lambda: dst.copy_(src)) / 1e9
    del src, dst
    n = 8192
    gemms = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device="cuda").to(dtype)
        b = torch.randn(n, n, device="cuda").to(dtype)
        gemms[dtype] = 2 * n ** 3 / median_secs(lambda: torch.matmul(a, b), n=5) / 1e9
        del a, b
    torch.cuda.empty_cache()
    return {"copy_gbps": copy, "fp32_gflops": gemms[torch.float32], "bf16_gemm_gflops": gemms[torch.bfloat16],
            "copy_method": "torch copy_ of 1 GiB float32, device to device, 2 GiB moved, median of 10",
            "peak_method": "torch.matmul 8192^3, fp32 with TF32 off / bf16, median of 5"}


def versions(env: Env) -> dict:
    import subprocess

    import tvm
    out = {"python": platform.python_version(), "numpy": np.__version__, "tvm": tvm.__version__}
    # A snapshot run elsewhere (git archive) names its commit; otherwise the checkout measured.
    out["commit"] = os.environ.get("AUTOFUSE_COMMIT")
    try:
        out["commit"] = out["commit"] or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    for name in ("torch", "jax", "jaxlib", "onnx", "onnxruntime", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed, or broken: the JSON says so
            out[name] = None
    if env.cuda:
        import torch
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=props.total_memory / 2 ** 30,
                   compute_capability=f"{props.major}.{props.minor}", torch_cuda=torch.version.cuda)
    else:
        out["cpu"] = platform.processor() or platform.machine()
    return out


def setup(device: str) -> tuple[object, object]:
    """The TVM target and device; on CUDA, fp32 means fp32 for every contender (no TF32)."""
    import tvm

    from autofuse.target import parse_target

    if device == "cpu":
        return parse_target("llvm"), tvm.cpu()
    import torch
    if not torch.cuda.is_available():
        raise AutofuseError("--device cuda: torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
    except ImportError:
        pass
    return parse_target("h200"), tvm.cuda(0)


NOTES = {
    "cuda": [
        "median_ms: each call alone, after a 256 MiB write that evicts L2, timed with torch CUDA events on "
        "torch's current stream; TVM's kernels run on that stream too (tvm_ffi.use_torch_stream)",
        "xla-gpu runs on streams of its own: its calls are bracketed by the same events but synchronously "
        "(flush completed first), so its median_ms includes jax's dispatch and the wait",
        "batched_ms: wall-clock of --repeat back-to-back calls without flushing, per call, for every contender",
        "float32 is float32 everywhere: torch TF32 off (matmul and cuDNN), jax matmul precision 'highest'",
        "tvm-untuned: Relax LegalizeOps, one kernel per op; tvm-auto: FuseOps + FuseTIR; both with dlight's GPU "
        "rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback: the first that applies), untuned",
        "roofline_pct: against min(peak, intensity x copy bandwidth); peak is the fp32 matmul figure for "
        "float32, the bf16 GEMM figure otherwise",
    ],
    "cpu": ["--device cpu: a plumbing test; wall-clock per call, no L2 flush, no roofline; the runtimes' "
            "thread pools (TVM, OpenMP, XLA) compete for the cores, so the figures are not a CPU comparison"],
}


def table(report: dict, names: list[str]) -> str:
    lines = ["| pattern | " + " | ".join(names) + " | best baseline / autofuse |",
             "|---" * (len(names) + 2) + "|"]
    for pattern, entry in report["patterns"].items():
        rows = entry.get("contenders", {})
        cells = [_cell(rows.get(n)) for n in names]
        ours = (rows.get("autofuse") or {}).get("median_ms")
        baselines = [r["median_ms"] for n, r in rows.items() if n != "autofuse" and r.get("status") == "ok"]
        ratio = f"{min(baselines) / ours:.2f}" if ours and baselines else "-"
        lines.append(f"| {pattern} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def _cell(row: dict | None) -> str:
    if not row:
        return "-"
    if row.get("median_ms") is not None:
        return f"{row['median_ms']:.4f}" + ("" if row["status"] == "ok" else " (invalid)")
    return {"unavailable": "n/a", "error": "error"}.get(row.get("status"), "-")


def write_json(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default="all", help="'all' or comma-separated pattern names")
    parser.add_argument("--contenders", default="all", help=f"'all' or some of {', '.join(CONTENDERS)}")
    parser.add_argument("--trials", type=int, default=0, help="tune ours first (union space), per pattern")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget-secs", type=float, default=500.0, help="no new pattern starts after this")
    parser.add_argument("--out", default="gpu.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes (plumbing tests)")
    parser.add_argument("--shape", action="append", metavar="PATTERN:K=V,...",
                        help="override shape parameters of one pattern (repeatable), e.g. softmax_dropout:rows=8192")
    args = parser.parse_args(argv)

    from autofuse.registry import resolve_patterns

    started = time.perf_counter()
    names = list(CONTENDERS) if args.contenders == "all" else [n.strip() for n in args.contenders.split(",")]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}")
    try:
        patterns = resolve_patterns(args.patterns)
        args.shapes = shapes_by_pattern(args.shape)
        for pattern in patterns:  # a bad override stops the run before anything is measured
            pattern.resolve_shape(args.shapes.get(pattern.name))
        target, tvm_dev = setup(args.device)
    except AutofuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="autofuse-gpu-") as work, contextlib.ExitStack() as stack:
        env = Env(args.device, target, tvm_dev, args.trials, args.repeat, work)
        report = {"schema": SCHEMA, "device": args.device, "target": str(target), "args": vars(args),
                  "versions": versions(env), "notes": NOTES[args.device], "machine": None, "patterns": {},
                  "not_started": []}
        if env.cuda:
            import tvm_ffi
            stack.enter_context(tvm_ffi.use_torch_stream())
            log("measuring the machine")
            report["machine"] = measure_machine()
        timer = CudaTimer() if env.cuda else CpuTimer()
        for pattern in patterns:
            if time.perf_counter() - started > args.budget_secs:
                report["not_started"].append(pattern.name)
                continue
            report["patterns"][pattern.name] = run_pattern(pattern, args, env, timer, report["machine"], names, log)
            report["secs"] = time.perf_counter() - started
            write_json(args.out, report)
        report["secs"] = time.perf_counter() - started
        write_json(args.out, report)
    print(table(report, names))
    if report["not_started"]:
        print(f"budget spent: not started {', '.join(report['not_started'])}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
