"""What the ``autofuse`` sub-commands share: the parser whose usage errors are one line, the flags
several commands take (argparse parent parsers) and the one rule each for turning them into work:
which pattern workloads, which target, which database."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import AutofuseError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(convert, noun: str, accept, rule: str):
    """An argparse type: ``convert`` the text (else "not {noun}"), then ``accept`` it (else "must be {rule}")."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


positive_int = _number(lambda t: int(t, 10), "an integer", lambda v: v > 0, "positive")
non_negative_int = _number(lambda t: int(t, 10), "an integer", lambda v: v >= 0, "zero or more")
positive_float = _number(float, "a number", lambda v: v > 0, "positive")


# Parent parsers: each shared flag is declared here once; a command passes its own help where the
# flag means something more for it.

def pattern_flags(pattern_help: str, shape_help: str) -> Parser:
    """--pattern, --shape, --small and --dtype, read by ``pattern_jobs``."""
    parent = Parser(add_help=False)
    parent.add_argument("--pattern", default=None, help=pattern_help)
    parent.add_argument("--shape", action="append", metavar="K=V", help=shape_help)
    parent.add_argument("--small", action="store_true", help="use each pattern's small test shape")
    parent.add_argument("--dtype", default=None, help="element type (default: the pattern's first)")
    return parent


def target_flag(help: str | None = None) -> Parser:
    """--target, read by ``target_of``."""
    parent = Parser(add_help=False)
    parent.add_argument("--target", default="llvm", help=help)
    return parent


def db_flag(help: str = "database root (default logs)") -> Parser:
    """--db, read by ``open_database``."""
    parent = Parser(add_help=False)
    parent.add_argument("--db", default="logs", help=help)
    return parent


def fusion_flag(help: str | None = None) -> Parser:
    """--fusion: how a model's operators become kernels."""
    parent = Parser(add_help=False)
    parent.add_argument("--fusion", default="patterns", choices=["none", "auto", "patterns"], help=help)
    return parent


def input_shape_flag() -> Parser:
    """--input-shape NAME=DIMS, read by ``input_shapes``."""
    parent = Parser(add_help=False)
    parent.add_argument("--input-shape", action="append", metavar="NAME=DIMS", help=(
        "a model input's shape, binding its symbolic (batch, sequence) axes, e.g. input_ids=1x128 "
        "(repeatable or comma-separated, as trtexec --shapes)"))
    return parent


def input_shapes(items: list[str] | None) -> dict[str, tuple[int, ...]] | None:
    """``--input-shape input_ids=1x128,attention_mask=1x128`` as {"input_ids": (1, 128), ...};
    None when not given. Whether the names and ranks fit the model is checked against it
    (``model.shapes.bind_input_shapes``)."""
    if not items:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        for part in item.split(","):
            name, sep, dims = part.strip().rpartition("=")
            if not sep or not name or not dims:
                raise AutofuseError(f"--input-shape expects NAME=DIMS (e.g. input_ids=1x128), got {part.strip()!r}")
            sizes = []
            for dim in dims.split("x"):
                if not (dim.isascii() and dim.isdigit()) or int(dim) == 0:
                    raise AutofuseError(f"--input-shape {part.strip()}: {dim!r} is not a positive size "
                                        "(DIMS are sizes joined by x, e.g. 1x128)")
                sizes.append(int(dim))
            if name in shapes:
                raise AutofuseError(f"--input-shape gives {name!r} twice")
            shapes[name] = tuple(sizes)
    return shapes


def shape_overrides(items: list[str] | None) -> dict[str, str]:
    """``--shape m=128,n=64 --shape k=32`` as {"m": "128", "n": "64", "k": "32"}."""
    overrides = {}
    for item in items or []:
        for part in item.split(","):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key or not value:
                raise AutofuseError(f"--shape expects key=value (e.g. m=128), got {part!r}")
            overrides[key.strip()] = value.strip()
    return overrides


def pattern_jobs(args) -> list:
    """The workloads --pattern/--shape/--small/--dtype name, each built, so every shape and dtype
    rule has been checked before anything runs."""
    from ..registry import resolve_patterns
    from ..tune_patterns import Job

    patterns = resolve_patterns(args.pattern)
    overrides = shape_overrides(args.shape)
    if overrides and len(patterns) > 1:
        raise AutofuseError("--shape applies to one pattern; drop it with several patterns")
    base = "small" if args.small else "default"
    return [Job(pattern, pattern.resolve_shape(overrides, base=base),
                pattern.check_dtype(args.dtype or pattern.dtypes[0])) for pattern in patterns]


def target_of(args, need_device: str | None = None):
    """--target as a TVM target; with ``need_device`` (what the command does there, for the error),
    its device must be on this machine."""
    from ..target import parse_target

    target = parse_target(args.target)
    if need_device is not None:
        require_device(target, need_device)
    return target


def require_device(target, doing: str) -> None:
    """Before any work: the target's device must be on this machine (a CUDA target on a machine
    without a GPU would otherwise fail deep inside TVM, after a minute of setup)."""
    from ..target import device_for
    if not device_for(target).exist:
        raise AutofuseError(f"no {target.kind.name} device on this machine: {doing}")


def open_database(args, target, *, none_allowed: bool = False):
    """The tuning database under --db for ``target``; with ``none_allowed``, ``--db none`` is None (no records)."""
    if none_allowed and args.db == "none":
        return None
    from ..database import TuningDatabase
    return TuningDatabase(args.db, target)


def check_writable(folder: str) -> None:
    """Before any work: the folder must exist as a writable directory or be creatable."""
    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    probe = probe or "."
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise AutofuseError(f"report folder {folder} cannot be written ({probe} is not a writable directory)")


def print_matches(prepared) -> None:
    """What the import did (folded nodes, TVM's warnings: counted, not shown) and which patterns
    ``--fusion patterns`` found in a model."""
    print(f"autofuse: imported {prepared.name}: {prepared.notes.summary()}", file=sys.stderr)
    if prepared.fusion != "patterns":
        return
    if prepared.matches:
        found = ", ".join(f"{name} x{count}" for name, count in sorted(prepared.matches.items()))
        print(f"autofuse: matched patterns in {prepared.name}: {found}", file=sys.stderr)
    else:
        print(f"autofuse: no pattern matched in {prepared.name}; everything goes through auto fusion", file=sys.stderr)
