"""autofuse.model.fusion's float32 accumulation: float16/bfloat16 matmuls and convolutions sum in
float32 and round once (what onnxruntime, cuBLAS and cuDNN do), other dtypes are left alone, and a
float16 convolution with a long reduction then matches onnxruntime where TVM's own lowering, which
adds in float16, does not."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import relax
from tvm.script import relax as R

from autofuse.model import fusion
from autofuse.model.jobs import build_model, prepare
from autofuse.target import parse_target


def _matmul_module(dtype_a, dtype_b):
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((4, 64), dtype_a))
    w = relax.Var("w", R.Tensor((64, 8), dtype_b))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod):
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)
                                    and found.append((e.op.name, str(getattr(e.attrs, "out_dtype", "")),
                                                      str(getattr(e.attrs, "dtype", "")))))
    return found


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_matmul_accumulates_in_float32_and_rounds_once(dtype):
    mod = fusion.accumulate_in_float32(_matmul_module(dtype, dtype))
    assert _ops(mod) == [("relax.matmul", "float32", ""), ("relax.astype", "", dtype)]
    assert f'-> R.Tensor((4, 8), dtype="{dtype}")' in mod["main"].script()  # the signature's result


def test_float32_matmuls_are_left_alone():
    mod = _matmul_module("float32", "float32")
    assert fusion.accumulate_in_float32(mod)["main"].script() == mod["main"].script()


def _patch_conv(path, seed=0):
    """A ViT's patch embedding in float16: Conv 3 -> 64 channels, 8 x 8 kernel, stride 8 (192 terms
    a sum), on 32 x 32 pixels."""
    rng = np.random.default_rng(seed)
    f16 = onnx.TensorProto.FLOAT16
    w = numpy_helper.from_array((rng.standard_normal((64, 3, 8, 8)) * 0.05).astype(np.float16), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[8, 8], strides=[8, 8])],
                              "patch", [helper.make_tensor_value_info("x", f16, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", f16, [1, 64, 4, 4])], initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_a_float16_convolution_matches_onnxruntime_only_when_it_sums_in_float32(tmp_path, monkeypatch):
    path = _patch_conv(tmp_path / "patch.onnx")
    target = parse_target("llvm")
    result = build_model(prepare(path, "auto"), target, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, result.message
    monkeypatch.setattr(fusion, "accumulate_in_float32", lambda mod: mod)
    result = build_model(prepare(path, "auto"), target, None, str(tmp_path / "m2.so"), repeat=1)
    assert not result.verified, result.message
