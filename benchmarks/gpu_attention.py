"""The attention kernels of search_spaces/lib/cuda_attention.py against torch on one GPU, one JSON.

    python benchmarks/gpu_attention.py --commit SHA [--out benchmarks/results/h200/attention.json]
        [--budget-secs 420] [--repeat 30] [--only prefill|decode] [--filter TEXT] [--dry-run]

Prefill (``prefill_attention``, tensor cores) on float16 q, k, v of shape (batch, heads, seq, head_dim),
causal and not; decode (``decode_attention``: split kernel + combine) of one new token per sequence
over a K/V cache of ``cache`` valid positions, GQA 32 query heads on 8 K/V heads, head_dim 128.

Per case, on the same seeded inputs: our kernel, torch SDPA (``scaled_dot_product_attention``,
``is_causal`` / ``enable_gqa`` as the case needs; for decode over exactly the valid positions, the
same work) and torch.compile (default mode) of the naive math. Each output is compared with a float32
torch computation (prefill: the first and the last (batch, head) pair, decode: everything) as
err = max|out - ref| / max|ref|; a contender is valid when its err is at most twice SDPA's.

Timing: each call alone after a 256 MiB write that evicts L2, bracketed by CUDA events on torch's
stream (TVM launches there too: tvm_ffi.use_torch_stream), median of ``--repeat``; plus ``batched``, the
wall-clock per call of ``--repeat`` back-to-back calls. Figures: TFLOP/s = 4 B H Sq Skv D / t (halved
when causal) for prefill, GB/s of the K and V bytes read for decode, and the ratio SDPA time / ours.
The JSON is rewritten after every case; no case starts once ``--budget-secs`` have passed.

``--dry-run`` (no GPU needed) builds the CUDA source of every kernel configuration at small shapes,
and of every case's default configuration, then exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from search_spaces.lib import cuda_attention as ca  # noqa: E402

SCHEMA = "autofuse.gpu_attention/1"
FLUSH_BYTES = 256 << 20
WARMUP = 3
DEFAULT_OUT = os.path.join("benchmarks", "results", "h200", "attention.json")
COMPILE_SCORE_LIMIT = 8 << 30   # torch.compile of the naive prefill materialises B*H*Sq*Skv fp32 scores

# (batch, heads, kv_heads, seq, head_dim, causal); all float16 unless named
PREFILL_CASES = [(8, 16, 16, s, 128, c) for s in (512, 1024, 2048, 4096, 8192) for c in (0, 1)] + [
    (8, 16, 16, 2048, 64, 0), (8, 16, 16, 2048, 64, 1), (8, 32, 32, 2048, 128, 0), (8, 32, 32, 2048, 128, 1),
    (8, 32, 8, 2048, 128, 1), (1, 32, 32, 8192, 128, 1)]
PREFILL_BF16 = [(8, 16, 16, 2048, 128, 0)]
# every configuration at these cases (the others run the default knobs)
PREFILL_SWEEP = [(8, 16, 16, 1024, 128, 0), (8, 16, 16, 1024, 128, 1), (8, 16, 16, 2048, 128, 0),
                 (8, 16, 16, 2048, 128, 1), (8, 16, 16, 8192, 128, 1)]
PREFILL_GRID = dict(batch=(1, 8), heads=(16, 32), head_dim=(64, 128), seq=(512, 1024, 2048, 4096, 8192), causal=(0, 1))
# (batch, cache): GQA 32/8, head_dim 128, max_seq = cache
DECODE_CASES = [(b, n) for b in (1, 16, 64) for n in (1024, 4096, 16384, 32768)]
DECODE_HEADS = (32, 8, 128)
# checked, not timed: lengths that end inside a step and caches longer than the valid part
DECODE_EDGES = [(3, 8192, 1), (3, 8192, 17), (2, 5000, 4097), (1, 131072, 131072)]


# ---- cases -----------------------------------------------------------------------------------------

def prefill_shape(case) -> dict:
    b, h, hkv, s, d, causal = case
    return dict(batch=b, heads=h, kv_heads=hkv, seq_q=s, seq_kv=s, head_dim=d, causal=causal)


def prefill_name(case, dtype="float16") -> str:
    b, h, hkv, s, d, causal = case
    gqa = f"/{hkv}" if hkv != h else ""
    return f"prefill b{b} h{h}{gqa} s{s} d{d} {'causal' if causal else 'full'} {dtype}"


def decode_shape(batch, max_seq) -> dict:
    hq, hkv, d = DECODE_HEADS
    return dict(batch=batch, num_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq)


def all_cases():
    """(kind, name, spec) in run order: prefill, then decode (timed), then decode edge checks."""
    out = []
    for case in PREFILL_CASES:
        out.append(("prefill", prefill_name(case), dict(case=case, dtype="float16")))
    for case in PREFILL_BF16:
        out.append(("prefill", prefill_name(case, "bfloat16"), dict(case=case, dtype="bfloat16")))
    for b, n in DECODE_CASES:
        out.append(("decode", f"decode b{b} cache{n} gqa32/8 d128 float16", dict(batch=b, max_seq=n, length=n, timed=True)))
    for b, smax, n in DECODE_EDGES:
        out.append(("decode", f"decode check b{b} max_seq{smax} len{n}", dict(batch=b, max_seq=smax, length=n, timed=False)))
    return out


def not_run() -> list[str]:
    """The brief's prefill grid points this run leaves out."""
    run = {(c[0], c[1], c[3], c[4], c[5]) for c in PREFILL_CASES if c[1] == c[2]}
    out = []
    for b in PREFILL_GRID["batch"]:
        for h in PREFILL_GRID["heads"]:
            for d in PREFILL_GRID["head_dim"]:
                for s in PREFILL_GRID["seq"]:
                    for c in PREFILL_GRID["causal"]:
                        if (b, h, s, d, c) not in run:
                            out.append(prefill_name((b, h, h, s, d, c)))
    return out


# ---- dry run ---------------------------------------------------------------------------------------

def dry_run() -> int:
    """Build the CUDA source of every configuration at small shapes and of each case's defaults."""
    started = time.perf_counter()
    built = 0
    for dtype in ca.DTYPES:
        for d in ca.HEAD_DIMS:
            for causal in (0, 1):
                shape = dict(batch=1, heads=4, kv_heads=2, seq_q=256, seq_kv=384, head_dim=d, causal=causal)
                for knobs in ca.prefill_configs(shape, dtype):
                    _source(ca.prefill_attention(shape, dtype, knobs))
                    built += 1
            shape = dict(batch=2, num_heads=8, num_kv_heads=2, head_dim=d, max_seq=1000)
            for append in (False, True):  # the appending kernel adds the ring's stages and the merges
                for knobs in ca.decode_configs(shape, dtype, append=append):
                    for func in ca.decode_attention(shape, dtype, knobs, append=append):
                        if func is not None:  # no combine kernel where the splits merge without it
                            _source(func)
                            built += 1
    for kind, name, spec in all_cases():
        if kind == "prefill":
            _source(ca.prefill_attention(prefill_shape(spec["case"]), spec["dtype"]))
            built += 1
        else:
            for func in ca.decode_attention(decode_shape(spec["batch"], spec["max_seq"]), "float16"):
                _source(func)
                built += 1
    print(f"dry run: built the CUDA source of {built} kernels in {time.perf_counter() - started:.0f} s")
    return 0


def _source(func) -> str:
    source = ca.cuda_source(ca.build(func))
    assert "__global__" in source, func.attrs["global_symbol"]
    return source


# ---- measuring -------------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, repeat: int, flush: str = "write"):
        self.torch = torch
        self.repeat = repeat
        self.scratch = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        # "write" (as `autofuse compare` flushes) leaves L2 full of dirty lines, "read" of clean ones
        self.flush = self.scratch.zero_ if flush == "write" else lambda: self.scratch.max()

    def measure(self, call) -> dict:
        torch = self.torch
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.repeat):
            self.flush()  # evicts the last call's data from L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        samples = [start.elapsed_time(end) for start, end in events]  # ms
        t0 = time.perf_counter()
        for _ in range(self.repeat):
            call()
        torch.cuda.synchronize()
        batched = (time.perf_counter() - t0) / self.repeat * 1e3
        return {"median_ms": float(np.median(samples)), "p10_ms": float(np.percentile(samples, 10)),
                "p90_ms": float(np.percentile(samples, 90)), "batched_ms": batched, "samples_ms": samples}


def scaled_error(out, ref) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def _try(fn):
    """fn()'s dict, or an error entry (the run goes on)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one contender failing must not stop the others
        lines = [x for x in str(err).strip().splitlines() if x.strip()]
        return {"status": "error", "error": f"{type(err).__name__}: {lines[0][:400] if lines else ''}",
                "traceback": traceback.format_exc(limit=-8)[-3000:]}


def _tvm_args(tvm, tensors):
    return [tvm.runtime.from_dlpack(t) for t in tensors]


def _entry(executable, func):
    return executable.mod[func.attrs["global_symbol"]]


def run_prefill(torch, timer, spec, log) -> dict:
    import tvm

    case, dtype = spec["case"], spec["dtype"]
    b, h, hkv, s, d, causal = case
    shape = prefill_shape(case)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", generator=gen).to(tdtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=gen).to(tdtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=gen).to(tdtype)
    flops = ca.prefill_flops(shape)
    scale = 1.0 / math.sqrt(d)
    group = h // hkv

    # float32 reference of the first and the last (batch, head)
    picks = [(0, 0), (b - 1, h - 1)]

    def reference(bi, hi):
        qs, ks, vs = (x[bi, hj].float() for x, hj in ((q, hi), (k, hi // group), (v, hi // group)))
        sc = (qs @ ks.T) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        return torch.softmax(sc, -1) @ vs

    refs = [reference(bi, hi) for bi, hi in picks]

    def error_of(out) -> float:
        return max(scaled_error(out[bi, hi], ref) for (bi, hi), ref in zip(picks, refs))

    def figures(row):
        if row.get("median_ms"):
            row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            row["tflops_batched"] = flops / (row["batched_ms"] * 1e-3) / 1e12
        return row

    entry = {"kind": "prefill", "shape": shape, "dtype": dtype, "flops": flops,
             "flops_rule": "4*B*H*Sq*Skv*D" + (" / 2 (causal)" if causal else ""),
             "check": "max|out-ref|/max|ref| against torch float32 on (batch, head) " + str(picks),
             "contenders": {}}
    rows = entry["contenders"]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=group > 1)

    def sdpa_row():
        out = sdpa()
        torch.cuda.synchronize()
        return figures({"status": "ok", "err": error_of(out), **timer.measure(sdpa)})

    rows["torch-sdpa"] = _try(sdpa_row)
    bound = rows["torch-sdpa"].get("err")

    def naive(q, k, v):
        kk, vv = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (k, v))
        sc = (q @ kk.transpose(-1, -2)).float() * scale
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.softmax(sc, -1).to(q.dtype) @ vv

    def compiled_row():
        score_bytes = 4 * b * h * s * s
        if score_bytes > COMPILE_SCORE_LIMIT:
            return {"status": "skipped", "why": f"the naive math materialises {score_bytes / 2**30:.0f} GiB of scores"}
        fn = torch.compile(naive)
        t0 = time.perf_counter()
        out = fn(q, k, v)
        torch.cuda.synchronize()
        row = {"compile_s": time.perf_counter() - t0, "err": error_of(out)}
        del out
        return figures({**_status(row["err"], bound), **row, **timer.measure(lambda: fn(q, k, v))})

    rows["torch-compile"] = _try(compiled_row)

    default = dict(ca.PREFILL_DEFAULT_KNOBS)
    configs = ca.prefill_configs(shape, dtype) if case in PREFILL_SWEEP and dtype == "float16" else [default]
    out = torch.empty_like(q)
    args = _tvm_args(tvm, (q, k, v, out))
    for knobs in configs:
        name = "autofuse" if knobs == default else "autofuse " + ",".join(f"{n}={x}" for n, x in knobs.items())

        def ours_row():
            t0 = time.perf_counter()
            func = ca.prefill_attention(shape, dtype, knobs)
            fn = _entry(ca.build(func), func)
            build_s = time.perf_counter() - t0
            out.fill_(float("nan"))
            fn(*args)
            torch.cuda.synchronize()
            err = error_of(out)
            row = {"knobs": knobs, "build_s": build_s, "err": err, **_status(err, bound)}
            return figures({**row, **timer.measure(lambda: fn(*args))})

        rows[name] = _try(ours_row)
        log(f"  {name}: {_brief(rows[name])}")
    _ratios(rows)
    return entry


def run_decode(torch, timer, spec, log) -> dict:
    import tvm

    nb, smax, length = spec["batch"], spec["max_seq"], spec["length"]
    hq, hkv, d = DECODE_HEADS
    group = hq // hkv
    shape = decode_shape(nb, smax)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(nb, hq, d, device="cuda", generator=gen).half()
    kc = torch.randn(nb, hkv, smax, d, device="cuda", generator=gen).half()
    vc = torch.randn(nb, hkv, smax, d, device="cuda", generator=gen).half()
    scale = 1.0 / math.sqrt(d)
    kv_bytes = ca.decode_kv_bytes(shape, length)

    ref = torch.empty(nb, hq, d, device="cuda")
    per = max(1, (1 << 30) // (hkv * length * d * 4))  # batch rows per float32 chunk (~1 GiB each)
    for b0 in range(0, nb, per):
        qg = q[b0:b0 + per].float().view(-1, hkv, group, d)
        ks, vs = kc[b0:b0 + per, :, :length].float(), vc[b0:b0 + per, :, :length].float()
        p = torch.softmax(qg @ ks.transpose(-1, -2) * scale, -1)
        ref[b0:b0 + per] = (p @ vs).view(-1, hq, d)
        del qg, ks, vs, p

    def figures(row):
        if row.get("median_ms"):
            row["gbps"] = kv_bytes / (row["median_ms"] * 1e-3) / 1e9
            row["gbps_batched"] = kv_bytes / (row["batched_ms"] * 1e-3) / 1e9
        return row

    entry = {"kind": "decode", "shape": shape, "length": length, "dtype": "float16", "kv_bytes": kv_bytes,
             "check": "max|out-ref|/max|ref| against torch float32, all outputs", "contenders": {}}
    rows = entry["contenders"]
    timed = spec["timed"]

    k_valid, v_valid = kc[:, :, :length], vc[:, :, :length]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k_valid, v_valid, enable_gqa=True)

    def sdpa_row():
        err = scaled_error(sdpa().squeeze(2), ref)
        return figures({"status": "ok", "err": err, **(timer.measure(sdpa) if timed else {})})

    rows["torch-sdpa"] = _try(sdpa_row)
    bound = rows["torch-sdpa"].get("err")

    if timed:
        def naive(q, k, v):
            qg = q.view(q.shape[0], hkv, group, d)
            p = torch.softmax((qg @ k.transpose(-1, -2)).float() * scale, -1).to(q.dtype)
            return (p @ v).view(q.shape[0], hq, d)

        def compiled_row():
            fn = torch.compile(naive)
            t0 = time.perf_counter()
            out = fn(q, k_valid, v_valid)
            torch.cuda.synchronize()
            row = {"compile_s": time.perf_counter() - t0, "err": scaled_error(out, ref)}
            return figures({**_status(row["err"], bound), **row, **timer.measure(lambda: fn(q, k_valid, v_valid))})

        rows["torch-compile"] = _try(compiled_row)

    def ours_row():
        t0 = time.perf_counter()
        _, knobs = ca.check_decode(shape, "float16")
        split_f, combine_f = ca.decode_attention(shape, "float16", knobs)
        split, combine = (_entry(ca.build(f), f) for f in (split_f, combine_f))
        build_s = time.perf_counter() - t0
        part_o = torch.empty(nb, hq, knobs["splits"], d, device="cuda")
        part_ml = torch.empty(nb, hq, knobs["splits"], 2, device="cuda")
        out = torch.full_like(q, float("nan"))
        split_args = _tvm_args(tvm, (q, kc, vc, part_o, part_ml))
        combine_args = _tvm_args(tvm, (part_o, part_ml, out))

        def call():
            split(*split_args, length)
            combine(*combine_args)

        call()
        torch.cuda.synchronize()
        err = scaled_error(out, ref)
        row = {"knobs": knobs, "build_s": build_s, "err": err, **_status(err, bound)}
        return figures({**row, **(timer.measure(call) if timed else {})})

    rows["autofuse"] = _try(ours_row)
    log(f"  autofuse: {_brief(rows['autofuse'])}")
    _ratios(rows)
    return entry


def _status(err, bound) -> dict:
    if bound is None:
        return {"status": "unchecked", "why": "torch SDPA gave no error bound"}
    valid = err <= 2 * bound
    return {"status": "ok" if valid else "invalid", "err_bound": 2 * bound}


def _ratios(rows) -> None:
    base = rows.get("torch-sdpa", {}).get("median_ms")
    for row in rows.values():
        if base and row.get("median_ms"):
            row["sdpa_ms_over_ms"] = base / row["median_ms"]


def _brief(row) -> str:
    if row.get("status") == "error":
        return row["error"]
    parts = [row.get("status", "?"), f"err {row.get('err', float('nan')):.2e}"]
    for key, fmt in (("median_ms", "{:.4f} ms"), ("tflops", "{:.0f} TFLOP/s"), ("gbps", "{:.0f} GB/s"),
                     ("sdpa_ms_over_ms", "x{:.2f} of SDPA")):
        if row.get(key) is not None:
            parts.append(fmt.format(row[key]))
    return ", ".join(parts)


def machine(torch) -> dict:
    import tvm

    props = torch.cuda.get_device_properties(0)
    info = {"gpu": torch.cuda.get_device_name(0), "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count, "memory_gib": props.total_memory / 2 ** 30,
            "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "tvm": tvm.__version__, "numpy": np.__version__}
    try:
        import tvm_ffi
        info["tvm_ffi"] = tvm_ffi.__version__
    except Exception:  # noqa: BLE001
        info["tvm_ffi"] = None
    # copy bandwidth: 1 GiB float16 copied device to device (2 GiB moved), median of 10
    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    c = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        c.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    info["copy_gbps"] = 2 * a.numel() * 2 / (float(np.median(times[2:])) * 1e-3) / 1e9
    info["copy_method"] = "torch copy_ of 1 GiB float16 device to device, 2 GiB moved, median of 10"
    del a, c
    torch.cuda.empty_cache()
    return info


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=None, help="git commit of the checkout measured (the GPU host has no .git)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--budget-secs", type=float, default=420.0, help="no case starts after this")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--only", choices=("prefill", "decode"), default=None)
    parser.add_argument("--filter", default=None, help="only cases whose name contains this text")
    parser.add_argument("--dry-run", action="store_true", help="build every kernel's CUDA source (no GPU) and exit")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()

    import torch
    import tvm_ffi

    if not torch.cuda.is_available():
        print("error: torch sees no CUDA device (use --dry-run without a GPU)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", file=sys.stderr, flush=True)

    cases = [c for c in all_cases() if (args.only is None or c[0] == args.only)
             and (args.filter is None or args.filter in c[1])]
    report = {"schema": SCHEMA, "commit": args.commit, "command": " ".join([sys.executable, *sys.argv]),
              "args": vars(args), "machine": machine(torch), "notes": [
                  "median_ms: each call alone after a 256 MiB L2-evicting write, CUDA events on torch's stream; "
                  "batched_ms: wall-clock per call of --repeat back-to-back calls; samples_ms: the per-call samples",
                  "valid (status ok) when err = max|out-ref|/max|ref| against float32 torch is at most twice SDPA's",
                  "prefill TFLOP/s = 4*B*H*Sq*Skv*D / median (halved when causal); decode GB/s = K and V bytes of "
                  "the valid positions / median; sdpa_ms_over_ms > 1: faster than SDPA",
                  "decode: max_seq = cache length; ours = split kernel + combine kernel, both timed",
                  "torch-compile: torch.compile (default mode) of the naive softmax(q k^T * scale) v; compile_s is "
                  "its first call"],
              "cases": {}, "not_started": [], "not_run": not_run()}
    timer = Timer(torch, args.repeat)
    with tvm_ffi.use_torch_stream():
        for kind, name, spec in cases:
            if time.perf_counter() - started > args.budget_secs:
                report["not_started"].append(name)
                continue
            log(name)
            entry = _try(lambda: (run_prefill if kind == "prefill" else run_decode)(torch, timer, spec, log))
            report["cases"][name] = entry
            report["secs"] = time.perf_counter() - started
            write_json(args.out, report)
            torch.cuda.empty_cache()
    report["secs"] = time.perf_counter() - started
    write_json(args.out, report)
    for name, entry in report["cases"].items():
        rows = entry.get("contenders", {})
        print(f"{name}: " + "; ".join(f"{n} {_brief(r)}" for n, r in rows.items()))
    if report["not_started"]:
        print(f"budget spent: not started {len(report['not_started'])} cases")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
