"""int8_matmul_dequant: exact int32 accumulation at the int8 extremes, relu=0, the Relax rules on
what they cover and what they leave alone, and models/quant_mlp.onnx end to end."""

import os

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper

from autofuse.errors import AutofuseError
from autofuse.model.build import build, run_vm
from autofuse.model.fusion import fuse
from autofuse.model.importer import to_relax
from autofuse.model.jobs import build_model, prepare
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.verify import check_module
from conftest import REPO

TARGET = parse_target("llvm")
DEV = tvm.cpu()
PATTERN = get_pattern("int8_matmul_dequant")
CPU_TEMPLATES = [t for t in PATTERN.templates if t.applies_to(TARGET)]
SMALL = {"m": 8, "n": 32, "k": 32, "relu": 1}


def _run_kernel(shape, inputs, template=None):
    func = PATTERN.build(shape, "float32")
    mod = template.apply(func, TARGET, tunable=False).mod if template else tvm.IRModule({"main": func})
    rt = tvm.tirx.build(mod, target=TARGET)
    out = tvm.runtime.tensor(np.zeros((shape["m"], shape["n"]), "float32"), DEV)
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], out)
    return out.numpy()


@pytest.mark.parametrize("template", [None, *CPU_TEMPLATES], ids=lambda t: getattr(t, "name", "unscheduled"))
def test_extremes_accumulate_exactly_in_int32(template):
    # -128 * -128 * k overflows int16 and every partial sum is exact only in int32; scales of 1
    # and no bias make y the integer accumulator itself, checked exactly.
    shape = {"m": 4, "n": 32, "k": 512, "relu": 0}
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([-128, 127, -127], np.int8), size=(4, 512))
    w = rng.choice(np.array([-128, 127, -1], np.int8), size=(32, 512))
    x[0] = -128
    w[0] = -128                                       # y[0, 0] = 16384 * 512 = 2**23, float32-exact
    inputs = [x, w, np.ones(1, np.float32), np.ones(32, np.float32), np.zeros(32, np.float32)]
    got = _run_kernel(shape, inputs, template)
    want = x.astype(np.int64) @ w.astype(np.int64).T
    assert got[0, 0] == 2 ** 23
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("template", [None, *CPU_TEMPLATES], ids=lambda t: getattr(t, "name", "unscheduled"))
def test_relu_off_keeps_negative_outputs(template):
    shape = dict(SMALL, relu=0)
    func = PATTERN.build(shape, "float32")
    mod = template.apply(func, TARGET, tunable=False).mod if template else tvm.IRModule({"main": func})
    assert check_module(PATTERN, tvm.tirx.build(mod, target=TARGET), func, shape, "float32", DEV).ok
    inputs = PATTERN.make_inputs(shape, "float32", 5)
    assert (PATTERN.run_reference(inputs, shape)[0] < 0).any()


def test_relu_must_be_0_or_1():
    with pytest.raises(AutofuseError, match="relu=2"):
        PATTERN.build(dict(SMALL, relu=2), "float32")


def _run_relax(model, inputs):
    mod, matches = fuse(to_relax(model), "patterns")
    return matches, run_vm(build(mod, TARGET), inputs, DEV)[0]


def _ort(model, inputs):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), inputs)})[0]


def test_relu_off_graph_is_found_by_the_plain_rule():
    shape = dict(SMALL, relu=0)
    model = PATTERN.onnx_graph(shape, "float32")
    inputs = PATTERN.make_inputs(shape, "float32", 1)
    matches, got = _run_relax(model, inputs)
    assert matches == {"int8_matmul_dequant": 1}
    np.testing.assert_allclose(got, PATTERN.run_reference(inputs, shape)[0], rtol=1e-5, atol=1e-5)


def _graph(x_shape, *, x_type=TensorProto.INT8, zero_point=False, scale_first=False, scale_shape=None):
    """MatMulInteger(x_q, w (k, n)) -> Cast -> Mul(scale) -> Add b -> Relu with graph inputs."""
    k, n = x_shape[-1], 16
    scale_shape = scale_shape or (n,)
    mm_inputs = ["x_q", "w"] + (["x_zp"] if zero_point else [])
    mul = ["scale", "acc_f"] if scale_first else ["acc_f", "scale"]
    nodes = [helper.make_node("MatMulInteger", mm_inputs, ["acc"]),
             helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", mul, ["deq"]),
             helper.make_node("Add", ["deq", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["y"])]
    inits = [helper.make_tensor("x_zp", x_type, [], [3])] if zero_point else []
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x_q", x_type, list(x_shape)),
         helper.make_tensor_value_info("w", TensorProto.INT8, [k, n]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, list(scale_shape)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*x_shape[:-1], n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    x_dtype = np.uint8 if x_type == TensorProto.UINT8 else np.int8
    low = 0 if x_type == TensorProto.UINT8 else -127
    inputs = [rng.integers(low, 128, size=x_shape).astype(x_dtype),
              rng.integers(-127, 128, size=(k, n)).astype(np.int8),
              rng.uniform(0.5, 1.5, size=scale_shape).astype(np.float32) / (127 * 127),
              rng.standard_normal(n).astype(np.float32)]
    return model, inputs


@pytest.mark.parametrize("case", ["rows_3d", "scalar_scale", "scale_first"])
def test_rule_covers_and_matches_onnxruntime(case):
    kw = {"rows_3d": dict(x_shape=(2, 3, 32)), "scalar_scale": dict(x_shape=(4, 32), scale_shape=(1,)),
          "scale_first": dict(x_shape=(4, 32), scale_first=True)}[case]
    model, inputs = _graph(**kw)
    matches, got = _run_relax(model, inputs)
    assert matches == {"int8_matmul_dequant": 1}
    np.testing.assert_allclose(got, _ort(model, inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["uint8_x", "zero_point", "scale_per_row"])
def test_rule_leaves_uncovered_graphs_alone(case):
    kw = {"uint8_x": dict(x_shape=(4, 32), x_type=TensorProto.UINT8),
          "zero_point": dict(x_shape=(4, 32), zero_point=True),
          "scale_per_row": dict(x_shape=(4, 32), scale_shape=(4, 1))}[case]
    model, inputs = _graph(**kw)
    matches, got = _run_relax(model, inputs)
    assert matches == {}
    np.testing.assert_allclose(got, _ort(model, inputs), rtol=1e-5, atol=1e-5)


def test_quant_mlp_matches_its_patterns_and_still_matches_onnxruntime(tmp_path):
    prepared = prepare(os.path.join(REPO, "models", "quant_mlp.onnx"), "patterns")
    assert prepared.matches == {"int8_matmul_dequant": 2}
    result = build_model(prepared, TARGET, None, str(tmp_path / "quant_mlp.so"), verify=True, repeat=1)
    assert result.verified, result.message
    # Power-of-two scales make every dequantising product exact: only the bias add rounds, the
    # same way in both, so the second QuantizeLinear sees the same values.
    assert result.max_abs_err < 1e-5
    assert any(k.startswith("int8_matmul_dequant") for k in result.kernels), result.kernels
