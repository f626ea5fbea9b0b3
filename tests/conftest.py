import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=None, timeout=900):
    """``autofuse ARGS`` in a fresh process, as a user runs it."""
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
