"""A process that has imported what ``autofuse`` commands import (TVM, MetaSchedule, the patterns:
~5 s of CPU a process) and forks a child for each command the tests run (conftest.run_cli).

The child is then a fresh ``python -m autofuse.cli ARGS`` but for the imports: its own process, its
own cwd, stdout and stderr, exit code, atexit handlers and interpreter shutdown, no pytest in it.
Protocol, one JSON line each way on stdin/stdout: the parent sends
``{"args", "cwd", "env", "stdout", "stderr"}`` (the last two: file paths); this process answers
``{"pid"}`` at once and ``{"returncode", "cpu_seconds"}`` when the child has ended (returncode
negative: killed by a signal; cpu_seconds: the child's and its waited-for children's).
"""

import json
import os
import resource
import runpy
import sys

# What autofuse/cli.py imports, not cli itself: runpy runs that as __main__ (and warns if it is loaded).
PRELOAD = ("autofuse.baselines", "autofuse.commands", "autofuse.registry", "tvm.relax", "tvm.s_tir.meta_schedule",
           "onnx")


def _preload():
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from autofuse.registry import all_patterns
    all_patterns()


def _child(request):
    """Become ``python -m autofuse.cli ARGS``: returns only by raising SystemExit or the command's
    own exception, which the interpreter then handles as it would in a fresh process."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        out = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.argv = ["-m", *request["args"]]
    runpy.run_module("autofuse.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)


def _reply(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main():
    sys.path[0] = os.getcwd()  # as under ``python -m``, not this file's folder
    _preload()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _reply(ready=True, cpu_seconds=usage.ru_utime + usage.ru_stime)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        _reply(pid=pid)
        _, status, usage = os.wait4(pid, 0)
        _reply(returncode=os.waitstatus_to_exitcode(status), cpu_seconds=usage.ru_utime + usage.ru_stime)


if __name__ == "__main__":
    main()
