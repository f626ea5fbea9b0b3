"""The patterns' Relax rules: each model gets the expected pattern kernels under --fusion patterns
and still matches onnxruntime; graphs a rule does not cover are left alone."""

import os

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from autofuse.model.fusion import fuse, match_patterns
from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from conftest import REPO

TARGET = parse_target("llvm")

EXPECTED = {
    "mlp": {"linear_bias_relu": 2},
    "conv_block": {"conv2d_bn_relu": 2},
    # The first LayerNorm reads the block input (no add before it): only the second matches.
    "transformer_block": {"layernorm_residual": 1, "softmax_dropout": 1},
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_model_matches_its_patterns_and_still_matches_onnxruntime(model, tmp_path):
    prepared = prepare(os.path.join(REPO, "models", f"{model}.onnx"), "patterns")
    assert prepared.matches == EXPECTED[model]
    result = build_model(prepared, TARGET, None, str(tmp_path / f"{model}.so"), verify=True, repeat=1)
    assert result.verified, result.message
    assert result.max_abs_err < 1e-3
    for name in EXPECTED[model]:
        assert any(k.startswith(name) for k in result.kernels), result.kernels


def _softmax(axis):
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 8, 16), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            with R.dataflow():
                y = R.nn.softmax(x, axis=axis)
                R.output(y)
            return y
    return Mod


def _conv_bn_relu(stride):
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((8, 4, 3, 3), "float32"),
                 gamma: R.Tensor((8,), "float32"), beta: R.Tensor((8,), "float32"),
                 mean: R.Tensor((8,), "float32"), var: R.Tensor((8,), "float32")):
            with R.dataflow():
                c = R.nn.conv2d(x, w, strides=[stride, stride], padding=[1, 1, 1, 1])
                bn = R.nn.batch_norm(c, gamma, beta, mean, var, axis=1, training=False)  # script default: True
                y = R.nn.relu(bn[0])
                R.output(y)
            return y
    return Mod


def _add_layer_norm(eps):
    @I.ir_module
    class Mod:
        @R.function
        def main(a: R.Tensor((4, 64), "float32"), b: R.Tensor((4, 64), "float32"),
                 gamma: R.Tensor((64,), "float32"), beta: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
            with R.dataflow():
                h = R.add(a, b)
                y = R.nn.layer_norm(h, gamma, beta, axes=[-1], epsilon=eps)
                R.output(y)
            return y
    return Mod


# (graph the rule covers, expected matches, the same graph with one thing it does not cover)
CASES = {
    "softmax_axis0": (_softmax(-1), {"softmax_dropout": 1}, _softmax(0)),
    "conv_stride2": (_conv_bn_relu(1), {"conv2d_bn_relu": 1}, _conv_bn_relu(2)),
    "layernorm_eps1e-6": (_add_layer_norm(1e-5), {"layernorm_residual": 1}, _add_layer_norm(1e-6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_graph_the_rules_do_not_cover_is_left_alone(case):
    covered, expected, uncovered = CASES[case]
    assert match_patterns(covered)[1] == expected  # the rule does fire on its twin
    rewritten, matches = match_patterns(uncovered)
    assert matches == {}
    assert not [gv for gv, f in rewritten.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    _, matches = fuse(uncovered, "patterns")  # and the rest of the pipeline still lowers it
    assert matches == {}
