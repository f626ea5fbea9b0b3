"""masked_attention in real exports (issue #25): BERT's attention with its attention_mask, as the
TorchScript exporter writes it, becomes one masked_attention kernel per layer under --fusion
patterns (what ``autofuse build`` does: prepare, then build_model) and still matches onnxruntime;
the dynamo export and ViT's unmasked attention are matched too."""

import os

import pytest

from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target
from conftest import REPO

TARGET = parse_target("llvm")
REAL = os.path.join(REPO, "models", "real")


def test_bert_builds_with_masked_attention_and_matches_onnxruntime(tmp_path):
    prepared = prepare(os.path.join(REAL, "bert-torchscript-fixed.onnx"), "patterns")
    # Two layers: QK^T, the mask add, softmax, the IsNaN/Where guard and PV are one kernel each.
    assert prepared.matches.get("masked_attention") == 2, prepared.matches
    assert "softmax_dropout" not in prepared.matches
    result = build_model(prepared, TARGET, None, str(tmp_path / "bert.so"), repeat=1)
    assert result.verified, result.message
    assert "masked_attention" in result.kernels
    assert not any("isnan" in k or k.startswith("matmul") for k in result.kernels), result.kernels
    decision = next(d for d in result.decisions if d.name == "masked_attention")
    assert decision.pattern == "masked_attention" and decision.applied == "template-default", decision


@pytest.mark.parametrize("model", ["bert-dynamo-fixed", "vit-torchscript-fixed"])
def test_other_exports_match(model):
    matches = prepare(os.path.join(REAL, f"{model}.onnx"), "patterns").matches
    assert matches.get("masked_attention") == 2 and "softmax_dropout" not in matches, matches
