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
    # The first LayerNorm reads the block input (no add before it): only the second matches. The
    # q/k/v/out projections and the FFN's second GEMM are linear_bias, its first linear_bias_gelu.
    "transformer_block": {"layernorm_residual": 1, "flash_attention": 1, "linear_bias": 5, "linear_bias_gelu": 1},
    # RoPE stays an auto-fused elementwise kernel before the attention (see README); the
    # projections have no bias, the out projection's residual add is no bias either.
    "decoder_block": {"layernorm_residual": 1, "flash_attention": 1, "swiglu_ffn": 1, "linear": 4},
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
    "layernorm_eps3e-6": (_add_layer_norm(1e-5), {"layernorm_residual": 1}, _add_layer_norm(3e-6)),
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


def _attention(scale=None, mask="causal", kv_heads=2, repeat_axis=2, heads=4, seq=8, head_dim=16):
    """softmax(q k^T * scale + mask) v in Relax, K/V repeated from kv_heads as exporters write it."""
    import numpy as np
    from tvm import relax

    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    group = heads // kv_heads
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, heads, seq, head_dim), "float32"))
    k = relax.Var("k", relax.TensorType((1, kv_heads, seq, head_dim), "float32"))
    v = relax.Var("v", relax.TensorType((1, kv_heads, seq, head_dim), "float32"))
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    masks = {"causal": np.where(j <= i, 0.0, -1e9), "shifted": np.where(j <= i + 1, 0.0, -1e9),
             "soft": np.where(j <= i, 0.0, -1.0)}
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            def repeat(t):
                if kv_heads == heads:
                    return t
                t = bb.emit(relax.op.expand_dims(t, [repeat_axis]))
                target = [1, kv_heads, seq, head_dim]
                target.insert(repeat_axis, group)
                t = bb.emit(relax.op.broadcast_to(t, target))
                return bb.emit(relax.op.reshape(t, (1, heads, seq, head_dim)))
            kt = bb.emit(relax.op.permute_dims(repeat(k), [0, 1, 3, 2]))
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, kt), relax.const(np.float32(scale))))
            if mask is not None:
                scores = bb.emit(relax.op.add(scores, relax.const(masks[mask].astype("float32"))))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(relax.op.matmul(probs, repeat(v)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("variant", ["gqa_causal", "mha_no_mask", "mqa"])
def test_attention_becomes_one_flash_kernel_and_computes_the_same(variant):
    import numpy as np
    from tvm import relax

    kwargs = {"gqa_causal": {}, "mha_no_mask": {"mask": None, "kv_heads": 4}, "mqa": {"kv_heads": 1}}[variant]
    mod = _attention(**kwargs)
    fused, matches = fuse(mod, "patterns")
    assert matches == {"flash_attention": 1}
    rng = np.random.default_rng(0)
    kv_heads = kwargs.get("kv_heads", 2)
    q = rng.standard_normal((1, 4, 8, 16)).astype("float32")
    k, v = (rng.standard_normal((1, kv_heads, 8, 16)).astype("float32") for _ in range(2))
    results = []
    for module in (fused, fuse(mod, "none")[0]):
        vm = relax.VirtualMachine(relax.build(module, TARGET), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(a) for a in (q, k, v)]).numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["scale", "shifted_mask", "soft_mask", "repeat_axis"])
def test_attention_the_kernel_does_not_compute_is_left_to_smaller_rules(variant):
    kwargs = {"scale": {"scale": 0.5}, "shifted_mask": {"mask": "shifted"}, "soft_mask": {"mask": "soft"},
              "repeat_axis": {"repeat_axis": 1}}[variant]
    _, matches = match_patterns(_attention(**kwargs))
    assert "flash_attention" not in matches
    assert matches == {"softmax_dropout": 1}  # the softmax alone is still ours
