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
    """A 3x3 'same' conv with bias and ReLU, a depthwise one, a strided one, a strided
    depthwise one big enough to run in parallel, a 5x5 strided depthwise one over rows of 7
    (MobileNetV3's), a strided dense one with 48 output channels (three vectors), and a strided
    dense one with 8 over rows of 64 (a stem's)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"]),
             helper.make_node("Conv", ["y", "wd"], ["d"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Conv", ["y", "ws"], ["s"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["big", "wsd"], ["sd"], pads=[1, 1, 1, 1], strides=[2, 2], group=16),
             helper.make_node("Conv", ["small", "wsn"], ["sn"], pads=[2, 2, 2, 2], strides=[2, 2], group=24),
             helper.make_node("Conv", ["small", "wwide"], ["sw"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["big", "wstem"], ["st"], pads=[1, 1, 1, 1], strides=[2, 2])]
    return _model(nodes, [("x", [1, 4, 8, 8]), ("big", [1, 16, 128, 128]), ("small", [1, 24, 14, 14])],
                  [("d", [1, 8, 8, 8]), ("s", [1, 8, 4, 4]), ("sd", [1, 16, 64, 64]), ("sn", [1, 24, 7, 7]),
                   ("sw", [1, 48, 7, 7]), ("st", [1, 8, 64, 64])],
                  [_const("w", 8, 4, 3, 3), _const("b", 8), _const("wd", 8, 1, 3, 3), _const("ws", 8, 8, 3, 3),
                   _const("wsd", 16, 1, 3, 3), _const("wsn", 24, 1, 5, 5), _const("wwide", 48, 24, 3, 3),
                   _const("wstem", 8, 16, 3, 3)])


def _pointwise():
    """Pointwise (1x1) convolutions: 16 to 32 channels over 28 x 28 with bias, a residual and ReLU
    (ResNet's expansion), 24 to 32 over 14 x 14 with a residual and ReLU (196 positions, no multiple
    of a vector), 16 to 32 at stride 2, 24 to 32 over 6 x 6 (36 positions), 24 to 16 over 14 x 14."""
    nodes = [helper.make_node("Conv", ["plane", "wpw", "bpw"], ["pc"]),
             helper.make_node("Add", ["pc", "res"], ["pr"]),
             helper.make_node("Relu", ["pr"], ["pw"]),
             helper.make_node("Conv", ["small", "wpw14"], ["pc14"]),
             helper.make_node("Add", ["pc14", "res14"], ["pr14"]),
             helper.make_node("Relu", ["pr14"], ["pw14"]),
             helper.make_node("Conv", ["plane", "wpw"], ["pws"], strides=[2, 2]),
             helper.make_node("Conv", ["tiny", "wpw14"], ["pw6"]),
             helper.make_node("Conv", ["small", "wpw16"], ["pw16"])]
    return _model(nodes, [("plane", [1, 16, 28, 28]), ("res", [1, 32, 28, 28]), ("small", [1, 24, 14, 14]),
                          ("res14", [1, 32, 14, 14]), ("tiny", [1, 24, 6, 6])],
                  [("pw", [1, 32, 28, 28]), ("pw14", [1, 32, 14, 14]), ("pws", [1, 32, 14, 14]),
                   ("pw6", [1, 32, 6, 6]), ("pw16", [1, 16, 14, 14])],
                  [_const("wpw", 32, 16, 1, 1), _const("bpw", 32), _const("wpw14", 32, 24, 1, 1),
                   _const("wpw16", 16, 24, 1, 1)])


@pytest.fixture(scope="module")
def graph_kernels(tmp_path_factory):
    """Every kernel of the three graphs under FuseOps, by name."""
    found = {}
    for name, model in (("ffn", _ffn()), ("attention", _attention()), ("conv", _conv()), ("pointwise", _pointwise())):
        path = tmp_path_factory.mktemp("graphs") / f"{name}.onnx"
        onnx.save(model, str(path))
        for kernel in kernels(prepare(str(path), "auto").mod):
            found[f"{name}:{kernel.name}"] = kernel
    return found


def _rule_of(kernels_by_name, *needles, target=TARGET):
    """The default rule of the one kernel whose name holds every needle, and the kernel."""
    matching = [k for name, k in kernels_by_name.items() if all(n in name for n in needles)]
    assert len(matching) == 1, (needles, sorted(kernels_by_name))
    sch, source = untuned(matching[0].func, target)
    return source, sch, matching[0]


# AVX-512 on 256-bit units (a ymm FMA as fast as a zmm one), and on Intel's 512-bit ones. The
# schedules are made for these and built for the host to check them (any x86-64 runs them).
ZNVER4 = parse_target('{"kind": "llvm", "mcpu": "znver4", "num-cores": 2}')
SAPPHIRERAPIDS = parse_target('{"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}')


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
    (("conv:", "conv2d3"), "cpu_parallel"),      # stride 2, depthwise, rows wider than a vector
    (("conv:", "conv2d4"), "cpu_conv"),          # stride 2, depthwise, rows of 7: columns deinterleaved
    (("conv:", "conv2d5"), "cpu_conv"),          # stride 2, 48 channels: channel vectors
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
                                     ("conv:", "conv2d_add_relu"), ("conv:", "conv2d2"), ("conv:", "conv2d4"),
                                     ("conv:", "conv2d5"), ("pointwise:", "add1_relu"),
                                     ("pointwise:", "conv2d1_add2")])
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


# --- convolutions: the channel-vector tile, deinterleaved columns ----------------------------------

def _allocs(sch):
    """name -> (shape, scope) of every buffer the scheduled function allocates."""
    root = sch.get(sch.get_sblock("root"))
    return {b.name: ([int(d) for d in b.shape], b.scope()) for b in root.alloc_buffers}


def _update_loops(sch):
    """The conv's update block (after decompose_reduction) and its loops."""
    blocks = [b for b in _all_blocks(sch) if sch.get(b).name_hint.endswith("_update")]
    assert len(blocks) == 1
    return blocks[0], sch.get_loops(blocks[0])


def _all_blocks(sch):
    found = []

    def walk(block):
        for child in sch.get_child_blocks(block):
            found.append(child)
            walk(child)

    walk(sch.get_sblock("root"))
    return found


@pytest.mark.parametrize("needles,channels,lanes", [(("conv:", "conv2d2"), 8, 8), (("conv:", "conv2d5"), 48, 16),
                                                    (("conv:", "conv2d_add_relu"), 8, 8)],
                         ids=["stride2-8ch", "stride2-48ch", "same-8ch"])
def test_dense_convs_run_on_the_channel_vector_tile_with_W_repacked(graph_kernels, needles, channels, lanes):
    """W repacked to [f / V][window][V], the accumulators channel-innermost ([.., x, f]) in a local
    tile within TVM's stack limit, the update's innermost loop a vector of V output channels, the
    positions before it unrolled; and the kernel matches the unscheduled one."""
    source, sch, kernel = _rule_of(graph_kernels, *needles, target=ZNVER4)
    assert source == "cpu_conv"
    allocs = _allocs(sch)
    packed = [shape for name, (shape, _) in allocs.items() if name.endswith("_global")]
    assert len(packed) == 1 and packed[0][0] == channels // lanes and packed[0][-1] == lanes, allocs
    local = [shape for shape, scope in allocs.values() if scope == "local"]
    assert len(local) == 1 and local[0][-1] == channels, "accumulators channel-innermost"
    _, loops = _update_loops(sch)
    assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED and int(sch.get(loops[-1]).extent) == lanes
    assert sch.get(loops[-3]).kind == tvm.tirx.ForKind.UNROLLED, "positions unrolled"
    vectors, positions = int(sch.get(loops[-2]).extent), int(sch.get(loops[-3]).extent)
    assert vectors * positions * lanes * 4 <= cpu_rules.MAX_STACK_BYTES
    ok, message = checker(kernel, TARGET, DEV)(sch)
    assert ok, message


@pytest.mark.parametrize("needles,strided", [(("conv:", "conv2d6"), True), (("conv:", "conv2d_add_relu"), False)],
                         ids=["stride2-8ch-64cols", "same-8ch"])
def test_half_width_channel_vectors_give_way_to_row_vectors_where_they_are_half_rate(graph_kernels, needles,
                                                                                     strided):
    """On Intel's AVX-512 an 8-channel dense conv (half a zmm of channels) is vectorised along its
    output rows instead, all 8 channels' accumulators at once, W not repacked; a strided one over
    the padding copy's columns deinterleaved. 48 channels (whole vectors), and 8 over rows of 4
    (narrower than the channel vector), keep the channel tile."""
    source, sch, kernel = _rule_of(graph_kernels, *needles, target=SAPPHIRERAPIDS)
    assert source == "cpu_conv"
    allocs = _allocs(sch)
    assert not any(name.endswith("_global") for name in allocs), "W as stored"
    _, loops = _update_loops(sch)
    assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED
    assert sch.get(loops[-2]).kind == tvm.tirx.ForKind.UNROLLED and int(sch.get(loops[-2]).extent) == 8
    assert ("% T.int64(2), v_rx // T.int64(2) + v_xx]" in sch.mod.script()) == strided
    ok, message = checker(kernel, TARGET, DEV)(sch)
    assert ok, message
    for other in ("conv2d5", "conv2d2"):
        source, sch, _ = _rule_of(graph_kernels, "conv:", other, target=SAPPHIRERAPIDS)
        assert any(name.endswith("_global") for name in _allocs(sch)), f"{other}: the channel tile"


def test_the_channel_vector_tile_takes_the_targets_vectors():
    """Vectors of 16 channels on AVX-512, 8 on AVX2 (half a vector where a whole one does not divide
    the channels), none below 4; tiles within the registers and the stack limit."""
    from tvm.target import Target
    from search_spaces.lib.cpu_gemm import vector_unit
    avx2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    assert cpu_rules.channel_vector(ZNVER4, "float32", 48) == 16
    assert cpu_rules.channel_vector(ZNVER4, "float32", 24) == 8
    assert cpu_rules.channel_vector(avx2, "float32", 24) == 8
    assert cpu_rules.channel_vector(avx2, "float32", 12) == 4
    assert cpu_rules.channel_vector(ZNVER4, "float32", 12) is None
    for target in (ZNVER4, avx2):
        unit = vector_unit(target)
        for lanes in (8, unit.lanes):
            for vectors in (1, 2, 3, 4, 64):
                for width in (7, 14, 28, 56, 112):
                    f, p = cpu_rules.channel_tile_shape(unit, vectors, lanes, width)
                    assert vectors % f == 0 and width % p == 0
                    assert f * p + f <= unit.registers - 4 and f * p * lanes * 4 <= cpu_rules.MAX_STACK_BYTES
                    assert f * p <= cpu_rules.CHANNEL_TILE_ACCUMULATORS


def test_an_avx2_target_gets_eight_channel_vectors_and_still_matches(graph_kernels):
    from tvm.target import Target
    avx2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    _, _, kernel = _rule_of(graph_kernels, "conv:", "conv2d5")
    sch = s_tir.Schedule(kernel.func)
    cpu_rules.conv(sch, avx2, Knobs(sch, False))
    _, loops = _update_loops(sch)
    assert int(sch.get(loops[-1]).extent) == 8
    ok, message = checker(kernel, avx2, DEV)(sch)
    assert ok, message


def test_a_narrow_strided_depthwise_conv_reads_deinterleaved_columns(graph_kernels):
    """The padded input stored [.., row, column % 2, column // 2] (written in that order), so the
    5x5 stride-2 window's row vectors are contiguous: the update's innermost loop a vector along
    the output row; the padding copy's loops left to LLVM (not TVM vectors)."""
    source, sch, kernel = _rule_of(graph_kernels, "conv:", "conv2d4")
    assert source == "cpu_conv"
    allocs = _allocs(sch)
    assert allocs["pad_temp"][0] == [1, 24, 18, 2, 9], allocs
    _, loops = _update_loops(sch)
    assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED and int(sch.get(loops[-1]).extent) == 7
    pad = sch.get_loops(sch.get_sblock("pad_temp"))
    assert not any(sch.get(loop).kind == tvm.tirx.ForKind.VECTORIZED for loop in pad)
    assert "pad_temp[" in sch.mod.script() and "% T.int64(2), v_rx // T.int64(2) + v_xx]" in sch.mod.script()
    ok, message = checker(kernel, TARGET, DEV)(sch)
    assert ok, message


@pytest.mark.parametrize("c_out,packed", [(32, True), (8, False)])
def test_conv2d_bn_relus_first_template_is_the_channel_tile_from_two_vectors(c_out, packed):
    """conv2d_bn_relu's CPU default: the channel-vector tile (W repacked) at 32 output channels,
    tiled_direct's row vectors at 8; both match the reference, a 1x1 one too."""
    from autofuse.registry import get_pattern
    from autofuse.verify import check_module
    pattern = get_pattern("conv2d_bn_relu")
    first = pattern.templates_for(TARGET)[0]
    assert first.name == "channel_tile"
    for kernel in (3, 1):
        shape = pattern.resolve_shape({"n": 1, "c_in": 16, "h": 14, "w": 14, "c_out": c_out, "kernel": kernel})
        func = pattern.build(shape, "float32")
        sch = first.apply(func, TARGET, tunable=False)
        assert ("weight_global" in _allocs(sch)) == packed
        if packed and kernel == 1:
            assert "pad" not in [sch.get(b).name_hint for b in _all_blocks(sch)], "a 1x1 kernel reads x itself"
        result = check_module(pattern, tvm.tirx.build(sch.mod, target=TARGET), func, shape, "float32", DEV)
        assert result.ok, result.message


@pytest.mark.parametrize("target", [ZNVER4, SAPPHIRERAPIDS], ids=["znver4", "sapphirerapids"])
def test_pointwise_convs_run_as_gemms_over_the_flattened_plane(graph_kernels, target):
    """A 1x1, unit-stride convolution whose 28 x 28 output positions fill whole vectors runs as the
    GEMM it is: positions flattened (one loop of 784, vectors along it, not along rows of 28), a
    tile of 8 channels x vectors, the bias, residual and ReLU stored from the tile. At 14 x 14 the
    196 positions are padded to 13 vectors (its input copied once into a zero-padded plane); one at
    stride 2, one of 36 positions and one of 16 channels over 196 keep the channel tile. Each
    matches the unscheduled kernel."""
    lanes = cpu_rules.lanes_for(target, "float32")
    for needles, padded in ((("pointwise:", "conv2d_add_add1_relu"), False), (("pointwise:", "conv2d1_add2"), True)):
        source, sch, kernel = _rule_of(graph_kernels, *needles, target=target)
        assert source == "cpu_conv"
        kinds = [inst.kind.name for inst in sch.trace.insts]
        assert kinds.count("TransformBlockLayout") == 2 and "CacheRead" not in kinds  # W not repacked
        assert kinds.count("PadEinsum") == padded
        _, loops = _update_loops(sch)
        assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED and int(sch.get(loops[-1]).extent) == lanes
        assert int(sch.get(loops[-3]).extent) == 8 and sch.get(loops[-3]).kind == tvm.tirx.ForKind.UNROLLED
        names = [sch.get(b).name_hint for b in _all_blocks(sch)]
        assert not any(name.startswith("T_add") or name == "compute" for name in names), names  # epilogue on the tile
        if padded:
            assert ([1, 24, 13 * lanes], "global") in _allocs(sch).values(), _allocs(sch)  # the padded plane
        ok, message = checker(kernel, TARGET, DEV)(sch)
        assert ok, message
    for other in ("conv2d2", "conv2d3", "conv2d4"):
        source, sch, kernel = _rule_of(graph_kernels, "pointwise:", other, target=target)
        assert source == "cpu_conv" and "TransformBlockLayout" not in [i.kind.name for i in sch.trace.insts]
        ok, message = checker(kernel, TARGET, DEV)(sch)
        assert ok, message
