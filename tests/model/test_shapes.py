"""autofuse.model.shapes: binding symbolic input axes (--input-shape) and folding shape
computations, on small graphs written the way exporters write them; the folded graph computes
what the original does (onnxruntime on both)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from autofuse.errors import AutofuseError
from autofuse.model.shapes import bind_input_shapes, fold_constants, input_specs, static_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
                              [onnx.numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _const(name, value):
    return (name, np.asarray(value, np.int64))


def _channel_shuffle(batch="n"):
    """ShuffleNet's channel shuffle as the TorchScript exporter writes it: the shape read with
    Shape, split with Gather, divided by the group count, concatenated into Reshape's shape."""
    nodes = [helper.make_node("Shape", ["x"], ["s"])]
    for i in range(4):
        nodes.append(helper.make_node("Gather", ["s", f"i{i}"], [f"d{i}"], axis=0))
        nodes.append(helper.make_node("Unsqueeze", [f"d{i}", "axis0"], [f"u{i}"]))
    nodes += [helper.make_node("Div", ["u1", "two"], ["half"]),
              helper.make_node("Concat", ["u0", "two", "half", "u2", "u3"], ["shape5"], axis=0),
              helper.make_node("Reshape", ["x", "shape5"], ["r"]),
              helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
              helper.make_node("Shape", ["x"], ["shape4"]),
              helper.make_node("Reshape", ["t", "shape4"], ["y"])]
    inits = [_const(f"i{i}", i) for i in range(4)] + [_const("axis0", [0]), _const("two", [2])]
    return _model(nodes, [("x", F, [batch, 8, 4, 4])], [("y", F, None)], inits)


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_channel_shuffle_folds_to_constant_reshapes_and_computes_the_same():
    model = _channel_shuffle()
    folded, count = static_model(model, {"x": (2, 8, 4, 4)})
    assert [n.op_type for n in folded.graph.node] == ["Reshape", "Transpose", "Reshape"]
    assert count == len(model.graph.node) - 3
    constants = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in folded.graph.initializer}
    assert [constants[n.input[1]] for n in folded.graph.node if n.op_type == "Reshape"] == [[2, 2, 4, 4, 4],
                                                                                          [2, 8, 4, 4]]
    assert len(constants) == 2  # the small constants the folded nodes read are gone
    x = np.random.default_rng(0).standard_normal((2, 8, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(_ort(folded, {"x": x})[0], _ort(model, {"x": x})[0])
    assert fold_constants(folded)[1] == 0  # a fixed point


def test_mask_arithmetic_folds_and_what_only_a_folded_shape_read_goes():
    """HF's additive mask: ConstantOfShape / Trilu / Equal / Where of constants and Shape of the
    input fold into one constant; a Reshape read only by a Shape that folded is dropped; a node
    that writes a graph output stays."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Concat", ["one", "s", "s"], ["mshape"], axis=0),
             helper.make_node("ConstantOfShape", ["mshape"], ["ones"], value=helper.make_tensor("v", F, [1], [1.0])),
             helper.make_node("Trilu", ["ones"], ["tri"], upper=0),
             helper.make_node("Equal", ["tri", "zero"], ["masked"]),
             helper.make_node("Where", ["masked", "neg", "zero"], ["mask"]),
             helper.make_node("MatMul", ["x", "xt"], ["scores"]),
             helper.make_node("Add", ["scores", "mask"], ["y"]),
             helper.make_node("Reshape", ["y", "flat"], ["yf"]),
             helper.make_node("Shape", ["yf"], ["yshape"]),
             helper.make_node("Cast", ["yshape"], ["z"], to=F)]
    model = _model(nodes, [("x", F, ["b", "seq", "seq"]), ("xt", F, ["b", "seq", "seq"])],
                   [("y", F, None), ("z", F, None)],
                   [_const("one", [1]), ("zero", np.float32(0)), ("neg", np.float32(-1e9)), _const("flat", [-1])])
    folded, count = static_model(model, {"x": (3, 5, 5)})  # xt's symbols are bound through x
    assert input_specs(folded) == [("x", (3, 5, 5), "float32"), ("xt", (3, 5, 5), "float32")]
    assert [n.op_type for n in folded.graph.node] == ["MatMul", "Add", "Cast"]
    assert count == 7
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((3, 5, 5)).astype(np.float32) for n in ("x", "xt")}
    for got, want in zip(_ort(folded, feeds), _ort(model, feeds)):
        np.testing.assert_array_equal(got, want)


def test_nodes_that_are_not_functions_of_their_inputs_stay():
    nodes = [helper.make_node("RandomNormal", [], ["r"], shape=[4]),
             helper.make_node("Add", ["x", "r"], ["y"])]
    model = _model(nodes, [("x", F, [4])], [("y", F, None)])
    folded, count = fold_constants(model)
    assert count == 0 and [n.op_type for n in folded.graph.node] == ["RandomNormal", "Add"]


def test_unnamed_nodes_get_their_output_names_for_errors():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [4])], [("y", F, None)])
    assert fold_constants(model)[0].graph.node[0].name == "y"


def test_binding_leaves_the_callers_model_alone_and_checks_every_name_rank_and_size():
    model = _channel_shuffle()
    bound = bind_input_shapes(model, {"x": (3, 8, 4, 4)})
    assert input_specs(bound) == [("x", (3, 8, 4, 4), "float32")]
    with pytest.raises(AutofuseError, match=r"input 'x' has symbolic dimensions: give them sizes with "
                                            r"--input-shape x=<n>x8x4x4 \(each <axis> a size\)"):
        input_specs(model)
    for shapes, message in [({"y": (1,)}, "names 'y', not an input of m.onnx \\(its inputs: x\\)"),
                            ({"x": (1, 8, 4)}, "'x' has 4 dimension\\(s\\) \\(<n>x8x4x4\\), not 3"),
                            ({"x": (1, 9, 4, 4)}, "dimension 1 of 'x' is fixed at 8 in m.onnx")]:
        with pytest.raises(AutofuseError, match=message):
            bind_input_shapes(model, shapes, "m.onnx")


def test_a_symbol_shared_by_two_inputs_gets_one_size():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    model = _model(nodes, [("a", F, ["batch", "seq"]), ("b", F, ["batch", "seq"])], [("y", F, None)])
    with pytest.raises(AutofuseError, match="gives dimension 'batch' two sizes: 1 \\(a\\) and 2 \\(b\\)"):
        bind_input_shapes(model, {"a": (1, 4), "b": (2, 4)})
    assert [s for _, s, _ in input_specs(bind_input_shapes(model, {"b": (2, 4)}))] == [(2, 4), (2, 4)]
