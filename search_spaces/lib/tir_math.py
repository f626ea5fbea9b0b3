"""Scalar TensorIR math the kernels share: a polynomial exp and a rational erf that vectorise (LLVM
lowers ``T.exp``/``T.erf`` on x86 to a scalar libm call per lane), ``fast_math`` putting them in
place of the calls in any kernel, the hashed dropout mask (the TIR keep test and its numpy twin),
and dtype sizes."""

import numpy as np
import tvm_ffi
from tvm import DataType, ir, tirx

from autofuse.pattern import ShapeParam

DROPOUT_P = 0.1               # the patterns' default dropout probability
DROPOUT_SEED = 42             # and the mask seed of their kernels
_GOLDEN = 0x9E3779B9          # seed spreading constant (2**32 / golden ratio)
_FMIX_C1 = 0x85EBCA6B         # murmur3 fmix32 multipliers
_FMIX_C2 = 0xC2B2AE35

# Cephes expf: exp(x) = 2**n * e**f, n = round(x*log2(e)), |f| <= ln2/2, e**f a degree-7 polynomial.
_LOG2E = 1.44269504088896341
_LN2 = 0.6931471805599453
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)

# erf(x) ~ x * P(x^2) / Q(x^2) on [-4, 4], highest power first (topi.fast_erf's coefficients).
_ERF_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
              -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
              -1.60960333262415e-02)
_ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
             -7.37332916720468e-03, -1.42647390514189e-02)


def dtype_bytes(dtype) -> int:
    return DataType(str(dtype)).bits // 8


def exp_f32(v):
    """exp(v) for float32 v <= 0 as plain arithmetic, so a vectorised loop stays vectorised: the
    polynomial of topi's ``fast_exp`` (relative error below 3.1e-7 on [-87, 0]). v is clamped below
    at -87, where 2**n is still a normal float (topi's -88.376 can round n + 127 to -1 under
    another FMA contraction), so anything lower gives exp(-87) ~ 1.6e-38."""
    f32 = "float32"
    # Plain sub-expressions rather than Let bindings: MetaSchedule's FLOP estimator has no rule for
    # a Let expression; TIR's CSE pass shares the repeats again.
    x = tirx.max(tirx.min(v, tirx.const(88.3762626647950, f32)), tirx.const(-87.0, f32))
    n = tirx.floor(x * tirx.const(_LOG2E, f32) + tirx.const(0.5, f32))
    f = x - n * tirx.const(_LN2, f32)
    poly = tirx.const(_EXP_POLY[0], f32)
    for c in _EXP_POLY[1:]:
        poly = poly * f + tirx.const(c, f32)
    poly = poly * f * f + f + tirx.const(1.0, f32)
    two_n = tirx.reinterpret(f32, tirx.Cast("int32", n + tirx.const(127.0, f32)) << tirx.const(23, "int32"))
    return two_n * poly


def erf_f32(v):
    """erf(v) for float32 as one vectorisable expression: the clamped rational approximation of
    ``topi.fast_erf`` (Eigen's), max abs error 4.4e-7 against ``math.erf``."""
    c = tirx.max(tirx.min(v, tirx.const(4.0, "float32")), tirx.const(-4.0, "float32"))
    c2 = c * c
    p = tirx.const(_ERF_ALPHA[0], "float32")
    for a in _ERF_ALPHA[1:]:
        p = c2 * p + tirx.const(a, "float32")
    q = tirx.const(_ERF_BETA[0], "float32")
    for b in _ERF_BETA[1:]:
        q = c2 * q + tirx.const(b, "float32")
    return c * p / q


def tanh_f32(v):
    """tanh(v) = sign(v) (1 - e) / (1 + e), e = exp(-2|v|) <= 1 (``exp_f32``'s range)."""
    e = exp_f32(tirx.const(-2.0, "float32") * tirx.abs(v))
    t = (tirx.const(1.0, "float32") - e) / (tirx.const(1.0, "float32") + e)
    return tirx.Select(v < tirx.const(0.0, "float32"), -t, t)


def sigmoid_f32(v):
    """1 / (1 + exp(-v)) through e = exp(-|v|) <= 1: 1 / (1 + e) for v >= 0, e / (1 + e) below."""
    e = exp_f32(-tirx.abs(v))
    one = tirx.const(1.0, "float32")
    return tirx.Select(v < tirx.const(0.0, "float32"), e, one) / (one + e)


# float32 calls fast_math replaces, by TIR op name.
_VECTORISABLE = {"tirx.exp": exp_f32, "tirx.erf": erf_f32, "tirx.tanh": tanh_f32, "tirx.sigmoid": sigmoid_f32}


def _small_power(base, exponent):
    """base ** 2, 3 or 4 as multiplications (GELU's x^3, RMSNorm's x^2), or None for any other
    exponent (left to powf)."""
    if not isinstance(exponent, tirx.FloatImm) or exponent.value not in (2.0, 3.0, 4.0):
        return None
    result = base
    for _ in range(int(exponent.value) - 1):
        result = result * base
    return result


def _rewrite(mod, replace):
    if isinstance(mod, tirx.PrimFunc):
        return tvm_ffi.structural_map(mod, (ir.expr.Call, replace))
    return ir.IRModule({gv: (tvm_ffi.structural_map(f, (ir.expr.Call, replace)) if isinstance(f, tirx.PrimFunc) else f)
                        for gv, f in mod.functions_items()}, attrs=mod.attrs)


def fast_math(mod):
    """``mod`` (an IRModule or a PrimFunc) with every float32 ``exp``, ``erf``, ``tanh`` and
    ``sigmoid`` call replaced by its polynomial above, and ``pow`` by 2, 3 or 4 by products, so
    that a vectorised loop around it stays vectorised (exp's relative error 3.1e-7 below 88.37, inf from there where libm still gives
    up to 3.4e38; erf's absolute error 4.4e-7). Applied before building whatever runs
    autofuse's kernels on a CPU; a kernel's reference (its TensorIR as written) keeps libm."""
    ops = {ir.Op.get(name): fn for name, fn in _VECTORISABLE.items()}
    power = ir.Op.get("tirx.pow")

    def replace(call):
        op = call.op
        if isinstance(op, ir.Op) and str(call.ty) == "float32":
            for known, fn in ops.items():
                if op.same_as(known):
                    return fn(call.args[0])
            if op.same_as(power):
                product = _small_power(*call.args)
                return call if product is None else product
        return call

    return _rewrite(mod, replace)


def exact_powers(mod):
    """``mod`` with ``pow`` by 2, 3 or 4 as products in every float dtype. TVM compiles CUDA with
    --use_fast_math, where powf(x, y) is exp2(y * log2(x)): NaN for any negative x, so RMSNorm's
    x^2 came out NaN for half its inputs."""
    power = ir.Op.get("tirx.pow")

    def replace(call):
        if isinstance(call.op, ir.Op) and call.op.same_as(power) and str(call.ty).startswith(("float", "bfloat")):
            product = _small_power(*call.args)
            return call if product is None else product
        return call

    return _rewrite(mod, replace)


def seed_mix(seed):
    return (int(seed) * _GOLDEN) & 0xFFFFFFFF


def dropout_threshold(p):
    """The keep threshold of the top 24 hash bits for dropout probability ``p``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")
    return int(round(p * (1 << 24)))


def _mul_wrap(a, c):
    """a * c mod 2**32 for a uint32 expression a. TVM emits a uint32 multiply as LLVM ``mul nuw``,
    so a wrapping multiply is poison and LLVM may fold the keep test to a constant; the product of
    the zero-extended operands cannot wrap in 64 bits, and LLVM narrows it back to a 32-bit mul."""
    return tirx.Cast("uint32", tirx.Cast("uint64", a) * tirx.const(c, "uint64"))


def hash_keep(flat_index, mix: int, thresh: int):
    """The dropout keep test in TIR: murmur3's fmix32 of ``uint32(flat_index) ^ mix``, kept when its
    top 24 bits reach ``thresh``. Wrapping uint32 arithmetic, so ``dropout_mask`` agrees bit for bit."""
    h0 = tirx.Cast("uint32", flat_index) ^ tirx.const(mix, "uint32")
    h1 = _mul_wrap(h0 ^ (h0 >> tirx.const(16, "uint32")), _FMIX_C1)
    h2 = _mul_wrap(h1 ^ (h1 >> tirx.const(13, "uint32")), _FMIX_C2)
    h3 = h2 ^ (h2 >> tirx.const(16, "uint32"))
    return (h3 >> tirx.const(8, "uint32")) >= tirx.const(thresh, "uint32")


def dropout_mask(rows, cols, p=DROPOUT_P, seed=DROPOUT_SEED):
    """The keep mask (bool, rows x cols) ``hash_keep`` computes over row-major flat indices, in numpy."""
    h = np.arange(rows * cols, dtype=np.uint32).reshape(rows, cols) ^ np.uint32(seed_mix(seed))
    h = (h ^ (h >> np.uint32(16))) * np.uint32(_FMIX_C1)
    h = (h ^ (h >> np.uint32(13))) * np.uint32(_FMIX_C2)
    h = h ^ (h >> np.uint32(16))
    return (h >> np.uint32(8)) >= np.uint32(dropout_threshold(p))


# The dropout patterns' shape parameter: p in 1/1000, an integer as every shape value is.
DROPOUT_PERMILLE = ShapeParam("p_permille", round(DROPOUT_P * 1000), round(DROPOUT_P * 1000),
                              "dropout probability in 1/1000 (0: inference)", minimum=0)


def dropout_p(shape):
    """The dropout probability of the shape parameter ``p_permille`` (DROPOUT_P when absent)."""
    return shape.get(DROPOUT_PERMILLE.name, DROPOUT_PERMILLE.default) / 1000.0


def dropout_constants(p, seed, rows, cols):
    """(seed mix, keep threshold, 1 / (1 - p)) baked into a kernel masking a rows x cols output,
    whose row-major flat index ``hash_keep`` takes must fit int32."""
    if rows * cols >= 1 << 31:
        raise ValueError(f"{rows} x {cols} does not fit the int32 flat index the dropout mask hashes")
    return seed_mix(seed), dropout_threshold(p), 1.0 / (1.0 - p)
