"""onnxruntime: the same ONNX graph in onnxruntime, all graph optimisations on. On a CPU its CPU
provider, pinned to the compare run's thread count; on a GPU its CUDA provider (onnxruntime-gpu)
with inputs and outputs bound on the device, so a run copies nothing to or from the host."""

from __future__ import annotations

from . import Context, Prepared, Subject, Unavailable


class OnnxRuntime:
    name = "onnxruntime"
    description = "onnxruntime, ORT_ENABLE_ALL (CPUExecutionProvider; CUDAExecutionProvider on a GPU)"
    runs_onnx_graph = True

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
        info = {"version": ort.__version__}
        if ctx.device == "cuda":
            return self._cuda(ort, subject, ctx, options, info)
        session = ort.InferenceSession(subject.onnx_path, options, providers=["CPUExecutionProvider"])
        feeds = subject.feeds
        last = {}

        def launch():
            last["out"] = session.run(None, feeds)

        return Prepared(launch, lambda: None, lambda: list(last["out"]), {**info, "provider": "CPUExecutionProvider"})

    @staticmethod
    def _cuda(ort, subject: Subject, ctx: Context, options, info: dict) -> Prepared:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable("this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
        device = ctx.dev.index
        session = ort.InferenceSession(subject.onnx_path, options,
                                       providers=[("CUDAExecutionProvider", {"device_id": device})])
        if "CUDAExecutionProvider" not in session.get_providers():
            raise Unavailable("onnxruntime could not start its CUDA provider (CUDA/cuDNN libraries?)")
        binding = session.io_binding()
        for name, array in subject.feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", device))
        for output in session.get_outputs():
            binding.bind_output(output.name, "cuda", device)

        # run_with_iobinding returns when its stream is done: ORT's own stream, not torch's.
        return Prepared(lambda: session.run_with_iobinding(binding), lambda: None,
                        lambda: [o.numpy() for o in binding.get_outputs()],
                        {**info, "provider": "CUDAExecutionProvider"}, same_stream=False)
