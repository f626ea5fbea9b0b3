"""search_spaces/lib/tirx_sequence.py: two tirx kernels as one PrimFunc, their parameters bound to
the composite's buffers, a workspace and a constant; the host code allocates the workspace on the
GPU and launches both kernels in order. Built to CUDA source here (no GPU to run it on)."""

import pytest
import tvm
from tvm.script import tirx as T

from search_spaces.lib import tirx_sequence as S

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _scale(n: int):
    @T.prim_func
    def scale(a: T.handle, b: T.handle, factor: T.int32):
        A = T.match_buffer(a, (n,), "float32", align=16)
        B = T.match_buffer(b, (n,), "float32", align=16)
        T.device_entry()
        bx = T.cta_id([n // 128])
        tx = T.thread_id([128])
        B[bx * 128 + tx] = A[bx * 128 + tx] * T.Cast("float32", factor)

    return scale.with_attr("global_symbol", "scale").with_attr("autofuse.tirx", True)


def test_two_kernels_through_a_workspace():
    x, y = S.buffer("x", (1024,), "float32"), S.buffer("y", (1024,), "float32")
    tmp = S.workspace("tmp", (1024,), "float32")
    func = S.sequence("twice", [x, y], [(_scale(1024), [x, tmp, 3]), (_scale(1024), [tmp, y, 5])], [tmp])
    assert func.attrs["global_symbol"] == "twice" and bool(func.attrs["autofuse.tirx"])
    assert [p.name for p in func.params] == ["x", "y"]
    executable = tvm.compile(tvm.IRModule({"twice": func}), target=TARGET, tir_pipeline="tirx")
    source = executable.mod.imports[0].inspect_source()
    kernels = [line for line in source.splitlines() if line.startswith('extern "C" __global__') and "{" in line]
    assert len(kernels) == 2
    assert "* 0x1.8p+1f" in source and "* 0x1.4p+2f" in source  # the factors, bound as constants
    host = executable.mod.inspect_source()
    # the workspace: 4 KiB on the CUDA device (type 2), taken and given back around the launches
    assert "(i32 2, i32 %dev_id, i64 4096, i32 2, i32" in host and "@__TVMBackendFreeWorkspace" in host


def test_arguments_must_match_the_parameters():
    x = S.buffer("x", (1024,), "float32")
    with pytest.raises(ValueError, match="scale: 3 parameters, 2 arguments"):
        S.sequence("bad", [x], [(_scale(1024), [x, x])])
