"""Each pattern's ONNX graph (what the baselines run) computes what its numpy reference does, and
imports into Relax, where --fusion patterns finds that very pattern in it."""

import numpy as np
import pytest

from autofuse.accuracy import compare
from autofuse.registry import all_patterns

PATTERNS = [p for p in all_patterns().values() if p.onnx_graph is not None]


def test_every_pattern_has_an_onnx_graph():
    assert len(PATTERNS) == len(all_patterns())


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_onnx_graph_matches_the_reference_and_is_found_by_its_rule(pattern, tmp_path):
    import onnx
    import onnxruntime as ort

    from autofuse.model.fusion import fuse
    from autofuse.model.importer import to_relax

    shape, dtype = pattern.small_shape(), pattern.dtypes[0]
    model = pattern.onnx_graph(shape, dtype)
    onnx.checker.check_model(model)
    inputs = pattern.make_inputs(shape, dtype, 3)
    initializers = {i.name for i in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in initializers]
    assert len(names) == len(inputs)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    expected = pattern.run_reference(inputs, shape)
    check = compare(got, expected, **pattern.check_args(shape, dtype))
    assert check.ok, check.message
    _, matches = fuse(to_relax(model, pattern.name), "patterns")
    if pattern.relax_rules:
        assert matches == {pattern.name: 1}
    else:  # no rule of its own yet (gelu_add_layernorm): at most a smaller pattern inside it
        assert pattern.name not in matches
