"""linear: y = x @ W, W (k, n): a projection without bias (Llama's q/k/v/o projections, LM heads).

The rule takes a matmul only where W is a model's weight (a constant or a graph input, possibly
transposed), so attention's products of two activations stay with the attention rules or the
batched GEMM default, and it runs after every rule whose match holds such a matmul (swiglu_ffn,
the biased linear patterns). The TensorIR, reference, templates and rule are ``search_spaces.lib.linear``'s.
"""

from autofuse.pattern import Pattern
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.linear import Linear

LINEAR = Linear("linear", act="none", bias=False)
build, reference, make_inputs, flops, nbytes, onnx_graph = (
    LINEAR.build, LINEAR.reference, LINEAR.make_inputs, LINEAR.flops, LINEAR.nbytes, LINEAR.onnx_graph)

PATTERN = Pattern.from_module(
    globals(),
    description="x @ W: GEMM without bias (projections, LM heads), W (k, n) a model weight",
    shape_params=gemm_shape((256, 16), (256, 32), (256, 16)),
    templates=LINEAR.templates(),
    relax_rules=[LINEAR.relax_rule(priority=-3)],
)
