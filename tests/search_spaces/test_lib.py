"""search_spaces.lib: its TensorIR macros keep their block names however often a pattern is built or
calls them (a macro renames its blocks from its second call on, so each build or call takes a fresh
one, and templates find stages by name); typed ONNX graphs give each tensor its own dtype; the
dropout constants refuse an output whose flat index overflows int32."""

import onnx
import pytest
from onnx import helper
from tvm import s_tir

from autofuse.registry import get_pattern
from search_spaces.lib.onnx_graphs import typed_model
from search_spaces.lib.tir_math import dropout_constants

MACRO_USERS = ["cross_attention", "gqa_decode_attention", "paged_attention", "gelu_add_layernorm",
               "layernorm_residual"]


def _block_names(func):
    sch = s_tir.Schedule(func)
    return [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]


@pytest.mark.parametrize("name", MACRO_USERS)
def test_macro_stages_keep_their_names_across_builds(name):
    pattern = get_pattern(name)
    builds = [_block_names(pattern.build(pattern.small_shape(), "float32")) for _ in range(3)]
    assert builds[0] == builds[1] == builds[2]
    sch = s_tir.Schedule(pattern.build(pattern.small_shape(), "float32"))
    for stage in ("mean", "sumsq", "norm") if "layernorm" in name else ("row_max", "pv"):
        sch.get_sblock(stage)


@pytest.mark.parametrize("name,stages", [("swiglu_ffn", ("gate", "up", "down")), ("linear_bias_relu", ("matmul",))])
def test_matmul_stage_keeps_its_block_name_in_every_call(name, stages):
    # swiglu_ffn calls matmul_stage three times per build: a reused macro would name them gate, up_1, down_2.
    pattern = get_pattern(name)
    builds = [_block_names(pattern.build(pattern.small_shape(), "float32")) for _ in range(3)]
    assert builds[0] == builds[1] == builds[2]
    assert set(stages) <= set(builds[0])


def test_typed_model_gives_each_tensor_its_dtype():
    model = typed_model("cast", [helper.make_node("Cast", ["i"], ["o"], to=onnx.TensorProto.FLOAT)],
                        [("i", (2, 3), "int32")], [("o", (2, 3), "float32")], {"unused": [1.0]})
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT32
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [t.name for t in model.graph.initializer] == ["unused"]


def test_dropout_constants_refuse_an_int32_overflow():
    mix, thresh, scale = dropout_constants(0.5, 42, 4, 8)
    assert thresh == 1 << 23 and scale == 2.0 and 0 <= mix < 1 << 32
    with pytest.raises(ValueError, match="int32"):
        dropout_constants(0.1, 42, 1 << 16, 1 << 15)
