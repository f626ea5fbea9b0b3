"""Several tirx kernels as one PrimFunc: a kernel template whose pattern needs more than one launch
(a grid-wide dependency, such as a GEMM that needs whole rows of the one before it, or split-KV
partials that a second kernel combines).

``sequence`` declares each kernel's buffer parameters over the memory of the composite's
parameters or of global workspaces allocated for the call, binds its scalar parameters to values,
and puts the kernels' bodies one after another: the tirx pipeline lowers each device region to its
own ``__global__`` function and the host code launches them in order on one stream, so each kernel
sees what the ones before it wrote. Workspaces are allocated by the host (TVM's workspace
allocator) for the duration of the call.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import tirx

ALIGN = 16  # the kernels' match_buffer(align=16): specialize wants the same alignment


def buffer(name: str, shape: Sequence[int], dtype: str) -> tirx.Buffer:
    """A parameter or workspace of a composite, as the kernels declare theirs."""
    return tirx.decl_buffer(tuple(shape), dtype, name, data_alignment=ALIGN)


def workspace(name: str, shape: Sequence[int], dtype: str) -> tirx.Buffer:
    """A global-memory buffer that lives for one call of the composite."""
    return tirx.decl_buffer(tuple(shape), dtype, name, data_alignment=ALIGN, scope="global")


def sequence(name: str, params: Sequence[tirx.Buffer], steps: Sequence[tuple[tirx.PrimFunc, Sequence]],
             workspaces: Sequence[tirx.Buffer] = ()) -> tirx.PrimFunc:
    """The PrimFunc ``name(*params)`` that runs each ``(kernel, args)`` of ``steps`` in turn, with
    kernel parameter i bound to ``args[i]`` (a Buffer of ``params`` or ``workspaces``, or an int or
    expression for a scalar parameter). Each kernel must be built for this call alone (its
    variables are taken over as they are). The result carries the first kernel's attributes."""
    stmts = [tirx.AllocBuffer(ws) for ws in workspaces]
    for kernel, args in steps:
        if len(args) != len(kernel.params):
            raise ValueError(f"{kernel.attrs['global_symbol']}: {len(kernel.params)} parameters, "
                             f"{len(args)} arguments")
        for param, arg in zip(kernel.params, args):
            if isinstance(param.ty, tirx.BufferType):  # the kernel's buffer, declared over the argument's memory
                stmts.append(tirx.DeclBuffer(param, data=arg.data))
            else:
                stmts.append(tirx.Bind(param, tirx.const(arg, str(param.ty.dtype)) if isinstance(arg, int) else arg))
        stmts.append(kernel.body)
    func = tirx.PrimFunc(list(params), tirx.SeqStmt(stmts), attrs=steps[0][0].attrs)
    return func.with_attr("global_symbol", name)


def prefixed(space: dict, prefix: str) -> dict:
    """One kernel's knobs (or knob space) as a composite's, under ``prefix``."""
    return {prefix + name: value for name, value in space.items()}


def unprefixed(knobs: dict, prefix: str) -> dict:
    """The knobs of the kernel under ``prefix`` from a composite's knobs."""
    return {name[len(prefix):]: value for name, value in knobs.items() if name.startswith(prefix)}
