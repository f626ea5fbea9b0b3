"""autofuse.verify's untuned CPU default: a model kernel without a record runs the first CPU rule
that applies and passes its check against the kernel as TVM runs it; a rule that fails its check
is passed over (the next one, then the TensorIR as written); the TVM baselines keep TVM's own
default (stock); the polynomial math that builds put in place of libm calls stays within the
check's bound; scheduling a kernel leaves the model's PrimFunc as it was."""

import math

import numpy as np
import onnx
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm.script import tirx as T

from autofuse import building, verify
from autofuse.model.jobs import prepare
from autofuse.model.kernels import apply_database, kernels
from autofuse.pattern import Template
from autofuse.target import parse_target
from search_spaces.lib import cpu_rules

TARGET = parse_target("llvm")
DEV = tvm.cpu()


@pytest.fixture(scope="module")
def gelu_softmax(tmp_path_factory):
    """x (8, 32) @ W (32, 48) + b, erf GELU (one GEMM kernel); softmax of x (a rows kernel)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 48)) * 0.2).astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(48).astype("float32"), "b"),
             numpy_helper.from_array(np.array(np.sqrt(2.0), "float32"), "sqrt2"),
             numpy_helper.from_array(np.array(1.0, "float32"), "one"),
             numpy_helper.from_array(np.array(0.5, "float32"), "half")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Div", ["hb", "sqrt2"], ["hd"]), helper.make_node("Erf", ["hd"], ["he"]),
             helper.make_node("Add", ["he", "one"], ["h1"]), helper.make_node("Mul", ["hb", "h1"], ["hm"]),
             helper.make_node("Mul", ["hm", "half"], ["y"]),
             helper.make_node("Softmax", ["x"], ["p"], axis=-1)]
    f32 = onnx.TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f32, [8, 32])],
                              [helper.make_tensor_value_info("y", f32, [8, 48]),
                               helper.make_tensor_value_info("p", f32, [8, 32])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path_factory.mktemp("verify") / "g.onnx"
    onnx.save(model, str(path))
    mod = prepare(str(path), "auto").mod
    return mod, {("gemm" if "matmul" in k.name else "rows"): k for k in kernels(mod)}


def test_a_model_kernel_runs_its_cpu_rule_checked(gelu_softmax):
    _, by_kind = gelu_softmax
    for kind, rule in (("gemm", "cpu_gemm"), ("rows", "cpu_rows")):
        choice, rejected = verify.choose(by_kind[kind], None, TARGET, DEV, fallback=True)
        assert choice.source == rule and choice.default_source == rule and not choice.is_record, rejected
        assert not rejected


def test_one_checker_checks_every_schedule_it_is_given(gelu_softmax, monkeypatch):
    """A model kernel's check is made once and then judges each record of a search in turn; each
    build is ours (fast_math) unless the checker is for the TVM baselines."""
    _, by_kind = gelu_softmax
    kernel = by_kind["gemm"]
    builds = []
    real_build = verify.build_kernel

    def recording_build(mod, target, *, stock=False):
        builds.append(stock)
        return real_build(mod, target, stock=stock)

    monkeypatch.setattr(verify, "build_kernel", recording_build)
    check = verify.checker(kernel, TARGET, DEV)
    default = verify.default_schedule(kernel.func, TARGET)
    for _ in range(3):
        ok, message = check(default)
        assert ok, message
    assert builds == [True, False, False, False]  # the reference once, with TVM's own default and math


def test_the_tvm_baselines_keep_tvms_own_default(gelu_softmax):
    mod, by_kind = gelu_softmax
    choice, _ = verify.choose(by_kind["gemm"], None, TARGET, DEV, fallback=True, stock=True)
    assert choice.source == verify.UNSCHEDULED
    _, decisions = apply_database(mod, None, TARGET, DEV, stock=True)
    assert {d.default for d in decisions} == {verify.UNSCHEDULED}
    _, ours = apply_database(mod, None, TARGET, DEV)
    assert sorted(d.default for d in ours) == ["cpu_gemm", "cpu_rows"]


def test_a_rule_that_fails_its_check_is_passed_over(gelu_softmax, monkeypatch):
    """cpu_gemm with W staged through float16 (wrong past the bound): the next rule that applies
    takes the kernel, and the notes say why."""
    _, by_kind = gelu_softmax

    broken = Template("cpu_gemm", _half_weights, target_kinds=("llvm",))
    monkeypatch.setattr(verify, "CPU_RULES", (broken,) + verify.CPU_RULES[1:])
    choice, rejected = verify.choose(by_kind["gemm"], None, TARGET, DEV, fallback=True)
    assert choice.source != "cpu_gemm", rejected
    assert any("cpu_gemm failed the numerical check" in line for line in rejected), rejected
    assert any(f"{choice.source} used: cpu_gemm failed its check" in line for line in rejected), rejected


def _half_weights(sch, target, knobs):
    """A GEMM rule with a bug: W read through a float16 copy."""
    matmul = next(b for b in cpu_rules.root_blocks(sch) if cpu_rules.is_reduction(sch, b))
    staged = sch.cache_read(matmul, 1, "global")
    sch.unsafe_set_dtype(staged, 0, "float16")


def test_scheduling_a_kernel_leaves_the_models_primfunc_as_it_was(gelu_softmax):
    """A schedule of ``kernel.func`` held by nothing else (as MetaSchedule's replays and the tests
    make them) annotated and split: the kernel's PrimFunc, and the model's, stay as they were."""
    mod, by_kind = gelu_softmax
    kernel = by_kind["gemm"]
    before = kernel.func.script()
    sch = tvm.s_tir.Schedule(kernel.func)
    matmul = next(b for b in cpu_rules.root_blocks(sch) if cpu_rules.is_reduction(sch, b))
    sch.annotate(matmul, "autofuse.template", "x")
    sch.split(sch.get_loops(matmul)[-1], [None, 4])
    assert kernel.func.script() == before
    assert "autofuse.template" not in mod[kernel.gv].script()


def _unary(name, op, n=4096):
    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n):
            with T.sblock("b"):
                vi = T.axis.remap("S", [i])
                b[vi] = op(a[vi])
    return func


@pytest.mark.parametrize("name,op,exact", [
    ("exp", T.exp, np.exp), ("erf", T.erf, np.vectorize(math.erf)), ("tanh", T.tanh, np.tanh),
    ("sigmoid", T.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    ("pow", lambda v: T.pow(v, T.float32(3.0)), lambda x: x ** 3)])
def test_fast_math_is_within_the_checks_bound_and_vectorises(name, op, exact):
    func = _unary(name, op)
    sch = tvm.s_tir.Schedule(func)
    sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 16])[1])
    rewritten = building.fast_math(sch.mod, TARGET)
    assert f"T.{name}(" in sch.mod.script() and f"T.{name}(" not in rewritten.script()
    x = np.linspace(-80 if name == "exp" else -12, 80 if name == "exp" else 12, 4096).astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(x))
    verify.build_kernel(sch.mod, TARGET)(tvm.runtime.tensor(x), out)
    want = exact(x.astype(np.float64))
    from autofuse.accuracy import compare
    # exp's error is relative: compare the scaled error over a span of magnitudes in pieces
    for piece in np.array_split(np.arange(x.size), 16):
        check = compare([out.numpy()[piece]], [want[piece]])
        assert check.ok, (name, check.message)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_gpu_build_squares_by_multiplying(dtype):
    """TVM compiles CUDA with --use_fast_math, where powf(x, 2) is exp2(2 log2 x): NaN for a
    negative x (a float16 Llama's RMSNorm went NaN on an H100). Ours multiplies; other exponents stay."""
    n = 64

    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((n,), dtype), b: T.Buffer((n,), dtype), c: T.Buffer((n,), dtype)):
        for i in range(n):
            with T.sblock("b"):
                vi = T.axis.remap("S", [i])
                b[vi] = T.pow(a[vi], T.FloatImm(dtype, 2.0))
                c[vi] = T.pow(a[vi], T.FloatImm(dtype, 2.5))

    built = building.fast_math(tvm.IRModule({"main": func}), parse_target("h200")).script()
    assert built.count("T.pow(") == 1  # x ** 2.5 is left to powf
    assert building.fast_math(tvm.IRModule({"main": func}), TARGET)["main"].script().count("T.pow(") == (
        1 if dtype == "float32" else 2)  # the CPU rewrite stays float32-only
    assert "a[vi] * a[vi]" in built


def test_a_gather_kernel_passes_its_check_on_indices_inside_its_table():
    """The check of a kernel that indexes with an input (gather_nd) runs it on indices inside the
    axes they index: with random ones the reference itself read past the table, its output changed
    from run to run and cpu_injective was passed over for the unscheduled kernel."""
    import types

    from index_kernels import gather_nd as _gather_nd

    kernel = types.SimpleNamespace(name="te_gather_nd", func=_gather_nd, workload=_gather_nd, pattern=None,
                                   shape=None, dtype=None)
    for _ in range(3):
        choice, rejected = verify.choose(kernel, None, TARGET, DEV, fallback=True)
        assert choice.source == "cpu_injective" and not rejected, rejected
