"""The torch contenders (torch-eager, torch-compile, torch-sdpa) run through compare's one pipeline
on this CPU as they do on a GPU: checked against the reference, then timed; each attention
pattern's SDPA form computes what its reference does. Skipped where torch is not installed (it
is an optional extra)."""

import pytest

torch = pytest.importorskip("torch")

from autofuse.registry import get_pattern  # noqa: E402

SDPA_PATTERNS = ["flash_attention", "cross_attention", "gqa_decode_attention"]


def _cpu(tmp_path, name, dtype="float32", **shape):
    import tvm
    from autofuse.baselines import Context
    from autofuse.compare import pattern_subject
    from autofuse.roofline import Machine
    from autofuse.target import parse_target

    pattern = get_pattern(name)
    subject = pattern_subject(pattern, pattern.resolve_shape(shape, base="small"), dtype, str(tmp_path))
    return subject, Context(parse_target("llvm"), tvm.cpu(), 2, None), Machine(20.0, 200.0, "test", "test", 2, [])


@pytest.mark.parametrize("name,shape", [("flash_attention", {}), ("flash_attention", {"seq_q": 8}),
                                        ("flash_attention", {"kv_heads": 1}), ("flash_attention", {"causal": 0}),
                                        ("cross_attention", {}), ("gqa_decode_attention", {})],
                         ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_each_sdpa_form_computes_the_reference(name, shape):
    from autofuse.baselines.onnx_to_torch import to_numpy, to_torch

    pattern = get_pattern(name)
    shape = pattern.resolve_shape(shape, base="small")
    inputs = pattern.make_inputs(shape, "float32", 0)
    outputs = [to_numpy(t) for t in pattern.sdpa(torch, shape, *[to_torch(x) for x in inputs])]
    check = pattern.check(outputs, inputs, shape, "float32")
    assert check.ok, check.message


def test_torch_eager_and_sdpa_are_checked_then_timed(tmp_path):
    from autofuse.compare import compare_subject

    subject, ctx, machine = _cpu(tmp_path, "flash_attention", "float16", seq_q=8)
    entry = compare_subject(subject, ctx, ["torch-eager", "torch-sdpa"], machine, repeat=3, min_repeat_ms=1.0)
    rows = {c["name"]: c for c in entry["contenders"]}
    for name in ("autofuse", "torch-eager", "torch-sdpa"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["scaled_err"] <= rows[name]["bound"] and len(rows[name]["samples_ms"]) == 3
    assert rows["torch-sdpa"]["info"]["device"] == "cpu" and rows["torch-eager"]["rival"]


def test_torch_sdpa_without_an_sdpa_form_says_so(tmp_path):
    from autofuse.compare import compare_subject

    subject, ctx, machine = _cpu(tmp_path, "linear_bias_relu")
    entry = compare_subject(subject, ctx, ["torch-sdpa"], machine, repeat=2, min_repeat_ms=1.0)
    row = entry["contenders"][1]
    assert row["status"] == "unavailable" and "scaled_dot_product_attention" in row["reason"]


def test_torch_compile_compiles_once_and_is_timed(tmp_path):
    from autofuse.compare import compare_subject

    subject, ctx, machine = _cpu(tmp_path, "softmax_dropout")
    entry = compare_subject(subject, ctx, ["torch-compile"], machine, repeat=3, min_repeat_ms=1.0)
    row = entry["contenders"][1]
    assert row["status"] == "ok", row
    # The compile is the first call, outside the timing.
    assert row["first_call_secs"] * 1e3 > row["median_ms"]


@pytest.mark.parametrize("relu", [True, False])
def test_the_torch_baselines_run_the_module_program_where_the_subject_has_one(tmp_path, relu):
    """``--torch-program``: the module itself is what torch-eager runs; a module computing something
    else (no ReLU) is caught by the check, so the ONNX graph is not what ran."""
    import dataclasses

    from autofuse.compare import compare_subject

    class Linear(torch.nn.Module):
        def forward(self, x, w, b):
            y = x @ w.T + b
            return torch.relu(y) if relu else y

    subject, ctx, machine = _cpu(tmp_path, "linear_bias_relu")
    args = tuple(torch.from_numpy(x) for x in subject.inputs)
    path = str(tmp_path / "linear.pt2")
    torch.export.save(torch.export.export(Linear(), args), path)
    subject = dataclasses.replace(subject, torch_program=path)
    entry = compare_subject(subject, ctx, ["torch-eager"], machine, repeat=2, min_repeat_ms=1.0)
    row = entry["contenders"][1]
    assert row["status"] == ("ok" if relu else "invalid"), row
    assert row["info"]["runs"] == f"torch.export program {path}"
