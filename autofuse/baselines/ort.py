"""onnxruntime: the same ONNX graph in onnxruntime's CPU provider, all graph optimisations on,
pinned to the compare run's thread count."""

from __future__ import annotations

from . import Context, Prepared, Subject, Unavailable


class OnnxRuntime:
    name = "onnxruntime"
    description = "onnxruntime CPUExecutionProvider, ORT_ENABLE_ALL"

    def prepare(self, subject: Subject, ctx: Context) -> Prepared:
        try:
            import onnxruntime as ort
        except ImportError:
            raise Unavailable("onnxruntime is not installed (pip install -e '.[bench]')") from None
        if subject.onnx_path is None:
            raise Unavailable(f"{subject.name} has no ONNX graph")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = ctx.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(subject.onnx_path, options, providers=["CPUExecutionProvider"])
        feeds = subject.feeds
        last = {}

        def call():
            last["out"] = session.run(None, feeds)

        return Prepared(call, lambda: list(last["out"]), {"version": ort.__version__})
