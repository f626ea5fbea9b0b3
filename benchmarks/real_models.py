"""Every model of the corpus (models/real/: HF transformers and torchvision exports) untuned and
after tuning, against onnxruntime, XLA and tvm-auto at the same budget, through autofuse.compare's
pipeline (the same seeded inputs, thread count, numerical check and timer).

    python benchmarks/real_models.py [--trials 512] [--models bert,resnet18-dynamo-fixed,...]
                                     [--budget-secs S] [--threads N] [--db DIR]

Per model: ``autofuse-untuned`` is ours with no database (pattern kernels on their template
defaults, every other kernel on its default schedule), measured beside onnxruntime and XLA; with
``--trials N`` (N > 0) ours and tvm-auto then get N new trials each in the model's own database
(``autofuse tune MODEL --trials N``'s search: the union space, the budget shared by the kernels by
weight; tvm-auto: the generic space on TVM's auto-fused kernels), with the wall time of each search
and when its first batch was measured (import and fusion included), and ``autofuse-tuned`` and
``tvm-auto`` are measured. A model with symbolic axes runs at the shapes its manifest entry binds.

Writes ``benchmarks/results/real-models-<target-key>.json`` and the Markdown table as ``.md``
beside it after every model, so a cut run keeps what it measured. ``--models`` takes
architectures (``bert``: all its variants) or file names without ``.onnx``.
"""

from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Neither imports anything heavy: threads are pinned first.
from autofuse.errors import AutofuseError  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.sweep import fmt as _fmt, median_ms as _ms, ratio as _ratio  # noqa: E402

CORPUS = os.path.join(REPO, "models", "real")
SCHEMA = "autofuse.real_models/1"
DEFAULT_TRIALS = 512
ORDER = ("autofuse-untuned", "autofuse-tuned", "tvm-auto", "onnxruntime", "xla")
RIVALS = ("tvm-auto", "onnxruntime", "xla")


def corpus() -> list[dict]:
    """The manifest's exported files, in its order."""
    with open(os.path.join(CORPUS, "manifest.json"), encoding="utf-8") as f:
        return [m for m in json.load(f)["models"] if m["file"]]


def stem(entry: dict) -> str:
    return entry["file"][:-len(".onnx")]


def select(text: str | None) -> list[dict]:
    entries = corpus()
    if text is None or text.strip() == "all":
        return entries
    chosen = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        found = [e for e in entries if name in (e["architecture"], stem(e))]
        if not found:
            raise AutofuseError(f"--models: {name!r} is neither an architecture nor a file of the corpus "
                                f"({', '.join(sorted({e['architecture'] for e in entries}))})")
        chosen += [e for e in found if e not in chosen]
    if not chosen:
        raise AutofuseError("--models names no model: give names separated by commas, or all")
    return chosen


def parse_args(argv: list[str]):
    parser = sweep.parser(__doc__, DEFAULT_TRIALS, f"new trials for ours and for tvm-auto per model (default "
                                                   f"{DEFAULT_TRIALS}); 0: untuned only")
    parser.add_argument("--models", default=None, help="architectures or file names, comma-separated (default all)")
    args = parser.parse_args(argv)
    sweep.check(args)
    args.entries = select(args.models)
    return args


def _not_run(name: str, reason: str) -> dict:
    return {"name": name, "status": "not run", "reason": reason, "median_ms": None, "samples_ms": [],
            "scaled_err": None}


def measure_model(entry: dict, ctx_untuned, ctx_tuned, machine, args, log) -> dict:
    """One model: untuned beside onnxruntime and XLA, then (--trials) tuned beside tvm-auto."""
    from autofuse.compare import compare_subject, model_subject, tune_subject

    name = stem(entry)
    start = time.perf_counter()
    shapes = {n: tuple(d) for n, d in entry["bind"].items()}
    record = {"model": name, "file": entry["file"], "architecture": entry["architecture"],
              "exporter": entry["exporter"], "axes": entry["axes"], "bytes": entry["bytes"],
              "input_shapes": {n: list(d) for n, d in shapes.items()}, "loadavg": list(os.getloadavg()),
              "tuning": None}
    path = os.path.join(CORPUS, entry["file"])
    try:
        subject = model_subject(path, input_shapes=shapes)
    except AutofuseError as err:
        record.update(status="import failed", reason=str(err), contenders=[_not_run(n, "import failed") for n in ORDER],
                      secs=time.perf_counter() - start)
        return record
    record.update(status="ok", flops=subject.flops)

    def timing(ours: str) -> dict:
        return {"repeat": args.repeat, "warmup": args.warmup,
                "log": lambda msg: log(f"{name}: measuring {msg.split(': ', 1)[-1].replace('autofuse', ours)}")}

    untuned = compare_subject(subject, ctx_untuned, ["onnxruntime", "xla"], machine, **timing("autofuse-untuned"))
    rows = [dict(untuned["contenders"][0], name="autofuse-untuned"), *untuned["contenders"][1:]]
    ours = rows[0].get("info") or {}
    record.update(matches=ours.get("matches"), folded=ours.get("folded"), import_warnings=ours.get("import_warnings"),
                  kernels=untuned.get("kernels"))
    if args.trials:
        log(f"{name}: tuning ours (union) and tvm-auto (generic), {args.trials} trials each")
        record["tuning"] = tune_subject(subject, ctx_tuned, ["tvm-auto"], args.trials, args.seed,
                                        progress=not args.no_progress)
        tuned = compare_subject(subject, ctx_tuned, ["tvm-auto"], machine, **timing("autofuse-tuned"))
        rows += [dict(tuned["contenders"][0], name="autofuse-tuned"), tuned["contenders"][1]]
        record["kernels_tuned"] = tuned.get("kernels")
    else:
        rows += [_not_run("autofuse-tuned", "--trials 0"),
                 _not_run("tvm-auto", "--trials 0: its kernels would run as written (no records)")]
    sweep.drop_compare_ratios(rows)
    by_name = {r["name"]: r for r in rows}
    record["contenders"] = [by_name[n] for n in ORDER]
    for key in ("reference", "accumulation", "dtype_bound", "bound", "framework"):
        record[key] = untuned[key]
    ort = _ms(by_name, "onnxruntime")
    rivals = [by_name[r] for r in RIVALS if _ms(by_name, r) is not None]
    best = min(rivals, key=lambda r: r["median_ms"], default=None)
    record.update(matches_onnxruntime=by_name["autofuse-untuned"]["status"] == "ok",
                  untuned_over_onnxruntime=_ratio(_ms(by_name, "autofuse-untuned"), ort),
                  tuned_over_onnxruntime=_ratio(_ms(by_name, "autofuse-tuned"), ort),
                  tuned_over_tvm_auto=_ratio(_ms(by_name, "autofuse-tuned"), _ms(by_name, "tvm-auto")),
                  best_rival=best["name"] if best else None,
                  ratio=_ratio(_ms(by_name, "autofuse-tuned" if args.trials else "autofuse-untuned"),
                               best["median_ms"] if best else None),
                  secs=time.perf_counter() - start)
    return record


# --- Markdown ------------------------------------------------------------------------------------

def _cell(row: dict) -> str:
    if row["status"] == "ok":
        return _fmt(row["median_ms"])
    if row["status"] == "invalid" and row.get("scaled_err") is not None:
        return f"invalid ({row['scaled_err']:.1e})"
    return {"not run": "-", "unavailable": "n/a"}.get(row["status"], row["status"])


def _search(tuning: dict | None, who: str) -> str:
    figures = (tuning or {}).get(who)
    if not figures:
        return "-"
    return f"{_fmt(figures['tune_secs'])} / {_fmt(figures['first_batch_secs'])}"


def markdown(report: dict) -> str:
    m = report["machine"]
    code = report["code"]
    lines = [f"# Real models: the corpus of models/real/ — {report['created']}", "",
             (f"Machine: {m.get('cpu_model')} (mcpu {m.get('mcpu', '?')}), {report['threads']} threads of "
              f"{m.get('cores')} cores; TVM {m.get('tvm')}."),
             (f"Code: commit {code.get('commit')}{' with local changes' if code.get('dirty') else ''}; command: "
              f"`{' '.join(report['command'])}`."),
             (f"Trials: {report['trials_added']} new each for ours (union space) and tvm-auto (generic space) per "
              f"model, each model in its own database. Timing: compare's timer, {report['warmup']} warm-up calls, "
              f"median of {report['repeat']} samples, milliseconds. Search: wall seconds / seconds to the first "
              f"measured batch (import and fusion included)."), "",
             "| model | exporter | axes | patterns matched | " + " | ".join(ORDER)
             + " | untuned / ORT | tuned / ORT | tuned / tvm-auto | ours search s | tvm-auto search s |",
             "|" + "---|" * (len(ORDER) + 9)]
    for model in report["models"]:
        rows = {c["name"]: c for c in model["contenders"]}
        matched = ", ".join(f"{k} x{v}" for k, v in sorted((model.get("matches") or {}).items())) or "none"
        lines.append(f"| {model['model']} | {model['exporter']} | {model['axes']} | {matched} | "
                     + " | ".join(_cell(rows[n]) for n in ORDER)
                     + f" | {_fmt(model.get('untuned_over_onnxruntime'))} | {_fmt(model.get('tuned_over_onnxruntime'))}"
                       f" | {_fmt(model.get('tuned_over_tvm_auto'))} | {_search(model.get('tuning'), 'autofuse')}"
                       f" | {_search(model.get('tuning'), 'tvm-auto')} |")
    problems = [f"{model['model']}: {model['status']}: {model.get('reason')}" for model in report["models"]
                if model["status"] != "ok"]
    problems += [f"{model['model']}/{c['name']}: {c['status']}: {c.get('reason')}" for model in report["models"]
                 if model["status"] == "ok" for c in model["contenders"] if c["status"] not in ("ok", "not run")]
    if problems:
        lines += ["", "Not valid or not run:", "", *[f"- {p}" for p in problems]]
    if report.get("not_started"):
        lines += ["", f"Not started (--budget-secs {report['budget_secs']}): {', '.join(report['not_started'])}."]
    return "\n".join(lines) + "\n"


def run(args, argv: list[str]) -> int:
    log = lambda msg: print(f"real_models: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    with sweep.session(args, argv, "real-models", list(RIVALS), log) as bench:
        from autofuse.baselines import Context
        from autofuse.database import TuningDatabase

        report, out = bench.report, bench.out
        report.update(schema=SCHEMA, contenders=list(ORDER), rivals=list(RIVALS),
                      corpus=os.path.relpath(CORPUS, REPO), models=[])
        start = time.perf_counter()
        for index, entry in enumerate(args.entries):
            if sweep.budget_spent(args, start, [stem(e) for e in args.entries[index:]], report, log):
                break
            # Each model tunes into a database of its own: no records carried over between variants.
            db = TuningDatabase(os.path.join(bench.db_root, stem(entry)), bench.ctx.target)
            ctx_tuned = Context(bench.ctx.target, bench.ctx.dev, bench.ctx.threads, db, work_dir=bench.work)
            record = measure_model(entry, bench.ctx, ctx_tuned, bench.machine, args, log)
            report["models"].append(record)
            report["elapsed_secs"] = time.perf_counter() - start
            sweep.write(report, out, markdown)
            log(f"{record['model']}: untuned / onnxruntime {_fmt(record.get('untuned_over_onnxruntime'))}, "
                f"tuned / onnxruntime {_fmt(record.get('tuned_over_onnxruntime'))} in {record['secs']:.0f} s; "
                f"wrote {out}")
        sweep.write(report, out, markdown)
    print(markdown(report))
    print(f"wrote {out} and {os.path.splitext(out)[0]}.md")
    failed = [m["model"] for m in report["models"] if not m.get("matches_onnxruntime")]
    if failed:
        print(f"real_models: no valid, timed untuned result for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return sweep.main("real_models", __file__, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
