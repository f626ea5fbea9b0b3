"""Models for a CUDA target, without a GPU: every kernel of the fused model gets a GPU schedule
(a pattern's CUDA template, dlight's rules for the rest; an unscheduled GPU kernel builds and then
crashes the device), and the whole model compiles through nvcc, with and without CUDA graphs.
Running and checking it against onnxruntime happens on the H200 (benchmarks/gpu_models.py)."""

import os
import shutil

import pytest
from tvm import tirx

from autofuse.model import build as model_build
from autofuse.model.jobs import prepare
from autofuse.model.kernels import apply_database
from autofuse.target import device_for, parse_target
from conftest import REPO, run_cli

H200 = parse_target("h200")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot compile CUDA here")


def _bound(func: tirx.PrimFunc) -> bool:
    return "threadIdx." in func.script() or "blockIdx." in func.script()


@needs_nvcc
@pytest.mark.parametrize("model,fusion", [("mlp", "patterns"), ("decoder_block", "patterns"), ("mlp", "auto")])
def test_every_kernel_gets_a_gpu_schedule_and_the_model_compiles(model, fusion):
    prepared = prepare(os.path.join(REPO, "models", f"{model}.onnx"), fusion)
    mod, decisions = apply_database(prepared.mod, None, H200, dev=None)
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert funcs and all(_bound(f) for f in funcs)
    by_kind = {d.applied for d in decisions}
    assert by_kind <= {"template-default", "default"}
    if fusion == "patterns":
        assert "template-default" in by_kind
    with H200:
        executable = model_build.build(mod, H200, cuda_graph=(model == "mlp"))
    assert executable is not None


@needs_nvcc
def test_cuda_graph_rewrite_captures_the_launches():
    prepared = prepare(os.path.join(REPO, "models", "mlp.onnx"), "patterns")
    mod, _ = apply_database(prepared.mod, None, H200, dev=None)
    plain = model_build.build(mod, H200).as_text()
    graphed = model_build.build(mod, H200, cuda_graph=True).as_text()
    assert "cuda_graph" not in plain and "cuda_graph" in graphed


def test_cuda_graph_needs_a_cuda_target():
    result = run_cli("build", os.path.join(REPO, "models", "mlp.onnx"), "--db", "none", "--cuda-graph")
    assert result.returncode == 2
    assert "needs a cuda target" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(device_for(H200).exist, reason="a GPU is here")
def test_cuda_build_without_a_gpu_is_one_line():
    result = run_cli("build", os.path.join(REPO, "models", "mlp.onnx"), "--db", "none", "--target", "cuda")
    assert result.returncode == 2
    assert "no cuda device" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(device_for(H200).exist, reason="a GPU is here")
@pytest.mark.parametrize("what", [["--pattern", "softmax_dropout"], [os.path.join(REPO, "models", "mlp.onnx")]],
                         ids=["pattern", "model"])
def test_cuda_tuning_without_a_gpu_is_one_line_before_any_work(what, tmp_path):
    db = tmp_path / "db"
    result = run_cli("tune", *what, "--target", "h200", "--trials", "2", "--db", str(db))
    assert result.returncode == 2
    assert "no cuda device" in result.stderr and "Traceback" not in result.stderr
    assert not db.exists()


@pytest.mark.skipif(device_for(H200).exist, reason="a GPU is here")
def test_cuda_compare_without_a_gpu_is_one_line_before_any_work(tmp_path):
    result = run_cli("compare", "--pattern", "softmax_dropout", "--small", "--target", "h200",
                     "--report", str(tmp_path / "report"))
    assert result.returncode == 2
    assert "no cuda device" in result.stderr and "GPU's host" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "report").exists()


@needs_nvcc
def test_the_float16_decoder_block_runs_kernel_templates_and_compiles(tmp_path):
    """flash_attention, swiglu_ffn and the projections (linear) get their Hopper kernel templates
    (tirx, sm_90a) inside the model; the mixed tirx/s_tir pipeline compiles the whole library."""
    import subprocess
    import sys

    subprocess.run([sys.executable, os.path.join(REPO, "models", "make_models.py"), "--out", str(tmp_path), "--only",
                    "decoder_block", "--dtype", "float16"], check=True, capture_output=True, timeout=300)
    prepared = prepare(str(tmp_path / "decoder_block-float16.onnx"), "patterns")
    assert prepared.matches == {"flash_attention": 1, "layernorm_residual": 1, "swiglu_ffn": 1, "linear": 4}
    mod, decisions = apply_database(prepared.mod, None, H200, dev=None)
    tirx_kernels = {d.pattern for d in decisions if "tirx kernel" in d.note}
    assert tirx_kernels == {"flash_attention", "swiglu_ffn", "linear"}
    with H200:
        model_build.build(mod, H200).export_library(str(tmp_path / "decoder.so"))
    library = (tmp_path / "decoder.so").read_bytes()
    # the CUDA source in the library: wgmma, and swiglu_ffn as two kernels
    assert b"wgmma.mma_async" in library and b"swiglu_ffn_kernel_1" in library
