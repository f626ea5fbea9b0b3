"""lib/cuda_moe: the routing kernels around a mixture of experts' GEMMs, emulated on the CPU
(tests/search_spaces/cuda_emulator.py) in float32 with stand-ins for the expert GEMMs, so that
routing and combine are checked at many shapes cheaply. The whole layer with its wgmma GEMMs runs
in test_kernel_templates_emulated.py, and on the GPU in tests/test_kernel_templates_gpu.py."""

import numpy as np
import pytest
import tvm

from search_spaces.lib import cuda_moe
from search_spaces.moe import moe_gate_topk as moe


def _scale_by_group(rows, hidden, experts):
    """A stand-in for a grouped GEMM (cheaper to emulate) with its parameters (A, B, groups, C):
    C's rows = A's rows times (their group + 1), rows of no group left unwritten."""
    from tvm.script import tirx as T

    @T.macro
    def kernel(a, g, c):
        T.device_entry()
        bx = T.cta_id([rows])
        tx = T.thread_id([hidden])
        if g[bx // 64] >= 0:
            c[bx, tx] = a[bx, tx] * T.Cast("float32", g[bx // 64] + 1)

    @T.prim_func
    def scale(a_h: T.handle, b_h: T.handle, g_h: T.handle, c_h: T.handle):
        a = T.match_buffer(a_h, (rows, hidden), "float32", align=16)
        T.match_buffer(b_h, (experts * hidden, hidden), "float32", align=16)
        g = T.match_buffer(g_h, (rows // 64,), "int32", align=16)
        c = T.match_buffer(c_h, (rows, hidden), "float32", align=16)
        kernel(a, g, c)

    return scale


@pytest.mark.parametrize("tokens, experts, k", [(64, 8, 2), (130, 40, 4)], ids=["e8-k2", "e40-k4"])
def test_the_routed_rows_and_their_combine_emulated(tokens, experts, k, tmp_path):
    """zero, route, place and combine (float32, the expert GEMMs replaced by a scaling of each row
    by its expert + 1, twice): every token gets its k experts' rows back,
    weighted by the renormalised gate, in either thread order (the slots the atomic counters hand
    out may differ, the result may not)."""
    emulator = pytest.importorskip("cuda_emulator")
    if emulator.unavailable_reason():
        pytest.skip(emulator.unavailable_reason())
    NT, H, E, K = tokens, 64, experts, k
    shape = {"tokens": NT, "hidden": H, "inter": H, "experts": E, "k": K}  # inter = hidden: the stand-ins' rows
    rows = cuda_moe.routed_rows(NT, E, K, 64)
    up, down = (_scale_by_group(rows, H, E) for _ in range(2))  # each kernel of a sequence its own
    func = cuda_moe.routed_layer(NT, H, H, E, K, "float32", rows, 64, up, down).with_attr("autofuse.tirx", True)
    x, wg, w1, w2 = moe.make_inputs(shape, "float32", 3)
    (y,) = emulator.emulate(tvm.IRModule({"main": func}), [x, wg, w1, w2], tmp_path)
    chosen, weights = moe.route(x, wg, K)
    expected = x * (weights * (chosen + 1.0) ** 2).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
