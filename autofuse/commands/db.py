"""``autofuse db check|compact``: inspect and maintain the tuning database."""

from __future__ import annotations

import sys

from .common import Parser, db_flag, positive_int


def add_parser(sub) -> None:
    db = sub.add_parser("db", help="check or compact a tuning database",
                        description="Inspect and maintain the tuning database: every target folder under --db.")
    db.set_defaults(handler=run)
    actions = db.add_subparsers(dest="db_command", metavar="ACTION", parser_class=Parser, required=True)
    actions.add_parser("check", help="report damaged lines, stale records and failed numerical checks",
                       description=(
        "Read every target folder under --db and report lines that are skipped (not JSON, record of an "
        "unknown workload, half-written), records whose trace no longer applies to their TensorIR, and "
        "records that failed the numerical check. Exit 0 when clean, 1 when something was found."),
                       parents=[db_flag()])
    compact = actions.add_parser("compact", help="rewrite the database keeping the best records per workload",
                                 description=(
        "Rewrite every target folder under --db keeping the --keep fastest valid records per workload whose "
        "trace still applies; damaged lines and failed trials go. The files are replaced atomically and the "
        "old ones kept as *.bak. Safe while other autofuse processes use the database."), parents=[db_flag()])
    compact.add_argument("--keep", default=16, type=positive_int, help="records kept per workload (default 16)")


def run(args) -> int:
    from ..database import check_folder, compact_folder, database_folders

    folders = database_folders(args.db)
    if args.db_command == "compact":
        for folder in folders:
            before, after = compact_folder(folder, args.keep)
            print(f"{folder}: {before} records -> {after} (best {args.keep} per workload; old files kept as *.bak)")
        return 0
    dirty = False
    for folder in folders:
        found = check_folder(folder)
        print(f"{folder}: {found['workloads']} workloads, {found['records']} records ({found['valid']} valid), "
              f"{found['failed_numerical_check']} failed the numerical check (kept, never chosen)")
        for problem in found["problems"]:
            print(f"  {problem}")
        dirty |= bool(found["problems"])
    if dirty:
        print("problems found: `autofuse db compact` rewrites the database without them", file=sys.stderr)
    return 1 if dirty else 0
