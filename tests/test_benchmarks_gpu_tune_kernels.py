"""benchmarks/gpu_tune_kernels.py off a GPU: one line and exit 2, before any work."""

import os
import subprocess
import sys

import pytest

from autofuse.target import device_for, parse_target
from conftest import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_tune_kernels.py")


@pytest.mark.skipif(device_for(parse_target("h200")).exist, reason="a CUDA GPU is here")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--pattern", "linear_bias_relu", "--dtype", "float16",
                           "--db", str(tmp_path / "db"), "--out", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: no cuda device on this machine: kernel templates are searched on the GPU"]
    assert not (tmp_path / "out.json").exists()
