"""The flags several commands share are parsed the same way by each (parent parsers), and the
``--shape`` syntax is one rule. In-process and without TVM: argument parsing only."""

import argparse

import pytest

from autofuse.cli import _build_parser
from autofuse.commands.common import input_shapes, shape_overrides
from autofuse.errors import AutofuseError


def _subparsers(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _subparsers(sub, (*prefix, name))


SHARED_DEFAULTS = {"db": "logs", "target": "llvm", "fusion": "patterns", "pattern": None, "shape": None,
                   "small": False, "dtype": None, "input_shape": None}
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
    assert sorted(seen["input_shape"]) == [("build",), ("compare",), ("run",), ("tune",)]
    assert commands[("tune",)].parse_args(["--shape", "m=8", "--shape", "n=4"]).shape == ["m=8", "n=4"]


def test_shape_overrides_are_repeatable_and_comma_separated():
    assert shape_overrides(["m=8,n=4", "k=2", ""]) == {"m": "8", "n": "4", "k": "2"}
    assert shape_overrides(None) == {}
    for bad in ("m", "m=", "=8"):
        with pytest.raises(AutofuseError, match="key=value"):
            shape_overrides([bad])


def test_input_shapes_are_repeatable_and_comma_separated():
    assert input_shapes(["input_ids=1x128,attention_mask=1x128", "input.1=2x3x224x224"]) == {
        "input_ids": (1, 128), "attention_mask": (1, 128), "input.1": (2, 3, 224, 224)}
    assert input_shapes(["x=7"]) == {"x": (7,)}
    assert input_shapes(None) is None


@pytest.mark.parametrize("bad, message", [
    ("input_ids", "NAME=DIMS"), ("=1x2", "NAME=DIMS"), ("input_ids=", "NAME=DIMS"),
    ("input_ids=1x0", "'0' is not a positive size"), ("input_ids=1xN", "'N' is not a positive size"),
    ("input_ids=1,128", "NAME=DIMS"), ("input_ids=-1x8", "'-1' is not"), ("input_ids=1x\u00b2", "is not"),
    ("x=1,x=2", "gives 'x' twice")])
def test_bad_input_shapes_are_one_error_each(bad, message):
    with pytest.raises(AutofuseError, match=message):
        input_shapes([bad.encode().decode("unicode_escape")])
