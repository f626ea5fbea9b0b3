"""Our Hopper wgmma GEMM kernels (search_spaces/lib/cuda_wgmma.py) against cuBLAS and torch.compile.

    source /opt/autofuse-gpu/env.sh && python benchmarks/gpu_gemm.py --commit SHA [--out PATH]
        [--budget-secs 500] [--repeat 50] [--cases NAME,...] [--knobs JSON]
    python benchmarks/gpu_gemm.py --dry-run [--out PATH] [--knobs JSON]   # no GPU: build every config's source, exit

Cases: linear_bias_relu, y = relu(x @ W^T + b), in float16 and bfloat16 at (m, n, k) in ``SHAPES``;
then, budget permitting, the SwiGLU pair y = silu(x @ Wg^T) * (x @ Wu^T) at ``SWIGLU_SHAPES``.
Inputs: x ~ N(0, 1), W ~ N(0, 1/k), b ~ N(0, 1), drawn in float32 on the GPU (seed 0) and cast.

Per case: the reference is the float32 computation (TF32 off) from the same half-precision inputs;
error = max|got - ref| / max|ref|. torch eager (``torch.relu(torch.addmm(b, x, W.t()))``: cuBLAS)
sets the bar: a contender is valid when its error is at most ``ERROR_FACTOR`` x eager's. Then
torch.compile of the same function (default mode, dynamic=False, dynamo reset per case; its first
call's time is its compile time), then each knob configuration of our kernel: built, run once on
NaN-filled outputs, checked, and timed when valid. float16 cases sweep ``sweep_configs``; a
bfloat16 case (the same kernel with bf16 MMAs) runs the default plus the ``BF16_FROM_FP16`` fastest
valid configurations of its float16 case. With ``--knobs`` every case runs its default and then
exactly the configurations given instead: a JSON list of knob objects, or one object whose values
are lists (their product), each over the case's default knobs; those the case's shape or shared
memory refuses are listed in its ``refused``. A case's default is what the pattern would run there:
``cuda_wgmma.fill_tile`` of ``DEFAULT_KNOBS`` (``SWIGLU_DEFAULT_KNOBS`` for the pair), a smaller tile
where the default's would leave SMs idle (m = 128). pct_of_cublas = 100 x (faster of torch eager and
torch.compile, whatever compile's check said) / our best valid time.

Timing: each call alone after a 256 MiB write that evicts L2, bracketed by CUDA events on torch's
current stream (TVM's kernels run on it too: tvm_ffi.use_torch_stream); median of --repeat calls,
samples kept. ``batched_ms``: events around --repeat back-to-back calls without flushing, per call.
TFLOP/s counts 2mnk per GEMM (the epilogue's flops are not counted).

Budget: no case starts once --budget-secs is spent, and each case stops starting configurations
once its share of what was left is spent (the default always runs), so later cases keep their
time. The JSON (--out) is rewritten after every configuration, naming the one about to run, and a
step that hangs (a kernel that never finishes) ends the process after ``HANG_SECS`` with a Python
traceback on stderr, so a cut run keeps all it measured.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

STARTED = time.perf_counter()  # the budget counts imports too
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from search_spaces.lib import cuda_wgmma  # noqa: E402

SCHEMA = "autofuse.gpu_gemm_wgmma/1"
DEFAULT_OUT = os.path.join("benchmarks", "results", "h200", "gemm-wgmma.json")
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (128, 4096, 4096), (1024, 4096, 4096),
          (4096, 11008, 4096), (4096, 4096, 11008)]
SWIGLU_SHAPES = [(4096, 11008, 4096)]
DTYPES = ("float16", "bfloat16")
DRY_RUN_SHAPE = (256, 512, 256)
FLUSH_BYTES = 256 << 20
WARMUP = 3
ERROR_FACTOR = 2.0
BF16_FROM_FP16 = 3
# the SwiGLU pair's default, then variants of the one-role kernel in the 2-D grid's order
ONE_ROLE = {"specialised": 0, "raster": 1}
SWIGLU_VARIANTS = [{}, {**ONE_ROLE, "stages": 3}, {**ONE_ROLE, "warpgroups": 1, "stages": 5}, {**ONE_ROLE, "wait_depth": 0}]
HANG_SECS = {"ours": 90, "torch": 240}
# Budget weight of a case, in configurations (baselines count as a few).
BASELINE_WEIGHT = 4
SM_COUNT = 132  # H200


# --- cases and configurations ---------------------------------------------------------------------

def sweep_configs(m: int, n: int, k: int, dtype: str) -> list[dict]:
    """float16 sweep of the one-role kernel in the 2-D grid's order: block_n x warpgroups x stages
    3-5 with wait depth 1 (measured better than 0 at 4096^3), plus wait depth 0 at the two
    2-warpgroup 4-stage tiles; only configurations that fit the shape and shared memory. Most
    promising first, as a case's budget may cut the tail: the default (whatever its layout), then
    wait depth 1, grids that fill more of the H200's 132 SMs, larger tiles, 4 stages before 3 and 5."""
    shape = {"m": m, "n": n, "k": k}
    # the one-role kernel in the default launch order (--knobs times the others)
    space = {**cuda_wgmma.KNOBS, "block_n": (128, 256), "stages": (3, 4, 5), "wait_depth": (1,),
             **{name: (value,) for name, value in ONE_ROLE.items()}}
    wanted = cuda_wgmma.configs(shape, dtype, space)
    for block_n in (256, 128):
        knobs = {**cuda_wgmma.DEFAULT_KNOBS, **ONE_ROLE, "block_n": block_n, "wait_depth": 0}
        try:
            cuda_wgmma.check(shape, dtype, knobs)
        except ValueError:
            continue
        wanted.append(knobs)

    def promise(knobs):
        bm, bn, _ = cuda_wgmma.tile_shape(knobs)
        ctas = (m // bm) * (n // bn)
        return (-knobs["wait_depth"], -min(ctas, SM_COUNT), -bm * bn, abs(knobs["stages"] - 4), knobs["stages"])

    default = cuda_wgmma.fill_tile(shape, dtype)
    rest = sorted((knobs for knobs in wanted if knobs != default), key=promise)
    try:
        cuda_wgmma.check(shape, dtype, default)
    except ValueError:
        return rest
    return [default, *rest]


def config_name(knobs: dict) -> str:
    """BN.._WG.._S.._BK.._W.., then _WS1 for the warp-specialised kernel and _R<n> for a grouped
    launch order (the names of the one-role kernel in row order are those of earlier reports)."""
    return (f"BN{knobs['block_n']}_WG{knobs['warpgroups']}_S{knobs['stages']}_BK{knobs['block_k']}"
            f"_W{knobs['wait_depth']}" + ("_WS1" if knobs.get("specialised") else "")
            + (f"_R{knobs['raster']}" if knobs.get("raster", 1) != 1 else ""))


def parse_knobs(text: str) -> list[dict]:
    """--knobs: a JSON list of knob objects, or one object of value lists (their product), every
    name one of ``cuda_wgmma.KNOBS``; ValueError otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--knobs is not JSON: {err}") from None
    if isinstance(value, dict):
        lists = [v if isinstance(v, list) else [v] for v in value.values()]
        value = [dict(zip(value, combo)) for combo in itertools.product(*lists)]
    if not isinstance(value, list) or not value or not all(isinstance(k, dict) for k in value):
        raise ValueError("--knobs takes a JSON list of knob objects or one object of value lists")
    for knobs in value:
        unknown = sorted(set(knobs) - set(cuda_wgmma.KNOBS))
        if unknown:
            raise ValueError(f"--knobs: unknown knob(s) {', '.join(unknown)}; knobs are {', '.join(cuda_wgmma.KNOBS)}")
    return value


def explicit_configs(case: dict, explicit: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the case's default and then each of ``explicit`` over it that the shape takes, once each;
    the refused ones with the reason)."""
    swiglu = case["kind"] == "swiglu"
    space, default = ((cuda_wgmma.SWIGLU_KNOBS, cuda_wgmma.SWIGLU_DEFAULT_KNOBS) if swiglu
                      else (cuda_wgmma.KNOBS, cuda_wgmma.DEFAULT_KNOBS))
    shape = {"m": case["m"], "n": case["n"], "k": case["k"]}
    default = cuda_wgmma.fill_tile(shape, case["dtype"], space, default, weights=2 if swiglu else 1)
    out, refused = [], []
    for knobs in [{}, *explicit]:
        full = {**default, **knobs}
        try:
            cuda_wgmma.check(shape, case["dtype"], full, space=space, default=default, weights=2 if swiglu else 1)
        except ValueError as err:
            refused.append({"knobs": full, "reason": str(err)})
            continue
        if full not in out:
            out.append(full)
    return out, refused


def case_name(kind: str, dtype: str, m: int, n: int, k: int) -> str:
    return f"{kind}-{dtype}-{m}x{n}x{k}"


def all_cases() -> list[dict]:
    cases = []
    for m, n, k in SHAPES:
        for dtype in DTYPES:
            cases.append({"kind": "linear_bias_relu", "dtype": dtype, "m": m, "n": n, "k": k})
    for m, n, k in SWIGLU_SHAPES:
        for dtype in DTYPES:
            cases.append({"kind": "swiglu", "dtype": dtype, "m": m, "n": n, "k": k})
    for case in cases:
        case["name"] = case_name(case["kind"], case["dtype"], case["m"], case["n"], case["k"])
    return cases


def case_configs(case: dict, report: dict, explicit: list[dict] | None = None) -> list[dict]:
    """The configurations a case runs, in order (a bfloat16 case reads its float16 case's results;
    with ``explicit``, the parsed --knobs, those of ``explicit_configs``)."""
    if explicit is not None:
        return explicit_configs(case, explicit)[0]
    m, n, k, dtype = case["m"], case["n"], case["k"], case["dtype"]
    if case["kind"] == "swiglu":
        out = []
        for variant in SWIGLU_VARIANTS:
            knobs = {**cuda_wgmma.SWIGLU_DEFAULT_KNOBS, **variant}
            try:
                cuda_wgmma.check({"m": m, "n": n, "k": k}, dtype, knobs, space=cuda_wgmma.SWIGLU_KNOBS,
                                 default=cuda_wgmma.SWIGLU_DEFAULT_KNOBS, weights=2)
            except ValueError:
                continue
            out.append(knobs)
        return out
    sweep = sweep_configs(m, n, k, dtype)
    if dtype == "float16":
        return sweep
    fp16 = report["cases"].get(case_name(case["kind"], "float16", m, n, k))
    if not fp16:
        return sweep
    ranked = sorted((row for row in fp16["configs"] if row.get("valid") and row.get("median_ms")),
                    key=lambda row: row["median_ms"])
    out = [cuda_wgmma.fill_tile({"m": m, "n": n, "k": k}, dtype)]
    for row in ranked:
        if len(out) > BF16_FROM_FP16:
            break
        if row["knobs"] not in out:
            out.append(dict(row["knobs"]))
    return out


def case_weight(case: dict, explicit: list[dict] | None = None) -> int:
    if explicit is not None:
        return len(explicit_configs(case, explicit)[0]) + BASELINE_WEIGHT
    if case["kind"] == "swiglu":
        return len(SWIGLU_VARIANTS) + BASELINE_WEIGHT
    if case["dtype"] == "bfloat16":
        return 1 + BF16_FROM_FP16 + BASELINE_WEIGHT
    return len(sweep_configs(case["m"], case["n"], case["k"], case["dtype"])) + BASELINE_WEIGHT


def kernel(case: dict, knobs: dict):
    shape = {"m": case["m"], "n": case["n"], "k": case["k"]}
    if case["kind"] == "swiglu":
        return cuda_wgmma.swiglu(shape, case["dtype"], knobs)
    return cuda_wgmma.gemm_bias_act(shape, case["dtype"], knobs, "relu")


def case_flop(case: dict) -> float:
    gemms = 2 if case["kind"] == "swiglu" else 1
    return 2.0 * gemms * case["m"] * case["n"] * case["k"]


# --- on the GPU --------------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, repeat: int):
        self.torch = torch
        self.repeat = repeat
        self.scratch = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")

    def measure(self, call, flop: float) -> dict:
        torch = self.torch
        for _ in range(WARMUP):
            call()
        events = []
        for _ in range(self.repeat):
            self.scratch.zero_()  # evicts the last call's data from L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        samples = [start.elapsed_time(end) for start, end in events]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.repeat):
            call()
        end.record()
        torch.cuda.synchronize()
        batched = start.elapsed_time(end) / self.repeat
        median = statistics.median(samples)
        ordered = sorted(samples)
        return {"median_ms": median, "tflops": flop / (median * 1e-3) / 1e12,
                "p10_ms": ordered[len(ordered) // 10], "p90_ms": ordered[(len(ordered) * 9) // 10],
                "batched_ms": batched, "batched_tflops": flop / (batched * 1e-3) / 1e12,
                "samples_ms": samples}


def make_inputs(torch, case: dict) -> dict:
    m, n, k = case["m"], case["n"], case["k"]
    dt = getattr(torch, case["dtype"])
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    x = draw(m, k)
    if case["kind"] == "swiglu":
        return {"x": x, "wg": draw(n, k, scale=k ** -0.5), "wu": draw(n, k, scale=k ** -0.5)}
    return {"x": x, "w": draw(n, k, scale=k ** -0.5), "b": draw(n)}


def torch_function(torch, kind: str):
    if kind == "swiglu":
        def swiglu(x, wg, wu):
            return torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())
        return swiglu

    def linear_bias_relu(x, w, b):
        return torch.relu(torch.addmm(b, x, w.t()))
    return linear_bias_relu


def scaled_error(got, ref) -> float | None:
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    return err if math.isfinite(err) else None


def run_case(torch, tvm, case: dict, configs: list[dict], timer: Timer, deadline: float, save, log) -> dict:
    """Baselines, then our configurations until ``deadline`` (the first always runs)."""
    started = time.perf_counter()
    flop = case_flop(case)
    inputs = make_inputs(torch, case)
    args = list(inputs.values())
    fn = torch_function(torch, case["kind"])
    ref = fn(*[t.float() for t in args])
    torch.cuda.synchronize()
    entry = {key: case[key] for key in ("kind", "dtype", "m", "n", "k")}
    entry.update(flop=flop, error_factor=ERROR_FACTOR, configs=[], not_run=[], max_abs_ref=float(ref.abs().max()))

    def step(what: str, budget: int):
        entry["running"] = what
        save(entry)
        faulthandler.dump_traceback_later(budget, exit=True)

    step("torch_eager", HANG_SECS["torch"])
    eager = fn(*args)
    torch.cuda.synchronize()
    eager_err = scaled_error(eager, ref)
    entry["torch_eager"] = {"call": "torch.relu(torch.addmm(b, x, w.t()))" if case["kind"] != "swiglu"
                            else "silu(x @ wg.t()) * (x @ wu.t())", "error": eager_err,
                            **timer.measure(lambda: fn(*args), flop)}
    del eager
    limit = ERROR_FACTOR * eager_err if eager_err is not None else None

    step("torch_compile", HANG_SECS["torch"])
    row = {"mode": "default", "dynamic": False}
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False)
        t0 = time.perf_counter()
        out = compiled(*args)
        torch.cuda.synchronize()
        row["first_call_secs"] = time.perf_counter() - t0
        row["error"] = scaled_error(out, ref)
        row["valid"] = row["error"] is not None and limit is not None and row["error"] <= limit
        del out
        row.update(timer.measure(lambda: compiled(*args), flop))
    except Exception as err:  # its failure is its row
        row["status"] = f"error: {type(err).__name__}: {str(err).strip()[:300]}"
    entry["torch_compile"] = row

    tvm_args = [tvm.runtime.from_dlpack(t) for t in args]
    out = torch.empty(case["m"], case["n"], dtype=args[0].dtype, device="cuda")
    tvm_out = tvm.runtime.from_dlpack(out)
    for index, knobs in enumerate(configs):
        name = config_name(knobs)
        if index and time.perf_counter() > deadline:
            entry["not_run"].append(name)
            continue
        step(name, HANG_SECS["ours"])
        row = {"name": name, "knobs": knobs}
        try:
            t0 = time.perf_counter()
            func = kernel(case, knobs)
            call = cuda_wgmma.build(func).mod[func.attrs["global_symbol"]]
            row["build_secs"] = time.perf_counter() - t0
            out.fill_(float("nan"))  # an output the kernel does not write fails the check
            t0 = time.perf_counter()
            call(*tvm_args, tvm_out)
            torch.cuda.synchronize()
            row["first_call_secs"] = time.perf_counter() - t0
            row["error"] = scaled_error(out, ref)
            row["valid"] = row["error"] is not None and limit is not None and row["error"] <= limit
            if row["valid"]:
                row.update(timer.measure(lambda: call(*tvm_args, tvm_out), flop))
        except Exception as err:  # one configuration's failure is its row
            row["status"] = f"error: {type(err).__name__}: {str(err).strip()[-600:]}"
        entry["configs"].append(row)
        log(f"  {case['name']} {name}: " + (f"{row['median_ms']:.4f} ms {row['tflops']:.0f} TFLOP/s"
            if row.get("median_ms") else row.get("status", f"invalid, error {row.get('error')}")))
    faulthandler.cancel_dump_traceback_later()
    entry.pop("running", None)

    valid = [row for row in entry["configs"] if row.get("valid") and row.get("median_ms")]
    best = min(valid, key=lambda row: row["median_ms"], default=None)
    entry["default"] = config_name(configs[0])
    entry["best"] = None if best is None else {key: best[key] for key in
                                                 ("name", "knobs", "median_ms", "tflops", "batched_ms", "error")}
    baselines = {name: entry[name]["median_ms"] for name in ("torch_eager", "torch_compile")
                 if entry[name].get("median_ms")}
    base_name = min(baselines, key=baselines.get)
    entry["baseline_for_pct"] = base_name
    entry["pct_of_cublas"] = 100.0 * baselines[base_name] / best["median_ms"] if best else None
    entry["secs"] = time.perf_counter() - started
    return entry


def summary(name: str, entry: dict) -> str:
    eager, comp, best = entry["torch_eager"], entry["torch_compile"], entry["best"]
    ours = f"ours {best['median_ms']:.4f} ms {best['tflops']:.0f} TFLOP/s ({best['name']})" if best else "ours: none valid"
    comp_txt = f"{comp['median_ms']:.4f} ms {comp['tflops']:.0f}" if comp.get("median_ms") else comp.get("status", "-")
    pct = f"{entry['pct_of_cublas']:.1f}% of {entry['baseline_for_pct']}" if entry["pct_of_cublas"] else "-"
    valid = sum(1 for row in entry["configs"] if row.get("valid"))
    return (f"{name}: {ours} | eager {eager['median_ms']:.4f} ms {eager['tflops']:.0f} | compile {comp_txt} | "
            f"{pct} | {valid}/{len(entry['configs'])} valid, {len(entry['not_run'])} not run, {entry['secs']:.0f} s")


def warm_up_compile(torch) -> float | str:
    """One torch.compile of a small case, so that inductor's one-time start (imports, worker pool)
    is not charged to the first case's budget."""
    t0 = time.perf_counter()
    try:
        inputs = make_inputs(torch, {"kind": "linear_bias_relu", "dtype": "float16", "m": 256, "n": 256, "k": 256})
        torch.compile(torch_function(torch, "linear_bias_relu"), dynamic=False)(*inputs.values())
        torch.cuda.synchronize()
        torch._dynamo.reset()
    except Exception as err:  # the cases will say it again, each in its own row
        return f"error: {type(err).__name__}: {str(err).strip()[:300]}"
    return time.perf_counter() - t0


def nvidia_smi() -> dict | None:
    fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out[0].split(",")))) if out else None


def machine(torch, tvm) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count, "gpu_memory_gib": props.total_memory / 2 ** 30,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "tvm": tvm.__version__,
            "python": platform.python_version(), "nvidia_smi_at_start": nvidia_smi(),
            "torch_matmul": {name: getattr(torch.backends.cuda.matmul, name, None) for name in
                             ("allow_tf32", "allow_fp16_reduced_precision_reduction",
                              "allow_bf16_reduced_precision_reduction")}}


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


NOTES = [
    "error: max|got - ref| / max|ref|, ref = the float32 computation (TF32 off) from the same inputs; "
    f"valid: error <= {ERROR_FACTOR} x torch eager's error",
    "median_ms: each call alone after a 256 MiB write (L2 evicted), CUDA events on torch's current stream, "
    "TVM kernels on that stream (tvm_ffi.use_torch_stream); batched_ms: --repeat back-to-back calls, per call",
    "tflops: 2mnk per GEMM over the median (the SwiGLU pair counts two GEMMs)",
    "pct_of_cublas: 100 x min(torch eager, torch.compile median) / our best valid median",
    "float16 cases sweep the configurations listed in their rows; bfloat16 cases run the default plus the "
    f"{BF16_FROM_FP16} fastest valid float16 configurations of the same shape",
    "not_run: configurations skipped when the case's share of the budget was spent",
]


def run(args) -> int:
    import torch
    import tvm
    import tvm_ffi

    if not torch.cuda.is_available():
        print("error: torch sees no CUDA device (use --dry-run on a machine without one)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
    started = STARTED
    log = lambda msg: print(f"[{time.perf_counter() - started:5.0f}s] {msg}", flush=True)  # noqa: E731
    cases = selected_cases(args.cases)  # checked in main
    report = {"schema": SCHEMA, "commit": args.commit, "command": sys.argv, "budget_secs": args.budget_secs,
              "repeat": args.repeat, "machine": machine(torch, tvm), "notes": NOTES, "cases": {},
              "not_started": []}
    out_path = args.out or DEFAULT_OUT
    explicit = parse_knobs(args.knobs) if args.knobs else None  # checked in main
    if explicit is not None:
        report["knobs"] = explicit
        report["notes"] = NOTES + ["--knobs: every case ran its default, then the configurations of `knobs` over it "
                                   "that its shape takes (those refused are in its `refused`), instead of the sweeps"]
    planned = sum(case_weight(c, explicit) - BASELINE_WEIGHT for c in cases)
    log(f"{len(cases)} cases, {planned} kernel builds planned; writing {out_path}")
    with tvm_ffi.use_torch_stream():
        timer = Timer(torch, args.repeat)
        report["torch_compile_warmup_secs"] = warm_up_compile(torch)
        log(f"torch.compile warm-up {report['torch_compile_warmup_secs']}")
        for index, case in enumerate(cases):
            now = time.perf_counter() - started
            if now > args.budget_secs:
                report["not_started"] = [c["name"] for c in cases[index:]]
                break
            weights = [case_weight(c, explicit) for c in cases[index:]]
            share = (args.budget_secs - now) * weights[0] / sum(weights)

            def save(entry, name=case["name"]):
                report["cases"][name] = entry
                report["secs"] = time.perf_counter() - started
                write_json(out_path, report)

            try:
                entry = run_case(torch, tvm, case, case_configs(case, report, explicit), timer,
                                 time.perf_counter() + share, save, lambda msg: log(msg))
                if explicit is not None:
                    entry["refused"] = explicit_configs(case, explicit)[1]
            except Exception as err:  # a case that cannot even start (e.g. out of memory) is its entry
                faulthandler.cancel_dump_traceback_later()
                entry = {"status": f"error: {type(err).__name__}: {str(err).strip()[:600]}"}
                log(f"{case['name']}: {entry['status']}")
            else:
                log(summary(case["name"], entry))
            save(entry)
            torch.cuda.empty_cache()
    report["machine"]["nvidia_smi_at_end"] = nvidia_smi()
    report["secs"] = time.perf_counter() - started
    write_json(out_path, report)
    if report["not_started"]:
        print(f"budget spent: not started {', '.join(report['not_started'])}")
    print(f"wrote {out_path}")
    return 0


def selected_cases(names: str | None) -> list[dict]:
    """The cases named in ``names`` (comma-separated; all when empty), ValueError for unknown ones."""
    cases = all_cases()
    if not names:
        return cases
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {c["name"] for c in cases}]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(c['name'] for c in cases)}")
    return [c for c in cases if c["name"] in wanted]


def dry_run(args) -> int:
    """Every configuration's CUDA source at one small shape, in both dtypes, plus the SwiGLU
    variants (with --knobs: each case's default and those); and the plan of the real run of
    --cases."""
    m, n, k = DRY_RUN_SHAPE
    started = time.perf_counter()
    small = [{"kind": "linear_bias_relu", "dtype": d, "m": m, "n": n, "k": k} for d in DTYPES]
    small += [{"kind": "swiglu", "dtype": d, "m": m, "n": n, "k": k} for d in DTYPES]
    report = {"schema": SCHEMA, "dry_run": True, "commit": args.commit, "command": sys.argv, "cases": {}}
    failed = 0
    explicit = parse_knobs(args.knobs) if args.knobs else None
    for case in small:
        name = case_name(case["kind"], case["dtype"], m, n, k)
        configs = (case_configs(case, {"cases": {}}, explicit) if case["kind"] == "swiglu" or explicit is not None
                   else sweep_configs(m, n, k, case["dtype"]))
        rows = []
        for knobs in configs:
            t0 = time.perf_counter()
            try:
                source = cuda_wgmma.cuda_source(cuda_wgmma.build(kernel(case, knobs)))
                ok = "wgmma.mma_async" in source and ("max(" in source or case["kind"] == "swiglu")
                rows.append({"name": config_name(knobs), "built": ok, "build_secs": time.perf_counter() - t0})
            except Exception as err:
                rows.append({"name": config_name(knobs), "built": False, "status": f"{type(err).__name__}: {err}"[:600]})
            failed += not rows[-1]["built"]
        report["cases"][name] = rows
        print(f"{name}: {sum(r['built'] for r in rows)}/{len(rows)} configs built "
              f"({', '.join(r['name'] for r in rows)})", flush=True)
    plan = {c["name"]: len(sweep_configs(c["m"], c["n"], c["k"], c["dtype"])) if c["kind"] == "linear_bias_relu"
            and c["dtype"] == "float16" and explicit is None else case_weight(c, explicit) - BASELINE_WEIGHT
            for c in selected_cases(args.cases)}
    report["plan"] = plan
    report["secs"] = time.perf_counter() - started
    print(f"real run: {len(plan)} cases, {sum(plan.values())} kernel builds at most: "
          + ", ".join(f"{name} {count}" for name, count in plan.items()))
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", help="the git commit of the checkout that runs (the GPU copy has no .git)")
    parser.add_argument("--out", help=f"results JSON (default {DEFAULT_OUT}; --dry-run writes only when given)")
    parser.add_argument("--budget-secs", type=float, default=500.0, help="no case starts after this")
    parser.add_argument("--repeat", type=int, default=50, help="timed calls per contender (at least 30)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build every config's CUDA source for one small shape")
    parser.add_argument("--knobs", help="the configurations to run after each case's default instead of its sweep: a "
                        "JSON list of knob objects, or one object of value lists (their product), each over the "
                        "case's default knobs, e.g. '{\"specialised\": [0, 1], \"stages\": [3, 4]}'")
    args = parser.parse_args(argv)
    if args.repeat < 30:
        parser.error("--repeat must be at least 30")
    if args.knobs:
        try:
            parse_knobs(args.knobs)
        except ValueError as err:
            parser.error(str(err))
    try:
        selected_cases(args.cases)
    except ValueError as err:
        parser.error(str(err))
    if args.dry_run:
        return dry_run(args)
    if not args.commit:
        parser.error("--commit is required for a measured run (the GPU checkout has no .git)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
