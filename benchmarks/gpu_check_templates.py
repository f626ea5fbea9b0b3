"""Every pattern's CUDA templates with their default knobs: built, run on the GPU, checked, timed.

    python benchmarks/gpu_check_templates.py [--patterns all|a,b] [--dtype float32] [--small]
                                             [--templates a,b] [--shape PATTERN:K=V,...]
                                             [--knobs TEMPLATE=JSON ...] [--repeat 20] [--out FILE.json]

For each pattern (default shape; ``--small``: small shape) and each template that applies to the
h200 target (the pattern's own CUDA templates, or the dlight fallback where it has none), the
template is applied with ``tunable=False``, built with ``tvm.tirx.build``, run once on the pattern's
seeded inputs on ``tvm.cuda(0)`` and checked against ``pattern.run_reference`` (``autofuse.accuracy``
at the pattern's ``check_args``: the dtype's bound for the kernel's accumulation length), then timed with ``time_evaluator`` (median
of ``--repeat`` runs, each averaging calls over 50 ms: warm caches, no L2 flush; ``autofuse compare
--target h200`` is the careful timing, against the baselines).
One line per pattern and template: ok, FAIL (ran, numbers wrong), error (did not build or run),
skip (the pattern has no such dtype). ``--knobs`` adds rows for a template under fixed knob values
(a sweep of, say, GEMM tile sizes without a tuner; the inputs and numpy result are computed once). With ``--out`` the rows are also written as JSON, rewritten
after every row so that a cut run keeps what it has. Exit status 1 when any row is FAIL or error.

Runs from the repository root without installing the package; needs TVM with CUDA and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tvm  # noqa: E402

from autofuse.measure import empty_outputs, time_function, to_device  # noqa: E402
from autofuse.registry import resolve_patterns  # noqa: E402
from autofuse.target import device_for, parse_target  # noqa: E402
from autofuse.accuracy import compare  # noqa: E402
from autofuse.compare import code_commit, pattern_shapes  # noqa: E402
from autofuse.report import machine_info  # noqa: E402

SCHEMA = "autofuse.gpu_check_templates/1"


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


class Reference:
    """A pattern's seeded inputs and numpy result at one shape and dtype, computed on first use and
    kept for the next template or knob setting (large shapes take minutes in numpy)."""

    def __init__(self, pattern, shape, dtype):
        self.pattern, self.shape, self.dtype = pattern, shape, dtype
        self._value = None

    def get(self):
        if self._value is None:
            inputs = self.pattern.make_inputs(self.shape, self.dtype, 0)
            self._value = inputs, self.pattern.run_reference(inputs, self.shape)
        return self._value


def check_template(pattern, template, shape, dtype, target, dev, repeat: int,
                   reference: Reference | None = None, knobs=None) -> dict:
    row = {"pattern": pattern.name, "template": template.name, "dtype": dtype,
           "shape": dict(shape), "status": "error", "ms": None, "max_abs_err": None, "message": ""}
    if knobs is not None:
        row["knobs"] = knobs
    reference = reference or Reference(pattern, shape, dtype)
    stage = "build"
    try:
        func = pattern.build(shape, dtype)
        start = time.perf_counter()
        sch = template.apply(func, target, tunable=False, overrides=knobs)
        if sch is None:
            row["message"] = "template does not apply to this target"
            return row
        rt = tvm.tirx.build(sch.mod, target=target)
        row["build_secs"] = round(time.perf_counter() - start, 2)
        stage = "run"
        inputs, expected = reference.get()
        outputs = empty_outputs(pattern.output_specs(func), dev)
        args = to_device(inputs, dev) + outputs
        rt(*args)
        dev.sync()
        stage = "check"
        check = compare([o.numpy() for o in outputs], expected, **pattern.check_args(shape, dtype, func))
        row.update(max_abs_err=check.max_abs_err, scaled_err=check.scaled_err, bound=check.bound)
        stage = "time"
        timing = time_function(rt, args, dev, repeat=repeat)
        row["ms"], row["samples_ms"] = timing.median_secs * 1e3, [s * 1e3 for s in timing.samples_secs]
        row["status"] = "ok" if check.ok else "FAIL"
        row["message"] = check.message
    except Exception as err:  # a row per failure; the run goes on
        row["message"] = f"{stage}: {_last_line(err)}"
        row["traceback"] = traceback.format_exc()[-4000:]
    return row


def line(row: dict) -> str:
    ms = f"{row['ms']:.4f} ms" if row["ms"] is not None else "-"
    err = f"err {row['max_abs_err']:.2e}" if row["max_abs_err"] is not None else ""
    knobs = f" {json.dumps(row['knobs'])}" if "knobs" in row else ""
    return (f"{row['pattern']:<24} {row['template'] + knobs:<22} {row['dtype']:<9} {row['status']:<5} "
            f"{ms:>12}  {err}  {row['message']}").rstrip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default="all", help="all, or pattern names separated by commas")
    parser.add_argument("--templates", default="", help="only these template names (commas); default all")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--small", action="store_true", help="the small shape instead of the default")
    parser.add_argument("--shape", action="append", metavar="PATTERN:K=V,...",
                        help="override shape parameters of one pattern (repeatable), e.g. softmax_dropout:rows=8192")
    parser.add_argument("--knobs", action="append", default=[], metavar="TEMPLATE=JSON",
                        help="also check TEMPLATE with these knob values, in the order the template asks "
                             "for them (tile: inner factors, choice: a value, null: the default); "
                             "repeatable, e.g. 'cuda_tiled_epilogue=[[16],[8],[16],[8]]'")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--target", default="h200", help="h200; llvm runs the CPU templates the same way (a test here)")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args()

    target = parse_target(args.target)
    dev = device_for(target)
    if not dev.exist:
        print(f"no {target.kind.name} device here", file=sys.stderr)  # e.g. no GPU on this machine
        return 2
    patterns = resolve_patterns(args.patterns)
    shapes = pattern_shapes(args.shape, patterns)
    sweeps = {}
    for spec in args.knobs:
        name, _, values = spec.partition("=")
        try:
            sweeps.setdefault(name.strip(), []).append(json.loads(values))
        except json.JSONDecodeError as err:
            print(f"--knobs {spec!r}: not JSON ({err})", file=sys.stderr)
            return 2
    wanted = {t.strip() for t in args.templates.split(",") if t.strip()}
    report = {"schema": SCHEMA, "target": args.target, "device": getattr(dev, "device_name", ""),
              "host": platform.node(), "code": code_commit(), "command": sys.argv, "machine": machine_info(dev),
              "dtype": args.dtype, "shape": "small" if args.small else "default", "rows": []}
    bad = 0
    for pattern in patterns:
        shape = pattern.resolve_shape(shapes.get(pattern.name), "small" if args.small else "default")
        reference = Reference(pattern, shape, args.dtype)
        for template in pattern.templates_for(target):
            if wanted and template.name not in wanted:
                continue
            if args.dtype not in pattern.dtypes:
                row = {"pattern": pattern.name, "template": template.name, "dtype": args.dtype,
                       "status": "skip", "ms": None, "max_abs_err": None,
                       "message": f"dtypes: {', '.join(pattern.dtypes)}"}
                rows = [row]
            else:
                rows = [check_template(pattern, template, shape, args.dtype, target, dev, args.repeat,
                                       reference, knobs)
                        for knobs in [None] + sweeps.get(template.name, [])]
            for row in rows:
                bad += row["status"] in ("FAIL", "error")
                print(line(row), flush=True)
                report["rows"].append(row)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
