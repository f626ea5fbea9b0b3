"""A process that has imported what ``autofuse`` commands import (TVM, MetaSchedule, the patterns,
the CPU tensor intrinsics: ~7 s of CPU a process) and forks a child for each command the tests run
(conftest.start_cli and run_cli).

The child is then a fresh ``python -m autofuse.cli ARGS`` but for the imports (frozen out of the
garbage collector's sight: ``gc.freeze``), the tests' smaller search (tests/small_search.py) and
their build and run workers (tests/popen_zygote.py): its own process, its own cwd, environment,
stdout and stderr, exit code, atexit handlers and interpreter shutdown, no pytest in it. Several
children may run at once.

Protocol, one JSON line each way on stdin/stdout. The parent sends
``{"id", "args", "cwd", "env", "stdout", "stderr"}`` (the last two: file paths) to start a command,
answered ``{"id", "pid"}`` at once and ``{"id", "returncode", "cpu_seconds"}`` when the child has
ended (returncode negative: killed by a signal; cpu_seconds: the child's and its waited-for
children's); ``{"id", "signal"}`` signals a child that has not been reaped yet (through its pidfd:
never another process that got its pid). End of input: the remaining children are killed, and the
server exits once they are reaped.
"""

import gc
import json
import os
import resource
import runpy
import select
import signal
import sys

from popen_zygote import use_zygote
from small_search import use_small_search

# What autofuse/cli.py imports, not cli itself: runpy runs that as __main__ (and warns if it is loaded).
PRELOAD = ("autofuse.baselines", "autofuse.commands", "autofuse.registry", "tvm.relax", "tvm.s_tir.meta_schedule",
           "onnx")


def _preload():
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from autofuse.registry import all_patterns
    from autofuse.target import parse_target
    from autofuse.tune import register_tensor_intrinsics

    all_patterns()
    register_tensor_intrinsics(parse_target("llvm"))  # what every CPU tuning session does first
    use_small_search()
    use_zygote()  # the commands' build and run processes: forked by the test process's zygote


def _child(request, inherited):
    """Become ``python -m autofuse.cli ARGS``: returns only by raising SystemExit or the command's
    own exception, which the interpreter then handles as it would in a fresh process."""
    for fd in inherited:
        os.close(fd)
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


def _cpu_seconds(usage):
    return usage.ru_utime + usage.ru_stime


def main():
    sys.path[0] = os.getcwd()  # as under ``python -m``, not this file's folder
    _preload()
    # What the preload made lives as long as the server: out of the collector's sight, a command's
    # garbage collections (its exit's included: 0.2 of its 0.26 s) do not walk it, nor copy the
    # pages it sits on (Python's advice for a process that forks without exec).
    gc.freeze()
    _reply(ready=True, cpu_seconds=_cpu_seconds(resource.getrusage(resource.RUSAGE_SELF)))
    children = {}  # pidfd -> (request id, pid)
    pending = b""
    reading = True
    while reading or children:
        readable, _, _ = select.select(([0] if reading else []) + list(children), [], [])
        for fd in readable:
            if fd != 0:
                request_id, pid = children.pop(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                _reply(id=request_id, returncode=os.waitstatus_to_exitcode(status), cpu_seconds=_cpu_seconds(usage))
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                reading = False
                for pidfd in children:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                continue
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "signal" in request:
                    for pidfd, (request_id, _) in children.items():
                        if request_id == request["id"]:
                            signal.pidfd_send_signal(pidfd, request["signal"])
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, list(children))
                children[os.pidfd_open(pid)] = (request["id"], pid)
                _reply(id=request["id"], pid=pid)


if __name__ == "__main__":
    main()
