"""autofuse.model.importer: what cannot be imported is one error naming the op, its node and the
model; TVM's warnings during import are counted, not printed."""

import gc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tvm.relax.frontend.onnx import onnx_frontend

from autofuse.errors import AutofuseError
from autofuse.model.importer import ImportNotes, to_relax
from autofuse.model.jobs import prepare

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_op_the_frontend_lacks_is_named_with_its_node():
    model = _model([helper.make_node("Relu", ["x"], ["r"], name="first"),
                    helper.make_node("DFT", ["r"], ["y"], name="/encoder/fft")],
                   [("x", F, [4, 5, 1])], [("y", F, [4, 5, 2])])
    with pytest.raises(AutofuseError, match=r"^m\.onnx uses ONNX op\(s\) the Relax frontend cannot import: "
                                            r"DFT \(node '/encoder/fft'\)$"):
        to_relax(model, "m.onnx")


def test_a_conversion_that_fails_names_the_op_the_node_and_the_model(monkeypatch, capfd):
    real = onnx_frontend.ONNXGraphImporter._convert_operator

    def failing(self, op_name, inputs, attrs, opset):
        if op_name == "Sigmoid":
            raise ValueError("no converter for this case\nsecond line of a long TVM message")
        return real(self, op_name, inputs, attrs, opset)

    monkeypatch.setattr(onnx_frontend.ONNXGraphImporter, "_convert_operator", failing)
    model = _model([helper.make_node("Relu", ["x"], ["r"], name="relu0"),
                    helper.make_node("Sigmoid", ["r"], ["y"], name="/block/gate")],
                   [("x", F, [2, 3])], [("y", F, [2, 3])])
    with pytest.raises(AutofuseError) as err:
        to_relax(model, "m.onnx")
    assert str(err.value) == ("m.onnx: node '/block/gate' (Sigmoid) cannot be imported into Relax: "
                              "no converter for this case")
    out, printed = capfd.readouterr()
    assert out == "" and printed == ""  # TVM's "Error converting operator" print is not shown


def test_a_data_dependent_shape_is_named():
    model = _model([helper.make_node("NonZero", ["x"], ["y"], name="where_nonzero")],
                   [("x", F, [4, 5])], [("y", TensorProto.INT64, [2, "n"])])
    with pytest.raises(AutofuseError, match="m.onnx: node 'where_nonzero' \\(NonZero\\) gives a tensor whose shape "
                                            "is known only at run time"):
        to_relax(model, "m.onnx")


def test_tvm_warnings_are_counted_not_printed(capfd, tmp_path):
    # What earlier tests left for the garbage collector (a Relax BlockBuilder warns as it goes) is
    # not this import's output.
    gc.collect()
    capfd.readouterr()
    # A renamed input ("input.1" is not a Relax identifier) and Gather's "fast mode" take: TVM warns.
    table = onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input.1"], ["y"])], "g",
                              [helper.make_tensor_value_info("input.1", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("y", F, [2, 3, 4])], [table])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    notes = ImportNotes()
    to_relax(onnx.load(str(path)), str(path), notes)
    prepared = prepare(str(path), "patterns")
    out, printed = capfd.readouterr()
    assert out == "" and printed == ""
    assert notes.warnings and len(prepared.notes.warnings) >= len(notes.warnings)
    assert f"{len(prepared.notes.warnings)} TVM import warning(s) not shown" in prepared.notes.summary()


def test_seeded_inputs_give_a_mask_input_zeros_and_ones_and_ids_a_small_range():
    """HF's attention_mask is 0 or 1: other values send (1 - mask) x finfo.min past float16's range
    (+inf scores) and make the module and its exported graph compute different things."""
    import numpy as np

    from autofuse.model.importer import random_feeds

    feeds = random_feeds([("input_ids", (4, 64), "int64"), ("attention_mask", (4, 64), "int64"),
                          ("x", (3,), "float16")], seed=0)
    assert set(np.unique(feeds["attention_mask"])) == {0, 1}
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() > 1
    assert feeds["x"].dtype == np.float16
