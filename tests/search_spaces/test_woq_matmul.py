"""woq_matmul where it could be wrong: the int4 codec (nibble order, sign of -8 and 7), both bit
widths and groups other than the default through the kernel (unscheduled, template default, knob
samples replayed) and the ONNX graph, every nibble position decoded exactly, the template keeping
only a tile of float weights, and shapes it rejects."""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir.schedule import Trace

from autofuse.errors import AutofuseError
from autofuse.target import parse_target
from autofuse.accuracy import compare
from search_spaces.quant import woq_matmul as woq

TARGET = parse_target("llvm")
DEV = tvm.cpu()
SMALL = woq.PATTERN.small_shape()
CASES = {
    "int4_group16": dict(SMALL, group=16),
    "int4_one_group": dict(SMALL, group=SMALL["k"]),
    "int8_small": dict(SMALL, bits=8),
    "int8_group8": dict(SMALL, bits=8, group=8),
    "int4_m1_group2": dict(SMALL, m=1, group=2),
}


def _run(mod, inputs):
    rt = tvm.tirx.build(mod, target=TARGET)
    outs = [tvm.runtime.tensor(np.zeros(shape, dtype), DEV)
            for shape, dtype in woq.PATTERN.output_specs(mod["main"])]
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], *outs)
    return [o.numpy() for o in outs]


def _modules(shape, samples=(5, 6)):
    func = woq.build(shape, "float32")
    yield "unscheduled", tvm.IRModule({"main": func})
    yield "default", woq.dequant_on_load.apply(func, TARGET, tunable=False).mod
    design = s_tir.Schedule(func, seed=1)
    woq.dequant_on_load.schedule(design, TARGET, tunable=True)
    space = Trace(design.trace.insts, {})
    for seed in samples:
        sch = s_tir.Schedule(func, seed=seed)
        space.apply_to_schedule(sch, remove_postproc=True)
        yield f"sample{seed}", sch.mod


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(5, 12))
    packed = woq.pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (5, 6)
    np.testing.assert_array_equal(woq.unpack_int4(packed), q)
    # Every byte is two valid nibbles, so unpack then pack is the identity on all 256 of them.
    every_byte = np.arange(256, dtype=np.uint8).reshape(4, 64)
    np.testing.assert_array_equal(woq.pack_int4(woq.unpack_int4(every_byte)), every_byte)


def test_nibble_order_and_extremes():
    # Low nibble = even k, high = odd k; -8 is 0b1000, 7 is 0b0111, -1 is 0b1111.
    np.testing.assert_array_equal(woq.pack_int4([[-8, 7, 7, -8, -1, 0]]), [[0x78, 0x87, 0x0F]])
    np.testing.assert_array_equal(woq.unpack_int4(np.array([[0x78, 0x87, 0xF0]], np.uint8)),
                                  [[-8, 7, 7, -8, 0, -1]])
    with pytest.raises(ValueError):
        woq.pack_int4([[8, 0]])
    with pytest.raises(ValueError):
        woq.pack_int4([[-9, 0]])


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_decodes_every_value_exactly(bits):
    # x = identity (m = k) makes y[kk, j] = q[j, kk] * scale[j, kk // group] + b[j]: one product
    # per output, so exact. q walks every value of the range (-8 and 7 / -128 and 127 included) in
    # every nibble position; power-of-two scales differing per group catch a wrong group index.
    k, n, group = 32, 16, 8
    shape = dict(SMALL, m=k, n=n, k=k, group=group, bits=bits)
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    q = (lo + (np.arange(n * k).reshape(n, k) * 7) % (hi - lo + 1)).astype(np.int8)
    assert q.min() == lo and q.max() == hi
    w = woq.pack_int4(q) if bits == 4 else q
    scales = (2.0 ** -np.arange(n * k // group).reshape(n, k // group)).astype(np.float32)
    b = np.zeros(n, np.float32)
    inputs = [np.eye(k, dtype=np.float32), w, scales, b]
    expected = (q.astype(np.float64) * np.repeat(scales, group, axis=1)).T
    np.testing.assert_array_equal(woq.reference(*inputs), expected)
    for label, mod in _modules(shape, samples=(3,)):
        (got,) = _run(mod, inputs)
        np.testing.assert_array_equal(got, expected, err_msg=label)


@pytest.mark.parametrize("case", list(CASES))
def test_bits_and_groups_match_reference(case):
    shape = CASES[case]
    inputs = woq.make_inputs(shape, "float32", 11)
    assert inputs[1].dtype == (np.uint8 if shape["bits"] == 4 else np.int8)
    expected = woq.PATTERN.run_reference(inputs, shape)
    bounds = woq.PATTERN.check_args(shape, "float32")
    for label, mod in _modules(shape):
        check = compare(_run(mod, inputs), expected, **bounds)
        assert check.ok, f"{label}: {check.message}"


@pytest.mark.parametrize("case", ["int4_group16", "int8_group8"])
def test_onnx_graph_matches_reference(case):
    import onnxruntime as ort
    shape = CASES[case]
    inputs = woq.make_inputs(shape, "float32", 2)
    model = woq.onnx_graph(shape, "float32")
    names = [v.name for v in model.graph.input]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs)))
    np.testing.assert_allclose(got[0], woq.PATTERN.run_reference(inputs, shape)[0], rtol=1e-4, atol=1e-4)


def test_template_keeps_a_tile_of_float_weights():
    # Dequantise on load: after buffer compaction the float weights are a (rows x lanes) tile under
    # the reduction, not the (n, k) copy the unscheduled function holds.
    shape = woq.PATTERN.default_shape()
    mod = woq.dequant_on_load.apply(woq.build(shape, "float32"), TARGET, tunable=False).mod
    t = tvm.s_tir.transform
    mod = tvm.transform.Sequential([t.LowerInitBlock(), t.PlanAndUpdateBufferAllocationLocation(),
                                    t.ConvertBlocksToOpaque(), t.CompactBufferAllocation()])(mod)
    (dims,) = re.findall(r"\bwd = T\.\w*alloc_buffer\(\(([\d, ]+)\)", mod.script())
    assert int(np.prod([int(d) for d in dims.split(",")])) <= 64


def test_bytes_count_packed_weights_and_scales():
    shape = woq.PATTERN.default_shape()
    m, n, k, group = shape["m"], shape["n"], shape["k"], shape["group"]
    int4 = woq.nbytes(shape, "float32")
    assert int4 == n * k // 2 + 4 * n * (k // group) + 4 * (m * k + m * n + n)
    assert woq.nbytes(dict(shape, bits=8), "float32") - int4 == n * k // 2


@pytest.mark.parametrize("bad", [dict(group=24), dict(group=128, k=64), dict(group=3, k=63), dict(bits=5)])
def test_rejects_bad_shapes(bad):
    shape = dict(SMALL, **bad)
    for call in (lambda: woq.build(shape, "float32"), lambda: woq.make_inputs(shape, "float32", 0),
                 lambda: woq.nbytes(shape, "float32")):
        with pytest.raises(ValueError, match="woq_matmul"):
            call()
    # Also an AutofuseError, so the command line reports it in one line.
    with pytest.raises(AutofuseError):
        woq.build(shape, "float32")
