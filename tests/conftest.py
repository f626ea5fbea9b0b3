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

import popen_zygote
from small_search import use_small_search

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

use_small_search()
# MetaSchedule's build and run processes, here and in the commands forked below, forked from a
# process that has imported TVM (tests/popen_zygote.py); named before any command is forked.
popen_zygote.configure()
popen_zygote.use_zygote(owner=True)
# Two test workers share 2 cores: each runs TVM's kernels on one (autofuse would use them all).
os.environ.setdefault("TVM_NUM_THREADS", "1")


class CliProcess:
    """An ``autofuse`` command forked by tests/cli_forkserver.py, with the part of ``subprocess.Popen``
    the tests use: pid, returncode, poll, wait, communicate (text), send_signal, kill."""

    def __init__(self, server, request_id, args, pid, paths):
        self.server, self.id, self.args, self.pid, self.paths = server, request_id, args, pid, paths
        self.returncode = None
        self.output = None

    def poll(self):
        self.server.pump(0)
        return self.returncode

    def wait(self, timeout=None):
        if not self.server.pump_until(lambda: self.returncode is not None, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        if self.output is None:
            self.output = tuple(_read_text(path) for path in self.paths)
        return self.output

    def send_signal(self, sig):
        if self.returncode is None:
            self.server.send({"id": self.id, "signal": int(sig)})

    def kill(self):
        self.send_signal(signal.SIGKILL)


class _ForkServer:
    """tests/cli_forkserver.py, started on the first command: each command a child forked from it."""

    def __init__(self):
        self.env = _environment()
        self.folder = tempfile.mkdtemp(prefix="autofuse-cli-")
        self.proc = subprocess.Popen([sys.executable, _FORKSERVER], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=False)
        self.pending = b""
        self.count = 0
        self.started = {}  # request id -> pid
        self.running = {}  # request id -> CliProcess
        self.cpu_seconds = 0.0
        ready = self._read(600)
        if ready.get("ready") is not True:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RuntimeError("tests/cli_forkserver.py did not start")
        self._count_cpu(ready["cpu_seconds"])

    def _count_cpu(self, seconds):
        global forked_cpu_seconds
        forked_cpu_seconds += seconds
        self.cpu_seconds += seconds

    def _read(self, timeout):
        """The next reply, or {} after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return {}
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"tests/cli_forkserver.py exited ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def pump(self, timeout):
        """Take one reply (waiting at most ``timeout`` seconds); False if none came."""
        reply = self._read(timeout)
        if not reply:
            return False
        if "pid" in reply:
            self.started[reply["id"]] = reply["pid"]
        else:
            self._count_cpu(reply["cpu_seconds"])
            self.running.pop(reply["id"]).returncode = reply["returncode"]
        return True

    def pump_until(self, done, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self.pump(left):
                return done()
        return True

    def send(self, request):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def start(self, args, cwd):
        self.count += 1
        request_id = self.count
        paths = tuple(os.path.join(self.folder, f"{request_id}.{name}") for name in ("out", "err"))
        self.send({"id": request_id, "args": list(args), "cwd": os.path.abspath(cwd), "env": dict(os.environ),
                   "stdout": paths[0], "stderr": paths[1]})
        if not self.pump_until(lambda: request_id in self.started, 60):
            raise RuntimeError("tests/cli_forkserver.py did not fork")
        proc = CliProcess(self, request_id, ["autofuse", *args], self.started.pop(request_id), paths)
        self.running[request_id] = proc
        return proc

    def close(self):
        if self.proc.returncode is None:
            try:
                self.proc.stdin.close()  # the server kills what still runs, reaps it, and exits
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._count_cpu(-self.cpu_seconds)  # reaped: getrusage's children's time has it now
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    os.unlink(path)
    return text


_server = None
_servers = []  # every one started, closed (reaped) when pytest ends
# CPU time of the fork servers and their commands that getrusage cannot see yet (until a server is reaped)
forked_cpu_seconds = 0.0


# Set by importing jax (a test's compare, a baseline), read by jax and XLA alone, which the fork
# server does not import: its imports are the same with them, and each command gets them anyway
# (it runs in the test's environment of the moment).
_NOT_READ_BY_THE_SERVER = {"PYTEST_CURRENT_TEST", "TF_CPP_MIN_LOG_LEVEL", "TPU_SKIP_MDS_QUERY"}


def _environment():
    """The environment a fork server's imports saw, or would see now (pytest names the running test
    in PYTEST_CURRENT_TEST; a command gets that too)."""
    return {k: v for k, v in os.environ.items() if k not in _NOT_READ_BY_THE_SERVER}


def _fork_server():
    """The running fork server, started on first use and again when the environment has changed
    since (its imports saw that environment; see _NOT_READ_BY_THE_SERVER for what does not count); None
    where commands get a fresh interpreter: AUTOFUSE_TEST_FRESH_CLI=1, no pidfd here, or the
    server failed to start."""
    global _server
    if os.environ.get("AUTOFUSE_TEST_FRESH_CLI") == "1" or not hasattr(os, "pidfd_open") or _server is False:
        return None
    if _server is not None and (_server.proc.poll() is not None or _server.env != _environment()):
        if not _server.running:  # else it serves its commands until they end, and exits with pytest
            _server.close()
        _server = None
    if _server is None:
        try:
            _server = _ForkServer()
        except RuntimeError:  # e.g. an import error: a fresh process shows it in its stderr
            _server = False
            return None
        _servers.append(_server)
    return _server


@atexit.register
def _close_fork_servers():
    for server in _servers:
        server.close()
    popen_zygote.stop()


def pytest_unconfigure(config):
    _close_fork_servers()  # also in an xdist worker, which may end without atexit


def start_cli(*args, cwd=None):
    """``autofuse ARGS`` started in its own process, as a user starts it; stdout and stderr are
    captured. The process is forked from one that has already imported TVM and the patterns
    (tests/cli_forkserver.py), or else is ``python -m autofuse.cli`` (see _fork_server)."""
    popen_zygote.start()  # before the command: it cannot start one that outlives it
    server = _fork_server()
    if server is not None:
        return server.start(args, cwd or REPO)
    return subprocess.Popen([sys.executable, "-m", "autofuse.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd or REPO)


def run_cli(*args, cwd=None, timeout=900):
    """``autofuse ARGS`` run to its end, as ``subprocess.run`` does (see start_cli)."""
    proc = start_cli(*args, cwd=cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(["autofuse", *args], timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(["autofuse", *args], proc.returncode, stdout, stderr)


def store_roofline(db_root) -> None:
    """Roofline figures stored in ``db_root`` for this CPU, so a benchmark run there does not spend
    half a minute measuring them."""
    import dataclasses
    import json
    import pathlib

    from autofuse.roofline import Machine
    from autofuse.target import host_cores, parse_target, target_key

    folder = pathlib.Path(db_root) / target_key(parse_target("llvm"))
    folder.mkdir(parents=True)
    machine = Machine(10.0, 100.0, "test", "test", host_cores(), bandwidth_ladder=[[1 << 20, 20.0], [1 << 28, 10.0]],
                      peak_label="FMA peak")
    (folder / "roofline.json").write_text(json.dumps(dataclasses.asdict(machine)))


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
