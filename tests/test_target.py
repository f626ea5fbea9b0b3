import subprocess
import sys

import pytest

from autofuse.errors import AutofuseError
from autofuse.target import parse_target, target_key


def test_llvm_is_this_cpu_with_mcpu_and_cores():
    target = parse_target("llvm")
    assert target.kind.name == "llvm"
    assert "mcpu" in target.attrs and int(target.attrs["num-cores"]) >= 1
    assert target_key(target).startswith("llvm-") and target_key(target).endswith("core")


def test_named_and_json_targets():
    assert target_key(parse_target("h200")) == "cuda-sm_90"
    target = parse_target('{"kind": "llvm", "num-cores": 1}')
    assert int(target.attrs["num-cores"]) == 1 and "mcpu" in target.attrs


@pytest.mark.parametrize("spec", ["tpu", "{", '{"no": "kind"}', '{"kind": "nope"}'])
def test_bad_targets(spec):
    with pytest.raises(AutofuseError):
        parse_target(spec)


def test_cpu_tuning_skips_the_gpu_tensor_intrinsics():
    code = (
        "import sys; from autofuse.target import parse_target; from autofuse.tune import register_tensor_intrinsics\n"
        "register_tensor_intrinsics(parse_target('llvm'))\n"
        "import tvm.s_tir.tensor_intrin\n"
        "from tvm.s_tir import TensorIntrin\n"
        "TensorIntrin.get('dot_16x4_vnni')\n"
        "print('cuda' if 'tvm.s_tir.tensor_intrin.cuda' in sys.modules else 'cpu-only')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cpu-only"


def test_tvm_runs_on_every_core_unless_told_otherwise():
    """TVM's x86 default is half the logical cores: on a VM of single-thread cores, tuning timed
    every candidate on half the machine. A subprocess: the test session pins TVM_NUM_THREADS."""
    code = ("import os; os.environ.pop('TVM_NUM_THREADS', None)\n"
            "from autofuse.target import host_cores, use_host_cores\n"
            "assert use_host_cores() == host_cores() == int(os.environ['TVM_NUM_THREADS'])\n"
            "os.environ['TVM_NUM_THREADS'] = '1'\n"
            "assert use_host_cores() == 1\n")
    subprocess.run([sys.executable, "-c", code], check=True)
