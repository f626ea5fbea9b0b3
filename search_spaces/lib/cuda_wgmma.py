"""Hopper (sm_90a) tensor-core GEMM kernels: C = act(A @ B^T [+ bias]), the SwiGLU pair, a grouped
GEMM, a GEMM with an elementwise epilogue on a residual, an int8 GEMM with a dequantising epilogue,
and a GEMM on int4/int8 weights dequantised in shared memory.

TVM 0.27's schedule primitives reach the H200's tensor cores only through WMMA / mma.sync, far from
cuBLAS; the H200 needs TMA bulk copies into swizzled shared memory, mbarrier rings and asynchronous
warpgroup MMAs (wgmma), which the tirx script can express. So these are kernel templates: functions
``(shape, dtype, knobs) -> PrimFunc`` written in the tirx script, built with
``tvm.compile(IRModule, target=TARGET, tir_pipeline="tirx")`` (``build``).

Operands: A (M, K), B (N, K) (both K-major, as a linear layer's x and W), bias (N,), C (M, N); float16
or bfloat16 in and out, float32 accumulation, the epilogue in float32 and C rounded once. B may also
be stored (K, N) (``b_layout="kn"``, the weight of ``x @ W``): it is then loaded in BN/64 boxes of BK
rows x 64 columns and read by wgmma N-major (its transpose flag), so no transposed copy is made.

The kernel. Each CTA computes one BM x BN tile of C with ``warpgroups`` consumer warpgroups of
128 threads, BM = 64 per warpgroup. BK-wide K slices of A and B come by TMA copies (128-byte
swizzle) into a ring of ``stages`` shared-memory slots, each with a "full" mbarrier that completes
when the slot's bytes have landed. For every K slice each warpgroup waits on the slot's barrier
and issues BK/16 ``wgmma.mma_async m64nBNk16`` reading its 64 rows of A and all BN rows of B from
shared memory into BN/2 float32 accumulator registers per thread. Who loads, and how a slot is
freed, is the ``specialised`` knob:

- 0, one role: the warpgroups compute, thread 0 also loads. ``wait_depth`` 1 keeps the slice's
  wgmma group in flight while the CTA syncs (``__syncthreads``) and thread 0 refills the slot of
  the previous slice (retired by then in every warpgroup); 0 retires each group before its own
  slot is refilled.
- 1, warp-specialised (FlashAttention-3's and CUTLASS's layout): one more warpgroup, the
  producer, whose thread 0 issues the TMA copies of every slice, each into slot kt % stages once
  the slot's "empty" mbarrier says the consumers are done with its previous slice (no wait on the
  first pass over the ring). The consumer warpgroups never sync with each other: after issuing a
  slice's wgmmas and waiting for all but ``wait_depth`` groups, one thread of each arrives on the
  empty barrier of the slice whose group has retired (the previous slice at depth 1), which
  completes once all ``warpgroups`` have arrived. Slice kt is phase kt // stages of its slot's
  barriers, so the consumers wait for parity (kt // stages) % 2 on "full" and the producer,
  refilling, for parity (kt // stages - 1) % 2 on "empty". With two consumer warpgroups the
  producer gives its registers to them (setmaxnreg 40 / 232 of the 168 each of 384 threads
  starts with, the launch bounds saying one CTA per SM so that ptxas keeps them). The epilogue
  runs in the consumers.

The epilogue (bias, activation, cast) runs on the accumulator registers and stores C directly, a
thread's two adjacent columns of a row (accumulators i, i + 1) as one 4-byte word (two halves;
8 bytes for float32 C). ``raster`` orders the tiles: 1, along the row of tiles (the grid's x is
the column tile); 8, Triton's grouped order, the CTAs walking down 8 tile-rows before moving one
tile-column on, so that the CTAs resident at once share B's column tiles in L2.

Knobs (``KNOBS``; ``DEFAULT_KNOBS`` is the configuration measured best or within 2% of it at
4096^3, 8192^3, 4096 x 11008 x 4096 and the SwiGLU pair on an H100 (README), and ``fill_tile``
shrinks its tile where it would leave SMs idle):
``block_n`` BN (64, 128 or 256: the wgmma N), ``warpgroups`` (1 or 2 consumer warpgroups: BM 64
or 128), ``stages`` (ring depth, 2-5; 2-7 for int8), ``block_k`` BK (64 only: one 128-byte swizzle
row of 2-byte elements per TMA box; 128 for int8), ``wait_depth`` (0 or 1), ``specialised`` (0 or
1; the empty barriers take 8 bytes a slot more), ``raster`` (1 or 8). A configuration needs M % BM
== N % BN == K % BK == 0 and at most ``SHARED_MEMORY_LIMIT`` bytes of shared memory; anything else
raises ValueError (callers fall back).

``swiglu`` computes out = silu(A @ Wg^T) * (A @ Wu^T): both weight tiles of a slice share the A tile
and its barrier, and each warpgroup issues two wgmmas per k step into two accumulators; BN at most
128 so that both (64 float32 registers each) fit where one BN 256 accumulator does.

``grouped_gemm_act`` is a grouped GEMM (a mixture of experts' expert GEMMs): B is several weights
stacked, A's rows come in groups of whole row tiles, and a table names each tile's group, whose
weight its TMA copies of B start at; a tile of no group (-1) does nothing. ``batched_gemm`` is
GEMMs of one shape stacked (every head's scores): three-dimensional tensor maps (batch, row,
column), so a batch's rows and columns need not be whole tiles (TMA fills the copies past them
with zeros and clips the stores), and the product scaled.

``gemm_split_k`` is ``gemm_bias_act`` for skinny GEMMs (``SPLIT_K_MAX_M`` rows at most): K is split
among ``split_k`` CTAs per tile, so that one wave of large tiles fills the SMs instead of many
small tiles each streaming all of K; each CTA stores its float32 partial into a workspace, and a
second kernel (launched dependent on the first) adds them in order, applies the bias and the
activation and rounds once.

``gemm_residual`` computes C = epilogue(A @ B^T, R) elementwise with R (M, N): a residual add by
default, or any float32 expression of the accumulator, R's element and its (row, column) (a down
projection's dropout mask and residual, say).

``gemm_int8_dequant`` is the kernel on int8 operands (a quantised linear layer): y = [relu](float32(
x_q @ w_q^T) * (x_scale * w_scale) + b), y float32. A 128-byte swizzle row is then 128 elements (BK
128, ``INT8_KNOBS``), a k step of ``wgmma ... m64nNk32.s32.s8.s8`` is 32 elements (still 32 bytes
along the descriptors), and the accumulators are int32 in uint32 registers, read as int32 by the
epilogue. int8 wgmma reads both operands K-major (no transpose flag), so B is (N, K) only. TVM
0.27 registers the s8 wgmma up to N 224, so a BN 256 tile issues two m64n128k32 per k step, into
the two halves of the accumulators (the m64n256 fragment's column order).

``gemm_woq`` is the weight-only-quantised linear layer, y = x @ dequant(W)^T + b with W int8 or
packed int4 and a float32 scale per row and group of k. Its producer warpgroup (always specialised)
TMA-loads W's raw bytes into a ring of their own, a slice ahead of need, and x's tile; all 128 of
its threads then turn a raw slice into wgmma's operand: 8 values at a time, q * scale in float32
rounded to the dtype, stored as one 16-byte chunk where TMA's 128-byte swizzle would have put it,
then fence.proxy.async and an arrival on the slot's full barrier (129 arrivals: theirs and thread
0's expect_tx for x's bytes). The roles swap: W dequantised is wgmma's A (64 features a consumer
warpgroup), x is B and the tokens are wgmma's N (``block_n`` from 16, a decode batch), so each
consumer holds a features x tokens tile of y^T and stores y element by element. Its knob
``dequant_first`` 1 instead dequantises W once into a workspace (``dequantise_weights``) and runs
``gemm_bias_act`` at that GEMM's own default tile, two kernels in one PrimFunc: where many token
tiles would each dequantise the same W.

Functions carry ``autofuse.tirx`` = True (a mixed Relax pipeline sends them through the tirx
lowering) and ``tirx.is_scheduled`` = True (dlight leaves them alone).
"""

from __future__ import annotations

import itertools
import math

import tvm
from tvm.script import tirx as T

TARGET = {"kind": "cuda", "arch": "sm_90a"}
# Where the Hopper kernels apply, as ``autofuse.kernel_templates.KernelTemplate`` takes it: an sm_90 GPU; they
# are compiled for sm_90a (wgmma and TMA are its arch-specific instructions).
HOPPER = {"target_kinds": ("cuda",), "archs": ("sm_90", "sm_90a"), "build_arch": "sm_90a"}
SHARED_MEMORY_LIMIT = 227 * 1024  # the H100/H200 per-block opt-in maximum of dynamic shared memory
SM_SHARED_MEMORY = 228 * 1024     # an SM's shared memory, which its resident CTAs share (1 KiB each reserved)
SM_COUNT = 132                    # streaming multiprocessors of an H100 SXM / H200
# A wave of CTAs whose SMs are less busy than this gets smaller tiles by default (``fill_tile``)
WAVE_FILL_MIN = 0.75


# Register pins: an empty asm that reads and writes one register. NVVM moves arithmetic across the
# wgmma wait asm (it sees no operands there), and ptxas then serialises every wgmma of the kernel
# (C7514) for an accumulator read before its wait; a pin after the wait holds those reads behind it
# (CUTLASS's warpgroup_fence_operand). TVM's own cuda.wgmma_noop_barrier takes its register by value.
_PIN_TYPES = {"float32": ("float", "f"), "uint32": ("uint32_t", "r")}


def _register_pins() -> None:
    from tvm.backend.cuda.codegen.schema import device_intrinsic
    from tvm.tirx import CallEffectKind

    for dtype, (ctype, constraint) in _PIN_TYPES.items():
        name = f"autofuse_pin_{dtype}"
        device_intrinsic(name, helper_name=name, c_signature=f"({ctype}& reg)",
                         body=f'    asm volatile("" : "+{constraint}"(reg) :: "memory");')
        # opaque: kept, and never moved across other calls
        tvm.ir.register_op_attr(f"tirx.{name}", "TCallEffectKind", CallEffectKind.Opaque.value)


_register_pins()


@T.macro
def pin_registers(regs, count, dtype):
    """Pin regs[0 .. count) (a local buffer of float32 or uint32) at this point of the program."""
    for i in T.unroll(count):
        T.evaluate(T.call_intrin("", "tirx.autofuse_pin_" + dtype, regs[i]))


KNOBS = {"block_n": (64, 128, 256), "warpgroups": (1, 2), "stages": (2, 3, 4, 5), "block_k": (64,),
         "wait_depth": (0, 1), "specialised": (0, 1), "raster": (1, 8)}
DEFAULT_KNOBS = {"block_n": 256, "warpgroups": 2, "stages": 4, "block_k": 64, "wait_depth": 1, "specialised": 1,
                 "raster": 8}
SWIGLU_KNOBS = {**KNOBS, "block_n": (64, 128)}
SWIGLU_DEFAULT_KNOBS = {**DEFAULT_KNOBS, "block_n": 128}
# int8 operands: a 128-byte swizzle row is 128 elements, so BK 128; a slot of the 128 x 256 tile is
# then 48 KiB as in float16, and the deeper rings fit only the smaller tiles
INT8_KNOBS = {**KNOBS, "stages": (2, 3, 4, 5, 6, 7), "block_k": (128,)}
# int8: the one-role kernel until the specialised one is measured on int8
INT8_DEFAULT_KNOBS = {**DEFAULT_KNOBS, "block_k": 128, "specialised": 0}

# wgmma operand type per storage dtype: the float kernels', and the int8 GEMM's
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
INT8_DTYPES = {"int8": "s8"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "int8": 1}
# The widest N of TVM 0.27's s8 wgmma (its table, ``_WGMMA_N_S8``, stops at 224 although ptxas takes
# 256): a BN 256 int8 tile is two m64n128k32 per k step, side by side in the accumulators.
_INT8_MMA_N_MAX = 224
# How B is stored: "nk" (N, K), K-major, a linear layer's W; "kn" (K, N), N-major, W as x @ W takes it.
B_LAYOUTS = ("nk", "kn")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)


def _silu(x):
    return x / (T.float32(1) + T.exp(-x))


# Epilogue activations on a float32 expression.
ACTIVATIONS = {
    "none": lambda x: x,
    "relu": lambda x: T.max(x, T.float32(0)),
    "gelu_tanh": lambda x: T.float32(0.5) * x * (T.float32(1) + T.tanh(
        T.float32(_SQRT_2_OVER_PI) * (x + T.float32(0.044715) * x * x * x))),
    "gelu_erf": lambda x: T.float32(0.5) * x * (T.float32(1) + T.erf(x * T.float32(_SQRT_HALF))),
    "silu": _silu,
}


def _activation(act: str):
    """The epilogue activation ``act`` (a key of ``ACTIVATIONS``); ValueError for any other."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


# setmaxnreg of the specialised kernel, (producer, consumers) per thread, by consumer warpgroups:
# with two, 128 x 40 + 256 x 232 = 384 x 168, the registers a thread of 384 starts with (CUTLASS's
# warp-specialised GEMM). A consumer warpgroup alone has 256 threads' share, more than it needs,
# so it starts with what ptxas gives it and nothing moves.
SPECIALISED_REGISTERS = {2: (40, 232)}

_SWIZZLE_128B = 3  # CUtensorMapSwizzle and the wgmma descriptor's layout code for 128-byte swizzle
_TMA_LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
_TMA_STORE = "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group"
_TMA_LOAD_3D = "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
_TMA_STORE_3D = "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group"


def resolve_knobs(knobs: dict | None, space: dict = KNOBS, default: dict = DEFAULT_KNOBS) -> dict:
    """``knobs`` over ``default``, every value checked against ``space``."""
    out = dict(default)
    for name, value in (knobs or {}).items():
        if name not in space:
            raise ValueError(f"unknown knob {name!r}; knobs are {', '.join(space)}")
        out[name] = value
    for name, value in out.items():
        if value not in space[name]:
            raise ValueError(f"knob {name}={value!r} is not one of {list(space[name])}")
    return out


def tile_shape(knobs: dict) -> tuple[int, int, int]:
    """(BM, BN, BK) of a CTA."""
    return 64 * knobs["warpgroups"], knobs["block_n"], knobs["block_k"]


def slot_bytes(knobs: dict, dtype: str = "float16", weights: int = 1) -> int:
    """Operand bytes of one ring slot (one k slice): the A tile and ``weights`` B tiles of ``dtype``."""
    bm, bn, bk = tile_shape(knobs)
    return (bm + weights * bn) * bk * _ITEMSIZE[dtype]


def shared_memory_bytes(knobs: dict, dtype: str = "float16", weights: int = 1) -> int:
    """Dynamic shared memory of a configuration: the ring of slots, plus a barrier per slot ("full"),
    and with ``specialised`` a second one ("empty"); with ``tma_store`` the C tile (2-byte
    elements) staged for its bulk copy out."""
    barriers = 2 if knobs.get("specialised", 0) else 1
    bm, bn, _ = tile_shape(knobs)
    staged = bm * bn * 2 if knobs.get("tma_store", 0) else 0
    return knobs["stages"] * (slot_bytes(knobs, dtype, weights) + 8 * barriers) + staged


def check(shape: dict, dtype: str, knobs: dict | None = None, *, space: dict = KNOBS,
          default: dict = DEFAULT_KNOBS, weights: int = 1, dtypes: dict = DTYPES) -> tuple[int, int, int, dict]:
    """(m, n, k, resolved knobs) when the kernel can compute ``shape`` ({"m", "n", "k"}) with
    operands in ``dtype`` (one of ``dtypes``) and ``knobs``; ValueError saying why not otherwise."""
    if dtype not in dtypes:
        raise ValueError(f"wgmma kernels take {' or '.join(dtypes)}, not {dtype}")
    knobs = resolve_knobs(knobs, space, default)
    if knobs["block_k"] * _ITEMSIZE[dtype] != 128:
        raise ValueError(f"block_k={knobs['block_k']} of {dtype} is not one 128-byte swizzle row")
    try:
        m, n, k = (int(shape[key]) for key in ("m", "n", "k"))
    except (KeyError, TypeError):
        raise ValueError(f"shape needs integer m, n, k; got {shape!r}") from None
    bm, bn, bk = tile_shape(knobs)
    for name, size, tile in (("m", m, bm), ("n", n, bn), ("k", k, bk)):
        if size <= 0 or size % tile:
            raise ValueError(f"{name}={size} is not a positive multiple of the tile's {tile} "
                             f"(block_n={knobs['block_n']}, warpgroups={knobs['warpgroups']}, block_k={bk})")
    if m * n >= 1 << 31 or max(m, n) * k >= 1 << 31:
        raise ValueError(f"m={m}, n={n}, k={k}: operands over 2^31 elements (int32 indices)")
    smem = shared_memory_bytes(knobs, dtype, weights)
    if smem > SHARED_MEMORY_LIMIT:
        raise ValueError(f"{smem} bytes of shared memory (stages={knobs['stages']}, tile {bm}x{bn}x{bk}) "
                         f"exceed the {SHARED_MEMORY_LIMIT} a CTA may have")
    return m, n, k, knobs


def configs(shape: dict, dtype: str, space: dict = KNOBS, default: dict = DEFAULT_KNOBS,
            weights: int = 1, dtypes: dict = DTYPES) -> list[dict]:
    """Every configuration of ``space`` that ``check`` accepts for ``shape``, in product order."""
    out = []
    for values in itertools.product(*space.values()):
        knobs = dict(zip(space, values))
        try:
            check(shape, dtype, knobs, space=space, default=default, weights=weights, dtypes=dtypes)
        except ValueError:
            continue
        out.append(knobs)
    return out


def wave_fill(ctas: int, sms: int = SM_COUNT) -> float:
    """Busy fraction of the SM slots over the waves ``ctas`` CTAs (one per SM at a time) take."""
    return ctas / (-(-ctas // sms) * sms)


def fill_tile(shape: dict, dtype: str, space: dict = KNOBS, default: dict = DEFAULT_KNOBS, weights: int = 1,
              dtypes: dict = DTYPES) -> dict:
    """Knobs over ``default`` for ``shape``: ``default`` itself unless its tile leaves the GPU's SMs
    idle (``wave_fill`` under ``WAVE_FILL_MIN``, e.g. 16 CTAs of 128 x 256 at m = 128, n = 4096) or
    does not divide the shape; then the largest tile (BM x BN, wider BN first) that fills them, or
    else the one with the most CTAs; a tile of half the default's bytes per k slice or fewer with
    the deepest ring that fits. ``default`` where no tile ``check``s."""
    tiles = []  # (fills the SMs, BM x BN, BN, knobs) of every tile that computes the shape
    for block_n, warpgroups in itertools.product(space["block_n"], space["warpgroups"]):
        option = {**default, "block_n": block_n, "warpgroups": warpgroups}
        if warpgroups not in SPECIALISED_REGISTERS:
            option["specialised"] = 0  # one consumer warpgroup: the one-role kernel, the one measured
        try:
            m, n, _, _ = check(shape, dtype, option, space=space, default=default, weights=weights, dtypes=dtypes)
        except ValueError:
            continue
        fills = wave_fill(m // (64 * warpgroups) * (n // block_n)) >= WAVE_FILL_MIN
        if option == default and fills:
            return dict(default)
        tiles.append((fills, 64 * warpgroups * block_n, block_n, option))
    if not tiles:
        return dict(default)
    filling = [t for t in tiles if t[0]]
    chosen = (max(filling, key=lambda t: t[1:3]) if filling else min(tiles, key=lambda t: (t[1], -t[2])))[3]
    if 2 * slot_bytes(chosen, dtype, weights) > slot_bytes(default, dtype, weights):
        return dict(chosen)
    # A slot of half the default's bytes or less: the deepest ring that fits keeps as many bytes in
    # flight (m = 128, n = k = 4096, 64 x 64 on an H100: 5 stages 0.033 ms, 4 stages 0.036), among
    # those whose CTAs take the fewest waves with as many resident per SM as their shared memory
    # allows (m = 128, n = 11008: 344 CTAs; 5 stages, 2 a SM, two waves 0.060 ms; 4 stages, 3, one 0.048)
    fitting = []
    for stages in space["stages"]:
        try:
            m, n, _, knobs = check(shape, dtype, {**chosen, "stages": stages}, space=space, default=default,
                                   weights=weights, dtypes=dtypes)
        except ValueError:
            continue
        bm, bn, _ = tile_shape(knobs)
        resident = SM_COUNT * max(1, SM_SHARED_MEMORY // (shared_memory_bytes(knobs, dtype, weights) + 1024))
        fitting.append((-(-(m // bm * (n // bn)) // resident), -stages, knobs))
    return dict(min(fitting, key=lambda t: t[:2])[2]) if fitting else dict(chosen)


def _tensor_map_args(rows: int, cols: int, box_rows: int, box_cols: int, itemsize: int = 2) -> list[int]:
    """cuTensorMapEncodeTiled's arguments after (map, dtype, rank, pointer) for a row-major
    (rows, cols) matrix of ``itemsize``-byte elements read in (box_rows, box_cols) boxes: dims and
    box innermost first."""
    return [cols, rows, cols * itemsize, box_cols, box_rows, 1, 1, 0, _SWIZZLE_128B, 0, 0]


def _batched_map_args(batches: int, rows: int, cols: int, box_rows: int, box_cols: int) -> list[int]:
    """``_tensor_map_args`` of ``batches`` row-major (rows, cols) matrices of 2-byte elements stacked,
    read in (1, box_rows, box_cols) boxes."""
    return [cols, rows, batches, cols * 2, rows * cols * 2, box_cols, box_rows, 1, 1, 1, 1, 0, _SWIZZLE_128B, 0, 0]


def _b_operand(n: int, k: int, knobs: dict, weights: int, b_layout: str, itemsize: int = 2):
    """(shape of the B ring in shared memory, tensor-map arguments of one weight, the wgmma
    descriptor's leading byte offset in 16-byte units, transpose flag) for B stored as
    ``b_layout``. "nk": one BN x BK box per weight and slot, K-major (offset unused: 1). "kn": BN/64
    boxes of BK rows x 64 columns per weight and slot, N-major (trans-b), the leading offset one box;
    a k step of 16 is 16 rows further."""
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout {b_layout!r} is not one of {', '.join(B_LAYOUTS)}")
    _, bn, bk = tile_shape(knobs)
    if b_layout == "nk":
        return (knobs["stages"], weights * bn, bk), _tensor_map_args(n, k, bn, bk, itemsize), 1, 0
    return (knobs["stages"], weights * bn // 64, bk, 64), _tensor_map_args(k, n, bk, 64), bk * 64 * 2 // 16, 1


# The pipelined main loops shared by the kernels. Not hygienic: they read the names of the kernel
# body they are expanded in (tensor maps, shared buffers, accumulators, block and thread indices)
# and the configuration constants that each kernel binds with T.meta_var before expanding them.
@T.macro(hygienic=False)
def _main_loop():
    # every warpgroup computes; thread 0 also loads, and a CTA-wide barrier per slice frees a slot
    if tx == 0:
        for s in T.unroll(STAGES):
            T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(1))
    T.ptx.fence.proxy.async_.shared__cta()
    T.cuda.cta_sync()
    if tx == 0:
        for s in T.unroll(PROLOGUE):
            _load_slice(s, s)
    _zero_accumulators()
    for kt in T.serial(KT):
        T.cuda.mbarrier_wait(T.address_of(bars[kt % STAGES]), kt // STAGES % 2)
        _issue_slice(kt)
        if WAIT_DEPTH == 1:
            # slice kt's group stays in flight; slice kt-1's has retired in every warpgroup once
            # all have passed the barrier, so its slot takes slice kt-1+STAGES
            T.ptx.wgmma.wait_group.sync.aligned(1)
            T.cuda.cta_sync()
            if tx == 0:
                if kt >= 1 and kt - 1 + STAGES < KT:
                    _load_slice((kt - 1) % STAGES, kt - 1 + STAGES)
        else:
            T.ptx.wgmma.wait_group.sync.aligned(0)
            T.cuda.cta_sync()
            if tx == 0:
                if kt + STAGES < KT:
                    _load_slice(kt % STAGES, kt + STAGES)
    T.ptx.wgmma.wait_group.sync.aligned(0)


@T.macro(hygienic=False)
def _init_specialised_barriers():
    # slot s's "full" barrier completes when the producer's bytes have landed (one arrival, the
    # producer's expect_tx); its "empty" one once every consumer warpgroup is done reading it
    if tx == 0:
        for s in T.unroll(STAGES):
            T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(1))
            T.ptx.mbarrier.init.shared.b64(T.address_of(empty[s]), T.uint32(CONSUMERS))
    T.ptx.fence.proxy.async_.shared__cta()
    T.cuda.cta_sync()


@T.macro(hygienic=False)
def _producer_loop():
    # Slice kt goes to slot kt % STAGES once the consumers released the slot's previous slice,
    # kt - STAGES: the (kt // STAGES)-th completion of its empty barrier, which ends phase
    # kt // STAGES - 1. The first pass over the ring (kt < STAGES) has nothing to wait for.
    for kt in T.serial(KT):
        if kt >= STAGES:
            T.cuda.mbarrier_wait(T.address_of(empty[kt % STAGES]), (kt // STAGES + 1) % 2)
        _load_slice(kt % STAGES, kt)


@T.macro(hygienic=False)
def _consumer_loop():
    # Slice kt is phase kt // STAGES of its slot's full barrier. A slot is released (one arrival
    # per consumer warpgroup on its empty barrier) once the wgmma group that read it retired: with
    # wait depth 1 the previous slice's, while this slice's group stays in flight.
    _zero_accumulators()
    for kt in T.serial(KT):
        T.cuda.mbarrier_wait(T.address_of(bars[kt % STAGES]), kt // STAGES % 2)
        _issue_slice(kt)
        if WAIT_DEPTH == 1:
            T.ptx.wgmma.wait_group.sync.aligned(1)
            if kt >= 1:
                if tx % 128 == 0:
                    T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(kt - 1) % STAGES]))
        else:
            T.ptx.wgmma.wait_group.sync.aligned(0)
            if tx % 128 == 0:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[kt % STAGES]))
    T.ptx.wgmma.wait_group.sync.aligned(0)
    # the epilogue's reads of the accumulators stay behind the wait (``_PIN_TYPES``)
    pin_registers(acc, NACC, ACC_DTYPE)
    if TWO_WEIGHTS:
        pin_registers(acc_up, NACC, ACC_DTYPE)


@T.macro(hygienic=False)
def _zero_accumulators():
    for i in T.serial(NACC):
        acc[i] = ACC_ZERO
        if TWO_WEIGHTS:
            acc_up[i] = ACC_ZERO


@T.macro(hygienic=False)
def _issue_slice(kt):
    # this warpgroup's wgmmas of K slice kt (in its ring slot, landed), as one committed group
    T.ptx.wgmma.fence.sync.aligned()
    for kk in T.unroll(BK // KSTEP):
        # 128-byte swizzle: stride 64 (8 rows of 128 B), in 16 B units; A K-major (leading offset 1);
        # a k step is 32 bytes (16 2-byte or 32 1-byte elements)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a), As.ptr_to([kt % STAGES, wg * 64, kk * KSTEP]), 1, 64, SWIZZLE)
        _b_descriptor(kt % STAGES, 0, kk)
        T.ptx[MMA](*[acc[i] for i in range(MMA_NACC)], desc_a, desc_b, *MMA_FLAGS)
        if PARTS == 2:
            # BN wider than one wgmma: B's second MMA_N rows into the second half of acc
            _b_descriptor(kt % STAGES, 0, kk, MMA_N)
            T.ptx[MMA](*[acc[MMA_NACC + i] for i in range(MMA_NACC)], desc_a, desc_b, *MMA_FLAGS)
        if TWO_WEIGHTS:
            _b_descriptor(kt % STAGES, 1, kk)
            T.ptx[MMA](*[acc_up[i] for i in range(NACC)], desc_a, desc_b, *MMA_FLAGS)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro(hygienic=False)
def _b_descriptor(slot, weight, kk, row=0):
    # k step kk of weight `weight` (0: B, 1: Wu) in ring slot `slot`, from its row `row` on ("nk")
    if B_KN:
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), Bs.ptr_to([slot, weight * BN // 64, kk * KSTEP, 0]), B_LEADING, 64, SWIZZLE)
    else:
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), Bs.ptr_to([slot, weight * BN + row, kk * KSTEP]), 1, 64, SWIZZLE)


@T.macro(hygienic=False)
def _load_slice(slot, kslice):
    # TMA copies of K slice `kslice` of the CTA's A rows and B (and Wu) tiles into ring slot `slot`;
    # the slot's barrier completes when all STAGE_BYTES have arrived
    # (a grouped GEMM's B is its group's block of rows: B_ROW0 = group * K or group * N, else 0;
    # a batched GEMM's copies are of its batch GRP's matrices, from row TILE_ROW0)
    if BATCHED:
        T.ptx[_TMA_LOAD_3D](As.ptr_to([slot, 0, 0]), T.address_of(A_map), kslice * BK, TILE_ROW0, GRP,
                            T.address_of(bars[slot]))
        T.ptx[_TMA_LOAD_3D](Bs.ptr_to([slot, 0, 0]), T.address_of(B_map), kslice * BK, bx * BN, GRP,
                            T.address_of(bars[slot]))
    else:
        _load_operands(slot, kslice)
    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[slot]), T.uint32(STAGE_BYTES))


@T.macro(hygienic=False)
def _load_operands(slot, kslice):
    # slice `kslice` of the CTA's share of K, which starts at slice K_FIRST (split-K; else 0)
    T.ptx[TMA](As.ptr_to([slot, 0, 0]), T.address_of(A_map), (K_FIRST + kslice) * BK, by * BM, T.address_of(bars[slot]))
    if B_KN:
        for box in T.unroll(BN // 64):
            T.ptx[TMA](Bs.ptr_to([slot, box, 0, 0]), T.address_of(B_map), bx * BN + box * 64, B_ROW0 + (K_FIRST + kslice) * BK, T.address_of(bars[slot]))
            if TWO_WEIGHTS:
                T.ptx[TMA](Bs.ptr_to([slot, BN // 64 + box, 0, 0]), T.address_of(U_map), bx * BN + box * 64, B_ROW0 + (K_FIRST + kslice) * BK, T.address_of(bars[slot]))
    else:
        T.ptx[TMA](Bs.ptr_to([slot, 0, 0]), T.address_of(B_map), (K_FIRST + kslice) * BK, B_ROW0 + bx * BN, T.address_of(bars[slot]))
        if TWO_WEIGHTS:
            T.ptx[TMA](Bs.ptr_to([slot, BN, 0]), T.address_of(U_map), (K_FIRST + kslice) * BK, B_ROW0 + bx * BN, T.address_of(bars[slot]))


def raster_rows(cta, tiles_m: int, tiles_n: int, raster: int, minimum=min):
    """Tile-rows in the group of CTA ``cta`` (``raster_tile``): ``raster``, fewer in a last group
    that ``tiles_m`` does not fill (``minimum``: min on ints, T.min on the kernel's expressions)."""
    return minimum(tiles_m - cta // (raster * tiles_n) * raster, raster)


def raster_tile(cta, tiles_n: int, raster: int, rows):
    """(column tile, row tile) of the linear CTA id ``cta`` in the grouped launch order (Triton's
    matmul tutorial): groups of ``raster`` tile-rows, each group walked down its ``rows`` rows
    (``raster_rows``) first, then across the ``tiles_n`` columns. ints or the kernel's expressions."""
    group, within = cta // (raster * tiles_n), cta % (raster * tiles_n)
    return within // rows, group * raster + within % rows


# Where accumulator element i of thread tx lands in C. m64nN: warp w of the warpgroup holds rows
# 16w + lane/4 (and +8), columns 8j + 2(lane%4) (and +1) in acc[4j .. 4j+3]: (r, c), (r, c+1),
# (r+8, c), (r+8, c+1).
def _row(by, bm, wg, tx, half):
    return by * bm + wg * 64 + tx % 128 // 32 * 16 + tx % 32 // 4 + half * 8


def _col(bx, bn, j, tx, pair):
    return bx * bn + j * 8 + tx % 4 * 2 + pair


def _mark(func, name: str):
    return (func.with_attr("global_symbol", name).with_attr("autofuse.tirx", True)
            .with_attr("tirx.is_scheduled", True))


# TVM's launch tag (its spelling) for CUDA's programmatic dependent launch, set per device function
# through "tirx.kernel_launch_params"; in a composite it reaches every kernel (``tirx_sequence``)
DEPENDENT_LAUNCH_TAG = "tirx.use_programtic_dependent_launch"


def dependent_launch(func):
    """``func`` launched with programmatic dependent launch: it may start while the kernel before it
    on the stream finishes, so it must execute griddepcontrol.wait before reading that kernel's
    results (the decode kernels and split-K's do, first thing)."""
    return func.with_attr("tirx.kernel_launch_params", [DEPENDENT_LAUNCH_TAG])


def _config(shape: dict, dtype: str, knobs: dict | None, weights: int, b_layout: str, out_dtype: str | None = None,
            space: dict | None = None, default: dict | None = None, dtypes: dict = DTYPES, groups: int = 0) -> dict:
    """The constants a kernel binds before expanding ``_main_loop``, checked (``check``): operands
    A and B in ``dtype``, one of ``dtypes`` (float16/bfloat16 of ``DTYPES`` with a float32
    accumulator; int8 of ``INT8_DTYPES`` with an int32 one), C in ``out_dtype`` (``dtype`` when
    None); with ``groups`` G, B is G weights stacked (``grouped_gemm_act``)."""
    if space is None:
        space, default = (KNOBS, DEFAULT_KNOBS) if weights == 1 else (SWIGLU_KNOBS, SWIGLU_DEFAULT_KNOBS)
    m, n, k, knobs = check(shape, dtype, knobs, space=space, default=default, weights=weights, dtypes=dtypes)
    integer = dtype in INT8_DTYPES
    if integer and b_layout != "nk":
        raise ValueError(f"int8 wgmma reads B K-major only (b_layout 'nk'), not {b_layout!r}")
    bm, bn, bk = tile_shape(knobs)
    itemsize = _ITEMSIZE[dtype]
    stacked = max(groups, 1)
    if groups:
        if weights != 1:
            raise ValueError("a grouped GEMM has one weight per group")
        if stacked * n * k >= 1 << 31:
            raise ValueError(f"{groups} groups of n={n} x k={k}: B over 2^31 elements (int32 indices)")
    # the tensor map spans every group's weight: (G N, K) stored "nk", (G K, N) "kn"
    b_rows, b_cols = (n * stacked, k) if b_layout == "nk" else (n, k * stacked)
    b_smem, b_box, b_leading, trans_b = _b_operand(b_rows, b_cols, knobs, weights, b_layout, itemsize)
    # one wgmma covers BN columns, but an int8 BN 256 takes two (``_INT8_MMA_N_MAX``)
    parts = 2 if integer and bn > _INT8_MMA_N_MAX else 1
    mma_n = bn // parts
    if integer:
        # s32 accumulators in uint32 carrier registers; operands K-major, no scale or transpose flags
        mma, flags, acc_dtype = f"wgmma.mma_async.sync.aligned.m64n{mma_n}k32.s32.s8.s8", (True,), "uint32"
    else:
        kind = DTYPES[dtype]
        mma = f"wgmma.mma_async.sync.aligned.m64n{mma_n}k16.f32.{kind}.{kind}"
        flags, acc_dtype = (True, 1, 1, 0, trans_b), "float32"
    specialised = knobs["specialised"]
    tma_store = knobs.get("tma_store", 0)
    if tma_store and _ITEMSIZE.get(out_dtype or dtype) != 2:
        raise ValueError(f"tma_store stages 2-byte C tiles, not {out_dtype or dtype}")
    return {"m": m, "n": n, "k": k, "bm": bm, "bn": bn, "bk": bk, "stages": knobs["stages"], "tma_store": tma_store,
            "split_k": knobs.get("split_k", 1),
            "c_box": _tensor_map_args(m, n, 64, 64) if tma_store else None,
            "threads": 128 * (knobs["warpgroups"] + specialised), "wait_depth": knobs["wait_depth"],
            "specialised": specialised, "consumers": knobs["warpgroups"], "raster": knobs["raster"],
            "dtype": dtype, "out_dtype": out_dtype or dtype, "acc_dtype": acc_dtype,
            "mma": mma, "mma_flags": flags, "mma_n": mma_n, "parts": parts, "k_step": 32 // itemsize,
            "a_box": _tensor_map_args(m, k, bm, bk, itemsize), "b_box": b_box, "b_smem": b_smem,
            "b_leading": b_leading, "trans_b": trans_b, "b_kn": b_layout == "kn",
            "b_shape": (n * stacked, k) if b_layout == "nk" else (k * stacked, n), "groups": groups,
            "stage_bytes": slot_bytes(knobs, dtype, weights)}


def _accumulator(acc_dtype: str):
    """An accumulator register as float32: itself, or the int32 in its uint32 carrier, converted."""
    if acc_dtype == "float32":
        return lambda value: value
    return lambda value: T.Cast("float32", T.reinterpret("int32", value))


def _gemm(cfg: dict, name: str, operands: list, epilogue, two_weights: bool):
    """The tirx PrimFunc ``(A, B, *X, C)``: the pipelined main loop over A and B (``_main_loop``, or
    with ``specialised`` ``_producer_loop`` and ``_consumer_loop`` in their warpgroups), and with
    ``two_weights`` over A and the first X (a second weight stored as B is, its product in
    ``acc_up``), then C[row, col] = epilogue(acc, acc_up, [X...], row, col) rounded once, acc as
    float32, two adjacent columns per store. ``operands``: the epilogue's, as (name, shape,
    dtype), the PrimFunc's parameters between B and C in that order (buffer ``name``, parameter
    ``name`` in lower case)."""
    m, n, k, bm, bn, bk, stages = (cfg[key] for key in ("m", "n", "k", "bm", "bn", "bk", "stages"))
    dtype, acc_dtype = cfg["dtype"], cfg["acc_dtype"]
    out_dtype = cfg["out_dtype"]
    accumulator = _accumulator(acc_dtype)
    store = (lambda value: value) if out_dtype == "float32" else (lambda value: T.Cast(out_dtype, value))

    # C as pairs of adjacent columns: a thread's accumulators i, i + 1 are (row, col), (row, col + 1),
    # stored as one 4-byte word (two halves) or 8 bytes (two float32)
    pair_dtype = "uint64" if out_dtype == "float32" else "uint32"
    tiles_m, tiles_n = cfg.get("tiles", (m // bm, n // bn))
    raster, specialised = cfg["raster"], bool(cfg["specialised"])
    grouped, b_row_step = bool(cfg["groups"]), (k if cfg["b_kn"] else n)
    batched, q_tiles, rank = "batches" in cfg, cfg.get("q_tiles", 0), cfg.get("rank", 2)
    tma_store = bool(cfg["tma_store"])
    # split-K: CTA kz of a tile takes K slices [kz KT, (kz + 1) KT) and stores its float32 partial
    # as row tile by + kz tiles_m of C, (split m, n); ``gemm_split_k``'s second kernel sums them
    split = cfg.get("split_k", 1)
    if split > 1 and (raster != 1 or batched or cfg["groups"] or tma_store or out_dtype != "float32"):
        raise ValueError("split-K partials: float32, in the 2-D grid's order, neither batched, grouped nor TMA-stored")
    registers = SPECIALISED_REGISTERS.get(cfg["consumers"]) if specialised else None
    share_registers = registers is not None

    @T.macro
    def store_tile(C_pairs, Cs_words, out_pair, out_word, acc, acc_up, XS, bx, by, wg, tx):
        """The epilogue of this warpgroup's accumulators, a pair of adjacent columns per store: to C,
        or with ``tma_store`` into its 64 x BN staging tile, BN/64 boxes of 64 x 64 whose 16-byte
        chunks are swizzled as TMA's 128-byte swizzle reads them (chunk ^ row % 8, so the 8 rows of
        a store instruction hit 8 different banks)."""
        for j in T.unroll(bn // 8):
            for half in T.unroll(2):
                row = T.meta_var(_row(by, bm, wg, tx, half))
                for pair in T.unroll(2):
                    col = T.meta_var(_col(bx, bn, j, tx, pair))
                    i = T.meta_var(j * 4 + half * 2 + pair)
                    out_pair[pair] = store(epilogue(accumulator(acc[i]), acc_up[i] if two_weights else None, XS, row,
                                                    col))
                if tma_store:
                    r = T.meta_var(tx % 128 // 32 * 16 + tx % 32 // 4 + half * 8)  # the row in the warpgroup's tile
                    Cs_words[wg, j // 8, r, T.bitwise_xor(j % 8, r % 8) * 4 + tx % 4] = out_word[0]
                else:
                    C_pairs[row, _col(bx, bn, j, tx, 0) // 2] = out_word[0]

    @T.macro
    def store_staged(C_map, Cs, bx, row0, grp, wg, tx):
        """This warpgroup's staged tile to C by TMA (rows from ``row0``, of batch ``grp`` when
        batched; TMA clips what lies past C), once every thread's writes are visible to the copy
        engine; its shared memory is read before the CTA may exit."""
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.warpgroup_sync(1 + wg)
        if tx % 128 == 0:
            for box in T.unroll(bn // 64):
                if batched:
                    T.ptx[_TMA_STORE_3D](T.address_of(C_map), bx * bn + box * 64, row0 + wg * 64, grp,
                                         Cs.ptr_to([wg, box, 0, 0]))
                else:
                    T.ptx[_TMA_STORE](T.address_of(C_map), bx * bn + box * 64, row0 + wg * 64, Cs.ptr_to([wg, box, 0, 0]))
            T.ptx["cp.async.bulk.commit_group"]()
            T.ptx["cp.async.bulk.wait_group.read"](0)

    @T.macro
    def kernel(A, B, XS, C):
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", A_map, dtype, rank, A.data, *cfg["a_box"])
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, dtype, rank, B.data, *cfg["b_box"])
        if two_weights:
            U_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", U_map, dtype, 2, XS[0].data, *cfg["b_box"])
        if tma_store:
            C_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", C_map, out_dtype, rank, C.data, *cfg["c_box"])
        T.device_entry()
        if share_registers:
            # launch bounds (threads, 1): ptxas then knows the registers a thread starts with (65536 /
            # threads, 168 at 384) and keeps the setmaxnreg below, balanced to that (it drops them
            # otherwise, C7508, as it did for the smaller tiles)
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        if split > 1:
            bx, by, kz = T.cta_id([tiles_n, tiles_m, split])
            # dependent launch (``dependent_launch``): what the kernel before wrote is visible
            # after the wait; the sum's CTAs may be scheduled from here on
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
        elif raster == 1:
            bx, by = T.cta_id([tiles_n, tiles_m])
        else:
            # grouped launch order: `raster` tile-rows at a time, down the rows first, so that the
            # CTAs running together share B's column tiles (and A's rows) in L2
            cta = T.cta_id([tiles_m * tiles_n])
            rows: T.let[T.int32] = raster_rows(cta, tiles_m, tiles_n, raster, T.min)
            bx: T.let[T.int32] = raster_tile(cta, tiles_n, raster, rows)[0]
            by: T.let[T.int32] = raster_tile(cta, tiles_n, raster, rows)[1]
        tx = T.thread_id([cfg["threads"]])
        pool = T.SMEMPool()
        As = pool.alloc((stages, bm, bk), dtype, align=1024)
        # each slot: the B tile (then, with two weights, the X tile)
        Bs = pool.alloc(cfg["b_smem"], dtype, align=1024)
        bars = pool.alloc((stages,), "uint64", align=8)
        if specialised:
            empty = pool.alloc((stages,), "uint64", align=8)
        if tma_store:
            Cs = pool.alloc((cfg["consumers"], bn // 64, 64, 64), out_dtype, align=1024)
        pool.commit()
        if tma_store:
            Cs_words = T.decl_buffer((cfg["consumers"], bn // 64, 64, 32), "uint32", data=Cs.data,
                                     elem_offset=Cs.elem_offset // 2, scope="shared.dyn")
        desc_a: T.uint64
        desc_b: T.uint64
        acc = T.alloc_buffer((bn // 2,), acc_dtype, scope="local")
        if two_weights:
            acc_up = T.alloc_buffer((bn // 2,), acc_dtype, scope="local")
        out_pair = T.alloc_buffer((2,), out_dtype, scope="local")
        out_word = T.decl_buffer((1,), pair_dtype, data=out_pair.data, scope="local")
        C_pairs = T.decl_buffer((m * split, n // 2), pair_dtype, data=C.data)
        # the warpgroup's 64 rows of the tile (with ``specialised``, warpgroup 0 is the producer)
        wg = T.meta_var(tx // 128 - 1 if specialised else tx // 128)
        BM, BN, BK, KT, STAGES, NACC = T.meta_var((bm, bn, bk, k // bk // split, stages, bn // 2))
        PROLOGUE = T.meta_var(min(stages, k // bk // split))
        K_FIRST = T.meta_var(kz * (k // bk // split) if split > 1 else 0)
        TILE_BY = T.meta_var(by + kz * tiles_m if split > 1 else by)  # the row tile of C stored
        STAGE_BYTES, WAIT_DEPTH, CONSUMERS = T.meta_var((cfg["stage_bytes"], cfg["wait_depth"], cfg["consumers"]))
        MMA, TMA, SWIZZLE = T.meta_var((cfg["mma"], _TMA_LOAD, _SWIZZLE_128B))
        MMA_FLAGS, MMA_N, PARTS, KSTEP = T.meta_var((cfg["mma_flags"], cfg["mma_n"], cfg["parts"], cfg["k_step"]))
        MMA_NACC, ACC_ZERO, ACC_DTYPE = T.meta_var((cfg["mma_n"] // 2, tvm.tirx.const(0, acc_dtype), acc_dtype))
        B_KN, B_LEADING, TRANS_B = T.meta_var((cfg["b_kn"], cfg["b_leading"], cfg["trans_b"]))
        TWO_WEIGHTS = T.meta_var(two_weights)
        if batched:
            grp: T.let[T.int32] = by // q_tiles  # the row tile's batch, then its first row in the batch
            tile_row0: T.let[T.int32] = by % q_tiles * bm
        elif grouped:
            # the row tile's group (whose weight B is), -1 past the last group's rows: no work there
            grp: T.let[T.int32] = XS[0][by * (bm // GROUP_ROWS)]
        B_ROW0 = T.meta_var(grp * b_row_step if grouped else 0)
        BATCHED, GRP, TILE_ROW0 = T.meta_var((batched, grp if batched else 0, tile_row0 if batched else 0))
        LIVE = T.meta_var(grp >= 0 if grouped else True)
        if LIVE:
            if specialised:
                _init_specialised_barriers()
                if tx < 128:
                    # the producer warpgroup: its registers to the consumers, one thread issues the copies
                    if share_registers:
                        T.ptx["setmaxnreg.dec.sync.aligned.u32"](registers[0])
                    if tx == 0:
                        _producer_loop()
                else:
                    if share_registers:
                        T.ptx["setmaxnreg.inc.sync.aligned.u32"](registers[1])
                    _consumer_loop()
                    store_tile(C_pairs, Cs_words if tma_store else None, out_pair, out_word, acc,
                               acc_up if two_weights else None, XS, bx, TILE_BY, wg, tx)
                    if tma_store:
                        store_staged(C_map, Cs, bx, TILE_ROW0 if batched else by * bm, GRP, wg, tx)
            else:
                _main_loop()
                store_tile(C_pairs, Cs_words if tma_store else None, out_pair, out_word, acc,
                           acc_up if two_weights else None, XS, bx, TILE_BY, wg, tx)
                if tma_store:
                    store_staged(C_map, Cs, bx, TILE_ROW0 if batched else by * bm, GRP, wg, tx)

    names = [op_name for op_name, _, _ in operands]
    # The parameter list varies with the operands, which the script's signatures cannot: the
    # signature and the buffers it matches are written out, the body is the macro above.
    source = "\n".join([
        "@T.prim_func",
        f"def gemm(a: T.handle, b: T.handle, {''.join(f'{x.lower()}: T.handle, ' for x in names)}c: T.handle):",
        "    A = T.match_buffer(a, (M, K), DTYPE, align=16)",
        "    B = T.match_buffer(b, B_SHAPE, DTYPE, align=16)",
        *[f"    {x} = T.match_buffer({x.lower()}, OPERANDS[{i}][1], OPERANDS[{i}][2], align=16)"
          for i, x in enumerate(names)],
        "    C = T.match_buffer(c, (M * SPLIT, N), OUT_DTYPE, align=16)",
        f"    kernel(A, B, [{', '.join(names)}], C)", ""])
    func = tvm.script.parse(source, extra_vars={
        "T": T, "kernel": kernel, "M": m, "N": n, "K": k, "SPLIT": split, "DTYPE": dtype, "OUT_DTYPE": out_dtype,
        "B_SHAPE": cfg["b_shape"], "OPERANDS": operands})
    return _mark(func, name)


def gemm_bias_act(shape: dict, dtype: str = "float16", knobs: dict | None = None, act: str = "relu",
                  b_layout: str = "nk"):
    """The tirx PrimFunc ``(A, B, bias, C)`` computing C = act(A @ B^T + bias) for ``shape``
    {"m", "n", "k"}, B stored as ``b_layout`` (``B_LAYOUTS``); its global symbol is
    ``gemm_bias_<act>``. ValueError when the shape, dtype, knobs or ``act`` (one of
    ``ACTIVATIONS``) do not fit."""
    activation = _activation(act)
    cfg = _config(shape, dtype, knobs, 1, b_layout)

    def bias_act(acc, _up, operands, _row, col):
        return activation(acc + T.Cast("float32", operands[0][col]))

    return _gemm(cfg, f"gemm_bias_{act}", [("X", (cfg["n"],), dtype)], bias_act, False)


def gemm_act(shape: dict, dtype: str = "float16", knobs: dict | None = None, act: str = "none",
             b_layout: str = "nk"):
    """``gemm_bias_act`` without the bias: the tirx PrimFunc ``(A, B, C)`` computing C = act(A @ B^T);
    global symbol ``gemm_<act>``."""
    activation = _activation(act)
    cfg = _config(shape, dtype, knobs, 1, b_layout)
    return _gemm(cfg, f"gemm_{act}", [], lambda acc, _up, _operands, _row, _col: activation(acc), False)


# Split-K (``gemm_split_k``): a skinny GEMM has few tiles, and each of its CTAs streams all of K's A
# and B through one SM. Its K is split among ``split_k`` CTAs per tile, each storing a float32
# partial; a second kernel sums them and applies the epilogue. One wave of CTAs that fills at least
# WAVE_FILL_MIN of the SMs: the split is for filling them with large tiles, not for more waves
# (m = 128, n = 11008: 86 CTAs of 128 x 256 x 2 splits 0.053 ms, the unsplit 64 x 64 tiles 0.048).
SPLIT_K_KNOBS = {**KNOBS, "raster": (1,), "split_k": (2, 3, 4, 6, 8)}
SPLIT_K_DEFAULT_KNOBS = {**DEFAULT_KNOBS, "block_n": 128, "raster": 1, "split_k": 4}
SPLIT_K_MAX_M = 256      # rows up to which K is split (two 128-row tiles)
SPLIT_K_MIN_SLICES = 4   # K slices a split keeps at least (fewer: the ring's fill dominates)
_SUM_THREADS = 256


def split_k_check(shape: dict, dtype: str, knobs: dict | None = None) -> tuple[int, int, int, dict]:
    """(m, n, k, resolved knobs) when ``gemm_split_k`` can compute ``shape`` in ``dtype`` with
    ``knobs`` (``SPLIT_K_KNOBS``); ValueError saying why not otherwise."""
    m, n, k, knobs = check(shape, dtype, knobs, space=SPLIT_K_KNOBS, default=SPLIT_K_DEFAULT_KNOBS)
    if m > SPLIT_K_MAX_M:
        raise ValueError(f"m={m}: over {SPLIT_K_MAX_M} rows the tiles fill the SMs without splitting K")
    bm, bn, bk = tile_shape(knobs)
    splits, slices = knobs["split_k"], k // bk
    if slices % splits or slices // splits < SPLIT_K_MIN_SLICES:
        raise ValueError(f"split_k={splits}: k={k} is {slices} slices of {bk}, not {splits} shares of "
                         f"{SPLIT_K_MIN_SLICES} or more")
    ctas = m // bm * (n // bn) * splits
    if not WAVE_FILL_MIN * SM_COUNT <= ctas <= SM_COUNT:
        raise ValueError(f"{ctas} CTAs ({m // bm * (n // bn)} tiles of {bm} x {bn}, split_k={splits}): not one wave "
                         f"of {WAVE_FILL_MIN:.0%} to 100% of the {SM_COUNT} SMs")
    return m, n, k, knobs


def split_k_fill(shape: dict, dtype: str) -> dict:
    """Knobs over ``SPLIT_K_DEFAULT_KNOBS`` for ``shape``: the first tile of 128 x 128, 128 x 256,
    128 x 64, then the same with 64 rows (one consumer warpgroup, the one-role kernel) that
    ``split_k_check`` takes, with the most splits; the default where none does."""
    for warpgroups, block_n in itertools.product((2, 1), (128, 256, 64)):
        for splits in sorted(SPLIT_K_KNOBS["split_k"], reverse=True):
            knobs = {**SPLIT_K_DEFAULT_KNOBS, "warpgroups": warpgroups, "block_n": block_n, "split_k": splits}
            if warpgroups not in SPECIALISED_REGISTERS:
                knobs["specialised"] = 0
            try:
                return split_k_check(shape, dtype, knobs)[3]
            except ValueError:
                continue
    return dict(SPLIT_K_DEFAULT_KNOBS)


def split_k_sum(m: int, n: int, splits: int, dtype: str, epilogue, operands: list, name: str):
    """The tirx PrimFunc ``(P, *X, C)``: C[r, c] = epilogue(sum over s of P[s m + r, c], None, [X...],
    r, c) rounded once into ``dtype``, P (splits m, n) float32, the splits added in order; a thread
    per 4 columns (one 16-byte load per split, issued before the adds; one 8-byte store).
    ``operands`` as ``_gemm``'s. It waits on the kernel before (dependent launch)."""
    chunks = m * n // 4
    blocks = -(-chunks // _SUM_THREADS)

    @T.macro
    def kernel(P, XS, C):
        T.device_entry()
        bx = T.cta_id([blocks])
        tx = T.thread_id([_SUM_THREADS])
        T.ptx.griddepcontrol.wait()  # the partials, complete and visible
        P4 = T.decl_buffer((splits * chunks,), "float32x4", data=P.data)
        C4 = T.decl_buffer((chunks,), "uint32x2", data=C.data)
        part = T.alloc_buffer((splits * 4,), "float32", scope="local")
        part4 = T.decl_buffer((splits,), "float32x4", data=part.data, scope="local")
        total = T.alloc_buffer((4,), "float32", scope="local")
        out = T.alloc_buffer((4,), dtype, scope="local")
        out4 = T.decl_buffer((1,), "uint32x2", data=out.data, scope="local")
        chunk = T.meta_var(bx * _SUM_THREADS + tx)
        if chunk < chunks:
            for s in T.unroll(splits):
                part4[s] = P4[s * chunks + chunk]
            for e in T.unroll(4):
                total[e] = part[e]
                for s in T.unroll(1, splits):
                    total[e] = total[e] + part[s * 4 + e]
                out[e] = T.Cast(dtype, epilogue(total[e], None, XS, chunk * 4 // n, chunk * 4 % n + e))
            C4[chunk] = out4[0]

    names = [op_name for op_name, _, _ in operands]
    source = "\n".join([
        "@T.prim_func",
        f"def split_k_sum(p: T.handle, {''.join(f'{x.lower()}: T.handle, ' for x in names)}c: T.handle):",
        "    P = T.match_buffer(p, (SPLITS * M, N), 'float32', align=16)",
        *[f"    {x} = T.match_buffer({x.lower()}, OPERANDS[{i}][1], OPERANDS[{i}][2], align=16)"
          for i, x in enumerate(names)],
        "    C = T.match_buffer(c, (M, N), DTYPE, align=16)",
        f"    kernel(P, [{', '.join(names)}], C)", ""])
    func = tvm.script.parse(source, extra_vars={"T": T, "kernel": kernel, "M": m, "N": n, "SPLITS": splits,
                                                "DTYPE": dtype, "OPERANDS": operands})
    return _mark(func, name)


def split_k_kernels(shape: dict, dtype: str, knobs: dict | None, epilogue, operands: list, b_layout: str = "nk",
                    name: str = "gemm_split_k") -> tuple:
    """(partials, sum, splits): the two kernels of a split-K GEMM for ``shape`` (``split_k_check``):
    ``(A, B, P)``, each CTA storing its share of K's float32 partial tile into P (splits m, n), and
    ``split_k_sum``'s ``(P, *X, C)`` with C = epilogue(sum, None, [X...], row, col) for ``operands``
    X as ``_gemm``'s. The partials kernel waits on the kernel before it and lets the sum launch
    early when the composite is launched dependent (``dependent_launch``)."""
    m, n, _, knobs = split_k_check(shape, dtype, knobs)
    cfg = _config(shape, dtype, knobs, 1, b_layout, "float32", SPLIT_K_KNOBS, SPLIT_K_DEFAULT_KNOBS)
    partials = _gemm(cfg, f"{name}_partials", [], lambda acc, _up, _operands, _row, _col: acc, False)
    return partials, split_k_sum(m, n, cfg["split_k"], dtype, epilogue, operands, f"{name}_sum"), cfg["split_k"]


def gemm_split_k(shape: dict, dtype: str = "float16", knobs: dict | None = None, act: str = "relu",
                 b_layout: str = "nk", bias: bool = True):
    """``gemm_bias_act`` (``gemm_act`` without ``bias``) with K split: the PrimFunc ``(A, B, [bias,]
    C)`` of ``split_k_kernels``' two (``tirx_sequence``), both launched dependent
    (``dependent_launch``): the GEMM over ``split_k`` shares of K into a float32 workspace (split_k
    m, n), then the sum adding the partials, the bias and the activation. Knobs from
    ``SPLIT_K_KNOBS``; global symbol ``gemm_split_k_<act>``. ValueError when the shape, dtype or
    knobs do not fit (``split_k_check``)."""
    from .tirx_sequence import buffer, sequence, workspace

    activation = _activation(act)
    m, n, k, knobs = split_k_check(shape, dtype, knobs)

    def bias_act(acc, _up, xs, _row, col):
        return activation(acc + T.Cast("float32", xs[0][col]) if bias else acc)

    operands = [("X", (n,), dtype)] if bias else []
    partials, summed, splits = split_k_kernels(shape, dtype, knobs, bias_act, operands, b_layout)
    b_rows, b_cols = (n, k) if b_layout == "nk" else (k, n)
    a, b, c = buffer("a", (m, k), dtype), buffer("b", (b_rows, b_cols), dtype), buffer("c", (m, n), dtype)
    x = [buffer("x", (n,), dtype)] if bias else []
    p = workspace("partials", (splits * m, n), "float32")
    return sequence(f"gemm_split_k_{act}", [a, b, *x, c],
                    [(dependent_launch(partials), [a, b, p]), (summed, [p, *x, c])], [p])


# A grouped GEMM's rows come in groups of whole row tiles; its table names the group of every
# GROUP_ROWS rows, so one table serves tiles of 64 and 128 rows.
GROUP_ROWS = 64


def grouped_check(shape: dict, groups: int, dtype: str, knobs: dict | None = None, b_layout: str = "kn",
                  out_dtype: str | None = None) -> dict:
    """The constants of ``grouped_gemm_act``'s kernel for ``shape`` with ``groups`` weights in
    ``dtype`` with ``knobs``; ValueError saying why it cannot compute that."""
    if groups < 1:
        raise ValueError(f"groups={groups}: at least one")
    return _config(shape, dtype, knobs, 1, b_layout, out_dtype, groups=groups)


def grouped_gemm_act(shape: dict, groups: int, dtype: str = "float16", knobs: dict | None = None,
                     act: str = "none", b_layout: str = "kn", out_dtype: str | None = None):
    """The tirx PrimFunc ``(A, B, G, C)`` of a grouped GEMM (a mixture of experts' expert GEMMs over
    its routed rows): C[r] = act(A[r] @ B[g]^T), g = G[r // GROUP_ROWS] the group of row r, for
    ``shape`` {"m", "n", "k"}: A (m, k) the groups' rows one after another, each group's in whole
    row tiles; B ``groups`` weights stacked, (groups * k, n) stored "kn" (B[g] is rows g k .. (g +
    1) k) or (groups * n, k) "nk"; G (m / GROUP_ROWS,) int32, -1 for rows no group has (their
    tiles do nothing, C's rows there are not written); C (m, n) in ``out_dtype`` (``dtype`` when
    None). Global symbol ``grouped_gemm_<act>``. ValueError when the shape, dtype or knobs do not
    fit."""
    activation = _activation(act)
    cfg = grouped_check(shape, groups, dtype, knobs, b_layout, out_dtype)
    return _gemm(cfg, f"grouped_gemm_{act}", [("G", (cfg["m"] // GROUP_ROWS,), "int32")],
                 lambda acc, _up, _operands, _row, _col: activation(acc), False)


def batched_check(shape: dict, batches: int, dtype: str, knobs: dict | None = None, space: dict = KNOBS,
                  default: dict = DEFAULT_KNOBS) -> dict:
    """The constants of ``batched_gemm``'s kernel for ``shape`` in ``batches`` in ``dtype`` with
    ``knobs``; ValueError saying why it cannot compute that."""
    if batches < 1:
        raise ValueError(f"batches={batches}: at least one")
    try:
        m, n, k = (int(shape[key]) for key in ("m", "n", "k"))
    except (KeyError, TypeError):
        raise ValueError(f"shape needs integer m, n, k; got {shape!r}") from None
    if m <= 0 or n <= 0 or m % batches:
        raise ValueError(f"m={m} rows do not split into {batches} batches")
    rows = m // batches
    bm, bn, bk = tile_shape(resolve_knobs(knobs, space, default))
    q_tiles, n_tiles = -(-rows // bm), -(-n // bn)
    # the tiles cover each batch's padded matrix; checked as one GEMM of that size
    cfg = _config({"m": batches * q_tiles * bm, "n": n_tiles * bn, "k": k}, dtype, knobs, 1, "nk", space=space,
                  default=default)
    tma_store = cfg["tma_store"]
    if (q_tiles * bm != rows or n_tiles * bn != n) and not tma_store:
        raise ValueError(f"{rows} x {n} is no whole {bm} x {bn} tiles: storing a padded tile needs tma_store")
    if tma_store and n % 8:
        raise ValueError(f"n={n}: C's rows are {2 * n} bytes, no multiple of the 16 a TMA copy needs")
    cfg.update(m=m, n=n, batches=batches, q_tiles=q_tiles, tiles=(batches * q_tiles, n_tiles), rank=3,
               a_box=_batched_map_args(batches, rows, k, bm, bk), b_box=_batched_map_args(batches, n, k, bn, bk),
               c_box=_batched_map_args(batches, rows, n, 64, 64) if tma_store else None, b_shape=(batches * n, k))
    return cfg


def batched_gemm(shape: dict, batches: int, dtype: str = "float16", knobs: dict | None = None, scale: float = 1.0,
                 space: dict = KNOBS, default: dict = DEFAULT_KNOBS):
    """The tirx PrimFunc ``(A, B, C)`` of ``batches`` GEMMs of one shape stacked (every head's
    attention scores, say): C[r] = scale * (A[r] @ B[g]^T) for row r of batch g = r // (m /
    batches), for ``shape`` {"m", "n", "k"}: A (m, k) the batches' rows one after another, B
    (batches * n, k) (B[g] is rows g n .. (g + 1) n), C (m, n). A batch's rows and n need not be
    whole tiles with ``tma_store`` (n a multiple of 8). Global symbol ``batched_gemm``. ValueError
    when the shape, dtype or knobs do not fit (``check``)."""
    cfg = batched_check(shape, batches, dtype, knobs, space, default)
    return _gemm(cfg, "batched_gemm", [], lambda acc, _up, _operands, _row, _col: acc * T.float32(scale), False)


def swiglu(shape: dict, dtype: str = "float16", knobs: dict | None = None, b_layout: str = "nk"):
    """The tirx PrimFunc ``(A, Wg, Wu, C)`` computing C = silu(A @ Wg^T) * (A @ Wu^T), Wg and Wu
    stored as ``b_layout`` ((N, K) for "nk"), for ``shape`` {"m", "n", "k"}; global symbol
    ``gemm_swiglu``. Knobs from ``SWIGLU_KNOBS`` (BN at most 128). ValueError when the shape, dtype
    or knobs do not fit."""
    cfg = _config(shape, dtype, knobs, 2, b_layout)
    return _gemm(cfg, "gemm_swiglu", [("X", cfg["b_shape"], dtype)], lambda acc, up, _wu, _row, _col: _silu(acc) * up,
                 True)


def add_residual(acc, residual, row, col):
    return acc + residual


def gemm_residual(shape: dict, dtype: str = "float16", knobs: dict | None = None, epilogue=add_residual,
                  b_layout: str = "nk", name: str = "gemm_residual"):
    """The tirx PrimFunc ``(A, B, R, C)`` computing C[i, j] = epilogue(acc[i, j], R[i, j], i, j) with
    acc = A @ B^T in float32, R (M, N) read as float32, B stored as ``b_layout``; the default
    epilogue adds R (a residual). ``epilogue`` builds a float32 TIR expression (a down projection's
    dropout mask, say); its result is rounded once into C. Global symbol ``name``."""
    cfg = _config(shape, dtype, knobs, 1, b_layout)

    def residual(acc, _up, operands, row, col):
        return epilogue(acc, T.Cast("float32", operands[0][row, col]), row, col)

    return _gemm(cfg, name, [("X", (cfg["m"], cfg["n"]), dtype)], residual, False)


def int8_check(shape: dict, knobs: dict | None = None) -> tuple[int, int, int, dict]:
    """``check`` of the int8 GEMM: int8 operands, knobs from ``INT8_KNOBS``."""
    return check(shape, "int8", knobs, space=INT8_KNOBS, default=INT8_DEFAULT_KNOBS, dtypes=INT8_DTYPES)


def gemm_int8_dequant(shape: dict, knobs: dict | None = None, relu: bool = True):
    """The tirx PrimFunc ``(x_q, w_q, x_scale, w_scale, b, y)`` computing y = [relu](float32(x_q @
    w_q^T) * (x_scale[0] * w_scale) + b) for ``shape`` {"m", "n", "k"}: x_q (m, k) and w_q (n, k)
    int8, their products accumulated exactly in int32 by ``wgmma ... k32.s32.s8.s8``; x_scale (1,),
    w_scale (n,), b (n,) and y (m, n) float32. Knobs from ``INT8_KNOBS`` (BK 128); global symbol
    ``gemm_int8_dequant[_relu]``. ValueError when the shape or knobs do not fit."""
    cfg = _config(shape, "int8", knobs, 1, "nk", "float32", INT8_KNOBS, INT8_DEFAULT_KNOBS, INT8_DTYPES)
    n = cfg["n"]

    def dequant(acc, _up, operands, _row, col):
        x_scale, w_scale, bias = operands
        # the scale product first, as the pattern (and ONNX's Mul(x_scale, w_scale)) computes it
        value = acc * (x_scale[0] * w_scale[col]) + bias[col]
        return T.max(value, T.float32(0)) if relu else value

    operands = [("X_scale", (1,), "float32"), ("W_scale", (n,), "float32"), ("Bias", (n,), "float32")]
    return _gemm(cfg, "gemm_int8_dequant_relu" if relu else "gemm_int8_dequant", operands, dequant, False)


# Weight-only-quantised GEMM (``gemm_woq``): y = x @ dequant(W)^T + b with W int8 or packed int4.
# The roles of the operands swap: wgmma's A is W dequantised (features, 64 a consumer warpgroup), its
# N the tokens (``block_n``, down to 16 for a decode batch), so x is B, loaded by TMA as a weight is.
WOQ_KNOBS = {**KNOBS, "block_n": (16, 32, 64, 128, 256), "specialised": (1,), "dequant_first": (0, 1)}
# 256 tokens a tile: each CTA dequantises its features' W once per token tile, so the widest tile
# dequantises least (m = n = k = 4096 on an H100: 0.305 ms against BN 128's 0.480; README)
WOQ_DEFAULT_KNOBS = {**DEFAULT_KNOBS, "block_n": 256, "dequant_first": 0}
# The producer dequantises (its registers hold 8 values, their scale and addresses; 40 spill), so
# it keeps more of its share: 128 x 96 + 256 x 200 <= 384 x 168.
WOQ_REGISTERS = {2: (96, 200)}
WOQ_BITS = (4, 8)


def woq_slot_bytes(knobs: dict, bits: int) -> int:
    """One ring slot of the woq kernel: W's raw bytes, W dequantised (BM x BK) and x's tile (BN x BK)."""
    bm, bn, bk = tile_shape(knobs)
    return bm * bk * bits // 8 + (bm + bn) * bk * 2


def woq_check(shape: dict, dtype: str, knobs: dict | None = None) -> tuple[int, int, int, int, int, dict]:
    """(m, n, k, bits, group, resolved knobs) when ``gemm_woq`` can compute ``shape`` ({"m", "n",
    "k", "bits", "group"}: x (m, k), W (n, k) quantised to ``bits`` with a scale per ``group`` values
    of a row) in ``dtype`` with ``knobs`` (``WOQ_KNOBS``); ValueError saying why not otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"wgmma kernels take {' or '.join(DTYPES)}, not {dtype}")
    knobs = resolve_knobs(knobs, WOQ_KNOBS, WOQ_DEFAULT_KNOBS)
    try:
        m, n, k, bits, group = (int(shape[key]) for key in ("m", "n", "k", "bits", "group"))
    except (KeyError, TypeError):
        raise ValueError(f"shape needs integer m, n, k, bits, group; got {shape!r}") from None
    if bits not in WOQ_BITS:
        raise ValueError(f"bits={bits}: weights of 4 or 8 bits")
    if group <= 0 or group % 8 or k % group:
        raise ValueError(f"group={group}: a multiple of 8 (the values one thread dequantises) dividing k={k}")
    bm, bn, bk = tile_shape(knobs)
    for name, size, tile, what in (("m", m, bn, "block_n"), ("n", n, bm, "64 x warpgroups"), ("k", k, bk, "block_k")):
        if size <= 0 or size % tile:
            raise ValueError(f"{name}={size} is not a positive multiple of {tile} ({what})")
    if m * n >= 1 << 31 or max(m, n) * k >= 1 << 31:
        raise ValueError(f"m={m}, n={n}, k={k}: operands over 2^31 elements (int32 indices)")
    if knobs["dequant_first"]:
        # W dequantised once, then the GEMM at its own default tile: one configuration, the other
        # knobs at their defaults
        if any(knobs[name] != WOQ_DEFAULT_KNOBS[name] for name in KNOBS):
            raise ValueError("dequant_first=1 runs the GEMM's own tile: the other knobs stay at their defaults")
        check({"m": m, "n": n, "k": k}, dtype, fill_tile({"m": m, "n": n, "k": k}, dtype))
        return m, n, k, bits, group, knobs
    smem = knobs["stages"] * (woq_slot_bytes(knobs, bits) + 24)
    if smem > SHARED_MEMORY_LIMIT:
        raise ValueError(f"{smem} bytes of shared memory (stages={knobs['stages']}, {bm} features x {bn} tokens) "
                         f"exceed the {SHARED_MEMORY_LIMIT} a CTA may have")
    return m, n, k, bits, group, knobs


# Tokens from which W dequantised once, then the GEMM (``dequant_first``), beats dequantising W's
# tiles per token tile (n = k = 4096 on an H100: 0.072 against 0.080 ms at 1024 tokens, 0.223
# against 0.305 at 4096; at 512 the fused kernel's 0.048 was the best found; README)
WOQ_DEQUANT_FIRST_TOKENS = 1024


def woq_fill_tile(shape: dict, dtype: str) -> dict:
    """Knobs over ``WOQ_DEFAULT_KNOBS`` for ``shape``: from ``WOQ_DEQUANT_FIRST_TOKENS`` tokens W
    dequantised first; else the widest token tile that divides m (up to the default's), then one
    consumer warpgroup (64 features a CTA) where two would leave SMs idle."""
    knobs = dict(WOQ_DEFAULT_KNOBS)
    m, n = int(shape.get("m", 0)), int(shape.get("n", 0))
    if m >= WOQ_DEQUANT_FIRST_TOKENS:
        try:
            return woq_check(shape, dtype, {**knobs, "dequant_first": 1})[5]
        except ValueError:
            pass
    fitting = [bn for bn in WOQ_KNOBS["block_n"] if bn <= knobs["block_n"] and m % bn == 0]
    if fitting:
        knobs["block_n"] = max(fitting)
    if n % 128 or wave_fill(n // 128 * max(m // knobs["block_n"], 1)) < WAVE_FILL_MIN:
        knobs["warpgroups"] = 1
    try:
        return woq_check(shape, dtype, knobs)[5]
    except ValueError:
        return dict(WOQ_DEFAULT_KNOBS)


@T.macro(hygienic=False)
def _load_raw(slot, kslice):
    # W's bytes of K slice `kslice` for the CTA's BM features into raw slot `slot`
    T.ptx[TMA](Ws.ptr_to([slot, 0, 0]), T.address_of(W_map), kslice * RAW_BK, by * BM, T.address_of(raw_full[slot]))
    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(raw_full[slot]), T.uint32(RAW_BYTES))


@T.macro(hygienic=False)
def _dequantise(kt):
    # W's slice kt, raw in its slot, to `dtype` in the same slot of As, 8 values (one 16-byte chunk of
    # a 128-byte row) at a time: thread tx takes chunk tx % 8 of rows tx // 8 + 16 i, stored at the
    # chunk the 128-byte swizzle puts it (chunk ^ row % 8), as TMA would have
    for i in T.unroll(BM // 16):
        f = T.meta_var(i * 16 + tx // 8)
        c = T.meta_var(tx % 8)
        scale[0] = scales[by * BM + f, (kt * BK + c * 8) // GROUP]
        if BITS == 8:
            raw8[0] = W8[kt % STAGES, f, c]
            for e in T.unroll(8):
                out_h[e] = T.Cast(DTYPE, T.Cast("float32", raw_b[e]) * scale[0])
        else:
            raw4[0] = W4[kt % STAGES, f, c]
            for e in T.unroll(8):
                # nibble e (value kk = 2 byte + half): two's complement of 4 bits, (u ^ 8) - 8
                out_h[e] = T.Cast(DTYPE, T.Cast("float32", T.Cast("int32", (raw4[0] >> T.uint32(4 * e)) & T.uint32(15) ^ T.uint32(8)) - 8)
                                  * scale[0])
        As16[kt % STAGES, f, T.bitwise_xor(c, tx // 8 % 8)] = out16[0]


@T.macro(hygienic=False)
def _dequant_producer_loop():
    # The whole producer warpgroup: raw W runs up to STAGES slices ahead (its slot is free once
    # dequantised); x's tile and W dequantised fill slot kt % STAGES once the consumers released it.
    # The slot's full barrier takes thread 0's expect_tx and the 128 threads' arrivals after their
    # stores (made visible to wgmma's async proxy by the fence).
    if tx == 0:
        for s in T.unroll(PROLOGUE):
            _load_raw(s, s)
    for kt in T.serial(KT):
        if kt >= STAGES:
            T.cuda.mbarrier_wait(T.address_of(empty[kt % STAGES]), (kt // STAGES + 1) % 2)
        if tx == 0:
            T.ptx[TMA](Bs.ptr_to([kt % STAGES, 0, 0]), T.address_of(B_map), kt * BK, bx * BN, T.address_of(bars[kt % STAGES]))
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[kt % STAGES]), T.uint32(STAGE_BYTES))
        T.cuda.mbarrier_wait(T.address_of(raw_full[kt % STAGES]), kt // STAGES % 2)
        _dequantise(kt)
        T.ptx.fence.proxy.async_.shared__cta()
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[kt % STAGES]))
        # every producer thread has read raw slot kt % STAGES: it takes slice kt + STAGES
        T.cuda.warpgroup_sync(1)
        if tx == 0:
            if kt + STAGES < KT:
                _load_raw(kt % STAGES, kt + STAGES)


def dequantise_weights(n: int, k: int, bits: int, group: int, dtype: str = "float16", threads: int = 256):
    """The tirx PrimFunc ``(w, scales, wd)`` writing W dequantised, wd (n, k) in ``dtype`` = q *
    scale in float32, rounded once (as ``gemm_woq``'s producer does): a thread per 8 values, one 16-
    byte store each. Global symbol ``woq_dequantise``."""
    per, chunks = 8 // bits, n * k // 8
    blocks = -(-chunks // threads)
    w_dtype = "uint8" if bits == 4 else "int8"

    @T.macro
    def kernel(w, scales, wd):
        T.device_entry()
        bx = T.cta_id([blocks])
        tx = T.thread_id([threads])
        # 8 values: 8 bytes of int8 or 4 of packed int4; 16 bytes of the dtype
        W8 = T.decl_buffer((chunks,), "uint32x2", data=w.data)
        W4 = T.decl_buffer((chunks,), "uint32", data=w.data)
        WD16 = T.decl_buffer((chunks,), "uint32x4", data=wd.data)
        raw8 = T.alloc_buffer((1,), "uint32x2", scope="local")
        raw_b = T.decl_buffer((8,), "int8", data=raw8.data, scope="local")
        raw4 = T.alloc_buffer((1,), "uint32", scope="local")
        out16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        out_h = T.decl_buffer((8,), dtype, data=out16.data, scope="local")
        scale = T.alloc_buffer((1,), "float32", scope="local")
        chunk = T.meta_var(bx * threads + tx)
        if chunk < chunks:
            scale[0] = scales[chunk // (k // 8), chunk % (k // 8) * 8 // group]
            if bits == 8:
                raw8[0] = W8[chunk]
                for e in T.unroll(8):
                    out_h[e] = T.Cast(dtype, T.Cast("float32", raw_b[e]) * scale[0])
            else:
                raw4[0] = W4[chunk]
                for e in T.unroll(8):
                    out_h[e] = T.Cast(dtype, T.Cast("float32", T.Cast(
                        "int32", (raw4[0] >> T.uint32(4 * e)) & T.uint32(15) ^ T.uint32(8)) - 8) * scale[0])
            WD16[chunk] = out16[0]

    @T.prim_func
    def dequantise(w_h: T.handle, scales_h: T.handle, wd_h: T.handle):
        w = T.match_buffer(w_h, (n, k // per), w_dtype, align=16)
        scales = T.match_buffer(scales_h, (n, k // group), "float32", align=16)
        wd = T.match_buffer(wd_h, (n, k), dtype, align=16)
        kernel(w, scales, wd)

    return _mark(dequantise, "woq_dequantise")


def _woq_dequant_first(m: int, n: int, k: int, bits: int, group: int, dtype: str):
    """W dequantised once into a workspace, then ``gemm_bias_act`` (no activation) at its own
    default tile: two kernels in one PrimFunc (``tirx_sequence``), the composite's parameters the
    pattern's."""
    from .tirx_sequence import buffer, sequence, workspace

    per = 8 // bits
    shape = {"m": m, "n": n, "k": k}
    gemm = gemm_bias_act(shape, dtype, fill_tile(shape, dtype), act="none")
    x, b, y = buffer("x", (m, k), dtype), buffer("b", (n,), dtype), buffer("y", (m, n), dtype)
    w = buffer("w", (n, k // per), "uint8" if bits == 4 else "int8")
    scales = buffer("scales", (n, k // group), "float32")
    wd = workspace("wd", (n, k), dtype)
    return sequence("gemm_woq", [x, w, scales, b, y],
                    [(dequantise_weights(n, k, bits, group, dtype), [w, scales, wd]), (gemm, [x, wd, b, y])], [wd])


def gemm_woq(shape: dict, dtype: str = "float16", knobs: dict | None = None):
    """The tirx PrimFunc ``(x, w, scales, b, y)`` of the woq_matmul pattern: y = x @ dequant(W)^T + b,
    x (m, k) and b, y in ``dtype``; W (n, k) int8, or for ``bits`` 4 uint8 (n, k / 2) with two's-
    complement nibbles, even k low; scales (n, k / group) float32. The producer warpgroup TMA-loads
    W's bytes and x's tile, dequantises W (q * scale in float32, rounded to ``dtype``) into the
    swizzled A slot and releases the slot to the consumers, whose wgmmas make y^T's tile (features x
    tokens) in float32; the epilogue adds b and stores y. Knobs from ``WOQ_KNOBS`` (always
    specialised); global symbol ``gemm_woq``. ValueError when the shape, dtype or knobs do not fit."""
    m, n, k, bits, group, knobs = woq_check(shape, dtype, knobs)
    if knobs["dequant_first"]:
        return _woq_dequant_first(m, n, k, bits, group, dtype)
    bm, bn, bk = tile_shape(knobs)
    stages, consumers, raster = knobs["stages"], knobs["warpgroups"], knobs["raster"]
    per = 8 // bits                      # values per stored byte
    raw_bk = bk // per                   # W's bytes of a K slice's row
    threads = 128 * (consumers + 1)
    registers = WOQ_REGISTERS.get(consumers)
    tiles_m, tiles_n = n // bm, m // bn  # feature tiles (wgmma's M), token tiles (its N)
    w_dtype = "uint8" if bits == 4 else "int8"
    kind = DTYPES[dtype]
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{kind}.{kind}"
    raw_map = [k // per, n, k // per, raw_bk, bm, 1, 1, 0, 0, 0, 0]  # no swizzle: rows of raw_bk bytes
    x_map = _tensor_map_args(m, k, bn, bk)

    @T.macro
    def kernel(x, w, scales, b, y):
        W_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", W_map, "int8", 2, w.data, *raw_map)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, dtype, 2, x.data, *x_map)
        T.device_entry()
        if registers is not None:
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        if raster == 1:
            bx, by = T.cta_id([tiles_n, tiles_m])
        else:
            cta = T.cta_id([tiles_m * tiles_n])
            rows: T.let[T.int32] = raster_rows(cta, tiles_m, tiles_n, raster, T.min)
            bx: T.let[T.int32] = raster_tile(cta, tiles_n, raster, rows)[0]
            by: T.let[T.int32] = raster_tile(cta, tiles_n, raster, rows)[1]
        tx = T.thread_id([threads])
        pool = T.SMEMPool()
        As = pool.alloc((stages, bm, bk), dtype, align=1024)
        Bs = pool.alloc((stages, bn, bk), dtype, align=1024)
        Ws = pool.alloc((stages, bm, raw_bk), "int8", align=128)
        bars = pool.alloc((stages,), "uint64", align=8)
        empty = pool.alloc((stages,), "uint64", align=8)
        raw_full = pool.alloc((stages,), "uint64", align=8)
        pool.commit()
        # 16-byte chunks of As's rows; W's raw rows as 8-byte (int8) or 4-byte (int4) chunks of 8 values
        # (views of the pool's buffers say where theirs start, in their own elements: the pool is one
        # allocation)
        As16 = T.decl_buffer((stages, bm, bk // 8), "uint32x4", data=As.data, elem_offset=As.elem_offset // 8,
                             scope="shared.dyn")
        W8 = T.decl_buffer((stages, bm, raw_bk // 8), "uint32x2", data=Ws.data, elem_offset=Ws.elem_offset // 8,
                           scope="shared.dyn")
        W4 = T.decl_buffer((stages, bm, raw_bk // 4), "uint32", data=Ws.data, elem_offset=Ws.elem_offset // 4,
                           scope="shared.dyn")
        desc_a: T.uint64
        desc_b: T.uint64
        acc = T.alloc_buffer((bn // 2,), "float32", scope="local")
        scale = T.alloc_buffer((1,), "float32", scope="local")
        raw8 = T.alloc_buffer((1,), "uint32x2", scope="local")
        raw_b = T.decl_buffer((8,), "int8", data=raw8.data, scope="local")
        raw4 = T.alloc_buffer((1,), "uint32", scope="local")
        out16 = T.alloc_buffer((1,), "uint32x4", scope="local")
        out_h = T.decl_buffer((8,), dtype, data=out16.data, scope="local")
        wg = T.meta_var(tx // 128 - 1)
        BM, BN, BK, KT, STAGES, NACC = T.meta_var((bm, bn, bk, k // bk, stages, bn // 2))
        PROLOGUE = T.meta_var(min(stages, k // bk))
        STAGE_BYTES, RAW_BYTES, RAW_BK = T.meta_var((bn * bk * 2, bm * raw_bk, raw_bk))
        WAIT_DEPTH, BITS, GROUP, DTYPE = T.meta_var((knobs["wait_depth"], bits, group, dtype))
        MMA, TMA, SWIZZLE = T.meta_var((mma, _TMA_LOAD, _SWIZZLE_128B))
        MMA_FLAGS, MMA_N, PARTS, KSTEP = T.meta_var(((True, 1, 1, 0, 0), bn, 1, 16))
        MMA_NACC, ACC_ZERO, ACC_DTYPE = T.meta_var((bn // 2, tvm.tirx.const(0, "float32"), "float32"))
        B_KN, B_LEADING, TRANS_B, TWO_WEIGHTS = T.meta_var((False, 1, 0, False))
        if tx == 0:
            for s in T.unroll(STAGES):
                # full: thread 0's expect_tx and the producer's 128 arrivals after dequantising
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(129))
                T.ptx.mbarrier.init.shared.b64(T.address_of(empty[s]), T.uint32(consumers))
                T.ptx.mbarrier.init.shared.b64(T.address_of(raw_full[s]), T.uint32(1))
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        if tx < 128:
            if registers is not None:
                T.ptx["setmaxnreg.dec.sync.aligned.u32"](registers[0])
            _dequant_producer_loop()
        else:
            if registers is not None:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](registers[1])
            _consumer_loop()
            # acc[4j + 2 half + pair] is feature row (by, wg, tx, half), token column (bx, j, tx, pair)
            for j in T.unroll(bn // 8):
                for half in T.unroll(2):
                    feature = T.meta_var(_row(by, bm, wg, tx, half))
                    for pair in T.unroll(2):
                        y[_col(bx, bn, j, tx, pair), feature] = T.Cast(
                            dtype, acc[j * 4 + half * 2 + pair] + T.Cast("float32", b[feature]))

    @T.prim_func
    def gemm(x_h: T.handle, w_h: T.handle, scales_h: T.handle, b_h: T.handle, y_h: T.handle):
        x = T.match_buffer(x_h, (m, k), dtype, align=16)
        w = T.match_buffer(w_h, (n, k // per), w_dtype, align=16)
        scales = T.match_buffer(scales_h, (n, k // group), "float32", align=16)
        b = T.match_buffer(b_h, (n,), dtype, align=16)
        y = T.match_buffer(y_h, (m, n), dtype, align=16)
        kernel(x, w, scales, b, y)

    return _mark(gemm, "gemm_woq")


def build(func):
    """``func`` compiled for ``TARGET`` through the tirx pipeline (an Executable; ``.mod`` is the
    runtime module, callable on a GPU, whose CUDA source ``cuda_source`` reads anywhere)."""
    import tvm

    name = func.attrs["global_symbol"]
    return tvm.compile(tvm.IRModule({name: func}), target=tvm.target.Target(TARGET), tir_pipeline="tirx")


def cuda_source(executable) -> str:
    """The CUDA C source of a ``build`` result."""
    return executable.mod.imports[0].inspect_source()
