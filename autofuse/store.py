"""The tuning database's files: MetaSchedule's JSON database format, made crash-safe and safe for
several processes at once.

``SafeJSONDatabase`` is a MetaSchedule ``Database`` that reads and writes exactly the two files
``JSONDatabase`` does (one JSON value a line: workloads ``[shash, module]``, records
``[workload index, record]``), so plain TVM still reads what it writes. It differs where
``JSONDatabase`` loses work:

- Every write happens under an exclusive advisory lock (``fcntl.flock`` on ``.lock`` beside the
  files) after reading whatever other processes appended, so two tuning processes agree on
  workload indices and neither overwrites the other's lines. Each line is one ``write`` and is
  fsync'ed before the lock is released.
- Reading tolerates damage: a line that is not JSON, a record of an unknown workload or one
  TVM cannot parse is skipped with a warning naming the file and line. A half-written last line
  (the process was killed mid-write) is skipped with one warning; the next write moves it to
  ``<file>.damaged`` and goes on from a clean line end. Complete lines are never dropped.
- ``compact`` rewrites both files keeping the best records per workload: new files are written
  and fsync'ed beside the old ones, then swapped in under a commit marker, so a kill at any
  moment leaves either the old pair or the new pair (the next open finishes or undoes a swap).

``JSONLinesFile`` keeps any other JSON-lines file of the folder (kernel templates' records) the
same way: locked appends of whole fsync'ed lines, damage skipped, atomic rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import tempfile

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from search_spaces.lib import register_intrinsics

log = logging.getLogger("autofuse")

LOCK = ".lock"
COMPACT_MARKER = ".compact-commit"
# MetaSchedule stores failed builds and runs with a run time of 1e10 s.
FAILED_RUN_SECS = 1e9


@dataclasses.dataclass
class Problem:
    """A line of a database file that was skipped, and why."""
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def mean_secs(record: ms.database.TuningRecord) -> float:
    if not record.run_secs:
        return float("inf")
    values = [float(s) for s in record.run_secs]
    return sum(values) / len(values)


_BLOCK_NAME = re.compile(r'T\.sblock\("([^"]*)"')


def workload_key(mod: tvm.IRModule) -> str:
    """A workload's structural hash as 16 hex digits (what the verdicts file names it by)."""
    return f"{tvm_ffi.structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}"


def _index_key(mod: tvm.IRModule) -> tuple[str, tuple[str, ...]]:
    """What makes two modules one workload here: structural equality (as MetaSchedule's JSON
    database has it) and the same block names. Structural equality ignores names, but a trace
    finds its blocks by name: Relax names a legalized kernel's blocks after its variables
    (``lv1_sum``, ``lv5_sum``), and a record of one, filed under the other, no longer parses
    when the database is read again (seen: two models' layer_norm kernels)."""
    return workload_key(mod), tuple(_BLOCK_NAME.findall(mod.script()))


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _record_body(line: str) -> str:
    """The record part of a record line ``[index,<record>]``, as text."""
    head, _, rest = line.partition(",")
    if not head.lstrip().startswith("[") or not rest.rstrip().endswith("]"):
        raise ValueError("not a [index, record] line")
    return rest.rstrip()[:-1]


class _RecordWriter:
    """Spells tuning records exactly as MetaSchedule's own JSON writer does, by letting it: a
    scratch ``JSONDatabase`` in a temporary folder takes each record and the line it appends is
    ours. (Its JSON printer knows every object a trace can hold, IndexMaps included, which
    ``TuningRecord.as_json`` hands to Python unconverted.)"""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="autofuse-record-writer-")
        self._records = os.path.join(self._folder.name, "records.json")
        self._db = ms.database.JSONDatabase(path_workload=os.path.join(self._folder.name, "workloads.json"),
                                            path_tuning_record=self._records)
        self._offset = 0

    def body(self, record: ms.database.TuningRecord) -> str:
        self._db.commit_workload(record.workload.mod)
        self._db.commit_tuning_record(record)
        with open(self._records, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        return _record_body(data.decode("utf-8").rstrip("\n"))


class _File:
    """One append-only JSON-lines file: what has been read of it so far."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0        # bytes consumed: always at a line end
        self.lines = 0         # lines consumed
        self.torn = False      # a half-written last line was seen at ``offset``

    def read_new(self) -> list[tuple[int, str]]:
        """(line number, text) of the complete lines appended since the last read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete, newline, tail = data.rpartition(b"\n")
        lines = []
        if newline:
            for raw in complete.split(b"\n"):
                self.lines += 1
                lines.append((self.lines, raw.decode("utf-8", errors="replace")))
            self.offset += len(complete) + 1
        if tail and _is_json(tail):
            # A complete line whose newline was lost with the process: keep it, mend it on the next write.
            self.lines += 1
            lines.append((self.lines, tail.decode("utf-8")))
            self.offset += len(tail)
            self.torn = True
        elif tail:
            if not self.torn:
                log.warning("%s:%d: half-written last line (%d bytes) skipped; it is moved aside on the next "
                            "write", self.path, self.lines + 1, len(tail))
            self.torn = True
        return lines

    def append(self, line: str) -> None:
        """Append one line (under the caller's exclusive lock), mending a torn end first."""
        with open(self.path, "ab+") as f:
            size = f.seek(0, os.SEEK_END)
            if size > self.offset:  # a half-written line: keep its bytes aside, then cut it off
                f.seek(self.offset)
                with open(f"{self.path}.damaged", "ab") as aside:
                    aside.write(f.read() + b"\n")
                    aside.flush()
                    os.fsync(aside.fileno())
                f.truncate(self.offset)
                log.info("%s: repaired; the torn bytes are kept in %s.damaged", self.path, self.path)
            elif self.torn and size:  # a complete last line without its newline
                f.write(b"\n")
                self.offset += 1
            data = (line + "\n").encode("utf-8")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.offset += len(data)
        self.lines += 1
        self.torn = False


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


@derived_object
class SafeJSONDatabase(ms.database.PyDatabase):
    """MetaSchedule's JSON database files, locked and crash-safe (see the module docstring)."""

    def __init__(self, path_workload: str, path_tuning_record: str):
        super().__init__()
        folder = os.path.dirname(os.path.abspath(path_workload))
        self._lock_path = os.path.join(folder, LOCK)
        self._workload_file = _File(path_workload)
        self._record_file = _File(path_tuning_record)
        self.problems: list[Problem] = []
        self._workloads: dict[int, ms.database.Workload] = {}       # file line index -> workload
        self._by_hash: dict[tuple, list[int]] = {}                   # _index_key -> indices
        self._records: list[tuple[int, ms.database.TuningRecord]] = []
        self._record_lines: list[int] = []                           # file line of each record
        self._record_bodies: list[str] = []                          # each record's JSON text
        self._writer: _RecordWriter | None = None
        with self._locked(fcntl.LOCK_EX):
            finish_compaction(folder)
            for path in (path_workload, path_tuning_record):
                if not os.path.exists(path):
                    open(path, "a", encoding="utf-8").close()
            self._refresh()

    # --- MetaSchedule's Database interface ---------------------------------------------------

    def has_workload(self, mod: tvm.IRModule) -> bool:
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        return self._find(mod) is not None

    def commit_workload(self, mod: tvm.IRModule) -> ms.database.Workload:
        found = self._find(mod)
        if found is not None:
            return self._workloads[found]
        with self._locked(fcntl.LOCK_EX):
            self._refresh()  # another process may have committed it meanwhile
            found = self._find(mod)
            if found is not None:
                return self._workloads[found]
            workload = ms.database.Workload(mod)
            self._workload_file.append(_dumps(workload.as_json()))
            self._add_workload(self._workload_file.lines - 1, workload)
            return workload

    def commit_tuning_record(self, record: ms.database.TuningRecord) -> None:
        with self._locked(fcntl.LOCK_EX):
            self._refresh()
            index = self._find(record.workload.mod)
            if index is None:
                raise ValueError("commit_tuning_record: the record's workload was never committed")
            if self._writer is None:
                self._writer = _RecordWriter()
            body = self._writer.body(record)
            self._record_file.append(f"[{index},{body}]")
            self._records.append((index, record))
            self._record_lines.append(self._record_file.lines)
            self._record_bodies.append(body)

    def get_top_k(self, workload: ms.database.Workload, top_k: int) -> list[ms.database.TuningRecord]:
        if top_k < 0:
            raise ValueError("top_k must be non-negative")
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        index = self._find(workload.mod)
        if index is None or top_k == 0:
            return []
        valid = [r for i, r in self._records if i == index and mean_secs(r) < FAILED_RUN_SECS]
        return sorted(valid, key=mean_secs)[:top_k]

    def get_all_tuning_records(self) -> list[ms.database.TuningRecord]:
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        return [r for _, r in self._records]

    def __len__(self) -> int:
        return len(self._records)

    # --- autofuse's own ----------------------------------------------------------------------

    def records_in_order(self) -> list[tuple[int, ms.database.TuningRecord]]:
        """(workload index, record) in the order they were committed, failed ones included."""
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        return list(self._records)

    def location(self, record: ms.database.TuningRecord) -> str:
        """``file:line`` of a record this database handed out, for messages about it."""
        for (_, stored), line in zip(self._records, self._record_lines):
            if stored.same_as(record):
                return f"{self._record_file.path}:{line}"
        return self._record_file.path

    def workload_index(self, mod: tvm.IRModule) -> int | None:
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        return self._find(mod)

    def workloads(self) -> dict[int, ms.database.Workload]:
        return dict(self._workloads)

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the database's write lock (and see every line written before it)."""
        with self._locked(fcntl.LOCK_EX):
            self._refresh()
            yield

    def compact(self, keep: int, usable=lambda record: True) -> tuple[int, int]:
        """Rewrite the files with the ``keep`` fastest valid and ``usable`` records of each workload
        (workloads left without one are dropped), in their original order, and without the lines
        that were skipped as damaged. Returns (records before, records after).

        The old files stay as ``*.bak``. Crash-safe: see ``finish_compaction``."""
        wpath, rpath = self._workload_file.path, self._record_file.path
        folder = os.path.dirname(os.path.abspath(wpath))
        with self.exclusive():
            records = self._records
            kept_ids = set()
            for index in self._workloads:
                ranked = sorted((r for r in records
                                 if r[0] == index and mean_secs(r[1]) < FAILED_RUN_SECS and usable(r[1])),
                                key=lambda r: mean_secs(r[1]))
                kept_ids.update(id(r) for r in ranked[:keep])
            kept = [r for r in records if id(r) in kept_ids]
            new_index = {}
            workload_lines = []
            for index in sorted({i for i, _ in kept}):
                new_index[index] = len(workload_lines)
                workload_lines.append(_dumps(self._workloads[index].as_json()))
            bodies = {id(r): body for r, body in zip(records, self._record_bodies)}
            record_lines = [f"[{new_index[r[0]]},{bodies[id(r)]}]" for r in kept]
            for path, lines in ((wpath, workload_lines), (rpath, record_lines)):
                with open(f"{path}.new", "w", encoding="utf-8") as f:
                    f.writelines(line + "\n" for line in lines)
                    f.flush()
                    os.fsync(f.fileno())
            _write_durably(os.path.join(folder, COMPACT_MARKER), "swap\n")
            finish_compaction(folder)
            # Start over from the new files.
            self._workload_file, self._record_file = _File(wpath), _File(rpath)
            self._workloads, self._by_hash, self._records, self._record_lines, self._record_bodies = {}, {}, [], [], []
            self._refresh()
        return len(records), len(kept)

    # --- internals ---------------------------------------------------------------------------

    def _locked(self, mode: int):
        return folder_lock(self._lock_path, mode)

    def _find(self, mod: tvm.IRModule) -> int | None:
        for index in self._by_hash.get(_index_key(mod), ()):
            if tvm_ffi.structural_equal(self._workloads[index].mod, mod):
                return index
        return None

    def _add_workload(self, index: int, workload: ms.database.Workload) -> None:
        self._workloads[index] = workload
        self._by_hash.setdefault(_index_key(workload.mod), []).append(index)

    def _skip(self, path: str, line: int, reason: str) -> None:
        problem = Problem(path, line, reason)
        self.problems.append(problem)
        log.warning("%s; skipped", problem)

    def _refresh(self) -> None:
        """Read the lines other processes (or an earlier run) appended since the last look."""
        wfile, rfile = self._workload_file, self._record_file
        for number, text in wfile.read_new():
            try:
                self._add_workload(number - 1, ms.database.Workload.from_json(json.loads(text)))
            except Exception as err:  # not JSON, or not a module TVM can load
                self._skip(wfile.path, number, f"not a workload ({_reason(err)})")
        for number, text in rfile.read_new():
            try:
                index, body = json.loads(text)
            except (ValueError, TypeError) as err:
                self._skip(rfile.path, number, f"not a tuning record ({_reason(err)})")
                continue
            workload = self._workloads.get(index) if isinstance(index, int) else None
            if workload is None:
                self._skip(rfile.path, number, f"record of unknown workload {index!r}")
                continue
            try:
                register_intrinsics(text)  # TVM replays the trace while parsing it
                self._records.append((index, ms.database.TuningRecord.from_json(body, workload)))
                self._record_lines.append(number)
                self._record_bodies.append(_record_body(text))
            except Exception as err:
                # TVM replays the trace while parsing: a ScheduleError means the TensorIR changed under it.
                stale = "ScheduleError" in type(err).__name__ or "ScheduleError" in str(err)
                self._skip(rfile.path, number, "its trace no longer applies to its workload" if stale
                           else f"record TVM cannot parse ({_reason(err)})")


class JSONLinesFile:
    """An append-only file of JSON objects, one a line, kept as the database files are: each append
    happens under the folder's exclusive lock (``.lock``, shared with ``SafeJSONDatabase``) after
    reading what other processes appended, as one fsync'ed write; a line that is not a JSON object
    is skipped and listed in ``problems``; a half-written last line is skipped and moved aside to
    ``<file>.damaged`` by the next append. ``rewrite`` replaces the whole file atomically, keeping
    the old one as ``<file>.bak``. The file is only created by the first append."""

    def __init__(self, path: str):
        self.path = path
        self._lock_path = os.path.join(os.path.dirname(os.path.abspath(path)), LOCK)
        self._reset()

    def _reset(self) -> None:
        self._file = _File(self.path)
        self._entries: list[tuple[int, dict]] = []
        self.problems: list[Problem] = []

    def entries(self) -> list[tuple[int, dict]]:
        """(line number, object) of every readable line, in file order."""
        if not os.path.exists(self.path):
            return []
        with self._locked(fcntl.LOCK_SH):
            self._refresh()
        return list(self._entries)

    def append(self, value: dict) -> None:
        with self._locked(fcntl.LOCK_EX):
            self._refresh()
            self._file.append(_dumps(value))
            self._entries.append((self._file.lines, value))

    def rewrite(self, values: list[dict]) -> None:
        """Replace the file's lines by ``values``: written and fsync'ed beside it, the old file
        hard-linked to ``.bak``, then swapped in by one rename (a kill leaves old or new)."""
        with self._locked(fcntl.LOCK_EX):
            new = f"{self.path}.new"
            with open(new, "w", encoding="utf-8") as f:
                f.writelines(_dumps(v) + "\n" for v in values)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{self.path}.bak")
                os.link(self.path, f"{self.path}.bak")
            os.replace(new, self.path)
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
            self._reset()
            self._refresh()

    def _locked(self, mode: int):
        return folder_lock(self._lock_path, mode)

    def _refresh(self) -> None:
        for number, text in self._file.read_new():
            try:
                value = json.loads(text)
            except ValueError as err:
                value, reason = None, f"not JSON ({_reason(err)})"
            else:
                reason = "not a JSON object"
            if not isinstance(value, dict):
                problem = Problem(self.path, number, reason)
                self.problems.append(problem)
                log.warning("%s; skipped", problem)
                continue
            self._entries.append((number, value))


@contextlib.contextmanager
def folder_lock(lock_path: str, mode: int):
    """The database folder's advisory lock (``fcntl.LOCK_SH`` or ``LOCK_EX``) on ``lock_path``."""
    with open(lock_path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:120]}" if text else type(err).__name__


# --- compaction ---------------------------------------------------------------------------------

def finish_compaction(folder: str) -> None:
    """Complete or undo a compaction cut short (called with the lock held): with the commit
    marker, the new files replace the old (the old kept as .bak); without it, the new ones go."""
    marker = os.path.join(folder, COMPACT_MARKER)
    names = ("database_workload.json", "database_tuning_record.json")
    if os.path.exists(marker):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.exists(f"{path}.new"):
                if os.path.exists(path):
                    os.replace(path, f"{path}.bak")
                os.replace(f"{path}.new", path)
        _fsync_dir(folder)
        os.remove(marker)
    else:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, f"{name}.new"))


def _write_durably(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
