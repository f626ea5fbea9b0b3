"""``autofuse list``: the patterns, their shapes and templates, and the best latency stored for each."""

from __future__ import annotations

import os

from .common import db_flag, open_database, target_flag, target_of


def add_parser(sub) -> None:
    lst = sub.add_parser("list", help="list patterns, their shapes and templates, and stored best latency",
                         description="List the patterns; with a database, the best checked latency of each "
                                     "workload stored there.",
                         parents=[db_flag(), target_flag("target whose records to show (default llvm)")])
    lst.set_defaults(handler=run)


def run(args) -> int:
    from ..pattern import shape_label
    from ..registry import all_patterns
    from ..report import table
    from ..target import target_key

    target = target_of(args)
    db_path = os.path.join(args.db, target_key(target))
    stored = os.path.exists(os.path.join(db_path, "database_tuning_record.json"))
    db = open_database(args, target) if stored else None  # listing never creates a database
    rows = []
    for pattern in all_patterns().values():
        row = {"family": pattern.family, "pattern": pattern.name,
               "shape": shape_label(pattern.default_shape()), "small": shape_label(pattern.small_shape()),
               "dtypes": ",".join(pattern.dtypes), "templates": ",".join(t.name for t in pattern.templates),
               "description": pattern.description}
        if db is not None:
            row.update(_stored_best(db, pattern, target))
        rows.append(row)
    columns = [("family", "family"), ("pattern", "pattern"), ("shape", "default shape"),
               ("small", "small shape"), ("templates", "templates")]
    if db is not None:
        columns += [("records", "records"), ("best_ms", "best ms (default shape)"), ("source", "best from")]
    print(table(rows, columns))
    print()
    for row in rows:
        print(f"{row['pattern']}: {row['description']}")
    if db is None:
        print(f"\n(no database at {db_path}: run `autofuse tune` to fill it)")
    return 0


def _stored_best(db, pattern, target) -> dict:
    from ..target import device_for
    from ..tune_patterns import Job
    from ..verify import checker

    job = Job(pattern, pattern.default_shape(), pattern.dtypes[0])
    dev = device_for(target)
    _, total = db.count(job.func)
    if not total:
        return {"records": 0}
    chosen, _ = db.best(job.func, checker(job, target, dev))
    if chosen is None:
        return {"records": total, "best_ms": None, "source": "none passed the check"}
    return {"records": total, "best_ms": chosen.run_secs * 1e3, "source": chosen.source}
