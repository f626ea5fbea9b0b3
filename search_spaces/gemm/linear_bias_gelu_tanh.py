"""linear_bias_gelu_tanh: y = 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))), h = x @ W + b,
W (k, n): GPT-2's FFN up projection ("gelu_new").

As linear_bias_gelu, with the tanh approximation: tanh is ``tir_math``'s exp polynomial (vectorises).
Matched as GPT-2's export spells it (Pow, Mul, Add, Mul, Tanh, Mul, Add, Mul, with a Reshape
between the bias and the activation) or an ONNX Gelu(approximate="tanh"). The TensorIR,
reference, templates and rule are ``search_spaces.lib.linear``'s.
"""

from autofuse.pattern import Pattern
from search_spaces.lib.gemm import gemm_shape
from search_spaces.lib.linear import Linear

LINEAR = Linear("linear_bias_gelu_tanh", act="gelu_tanh", bias=True)
build, reference, make_inputs, flops, nbytes, onnx_graph = (
    LINEAR.build, LINEAR.reference, LINEAR.make_inputs, LINEAR.flops, LINEAR.nbytes, LINEAR.onnx_graph)

PATTERN = Pattern.from_module(
    globals(),
    description="gelu_tanh(x @ W + b), tanh GELU: GEMM with bias and GELU fused in its epilogue, W (k, n)",
    shape_params=gemm_shape((256, 16), (1024, 32), (256, 16)),
    templates=LINEAR.templates(),
    relax_rules=[LINEAR.relax_rule(priority=-1)],
)
