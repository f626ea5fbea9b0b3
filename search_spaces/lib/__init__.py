"""The schedule library the patterns stand on, in the manner of dlight's ``base`` and ``analysis``.

TensorIR building blocks and schedule steps with public names, shared by the patterns under
``search_spaces/``: ``tir_math`` (polynomial exp and erf, the dropout hash), ``tiling`` (the unroll
knob, CPU register tiles), ``stages`` (the GEMM and row-sum blocks several patterns write),
``cpu_rows`` and ``cuda_rows`` (row reductions), ``gemm`` (the GEMM/FFN shape parameters),
``cpu_gemm``, ``cuda_gemm`` and ``cuda_wgmma`` (GEMM schedules), ``attention`` and
``cuda_attention`` (softmax stages, attention kernels, the attention shape parameters),
``tirx_sequence`` (several tirx kernels as one PrimFunc), ``layernorm``, ``onnx_graphs`` (graphs
with inputs of several dtypes, attention's nodes). A pattern imports this library,
``autofuse.pattern`` and ``autofuse.kernel_templates`` (its ``KernelTemplate``), never another
pattern; the library imports no pattern, and of autofuse only its error type and
``autofuse.pattern`` (the shape parameters patterns share).
"""


def register_intrinsics(text: str | None = None) -> None:
    """Register the library's own tensor intrinsics with TVM (they are registered lazily, at first
    use): those named in ``text`` (a trace or record), or all. A trace that tensorizes with one
    replays, and a record of it parses, only after this."""
    from .cpu_gemm import PAIR_DOT_PREFIX, register_pair_dots
    if text is None or PAIR_DOT_PREFIX in text:
        register_pair_dots()
