"""Finds the patterns under ``search_spaces/`` and looks them up by name.

Every module in the ``search_spaces`` package tree that defines a module-level ``PATTERN`` is one
pattern; no list to keep up to date.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil

from .errors import AutofuseError
from .pattern import Pattern


@functools.cache
def all_patterns() -> dict[str, Pattern]:
    import search_spaces

    found: dict[str, Pattern] = {}
    for info in pkgutil.walk_packages(search_spaces.__path__, prefix="search_spaces."):
        module = importlib.import_module(info.name)
        pattern = getattr(module, "PATTERN", None)
        if not isinstance(pattern, Pattern):
            continue
        if pattern.name in found:
            raise RuntimeError(f"two patterns named {pattern.name!r}: {info.name} and another module")
        found[pattern.name] = pattern
    return dict(sorted(found.items(), key=lambda item: (item[1].family, item[0])))


def get_pattern(name: str) -> Pattern:
    patterns = all_patterns()
    if name in patterns:
        return patterns[name]
    close = difflib.get_close_matches(name, patterns, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise AutofuseError(f"unknown pattern {name!r}{hint}; known: {', '.join(patterns)}")


def resolve_patterns(name: str) -> list[Pattern]:
    """``all``, one pattern name, or several separated by commas."""
    if name == "all":
        return list(all_patterns().values())
    return [get_pattern(n.strip()) for n in name.split(",") if n.strip()]
