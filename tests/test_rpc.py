"""Tuning through TVM's RPC tracker on loopback: addresses, unreachable trackers, two servers
sharing the measurements, and a server killed mid-tuning."""

import os
import signal
import time

import pytest

from autofuse.database import TuningDatabase
from autofuse.errors import AutofuseError
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.rpc import LocalFarm, free_port, parse_address, queue
from conftest import run_cli, start_cli


@pytest.mark.parametrize("text", ["127.0.0.1:9190", "127.0.0.1::cpu", ":9190:cpu", "host:port:cpu", "h:70000:k"])
def test_bad_addresses_are_one_line_errors(text):
    with pytest.raises(AutofuseError) as err:
        parse_address(text)
    assert "\n" not in str(err.value)


def test_address_round_trip():
    address = parse_address("10.0.0.5:9190:h200")
    assert (address.host, address.port, address.key) == ("10.0.0.5", 9190, "h200")
    assert str(address) == "10.0.0.5:9190:h200"
    assert parse_address("10.0.0.5:9190", need_key=False).key is None


def test_queue_counts_registered_servers():
    info = {"queue_info": {"cpu": {"free": 1, "pending": 2}},
            "server_info": [{"key": "server:cpu", "addr": ["h", 1]}, {"key": "server:cpu", "addr": ["h", 2]},
                            {"key": "server:gpu", "addr": ["h", 3]}]}
    assert queue(info, "cpu") == {"total": 2, "free": 1, "pending": 2}
    assert queue(info, "npu") == {"total": 0, "free": 0, "pending": 0}


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """A tracker and two servers (key cpu) on loopback, started once for the module: the take
    kernel is measured on them, then one of them is killed mid-tuning (the last test here)."""
    with LocalFarm(2, key="cpu", log_dir=str(tmp_path_factory.mktemp("farm"))) as farm:
        yield farm


def test_unreachable_tracker_is_exit_2_before_any_work(tmp_path):
    start = time.monotonic()
    port = free_port()
    for args in (["tune", "--rpc", f"127.0.0.1:{port}:cpu", "--small", "--db", str(tmp_path)],
                 ["rpc", "status", "--tracker", f"127.0.0.1:{port}"],
                 ["rpc", "server", "--tracker", f"127.0.0.1:{port}", "--key", "cpu"]):
        result = run_cli(*args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot reach the RPC tracker" in lines[0], result.stderr
    assert not os.listdir(tmp_path)
    assert time.monotonic() - start < 120  # not TVM's minute of retries per call


def test_a_lost_session_is_retried_and_a_timeout_is_not():
    from tvm.s_tir import meta_schedule as ms
    from tvm.ir.utils import derived_object

    from autofuse.rpc import RetryingRunner

    @derived_object
    class Done(ms.runner.PyRunnerFuture):
        def __init__(self, result):
            super().__init__()
            self.value = result

        def done(self):
            return True

        def result(self):
            return self.value

    @derived_object
    class Flaky(ms.runner.PyRunner):
        """The first attempt of every input loses its session, except inputs that time out always."""

        def __init__(self):
            super().__init__()
            self.calls = []

        def run(self, runner_inputs):
            out = []
            for item in runner_inputs:
                name = str(item.device_type)
                self.calls.append(name)
                if name == "slow":
                    out.append(Done(ms.runner.RunnerResult(None, "RPCRunner: Timeout, killed after 1 seconds")))
                elif self.calls.count(name) == 1:
                    out.append(Done(ms.runner.RunnerResult(None, "RPCRunner: An exception occurred\nconnection reset")))
                else:
                    out.append(Done(ms.runner.RunnerResult([1e-3], None)))
            return out

    flaky = Flaky()
    inputs = [ms.runner.RunnerInput("/nonexistent", device_type, []) for device_type in ("cpu", "slow")]
    results = [f.result() for f in RetryingRunner(flaky, retries=1).run(inputs)]
    assert results[0].error_msg is None and [float(s) for s in results[0].run_secs] == [1e-3]
    assert "Timeout" in results[1].error_msg
    assert flaky.calls == ["cpu", "slow", "cpu"]


def test_the_rpc_runner_gives_integer_arguments_valid_indices():
    """The RPC runner's arguments, allocated on the server: integer tensors zeros (valid indices
    of an embedding lookup), float ones the server's random data."""
    import numpy as np
    from tvm import rpc

    from autofuse.rpc import rpc_alloc_arguments

    session = rpc.LocalSession()
    info = [("TENSOR", "int64", [4, 8]), ("TENSOR", "int32", [16]), ("TENSOR", "float32", [64])]
    for ids, small, values in rpc_alloc_arguments(session, session.cpu(0), info, 2):
        assert (ids.numpy() == 0).all() and (small.numpy() == 0).all()
        assert len(np.unique(values.numpy())) > 1


def test_a_kernel_that_indexes_with_an_input_is_measured_through_rpc(farm, tmp_path):
    """An embedding lookup (take) tuned through a server: its int64 ids arrive as valid indices and
    its candidates are stored valid (with MetaSchedule's random fill each one read far past the
    table and was stored failed)."""
    from autofuse.rpc import make_runner
    from autofuse.tune import Task, tune
    from index_kernels import take

    target = parse_target("llvm")
    db = TuningDatabase(str(tmp_path / "db"), target)
    stats = tune([Task("take", take)], target, db.ms, db.work_dir, trials_per_task=2, space="generic", seed=0,
                 runner=make_runner(farm.address, 1, 10, retries=0))
    assert stats.trials.get(0, 0) >= 1 and not stats.failed.get(0), stats
    valid, total = db.count(take)
    assert total >= 1 and valid == total


def test_two_servers_share_the_measurements_and_a_killed_one_loses_nothing(farm, tmp_path):
    trials = 16  # two rounds of 8: the kill lands in the first, the survivor measures the rest
    earlier = farm.measured()  # what the module's earlier tests measured on these servers

    def measured():
        return [now - then for now, then in zip(farm.measured(), earlier)]

    empty = run_cli("tune", "--rpc", f"{farm.address.host}:{farm.address.port}:gpu", "--small",
                    "--db", str(tmp_path / "none"))
    assert empty.returncode == 2 and "no RPC server is registered under key 'gpu'" in empty.stderr

    status = run_cli("rpc", "status", "--tracker", f"{farm.address.host}:{farm.address.port}")
    assert status.returncode == 0 and "key cpu: 2 servers" in status.stdout, status.stdout

    db = str(tmp_path / "db")
    proc = start_cli("tune", "--pattern", "linear_bias_relu", "--small", "--trials", str(trials), "--seed", "3",
                     "--db", db, "--no-progress", "--rpc", str(farm.address), "--rpc-workers", "2")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (min(measured()) < 1 or sum(measured()) < 4):
        time.sleep(0.2)
    before_kill = measured()
    assert min(before_kill) >= 1, f"both servers should have measured: {before_kill}"
    os.killpg(farm.servers[0].pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert measured()[1] > before_kill[1], "the surviving server took over"
    pattern = get_pattern("linear_bias_relu")
    valid, total = TuningDatabase(db, parse_target("llvm")).count(pattern.build(pattern.small_shape(), "float32"))
    assert total == trials, "every measured candidate is stored"
    # A candidate whose session died with the server is measured again on the other one, not
    # stored as failed.
    assert valid == trials, f"{trials - valid} of {trials} candidates stored as failed"
    assert "linear_bias_relu" in out
