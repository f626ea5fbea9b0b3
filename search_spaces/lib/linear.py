"""y = act(x @ W [+ b]): a linear layer as exported models hold it, W stored (k, n) (torch.onnx
writes nn.Linear on 3-D input as ``MatMul(x, W[k, n]) + Add(b)``), the bias and the activation on
the accumulator tile. What the ``linear*`` patterns share (``Linear``): TensorIR, numpy reference,
seeded inputs, work counts, the ONNX graph of the baselines, CPU and CUDA templates, the Hopper
kernel template and the Relax rule that finds the layer in an imported model. A pattern module
names the activation (``ACTIVATIONS``) and whether there is a bias.

W is read as stored, not transposed: the CPU GEMM then needs no transposing copy of it, and a few
rows (``cpu_gemm.SKINNY_ROWS``; the exported models run 17-32) take the register tile over W as
stored instead of dot products along k with a lane sum per output (32 x 192 x 64 here: 20 us
against 33 us with W (n, k)).

TensorIR: block ``matmul`` accumulates x @ W in float32 into ``acc`` (allocated in the root block,
so a schedule can keep it in registers), block ``epilogue`` writes y = act(acc + b) rounded once;
casts appear only where dtypes differ. GELU's erf and tanh are ``tir_math``'s polynomials, so the
epilogue vectorises on a CPU (LLVM makes ``T.erf`` a scalar libm call per element).

Templates: ``packed_tile`` (``cpu_gemm``: W in panels, or as stored for a few rows; the epilogue on
the register tile) and ``tiled_epilogue`` on a CPU; ``cuda_tiled_epilogue`` (SIMT register tiles
over x and W k-tiles staged through shared memory) and ``cuda_wmma`` (float16 tensor cores) on a
GPU; on sm_90 in float16/bfloat16 the kernel template ``cuda_wgmma`` first (``cuda_wgmma``'s TMA +
wgmma GEMM, B read N-major), and before it at up to 256 rows ``cuda_wgmma_split_k`` (K split among
CTAs, the partials summed with the epilogue by a second kernel).

Relax rule: ``matmul(x, W)`` with W a parameter of the model (a constant, or a graph input where an
exporter keeps weights as inputs; possibly transposed, as a Gemm's transB), so attention's
products of two activations are never taken, then ``+ b`` (b of shape (n,), either
operand order), then the activation as exporters spell it (GELU: Div/Erf/Add/Mul/Mul,
Pow/Mul/Add/Mul/Tanh/..., or ``nn.gelu`` / ``nn.gelu_tanh`` from an ONNX Gelu), with a reshape
allowed between the bias and the activation (GPT-2's Conv1D flattens the rows). x of any rank >= 2:
leading axes are rows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from tvm.script import tirx as T

from autofuse.kernel_templates import KernelTemplate
from autofuse.pattern import FLOAT_DTYPES, RelaxRule, constant_value, dtype_of, onnx_model, static_shape, template
from search_spaces.lib import cuda_wgmma
from search_spaces.lib.cpu_gemm import schedule_gemm
from search_spaces.lib.cpu_rules import PARALLEL_MIN_ELEMENTS
from search_spaces.lib.cuda_gemm import (cuda_fetch_shared, cuda_pipeline, cuda_split_k, cuda_tile_output,
                                         cuda_unroll, cuda_vector_lanes, cuda_wmma_gemm)
from search_spaces.lib.stages import matmul_stage
from search_spaces.lib.tiling import epilogue_on_tile, parallel_register_tile, unroll
from search_spaces.lib.tir_math import erf_f32, tanh_f32

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _gelu_erf(v):
    return T.float32(0.5) * v * (T.float32(1) + erf_f32(v * T.float32(_SQRT_HALF)))


def _gelu_tanh(v):
    return T.float32(0.5) * v * (T.float32(1) + tanh_f32(
        T.float32(_SQRT_2_OVER_PI) * (v + T.float32(_GELU_CUBIC) * v * v * v)))


_erf = np.vectorize(math.erf, otypes=[np.float64])

# name -> (float32 TIR expression -> float32 TIR expression, float64 numpy twin, FLOPs per element).
# The names are ``cuda_wgmma.ACTIVATIONS``'. FLOPs count the formula's operations, erf/tanh as one.
ACTIVATIONS = {
    "none": (lambda v: v, lambda a: a, 0),
    "gelu_erf": (_gelu_erf, lambda a: 0.5 * a * (1.0 + _erf(a * _SQRT_HALF)), 5),
    "gelu_tanh": (_gelu_tanh, lambda a: 0.5 * a * (1.0 + np.tanh(_SQRT_2_OVER_PI * (a + _GELU_CUBIC * a ** 3))), 9),
}


@dataclasses.dataclass(frozen=True)
class Linear:
    """y = act(x @ W [+ b]), x (m, k), W (k, n), b (n,), y (m, n): one pattern's computation.
    Its methods are the pattern module's ``build``, ``reference``, ... (bind them to those names)."""

    name: str           # the pattern's (the PrimFunc's global symbol)
    act: str            # a key of ACTIVATIONS
    bias: bool

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} is not one of {', '.join(ACTIVATIONS)}")

    def build(self, shape, dtype):
        m, n, k = shape["m"], shape["n"], shape["k"]
        act = ACTIVATIONS[self.act][0]
        to_f32 = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast("float32", e))
        to_out = (lambda e: e) if dtype == "float32" else (lambda e: T.Cast(dtype, e))
        # The bias buffer is a parameter only where the pattern has one; the body is the same macro.
        biased = (lambda b, j, v: v + to_f32(b[j])) if self.bias else (lambda b, j, v: v)

        @T.macro
        def body(x, w, b, y):
            acc = T.sblock_alloc_buffer((m, n), "float32")
            matmul_stage("matmul", acc, (m, n, k), lambda i, j, kk: to_f32(x[i, kk]) * to_f32(w[kk, j]))
            for i, j in T.grid(m, n):
                with T.sblock("epilogue"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    # No T.let for the biased value (GELU's polynomials repeat it): TVM 0.27's
                    # bfloat16 legalisation miscomputes a let whose value casts a bfloat16 load.
                    # TIR's CSE shares the repeats again.
                    y[vi, vj] = to_out(act(biased(b, vj, acc[vi, vj])))

        if self.bias:
            @T.prim_func(s_tir=True)
            def func(x: T.Buffer((m, k), dtype), w: T.Buffer((k, n), dtype), b: T.Buffer((n,), dtype),
                     y: T.Buffer((m, n), dtype)):
                T.func_attr({"tirx.noalias": True})
                body(x, w, b, y)
        else:
            @T.prim_func(s_tir=True)
            def func(x: T.Buffer((m, k), dtype), w: T.Buffer((k, n), dtype), y: T.Buffer((m, n), dtype)):
                T.func_attr({"tirx.noalias": True})
                body(x, w, None, y)

        return func.with_attr("global_symbol", self.name)

    def reference(self, x, w, *rest):
        f64 = np.float64
        h = x.astype(f64) @ w.astype(f64)
        if self.bias:
            h = h + rest[0].astype(f64)
        return ACTIVATIONS[self.act][1](h).astype(x.dtype)

    def make_inputs(self, shape, dtype, seed):
        rng = np.random.default_rng(seed)
        m, n, k = shape["m"], shape["n"], shape["k"]
        arrays = [rng.standard_normal((m, k)), rng.standard_normal((k, n)) / np.sqrt(k)]
        if self.bias:
            arrays.append(rng.standard_normal(n))
        # Drawn as float32 and cast: a half-precision run gets the float32 run's inputs, rounded.
        return [a.astype(np.float32).astype(dtype) for a in arrays]

    def flops(self, shape):
        m, n, k = shape["m"], shape["n"], shape["k"]
        return 2.0 * m * n * k + float(m * n * (int(self.bias) + ACTIVATIONS[self.act][2]))

    def nbytes(self, shape, dtype):
        m, n, k = shape["m"], shape["n"], shape["k"]
        return np.dtype(dtype).itemsize * (m * k + k * n + n * int(self.bias) + m * n)

    def onnx_graph(self, shape, dtype):
        """MatMul, Add (the bias), then the activation in opset-17 ops (no Gelu op there), as
        torch.onnx writes nn.Linear and BERT's / GPT-2's GELU."""
        from onnx import helper
        m, n, k = shape["m"], shape["n"], shape["k"]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
        inputs = [("x", (m, k)), ("w", (k, n))]
        if self.bias:
            nodes.append(helper.make_node("Add", ["mm", "b"], ["h"]))
            inputs.append(("b", (n,)))
        h = "h" if self.bias else "mm"
        act_nodes, constants = activation_nodes(self.act, h, "y", dtype)
        if not act_nodes:
            nodes[-1].output[0] = "y"
        return onnx_model(self.name, nodes + act_nodes, inputs, [("y", (m, n))], dtype, constants)

    def relax_rule(self, priority: int) -> RelaxRule:
        """The rule finding this layer in a Relax model (see the module docstring); ``priority``
        below every rule whose match contains it (linear_bias_relu's, swiglu_ffn's), and a larger
        linear one above a smaller (GELU above bias-only above none)."""
        return RelaxRule(f"matmul{'_add' if self.bias else ''}{'' if self.act == 'none' else '_' + self.act}",
                         lambda: _relax_pattern(self.bias, self.act), self._relax_rewrite, priority)

    def _relax_rewrite(self, matched, kernel):
        """x (..., k) @ W (k, n) a weight [+ b (n,)] [-> activation], all of one float dtype, the
        activation's constants its own -> the kernel on x's rows, reshaped back to the root's shape."""
        from tvm import relax
        x, w, root = matched["x"], matched["w"], matched["root"]
        if not _is_parameter(matched["w_source"] if "w_transposed" in matched else matched["w_plain"]):
            return None  # a weight computed at run time: attention's K^T or V
        xs, ws, out = static_shape(x), static_shape(w), static_shape(root)
        if None in (xs, ws, out) or len(xs) < 2 or len(ws) != 2 or xs[-1] != ws[0]:
            return None
        m, (k, n) = int(np.prod(xs[:-1])), ws
        if int(np.prod(out)) != m * n:
            return None
        dtype = dtype_of(x)
        operands = [x, w] + ([matched["b"]] if self.bias else [])
        if dtype not in FLOAT_DTYPES or any(dtype_of(t) != dtype for t in operands + [root]):
            return None
        if self.bias and static_shape(matched["b"]) != (n,):
            return None  # a residual or a broadcast other than per column: not this kernel's bias
        if not _constants_fit(matched):
            return None
        rows = x if len(xs) == 2 else relax.op.reshape(x, (m, k))
        y = kernel({"m": m, "n": n, "k": k}, dtype, [rows, *operands[1:]])
        return y if out == (m, n) else relax.op.reshape(y, out)

    def wgmma_template(self) -> KernelTemplate:
        """The Hopper kernel template (float16/bfloat16 on sm_90, at multiples of its tile)."""
        act, bias = self.act, self.bias

        def wgmma(shape, dtype, knobs):
            """Hopper TMA + mbarrier ring + wgmma GEMM (``search_spaces.lib.cuda_wgmma``), W read
            N-major as stored, bias and activation on the accumulator registers."""
            if bias:
                return cuda_wgmma.gemm_bias_act(shape, dtype, knobs, act, b_layout="kn")
            return cuda_wgmma.gemm_act(shape, dtype, knobs, act, b_layout="kn")

        return KernelTemplate("cuda_wgmma", wgmma, cuda_wgmma.KNOBS, cuda_wgmma.DEFAULT_KNOBS, cuda_wgmma.check,
                              shape_default=cuda_wgmma.fill_tile, **cuda_wgmma.HOPPER)

    def split_k_template(self) -> KernelTemplate:
        """The Hopper kernel template with K split among CTAs (at most 256 rows)."""
        act, bias = self.act, self.bias

        def wgmma_split_k(shape, dtype, knobs):
            """Hopper wgmma GEMM with K split among CTAs (``search_spaces.lib.cuda_wgmma.gemm_split_k``),
            W read N-major as stored, then a kernel summing the float32 partials with the epilogue."""
            return cuda_wgmma.gemm_split_k(shape, dtype, knobs, act, b_layout="kn", bias=bias)

        return KernelTemplate("cuda_wgmma_split_k", wgmma_split_k, cuda_wgmma.SPLIT_K_KNOBS,
                              cuda_wgmma.SPLIT_K_DEFAULT_KNOBS, cuda_wgmma.split_k_check,
                              shape_default=cuda_wgmma.split_k_fill, **cuda_wgmma.HOPPER)

    def templates(self) -> list:
        """Every template, in the order tried."""
        return [packed_tile, tiled_epilogue, self.split_k_template(), self.wgmma_template(), cuda_tiled_epilogue,
                cuda_wmma]


def activation_nodes(act: str, src: str, dst: str, dtype: str):
    """ONNX nodes (opset 17) computing ``dst = act(src)`` and the constants they read."""
    from onnx import helper

    def const(value):
        return np.asarray(value, dtype=dtype)

    def mul(a, b, out):
        return helper.make_node("Mul", [a, b], [out])

    def add(a, b, out):
        return helper.make_node("Add", [a, b], [out])

    if act == "none":
        return [], {}
    if act == "gelu_erf":  # x * (1 + erf(x / sqrt 2)) * 0.5, as BERT's export writes it
        return ([helper.make_node("Div", [src, "sqrt2"], ["scaled"]), helper.make_node("Erf", ["scaled"], ["erf"]),
                 add("erf", "one", "erf1"), mul(src, "erf1", "gx"), mul("gx", "half", dst)],
                {"sqrt2": const(math.sqrt(2.0)), "one": const(1.0), "half": const(0.5)})
    if act == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as GPT-2's export writes it
        return ([helper.make_node("Pow", [src, "three"], ["cube"]), mul("cube", "cubic", "cubic_term"),
                 add(src, "cubic_term", "inner"), mul("inner", "sqrt2_over_pi", "scaled"),
                 helper.make_node("Tanh", ["scaled"], ["tanh"]), mul(src, "half", "half_x"),
                 add("tanh", "one", "tanh1"), mul("half_x", "tanh1", dst)],
                {"three": const(3.0), "cubic": const(_GELU_CUBIC), "sqrt2_over_pi": const(_SQRT_2_OVER_PI),
                 "half": const(0.5), "one": const(1.0)})
    raise ValueError(f"activation {act!r} is not one of {', '.join(ACTIVATIONS)}")


# ---- Relax -----------------------------------------------------------------------------------

# Named constants a GELU match may have bound -> the value each must hold.
_GELU_CONSTANTS = {"sqrt2": math.sqrt(2.0), "rsqrt2": _SQRT_HALF, "one": 1.0, "half": 0.5, "three": 3.0,
                   "cubic": _GELU_CUBIC, "sqrt2_over_pi": _SQRT_2_OVER_PI}


def _is_parameter(expr) -> bool:
    """A model's weight: a constant, or a parameter of the function (ONNX weights kept as graph
    inputs), not a value computed in it."""
    from tvm import ir, relax
    return isinstance(expr, ir.expr.Constant) or (isinstance(expr, relax.Var) and not isinstance(expr, relax.DataflowVar))


def _constants_fit(matched) -> bool:
    for name, value in _GELU_CONSTANTS.items():
        if name in matched:
            found = np.asarray(constant_value(matched[name]), dtype=np.float64)
            if found.size != 1 or not np.isclose(float(found.reshape(())), value, rtol=1e-3, atol=0):
                return False
    return True


def _either(op, a, b):
    """``op(a, b)`` in either operand order."""
    from tvm.relax.dpl import is_op
    return is_op(op)(a, b) | is_op(op)(b, a)


def _relax_pattern(bias: bool, act: str):
    from tvm.relax.dpl import is_const, is_op, wildcard

    named = {"x": wildcard(), "b": wildcard(), "w_source": wildcard(), "w_plain": wildcard()}
    # transposed first: a Var bound to permute_dims also matches the plain wildcard
    named["w_transposed"] = is_op("relax.permute_dims")(named["w_source"])
    named["w"] = named["w_transposed"] | named["w_plain"]
    h = is_op("relax.matmul")(named["x"], named["w"])
    if bias:
        h = _either("relax.add", h, named["b"])
    if act == "none":
        named["root"] = h
        return h, named
    named.update({name: is_const() for name in _GELU_CONSTANTS})
    c = named
    # GPT-2's Conv1D computes on flattened rows and reshapes before the activation
    h = is_op("relax.reshape")(h, wildcard()) | h
    if act == "gelu_erf":
        scaled = is_op("relax.divide")(h, c["sqrt2"]) | _either("relax.multiply", h, c["rsqrt2"])
        gate = _either("relax.add", is_op("relax.erf")(scaled), c["one"])
        fused = is_op("relax.nn.gelu")(h)
    else:
        cube = is_op("relax.power")(h, c["three"])
        inner = _either("relax.add", h, _either("relax.multiply", cube, c["cubic"]))
        gate = _either("relax.add", is_op("relax.tanh")(_either("relax.multiply", inner, c["sqrt2_over_pi"])),
                       c["one"])
        fused = is_op("relax.nn.gelu_tanh")(h)
    # 0.5 * x * gate in any grouping: (x * gate) * 0.5, (x * 0.5) * gate or x * (0.5 * gate) (the
    # dynamo exporter's)
    root = (_either("relax.multiply", _either("relax.multiply", h, gate), c["half"])
            | _either("relax.multiply", _either("relax.multiply", h, c["half"]), gate)
            | _either("relax.multiply", h, _either("relax.multiply", gate, c["half"])) | fused)
    named["root"] = root
    return root, named


# ---- CPU templates ---------------------------------------------------------------------------


@template("packed_tile")
def packed_tile(sch, target, knobs):
    """BLIS-style GEMM (``search_spaces.lib.cpu_gemm``) over W as stored (k, n): W packed into
    NR-column panels, an MR x NR register tile sized from the target's vectors, bias and
    activation on the tile; a few rows of x (decoding, short sequences) read W as stored. Below
    ``cpu_rules.PARALLEL_MIN_ELEMENTS`` multiply-adds on one thread, the CPU rules' bound for a
    kernel too small to wake the thread pool for (32 x 64 x 64, a BERT-mini projection: 2.8 us on
    one thread, 9.1 us on two, here with another job on the 2 cores)."""
    mm = sch.get_sblock("matmul")
    work = math.prod(int(iv.dom.extent) for iv in sch.get(mm).iter_vars)
    schedule_gemm(sch, mm, knobs, target, epilogue_blocks=[sch.get_sblock("epilogue")], weight_read=1,
                  weight_layout="kn", parallel=work >= PARALLEL_MIN_ELEMENTS)


@template("tiled_epilogue")
def tiled_epilogue(sch, target, knobs):
    """Register-blocked GEMM: outer tiles in parallel, K split for cache, vectorised inner N
    (W's contiguous axis), bias and activation applied to the accumulator tile."""
    mm = sch.get_sblock("matmul")
    outer, tile, k0, vec = parallel_register_tile(sch, knobs, mm, [4, 4], [4, 16], 8)
    epilogue_on_tile(sch, mm, sch.get_sblock("epilogue"), tile, k0, vec)
    unroll(sch, knobs, outer)


# ---- CUDA templates --------------------------------------------------------------------------


@template("cuda_tiled_epilogue", target_kinds=("cuda",))
def cuda_tiled_epilogue(sch, target, knobs):
    """Shared-memory tiled GEMM: one block per output tile, x (k contiguous) and W (n contiguous)
    k-tiles staged through shared memory by all threads (software-pipelined through registers),
    each thread a register tile of float32 accumulators over runs of adjacent columns (one vector
    shared load of W per k), bias and activation applied to it on the way out."""
    mm, epi = sch.get_sblock("matmul"), sch.get_sblock("epilogue")
    x, w = (r.source for r in sch.get(mm).reads[-2:])
    dtype, depth, n = str(x.dtype), int(x.shape[1]), int(w.shape[1])
    wide, narrow = cuda_vector_lanes(dtype, n, max_bytes=16), cuda_vector_lanes(dtype, depth)
    sch.set_scope(mm, 0, "local")
    i, j, k = sch.get_loops(mm)
    bx, _, tx, nty, ntx, lane = cuda_tile_output(sch, knobs, i, j, rows=(8, 4), cols=(8, 1), j_lanes=wide)
    (k0,) = cuda_split_k(sch, knobs, [k], narrow)
    if wide > 1:  # the column run innermost, under the whole k loop
        sch.reorder(*sch.get_loops(mm)[-3:], lane)
    sch.reverse_compute_at(epi, tx, preserve_unit_loops=True)
    fetches = [cuda_fetch_shared(sch, mm, 0, k0, (nty, ntx), narrow, k_major=True),
               cuda_fetch_shared(sch, mm, 1, k0, (nty, ntx), wide, k_major=False)]
    if wide > 1:
        sch.vectorize(lane)
    sch.decompose_reduction(mm, k0)
    cuda_unroll(sch, knobs, bx)
    cuda_pipeline(sch, k0, fetches)


@template("cuda_wmma", target_kinds=("cuda",))
def cuda_wmma(sch, target, knobs):
    """float16: tensor cores through TVM's WMMA intrinsics (``lib.cuda_gemm.cuda_wmma_gemm``, W
    row-major, each accumulator fragment staged through shared memory for the epilogue). Other
    dtypes, and sizes not multiples of 16: ``cuda_tiled_epilogue``."""
    if not cuda_wmma_gemm(sch, knobs, "epilogue", trans_b=False):
        cuda_tiled_epilogue.fn(sch, target, knobs)
