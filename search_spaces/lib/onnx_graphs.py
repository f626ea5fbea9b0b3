"""ONNX graphs whose inputs and outputs are not all of one dtype (integer indices, masks, quantised
weights next to float activations): ``autofuse.pattern.onnx_model`` gives every tensor the
pattern's dtype. onnx is imported only when a graph is built, as the baselines need it."""

import numpy as np


def typed_model(name, nodes, inputs, outputs, initializers=None, opset=17):
    """A checked ONNX model of ``nodes``; ``inputs`` and ``outputs`` are (name, shape, dtype)
    triples (a numpy dtype or its name), ``initializers`` a dict of numpy constants."""
    import onnx
    from onnx import helper, numpy_helper

    def value_info(name_, shape, dtype):
        return helper.make_tensor_value_info(name_, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape))

    graph = helper.make_graph(list(nodes), name, [value_info(*t) for t in inputs], [value_info(*t) for t in outputs],
                              initializer=[numpy_helper.from_array(np.asarray(v), k)
                                           for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="autofuse")
    onnx.checker.check_model(model)
    return model
