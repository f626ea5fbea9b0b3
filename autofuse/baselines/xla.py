"""xla: the same ONNX graph as a JAX function (``onnx_to_jax``) under ``jax.jit`` on the compare
device — XLA's automatic fusion as a baseline, run on exactly the computation onnxruntime runs.
On a GPU (jax with CUDA) float32 matmuls run at 'highest' precision, no TF32, like every
contender; XLA runs on streams of its own."""

from __future__ import annotations

import numpy as np

from ..errors import AutofuseError
from . import Context, Prepared, Subject, Unavailable


class Xla:
    name = "xla"
    description = "jax.jit (XLA fusion) of the same ONNX graph, on the compare device"
    runs_onnx_graph = True

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        try:
            import jax
        except ImportError:
            raise Unavailable("jax is not installed (pip install -e '.[bench]')") from None
        if subject.onnx_path is None:
            raise Unavailable(f"{subject.name} has no ONNX graph")
        from .onnx_to_jax import jax_function

        device = _device(jax, ctx)
        try:
            fn = jax.jit(jax_function(subject.static_graph()))
        except AutofuseError as err:
            raise Unavailable(str(err)) from None
        args = [jax.device_put(x, device) for x in subject.inputs]
        last = {}

        def launch():
            last["out"] = fn(*args)

        return Prepared(launch, lambda: jax.block_until_ready(last["out"]),
                        lambda: [np.asarray(o) for o in last["out"]],
                        {"version": jax.__version__, "device": str(device)}, same_stream=ctx.device == "cpu")


def _device(jax, ctx: Context):
    if ctx.device == "cpu":
        return jax.devices("cpu")[0]
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except RuntimeError:
        gpus = []
    if not gpus:
        try:
            seen = ", ".join(sorted({d.platform for d in jax.devices()}))
        except RuntimeError:
            seen = "none"
        raise Unavailable(f"jax sees no CUDA device (platforms: {seen}; pip install 'jax[cuda12]')")
    return gpus[min(ctx.dev.index, len(gpus) - 1)]
