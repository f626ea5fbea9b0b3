"""The three fusion modes of a model, from imported Relax to a module of PrimFunc kernels.

- ``none``: every op its own kernel (LegalizeOps only).
- ``auto``: TVM's automatic fusion, the XLA-style baseline (FuseOps + FuseTIR).
- ``patterns``: subgraphs that are one of our patterns become a call to that pattern's PrimFunc
  (its templates and records then apply); the rest goes through ``auto``.
"""

from __future__ import annotations

import collections
import json

import tvm
from tvm import relax
from tvm.relax.dpl import rewrite_call

from ..errors import AutofuseError
from ..pattern import constant_value, dtype_of, static_shape  # noqa: F401 (the rules' matching helpers)
from ..registry import all_patterns

MODES = ("none", "auto", "patterns")
PATTERN_ATTR = "autofuse.pattern"
SHAPE_ATTR = "autofuse.shape"
DTYPE_ATTR = "autofuse.dtype"
# FuseOps must not merge a pattern kernel with its neighbours: that would make it another workload.
OPAQUE = 8


_REDUCED_FLOATS = ("float16", "bfloat16")
_SUMMING_OPS = ("relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d")


@relax.expr_functor.mutator
class _Float32Accumulation(relax.PyExprMutator):
    """Matmuls and convolutions of float16/bfloat16 tensors sum in float32 and round once, as
    onnxruntime, cuBLAS and cuDNN do: TVM legalises them to add in the storage dtype, whose error
    grows with the reduction (a ViT's float16 patch convolution put the model 1.7x over the error
    torch has in float16)."""

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        if name not in _SUMMING_OPS:
            return call
        call = self.builder_.normalize(call)  # its type, after the arguments were visited
        dtype = dtype_of(call)
        if dtype not in _REDUCED_FLOATS or any(dtype_of(a) != dtype for a in call.args):
            return call
        if name == "relax.matmul":
            wide = relax.op.matmul(*call.args, out_dtype="float32")
        else:
            a = call.attrs
            conv = relax.op.nn.conv1d if name == "relax.nn.conv1d" else relax.op.nn.conv2d
            wide = conv(*call.args, strides=a.strides, padding=a.padding, dilation=a.dilation, groups=a.groups,
                        data_layout=a.data_layout, kernel_layout=a.kernel_layout, out_layout=a.out_layout,
                        out_dtype="float32")
        return relax.op.astype(self.builder_.emit(wide), dtype)


def accumulate_in_float32(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every float16/bfloat16 matmul and 1-D/2-D convolution accumulating in float32."""
    out = tvm.IRModule(mod.functions, attrs=mod.attrs, global_infos=mod.global_infos)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out[gv] = _Float32Accumulation().visit_expr(func)
    return out


def _prepare(mod: tvm.IRModule) -> tvm.IRModule:
    # BatchNorm becomes arithmetic that fuses into the conv; canonicalising afterwards lets the ReLU
    # after it fuse too (without it, Relu stays a kernel of its own).
    return tvm.transform.Sequential([relax.transform.DecomposeOpsForInference(),
                                     relax.transform.CanonicalizeBindings()])(mod)


def _lower(mod: tvm.IRModule, fuse: bool) -> tvm.IRModule:
    # FoldConstant after LegalizeOps folds what only depends on weights (a Gemm's transposed
    # constant would otherwise be a runtime transpose kernel).
    passes = [relax.transform.LegalizeOps(), relax.transform.FoldConstant()]
    if fuse:
        passes += [relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    passes.append(relax.transform.DeadCodeElimination())
    return tvm.transform.Sequential(passes)(mod)


def fuse(mod: tvm.IRModule, mode: str) -> tuple[tvm.IRModule, dict[str, int]]:
    """The lowered module and, for ``patterns``, how many subgraphs each rule matched."""
    if mode not in MODES:
        raise AutofuseError(f"unknown fusion mode {mode!r}: use one of {', '.join(MODES)}")
    matches: dict[str, int] = {}
    if mode == "patterns":
        # Match before DecomposeOpsForInference: batch_norm is still one op there.
        mod, matches = match_patterns(mod)
    mod = _prepare(accumulate_in_float32(mod))
    return _lower(mod, fuse=mode != "none"), matches


def match_patterns(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, int]]:
    """Replace every subgraph a pattern's ``RelaxRule`` matches by a call to its PrimFunc."""
    builder = relax.BlockBuilder(mod)
    functions = {gv: f for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
    rules = [(pattern, rule) for pattern in all_patterns().values() for rule in pattern.relax_rules]
    for pattern, rule in sorted(rules, key=lambda pr: -pr[1].priority):
        root, wildcards = rule.make()

        def kernel(shape, dtype, args, _pattern=pattern, _rule=rule):
            func = _pattern.build(shape, dtype)
            func = func.without_attr("global_symbol").with_attrs({
                "op_pattern": OPAQUE, PATTERN_ATTR: _pattern.name,
                SHAPE_ATTR: json.dumps(shape), DTYPE_ATTR: dtype})
            gv = builder.add_func(func, f"{_pattern.name}")
            specs = _pattern.output_specs(func)
            out = [relax.TensorType(shape_, dtype_) for shape_, dtype_ in specs]
            return relax.call_tir(gv, list(args), out if len(out) > 1 else out[0])

        def rewriter(expr, matchings, _rule=rule, _wildcards=wildcards, _kernel=kernel):
            matched = {name: matchings[p] for name, p in _wildcards.items() if p in matchings}
            replacement = _rule.rewrite(matched, _kernel)
            return expr if replacement is None else replacement

        for gv in list(functions):
            functions[gv] = rewrite_call(root, rewriter, functions[gv])
    result = builder.get()
    for gv, func in functions.items():
        result[gv] = func
    return result, pattern_calls(result)


def pattern_calls(mod: tvm.IRModule) -> dict[str, int]:
    """Call sites of pattern kernels per pattern name (identical kernels share one PrimFunc)."""
    names = {gv: f.attrs[PATTERN_ATTR] for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and PATTERN_ATTR in f.attrs}
    counts: collections.Counter = collections.Counter()
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir) and expr.args[0] in names:
            counts[str(names[expr.args[0]])] += 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return dict(counts)


def kernel_names(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))

