"""xla: the same ONNX graph as a JAX function (``onnx_to_jax``) under ``jax.jit`` on the CPU —
XLA's automatic fusion as a baseline, run on exactly the computation onnxruntime runs."""

from __future__ import annotations

import numpy as np

from ..errors import AutofuseError
from . import Context, Prepared, Subject, Unavailable


class Xla:
    name = "xla"
    description = "jax.jit on CPU (XLA fusion) of the same ONNX graph"

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        try:
            import jax
        except ImportError:
            raise Unavailable("jax is not installed (pip install -e '.[bench]')") from None
        if subject.onnx_path is None:
            raise Unavailable(f"{subject.name} has no ONNX graph")
        import onnx

        from .onnx_to_jax import jax_function

        try:
            fn = jax.jit(jax_function(onnx.load(subject.onnx_path)))
        except AutofuseError as err:
            raise Unavailable(str(err)) from None
        cpu = jax.devices("cpu")[0]
        args = [jax.device_put(x, cpu) for x in subject.inputs]
        last = {}

        def call():
            last["out"] = jax.block_until_ready(fn(*args))

        return Prepared(call, lambda: [np.asarray(o) for o in last["out"]], {"version": jax.__version__})
