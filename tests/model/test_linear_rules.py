"""The linear patterns' Relax rules (search_spaces/lib/linear.py) on graphs in the forms torch.onnx
writes a linear layer and its activation in (tests/model/exported_graphs.py ``linear``): each form
becomes the one pattern kernel it is, larger rules keep their matches (linear_bias_relu), what is
no linear layer of a model weight (attention's products, a residual add, a wrong GELU constant) is
left to other kernels, and the built model still matches onnxruntime."""

import pytest

from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from exported_graphs import LINEAR_FORMS, linear

TARGET = parse_target("llvm")

EXPECTED = {
    "bias": {"linear_bias": 1},
    "bias_2d": {"linear_bias": 1},
    "gemm": {"linear_bias": 1},
    "plain": {"linear": 1},
    "gelu_erf": {"linear_bias_gelu": 1},
    "gelu_erf_dynamo": {"linear_bias_gelu": 1},
    "gelu_op": {"linear_bias_gelu": 1},
    "gelu_tanh": {"linear_bias_gelu_tanh": 1},
    "gelu_tanh_op": {"linear_bias_gelu_tanh": 1},
    "relu": {"linear_bias_relu": 1},                # the larger rule runs first
    "gelu_bad_constant": {"linear_bias": 1},        # the GELU left to auto-fusion
    "residual": {"linear": 1},                      # the residual add is no bias
    "weight_input": {"linear_bias": 1},             # weights kept as graph inputs are weights too
    "activations": {},
    "scores": {},
}
# Built and checked against onnxruntime: each kernel form once (the rest share their kernels).
BUILT = ("bias_2d", "gemm", "plain", "gelu_erf", "gelu_erf_dynamo", "gelu_tanh", "gelu_bad_constant", "residual")


def test_every_form_has_an_expectation():
    assert set(EXPECTED) == set(LINEAR_FORMS)


@pytest.mark.parametrize("form", sorted(EXPECTED))
def test_each_form_becomes_its_pattern_kernel(form, tmp_path):
    prepared = prepare(linear(tmp_path / "m.onnx", form), "patterns")
    assert prepared.matches == EXPECTED[form]
    if form in BUILT:
        result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
        assert result.verified, result.message
        for name in EXPECTED[form]:
            (decision,) = [d for d in result.decisions if d.pattern == name]
            assert decision.applied == "template-default"
