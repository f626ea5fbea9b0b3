"""search_spaces.lib.cpu_rules, the untuned CPU default of kernels no pattern made: on the kernels
FuseOps makes of small ONNX graphs (a GELU FFN, tanh-GELU and SiLU epilogues, attention's batched
matmuls and softmax, LayerNorm, RMSNorm, a spatial mean, transposes, convolutions), each rule
takes its kind of kernel, the schedule matches the unscheduled kernel, a GEMM-shaped kernel runs
as lib.cpu_gemm's GEMM with its epilogue vectorised on the register tile, and a knob sample
replays.
How verify wires them (checked, stock for the TVM baselines): tests/test_verify.py."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import s_tir

from autofuse.model.jobs import prepare
from autofuse.measure import param_buffers
from autofuse.model.kernels import kernels
from autofuse.pattern import Knobs
from autofuse.target import parse_target
from autofuse.verify import CPU_RULES, checker, untuned
from search_spaces.lib import cpu_rules

TARGET = parse_target("llvm")
DEV = tvm.cpu()
F32 = onnx.TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _const(name, *shape, scale=0.2):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype("float32"), name)


def _scalar(name, value):
    return numpy_helper.from_array(np.array(value, dtype="float32"), name)


def _model(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, F32, s) for n, s in outputs], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _ffn():
    """x (1, 8, 32): MatMul, Add, erf GELU as torch exports it; MatMul, Add, residual Add; then a
    second branch with a tanh GELU and one with SiLU (x * sigmoid(x))."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Div", ["hb", "sqrt2"], ["hd"]), helper.make_node("Erf", ["hd"], ["he"]),
        helper.make_node("Add", ["he", "one"], ["h1"]), helper.make_node("Mul", ["hb", "h1"], ["hm"]),
        helper.make_node("Mul", ["hm", "half"], ["g"]),
        helper.make_node("MatMul", ["g", "w2"], ["o"]), helper.make_node("Add", ["o", "b2"], ["ob"]),
        helper.make_node("Add", ["ob", "x"], ["y"]),
        # tanh GELU: 0.5 t (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3)))
        helper.make_node("MatMul", ["x", "w3"], ["t0"]), helper.make_node("Add", ["t0", "b1"], ["t"]),
        helper.make_node("Pow", ["t", "three"], ["t3"]), helper.make_node("Mul", ["t3", "c"], ["t3c"]),
        helper.make_node("Add", ["t", "t3c"], ["u"]), helper.make_node("Mul", ["u", "k"], ["uk"]),
        helper.make_node("Tanh", ["uk"], ["th"]), helper.make_node("Add", ["th", "one"], ["th1"]),
        helper.make_node("Mul", ["t", "th1"], ["tm"]), helper.make_node("Mul", ["tm", "half"], ["gt"]),
        # SiLU
        helper.make_node("MatMul", ["x", "w4"], ["s0"]), helper.make_node("Sigmoid", ["s0"], ["ss"]),
        helper.make_node("Mul", ["s0", "ss"], ["gs"]),
    ]
    inits = [_const("w1", 32, 64), _const("b1", 64), _const("w2", 64, 32), _const("b2", 32), _const("w3", 32, 64),
             _const("w4", 32, 48), _scalar("sqrt2", np.sqrt(2.0)), _scalar("one", 1.0), _scalar("half", 0.5),
             _scalar("three", 3.0), _scalar("c", 0.044715), _scalar("k", np.sqrt(2 / np.pi))]
    return _model(nodes, [("x", [1, 8, 32])], [("y", [1, 8, 32]), ("gt", [1, 8, 64]), ("gs", [1, 8, 48])], inits)


def _attention():
    """q, k, v (1, 2, 8, 16): softmax(q k^T * s) v, LayerNorm, RMSNorm as exporters decompose it, a
    mean over the last two axes, a transpose."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["o"]),
        helper.make_node("LayerNormalization", ["q", "gamma", "beta"], ["ln"], axis=-1),
        helper.make_node("Pow", ["v", "two"], ["v2"]), helper.make_node("ReduceMean", ["v2"], ["ms"], axes=[-1]),
        helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["v", "rms"], ["vn"]), helper.make_node("Mul", ["vn", "gamma"], ["rn"]),
        helper.make_node("ReduceMean", ["k"], ["km"], axes=[2, 3], keepdims=1),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
    ]
    inits = [_scalar("scale", 0.25), _const("gamma", 16), _const("beta", 16), _scalar("two", 2.0),
             _scalar("eps", 1e-6)]
    shape = [1, 2, 8, 16]
    return _model(nodes, [("q", shape), ("k", shape), ("v", shape)],
                  [("o", shape), ("ln", shape), ("rn", shape), ("km", [1, 2, 1, 1]), ("qt", [1, 8, 2, 16])], inits)


def _conv():
    """A 3x3 'same' conv with bias and ReLU, a depthwise one, a strided one, and a strided
    depthwise one big enough to run in parallel."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"]),
             helper.make_node("Conv", ["y", "wd"], ["d"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Conv", ["y", "ws"], ["s"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["big", "wsd"], ["sd"], pads=[1, 1, 1, 1], strides=[2, 2], group=16)]
    return _model(nodes, [("x", [1, 4, 8, 8]), ("big", [1, 16, 128, 128])],
                  [("d", [1, 8, 8, 8]), ("s", [1, 8, 4, 4]), ("sd", [1, 16, 64, 64])],
                  [_const("w", 8, 4, 3, 3), _const("b", 8), _const("wd", 8, 1, 3, 3), _const("ws", 8, 8, 3, 3),
                   _const("wsd", 16, 1, 3, 3)])


@pytest.fixture(scope="module")
def graph_kernels(tmp_path_factory):
    """Every kernel of the three graphs under FuseOps, by name."""
    found = {}
    for name, model in (("ffn", _ffn()), ("attention", _attention()), ("conv", _conv())):
        path = tmp_path_factory.mktemp("graphs") / f"{name}.onnx"
        onnx.save(model, str(path))
        for kernel in kernels(prepare(str(path), "auto").mod):
            found[f"{name}:{kernel.name}"] = kernel
    return found


def _rule_of(kernels_by_name, *needles):
    """The default rule of the one kernel whose name holds every needle, and the kernel."""
    matching = [k for name, k in kernels_by_name.items() if all(n in name for n in needles)]
    assert len(matching) == 1, (needles, sorted(kernels_by_name))
    sch, source = untuned(matching[0].func, TARGET)
    return source, sch, matching[0]


# (kernel name parts, the rule that schedules it)
EXPECTED = [
    (("ffn:", "erf"), "cpu_gemm"),
    (("ffn:", "matmul1", "add"), "cpu_gemm"),
    (("ffn:", "tanh"), "cpu_gemm"),
    (("ffn:", "sigmoid"), "cpu_gemm"),
    (("attention:", "matmul", "multiply"), "cpu_batched_gemm"),
    (("attention:", "softmax"), "cpu_rows"),
    (("attention:", "layer_norm"), "cpu_rows"),
    (("attention:", "matmul1"), "cpu_batched_gemm"),
    (("attention:", "mean_add_tir_sqrt"), "cpu_rows"),   # RMSNorm (FuseOps leaves the Pow before it)
    (("attention:", "power"), "cpu_injective"),
    (("attention:", "mean1"), "cpu_rows"),
    (("attention:", "transpose1"), "cpu_injective"),
    (("conv:", "conv2d_add_relu"), "cpu_conv"),
    (("conv:", "conv2d1"), "cpu_conv"),          # depthwise
    (("conv:", "conv2d2"), "cpu_conv"),          # stride 2: channel vectors, W repacked
    (("conv:", "conv2d3"), "cpu_parallel"),      # stride 2, depthwise
]


@pytest.mark.parametrize("needles,rule", EXPECTED, ids=[r + ":" + "-".join(n) for n, r in EXPECTED])
def test_each_rule_takes_its_kind_and_matches_the_unscheduled_kernel(graph_kernels, needles, rule):
    source, sch, kernel = _rule_of(graph_kernels, *needles)
    assert source == rule
    ok, message = checker(kernel, TARGET, DEV)(sch)
    assert ok, message


def _output_block(kernel):
    """The name of the block writing the kernel's output (the epilogue, after FuseOps)."""
    func = kernel.func
    sch = s_tir.Schedule(func)
    out = param_buffers(func)[-1]
    names = [sch.get(b).name_hint for b in cpu_rules.root_blocks(sch)
             if any(w.source.same_as(out) for w in sch.get(b).writes)]
    assert len(names) == 1
    return names[0]


@pytest.mark.parametrize("activation", ["erf", "tanh", "sigmoid"])
def test_a_gemm_kernel_runs_as_the_librarys_gemm_with_a_vectorised_polynomial_epilogue(graph_kernels, activation,
                                                                                      monkeypatch):
    from autofuse.building import fast_math
    calls = []
    real = cpu_rules.schedule_gemm
    monkeypatch.setattr(cpu_rules, "schedule_gemm", lambda *a, **k: calls.append(k) or real(*a, **k))
    _, sch, kernel = _rule_of(graph_kernels, "ffn:", activation)
    assert len(calls) == 1 and calls[0]["weight_layout"] == "kn", "the GEMM of lib.cpu_gemm, W (k, n) as exported"
    update = sch.get_loops(sch.get_sblock("matmul_update"))
    epilogue = sch.get_loops(sch.get_sblock(_output_block(kernel)))
    # 8 x 32 x 64 multiply-adds: too few to wake the thread pool for.
    assert sch.get(update[0]).kind == tvm.tirx.ForKind.SERIAL
    # The epilogue (the activation) is on the register tile, inside the GEMM's task loop
    # and right after its k loop, its columns in vectors.
    assert sch.get(epilogue[0]).same_as(sch.get(update[0]))
    assert sch.get(epilogue[-1]).kind == tvm.tirx.ForKind.VECTORIZED
    assert f"T.{activation}(" in sch.mod.script()
    built = fast_math(sch.mod, TARGET).script()
    assert not any(f"T.{op}(" in built for op in ("erf", "tanh", "sigmoid", "exp")), "libm calls are polynomials"


@pytest.mark.parametrize("m, parallel", [(1, False), (256, True)])
def test_a_gemm_runs_in_parallel_only_with_the_work_for_it(m, parallel):
    from tvm import te
    x, w = te.placeholder((m, 256), name="x"), te.placeholder((256, 512), name="w")
    k = te.reduce_axis((0, 256), name="k")
    y = te.compute((m, 512), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="matmul")
    relu = te.compute((m, 512), lambda i, j: te.max(y[i, j], tvm.tirx.const(0.0, "float32")), name="relu")
    sch = s_tir.Schedule(te.create_prim_func([x, w, relu]))
    cpu_rules.gemm(sch, TARGET, Knobs(sch, False))
    assert (m * 256 * 512 >= cpu_rules.PARALLEL_MIN_ELEMENTS) == parallel
    kinds = {sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock("matmul_update"))}
    assert (tvm.tirx.ForKind.PARALLEL in kinds) == parallel


def test_rules_refuse_what_they_do_not_describe(graph_kernels):
    _, _, conv = _rule_of(graph_kernels, "conv:", "conv2d_add_relu")
    _, _, softmax = _rule_of(graph_kernels, "attention:", "softmax")
    _, _, gemm = _rule_of(graph_kernels, "ffn:", "erf")
    for fn, kernel in ((cpu_rules.gemm, softmax), (cpu_rules.batched_gemm, gemm), (cpu_rules.rows, conv),
                       (cpu_rules.injective, softmax), (cpu_rules.conv, gemm)):
        sch = s_tir.Schedule(kernel.func)
        with pytest.raises(cpu_rules.NotApplicable):
            fn(sch, TARGET, Knobs(sch, False))


@pytest.mark.parametrize("needles", [("ffn:", "erf"), ("attention:", "matmul", "multiply"), ("attention:", "softmax"),
                                     ("conv:", "conv2d_add_relu"), ("conv:", "conv2d2")])
def test_a_knob_sample_replays_and_still_matches(graph_kernels, needles):
    """As MetaSchedule replays a rule's trace with new decisions: sampled, replayed on a fresh
    schedule, checked."""
    source, _, kernel = _rule_of(graph_kernels, *needles)
    rule = next(r for r in CPU_RULES if r.name == source)
    sampled = s_tir.Schedule(kernel.func, seed=3)
    rule.schedule(sampled, TARGET, tunable=True)
    replayed = s_tir.Schedule(kernel.func)
    sampled.trace.apply_to_schedule(replayed, remove_postproc=False)
    ok, message = checker(kernel, TARGET, DEV)(replayed)
    assert ok, message
