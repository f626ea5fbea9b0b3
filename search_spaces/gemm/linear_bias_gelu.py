"""linear_bias_gelu: y = gelu(x @ W + b), exact (erf) GELU, W (k, n): BERT's and ViT's FFN up
projection.

Unfused, the GEMM writes m*n values that the bias add and GELU's elementwise ops read back; fused,
they run on the accumulator tile while it is in registers, erf as ``tir_math``'s rational
polynomial (vectorises; libm's erff is a scalar call per element). Matched as BERT's export spells
GELU (Div, Erf, Add, Mul, Mul) or an ONNX Gelu. The TensorIR, reference, templates and rule are
``search_spaces.lib.linear``'s.
"""

from autofuse.pattern import Pattern
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.linear import Linear

LINEAR = Linear("linear_bias_gelu", act="gelu_erf", bias=True)
build, reference, make_inputs, flops, nbytes, onnx_graph = (
    LINEAR.build, LINEAR.reference, LINEAR.make_inputs, LINEAR.flops, LINEAR.nbytes, LINEAR.onnx_graph)

PATTERN = Pattern.from_module(
    globals(),
    description="gelu(x @ W + b), erf GELU: GEMM with bias and GELU fused in its epilogue, W (k, n)",
    shape_params=gemm_shape((256, 16), (1024, 32), (256, 16)),
    templates=LINEAR.templates(),
    relax_rules=[LINEAR.relax_rule(priority=-1)],
)
