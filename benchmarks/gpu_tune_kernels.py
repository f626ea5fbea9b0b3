"""Search a pattern's kernel templates (the Hopper tirx kernels of search_spaces/lib) on this GPU
and write what every configuration measured to one JSON file.

    source /opt/autofuse-gpu/env.sh && python3 benchmarks/gpu_tune_kernels.py --pattern linear_bias_relu \
        --shape m=4096,n=4096,k=4096 --dtype float16 --trials 48 --db /tmp/db --out tune.json [--commit SHA]

``autofuse tune --space template`` searches the schedule-rule templates through MetaSchedule
before the kernel templates; this runs only the second part (``kernel_templates.tune_kernels``):
each configuration is built, checked against the pattern's reference and timed on the device,
and stored in --db's kernel records as soon as it is measured, so a later run (or ``autofuse
compare --db``) resumes from and uses them. Records already in --db count towards the JSON.
Without a CUDA GPU it prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autofuse.commands.common import db_flag, pattern_flags, pattern_jobs, require_device  # noqa: E402
from autofuse.errors import AutofuseError  # noqa: E402

SCHEMA = "autofuse.gpu-tune-kernels/1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Search one pattern's kernel templates on this GPU; every configuration's check and times go to --db and --out.",
        parents=[pattern_flags("one pattern with kernel templates", "shape parameter K=V"), db_flag()])
    parser.add_argument("--target", default="h200", help="a CUDA target (default h200)")
    parser.add_argument("--trials", type=int, default=48, help="configurations to add (default 48)")
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--commit", help="the commit of the code that runs (the GPU copy has no .git)")
    args = parser.parse_args(argv)
    try:
        return run(args, argv if argv is not None else sys.argv[1:])
    except AutofuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(args, argv: list[str]) -> int:
    from autofuse import kernel_templates as K
    from autofuse.database import TuningDatabase
    from autofuse.provenance import code_commit
    from autofuse.report import gpu_info, write_json
    from autofuse.target import device_for, parse_target
    from autofuse.verify import device_measure

    target = parse_target(args.target)
    require_device(target, "kernel templates are searched on the GPU")
    jobs = pattern_jobs(args)
    if len(jobs) != 1:
        raise AutofuseError("--pattern names one pattern")
    (job,) = jobs
    if not K.kernel_templates_for(job.pattern, job.shape, job.dtype, target):
        raise AutofuseError(f"{job.label} in {job.dtype} has no kernel template on {args.target}")
    if args.db == "none":
        raise AutofuseError("--db none keeps no records; name a folder")
    if args.trials < 0:
        raise AutofuseError("--trials must be 0 or more")
    dev = device_for(target)
    db = TuningDatabase(args.db, target)
    start = time.perf_counter()
    stats = K.tune_kernels([job], target, db, trials=args.trials, dev=dev, measure=device_measure(dev),
                           on_phase=lambda text: print(text, flush=True))
    rows = []
    for record in db.kernels.of(job.pattern.name, job.shape, job.dtype):
        median = statistics.median(record.run_secs) if record.ok and record.run_secs else None
        rows.append({"template": record.template, "knobs": record.knobs, "ok": record.ok,
                     "message": record.checked.get("message"), "median_ms": median and median * 1e3,
                     "samples_ms": [s * 1e3 for s in record.run_secs], "commit": record.commit,
                     "time": record.time})
    ok = sorted((r for r in rows if r["ok"]), key=lambda r: r["median_ms"])
    added = stats.get(0)
    payload = {"schema": SCHEMA, "commit": code_commit(args.commit),
               "command": shlex.join([os.path.basename(sys.argv[0]), *argv]),
               "machine": gpu_info(dev), "pattern": job.pattern.name, "shape": dict(job.shape),
               "dtype": job.dtype, "trials_added": added.trials if added else 0,
               "failed_added": added.failed if added else 0, "secs": time.perf_counter() - start,
               "records": len(rows), "valid": len(ok), "best": ok[0] if ok else None, "rows": rows}
    write_json(args.out, payload)
    best = f"best {ok[0]['median_ms']:.4f} ms {ok[0]['knobs']}" if ok else "no valid record"
    print(f"{job.label} {job.dtype}: {len(rows)} records ({len(ok)} valid), {best}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
