"""Which code ran: the commit that a compare run's report and a kernel record carry."""

from __future__ import annotations

import os
import re
import subprocess

from .errors import AutofuseError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_commit(explicit: str | None = None) -> dict:
    """The commit of the code that runs: ``explicit`` (--commit), else $AUTOFUSE_COMMIT, else
    ``git rev-parse HEAD`` of the checkout this package lives in (with whether its tracked files
    differ from it); "unknown" when none says, never another repository's commit."""
    for value, source in ((explicit, "--commit"), (os.environ.get("AUTOFUSE_COMMIT"), "AUTOFUSE_COMMIT")):
        if value:
            if not re.fullmatch(r"[0-9a-fA-F]{7,40}", value.strip()):
                raise AutofuseError(f"{source} {value!r} is not a commit id (7 to 40 hex digits)")
            return {"commit": value.strip().lower(), "source": source, "dirty": None}

    def git(*args) -> str | None:
        try:
            done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(ROOT):  # no checkout, or an enclosing one
        return {"commit": "unknown", "source": "no git checkout here (pass --commit or AUTOFUSE_COMMIT)",
                "dirty": None}
    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head or "unknown", "source": "git rev-parse HEAD",
            "dirty": bool(status) if status is not None else None}
