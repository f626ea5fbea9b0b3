"""MetaSchedule's worker processes forked from a process that has already imported what they import.

Every tuning session starts a build process (autofuse.tune.PooledBuilder) and a run process
(MetaSchedule's LocalRunner; RPCRunner's too), each ``python -m tvm.exec.popen_worker``: a fresh
interpreter importing TVM and autofuse, about 2.5 s of CPU before its first job, 5 s a session, and
the tests run dozens of sessions (in the test process and in the commands they fork). Here TVM's
``PopenWorker._start`` asks a zygote instead: a process started once per test process that has
imported them (and nothing else ran in it: no thread, no kernel, no thread pool), and forks a worker
for each request. The worker is then what ``python -m tvm.exec.popen_worker READ WRITE`` would be but
for the imports: its own process with the requester's environment, working directory, stdout and
stderr and the two pipes (passed over a Unix socket), running TVM's own ``popen_worker.main``; it
exits when its pipes close, as TVM's does. The requester gets a ``subprocess.Popen`` stand-in (pid,
poll, wait, kill) on the worker's pidfd, so TVM's pool kills, restarts and recycles workers as it
would its own (a crash, a timeout, ``maximum_process_uses``).

Where the zygote cannot be reached (not started, no pidfd here, AUTOFUSE_TEST_FRESH_WORKERS=1), a
worker is started as TVM starts it.
"""

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

ADDRESS = "AUTOFUSE_TEST_POPEN_ZYGOTE"  # environment variable: the zygote's socket path
# What a build or run worker imports before its first job (autofuse.tune._import_autofuse for the
# builder; MetaSchedule's worker functions).
PRELOAD = ("cloudpickle", "tvm", "tvm.support.popen_pool", "tvm.exec.popen_worker", "tvm.s_tir.meta_schedule",
           "autofuse.verify", "autofuse.tune")


# ---------------------------------------------------------------- the zygote process


def _worker(connection, listener, header, fds):
    """Become ``python -m tvm.exec.popen_worker READ WRITE``; leaves only by SystemExit."""
    read_fd, write_fd, out_fd, err_fd = fds
    listener.close()
    connection.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (out_fd, err_fd):
        if fd > 2:
            os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    os.environ.clear()
    os.environ.update(header["env"])
    os.chdir(header["cwd"])
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    sys.argv = [sys.argv[0], str(read_fd), str(write_fd)]
    from tvm.exec import popen_worker

    popen_worker.main()
    sys.exit(0)


def _serve(path):
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # as the CLI fork server does: a worker's collections do not walk (nor copy) the preload
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([listener, 0], [], [], 1.0)
        while True:  # reap the workers that have ended (their requesters watch their pidfds)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if 0 in readable and not os.read(0, 4096):
            return  # the test process has gone
        if listener not in readable:
            continue
        connection, _ = listener.accept()
        with connection:
            try:
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
                header = json.loads(message)
            except (OSError, ValueError):
                continue
            if len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _worker(connection, listener, header, fds)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            try:
                socket.send_fds(connection, [json.dumps({"pid": pid}).encode()], [pidfd])
            except OSError:
                os.kill(pid, signal.SIGKILL)
            finally:
                os.close(pidfd)


# ---------------------------------------------------------------- the test process: start and stop it

_zygote = None  # the zygote process once started; False: it failed to start
_folder = None  # the folder of its socket, made by ``configure``
_lock = threading.Lock()  # TVM's pools start their workers from threads of their own


def configure():
    """Name this test process's zygote socket in ADDRESS, before any command is forked (they
    inherit the variable, and the CLI fork server restarts when the environment changes); the
    zygote itself starts on first use (``start``). Each test process (each xdist worker) has its own,
    whatever it inherited."""
    global _folder
    if _usable() and _folder is None:
        _folder = tempfile.mkdtemp(prefix="autofuse-zygote-")
        os.environ[ADDRESS] = os.path.join(_folder, "socket")


def start():
    """Start the zygote at ADDRESS, once: before this process forks a command or starts a worker.
    A command cannot start it (it would end with the command)."""
    global _zygote
    with _lock:
        path = os.environ.get(ADDRESS)
        if _zygote is not None or _folder is None or path != os.path.join(_folder, "socket"):
            return
        _zygote = False
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        if not ready or proc.stdout.readline() != b"ready\n":
            proc.kill()
            proc.wait()
            return
        _zygote = proc


def stop():
    """End the zygote (its workers end with their requesters' pipes) and remove its socket."""
    global _zygote, _folder
    if _zygote:
        _zygote.stdin.close()  # the zygote exits at the end of its input
        try:
            _zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _zygote.kill()
            _zygote.wait()
    _zygote = None
    if _folder is not None:
        for name in os.listdir(_folder):
            os.unlink(os.path.join(_folder, name))
        os.rmdir(_folder)
        _folder = None


def _usable():
    return (os.environ.get("AUTOFUSE_TEST_FRESH_WORKERS") != "1" and hasattr(os, "pidfd_open")
            and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "send_fds"))


# ---------------------------------------------------------------- a requester: TVM's PopenWorker


class ZygoteWorker:
    """The part of ``subprocess.Popen`` TVM's PopenWorker uses, for a worker the zygote forked:
    pid, returncode, poll, wait, kill (through its pidfd, never another process given its pid)."""

    def __init__(self, pid, pidfd):
        self.pid, self._pidfd = pid, pidfd
        self.returncode = None
        self.args = ["tvm.exec.popen_worker", f"(forked by {__name__})"]

    def _ended(self, timeout):
        if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
            self.returncode = -1  # ended; its status went to the zygote, which reaps it
        return self.returncode is not None

    def poll(self):
        self._ended(0)
        return self.returncode

    def wait(self, timeout=None):
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if not self._ended(0):
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def __del__(self):
        try:
            os.close(self._pidfd)
        except (OSError, AttributeError, TypeError):
            pass


def _stream_fd(stream, default):
    """The fd a PopenWorker's stdout/stderr argument names (None: this process's own), or None
    where the zygote cannot give it (a pipe back to this process)."""
    if stream is None:
        return os.dup(default)
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY)
    if isinstance(stream, int) and stream >= 0:
        return os.dup(stream)
    if hasattr(stream, "fileno"):
        return os.dup(stream.fileno())
    return None


def spawn(read_fd, write_fd, stdout=None, stderr=None):
    """A worker forked by the zygote, reading ``read_fd`` and writing ``write_fd``; None where no
    zygote answers (the caller then starts one as TVM does)."""
    path = os.environ.get(ADDRESS)
    if not path or not _usable() or stdout == subprocess.PIPE or stderr == subprocess.PIPE:
        return None
    out = _stream_fd(stdout, 1)
    err = (os.dup(out) if out is not None else None) if stderr == subprocess.STDOUT else _stream_fd(stderr, 2)
    if out is None or err is None:
        for fd in (out, err):
            if fd is not None:
                os.close(fd)
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(path)
            header = {"env": dict(os.environ), "cwd": os.getcwd()}
            socket.send_fds(connection, [json.dumps(header).encode()], [read_fd, write_fd, out, err])
            message, fds, _, _ = socket.recv_fds(connection, 4096, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        return ZygoteWorker(json.loads(message)["pid"], fds[0])
    except (OSError, ValueError):
        return None
    finally:
        os.close(out)
        os.close(err)


def use_zygote(owner=False):
    """TVM's PopenWorker starts its process through the zygote (when one answers); ``owner``: this
    is the test process, which starts the zygote on the first worker it needs."""
    from tvm.support import popen_pool

    fresh = popen_pool.PopenWorker._start
    if getattr(fresh, "from_zygote", False):
        return

    def _start(self):
        if self._proc is not None:
            return
        if owner:
            start()
        main_read, worker_write = os.pipe()
        worker_read, main_write = os.pipe()
        proc = spawn(worker_read, worker_write, self._stdout, self._stderr)
        if proc is None:
            for fd in (main_read, worker_write, worker_read, main_write):
                os.close(fd)
            fresh(self)
            return
        os.close(worker_read)
        os.close(worker_write)
        self._proc = proc
        self._reader = os.fdopen(main_read, "rb")
        self._writer = os.fdopen(main_write, "wb")

    _start.from_zygote = True
    popen_pool.PopenWorker._start = _start


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run ends it through its stdin
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's autofuse
    _serve(sys.argv[1])
