"""autofuse compare: every contender measured or its absence explained; a contender judged by the
framework's own accuracy in that dtype (never by a fixed tolerance) and, when it fails, marked
invalid and never timed; ours over the best rival doing the same work; every report naming its
commit, command, machine and samples, in a schema-valid report.json and a report.md that shows
each error beside its time."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from autofuse.compare import check_report
from conftest import REPO, run_cli


def _fake_roofline(db_root):
    """A stored roofline, so tests do not spend seconds measuring the machine."""
    from autofuse.target import parse_target, target_key
    folder = os.path.join(db_root, target_key(parse_target("llvm")))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "roofline.json"), "w") as f:
        # With its peak_label: a stored roofline without one is an older figure, measured again.
        json.dump({"bandwidth_gbps": 20.0, "peak_gflops": 200.0, "bandwidth_method": "test",
                   "peak_method": "test", "threads": len(os.sched_getaffinity(0)),
                   "bandwidth_ladder": [[1 << 20, 60.0], [1 << 28, 20.0]], "peak_label": "FMA peak"}, f)


CPU_BASELINES = ["tvm-untuned", "tvm-auto", "onnxruntime", "xla"]


@pytest.fixture(scope="module")
def pattern_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    _fake_roofline(root / "db")
    result = run_cli("compare", "--pattern", "linear_bias_relu", "--small", "--db", str(root / "db"),
                     "--baselines", ",".join(CPU_BASELINES), "--repeat", "3", "--report", str(root / "report"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "report", result


def test_pattern_compare_writes_every_file_and_a_valid_report(pattern_report):
    folder, result = pattern_report
    for name in ("report.json", "report.md", "report.png", "roofline.png"):
        assert (folder / name).stat().st_size > 0, name
    report = json.loads((folder / "report.json").read_text())
    assert check_report(report) == []
    subject = report["subjects"][0]
    contenders = {c["name"]: c for c in subject["contenders"]}
    assert set(contenders) == {"autofuse", *CPU_BASELINES}
    for c in contenders.values():
        assert c["status"] == "ok", c
        assert c["scaled_err"] <= c["bound"] == subject["bound"] and c["max_abs_err"] < 1e-3
        assert len(c["samples_ms"]) == 3 and c["p10_ms"] <= c["median_ms"] <= c["p90_ms"]
        assert c["intensity"] > 0 and c["roofline_pct"] > 0
    assert subject["framework"]["name"] == "onnxruntime" and subject["framework"]["scaled_errs"] is not None
    assert "| autofuse" in (folder / "report.md").read_text()
    assert "linear_bias_relu" in result.stdout


def test_every_report_names_its_commit_command_and_machine(pattern_report):
    folder, _ = pattern_report
    report = json.loads((folder / "report.json").read_text())
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert report["code"]["commit"] == (head or "unknown")
    assert report["command"][1:4] == ["compare", "--pattern", "linear_bias_relu"]
    assert report["machine"]["cpu_model"] and isinstance(report["machine"]["cpu_flags"], list)
    assert report["device"] == "cpu" and report["framework"] == "onnxruntime"
    assert f"commit {report['code']['commit']}" in (folder / "report.md").read_text()


def test_model_compare_breaks_the_tuned_model_down_per_kernel(tmp_path):
    _fake_roofline(tmp_path / "db")
    result = run_cli("compare", os.path.join(REPO, "models", "mlp.onnx"), "--db", str(tmp_path / "db"),
                     "--repeat", "3", "--baselines", "onnxruntime,xla", "--no-plots", "--report", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert check_report(report) == []
    subject = report["subjects"][0]
    assert subject["reference"] == "onnxruntime" and subject["accumulation"] > 1
    assert [c["status"] for c in subject["contenders"]] == ["ok", "ok", "ok"]
    kernels = subject["kernels"]
    assert [k["pattern"] for k in kernels].count("linear_bias_relu") == 2
    assert all(k["ms"] > 0 and k["source"] for k in kernels)
    assert not (tmp_path / "r" / "report.png").exists()


def _in_process_subject(tmp_path, name="linear_bias_relu", dtype="float32"):
    import tvm
    from autofuse.baselines import Context
    from autofuse.compare import pattern_subject
    from autofuse.registry import get_pattern
    from autofuse.roofline import Machine
    from autofuse.target import parse_target

    pattern = get_pattern(name)
    subject = pattern_subject(pattern, pattern.small_shape(), dtype, str(tmp_path))
    ctx = Context(parse_target("llvm"), tvm.cpu(), 2, None)
    return subject, ctx, Machine(20.0, 200.0, "test", "test", 2, [[1 << 28, 20.0]])


def test_missing_optional_baselines_are_reported_not_crashed(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path)
    for module in ("jax", "onnxruntime", "torch"):
        monkeypatch.setitem(sys.modules, module, None)  # import MODULE -> ImportError
    entry = compare_subject(subject, ctx, ["onnxruntime", "xla", "torch-eager", "torch-compile"], machine, repeat=2)
    status = {c["name"]: (c["status"], c["reason"]) for c in entry["contenders"]}
    assert status["autofuse"][0] == "ok"
    for name, module in (("onnxruntime", "onnxruntime"), ("xla", "jax"), ("torch-eager", "torch"),
                         ("torch-compile", "torch")):
        assert status[name][0] == "unavailable" and module in status[name][1], status[name]
    # No framework result to hold anyone to: the dtype bound alone.
    assert entry["framework"]["status"] == "unavailable" and entry["bound"] == entry["dtype_bound"]


def test_our_kernel_that_cannot_run_says_why(tmp_path, monkeypatch):
    from autofuse import compare, verify

    note = "template default failed the numerical check (cuda_split_kv): build failed: int32 extent"
    monkeypatch.setattr(verify, "choose", lambda *args, **kwargs: (None, [note]))
    subject, ctx, machine = _in_process_subject(tmp_path)
    entry = compare.compare_subject(subject, ctx, ["onnxruntime"], machine, repeat=2)
    ours = entry["contenders"][0]
    assert ours["name"] == "autofuse" and ours["status"] == "failed" and note in ours["reason"], ours


def test_a_contender_that_disagrees_is_invalid_and_never_timed(tmp_path, monkeypatch):
    from autofuse import compare
    from autofuse.baselines.xla import Xla

    real_prepare = Xla.prepare

    def wrong(self, subject, ctx):
        prepared = real_prepare(self, subject, ctx)
        good = prepared.outputs
        prepared.outputs = lambda: [o + np.float32(0.5) for o in good()]
        return prepared

    monkeypatch.setattr(Xla, "prepare", wrong)
    subject, ctx, machine = _in_process_subject(tmp_path)
    entry = compare.compare_subject(subject, ctx, ["onnxruntime", "xla"], machine, repeat=2)
    row = entry["contenders"][2]
    assert row["status"] == "invalid" and row["median_ms"] is None and row["samples_ms"] == []
    assert "disagrees" in row["reason"] and row["scaled_err"] > row["bound"]
    assert entry["contenders"][0]["status"] == entry["contenders"][1]["status"] == "ok"


# --- the validity rule, on contenders whose error is set ----------------------------------------

class _Launch:
    """A launch that does nothing, with the latency a fake timer reports for it."""

    def __init__(self, ms):
        self.ms = ms

    def __call__(self):
        pass


class _Timer:
    def time(self, launch, wait, **_):
        from autofuse.measure import Timing
        return Timing.of([launch.ms / 1e3] * 3, method="fake")


class _Offset:
    """A contender whose outputs are the reference plus ``err`` x the output's scale, in the
    subject's dtype: its scaled error is ``err`` (to the dtype's rounding)."""

    description = "test"

    def __init__(self, name, err, ms=1.0, graph=True):
        self.name, self.err, self.ms, self.runs_onnx_graph = name, err, ms, graph
        self.runs = 0

    def prepare(self, subject, ctx):
        from autofuse.baselines import Prepared
        self.runs += 1
        reference = subject.pattern.run_reference(subject.inputs, subject.shape)
        out = [(r.astype(np.float64) + self.err * np.abs(r.astype(np.float64)).max()).astype(r.dtype)
               for r in reference]
        return Prepared(_Launch(self.ms), lambda: None, lambda: out)


def _with(monkeypatch, *fakes):
    from autofuse import compare
    fakes = {f.name: f for f in fakes}
    monkeypatch.setattr(compare, "contenders", lambda: fakes)
    return fakes


def test_a_half_precision_contender_as_accurate_as_the_framework_is_valid_past_the_dtype_bound(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path, "flash_attention", "float16")
    # onnxruntime (the framework on a CPU) is 5x off the float16 bound; xla as far; torch-eager far worse.
    _with(monkeypatch, _Offset("autofuse", 0.0), _Offset("onnxruntime", 1e-2), _Offset("xla", 1e-2),
          _Offset("torch-eager", 2e-1))
    entry = compare_subject(subject, ctx, ["onnxruntime", "xla", "torch-eager"], machine, repeat=3, timer=_Timer())
    rows = {c["name"]: c for c in entry["contenders"]}
    assert entry["dtype_bound"] < 5e-3 < entry["bound"] and entry["framework"]["name"] == "onnxruntime"
    for name in ("onnxruntime", "xla"):
        assert rows[name]["status"] == "ok" and rows[name]["median_ms"] == pytest.approx(1.0)
        assert rows[name]["scaled_err"] > entry["dtype_bound"] and rows[name]["bound"] == entry["bound"]
    bad = rows["torch-eager"]
    assert bad["status"] == "invalid" and bad["median_ms"] is None and "disagrees" in bad["reason"]
    assert bad["scaled_err"] > bad["bound"]


def test_a_framework_far_off_lifts_no_bound(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path, "flash_attention", "float16")
    _with(monkeypatch, _Offset("autofuse", 0.0), _Offset("onnxruntime", 0.5), _Offset("xla", 0.5))
    entry = compare_subject(subject, ctx, ["onnxruntime", "xla"], machine, repeat=3, timer=_Timer())
    assert entry["bound"] == entry["dtype_bound"]
    assert [c["status"] for c in entry["contenders"]] == ["ok", "invalid", "invalid"]


def test_the_framework_runs_for_its_error_alone_when_not_compared(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path, "flash_attention", "float16")
    fakes = _with(monkeypatch, _Offset("autofuse", 0.0), _Offset("onnxruntime", 1e-2), _Offset("xla", 1e-2))
    entry = compare_subject(subject, ctx, ["xla"], machine, repeat=3, timer=_Timer())
    assert fakes["onnxruntime"].runs == 1 and [c["name"] for c in entry["contenders"]] == ["autofuse", "xla"]
    assert entry["framework"]["scaled_errs"][0] == pytest.approx(1e-2, rel=0.1)
    assert entry["contenders"][1]["status"] == "ok"


def test_a_baseline_doing_more_work_is_labelled_and_left_out_of_the_ratio(tmp_path, monkeypatch):
    from autofuse.compare import compare_subject
    subject, ctx, machine = _in_process_subject(tmp_path)
    subject.more_work = {"onnxruntime": "its graph copies the weights every call"}
    _with(monkeypatch, _Offset("autofuse", 0.0, ms=1.0), _Offset("onnxruntime", 0.0, ms=0.5),
          _Offset("xla", 0.0, ms=2.0), _Offset("tvm-untuned", 0.0, ms=1.5))
    entry = compare_subject(subject, ctx, ["tvm-untuned", "onnxruntime", "xla"], machine, repeat=3, timer=_Timer())
    ours, untuned, ort, xla = entry["contenders"]
    assert ort["status"] == "ok" and ort["same_work"] is False and "weights" in ort["more_work"]
    assert xla["same_work"] and untuned["same_work"] and not untuned["rival"]
    # Over xla: onnxruntime does more work, tvm-untuned is no rival.
    assert ours["ratio_to_best_baseline"] == pytest.approx(0.5) and ours["best_baseline"] == "xla"


def test_onnx_graph_marks_every_contender_running_the_graph(tmp_path):
    from autofuse.baselines import contenders
    from autofuse.compare import _new_row
    subject, _, _ = _in_process_subject(tmp_path)
    subject.more_work = {"onnx_graph": "the graph writes the whole cache"}
    marked = {name for name, c in contenders().items() if not _new_row(name, c, subject)["same_work"]}
    assert marked == {"tvm-untuned", "tvm-auto", "onnxruntime", "xla", "torch-eager", "torch-compile"}


def test_a_patterns_torch_function_makes_the_torch_contenders_same_work(tmp_path):
    # moe_gate_topk's graph copies expert weights (more work); its torch_function is the routed loop
    import dataclasses

    from autofuse.baselines import contenders
    from autofuse.baselines.torch_eager import source_info
    from autofuse.compare import _new_row, pattern_subject
    from autofuse.registry import get_pattern
    pattern = get_pattern("moe_gate_topk")
    assert pattern.torch_function is not None and "onnx_graph" in pattern.more_work
    subject = pattern_subject(pattern, pattern.default_shape(), "float32", str(tmp_path))
    marked = {name for name, c in contenders().items() if not _new_row(name, c, subject)["same_work"]}
    assert marked == {"tvm-untuned", "tvm-auto", "onnxruntime", "xla"}
    assert "torch_function" in source_info(subject)["runs"]
    subject.pattern = dataclasses.replace(pattern, torch_function=None)
    marked = {name for name, c in contenders().items() if not _new_row(name, c, subject)["same_work"]}
    assert {"torch-eager", "torch-compile"} <= marked and source_info(subject)["runs"] == "ONNX graph"


# --- provenance --------------------------------------------------------------------------------

def test_the_commit_comes_from_the_flag_the_environment_or_this_checkout_never_a_guess(tmp_path, monkeypatch):
    from autofuse import compare, provenance
    from autofuse.errors import AutofuseError

    monkeypatch.setenv("AUTOFUSE_COMMIT", "ABCDEF1234")
    assert compare.code_commit("1234567")["commit"] == "1234567"
    assert compare.code_commit()["commit"] == "abcdef1234"
    with pytest.raises(AutofuseError, match="not a commit id"):
        compare.code_commit("main; rm -rf /")
    monkeypatch.delenv("AUTOFUSE_COMMIT")
    # A copy of the code without .git, inside some other repository: unknown, not that one's HEAD.
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    monkeypatch.setattr(provenance, "ROOT", str(outer / "copy"))
    assert compare.code_commit()["commit"] == "unknown"


def test_a_malformed_commit_is_one_line_before_any_work(tmp_path):
    result = run_cli("compare", "--pattern", "linear_bias_relu", "--small", "--db", "none", "--commit", "not-a-sha",
                     "--report", str(tmp_path / "r"))
    assert result.returncode == 2 and "not a commit id" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()


def test_shapes_of_several_patterns_are_set_one_pattern_each():
    from autofuse.compare import pattern_shapes
    from autofuse.errors import AutofuseError
    from autofuse.registry import resolve_patterns

    two = resolve_patterns("linear_bias_relu,softmax_dropout")
    assert pattern_shapes(["linear_bias_relu:m=64,n=32", "softmax_dropout:rows=8"], two) == {
        "linear_bias_relu": {"m": "64", "n": "32"}, "softmax_dropout": {"rows": "8"}}
    assert pattern_shapes(["m=8"], two[:1]) == {"linear_bias_relu": {"m": "8"}}
    with pytest.raises(AutofuseError, match="PATTERN:K=V"):
        pattern_shapes(["m=8"], two)
    with pytest.raises(AutofuseError, match="not one of the patterns"):
        pattern_shapes(["flash_attention:seq_q=8"], two)


# --- report.md -----------------------------------------------------------------------------------

def _row(name, status="ok", ms=None, err=1e-6, **extra):
    return {"name": name, "status": status, "reason": None if status == "ok" else "why", "median_ms": ms,
            "p10_ms": ms, "p90_ms": ms, "batched_ms": None, "samples_ms": [ms] if ms else [], "max_abs_err": err,
            "scaled_err": err, "bound": 2e-3, "same_work": True, "more_work": None, "rival": name != "tvm-untuned",
            **extra}


def test_report_markdown_shows_each_error_beside_its_time_and_labels_more_work():
    from autofuse.report import compare_markdown

    report = {"created": "now", "machine": {"gpu": {"name": "NVIDIA H200", "compute_capability": "9.0",
                                                    "memory_gib": 139.8, "torch_cuda": "12.8"},
                                            "cpu_model": "Xeon", "roofline": {"bandwidth_gbps": 4000.0,
                                                                              "peak_gflops": 50000.0}},
              "device": "cuda", "threads": 16, "repeat": 20, "warmup": 3, "trials_added": 0, "database": None,
              "code": {"commit": "abc1234", "source": "--commit", "dirty": None},
              "command": ["python", "-m", "autofuse.cli", "compare", "--target", "h200"],
              "baselines": ["torch-eager", "torch-sdpa", "xla"], "rivals": ["torch-eager", "torch-sdpa", "xla"],
              "subjects": [{"kind": "pattern", "name": "flash_attention", "shape": {"seq_q": 256}, "dtype": "float16",
                            "reference": "numpy reference", "accumulation": 256, "dtype_bound": 2e-3, "bound": 4e-3,
                            "framework": {"name": "torch-eager", "scaled_errs": [3.2e-3]},
                            "contenders": [_row("autofuse", ms=0.05, err=4e-4, ratio_to_best_baseline=1.25,
                                                best_baseline="torch-sdpa"),
                                           _row("torch-eager", ms=0.2, err=3.2e-3),
                                           _row("torch-sdpa", ms=0.04, err=1.1e-3, same_work=False,
                                                more_work="pads the keys"),
                                           _row("xla", status="invalid", err=0.3)]}]}
    markdown = compare_markdown(report)
    assert "NVIDIA H200" in markdown and "commit abc1234" in markdown and "--target h200" in markdown
    assert "0.05 (4.0e-04)" in markdown and "0.2 (3.2e-03)" in markdown
    assert "0.04 (1.1e-03) †" in markdown and "pads the keys" in markdown
    assert "invalid (3.0e-01 > 2.0e-03)" in markdown
    assert "valid up to 4.0e-03" in markdown and "torch-eager's own error 3.2e-03" in markdown
    assert "CUDA events" in markdown


def test_report_markdown_names_the_kernel_template_that_made_our_kernel():
    from autofuse.report import compare_markdown

    ours = _row("autofuse", ms=0.5, err=6e-4)
    ours["info"] = {"source": "template-default", "template": "cuda_wgmma_flash", "knobs": {"block_n": 128}}
    report = {"created": "now", "machine": {"cpu_model": "Xeon"}, "device": "cuda", "threads": 16, "repeat": 20,
              "warmup": 3, "trials_added": 0, "database": None, "code": {"commit": "abc1234", "source": "git"},
              "command": ["autofuse", "compare"], "baselines": [], "rivals": [],
              "subjects": [{"kind": "pattern", "name": "flash_attention", "shape": {}, "dtype": "float16",
                            "reference": "numpy reference", "accumulation": 128, "dtype_bound": 2e-3,
                            "bound": 2e-3, "contenders": [ours]}]}
    assert "- autofuse kernel from: template-default (cuda_wgmma_flash, knobs {'block_n': 128})" in compare_markdown(report)


@pytest.mark.parametrize("elem, want", [("FLOAT16", "float16"), ("FLOAT", "float32"), ("INT64", "float32")])
def test_a_models_dtype_is_its_first_floating_output(elem, want):
    """A float16 export is measured against the float16 roofline, not float32's."""
    from onnx import TensorProto, helper

    from autofuse.compare import _model_dtype
    kind = getattr(TensorProto, elem)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", kind, [2])],
                              [helper.make_tensor_value_info("y", kind, [2])])
    assert _model_dtype(helper.make_model(graph)) == want
