import atexit
import inspect
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FORKSERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_forkserver.py")


def _getmodule_without_a_futile_scan(real):
    """TVMScript's parser calls ``inspect.stack()`` for every ``T.prim_func`` and buffer it parses.
    For a frame whose file is not on disk (``<frozen runpy>`` under ``python -m pytest``,
    ``<frozen importlib._bootstrap>`` inside an import), ``inspect.getmodule`` then scans all of
    ``sys.modules`` (thousands of modules in a test session), three times a frame, and finds none:
    that made every TensorIR parse here 4x slower, and the import of TVM's CUDA tensor
    intrinsics (~500 parses) 50 s of CPU instead of 3. Such a frame gets what the scan would give
    it, without the scan: the module its name was already mapped to, else None."""
    def getmodule(object, _filename=None):
        if _filename is not None and _filename[:1] == "<" and _filename[-1:] == ">" and inspect.isframe(object):
            name = inspect.modulesbyfile.get(_filename) or inspect.modulesbyfile.get(
                os.path.normcase(os.path.abspath(_filename)))
            return sys.modules.get(name) if name else None
        return real(object, _filename)
    return getmodule


inspect.getmodule = _getmodule_without_a_futile_scan(inspect.getmodule)

SEARCH_POPULATION = 64


def _smaller_search_population():
    """The tests tune budgets of 1 to 24 trials, for which MetaSchedule's evolutionary search still
    breeds 512 candidates a round: most of a small session's CPU (4 patterns x 1 trial: 125 s of
    CPU, 36 s with a population of 16). Tuning in the test process searches with SEARCH_POPULATION
    instead: the same EvolutionarySearch, a smaller population."""
    from tvm.s_tir.meta_schedule.search_strategy import EvolutionarySearch, SearchStrategy

    default = SearchStrategy.create

    def create(kind="evolutionary", *args, **kwargs):
        if kind == "evolutionary" and not args and not kwargs:
            return EvolutionarySearch(population_size=SEARCH_POPULATION)
        return default(kind, *args, **kwargs)

    SearchStrategy.create = staticmethod(create)


_smaller_search_population()


class _ForkServer:
    """tests/cli_forkserver.py, started on the first command: each command a child forked from it."""

    def __init__(self):
        self.env = _environment()
        self.folder = tempfile.mkdtemp(prefix="autofuse-cli-")
        self.proc = subprocess.Popen([sys.executable, _FORKSERVER], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=False)
        self.pending = b""
        self.count = 0
        ready = self._read(600)
        if ready.get("ready") is not True:
            raise RuntimeError("tests/cli_forkserver.py did not start")
        global forked_cpu_seconds
        forked_cpu_seconds += ready["cpu_seconds"]

    def _read(self, timeout):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return {}
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"tests/cli_forkserver.py exited ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, args, cwd, timeout):
        self.count += 1
        out, err = (os.path.join(self.folder, f"{self.count}.{name}") for name in ("out", "err"))
        request = {"args": list(args), "cwd": os.path.abspath(cwd), "env": dict(os.environ), "stdout": out,
                   "stderr": err}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(60)["pid"]
        reply = self._read(timeout)
        timed_out = not reply
        if timed_out:
            os.kill(pid, signal.SIGKILL)
            reply = self._read(60)
        global forked_cpu_seconds
        forked_cpu_seconds += reply.get("cpu_seconds", 0.0)
        stdout, stderr = (_read_text(path) for path in (out, err))
        if timed_out:
            raise subprocess.TimeoutExpired(["autofuse", *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["autofuse", *args], reply["returncode"], stdout, stderr)

    def close(self):
        try:
            self.proc.stdin.close()  # the server's loop ends, and it exits
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    os.unlink(path)
    return text


_server = None
forked_cpu_seconds = 0.0  # CPU time of the commands run through the fork server (getrusage cannot see them)


def _environment():
    """What a command's imports may have read from the environment (pytest names the running test
    in PYTEST_CURRENT_TEST; the child gets that too)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def run_cli(*args, cwd=None, timeout=900):
    """``autofuse ARGS`` in a fresh process, as a user runs it. The process is forked from one that
    has already imported TVM and the patterns (tests/cli_forkserver.py), unless the environment
    changed since that one started or AUTOFUSE_TEST_FRESH_CLI=1: then it is ``python -m autofuse.cli``."""
    global _server
    if os.environ.get("AUTOFUSE_TEST_FRESH_CLI") != "1" and hasattr(os, "fork") and _server is not False:
        if _server is None or _server.proc.poll() is not None:
            try:
                _server = _ForkServer()
                atexit.register(_server.close)
            except RuntimeError:  # e.g. an import error: a fresh process shows it in its stderr
                _server = False
        if _server and _server.env == _environment():
            return _server.run(args, cwd or REPO, timeout)
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)


@pytest.fixture(scope="session")
def tuned_db(tmp_path_factory):
    """One tiny tuning run shared by the tests that need records: linear_bias_relu at its small
    shape, 8 trials of the union space."""
    root = tmp_path_factory.mktemp("db")
    result = run_cli("tune", "--pattern", "linear_bias_relu", "--small", "--trials", "8", "--seed", "1",
                     "--db", str(root), "--no-progress", "--json", str(root / "rows.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


@pytest.fixture(scope="session")
def built_mlp(tmp_path_factory):
    """models/mlp.onnx built with --fusion patterns and no records."""
    out = tmp_path_factory.mktemp("built") / "mlp.so"
    result = run_cli("build", os.path.join(REPO, "models", "mlp.onnx"), "--db", "none", "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out
