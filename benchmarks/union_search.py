"""The union space against each of its arms at the same budget: per case (a pattern at a shape),
the template space, the generic space and the union tuned N trials each, every one in a fresh
database, on the same seeds.

    python benchmarks/union_search.py [--trials 64] [--seeds 0,1] [--cases CASE;CASE...]

CASE is ``pattern`` or ``pattern:k=v,k=v`` (default: linear_bias_relu at the issue's 512x1024x1024
and at 256^3, swiglu_ffn and int8_matmul_dequant at their default shapes). Per case and seed: each
space's best measured trial (MetaSchedule's runner, ms), its best-so-far curve, the first
measured trial's time; for the union how many trials each arm had and which arm the best came
from. Then each space's best checked record and the template default are timed again, in
interleaved rounds (``--rounds``), so that a load that changed between the sessions does not
decide the comparison. The summary gives union / best arm per case on those times (median over
seeds) and the cases where the union ended more than 5% behind an arm. Writes
benchmarks/results/union-search-<target-key>.json and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from autofuse.errors import AutofuseError  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
SCHEMA = "autofuse.union_search/1"
SPACES = ("template", "generic", "union")
DEFAULT_CASES = ("linear_bias_relu:m=512,n=1024,k=1024", "linear_bias_relu:m=256,n=256,k=256", "swiglu_ffn",
                 "int8_matmul_dequant")
SLACK = 1.05  # the union counts as behind an arm past this ratio (trial timings vary by a few %)


def parse_case(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.strip().partition(":")
    shape = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise AutofuseError(f"--cases item {text!r}: {item!r} is not k=v")
        shape[key.strip()] = value.strip()
    if not name:
        raise AutofuseError(f"--cases item {text!r} names no pattern")
    return name, shape


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--seeds", default="0", help="comma-separated tuning seeds")
    parser.add_argument("--cases", default=";".join(DEFAULT_CASES), help="pattern[:k=v,...] separated by ';'")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the final timing")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.trials < 1 or args.rounds < 1:
        raise AutofuseError(f"--trials and --rounds must be positive, got {args.trials} and {args.rounds}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise AutofuseError(f"--seeds {args.seeds!r} is not a comma-separated list of integers") from None
    args.case_list = [parse_case(c) for c in args.cases.split(";") if c.strip()]
    if not args.case_list or not args.seed_list:
        raise AutofuseError("--cases and --seeds must name at least one case and one seed")
    return args


def arm_counts(records, best_record) -> dict:
    """How many of the union's records each arm produced, and the arm of the best one."""
    from autofuse.database import record_source
    arms = [record_source(r.trace).split(":")[0] for r in records]
    return {"template_trials": arms.count("template"), "generic_trials": arms.count("generic"),
            "best_from": record_source(best_record.trace) if best_record else None}


def run_space(job, target, space: str, trials: int, seed: int, root: str) -> dict:
    """Tune ``job`` in ``space`` into a fresh database under ``root``; the database stays for
    ``retime``."""
    from autofuse.database import TuningDatabase
    from autofuse.tune import Task, tune

    db = TuningDatabase(os.path.join(root, space), target)
    task = Task(job.label, job.func, job.pattern.templates_for(target, job.func))
    stats = tune([task], target, db.ms, db.work_dir, trials_per_task=trials, space=space, seed=seed,
                 cost_model_path=db.cost_model_path)
    row = {"space": space, "seed": seed, "trials": stats.total_trials, "failed": sum(stats.failed.values()),
           "best_ms": min(stats.best_secs.values()) * 1e3 if stats.best_secs else None,
           "first_trial_secs": stats.first_trial_secs, "tune_secs": stats.total_secs,
           "curve_ms": db.best_so_far(job.func)}
    if space == "union":
        records = db.records(job.func)  # fastest first
        row.update(arm_counts(records, records[0] if records else None))
    return row


def retime(job, target, root: str, rows: list[dict], rounds: int) -> dict:
    """Each space's best checked record (and the template default), built and timed in turn,
    ``rounds`` times; the median per space (ms) goes into its row, the default's is returned."""
    from autofuse.database import TuningDatabase
    from autofuse.target import device_for
    from autofuse.verify import build_kernel, choose, time_kernel

    dev = device_for(target)
    kernels = {}
    for row in rows:
        if row.get("error"):
            continue
        choice, _ = choose(job, TuningDatabase(os.path.join(root, row["space"]), target), target, dev, defaults=False)
        if choice is not None:
            kernels[row["space"]] = build_kernel(choice.mod, target)
    default, _ = choose(job, None, target, dev)
    if default is not None:
        kernels["default"] = build_kernel(default.mod, target)
    samples = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, rt in kernels.items():
            samples[name].append(time_kernel(job, rt, dev) * 1e3)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for row in rows:
        row["retimed_ms"] = medians.get(row["space"])
    return {"default_ms": medians.get("default")}


def summarize(cases: list[dict]) -> dict:
    ratios, behind = {}, {}
    for case in cases:
        per_seed = []
        for seed in {r["seed"] for r in case["runs"]}:
            best = {r["space"]: r.get("retimed_ms") or r["best_ms"] for r in case["runs"] if r["seed"] == seed}
            arms = [best[arm] for arm in ("template", "generic") if best.get(arm) is not None]
            if best.get("union") is None or not arms:
                continue
            per_seed.append(best["union"] / min(arms))  # an arm that failed to search is not a rival
            for arm in ("template", "generic"):
                if best.get(arm) is not None and best["union"] > SLACK * best[arm]:
                    behind.setdefault(case["label"], []).append({"seed": seed, "arm": arm,
                                                                 "ratio": best["union"] / best[arm]})
        ratios[case["label"]] = statistics.median(per_seed) if per_seed else None
    return {"union_over_best_arm": ratios, "union_behind_an_arm": behind, "slack": SLACK}


def markdown(report: dict) -> str:
    lines = [f"# Union space vs its arms, {report['trials']} trials each, seeds {report['seeds']}", "",
             "Times: each space's best checked record, timed again in interleaved rounds (best trial as "
             "measured while tuning in brackets).", "",
             "| case | seed | template ms | generic ms | union ms | union / best arm | union trials T/G | best from "
             "| template default ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        for seed in report["seeds"]:
            runs = {r["space"]: r for r in case["runs"] if r["seed"] == seed}
            best = {s: (runs[s].get("retimed_ms") or runs[s]["best_ms"]) if s in runs else None for s in SPACES}
            arms = [best[s] for s in ("template", "generic") if best[s] is not None]
            ratio = best["union"] / min(arms) if best["union"] is not None and arms else None
            union = runs.get("union", {})
            cells = [f"{best[s]:.4g} ({runs[s]['best_ms']:.4g})" if best[s] is not None and runs[s]["best_ms"]
                     else ("fails" if runs.get(s, {}).get("error") else "-") for s in SPACES]
            cells.append(f"{ratio:.3f}" if ratio is not None else "-")
            cells.append(f"{union.get('template_trials', '-')}/{union.get('generic_trials', '-')}")
            cells.append(union.get("best_from") or "-")
            default = case.get("default_ms", {}).get(str(seed))
            cells.append(f"{default:.4g}" if default is not None else "-")
            lines.append(f"| {case['label']} | {seed} | " + " | ".join(cells) + " |")
    behind = report["summary"]["union_behind_an_arm"]
    lines += ["", "Union more than 5% behind an arm: " + (", ".join(
        f"{label} (seed {b['seed']}, {b['arm']} {b['ratio']:.2f}x)" for label, items in behind.items() for b in items)
        or "none") + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        from autofuse.target import use_host_cores
        use_host_cores()  # before any kernel runs: every core, as compare times
        from autofuse.registry import resolve_patterns
        from autofuse.report import machine_info, write_json
        from autofuse.target import parse_target, target_key
        from autofuse.tune_patterns import Job

        target = parse_target(args.target)
        jobs = []
        for name, shape in args.case_list:
            pattern = resolve_patterns(name)[0]
            jobs.append(Job(pattern, pattern.resolve_shape(shape), pattern.dtypes[0]))
    except AutofuseError as err:
        print(f"union_search: {err}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(RESULTS, f"union-search-{target_key(target)}.json")
    from autofuse.provenance import code_commit
    report = {"schema": SCHEMA, "code": code_commit(None), "command": ["benchmarks/union_search.py", *argv],
              "machine": machine_info(), "target": str(target), "trials": args.trials, "seeds": args.seed_list,
              "cases": []}
    for job in jobs:
        case = {"label": job.label, "runs": [], "default_ms": {}}
        report["cases"].append(case)
        for seed in args.seed_list:
            with tempfile.TemporaryDirectory(prefix="union-search-") as root:
                rows = []
                for space in SPACES:
                    print(f"union_search: {job.label}, seed {seed}, {space} space, {args.trials} trials",
                          file=sys.stderr, flush=True)
                    try:
                        rows.append(run_space(job, target, space, args.trials, seed, root))
                    except AutofuseError as err:  # e.g. MetaSchedule's generic rules fail on this TensorIR
                        print(f"union_search: {job.label}: {err}", file=sys.stderr, flush=True)
                        rows.append({"space": space, "seed": seed, "best_ms": None, "error": str(err)})
                    case["runs"].append(rows[-1])
                    report["summary"] = summarize(report["cases"])
                    write_json(out, report)  # after every run, so a cut run keeps what it measured
                print(f"union_search: {job.label}, seed {seed}, timing the best of each space again",
                      file=sys.stderr, flush=True)
                case["default_ms"][str(seed)] = retime(job, target, root, rows, args.rounds)["default_ms"]
                report["summary"] = summarize(report["cases"])
                write_json(out, report)
    text = markdown(report)
    with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
