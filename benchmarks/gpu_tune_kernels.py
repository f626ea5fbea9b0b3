"""Search a pattern's kernel templates (the Hopper tirx kernels of search_spaces/lib) on this GPU
and write what every configuration measured to one JSON file.

    source /opt/autofuse-gpu/env.sh && python3 benchmarks/gpu_tune_kernels.py --pattern linear_bias_relu \
        --shape m=4096,n=4096,k=4096 --dtype float16 --trials 48 --db /tmp/db --out tune.json [--commit SHA] \
        [--templates NAME,...]

``autofuse tune --space template`` searches the schedule-rule templates through MetaSchedule
before the kernel templates; this runs only the second part (``kernel_templates.tune_kernels``):
each configuration is built, checked against the pattern's reference and timed on the device,
and stored in --db's kernel records as soon as it is measured, so a later run (or ``autofuse
compare --db``) resumes from and uses them. Records already in --db count towards the JSON, which
is rewritten after every configuration; no configuration starts once --budget-secs is spent, and a
kernel that crashes ends the search (its process's device may be unusable). Without a CUDA GPU it
prints one line and exits 2.
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
    parser.add_argument("--budget-secs", type=float, default=float("inf"),
                        help="no configuration starts after this many seconds (default: no limit)")
    parser.add_argument("--templates", default="",
                        help="only these kernel templates, names separated by commas (default: every one that applies)")
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
    from autofuse.report import gpu_info
    from autofuse.target import device_for, parse_target
    from autofuse.verify import device_measure

    target = parse_target(args.target)
    require_device(target, "kernel templates are searched on the GPU")
    jobs = pattern_jobs(args)
    if len(jobs) != 1:
        raise AutofuseError("--pattern names one pattern")
    (job,) = jobs
    applicable = [t.name for t in K.kernel_templates_for(job.pattern, job.shape, job.dtype, target)]
    if not applicable:
        raise AutofuseError(f"{job.label} in {job.dtype} has no kernel template on {args.target}")
    templates = [name for name in args.templates.split(",") if name]
    unknown = [name for name in templates if name not in applicable]
    if unknown:
        raise AutofuseError(f"--templates {','.join(unknown)}: not among {job.label}'s kernel templates that apply "
                            f"here ({', '.join(applicable)})")
    if args.db == "none":
        raise AutofuseError("--db none keeps no records; name a folder")
    if args.trials < 0:
        raise AutofuseError("--trials must be 0 or more")
    dev = device_for(target)
    db = TuningDatabase(args.db, target)
    measure = device_measure(dev)
    header = {"schema": SCHEMA, "commit": code_commit(args.commit),
              "command": shlex.join([os.path.basename(sys.argv[0]), *argv]), "machine": gpu_info(dev),
              "pattern": job.pattern.name, "shape": dict(job.shape), "dtype": job.dtype}
    start = time.perf_counter()
    added = failed = 0
    summary = _summary(db, job, header, added, failed, 0.0, args.out)
    # One configuration per call, so the JSON follows every one and the budget is checked between them.
    while added < args.trials and time.perf_counter() - start < args.budget_secs:
        done = K.tune_kernels([job], target, db, trials=1, dev=dev, measure=measure,
                              on_phase=lambda text: print(text, flush=True), templates=templates).get(0)
        if done is None:  # every configuration of the space is recorded
            break
        added, failed = added + done.trials, failed + done.failed
        summary = _summary(db, job, header, added, failed, time.perf_counter() - start, args.out)
        if done.crashed:
            print("a kernel crashed; the search stops here", flush=True)
            break
    best = summary["best"]
    best = f"best {best['median_ms']:.4f} ms {best['knobs']}" if best else "no valid record"
    print(f"{job.label} {job.dtype}: {summary['records']} records ({summary['valid']} valid), {best}; wrote {args.out}")
    return 0


def _summary(db, job, header: dict, added: int, failed: int, secs: float, out: str) -> dict:
    """Every record of the job in ``db`` (fastest valid first), written to ``out``."""
    from autofuse.report import write_json

    rows = []
    for record in db.kernels.of(job.pattern.name, job.shape, job.dtype):
        median = statistics.median(record.run_secs) if record.ok and record.run_secs else None
        rows.append({"template": record.template, "knobs": record.knobs, "ok": record.ok,
                     "message": record.checked.get("message"), "median_ms": median and median * 1e3,
                     "samples_ms": [s * 1e3 for s in record.run_secs], "commit": record.commit,
                     "time": record.time})
    rows.sort(key=lambda r: (not r["ok"], r["median_ms"] or 0.0))
    valid = [r for r in rows if r["ok"]]
    payload = {**header, "trials_added": added, "failed_added": failed, "secs": secs, "records": len(rows),
               "valid": len(valid), "best": valid[0] if valid else None, "rows": rows}
    write_json(out, payload)
    return payload


if __name__ == "__main__":
    sys.exit(main())
