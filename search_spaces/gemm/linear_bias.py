"""linear_bias: y = x @ W + b, W (k, n): nn.Linear as torch.onnx exports it (MatMul + Add).

Unfused, the GEMM writes m*n values that the bias add reads back; fused, the bias is added to the
accumulator tile while it is in registers. The rule runs after linear_bias_relu's and the GELU
patterns' (whose matches contain this one) and takes only a bias of shape (n,): a residual added
to a projection stays with the residual's own rule (layernorm_residual, rms_norm). The TensorIR,
reference, templates and rule are ``search_spaces.lib.linear``'s.
"""

from autofuse.pattern import Pattern
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.linear import Linear

LINEAR = Linear("linear_bias", act="none", bias=True)
build, reference, make_inputs, flops, nbytes, onnx_graph = (
    LINEAR.build, LINEAR.reference, LINEAR.make_inputs, LINEAR.flops, LINEAR.nbytes, LINEAR.onnx_graph)

PATTERN = Pattern.from_module(
    globals(),
    description="x @ W + b: GEMM with the bias fused in its epilogue, W (k, n)",
    shape_params=gemm_shape((256, 16), (256, 32), (256, 16)),
    templates=LINEAR.templates(),
    relax_rules=[LINEAR.relax_rule(priority=-2)],
)
