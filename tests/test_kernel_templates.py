"""Kernel templates (autofuse.kernel_templates) without a GPU: linear_bias_relu's cuda_wgmma knob
configurations enumerate default first; a search on a stand-in device stores one crash-safe
record per configuration, resumes where it stopped, and its records replay to the same CUDA
source; ``db check``/``compact`` read and keep them; ``verify.choose`` is never worse across a
kernel record, a MetaSchedule record and the default; a float16 Relax model with linear_bias_relu
builds for the H200 through the mixed tirx/s_tir pipeline with the wgmma kernel in its library.
Checking and timing on the H200 itself are stood in for here (no GPU on this machine)."""

import json
import os

import onnx
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from autofuse import building as B
from autofuse import kernel_templates as K
from autofuse import verify
from autofuse.database import TuningDatabase, check_folder, compact_folder
from autofuse.model import build as model_build
from autofuse.model.fusion import PATTERN_ATTR
from autofuse.model.jobs import prepare
from autofuse.model.kernels import apply_database, kernels
from autofuse.pattern import Template
from autofuse.registry import get_pattern
from autofuse.target import parse_target
from autofuse.tune_patterns import Job
from search_spaces.lib import cuda_wgmma as W

H200 = parse_target("h200")
LLVM = parse_target("llvm")
PATTERN = get_pattern("linear_bias_relu")
SHAPE = {"m": 2048, "n": 2048, "k": 256}  # 128 CTAs of the default 128 x 256 tile: it fills the GPU
WGMMA = next(t for t in PATTERN.templates if getattr(t, "name", None) == "cuda_wgmma")


def _source(mod) -> str:
    rt = verify.build_kernel(mod, H200)
    return rt.imports[0].inspect_source()


# --- the template and its space -----------------------------------------------------------------

def test_configs_enumerate_default_first():
    configs = WGMMA.configs(SHAPE, "float16")
    assert configs[0] == W.DEFAULT_KNOBS
    assert sorted(map(K._knobs_key, configs)) == sorted(map(K._knobs_key, W.configs(SHAPE, "float16")))
    distance = [sum(k[n] != W.DEFAULT_KNOBS[n] for n in k) for k in configs]
    assert distance == sorted(distance) and distance[1] == 1
    # n = 384 takes no BN 256 tile: the default falls to the largest that fills the 132 SMs (44 x 3)
    assert WGMMA.default_for({**SHAPE, "m": 5632, "n": 384}, "float16") == {**W.DEFAULT_KNOBS, "block_n": 128}
    # m = 128: 16 CTAs of 128 x 256 would leave 116 SMs idle; 128 of 64 x 64 fill them, 5 stages deep
    # (one consumer warpgroup: the one-role kernel)
    assert WGMMA.default_for({"m": 128, "n": 4096, "k": 4096}, "float16") == {
        **W.DEFAULT_KNOBS, "block_n": 64, "warpgroups": 1, "stages": 5, "specialised": 0}


def test_where_the_kernel_template_applies():
    assert K.kernel_templates_for(PATTERN, SHAPE, "float16", H200) == [WGMMA]
    assert K.kernel_templates_for(PATTERN, SHAPE, "bfloat16", H200) == [WGMMA]
    assert K.kernel_templates_for(PATTERN, SHAPE, "float32", H200) == []          # wgmma: half types only
    assert K.kernel_templates_for(PATTERN, PATTERN.small_shape(), "float16", H200) == []   # m=16: no tile fits
    assert K.kernel_templates_for(PATTERN, SHAPE, "float16", LLVM) == []
    assert not WGMMA.applies(SHAPE, "float16", parse_target('{"kind": "cuda", "arch": "sm_80"}'))
    # the schedule rules stay what MetaSchedule searches, CUDA's listed after the kernel template
    cuda = [t for t in PATTERN.templates if t.target_kinds == ("cuda",)]
    assert [t.name for t in cuda[:2]] == ["cuda_wgmma_split_k", "cuda_wgmma"] and cuda[1] is WGMMA
    assert all(isinstance(t, Template) for t in PATTERN.templates_for(H200))
    assert [t.name for t in PATTERN.templates_for(H200)] == ["cuda_tiled_epilogue", "cuda_wmma"]


def test_the_kernel_builds_for_sm90a_through_the_tirx_pipeline():
    func = K.build_cached(PATTERN, WGMMA, SHAPE, "float16", W.DEFAULT_KNOBS)
    assert B.is_tirx(func) and func.attrs["global_symbol"] == "gemm_bias_relu"
    assert str(B.tirx_target(B.kernel_module(func), H200).attrs["arch"]) == "sm_90a"
    source = _source(B.kernel_module(func))
    assert "wgmma_f16_ss_mma_async_sync_aligned_m64n256k16_f32_f16_f16" in source


# --- search, records, replay --------------------------------------------------------------------

class FakeDevice:
    """Stands in for the H200: a check that fails one chosen configuration, and run times that
    favour another (block_n 128, 3 stages)."""

    def __init__(self, failing: dict | None = None):
        self.failing = failing
        self.measured = []

    def measure(self, job, rt, dev):
        assert "wgmma" in rt.imports[0].inspect_source()
        self.measured.append(rt)
        knobs = self._knobs[len(self.measured) - 1]
        if knobs == self.failing:
            return False, "injected mismatch", []
        secs = 1e-3 * (1 + sum(knobs[n] != v for n, v in {"block_n": 128, "stages": 3}.items()))
        return True, "max abs error 0.001", [secs, secs]


def _tune(db, trials, device):
    # The configurations left, as tune_kernels finds them: the recorded ones read once (a Job
    # builds its PrimFunc, and each recorded kernel is rebuilt to see it is not stale).
    recorded = K._recorded(db, Job(PATTERN, SHAPE, "float16"), WGMMA)
    todo = [k for k in WGMMA.configs(SHAPE, "float16") if K._knobs_key(k) not in recorded]
    device._knobs = todo
    device.measured = []
    return K.tune_kernels([Job(PATTERN, SHAPE, "float16")], H200, db, trials=trials, dev="h200",
                          measure=device.measure)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database with 3 kernel records (the 3rd configuration failing its check), and 1 more
    from a second session that resumes it. (Parsing a tirx kernel takes seconds in a process that
    has imported this much: the tests share the same few configurations through build_cached.)"""
    root = tmp_path_factory.mktemp("kdb")
    db = TuningDatabase(str(root), H200)
    first = WGMMA.configs(SHAPE, "float16")
    stats = _tune(db, 3, FakeDevice(failing=first[2]))
    assert stats[0].trials == 3 and stats[0].failed == 1
    more = _tune(db, 1, FakeDevice())
    assert more[0].trials == 1
    return root, db


def test_each_configuration_is_one_record_line(tuned):
    root, db = tuned
    path = os.path.join(db.path, K.KERNEL_RECORDS)
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(lines) == 4
    for line in lines:
        assert {"pattern", "shape", "dtype", "template", "knobs", "run_secs", "checked", "func_hash",
                "commit"} <= set(line)
        assert (line["pattern"], line["shape"], line["dtype"], line["template"]) == \
            ("linear_bias_relu", SHAPE, "float16", "cuda_wgmma")
    # measured in configs order, default first, the second session where the first stopped
    assert [line["knobs"] for line in lines] == WGMMA.configs(SHAPE, "float16")[:4]
    failed = [line for line in lines if not line["checked"]["ok"]]
    assert len(failed) == 1 and failed[0]["run_secs"] == [] and "injected" in failed[0]["checked"]["message"]
    assert db.kernels.count("linear_bias_relu", SHAPE, "float16") == (3, 4)


def test_records_replay_to_the_same_source(tuned):
    _, db = tuned
    for record in db.kernels.all()[1:2]:
        replayed = K.replay(record)
        fresh = W.gemm_bias_act(SHAPE, "float16", record.knobs, "relu")  # built anew, not from a cache
        assert K.func_hash(replayed) == record.func_hash == K.func_hash(WGMMA.build(SHAPE, "float16", record.knobs))
        source = _source(B.kernel_module(replayed))
        assert source == _source(B.kernel_module(fresh.with_attrs(dict(replayed.attrs))))
        assert f"m64n{record.knobs['block_n']}k16" in source


def test_best_record_is_the_fastest_checked_one(tuned):
    _, db = tuned
    found = K.candidates(Job(PATTERN, SHAPE, "float16"), db, H200)
    assert found.record.secs == min(r.secs for r in db.kernels.all() if r.ok)
    assert B.is_tirx(found.module["main"])
    assert len(found.rejected) == 1 and "1 kernel record(s) failed the numerical check" in found.rejected[0]
    # another dtype, shape or target has none
    assert K.candidates(Job(PATTERN, SHAPE, "bfloat16"), db, H200).record is None
    assert K.candidates(Job(PATTERN, SHAPE, "float16"), db, LLVM).record is None


def test_a_crash_is_recorded_and_stops_the_search(tmp_path):
    db = TuningDatabase(str(tmp_path), H200)

    def crash(job, rt, dev):
        raise RuntimeError("CUDA: an illegal memory access was encountered")

    stats = K.tune_kernels([Job(PATTERN, SHAPE, "float16")], H200, db, trials=3, dev="h200", measure=crash)
    (record,) = db.kernels.all()  # later configurations are left for a fresh process, not failed
    assert stats[0].trials == 1 and stats[0].failed == 1 and stats[0].crashed
    assert not record.ok and "illegal memory access" in record.checked["message"]


def test_the_device_measure_checks_then_times():
    """The default measure on a kernel that runs here (the CPU default of the same pattern)."""
    import numpy as np
    job = Job(PATTERN, PATTERN.small_shape(), "float32")
    rt = verify.build_kernel(verify.default_schedule(job.func, LLVM, PATTERN).mod, LLVM)
    ok, message, secs = verify.measure_on_device(job, rt, tvm.cpu(), repeat=3)
    assert ok and len(secs) == 3 and all(s > 0 for s in secs), message

    def wrong(*args):
        rt(*args)
        args[-1].copyfrom(np.zeros(args[-1].shape, "float32"))

    ok, message, secs = verify.measure_on_device(job, wrong, tvm.cpu())
    assert not ok and secs == []


def test_a_torn_last_line_is_skipped_then_mended(tmp_path):
    db = TuningDatabase(str(tmp_path), H200)
    record = K.KernelRecord("linear_bias_relu", SHAPE, "float16", "cuda_wgmma", dict(W.DEFAULT_KNOBS), [1e-3],
                            {"ok": True, "message": ""}, "0" * 16)
    db.kernels.append(record)
    with open(db.kernels.path, "a", encoding="utf-8") as f:
        f.write('{"pattern": "linear_bias_r')  # killed mid-write
    again = TuningDatabase(str(tmp_path), H200)
    assert again.kernels.all() == [record]
    again.kernels.append(record)
    assert TuningDatabase(str(tmp_path), H200).kernels.all() == [record, record]
    assert os.path.exists(db.kernels.path + ".damaged")


# --- db check / compact -------------------------------------------------------------------------

def test_db_check_and_compact_keep_kernel_records(tuned, tmp_path):
    import shutil
    root, db = tuned
    folder = shutil.copytree(db.path, tmp_path / os.path.basename(db.path))
    path = folder / K.KERNEL_RECORDS
    found = check_folder(str(folder))
    assert found["records"] == 4 and found["valid"] == 3 and found["failed_numerical_check"] == 1
    assert found["problems"] == []

    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    stale = {**records[1], "func_hash": "f" * 16, "run_secs": [1e-6]}  # fastest, but not this kernel
    with open(path, "a", encoding="utf-8") as f:
        f.write("not json\n" + json.dumps({"pattern": "linear_bias_relu"}) + "\n" + json.dumps(stale) + "\n")
    found = check_folder(str(folder))
    assert len(found["problems"]) == 3, found["problems"]
    assert any("not JSON" in p for p in found["problems"])
    assert any("not a kernel record" in p for p in found["problems"])
    assert any("changed since it was measured" in p for p in found["problems"])

    before, after = compact_folder(str(folder), keep=2)
    assert before == 7 and after == 2
    kept = [json.loads(line) for line in open(path, encoding="utf-8")]
    best = sorted((r for r in records if r["checked"]["ok"]), key=lambda r: sum(r["run_secs"]))[:2]
    assert sorted(map(json.dumps, kept)) == sorted(map(json.dumps, best))
    assert os.path.exists(str(path) + ".bak")
    assert check_folder(str(folder))["problems"] == []


# --- never-worse selection ----------------------------------------------------------------------

def _stir_record(db, job, secs):
    """A MetaSchedule record of cuda_tiled_epilogue's fixed knobs, as if measured at ``secs``."""
    template = next(t for t in PATTERN.templates_for(H200) if t.name == "cuda_tiled_epilogue")
    sch = template.apply(job.func, H200, tunable=False)
    workload = db.ms.commit_workload(_normalize_mod(job.func))
    db.ms.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [secs], H200))


def _kernel_record(db, knobs, secs, ok=True):
    func = K.build_cached(PATTERN, WGMMA, SHAPE, "float16", knobs)
    db.kernels.append(K.KernelRecord("linear_bias_relu", SHAPE, "float16", "cuda_wgmma", dict(knobs),
                                     [secs] if ok else [], {"ok": ok, "message": "" if ok else "wrong"},
                                     K.func_hash(func)))


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """``choose`` on a stand-in H200: every check passes, and each candidate runs in the seconds
    ``times`` gives it: "stir" for a schedule, a tirx kernel's ``_hash`` for it."""
    times = {}

    def key(mod):
        func = mod["main"]
        return K.func_hash(func) if B.is_tirx(func) else "stir"

    monkeypatch.setattr(verify, "checker", lambda *args, **kwargs: lambda sch: (True, ""))
    monkeypatch.setattr(verify, "build_kernel", lambda mod, target, **kwargs: mod)
    monkeypatch.setattr(verify, "time_kernel", lambda kernel, mod, dev, *args: times[key(mod)])
    return times


def _hash(knobs):
    return K.func_hash(K.build_cached(PATTERN, WGMMA, SHAPE, "float16", knobs))


OTHER = {**W.DEFAULT_KNOBS, "block_n": 128}


@pytest.mark.parametrize("fastest", ["kernel record", "schedule record", "default"])
def test_never_worse_between_the_two_kinds_and_the_default(fastest, tmp_path, stand_in_gpu):
    db = TuningDatabase(str(tmp_path), H200)
    job = Job(PATTERN, SHAPE, "float16")
    _stir_record(db, job, 5e-3)
    _kernel_record(db, OTHER, 4e-3)
    _kernel_record(db, {**W.DEFAULT_KNOBS, "stages": 2}, 1e-6, ok=False)   # fastest, but failed its check
    secs = {"kernel record": (1, 2, 3), "schedule record": (2, 1, 3), "default": (2, 3, 1)}[fastest]
    stand_in_gpu.update({_hash(OTHER): secs[0] * 1e-3, "stir": secs[1] * 1e-3,
                         _hash(W.DEFAULT_KNOBS): secs[2] * 1e-3})
    choice, rejected = verify.choose(job, db, H200, dev="h200")
    expected = {"kernel record": "kernel:cuda_wgmma", "schedule record": "template:cuda_tiled_epilogue",
                "default": verify.TEMPLATE_DEFAULT}[fastest]
    assert choice.source == expected
    assert choice.secs == min(secs) * 1e-3
    assert choice.default_secs == secs[2] * 1e-3
    # the faster of the two records is "the record", also when the default won
    assert choice.record_secs == min(secs[:2]) * 1e-3
    assert choice.record_source == ("kernel:cuda_wgmma" if secs[0] < secs[1] else "template:cuda_tiled_epilogue")
    if fastest == "kernel record":
        assert choice.knobs == OTHER and B.is_tirx(choice.mod["main"])
    if fastest == "default":
        assert choice.knobs == W.DEFAULT_KNOBS and B.is_tirx(choice.mod["main"])
    assert any("failed the numerical check" in line for line in rejected)


def test_a_stale_kernel_record_is_skipped(tmp_path, stand_in_gpu):
    db = TuningDatabase(str(tmp_path), H200)
    db.kernels.append(K.KernelRecord("linear_bias_relu", SHAPE, "float16", "cuda_wgmma", dict(OTHER), [1e-6],
                                     {"ok": True, "message": ""}, "f" * 16))
    stand_in_gpu.update({_hash(W.DEFAULT_KNOBS): 1e-3})
    choice, rejected = verify.choose(Job(PATTERN, SHAPE, "float16"), db, H200, dev="h200")
    assert choice.source == verify.TEMPLATE_DEFAULT and choice.record_source is None
    assert any("changed since it was measured" in line for line in rejected)


def test_defaults_without_a_device():
    half, _ = verify.choose(Job(PATTERN, SHAPE, "float16"), None, H200, None)
    assert half.source == verify.TEMPLATE_DEFAULT and half.knobs == W.DEFAULT_KNOBS and B.is_tirx(half.mod["main"])
    assert "wgmma" in _source(half.mod)
    single, _ = verify.choose(Job(PATTERN, SHAPE, "float32"), None, H200, None)
    assert single.knobs is None and not B.has_tirx(single.mod)  # cuda_tiled_epilogue


# --- a model ------------------------------------------------------------------------------------

def test_a_float16_model_builds_for_h200_with_the_mixed_pipeline(tmp_path):
    path = str(tmp_path / "linear_relu_fp16.onnx")
    onnx.save(PATTERN.onnx_graph(SHAPE, "float16"), path)
    prepared = prepare(path, "patterns")
    assert prepared.matches == {"linear_bias_relu": 1}
    mod, decisions = apply_database(prepared.mod, None, H200, dev=None)
    (decision,) = [d for d in decisions if d.pattern == "linear_bias_relu"]
    assert decision.applied == "template-default" and "tirx kernel" in decision.note
    (kernel,) = [k for k in kernels(mod) if k.pattern is not None]  # still found as the pattern's kernel
    assert B.is_tirx(kernel.original) and kernel.original.attrs[PATTERN_ATTR] == "linear_bias_relu"
    options = B.relax_build_options(mod, H200)
    assert options["tir_pipeline"] == B.MIXED_PIPELINE and str(options["target"].attrs["arch"]) == "sm_90a"
    library = str(tmp_path / "model.so")
    model_build.build(mod, H200).export_library(library)
    data = open(library, "rb").read()
    assert b"wgmma.mma_async" in data and b"cp.async.bulk.tensor" in data
    # a float32 model has no tirx kernel: the plain build
    onnx.save(PATTERN.onnx_graph(SHAPE, "float32"), path)
    single, _ = apply_database(prepare(path, "patterns").mod, None, H200, dev=None)
    assert B.relax_build_options(single, H200) == {"target": H200}
