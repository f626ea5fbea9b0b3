"""The ``autofuse`` command: sub-commands ``tune``, ``build``, ``compare``, ``db``, ``rpc``, ``run`` and ``list``.

Every known problem with the user's input is an ``AutofuseError``; this module alone prints it, as
one line on stderr, and exits with code 2. The sub-commands live in ``autofuse/commands/``, one
module each; ``compare``'s flags are still declared here (its job is ``autofuse.compare.run_command``).
"""

from __future__ import annotations

import sys

from .baselines import BASELINES
from .commands import build, db, listing, rpc, run, tune
from .commands.common import (Parser, db_flag, input_shape_flag, non_negative_int, pattern_flags, positive_int,
                              target_flag)
from .errors import AutofuseError


def _build_parser() -> Parser:
    parser = Parser(prog="autofuse", description=(
        "Search fused-kernel schedules with TVM MetaSchedule: hand-designed templates vs the generic "
        "(Ansor-style) space, best records kept in a JSON tuning database."))
    from . import __version__
    parser.add_argument("--version", action="version", version=f"autofuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    tune.add_parser(sub)
    build.add_parser(sub)
    _add_compare_parser(sub)
    for command in (db, rpc, run, listing):
        command.add_parser(sub)
    return parser


def _add_compare_parser(sub) -> None:
    cmp = sub.add_parser("compare", help="time tuned kernels against onnxruntime, XLA, torch and TVM baselines",
                         description=(
        "Measure autofuse against the baselines on the same seeded inputs, in one process, on this CPU "
        "(pinned to the same threads) or a GPU (--target cuda|h200): tvm-untuned (FuseOps, default "
        "schedules), tvm-auto (FuseOps + generic-space records from the same database), onnxruntime "
        "(ORT_ENABLE_ALL), xla (jax.jit of the same ONNX graph), torch-eager, torch-compile and "
        "torch-sdpa. Every contender first runs once and is checked against the reference: valid when "
        "as accurate as the dtype allows or as the framework's own result (onnxruntime on a CPU, torch "
        "eager on a GPU); only valid ones are timed. With several patterns, --shape PATTERN:K=V sets one "
        "pattern's shape. Writes report.md, report.json, report.png and roofline.png to --report."), parents=[
        pattern_flags("compare on a pattern (several separated by commas, or 'all') at its default shape",
                      "override a pattern shape parameter"),
        db_flag("database root (default logs); none: no records"), target_flag(), input_shape_flag()])
    cmp.set_defaults(handler=cmd_compare)
    cmp.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx", help="compare on this ONNX model")
    cmp.add_argument("--torch-program", default=None, metavar="FILE.pt2",
                     help="with a MODEL: the torch.export program of the module it was exported from "
                          "(models/real/export.py --programs); torch-eager and torch-compile run that module "
                          "instead of their translation of the ONNX graph")
    cmp.add_argument("--baselines", default="all",
                     help=f"comma-separated subset of {','.join(BASELINES)} (default all)")
    cmp.add_argument("--commit", default=None, metavar="SHA",
                     help="the commit of the code that runs, for the report, where this checkout has no .git "
                          "(also $AUTOFUSE_COMMIT; default git rev-parse HEAD, else 'unknown')")
    cmp.add_argument("--trials", default=0, type=non_negative_int,
                     help="first tune ours (union space) and tvm-auto (generic space) for this many more trials "
                          "each into --db, the same budget for both (default 0: use the database as it is)")
    cmp.add_argument("--repeat", default=20, type=positive_int, help="timed repeats per contender (default 20)")
    cmp.add_argument("--warmup", default=3, type=non_negative_int, help="untimed calls first (default 3)")
    cmp.add_argument("--threads", default=None, type=positive_int,
                     help="cores every contender may use (default all of this process's cores)")
    cmp.add_argument("--report", default=None, metavar="DIR", help="report folder (default reports/<name>)")
    cmp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar while tuning")
    cmp.add_argument("--seed", default=None, type=int, help="random seed of the search (with --trials)")


def cmd_compare(args) -> int:
    from .compare import run_command
    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .target import use_host_cores
    use_host_cores()
    try:
        return args.handler(args)
    except AutofuseError as err:
        print(f"autofuse {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autofuse {args.command}: interrupted; records measured so far are in the database",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
