"""models/real/: the corpus of exported HF transformers and torchvision models. The manifest
describes the committed files; every file imports into Relax (its symbolic axes bound where it has
them); the TorchScript fixed-shape export of the transformers and ResNet-18 builds under --fusion
patterns without records and matches onnxruntime (the rest build in benchmarks/real_models.py);
a dynamic export builds with its axes bound (--input-shape) and runs at that shape."""

import hashlib
import json
import os

import pytest

from autofuse.model.importer import load_onnx, to_relax
from autofuse.errors import AutofuseError
from autofuse.model.jobs import build_model, prepare, run_library
from autofuse.model.shapes import static_model
from autofuse.target import parse_target
from conftest import REPO

REAL = os.path.join(REPO, "models", "real")
with open(os.path.join(REAL, "manifest.json"), encoding="utf-8") as f:
    MANIFEST = json.load(f)
EXPORTED = [m for m in MANIFEST["models"] if m["file"]]
# One variant per architecture in the suite: the TorchScript exporter at fixed shapes (BERT's
# dynamic export, bound, stands in for its fixed one); the others build in the benchmark
# (benchmarks/real_models.py, every export against onnxruntime), as do the CNNs but ResNet-18:
# ResNet-50, MobileNetV3 and ShuffleNet took 60 s of the suite's 10 minutes (the import test still
# reads every export, ShuffleNet's channel shuffle folded away).
SUITE = [m for m in EXPORTED if m["exporter"] == "torchscript" and m["axes"] == "fixed"
         and m["architecture"] not in ("bert", "resnet50", "shufflenetv2_x0_5", "mobilenetv3_small")]
TARGET = parse_target("llvm")


def _path(entry) -> str:
    return os.path.join(REAL, entry["file"])


def _bind(entry):
    return {name: tuple(dims) for name, dims in entry["bind"].items()} if entry["axes"] == "dynamic" else None


def test_manifest_matches_the_committed_files():
    on_disk = sorted(f for f in os.listdir(REAL) if f.endswith(".onnx"))
    assert on_disk == sorted(m["file"] for m in EXPORTED)
    for entry in EXPORTED:
        data = open(_path(entry), "rb").read()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        assert len(data) < 5 << 20, f"{entry['file']}: tracked files stay under 5 MB"
    assert sum(m["bytes"] for m in EXPORTED) < 20 << 20
    architectures = {m["architecture"] for m in MANIFEST["models"]}
    assert {"bert", "gpt2", "llama", "vit", "resnet18", "resnet50", "mobilenetv3_small",
            "shufflenetv2_x0_5"} <= architectures
    assert {m["architecture"] for m in EXPORTED if m["exporter"] == "torchscript" and m["axes"] == "fixed"} \
        == architectures, "every architecture has a TorchScript fixed export"
    assert {m["exporter"] for m in EXPORTED} == {"torchscript", "dynamo"}
    dynamic = {m["architecture"] for m in EXPORTED if m["axes"] == "dynamic"}
    assert dynamic & {"bert", "gpt2", "llama", "vit"} and dynamic & {"resnet18", "resnet50"}
    for key in ("torch", "torchvision", "transformers"):
        assert MANIFEST["versions"][key]


@pytest.mark.parametrize("entry", EXPORTED, ids=lambda m: m["file"])
def test_every_export_imports_with_static_shapes(entry):
    model, folded = static_model(load_onnx(_path(entry)), _bind(entry), entry["file"])
    # TorchScript's shape arithmetic (ShuffleNet's channel shuffle, HF's masks) is folded away.
    if entry["exporter"] == "torchscript" and entry["architecture"] in ("shufflenetv2_x0_5", "bert", "llama"):
        assert folded > 0
        assert not any(node.op_type == "Shape" for node in model.graph.node)
    to_relax(model, entry["file"])  # raises on anything it cannot import, or a shape known only at run time


@pytest.fixture(scope="module")
def prepared_once():
    """``prepare(FILE, "patterns")`` once per file for the module: the build test and the FLOP-share
    test read the same fused module of GPT-2, Llama and ViT (build_model leaves it as it was)."""
    done = {}

    def get(entry):
        if entry["file"] not in done:
            done[entry["file"]] = prepare(_path(entry), "patterns")
        return done[entry["file"]]

    return get


@pytest.mark.parametrize("entry", SUITE, ids=lambda m: m["architecture"])
def test_torchscript_export_builds_and_matches_onnxruntime(entry, tmp_path, prepared_once):
    prepared = prepared_once(entry)
    result = build_model(prepared, TARGET, None, str(tmp_path / "m.so"), repeat=1)
    assert result.verified, f"{entry['file']}: {result.message}"


TRANSFORMERS = [m for m in EXPORTED if m["exporter"] == "torchscript" and m["axes"] == "fixed"
                and m["architecture"] in ("bert", "gpt2", "llama", "vit")]


@pytest.mark.parametrize("entry", TRANSFORMERS, ids=lambda m: m["architecture"])
def test_most_of_a_transformers_flops_run_in_pattern_kernels(entry, prepared_once):
    """The projections and FFN GEMMs are the linear patterns (with their bias and GELU), so at
    least 80% of the FLOPs run in pattern kernels, counted as ``autofuse build`` reports them."""
    from autofuse.model.kernels import pattern_share

    share = pattern_share(prepared_once(entry).mod)
    assert share["flop_fraction"] >= 0.8, share


def test_dynamic_export_builds_and_runs_at_the_bound_shape(tmp_path):
    """--input-shape input_ids=2x16 on BERT with symbolic batch and sequence axes: attention_mask
    shares them and is bound too; the library runs at that shape (and only that one)."""
    library = str(tmp_path / "bert.so")
    prepared = prepare(os.path.join(REAL, "bert-torchscript-dynamic.onnx"), "patterns", {"input_ids": (2, 16)})
    result = build_model(prepared, TARGET, None, library, repeat=1)
    assert result.verified, result.message
    meta, outputs = run_library(library, None, 0, {"input_ids": (2, 16), "attention_mask": (2, 16)})
    assert [(i["name"], i["shape"]) for i in meta["inputs"]] == [("input_ids", [2, 16]), ("attention_mask", [2, 16])]
    assert [o.shape for o in outputs.values()] == [(2, 16, 64)]
    with pytest.raises(AutofuseError, match="was built for input_ids=2x16, not 1x16"):
        run_library(library, None, 0, {"input_ids": (1, 16)})
