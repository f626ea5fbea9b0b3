"""Export the real-model corpus: Hugging Face transformers and torchvision architectures at small
configs with seeded random weights, through torch.onnx as a user would export them.

    pip install -e ".[export]"
    python models/real/export.py                 # every variant, rewrites manifest.json
    python models/real/export.py --only bert,resnet18
    python models/real/export.py --only bert,llama --variants torchscript-fixed --dtype float16 \
        --device cuda --programs --out /tmp/f16      # for a GPU compare (benchmarks/gpu_session.sh)

Each architecture is exported by the TorchScript exporter (``dynamo=False``) and by the
torch.export-based one (``dynamo=True``), with fixed input shapes; the ``DYNAMIC`` ones again with
symbolic batch (and sequence) axes. A variant whose export fails is listed in the manifest with
the error instead of a file. Nothing is downloaded: the configs are written here, the weights
drawn from a seeded generator. ``--out`` writes the files and a manifest of their own elsewhere;
``--dtype float16`` casts the weights and float inputs (the exports then trace in that dtype);
``--programs`` also saves each variant's module as a torch.export program (``.pt2`` beside the
``.onnx``), which ``autofuse compare MODEL --torch-program`` runs as the torch baselines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import platform
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0
OPSET_TORCHSCRIPT = 17
OPSET_DYNAMO = 18
SEQ = 32
IMAGE = 224
VOCAB = 256
CLASSES = 10
# Transformer sizes: what makes each file small (hundreds of KB) while keeping the real structure.
HIDDEN, HEADS, LAYERS, FFN = 64, 4, 2, 128
# Architectures also exported with symbolic batch (and sequence) axes.
DYNAMIC = ("bert", "llama", "resnet18")


def _randomize_batchnorm(module):
    """torchvision initialises BN as the identity (mean 0, var 1, weight 1, bias 0): give it
    statistics and an affine part, so a model that mishandles BN folding is caught."""
    import torch
    gen = torch.Generator().manual_seed(SEED + 1)
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return module


def _exported(arch: Arch):
    """``arch.module`` behind ``forward(*inputs)`` with one tensor output, so every export sees
    the same signature: a HF model gets its inputs by keyword and gives its first output
    (last_hidden_state or logits); a torchvision model is called as it is."""
    import torch

    names = [name for name, _, _ in arch.inputs]

    class Exported(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            if not arch.keyword_inputs:
                return self.inner(*inputs)
            return self.inner(**dict(zip(names, inputs)))[0]

    return Exported(arch.module).eval()


@dataclasses.dataclass
class Arch:
    module: object
    inputs: list            # (name, dtype, dims): a dim is a size or the name of a symbolic axis
    sizes: dict             # each symbolic axis's size in the fixed export (and the tests' binding)
    what: str
    config: dict
    keyword_inputs: bool    # a HF model: inputs by keyword, first output taken


TOKENS = [("input_ids", "int64", ["batch", "seq"]), ("attention_mask", "int64", ["batch", "seq"])]
TOKEN_SIZES = {"batch": 1, "seq": SEQ}


def bert():
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=128, hidden_act="gelu")
    return Arch(BertModel(config, add_pooling_layer=False), TOKENS, TOKEN_SIZES,
                "BertModel (no pooler): last_hidden_state", config.to_dict(), True)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=128,
                        use_cache=False)
    return Arch(GPT2LMHeadModel(config), TOKENS, TOKEN_SIZES, "GPT2LMHeadModel: logits (tied embeddings)",
                config.to_dict(), True)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=128,
                         use_cache=False)
    return Arch(LlamaForCausalLM(config), TOKENS, TOKEN_SIZES,
                "LlamaForCausalLM: logits (GQA 4 query / 2 KV heads, RoPE, RMSNorm, SwiGLU)", config.to_dict(), True)


def vit():
    from transformers import ViTConfig, ViTModel
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=FFN)
    return Arch(ViTModel(config, add_pooling_layer=False), [("pixel_values", "float32", ["batch", 3, 32, 32])],
                {"batch": 1}, "ViTModel (no pooler, 32x32 image, 8x8 patches): last_hidden_state", config.to_dict(),
                True)


def _narrow_resnet(block, layers: list[int], width: int, num_classes: int):
    """torchvision's ResNet with its stage widths divided (64, 128, 256, 512 -> width x 1, 2, 4, 8):
    the same graph in a file of about a MB."""
    import torch
    from torchvision.models.resnet import ResNet

    model = ResNet(block, layers, num_classes=num_classes)
    model.inplanes = width
    model.conv1 = torch.nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = torch.nn.BatchNorm2d(width)
    model.layer1 = model._make_layer(block, width, layers[0])
    model.layer2 = model._make_layer(block, width * 2, layers[1], stride=2)
    model.layer3 = model._make_layer(block, width * 4, layers[2], stride=2)
    model.layer4 = model._make_layer(block, width * 8, layers[3], stride=2)
    model.fc = torch.nn.Linear(width * 8 * block.expansion, num_classes)
    return model


def _cnn(module, what: str, config: dict) -> Arch:
    return Arch(_randomize_batchnorm(module), [("input", "float32", ["batch", 3, IMAGE, IMAGE])], {"batch": 1},
                what, config, False)


def resnet18():
    from torchvision.models.resnet import BasicBlock
    config = {"block": "BasicBlock", "layers": [2, 2, 2, 2], "width": 8, "num_classes": CLASSES}
    return _cnn(_narrow_resnet(BasicBlock, [2, 2, 2, 2], 8, CLASSES), "torchvision ResNet-18 (BasicBlock "
                f"[2,2,2,2]) at 1/8 width (8..64), {CLASSES} classes", config)


def resnet50():
    from torchvision.models.resnet import Bottleneck
    config = {"block": "Bottleneck", "layers": [3, 4, 6, 3], "width": 8, "num_classes": CLASSES}
    return _cnn(_narrow_resnet(Bottleneck, [3, 4, 6, 3], 8, CLASSES), "torchvision ResNet-50 (Bottleneck "
                f"[3,4,6,3]) at 1/8 width (8..64, x4 expansion), {CLASSES} classes", config)


def mobilenetv3_small():
    from torchvision.models import mobilenet_v3_small
    return _cnn(mobilenet_v3_small(weights=None, width_mult=0.25, num_classes=CLASSES),
                f"torchvision mobilenet_v3_small(width_mult=0.25, num_classes={CLASSES})",
                {"width_mult": 0.25, "num_classes": CLASSES})


def shufflenetv2_x0_5():
    from torchvision.models import shufflenet_v2_x0_5
    return _cnn(shufflenet_v2_x0_5(weights=None, num_classes=CLASSES),
                f"torchvision shufflenet_v2_x0_5(num_classes={CLASSES})", {"num_classes": CLASSES})


ARCHITECTURES = {f.__name__: f for f in (bert, gpt2, llama, vit, resnet18, resnet50, mobilenetv3_small,
                                          shufflenetv2_x0_5)}


def _variants(names):
    for name in names:
        for exporter in ("torchscript", "dynamo"):
            yield name, exporter, "fixed"
            if name in DYNAMIC:
                yield name, exporter, "dynamic"


def _example_inputs(arch: Arch, dtype: str = "float32", device: str = "cpu") -> tuple:
    """Seeded example inputs; an attention mask with its last positions padded, so the exporter
    traces (and the file keeps) the padding path. Float inputs in ``dtype``."""
    import torch
    gen = torch.Generator().manual_seed(SEED + 2)
    tensors = []
    for name, kind, dims in arch.inputs:
        shape = [arch.sizes.get(d, d) for d in dims]
        if name == "attention_mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[..., -4:] = 0
            tensors.append(mask)
        elif kind == "int64":
            tensors.append(torch.randint(0, VOCAB, shape, generator=gen))
        else:
            tensors.append(torch.randn(shape, generator=gen).to(getattr(torch, dtype)))
    return tuple(t.to(device) for t in tensors)


def _export(arch: Arch, exporter: str, axes: str, path: str, dtype: str = "float32", device: str = "cpu",
            program: bool = False) -> None:
    import torch

    module, args = _exported(arch).to(device=device, dtype=getattr(torch, dtype)), _example_inputs(arch, dtype, device)
    if program:  # the module itself, for the torch baselines (fixed shapes: what compare binds)
        torch.export.save(torch.export.export(module, args), path[:-len(".onnx")] + ".pt2")
    names = [name for name, _, _ in arch.inputs]
    symbolic = [{j: d for j, d in enumerate(dims) if isinstance(d, str)} for _, _, dims in arch.inputs]
    if exporter == "torchscript":
        dynamic_axes = dict(zip(names, symbolic)) if axes == "dynamic" else None
        torch.onnx.export(module, args, path, input_names=names, output_names=["output"],
                          opset_version=OPSET_TORCHSCRIPT, dynamo=False, dynamic_axes=dynamic_axes)
        return
    dynamic_shapes = None
    if axes == "dynamic":
        dims = {"batch": torch.export.Dim("batch", min=1, max=64), "seq": torch.export.Dim("seq", min=2, max=128)}
        dynamic_shapes = {"inputs": tuple({j: dims[d] for j, d in axes_.items()} for axes_ in symbolic)}
    program = torch.onnx.export(module, args, input_names=names, output_names=["output"],
                                opset_version=OPSET_DYNAMO, dynamo=True, external_data=False,
                                dynamic_shapes=dynamic_shapes)
    program.save(path, external_data=False)


def export_one(name: str, exporter: str, axes: str, out: str = HERE, dtype: str = "float32", device: str = "cpu",
               program: bool = False, options: str = "") -> dict:
    """Export one variant; its manifest entry (with ``error`` instead of a file when the
    exporter cannot take the model)."""
    import torch

    torch.manual_seed(SEED)
    arch = ARCHITECTURES[name]()
    file = f"{name}-{exporter}-{axes}{'' if dtype == 'float32' else '-' + dtype}.onnx"
    path = os.path.join(out, file)
    entry = {"file": file, "architecture": name, "what": arch.what, "exporter": exporter, "axes": axes,
             "inputs": [{"name": n, "dtype": dtype if kind == "float32" else kind,
                         "shape": [arch.sizes[d] if isinstance(d, str) and axes == "fixed" else d for d in dims]}
                        for n, kind, dims in arch.inputs],
             # the sizes the tests and the benchmark bind symbolic axes to (``--input-shape``)
             "bind": {n: [arch.sizes.get(d, d) for d in dims] for n, _, dims in arch.inputs},
             "config": arch.config,
             "command": f"python models/real/export.py --only {name}{options}"}
    log = io.StringIO()
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            warnings.simplefilter("ignore")
            _export(arch, exporter, axes, path, dtype, device, program)
    except Exception as err:  # an exporter that cannot take this model: recorded, not fatal
        for stale in (path, path[:-len(".onnx")] + ".pt2"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        text = str(err).strip()
        entry.update(file=None, error=f"{type(err).__name__}: {text.splitlines()[0][:300]}" if text
                     else type(err).__name__)
        return entry
    entry["bytes"] = os.path.getsize(path)
    with open(path, "rb") as f:
        entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
    return entry


def versions() -> dict:
    import onnx
    import torch
    import torchvision
    import transformers
    found = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
             "transformers": transformers.__version__, "onnx": onnx.__version__}
    with contextlib.suppress(ImportError):
        import onnxscript
        found["onnxscript"] = onnxscript.__version__
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated architectures (default all): "
                                                     + ", ".join(ARCHITECTURES))
    parser.add_argument("--variants", default=None,
                        help="comma-separated EXPORTER-AXES to export (e.g. torchscript-fixed; default every one)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="the weights' and float inputs' dtype (default float32: the corpus)")
    parser.add_argument("--device", default="cpu", help="where the exporters trace, e.g. cuda (default cpu)")
    parser.add_argument("--programs", action="store_true",
                        help="also save each module as a torch.export program (.pt2) beside its .onnx")
    parser.add_argument("--out", default=HERE, help="folder for the files and their manifest (default: the corpus)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}")
    variants = _variants(names)
    if args.variants:
        wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
        known = {f"{e}-{a}" for e in ("torchscript", "dynamo") for a in ("fixed", "dynamic")}
        if not wanted or wanted - known:
            parser.error(f"--variants: give some of {', '.join(sorted(known))}")
        variants = [v for v in variants if f"{v[1]}-{v[2]}" in wanted]
    os.makedirs(args.out, exist_ok=True)
    options = "".join(f" --{k} {v}" for k, v in (("variants", args.variants), ("dtype", args.dtype),
                                                   ("device", args.device)) if v not in (None, "float32", "cpu"))
    options += " --programs" if args.programs else ""
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = {"models": []}
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    kept = [m for m in manifest["models"] if m["architecture"] not in names]
    exported = []
    for name, exporter, axes in variants:
        entry = export_one(name, exporter, axes, args.out, args.dtype, args.device, args.programs, options)
        exported.append(entry)
        status = f"{entry['bytes'] / 1e3:.0f} KB" if entry.get("file") else f"FAILED: {entry['error']}"
        print(f"{name:18s} {exporter:11s} {axes:7s} {status}", flush=True)
    order = {n: i for i, n in enumerate(ARCHITECTURES)}
    manifest = {"seed": SEED, "opset": {"torchscript": OPSET_TORCHSCRIPT, "dynamo": OPSET_DYNAMO},
                "command": "python models/real/export.py" + options, "versions": versions(),
                "models": sorted(kept + exported, key=lambda m: (order[m["architecture"]], m["exporter"] != "torchscript",
                                                                 m["axes"] != "fixed"))}
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
