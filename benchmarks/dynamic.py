"""One symbolic-length flash_attention kernel serving every length (continuous batching), against
a static kernel compiled for each length.

    python benchmarks/dynamic.py [--db benchmarks/work/db] [--sizes 64x64,100x100,...] [--repeat 20]

The symbolic kernel (seq_q and seq_kv int64 variables) takes its schedule from the representative
static shape (the pattern's default): the best checked record in --db or the template default,
whichever is faster there, its trace replayed on the symbolic function (``autofuse.dynamic``).
At each size QxK the one library is checked against the numpy reference and timed; the static
kernel at that size (template default, built for it alone) is timed beside it. Keep the machine
idle. Writes benchmarks/results/dynamic-<target-key>.json.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.database import TuningDatabase  # noqa: E402
from autofuse.dynamic import build_dynamic, check_sizes  # noqa: E402
from autofuse.registry import get_pattern  # noqa: E402
from autofuse.report import machine_info, write_json  # noqa: E402
from autofuse.target import device_for, parse_target, target_key  # noqa: E402
from autofuse.tune_patterns import Job  # noqa: E402
from autofuse.verify import build_kernel, default_schedule, time_kernel  # noqa: E402

DEFAULT_SIZES = "1x300,16x16,64x64,100x100,256x256,300x700,512x512,1000x1000"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="flash_attention")
    parser.add_argument("--db", default=os.path.join(ROOT, "benchmarks", "work", "db"))
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="seq_qxseq_kv pairs, comma-separated")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times

    target = parse_target("llvm")
    dev = device_for(target)
    pattern = get_pattern(args.pattern)
    shape = pattern.default_shape()
    db = TuningDatabase(args.db, target) if args.db != "none" else None
    rt, source = build_dynamic(pattern, shape, ["seq_q", "seq_kv"], "float32", target, db)
    print(f"symbolic {args.pattern} built once from {source}")
    rows = []
    for item in args.sizes.split(","):
        seq_q, seq_kv = (int(v) for v in item.split("x"))
        size = {"seq_q": seq_q, "seq_kv": seq_kv}
        (result,) = check_sizes(pattern, rt, shape, [size], "float32", dev, repeat=args.repeat)
        job = Job(pattern, {**shape, **size}, "float32")
        static = build_kernel(default_schedule(job.func, target, pattern).mod, target)
        static_ms = time_kernel(job, static, dev, args.repeat) * 1e3
        rows.append({"seq_q": seq_q, "seq_kv": seq_kv, "ok": result.ok, "max_abs_err": result.max_abs_err,
                     "symbolic_ms": result.median_ms, "static_default_ms": static_ms})
        symbolic_ms = f"{result.median_ms:8.3f}" if result.median_ms is not None else "       -"
        print(f"{seq_q:5d} x {seq_kv:5d}  {'ok ' if result.ok else 'BAD'} err {result.max_abs_err:.1e}  "
              f"symbolic {symbolic_ms} ms  static default {static_ms:8.3f} ms")
    path = os.path.join(ROOT, "benchmarks", "results", f"dynamic-{target_key(target)}.json")
    write_json(path, {"pattern": args.pattern, "representative_shape": shape, "source": source,
                      "rows": rows, "machine": machine_info()})
    print(f"wrote {path}")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
