"""Building what autofuse runs, for a target: a kernel (``build_kernel``) or a Relax model's
options (``relax_build_options``).

On a CPU, float32 exp/erf/tanh/sigmoid calls become the vectorisable polynomials of
``search_spaces.lib.tir_math`` (``fast_math``; ``stock`` keeps libm's, as TVM builds it); on a GPU,
pow by a small integer becomes products (``exact_powers``: TVM's CUDA fast math gives NaN for a
negative base). A kernel
template's PrimFunc carries ``autofuse.tirx`` and is lowered by TVM's tirx pipeline for its
``autofuse.tirx_arch`` (sm_90a: wgmma and TMA are arch-specific features an sm_90 target does not
enable); a Relax model holding one is built with the ``autofuse_mixed`` pipeline, which sends those
functions through tirx and the others through s_tir.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.target import Target

from search_spaces.lib.tir_math import exact_powers  # noqa: E402 (the schedule library, no pattern)
from search_spaces.lib.tir_math import fast_math as _fast_math  # noqa: E402

# On a kernel template's PrimFunc: lowered by the tirx pipeline, compiled for this arch.
TIRX_ATTR = "autofuse.tirx"
TIRX_ARCH_ATTR = "autofuse.tirx_arch"
MIXED_PIPELINE = "autofuse_mixed"


def kernel_module(func: tirx.PrimFunc) -> tvm.IRModule:
    """A kernel as the module a ``verify.Choice`` holds (the function keeps its global symbol)."""
    return tvm.IRModule({"main": func})


def is_tirx(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs) and TIRX_ATTR in func.attrs


def has_tirx(mod) -> bool:
    if isinstance(mod, tirx.PrimFunc):
        return is_tirx(mod)
    return any(is_tirx(f) for _, f in mod.functions_items())


def tirx_target(mod, target: Target) -> Target:
    """``target`` with the arch the module's tirx kernels are compiled for (sm_90 -> sm_90a)."""
    funcs = [mod] if isinstance(mod, tirx.PrimFunc) else [f for _, f in mod.functions_items()]
    archs = {str(f.attrs[TIRX_ARCH_ATTR]) for f in funcs if is_tirx(f) and TIRX_ARCH_ATTR in f.attrs}
    if not archs:
        return target
    if len(archs) > 1:
        raise ValueError(f"tirx kernels for several archs in one module: {', '.join(sorted(archs))}")
    config = dict(target.export())
    config["arch"] = archs.pop()
    return Target(config)


def fast_math(mod, target: Target):
    """``mod`` as autofuse builds it for ``target``: on a CPU, the vectorisable polynomials in
    place of libm's exp/erf/tanh/sigmoid (``search_spaces.lib.tir_math.fast_math``); on a GPU, pow
    by 2, 3 or 4 as products (``exact_powers``)."""
    return _fast_math(mod) if target.kind.name == "llvm" else exact_powers(mod)


def build_kernel(mod: tvm.IRModule | tirx.PrimFunc, target: Target, *, stock: bool = False):
    """A kernel template's kernel goes through the tirx pipeline, everything else through s_tir.
    ``stock``: as TVM builds it (libm's math): references and the TVM baselines."""
    if has_tirx(mod):
        return build_tirx(mod, target)
    return tvm.tirx.build(mod if stock else fast_math(mod, target), target=target)


def build_tirx(mod, target: Target):
    """A module of tirx kernels (a kernel template's, alone) through TVM's tirx pipeline; the runtime
    module calls it by its global symbol, and by ``main`` when it is the only one."""
    if isinstance(mod, tirx.PrimFunc):
        mod = kernel_module(mod)
    return tvm.tirx.build(mod, target=tirx_target(mod, target), pipeline="tirx")


def register_mixed_pipeline() -> str:
    """Register (once) the TIR pipeline that lowers tirx kernels (attr ``autofuse.tirx``) through
    tirx and every other PrimFunc through s_tir, for ``relax.build(..., tir_pipeline=...)``; its name."""
    from tvm.tirx import compilation_pipeline as cp

    if MIXED_PIPELINE in cp.PIPELINE_MAP:
        return MIXED_PIPELINE

    def factory():
        s_tir_pass, finalize_host, finalize_device = cp.PIPELINE_MAP["s_tir"]()
        tirx_pass, _, _ = cp.PIPELINE_MAP["tirx"]()

        @tvm.transform.module_pass(opt_level=0, name="AutofuseMixedPipeline")
        def mixed(mod, _ctx):
            kernels = {gv: f for gv, f in mod.functions_items() if is_tirx(f)}
            rest = {gv: f for gv, f in mod.functions_items() if gv not in kernels}
            lowered = {}
            for part, lower in ((kernels, tirx_pass), (rest, s_tir_pass)):
                if part:
                    lowered.update(lower(tvm.IRModule(part, attrs=mod.attrs)).functions_items())
            return tvm.IRModule(lowered, attrs=mod.attrs)

        return mixed, finalize_host, finalize_device

    cp.register_tir_pipeline(MIXED_PIPELINE, factory)
    return MIXED_PIPELINE


def relax_build_options(mod: tvm.IRModule, target: Target) -> dict:
    """``relax.build`` keyword arguments for ``mod``: with tirx kernels in it, their arch and the
    mixed pipeline; otherwise just the target."""
    if not has_tirx(mod):
        return {"target": target}
    return {"target": tirx_target(mod, target), "tir_pipeline": register_mixed_pipeline()}
