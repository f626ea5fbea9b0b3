"""The Relax rules on graphs in the shapes torch.onnx writes (tests/model/exported_graphs.py):
each is found, the model still matches onnxruntime, and what a rule does not cover is left to the
auto-fused kernels on their CPU defaults."""

import pytest

from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from exported_graphs import rms_norm

TARGET = parse_target("llvm")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_residual_rms_norm_becomes_the_pattern_kernel(exporter, tmp_path):
    prepared = prepare(rms_norm(tmp_path / "m.onnx", exporter), "patterns")
    assert prepared.matches == {"rms_norm": 1}
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    kernel = next(d for d in result.decisions if d.pattern == "rms_norm")
    assert kernel.applied == "template-default"


def test_an_rms_norm_without_a_residual_add_stays_auto_fused(tmp_path):
    prepared = prepare(rms_norm(tmp_path / "m.onnx", residual=False), "patterns")
    assert prepared.matches == {}
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    assert "cpu_rows" in {d.default for d in result.decisions}


def test_an_eps_that_is_no_power_of_ten_is_left_alone(tmp_path):
    assert prepare(rms_norm(tmp_path / "m.onnx", eps=3e-6), "patterns").matches == {}


def test_build_reports_the_pattern_kernels_share_of_the_work(tmp_path):
    """Counted per call site: mlp is all linear_bias_relu; an RMSNorm graph's pattern kernel does
    its norm, the residual adds do the rest; without a match, none."""
    import os

    from autofuse.model.kernels import pattern_share
    from conftest import REPO

    mlp = pattern_share(prepare(os.path.join(REPO, "models", "mlp.onnx"), "patterns").mod)
    # 128 x 256 -> 512 -> 256, bias and ReLU: 2mnk + 2mn per layer
    assert mlp["flop_fraction"] == 1.0 and mlp["pattern_flops"] == 2 * (2 * 128 * 512 * 256) + 2 * 128 * (512 + 256)
    matched = pattern_share(prepare(rms_norm(tmp_path / "a.onnx"), "patterns").mod)
    assert 0.0 < matched["flop_fraction"] < 1.0 and 0.0 < matched["byte_fraction"] < 1.0
    assert pattern_share(prepare(rms_norm(tmp_path / "b.onnx", residual=False), "patterns").mod)["flop_fraction"] == 0.0


def test_a_conv_with_its_batch_norm_folded_becomes_conv2d_bn_relu(tmp_path):
    from exported_graphs import conv_relu
    prepared = prepare(conv_relu(tmp_path / "m.onnx"), "patterns")
    assert prepared.matches == {"conv2d_bn_relu": 2}
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    # stride 2 is not the pattern's: the first conv stays auto-fused, the 1x1 after it matches
    assert prepare(conv_relu(tmp_path / "s.onnx", stride=2), "patterns").matches == {"conv2d_bn_relu": 1}


@pytest.mark.parametrize("eps", [1e-12, 1e-5])
def test_a_residual_layer_norm_of_any_power_of_ten_eps_matches(eps, tmp_path):
    from exported_graphs import layernorm_residual
    prepared = prepare(layernorm_residual(tmp_path / "m.onnx", eps), "patterns")
    assert prepared.matches == {"layernorm_residual": 1}
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    assert prepare(layernorm_residual(tmp_path / "o.onnx", 2e-5), "patterns").matches == {}
