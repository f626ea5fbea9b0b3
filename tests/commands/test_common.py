"""The flags several commands share are parsed the same way by each (parent parsers), and the
``--shape`` syntax is one rule. In-process and without TVM: argument parsing only."""

import argparse

import pytest

from autofuse.cli import _build_parser
from autofuse.commands.common import shape_overrides
from autofuse.errors import AutofuseError


def _subparsers(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _subparsers(sub, (*prefix, name))


SHARED_DEFAULTS = {"db": "logs", "target": "llvm", "fusion": "patterns", "pattern": None, "shape": None,
                   "small": False, "dtype": None}
REQUIRED = {("build",): ["m.onnx"], ("run",): ["m.so"], ("rpc", "server"): ["--tracker", "h:1", "--key", "k"]}


def test_every_command_that_takes_a_shared_flag_parses_it_alike():
    commands = dict(_subparsers(_build_parser()))
    seen = {}
    for path, parser in commands.items():
        if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            continue  # db and rpc: their actions hold the flags
        args = parser.parse_args(REQUIRED.get(path, []))
        for dest, default in SHARED_DEFAULTS.items():
            if hasattr(args, dest):
                assert getattr(args, dest) == default, (path, dest)
                seen.setdefault(dest, []).append(path)
    assert len(seen["db"]) == 6 and len(seen["target"]) == 4 and len(seen["fusion"]) == 2
    assert commands[("tune",)].parse_args(["--shape", "m=8", "--shape", "n=4"]).shape == ["m=8", "n=4"]


def test_shape_overrides_are_repeatable_and_comma_separated():
    assert shape_overrides(["m=8,n=4", "k=2", ""]) == {"m": "8", "n": "4", "k": "2"}
    assert shape_overrides(None) == {}
    for bad in ("m", "m=", "=8"):
        with pytest.raises(AutofuseError, match="key=value"):
            shape_overrides([bad])
