"""The tuning database: MetaSchedule's JSON database files under ``<root>/<target-key>/``
(written through ``store.SafeJSONDatabase``: locked, crash-safe, readable by plain TVM), plus the
numerical verdicts that decide which records may be used.

A record is only ever used (reported, applied to a build) after its kernel has matched the
pattern's numpy reference; the verdict is cached beside the database in
``autofuse_verdicts.json`` so a record is checked once. A record that fails stays in the database
(it is history) but is never chosen; the next best is tried instead.

Kernel templates' records (``autofuse.kernel_templates``) live in the same folder, in
``kernel_records.json``, each with the verdict of the check it passed or failed when measured;
``db.kernels`` reads and appends them, and ``check_folder``/``compact_folder`` cover them too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod
from tvm.target import Target

from search_spaces.lib import register_intrinsics

from .errors import AutofuseError
from .kernel_templates import KERNEL_RECORDS, KernelRecords, check_records, compact_records
from .pattern import TEMPLATE_ANNOTATION
from .store import FAILED_RUN_SECS, SafeJSONDatabase, mean_secs, workload_key
from .target import target_key


def replay(trace, sch: s_tir.Schedule, remove_postproc: bool = False) -> None:
    """``trace`` applied to ``sch``, the schedule library's tensor intrinsics registered first
    (they are registered at first use, and a record may tensorize with one this process has not
    scheduled yet)."""
    register_intrinsics(" ".join(str(attr) for inst in trace.insts if inst.kind.name == "Tensorize"
                                 for attr in inst.attrs))
    trace.apply_to_schedule(sch, remove_postproc=remove_postproc)


WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
VERDICTS = "autofuse_verdicts.json"

log = logging.getLogger("autofuse")


@dataclasses.dataclass
class ChosenRecord:
    record: ms.database.TuningRecord
    run_secs: float         # mean measured by MetaSchedule during tuning
    source: str             # "template:<name>" or "generic"
    schedule: s_tir.Schedule


# The mean of a record's measured run times (inf for none).
record_secs = mean_secs


def record_source(trace) -> str:
    """Which space produced a trace: our templates annotate it with their name."""
    for inst in trace.insts:
        if inst.kind.name == "Annotate" and len(inst.attrs) and str(inst.attrs[0]) == TEMPLATE_ANNOTATION:
            return f"template:{inst.inputs[1]}" if len(inst.inputs) > 1 else "template"
    text = str(trace)
    if TEMPLATE_ANNOTATION in text:
        start = text.index(TEMPLATE_ANNOTATION)
        name = text[start:].split('ann_val="', 1)[-1].split('"', 1)[0]
        return f"template:{name}"
    return "generic"


def trace_key(record: ms.database.TuningRecord) -> str:
    return hashlib.sha1(json.dumps(record.trace.as_json(), sort_keys=True, default=str).encode()).hexdigest()


class TuningDatabase:
    """The records of one target under ``root``; ``.ms`` is the plain MetaSchedule database."""

    def __init__(self, root: str, target: Target):
        self.target = target
        self.path = os.path.join(root, target_key(target))
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, ".write-test")
            with open(probe, "w", encoding="utf-8"):
                pass
            os.remove(probe)
        except OSError as err:
            raise AutofuseError(f"database directory {self.path} is not writable: {err.strerror}") from None
        self.ms = SafeJSONDatabase(os.path.join(self.path, WORKLOADS), os.path.join(self.path, RECORDS))
        self._verdicts_path = os.path.join(self.path, VERDICTS)
        self._verdicts = self._load_verdicts()
        # Kernel-template records (autofuse.kernel_templates), beside MetaSchedule's.
        self.kernels = KernelRecords(self.path)

    @property
    def work_dir(self) -> str:
        return os.path.join(self.path, "ms-logs")

    @property
    def cost_model_path(self) -> str:
        return os.path.join(self.path, "ms-logs", "cost_model.tar")

    def records(self, func: tirx.PrimFunc | tvm.IRModule) -> list[ms.database.TuningRecord]:
        """Every valid (built and ran) record of ``func``'s workload, fastest first."""
        mod = _normalize_mod(func)
        if self.ms.workload_index(mod) is None:
            return []
        return self.ms.get_top_k(self.ms.commit_workload(mod), len(self.ms) or 1)

    def count(self, func: tirx.PrimFunc | tvm.IRModule) -> tuple[int, int]:
        """(valid, all) records of ``func``'s workload, failed builds/runs included in ``all``."""
        history = self.history(func)
        return sum(secs < float("inf") for secs, _ in history), len(history)

    def count_kernel(self, kernel) -> tuple[int, int]:
        """(valid, all) records of both kinds of a ``verify.Kernel``: MetaSchedule's of its workload
        and, for a pattern's kernel, the kernel templates' of its pattern workload."""
        valid, total = self.count(kernel.workload)
        if kernel.pattern is None:
            return valid, total
        kernel_valid, kernel_total = self.kernels.count(kernel.pattern.name, kernel.shape, kernel.dtype)
        return valid + kernel_valid, total + kernel_total

    def history(self, func: tirx.PrimFunc | tvm.IRModule) -> list[tuple[float, str]]:
        """(mean seconds, source) of every record of ``func``'s workload in the order it was
        measured; failed trials have ``inf`` seconds."""
        index = self.ms.workload_index(_normalize_mod(func))
        if index is None:
            return []
        found = []
        for workload_index, record in self.ms.records_in_order():
            if workload_index == index:
                secs = record_secs(record)
                found.append((secs if secs < FAILED_RUN_SECS else float("inf"),
                              "generic" if record_source(record.trace) == "generic" else "template"))
        return found

    def best_so_far(self, func: tirx.PrimFunc) -> list[float | None]:
        """Best latency (ms) after each trial, in trial order; None before the first valid one."""
        best, curve = float("inf"), []
        for secs, _source in self.history(func):
            best = min(best, secs)
            curve.append(best * 1e3 if best < float("inf") else None)
        return curve

    def best(self, func: tirx.PrimFunc | tvm.IRModule, check,
             limit: int = 8) -> tuple[ChosenRecord | None, list[str]]:
        """The fastest record whose kernel passes ``check(schedule) -> (ok, message)``.

        Returns the choice (None when no record passes) and one line per rejected record.
        """
        rejected = []
        mod = _normalize_mod(func)
        wkey = workload_key(mod)
        for record in self.records(func)[:limit]:
            tkey = trace_key(record)
            verdict = self._verdicts.get((wkey, tkey))
            sch = self._schedule(mod, record)
            if sch is None:
                message = f"{self.ms.location(record)}: record {tkey[:8]} no longer applies to this TensorIR; skipped"
                log.warning(message)
                rejected.append(message)
                continue
            if verdict is None:
                ok, message = check(sch)
                verdict = {"ok": bool(ok), "message": message}
                self._store_verdict(wkey, tkey, verdict)
            if verdict["ok"]:
                return ChosenRecord(record, record_secs(record), record_source(record.trace), sch), rejected
            rejected.append(f"record {tkey[:8]} ({record_secs(record) * 1e3:.3f} ms) failed the numerical check: "
                            f"{verdict['message']}")
        return None, rejected

    @staticmethod
    def _schedule(mod: tvm.IRModule, record: ms.database.TuningRecord) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(mod)
        try:
            replay(record.trace, sch)
        except Exception:  # a trace of an older version of the pattern
            return None
        return sch

    def _load_verdicts(self) -> dict:
        return load_verdicts(self._verdicts_path)

    def _store_verdict(self, wkey: str, tkey: str, verdict: dict) -> None:
        self._verdicts[(wkey, tkey)] = verdict
        with open(self._verdicts_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"workload": wkey, "trace": tkey, **verdict}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def load_verdicts(path: str) -> dict:
    """{(workload key, trace key): {"ok", "message"}} from a verdicts file (empty when absent)."""
    verdicts = {}
    if not os.path.exists(path):
        return verdicts
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                verdicts[(entry["workload"], entry["trace"])] = {"ok": entry["ok"], "message": entry["message"]}
            except (ValueError, KeyError, TypeError):
                log.warning("%s:%d: skipping a line that is not a verdict", path, number)
    return verdicts


# --- check and compact (``autofuse db``) -------------------------------------------------------

def database_folders(root: str) -> list[str]:
    """The per-target database folders under ``root``."""
    if not os.path.isdir(root):
        raise AutofuseError(f"no database at {root}")
    found = sorted(os.path.join(root, name) for name in os.listdir(root)
                   if any(os.path.isfile(os.path.join(root, name, f)) for f in (WORKLOADS, KERNEL_RECORDS)))
    if not found:
        raise AutofuseError(f"no database under {root} (expected {root}/<target>/{WORKLOADS})")
    return found


def trace_applies(record: ms.database.TuningRecord) -> bool:
    """Whether a record's trace still replays on its workload (false once the TensorIR changed
    under it, e.g. a record copied from an older pattern version)."""
    try:
        replay(record.trace, s_tir.Schedule(record.workload.mod))
        return True
    except Exception:
        return False


def check_folder(folder: str) -> dict:
    """What is in one database folder and what is wrong with it: skipped lines (file:line: why),
    records whose trace no longer applies, records that failed the numerical check; kernel
    records counted in (those that no longer replay are problems)."""
    quiet = log.level
    log.setLevel(logging.ERROR)  # the skipped lines are this function's answer, not warnings
    try:
        db = SafeJSONDatabase(os.path.join(folder, WORKLOADS), os.path.join(folder, RECORDS))
    finally:
        log.setLevel(quiet)
    problems = [str(p) for p in db.problems]
    records = db.records_in_order()
    valid = 0
    for number, (_index, record) in enumerate(records, 1):
        if record_secs(record) >= FAILED_RUN_SECS:
            continue
        valid += 1
        if not trace_applies(record):
            problems.append(f"record {number} ({trace_key(record)[:8]}): its trace no longer applies to its workload")
    failed_checks = 0
    verdicts = os.path.join(folder, VERDICTS)
    if os.path.exists(verdicts):
        with open(verdicts, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    failed_checks += not json.loads(line)["ok"]
                except (ValueError, KeyError, TypeError):
                    problems.append(f"{verdicts}:{number}: not a verdict")
    kernels = check_records(folder)
    return {"folder": folder, "workloads": len(db.workloads()) + kernels["workloads"],
            "records": len(records) + kernels["records"], "valid": valid + kernels["valid"],
            "failed_numerical_check": failed_checks + kernels["failed_numerical_check"],
            "problems": problems + kernels["problems"]}


def compact_folder(folder: str, keep: int) -> tuple[int, int]:
    """Rewrite one folder's database keeping the ``keep`` best records per workload whose trace
    still applies and that did not fail their numerical check, and as many kernel records per
    pattern workload that passed theirs and still replay; (records before, after), both kinds."""
    db = SafeJSONDatabase(os.path.join(folder, WORKLOADS), os.path.join(folder, RECORDS))
    verdicts = load_verdicts(os.path.join(folder, VERDICTS))

    def usable(record) -> bool:
        # A record that failed its numerical check can never be chosen; left in, it would keep
        # taking a place among the fastest that best() looks at.
        verdict = verdicts.get((workload_key(record.workload.mod), trace_key(record)))
        return (verdict is None or verdict["ok"]) and trace_applies(record)

    before, after = db.compact(keep, usable=usable)
    kernels_before, kernels_after = compact_records(folder, keep)
    return before + kernels_before, after + kernels_after
