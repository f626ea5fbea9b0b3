"""The schedule library the patterns stand on, in the manner of dlight's ``base`` and ``analysis``.

TensorIR building blocks and schedule steps with public names, shared by the patterns under
``search_spaces/``: ``tir_math`` (polynomial exp and erf, the dropout hash), ``cpu_rows`` and
``cuda_rows`` (row reductions), ``cuda_gemm`` (tiled and tensor-core GEMM steps), ``attention``
(softmax stages and the attention kernels' shared steps), ``onnx_graphs`` (graphs with inputs of
several dtypes). A pattern imports this library and ``autofuse.pattern``, never another pattern;
the library imports no pattern and nothing of autofuse but its error type.
"""
