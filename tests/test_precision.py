"""Half precision. Every pattern that declares float16/bfloat16 passes its reference check with each
template's fixed default (tests/search_spaces/test_patterns.py checks the unscheduled function in
every declared dtype); its reductions accumulate in float32 whatever the template and its knobs;
a LayerNorm whose statistics accumulate in float16 fails the float16 tolerance that
layernorm_residual (float32 statistics) passes; ``autofuse tune --dtype float16`` works, and a
dtype a pattern does not declare is one line, exit 2."""

import json

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir.schedule import Trace
from tvm.script import tirx as T

from autofuse.registry import all_patterns, get_pattern
from autofuse.target import parse_target
from autofuse.accuracy import compare
from autofuse.verify import check_module
from conftest import run_cli
from search_spaces.lib.layernorm import EPS

TARGET = parse_target("llvm")
DEV = tvm.cpu()
HALF = ("float16", "bfloat16")
PATTERNS = [p for p in all_patterns().values() if any(d in p.dtypes for d in HALF)]
TEMPLATE_CASES = [(p, t, d) for p in PATTERNS for t in p.templates if t.applies_to(TARGET)
                  for d in HALF if d in p.dtypes]
DTYPE_CASES = [(p, d) for p in PATTERNS for d in HALF if d in p.dtypes]


def _ids(value):
    return getattr(value, "name", value)


def test_float32_stays_the_first_dtype():
    # The onnx graph test, the knob-sample test and the CLI default all use dtypes[0].
    assert all(p.dtypes[0] == "float32" for p in all_patterns().values())


@pytest.mark.parametrize("pattern,template,dtype", TEMPLATE_CASES, ids=_ids)
def test_template_default_matches_reference_in_half_precision(pattern, template, dtype):
    shape = pattern.small_shape()
    func = pattern.build(shape, dtype)
    sch = template.apply(func, TARGET, tunable=False)
    rt = tvm.tirx.build(sch.mod, target=TARGET)
    result = check_module(pattern, rt, func, shape, dtype, DEV)
    assert result.ok, result.message


def _float_reduction_dtypes(sch):
    """dtype of every float buffer a block with a reduction axis writes, by block name."""
    found = {}

    def walk(parent):
        for ref in sch.get_child_blocks(parent):
            block = sch.get(ref)
            if any(int(iv.iter_type) == tvm.tirx.IterVar.CommReduce for iv in block.iter_vars):
                dtypes = {str(w.source.dtype) for w in block.writes}
                found[block.name_hint] = {d for d in dtypes if "float" in d}
            walk(ref)

    walk(sch.get_sblock("root"))
    return found


@pytest.mark.parametrize("pattern,dtype", DTYPE_CASES, ids=_ids)
def test_reductions_accumulate_in_float32_under_every_schedule(pattern, dtype):
    shape = pattern.small_shape()
    func = pattern.build(shape, dtype)
    schedules = [s_tir.Schedule(func)]
    for template in pattern.templates_for(TARGET):
        schedules.append(template.apply(func, TARGET, tunable=False))
        design = s_tir.Schedule(func, seed=1)
        template.schedule(design, TARGET, tunable=True)
        space = Trace(design.trace.insts, {})
        for seed in (2, 3):
            sch = s_tir.Schedule(func, seed=seed)
            space.apply_to_schedule(sch, remove_postproc=True)
            schedules.append(sch)
    for sch in schedules:
        found = _float_reduction_dtypes(sch)
        assert found, "no float reduction found: the check would prove nothing"
        wrong = {name: d for name, d in found.items() if d - {"float32"}}
        assert not wrong, f"reductions not accumulating in float32: {wrong}"


def _layernorm_residual(rows, hidden, dtype, stats):
    """layernorm_residual's build with the statistics' dtype as a parameter: the fp16-statistics
    variant below. With ``stats="float32"`` it is the pattern's own function (checked)."""
    inv_n = 1.0 / hidden
    # The normalisation itself is float32 either way: only the accumulation differs.
    to_f32 = (lambda e: e) if stats == "float32" else (lambda e: T.Cast("float32", e))

    @T.prim_func(s_tir=True)
    def layernorm_residual(x: T.Buffer((rows, hidden), dtype), r: T.Buffer((rows, hidden), dtype),
                           gamma: T.Buffer((hidden,), dtype), beta: T.Buffer((hidden,), dtype),
                           h: T.Buffer((rows, hidden), dtype), y: T.Buffer((rows, hidden), dtype)):
        T.func_attr({"global_symbol": "layernorm_residual", "tirx.noalias": True})
        row_sum = T.sblock_alloc_buffer((rows,), stats)
        row_sq = T.sblock_alloc_buffer((rows,), stats)
        for i, j in T.grid(rows, hidden):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                h[vi, vj] = x[vi, vj] + r[vi, vj]
        for i, k in T.grid(rows, hidden):
            with T.sblock("mean"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    row_sum[vi] = T.cast(0, stats)
                row_sum[vi] = row_sum[vi] + T.Cast(stats, h[vi, vk])
        for i, k in T.grid(rows, hidden):
            with T.sblock("sumsq"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    row_sq[vi] = T.cast(0, stats)
                row_sq[vi] = row_sq[vi] + T.Cast(stats, h[vi, vk]) * T.Cast(stats, h[vi, vk])
        for i, j in T.grid(rows, hidden):
            with T.sblock("norm"):
                vi, vj = T.axis.remap("SS", [i, j])
                mu: T.let = to_f32(row_sum[vi]) * T.float32(inv_n)
                var: T.let = T.max(to_f32(row_sq[vi]) * T.float32(inv_n) - mu * mu, T.float32(0))
                y[vi, vj] = T.Cast(dtype, (T.Cast("float32", h[vi, vj]) - mu) * T.rsqrt(var + T.float32(EPS))
                                   * T.Cast("float32", gamma[vj]) + T.Cast("float32", beta[vj]))

    return layernorm_residual


def test_float16_statistics_fail_the_float16_tolerance_that_float32_statistics_pass():
    """At a realistic hidden size, summing h*h (h = x + r, unit-normal x and r: the size of a
    residual stream) in float16 stalls: past 2048 the float16 spacing is 2 and then 4, so most
    terms round away. The variance comes out wrong, and with it every output."""
    pattern = get_pattern("layernorm_residual")
    shape = {"rows": 8, "hidden": 4096}
    ours = pattern.build(shape, "float16")
    tvm.ir.assert_structural_equal(_layernorm_residual(8, 4096, "float16", "float32"), ours)
    fp16_stats = _layernorm_residual(8, 4096, "float16", "float16")
    inputs = pattern.make_inputs(shape, "float16", 0)
    expected = pattern.run_reference(inputs, shape)
    errors = {}
    for name, func in (("float32 statistics", ours), ("float16 statistics", fp16_stats)):
        rt = tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET)
        outputs = [tvm.runtime.tensor(np.zeros(s, d), DEV) for s, d in pattern.output_specs(func)]
        rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], *outputs)
        errors[name] = compare([o.numpy() for o in outputs], expected, **pattern.check_args(shape, "float16", ours))
    assert errors["float32 statistics"].ok, errors["float32 statistics"].message
    bad = errors["float16 statistics"]
    assert not bad.ok
    # Not a near miss: the error is many times the float16 rounding of the output.
    assert bad.scaled_err > 10 * bad.bound, bad


def test_tune_in_float16(tmp_path):
    result = run_cli("tune", "--pattern", "layernorm_residual", "--small", "--dtype", "float16",
                     "--trials", "4", "--db", str(tmp_path / "db"), "--no-progress",
                     "--json", str(tmp_path / "rows.json"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert row["dtype"] == "float16" and row["best_ms"] is not None


def test_a_dtype_the_pattern_does_not_declare_is_one_line_exit_2(tmp_path):
    float32_only = next(p for p in all_patterns().values() if "float16" not in p.dtypes)
    result = run_cli("tune", "--pattern", float32_only.name, "--dtype", "float16",
                     "--db", str(tmp_path / "db"), "--no-progress")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "float16" in lines[0] and float32_only.name in lines[0], result.stderr
