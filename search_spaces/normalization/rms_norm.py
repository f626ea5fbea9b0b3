"""rms_norm: h = x + r; y = h / sqrt(mean(h^2) + eps) * w over the last axis; returns both.

RMSNorm with its residual, as Llama-style decoders run it before each sublayer: h is the next
residual stream, y feeds the attention or the FFN. eps = 10^-eps_exp (1e-6 in Llama, 1e-5 in
others). Three sblocks: ``add`` (h), ``sumsq`` (float32 sum of h^2 per row) and ``norm`` (y, rounded
to the dtype once). Unfused, h is written and read back twice and mean(h^2) once more; fused per
row, the passes read the row just written from L1, registers or shared memory. h is an output in
the dtype, so the statistics are taken from the rounded h, as the reference does. Parameters:
x, r, w, h, y.

In models (``--fusion patterns``) the rule takes the decomposition torch.onnx writes for HF's
RMSNorm, TorchScript and dynamo alike: ``Add`` (the residual) [-> ``Cast``] -> ``Pow`` 2 ->
``ReduceMean`` (last axis, keepdims) -> ``Add`` eps -> ``Sqrt`` -> ``Div`` 1 by it or
``Reciprocal`` -> ``Mul`` [-> ``Cast``] -> ``Mul`` by the weight, either operand order; also
x / sqrt(...) and ``rsqrt``. An RMSNorm without a residual add before it (a model's first one) is
left to the auto-fused kernels.
"""

import numpy as np
from tvm.script import tirx as T

from autofuse.pattern import FLOAT_DTYPES, Pattern, RelaxRule, constant_value, dtype_of, onnx_model, static_shape, \
    template
from search_spaces.lib import cpu_rows
from search_spaces.lib import cuda_rows as cuda_rows_lib
from search_spaces.lib.layernorm import ROWS_HIDDEN, eps_exp_of, eps_param
from search_spaces.lib.layernorm import eps_of as _eps_of
from search_spaces.lib.stages import row_sum_stage

def eps_of(shape):
    return _eps_of(shape, 6)


def build(shape, dtype):
    rows, hidden = shape["rows"], shape["hidden"]
    eps = eps_of(shape)

    @T.prim_func(s_tir=True)
    def rms_norm(x: T.Buffer((rows, hidden), dtype), r: T.Buffer((rows, hidden), dtype),
                 w: T.Buffer((hidden,), dtype), h: T.Buffer((rows, hidden), dtype),
                 y: T.Buffer((rows, hidden), dtype)):
        T.func_attr({"global_symbol": "rms_norm", "tirx.noalias": True})
        row_sq = T.sblock_alloc_buffer((rows,), "float32")
        for i, j in T.grid(rows, hidden):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                h[vi, vj] = x[vi, vj] + r[vi, vj]
        row_sum_stage("sumsq", row_sq, (rows, hidden),
                      lambda i, j: T.Cast("float32", h[i, j]) * T.Cast("float32", h[i, j]))
        for i, j in T.grid(rows, hidden):
            with T.sblock("norm"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast(dtype, T.Cast("float32", h[vi, vj])
                                   * T.rsqrt(row_sq[vi] * T.float32(1.0 / hidden) + T.float32(eps))
                                   * T.Cast("float32", w[vj]))

    return rms_norm


def reference(x, r, w, shape):
    h = (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype)
    h64 = h.astype(np.float64)
    y = h64 / np.sqrt((h64 * h64).mean(axis=-1, keepdims=True) + eps_of(shape)) * w.astype(np.float64)
    return h, y.astype(x.dtype)


def make_inputs(shape, dtype, seed):
    """x, r (rows, hidden) unit normal, w ~ 1."""
    rng = np.random.default_rng(seed)
    rows, hidden = shape["rows"], shape["hidden"]
    arrays = [rng.standard_normal((rows, hidden)), rng.standard_normal((rows, hidden)),
              1.0 + 0.1 * rng.standard_normal(hidden)]
    return [a.astype(np.float32).astype(dtype) for a in arrays]


def flops(shape):
    # add 1, sum of squares 2, scale and weight 2 per element.
    return 5.0 * shape["rows"] * shape["hidden"]


def nbytes(shape, dtype):
    rows, hidden = shape["rows"], shape["hidden"]
    return np.dtype(dtype).itemsize * (4 * rows * hidden + hidden)


@template("row_fused")
def row_fused(sch, target, knobs):
    """Rows split and run in parallel; per row the residual add writes h, the sum-of-squares pass
    re-reads it from L1 (vectorised through an rfactor over a lane tile, float32) and the
    vectorised normalise pass writes y (``lib.cpu_rows.residual_norm_rows``)."""
    cpu_rows.residual_norm_rows(sch, knobs, ("sumsq",))


@template("cuda_rows", target_kinds=("cuda",))
def cuda_rows(sch, target, knobs):
    """A warp (short rows) or a block (long rows) per row; x and r loaded with vector loads, the
    row of h kept in registers and stored with vector stores; the sum of squares a cross-thread
    reduction; y written from the registers with vector stores (``lib.cuda_rows``)."""
    cuda_rows_lib.residual_norm_rows(sch, target, knobs, "local", ("sumsq",), ("w",))


@template("cuda_rows_reread", target_kinds=("cuda",))
def cuda_rows_reread(sch, target, knobs):
    """As cuda_rows, but the passes after the add read h back from global memory (each thread the
    elements it stored, so no barrier; L1 hits)."""
    cuda_rows_lib.residual_norm_rows(sch, target, knobs, None, ("sumsq",), ("w",))


def _relax_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    named = {name: wildcard() for name in ("x", "r", "w")}
    named.update(two=is_const(), eps=is_const(), one=is_const())
    named["add"] = is_op("relax.add")(named["x"], named["r"])
    named["cast_in"] = is_op("relax.astype")(named["add"])
    h = named["cast_in"] | named["add"]
    named["mean"] = is_op("relax.mean")(is_op("relax.power")(h, named["two"]))
    var = is_op("relax.add")(named["mean"], named["eps"])
    rms = is_op("relax.sqrt")(var)
    inverse = is_op("relax.divide")(named["one"], rms) | is_op("relax.rsqrt")(var)
    normed = (is_op("relax.multiply")(h, inverse) | is_op("relax.multiply")(inverse, h)
              | is_op("relax.divide")(h, rms))
    named["cast_out"] = is_op("relax.astype")(normed)
    scaled = named["cast_out"] | normed
    root = is_op("relax.multiply")(named["w"], scaled) | is_op("relax.multiply")(scaled, named["w"])
    named["call"] = root
    return root, named


def _relax_rewrite(matched, kernel):
    """The decomposed RMSNorm of a residual sum (see the module docstring) over the last axis: x,
    r of one shape and one of the pattern's dtypes, w (hidden,) of it too; the exponent 2, eps a
    power of ten, the 1 a one; a cast to float32 before the statistics (a half-precision model's)
    and back after is taken as the kernel's float32 statistics. -> the kernel's y, x and r
    flattened to (rows, hidden). As in layernorm_residual, the add stays for its other users."""
    from tvm import relax
    x, r, w = matched["x"], matched["r"], matched["w"]
    shape = static_shape(x)
    dtype = dtype_of(x)
    if shape is None or len(shape) < 1 or static_shape(r) != shape or dtype not in FLOAT_DTYPES:
        return None
    hidden = shape[-1]
    if static_shape(w) != (hidden,) or dtype_of(r) != dtype or dtype_of(w) != dtype:
        return None
    for name, want in (("cast_in", ("float32", dtype)), ("cast_out", (dtype,))):
        if name in matched and str(matched[name].attrs.dtype) not in want:
            return None
    attrs = matched["mean"].attrs
    if [int(a) for a in attrs.axis] not in ([-1], [len(shape) - 1]) or not attrs.keepdims:
        return None
    scalars = {}
    for name in ("two", "eps", "one"):
        if name in matched:
            value = constant_value(matched[name])
            if value.size != 1:
                return None
            scalars[name] = float(value.reshape(()))
    eps_exp = eps_exp_of(scalars["eps"])
    if scalars["two"] != 2.0 or scalars.get("one", 1.0) != 1.0 or eps_exp is None:
        return None
    rows = int(np.prod(shape[:-1]))
    flat = (lambda t: t) if len(shape) == 2 else (lambda t: relax.op.reshape(t, (rows, hidden)))
    out = kernel({"rows": rows, "hidden": hidden, "eps_exp": eps_exp}, dtype, [flat(x), flat(r), w])
    y = relax.TupleGetItem(out, 1)
    return y if len(shape) == 2 else relax.op.reshape(y, shape)


def onnx_graph(shape, dtype):
    """As torch.onnx's TorchScript exporter writes HF's RMSNorm after a residual add."""
    from onnx import helper
    rows, hidden = shape["rows"], shape["hidden"]
    consts = {"two": np.array(2.0, dtype), "eps": np.array(eps_of(shape), dtype), "one": np.array(1.0, dtype)}
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]), helper.make_node("Pow", ["h", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["rms"]),
             helper.make_node("Div", ["one", "rms"], ["inv"]), helper.make_node("Mul", ["h", "inv"], ["normed"]),
             helper.make_node("Mul", ["w", "normed"], ["y"])]
    return onnx_model("rms_norm", nodes, [("x", (rows, hidden)), ("r", (rows, hidden)), ("w", (hidden,))],
                      [("h", (rows, hidden)), ("y", (rows, hidden))], dtype, initializers=consts)


PATTERN = Pattern.from_module(
    globals(),
    description="h = x + r; y = h / sqrt(mean(h^2) + eps) * w over the last axis; outputs h and y",
    shape_params=[*ROWS_HIDDEN, eps_param(6)],
    templates=[row_fused, cuda_rows, cuda_rows_reread],
    num_outputs=2,
    relax_rules=[RelaxRule("residual_rms_norm", _relax_pattern, _relax_rewrite)],
)
