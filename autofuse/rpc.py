"""Measuring on other machines through TVM's RPC tracker.

Owns: the ``--rpc HOST:PORT:KEY`` address, the reachability check (a clear error instead of TVM's
minute of silent retries), MetaSchedule's ``RPCRunner`` wrapped so that a candidate whose RPC
session was lost (a server killed or unplugged mid-measurement) is measured once more on another
server, the tracker's queue summary, and the commands that start TVM's own tracker and servers.
Nothing here is a protocol of ours: the tracker, the servers and the runner are TVM's.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .errors import AutofuseError

DEFAULT_TRACKER_PORT = 9190
DEFAULT_SERVER_PORT = 9090
# The marker MetaSchedule's RPCRunner puts before an exception raised while talking to a server
# (as opposed to its own timeout message, which a slow kernel earns and should keep).
_SESSION_ERROR = "RPCRunner: An exception occurred"


@dataclasses.dataclass(frozen=True)
class TrackerAddress:
    host: str
    port: int
    key: str | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" + (f":{self.key}" if self.key else "")


def parse_address(text: str, need_key: bool = True) -> TrackerAddress:
    """``HOST:PORT:KEY`` (or ``HOST:PORT`` when ``need_key`` is off)."""
    parts = text.rsplit(":", 2) if need_key else text.rsplit(":", 1)
    form = "HOST:PORT:KEY" if need_key else "HOST:PORT"
    if len(parts) != (3 if need_key else 2) or not all(parts):
        raise AutofuseError(f"RPC tracker address {text!r} is not {form} (e.g. 127.0.0.1:9190{':cpu' if need_key else ''})")
    try:
        port = int(parts[1], 10)
    except ValueError:
        raise AutofuseError(f"RPC tracker port {parts[1]!r} in {text!r} is not a number") from None
    if not 0 < port < 65536:
        raise AutofuseError(f"RPC tracker port {port} in {text!r} is out of range")
    return TrackerAddress(parts[0], port, parts[2] if need_key else None)


def summary(address: TrackerAddress, timeout: float = 5.0) -> dict:
    """The tracker's ``summary()`` (servers and queue per key), or a one-line AutofuseError."""
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout):
            pass
    except OSError as err:
        raise AutofuseError(f"cannot reach the RPC tracker at {address.host}:{address.port}: {err.strerror or err}. "
                            f"Start one with `autofuse rpc tracker --port {address.port}`") from None
    # A port that accepts but does not speak the tracker protocol would make TVM wait forever.
    result: dict = {}

    def ask():
        try:
            from tvm import rpc
            result["summary"] = rpc.connect_tracker(address.host, address.port).summary()
        except Exception as err:  # reported below as one line
            result["error"] = err

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout)
    if "summary" not in result:
        reason = str(result.get("error", f"no answer in {timeout:g} s")).strip().splitlines()[-1]
        raise AutofuseError(f"{address.host}:{address.port} is not answering as an RPC tracker: {reason}")
    return result["summary"]


def queue(info: dict, key: str) -> dict:
    """``{"total", "free", "pending"}`` servers and requests of ``key`` in a tracker summary."""
    entry = info.get("queue_info", {}).get(key, {})
    # Servers register as "server:KEY"; the queue only counts the free ones.
    total = sum(1 for item in info.get("server_info", []) if item.get("key") == f"server:{key}")
    return {"total": total, "free": int(entry.get("free", 0)), "pending": int(entry.get("pending", 0))}


def status_text(address: TrackerAddress) -> str:
    """Servers by key and the queue, one line each."""
    info = summary(address)
    lines = [f"tracker {address.host}:{address.port}"]
    servers = info.get("server_info", [])
    lines.append(f"servers: {len(servers)}")
    for item in servers:
        host, port = item.get("addr", ["?", "?"])[:2]
        lines.append(f"  {host}:{port}  key {str(item.get('key', '?')).removeprefix('server:')}")
    for key in sorted(info.get("queue_info", {})):
        counts = queue(info, key)
        lines.append(f"key {key}: {counts['total']} servers, {counts['free']} free, {counts['pending']} requests waiting")
    return "\n".join(lines)


def check_servers(address: TrackerAddress) -> int:
    """The number of servers registered under the address's key; an error when there are none."""
    counts = queue(summary(address), address.key)
    if counts["total"] == 0:
        raise AutofuseError(f"no RPC server is registered under key {address.key!r} at {address.host}:{address.port}: "
                            f"start one with `autofuse rpc server --tracker {address.host}:{address.port} "
                            f"--key {address.key}`")
    return counts["total"]


def bar_status(address: TrackerAddress):
    """``status()`` for the progress bar: the key's servers, how many are measuring and waiting."""
    def status() -> str:
        try:
            counts = queue(summary(address, timeout=2.0), address.key)
        except AutofuseError:
            return f"rpc {address.key}: tracker not answering"
        busy = counts["total"] - counts["free"]
        return f"rpc {address.key}: {busy}/{counts['total']} servers busy, {counts['pending']} waiting"
    return status


def rpc_alloc_arguments(session, device, args_info, alloc_repeat: int) -> list:
    """``tune.alloc_arguments`` on a server: integer tensors zeros (valid indices), the others
    filled by the server's random fill, as MetaSchedule's RPCRunner fills them."""
    from .tune import alloc_arguments
    return alloc_arguments(device, args_info, alloc_repeat,
                           f_random_fill=session.get_function("tvm.contrib.random.random_fill_for_measure"))


def make_runner(address: TrackerAddress, workers: int, timeout: float, retries: int = 1) -> ms.runner.Runner:
    """MetaSchedule's RPCRunner on ``address`` with ``workers`` measurements in flight, each
    candidate given ``timeout`` seconds; a lost session is retried ``retries`` times."""
    config = ms.runner.RPCConfig(tracker_host=address.host, tracker_port=address.port, tracker_key=address.key,
                                 session_timeout_sec=max(1, int(round(timeout))))
    inner = ms.runner.RPCRunner(rpc_config=config, max_workers=workers, f_alloc_argument=rpc_alloc_arguments)
    return RetryingRunner(inner, retries) if retries > 0 else inner


@derived_object
class _RetryFuture(ms.runner.PyRunnerFuture):
    def __init__(self, runner, runner_input, future, retries: int):
        super().__init__()
        self.runner = runner
        self.runner_input = runner_input
        self.future = future
        self.retries = retries

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> ms.runner.RunnerResult:
        result = self.future.result()
        while self.retries > 0 and result.error_msg and result.error_msg.startswith(_SESSION_ERROR):
            self.retries -= 1
            self.future = self.runner.run([self.runner_input])[0]
            result = self.future.result()
        return result


@derived_object
class RetryingRunner(ms.runner.PyRunner):
    """Another RPC attempt for a candidate whose session failed (the tracker hands it to a server
    that is still up); candidates that time out or fail to run are not retried."""

    def __init__(self, runner: ms.runner.Runner, retries: int = 1):
        super().__init__()
        self.runner = runner
        self.retries = retries

    def run(self, runner_inputs):
        futures = self.runner.run(runner_inputs)
        return [_RetryFuture(self.runner, item, future, self.retries) for item, future in zip(runner_inputs, futures)]


def tracker_command(host: str, port: int) -> list[str]:
    # TVM's default --port-end (9199) is below any port above it, which it then cannot bind.
    return [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port), "--port-end", str(port + 1)]


def server_command(tracker: TrackerAddress, key: str, host: str, port: int) -> list[str]:
    # --port-end gives the server room when the port is taken by another server on this host.
    return [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"{tracker.host}:{tracker.port}",
            "--key", key, "--host", host, "--port", str(port), "--port-end", str(port + 100)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalFarm:
    """A tracker and ``servers`` RPC servers as subprocesses on this host (loopback), for tests,
    benchmarks and one-host farms (one server per GPU: ``server_env`` gives each its own
    ``CUDA_VISIBLE_DEVICES``). ``with LocalFarm(2) as farm: farm.address`` is ``HOST:PORT:KEY``;
    leaving the block stops every process it started."""

    def __init__(self, servers: int, key: str = "local", host: str = "127.0.0.1", log_dir: str | None = None,
                 server_env=None, start_timeout: float = 120.0):
        self.count = servers
        self.key = key
        self.host = host
        self.log_dir = log_dir
        self.server_env = server_env or (lambda index: None)
        self.start_timeout = start_timeout
        self.tracker = None
        self.servers: list = []
        self.logs: list[str] = []
        self.port = 0

    @property
    def address(self) -> TrackerAddress:
        return TrackerAddress(self.host, self.port, self.key)

    def __enter__(self) -> "LocalFarm":
        import tempfile
        import os
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="autofuse-rpc-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.port = free_port()
        self.tracker = self._spawn(tracker_command(self.host, self.port), "tracker.log", None)
        try:
            self._wait(lambda: summary(TrackerAddress(self.host, self.port), timeout=2.0), "the tracker",
                       [self.tracker])
            for index in range(self.count):
                self.start_server(index)
            self._wait(lambda: self._registered() >= self.count or None, f"{self.count} server(s)", self.servers)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start_server(self, index: int):
        command = server_command(TrackerAddress(self.host, self.port), self.key, self.host, free_port())
        process = self._spawn(command, f"server{index}.log", self.server_env(index))
        self.servers.append(process)
        return process

    def _registered(self) -> int:
        return queue(summary(self.address, timeout=2.0), self.key)["total"]

    def _spawn(self, command: list[str], log_name: str, env):
        import os
        import subprocess
        path = os.path.join(self.log_dir, log_name)
        self.logs.append(path)
        environment = dict(os.environ, **(env or {}))
        with open(path, "ab") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                    start_new_session=True)

    def _wait(self, probe, what: str, processes) -> None:
        import time
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                raise AutofuseError(f"{what} exited while starting (logs in {self.log_dir})")
            try:
                if probe():
                    return
            except AutofuseError:
                pass
            time.sleep(0.5)
        raise AutofuseError(f"{what} did not come up within {self.start_timeout:g} s (logs in {self.log_dir})")

    def measured(self) -> list[int]:
        """Kernels each server has loaded so far (one per measurement), read from its log."""
        counts = []
        for path in self.logs[1:]:
            with open(path, encoding="utf-8", errors="replace") as f:
                counts.append(sum(1 for line in f if "load_module" in line))
        return counts

    def __exit__(self, *exc) -> None:
        import os
        import signal
        # Servers fork a child per session: signal the whole process group.
        for process in [*self.servers, self.tracker]:
            if process is None or process.poll() is not None:
                continue
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                process.wait(timeout=10)
            except Exception:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
