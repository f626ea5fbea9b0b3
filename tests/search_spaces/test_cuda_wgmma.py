"""The Hopper wgmma kernel templates (search_spaces/lib/cuda_wgmma.py) build to CUDA source for
sm_90a with every knob configuration of the one-role kernel and representative ones of the
warp-specialised kernel, keep the pipeline's invariants visible in that source (one barrier byte
count equal to the bytes a slot's TMA copies bring, one load per ring slot and a refill, the wait
depth asked for; specialised: the producer's and consumers' barriers, slots and phases evaluated
from the source's own expressions, no CTA-wide barrier in the K loop, setmaxnreg), store C two
columns per 4-byte word (8 bytes for float32), refuse shapes and knobs they cannot compute, and
compile with nvcc without spills or serialised wgmmas; the int8 GEMM likewise, with its s8 wgmma,
BK 128 and int32 accumulators. Nothing runs here (no GPU): benchmarks/gpu_gemm.py measures them on
an H200 or H100."""

import re
import shutil
import subprocess

import pytest

from tvm.script import tirx as T

from autofuse.measure import param_buffers
from search_spaces.lib import cuda_wgmma as W

SHAPE = {"m": 256, "n": 512, "k": 512}  # 8 K slices: more than any ring, so every config refills


def _kernel_body(source: str) -> str:
    """The kernel's definition (the helpers before it define the PTX wrappers)."""
    return source.split('extern "C" __global__')[-1]


def _source(func) -> str:
    return W.cuda_source(W.build(func))


def _expect_tx_bytes(body: str) -> list[int]:
    return [int(n) for n in re.findall(r"arrive_expect_tx_shared_b64\(.*\(uint\)(\d+)\);", body)]


def _values(body: str) -> list[str]:
    """The epilogue's assignments, one per element of C: into the pair of a packed store."""
    return [line for line in body.splitlines() if re.match(r"\s*out_pair_ptr\[[01]\] = ", line)]


def _packed_stores(body: str, word: str = "uint") -> int:
    """The stores of C, each two adjacent columns as one ``word`` (none of single elements)."""
    stores = re.findall(r"\(\((\w+)\*\)C_ptr\)\[.*\] = \(\((\w+)\*\)out_pair_ptr\)\[0\];", body)
    assert "C_ptr[" not in body and all(pair == (word, word) for pair in stores), stores[:2]
    return len(stores)


# The one-role kernel (thread 0 loads, a CTA-wide barrier per slice frees a slot) in the 2-D grid's
# order: what the tests of the loads' and refills' structure build
ONE_ROLE_KNOBS = {"specialised": 0, "raster": 1}
# The one-role kernel's space (specialised 0, raster 1): its every configuration
ONE_ROLE = [k for k in W.configs(SHAPE, "float16") if not k["specialised"] and k["raster"] == 1]


@pytest.mark.parametrize("knobs", ONE_ROLE, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_every_config_builds_with_its_pipeline(knobs):
    bm, bn, bk = W.tile_shape(knobs)
    body = _kernel_body(_source(W.gemm_bias_act(SHAPE, "float16", knobs, "relu")))
    assert f"__launch_bounds__({128 * knobs['warpgroups']})" in body
    assert f"wgmma_f16_ss_mma_async_sync_aligned_m64n{bn}k16_f32_f16_f16" in body
    # the prologue fills every slot, and one refill site follows; each waits for a slot's bytes
    assert _expect_tx_bytes(body) == [(bm + bn) * bk * 2] * (knobs["stages"] + 1)
    assert body.count("cp_async_bulk_tensor_g2s") == 2 * (knobs["stages"] + 1)
    assert ("wait_group_sync_aligned_1()" in body) == (knobs["wait_depth"] == 1)
    assert "max((acc_ptr[0] + ((float)X_ptr[" in body  # bias (the operand X) + ReLU on the accumulator
    assert _packed_stores(body) == bn // 4 and len(_values(body)) == bn // 2


def test_the_config_space():
    configs = W.configs(SHAPE, "float16")
    # the default: warp-specialised, in the grouped tile order
    assert W.DEFAULT_KNOBS in configs and W.DEFAULT_KNOBS["specialised"] == 1 and W.DEFAULT_KNOBS["raster"] == 8
    assert all(W.shared_memory_bytes(k) <= W.SHARED_MEMORY_LIMIT for k in configs)
    # each knob value of the specialised layout and the launch order doubles the one-role space
    assert len(configs) == 4 * len(ONE_ROLE)
    # the specialised kernel's empty barriers: 8 bytes a slot
    specialised = {**W.DEFAULT_KNOBS, "specialised": 1}
    one_role = {**W.DEFAULT_KNOBS, **ONE_ROLE_KNOBS}
    assert W.shared_memory_bytes(specialised) == W.shared_memory_bytes(one_role) + 8 * 4
    assert W.fill_tile({"m": 5632, "n": 384, "k": 4096}, "float16", default=specialised)["specialised"] == 1
    too_big = {**W.DEFAULT_KNOBS, "stages": 5}  # 5 x 48 KiB slots of a 128x256 tile
    assert too_big not in configs and W.shared_memory_bytes(too_big) > W.SHARED_MEMORY_LIMIT
    # n = 128 drops every BN 256 config, n = 192 every BN but 64
    assert {k["block_n"] for k in W.configs({**SHAPE, "n": 128}, "float16")} == {64, 128}
    assert {k["block_n"] for k in W.configs({**SHAPE, "n": 192}, "float16")} == {64}


MARKERS = {"relu": "max(", "gelu_tanh": "tanhf(", "gelu_erf": "erff(", "silu": "expf("}


@pytest.mark.parametrize("act", list(W.ACTIVATIONS))
def test_activations_in_the_epilogue(act):
    body = _kernel_body(_source(W.gemm_bias_act(SHAPE, "bfloat16", {"block_n": 128}, act)))
    assert "wgmma_bf16_ss_mma_async_sync_aligned_m64n128k16_f32_bf16_bf16" in body
    stores = _values(body)
    assert len(stores) == 4 * 128 // 8 and all("(nv_bfloat16)" in line for line in stores)
    assert _packed_stores(body) == 2 * 128 // 8
    for name, marker in MARKERS.items():
        assert (marker in stores[0]) == (name == act), (name, stores[0][-200:])


def test_fewer_k_slices_than_stages():
    # k = 128: two slices for a 4-slot ring: two loads, nothing to refill
    body = _kernel_body(_source(W.gemm_bias_act({**SHAPE, "k": 128}, "float16", ONE_ROLE_KNOBS)))
    assert len(_expect_tx_bytes(body)) == 2


def test_swiglu_shares_the_a_tile():
    knobs = {**W.SWIGLU_DEFAULT_KNOBS, **ONE_ROLE_KNOBS}
    bm, bn, bk = W.tile_shape(knobs)
    func = W.swiglu(SHAPE, "float16", ONE_ROLE_KNOBS)
    body = _kernel_body(_source(func))
    assert _expect_tx_bytes(body) == [(bm + 2 * bn) * bk * 2] * (knobs["stages"] + 1)
    assert body.count("cp_async_bulk_tensor_g2s") == 3 * (knobs["stages"] + 1)
    assert "U_map" in body and "acc_up_ptr[63]" in body
    assert "expf(" in body and "* acc_up_ptr[0]" in body
    with pytest.raises(ValueError, match="block_n=256"):
        W.swiglu(SHAPE, "float16", {"block_n": 256})


@pytest.mark.parametrize("block_n", [64, 256])
def test_weights_stored_k_by_n_load_in_64_column_boxes(block_n):
    """B stored (K, N) (x @ W's W): BN/64 TMA boxes per slot, N-major descriptors (trans-b)."""
    knobs = {"block_n": block_n, "stages": 2, **ONE_ROLE_KNOBS}
    bm, bn, bk = W.tile_shape({**W.DEFAULT_KNOBS, **knobs})
    func = W.gemm_bias_act(SHAPE, "float16", knobs, "none", b_layout="kn")
    assert [int(x) for x in func.params[1].shape] == [SHAPE["k"], SHAPE["n"]]
    body = _kernel_body(_source(func))
    assert _expect_tx_bytes(body) == [(bm + bn) * bk * 2] * 3
    assert body.count("cp_async_bulk_tensor_g2s") == (1 + bn // 64) * 3
    # the leading offset is one 64-column box of BK rows (512 x 16 bytes); the last mma flag transposes B
    assert re.search(r"encode_matrix_descriptor\(.*, 512, 64, 3\)", body)
    assert f"m64n{bn}k16_f32_f16_f16_1_1_0_1(" in body and "_1_1_0_0(" not in body


def test_swiglu_with_weights_stored_k_by_n():
    body = _kernel_body(_source(W.swiglu(SHAPE, "bfloat16", {"block_n": 128, **ONE_ROLE_KNOBS}, b_layout="kn")))
    bm, bn, bk = W.tile_shape(W.SWIGLU_DEFAULT_KNOBS)
    assert _expect_tx_bytes(body)[0] == (bm + 2 * bn) * bk * 2
    assert body.count("cp_async_bulk_tensor_g2s") == (1 + 2 * bn // 64) * (W.SWIGLU_DEFAULT_KNOBS["stages"] + 1)


def test_gemm_residual_epilogue():
    def scaled(acc, residual, row, col):
        return residual + acc * T.float32(0.5)

    func = W.gemm_residual(SHAPE, "float16", {"block_n": 128}, scaled, name="down")
    assert func.attrs["global_symbol"] == "down"
    stores = _values(_kernel_body(_source(func)))
    assert len(stores) == 4 * 128 // 8
    assert all("X_ptr[" in line and "0x1p-1f" in line for line in stores), stores[0]
    with pytest.raises(ValueError, match="b_layout 'mn'"):
        W.gemm_residual(SHAPE, "float16", b_layout="mn")


def test_marked_for_the_mixed_pipeline():
    func = W.gemm_bias_act(SHAPE, "float16", None, "gelu_erf")
    assert func.attrs["global_symbol"] == "gemm_bias_gelu_erf"
    assert bool(func.attrs["autofuse.tirx"]) and bool(func.attrs["tirx.is_scheduled"])
    assert W.swiglu(SHAPE).attrs["global_symbol"] == "gemm_swiglu"


@pytest.mark.parametrize("shape, dtype, knobs, act, message", [
    ({"m": 200, "n": 512, "k": 512}, "float16", None, "relu", "m=200 is not a positive multiple of the tile's 128"),
    ({"m": 64, "n": 512, "k": 512}, "float16", None, "relu", "m=64"),
    ({"m": 256, "n": 384, "k": 512}, "float16", None, "relu", "n=384 is not a positive multiple of the tile's 256"),
    ({"m": 256, "n": 512, "k": 96}, "float16", None, "relu", "k=96"),
    ({"m": 256, "n": 512}, "float16", None, "relu", "shape needs integer m, n, k"),
    (SHAPE, "float32", None, "relu", "float16 or bfloat16, not float32"),
    (SHAPE, "float16", {"stages": 5}, "relu", "shared memory"),
    (SHAPE, "float16", {"stages": 7}, "relu", r"stages=7 is not one of \[2, 3, 4, 5\]"),
    (SHAPE, "float16", {"bm": 64}, "relu", "unknown knob 'bm'"),
    (SHAPE, "float16", None, "tanh", "activation 'tanh' is not one of"),
])
def test_what_it_cannot_compute_raises(shape, dtype, knobs, act, message):
    with pytest.raises(ValueError, match=message):
        W.gemm_bias_act(shape, dtype, knobs, act)


def test_a_smaller_tile_takes_what_the_default_refuses():
    shape = {"m": 64, "n": 384, "k": 512}
    W.gemm_bias_act(shape, "float16", {"block_n": 128, "warpgroups": 1})


@pytest.mark.parametrize("m, n, k, tile", [
    (4096, 4096, 4096, (2, 256)),     # 512 CTAs of the default: kept
    (1024, 4096, 4096, (2, 256)),     # 128 CTAs, 97% of the SMs: kept
    (128, 4096, 4096, (1, 64)),       # 16 of 128 x 256; 128 of 64 x 64
    (5632, 384, 4096, (2, 128)),      # BN 256 does not divide n; 132 of 128 x 128 fill the SMs
    (128, 256, 256, (1, 64)),         # nothing fills: the most CTAs
    (100, 256, 256, (2, 256)),        # no tile divides m: the default, which check refuses
])
def test_the_default_tile_shrinks_where_it_would_leave_sms_idle(m, n, k, tile):
    knobs = W.fill_tile({"m": m, "n": n, "k": k}, "float16")
    assert (knobs["warpgroups"], knobs["block_n"]) == tile
    # a 64 x 64 tile (a third of the default's bytes per k slice) takes the deepest ring that fits
    assert knobs["stages"] == (max(W.KNOBS["stages"]) if tile == (1, 64) else W.DEFAULT_KNOBS["stages"])
    # one consumer warpgroup: the one-role kernel
    assert knobs["specialised"] == (W.DEFAULT_KNOBS["specialised"] if tile[0] == 2 else 0)
    assert {key: v for key, v in knobs.items() if key not in ("warpgroups", "block_n", "stages", "specialised")} == {
        key: v for key, v in W.DEFAULT_KNOBS.items() if key not in ("warpgroups", "block_n", "stages", "specialised")}
    assert W.wave_fill(132) == W.wave_fill(264) == 1.0 and W.wave_fill(133) == 133 / 264


# --- the warp-specialised kernel ------------------------------------------------------------------

def _c_int(expr: str, **names) -> int:
    """A C integer expression of the kernel source (non-negative operands), evaluated."""
    return eval(expr.replace(" / ", " // ").replace("&&", " and ").replace("||", " or "), {}, names)


_BARRIER = r"\(&\(\(\(uint64_t\*\)pool_buf_ptr\)\[(.+?)\]\)\)"
_INIT = re.compile(r"mbarrier_init_init_shared_b64\(tvm_builtin_cuda_cvta_generic_to_shared\(" + _BARRIER
                   + r"\), \(uint\)(\d+)\);")
_WAIT = re.compile(r"tvm_builtin_cuda_mbarrier_wait\(" + _BARRIER + r", (.+)\);$", re.M)
_ARRIVE = re.compile(r"mbarrier_arrive_nocount_arrive_shared_b64\(tvm_builtin_cuda_cvta_generic_to_shared\(" + _BARRIER)
_PRODUCER = "  if (((int)threadIdx.x) < 128) {\n"


def _roles(body: str) -> tuple[str, str, str]:
    """(before the roles split, the producer warpgroup's branch, the consumers' branch)."""
    start, rest = body.split(_PRODUCER)
    producer, consumers = rest.split("\n  } else {\n", 1)
    return start, producer, consumers


def _check_specialised(body: str, knobs: dict, slot: int, copies: int, k: int) -> tuple[str, str]:
    """The invariants of a specialised kernel with ``knobs`` (resolved), ``slot`` bytes a slice
    in ``copies`` TMA copies, over ``k`` // BK slices: the ring's barriers, who waits on which at
    which phase, who arrives, and that only the consumers compute and store. (producer, consumers)."""
    stages, consumers, depth = knobs["stages"], knobs["warpgroups"], knobs["wait_depth"]
    slices = k // W.tile_shape(knobs)[2]
    full = stages * slot // 8        # the barriers follow the ring's slots, in uint64 units
    empty = full + stages
    start, producer, consumer = _roles(body)
    threads = 128 * (consumers + 1)
    assert f"__launch_bounds__({threads}{', 1' if consumers == 2 else ''})" in body
    # one CTA-wide barrier, after the barriers' initialisation: none in the K loop
    assert body.count("tvm_builtin_cuda_cta_sync();") == start.count("tvm_builtin_cuda_cta_sync();") == 1
    inits = {_c_int(index): int(count) for index, count in _INIT.findall(start)}
    assert inits == {**{full + s: 1 for s in range(stages)}, **{empty + s: consumers for s in range(stages)}}
    # setmaxnreg: with two consumer warpgroups the producer's registers go to them
    assert ("setmaxnreg_dec_sync_aligned_u32_40();" in producer) == (consumers == 2)
    assert ("setmaxnreg_inc_sync_aligned_u32_232();" in consumer) == (consumers == 2)
    # the producer: slice kt into slot kt % stages once its empty barrier completed the phase of
    # slice kt - stages (parity (kt // stages - 1) % 2); nothing to wait for on the first pass
    [(index, parity)] = _WAIT.findall(producer)
    [guard] = re.findall(r"if \((.+)\) \{\n\s*tvm_builtin_cuda_mbarrier_wait", producer)
    assert [_c_int(guard, kt=kt) for kt in range(slices)] == [kt >= stages for kt in range(slices)]
    for kt in range(stages, slices):
        assert _c_int(index, kt=kt) == empty + kt % stages
        assert _c_int(parity, kt=kt) == (kt // stages - 1) % 2
    assert _expect_tx_bytes(producer) == [slot] and producer.count("cp_async_bulk_tensor_g2s") == copies
    assert "mma_async" not in producer and "C_ptr)[" not in producer and not _ARRIVE.findall(producer)
    # the consumers: slice kt landed in its slot's full barrier's phase kt // stages; one thread
    # of each releases the slot whose wgmma group has retired (depth 1: the previous slice's)
    [(index, parity)] = _WAIT.findall(consumer)
    [arrive] = _ARRIVE.findall(consumer)
    assert consumer.count("if ((((int)threadIdx.x) % 128) == 0) {") == 1
    guards = re.findall(r"if \((.+)\) \{\n\s*if \(\(\(\(int\)threadIdx\.x\) % 128\) == 0\) \{", consumer)
    assert [[_c_int(guard, kt_1=kt) for kt in range(slices)] for guard in guards] == \
        ([[kt >= 1 for kt in range(slices)]] if depth == 1 else [])
    for kt in range(slices):
        assert _c_int(index, kt_1=kt) == full + kt % stages
        assert _c_int(parity, kt_1=kt) == kt // stages % 2
        if kt >= depth:
            assert _c_int(arrive, kt_1=kt) == empty + (kt - depth) % stages
    # in the loop the wait depth asked for; after it all retired, and the accumulators pinned there
    assert consumer.count(f"wait_group_sync_aligned_{depth}();") == 2 - depth
    assert re.search(r"wait_group_sync_aligned_0\(\);\n\s*autofuse_pin_(float32|uint32)\(acc_ptr\[0\]\);", consumer)
    assert "cp_async_bulk_tensor_g2s" not in consumer
    assert "mma_async" not in start and "C_ptr)[" not in start
    return producer, consumer


SPECIALISED = [
    {"specialised": 1},                                                     # the default tile
    {"specialised": 1, "block_n": 128, "stages": 5, "wait_depth": 0},       # a slot freed after its own group
    {"specialised": 1, "block_n": 64, "warpgroups": 1, "stages": 2},        # one consumer: no setmaxnreg
    {"specialised": 1, "stages": 3, "raster": 8},
]


@pytest.mark.parametrize("knobs", SPECIALISED, ids=lambda k: "-".join(f"{n}{v}" for n, v in k.items()))
def test_the_specialised_kernel_keeps_its_producer_and_consumers_apart(knobs):
    resolved = {**W.DEFAULT_KNOBS, **knobs}
    bm, bn, bk = W.tile_shape(resolved)
    body = _kernel_body(_source(W.gemm_bias_act(SHAPE, "float16", knobs, "relu")))
    _, consumer = _check_specialised(body, resolved, (bm + bn) * bk * 2, 2, SHAPE["k"])
    assert consumer.count(f"wgmma_f16_ss_mma_async_sync_aligned_m64n{bn}k16_f32_f16_f16") == bk // 16
    # the epilogue: this consumer warpgroup's rows (its warpgroup index less the producer's)
    assert "max((acc_ptr[0] + ((float)X_ptr[" in consumer
    assert _packed_stores(consumer) == bn // 4 and len(_values(consumer)) == bn // 2


def test_specialised_swiglu_residual_and_weights_stored_k_by_n():
    knobs = {**W.SWIGLU_DEFAULT_KNOBS, "specialised": 1}
    bm, bn, bk = W.tile_shape(knobs)
    for layout, copies in (("nk", 3), ("kn", 1 + 2 * bn // 64)):
        body = _kernel_body(_source(W.swiglu(SHAPE, "bfloat16", knobs, b_layout=layout)))
        _, consumer = _check_specialised(body, knobs, (bm + 2 * bn) * bk * 2, copies, SHAPE["k"])
        assert "autofuse_pin_float32(acc_up_ptr[63]);" in consumer and "* acc_up_ptr[0]" in consumer
        assert _packed_stores(consumer) == bn // 4
    knobs = {**W.DEFAULT_KNOBS, "specialised": 1, "block_n": 128}
    body = _kernel_body(_source(W.gemm_residual(SHAPE, "float16", knobs, b_layout="kn")))
    _, consumer = _check_specialised(body, knobs, (128 + 128) * 64 * 2, 1 + 128 // 64, SHAPE["k"])
    assert "_1_1_0_1(" in consumer and all("X_ptr[" in line for line in _values(consumer))
    body = _kernel_body(_source(W.gemm_act(SHAPE, "float16", {"specialised": 1, "block_n": 64}, "gelu_tanh")))
    _check_specialised(body, {**W.DEFAULT_KNOBS, "specialised": 1, "block_n": 64}, (128 + 64) * 64 * 2, 2, SHAPE["k"])


def test_the_grouped_launch_order_visits_every_tile_once():
    for tiles_m, tiles_n in ((32, 16), (11, 3), (5, 7), (1, 4)):
        for raster in W.KNOBS["raster"]:
            tiles = [W.raster_tile(cta, tiles_n, raster, W.raster_rows(cta, tiles_m, tiles_n, raster))
                     for cta in range(tiles_m * tiles_n)]
            assert sorted(tiles) == sorted((x, y) for x in range(tiles_n) for y in range(tiles_m))
            # consecutive CTAs walk down a group's rows first, then one column on
            rows = min(raster, tiles_m)
            after = (1, 0) if tiles_n > 1 else (0, rows)
            assert tiles[:rows + 1] == [(0, y) for y in range(rows)] + [after][:len(tiles) - rows]
    # raster 1 is the 2-D grid's order: along the row of tiles
    assert [W.raster_tile(cta, 16, 1, W.raster_rows(cta, 32, 16, 1)) for cta in range(17)] == \
        [(x, 0) for x in range(16)] + [(0, 1)]
    # in the kernel: one linear CTA id (the last group 3 of 11 tile-rows of 128)
    body = _kernel_body(_source(W.gemm_bias_act({"m": 1408, "n": 384, "k": 128}, "float16",
                                                {"block_n": 128, "raster": 8})))
    assert "blockIdx.y" not in body and "int rows = " in body and "max(" in body.split("int rows = ")[1].split(";")[0]


# --- int8 operands --------------------------------------------------------------------------------

INT8_SHAPE = {"m": 256, "n": 512, "k": 1024}  # 8 K slices of 128


@pytest.mark.parametrize("knobs", [{}, {"block_n": 128, "stages": 6}, {"block_n": 64, "warpgroups": 1, "stages": 7,
                                                                        "wait_depth": 0}],
                         ids=["default-tile", "bn128-6stages", "bn64-1wg-7stages-wait0"])
def test_int8_builds_with_its_pipeline(knobs):
    knobs = {**knobs, **ONE_ROLE_KNOBS}
    resolved = {**W.INT8_DEFAULT_KNOBS, **knobs}
    bm, bn, bk = W.tile_shape(resolved)
    assert bk == 128
    func = W.gemm_int8_dequant(INT8_SHAPE, knobs)
    m, n, k = (INT8_SHAPE[key] for key in "mnk")
    assert [(tuple(int(d) for d in p.shape), str(p.dtype)) for p in param_buffers(func)] == \
        [((m, k), "int8"), ((n, k), "int8"), ((1,), "float32"), ((n,), "float32"), ((n,), "float32"), ((m, n), "float32")]
    # the tensor maps: int8, rows of k bytes, boxes of 128 bytes (one swizzle row)
    script = func.script()
    assert f'"int8", 2, A.data, {k}, {m}, {k}, 128, {bm}, 1, 1, 0, 3, 0, 0' in script
    assert f'"int8", 2, B.data, {k}, {n}, {k}, 128, {bn}, 1, 1, 0, 3, 0, 0' in script
    body = _kernel_body(_source(func))
    # BN 256 is two m64n128 (TVM's s8 wgmma stops at N 224), each k step 32 bytes further
    mma_n, parts = (128, 2) if bn == 256 else (bn, 1)
    calls = re.findall(r"wgmma_int_ss_mma_async_sync_aligned_m64n(\d+)k32_s32_s8_s8\(acc_ptr\[(\d+)\]", body)
    assert calls == [(str(mma_n), str(part * mma_n // 2)) for _ in range(bk // 32) for part in range(parts)]
    assert "acc_ptr[i] = (uint)0;" in body and f"uint acc_ptr[{bn // 2}]" in body
    assert _expect_tx_bytes(body) == [(bm + bn) * bk] * (resolved["stages"] + 1)
    assert body.count("cp_async_bulk_tensor_g2s") == 2 * (resolved["stages"] + 1)
    assert ("wait_group_sync_aligned_1()" in body) == (resolved["wait_depth"] == 1)
    # the epilogue: the int32 accumulator as float, scaled, biased, ReLU, stored float32, two columns
    # per 8-byte store
    stores = _values(body)
    assert len(stores) == bn // 2 and _packed_stores(body, "uint64_t") == bn // 4
    assert all("max(((((float)(*(int *)(&(v_" in line and "(X_scale_ptr[0] * W_scale_ptr[" in line
               and "Bias_ptr[" in line for line in stores), stores[0]


@pytest.mark.parametrize("knobs", [{"specialised": 1}, {"specialised": 1, "block_n": 64, "warpgroups": 1, "stages": 7}],
                         ids=["default", "bn64-1wg-7stages"])
def test_int8_specialised(knobs):
    resolved = {**W.INT8_DEFAULT_KNOBS, **knobs}
    bm, bn, bk = W.tile_shape(resolved)
    body = _kernel_body(_source(W.gemm_int8_dequant(INT8_SHAPE, knobs)))
    _, consumer = _check_specialised(body, resolved, (bm + bn) * bk, 2, INT8_SHAPE["k"])
    mma_n, parts = (128, 2) if bn == 256 else (bn, 1)
    calls = re.findall(r"wgmma_int_ss_mma_async_sync_aligned_m64n(\d+)k32_s32_s8_s8\(acc_ptr\[(\d+)\]", consumer)
    assert calls == [(str(mma_n), str(part * mma_n // 2)) for _ in range(bk // 32) for part in range(parts)]
    assert f"autofuse_pin_uint32(acc_ptr[{bn // 2 - 1}]);" in consumer
    assert _packed_stores(consumer, "uint64_t") == bn // 4


def test_int8_without_relu():
    func = W.gemm_int8_dequant(INT8_SHAPE, {"block_n": 128}, relu=False)
    assert func.attrs["global_symbol"] == "gemm_int8_dequant"
    stores = _values(_kernel_body(_source(func)))
    assert stores and not any("max(" in line for line in stores)


def test_int8_config_space():
    configs = W.configs(INT8_SHAPE, "int8", W.INT8_KNOBS, W.INT8_DEFAULT_KNOBS, dtypes=W.INT8_DTYPES)
    assert W.INT8_DEFAULT_KNOBS in configs and all(k["block_k"] == 128 for k in configs)
    assert all(W.shared_memory_bytes(k, "int8") <= W.SHARED_MEMORY_LIMIT for k in configs)
    # a 128 x 256 x 128 slot is 48 KiB, as float16's 128 x 256 x 64: 4 stages; 128 x 128 takes 7
    assert W.shared_memory_bytes(W.INT8_DEFAULT_KNOBS, "int8") == W.shared_memory_bytes(
        {**W.DEFAULT_KNOBS, "specialised": W.INT8_DEFAULT_KNOBS["specialised"]}, "float16")
    assert {**W.INT8_DEFAULT_KNOBS, "stages": 5} not in configs
    assert {**W.INT8_DEFAULT_KNOBS, "block_n": 128, "stages": 7} in configs


@pytest.mark.parametrize("shape, knobs, message", [
    ({**INT8_SHAPE, "m": 200}, None, "m=200 is not a positive multiple of the tile's 128"),
    ({**INT8_SHAPE, "n": 384}, None, "n=384 is not a positive multiple of the tile's 256"),
    ({**INT8_SHAPE, "k": 192}, None, "k=192 is not a positive multiple of the tile's 128"),
    (INT8_SHAPE, {"block_k": 64}, r"block_k=64 is not one of \[128\]"),
    (INT8_SHAPE, {"block_n": 128, "stages": 8}, r"stages=8 is not one of"),
    (INT8_SHAPE, {"stages": 5}, "shared memory"),
])
def test_what_the_int8_kernel_cannot_compute_raises(shape, knobs, message):
    with pytest.raises(ValueError, match=message):
        W.gemm_int8_dequant(shape, knobs)


def test_int8_operands_need_their_own_knobs_and_k_major_weights():
    with pytest.raises(ValueError, match="block_k=64 of int8 is not one 128-byte swizzle row"):
        W.check(INT8_SHAPE, "int8", W.DEFAULT_KNOBS, dtypes=W.INT8_DTYPES)
    with pytest.raises(ValueError, match="float16 or bfloat16, not int8"):
        W.gemm_bias_act(INT8_SHAPE, "int8")
    with pytest.raises(ValueError, match="K-major only"):
        W._config(INT8_SHAPE, "int8", None, 1, "kn", "float32", W.INT8_KNOBS, W.INT8_DEFAULT_KNOBS, W.INT8_DTYPES)


LARGE = {"m": 4096, "n": 4096, "k": 4096}
SPECIALISED_ON = {"specialised": 1}
# (kernel, 32-bit words of C each thread stores: BN / 4, the PTX store of a column pair)
NVCC = {
    "gemm_default": (lambda: W.gemm_bias_act(LARGE, "float16"), 64, "v2.u16"),
    "swiglu_default": (lambda: W.swiglu(LARGE, "bfloat16"), 32, "v2.u16"),
    "int8_default": (lambda: W.gemm_int8_dequant(LARGE), 64, "v2.f32"),
    # warp-specialised: BN 256 (swiglu 128), two consumer warpgroups and the producer
    "gemm_specialised": (lambda: W.gemm_bias_act(LARGE, "float16", SPECIALISED_ON), 64, "v2.u16"),
    "swiglu_specialised": (lambda: W.swiglu(LARGE, "bfloat16", SPECIALISED_ON), 32, "v2.u16"),
    "int8_specialised": (lambda: W.gemm_int8_dequant(LARGE, SPECIALISED_ON), 64, "v2.f32"),
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", sorted(NVCC))
def test_nvcc_compiles_without_spills(name, tmp_path):
    make, stores, pair = NVCC[name]
    src = tmp_path / "kernel.cu"
    src.write_text(_source(make()))
    result = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v", "--keep",
                             "--keep-dir", str(tmp_path), "-o", str(tmp_path / "kernel.cubin"), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ptxas = result.stdout + result.stderr
    assert "0 bytes spill stores" in ptxas and "0 bytes spill loads" in ptxas, ptxas[-2000:]
    assert "serialized" not in ptxas  # ptxas's warning when wgmmas cannot overlap (C7514/C7515)
    assert (tmp_path / "kernel.cubin").stat().st_size > 0
    if "specialised" in name:
        # 384 threads start with 168 registers each; setmaxnreg kept (C7508: ptxas dropped it)
        assert "Used 168 registers" in ptxas and "C7508" not in ptxas, ptxas[-2000:]
    # C two columns per store: one 4-byte (8-byte for float32) store instruction per pair
    ptx = (tmp_path / "kernel.ptx").read_text()
    assert re.findall(r"st\.global\.[\w.]+", ptx) == [f"st.global.{pair}"] * stores


# --- weight-only-quantised GEMM (gemm_woq) ------------------------------------------------------

WOQ_SHAPE = {"m": 256, "n": 512, "k": 512, "group": 64, "bits": 4}  # 8 K slices: every ring refills
WOQ = [
    ({"bits": 4}, {}),                                                   # 128 features x 256 tokens
    ({"bits": 8, "group": 32}, {"block_n": 16, "warpgroups": 1, "stages": 3, "wait_depth": 0}),
    ({"bits": 8}, {"block_n": 256, "raster": 1}),
]
_SCALE = re.compile(r"scale_ptr\[0\] = scales_ptr\[(.+)\];")
_RAW = re.compile(r"raw[48]_ptr\[0\] = \(\((uint2?)\*\)pool_buf_ptr\)\[(.+)\];")
_A_STORE = re.compile(r"\(\(uint4\*\)pool_buf_ptr\)\[(.+)\] = out16_ptr\[0\];")


@pytest.mark.parametrize("over, knobs", WOQ, ids=["int4-default", "int8-bn16-one-consumer", "int8-bn256"])
def test_woq_producer_dequantises_into_the_swizzled_a_tile(over, knobs):
    """gemm_woq: the producer warpgroup dequantises raw W slices (their own TMA ring) into wgmma's
    A tile where TMA's 128-byte swizzle would have put them, a scale per row and group; the full
    barrier completes on x's bytes and the 128 producer threads; the consumers store y^T's tile."""
    shape = {**WOQ_SHAPE, **over}
    resolved = {**W.WOQ_DEFAULT_KNOBS, **knobs}
    bm, bn, bk = W.tile_shape(resolved)
    stages, consumers = resolved["stages"], resolved["warpgroups"]
    bits, group, k = shape["bits"], shape["group"], shape["k"]
    raw_bk = bk * bits // 8
    body = _kernel_body(_source(W.gemm_woq(shape, "float16", knobs)))
    start, producer, consumer = _roles(body)
    # the pool: As, Bs (1024-aligned), the raw ring, then full, empty and raw barriers
    raw_at = stages * (bm + bn) * bk * 2
    full = (raw_at + stages * bm * raw_bk) // 8
    inits = {_c_int(index): int(count) for index, count in _INIT.findall(start)}
    assert inits == {**{full + s: 129 for s in range(stages)}, **{full + stages + s: consumers for s in range(stages)},
                     **{full + 2 * stages + s: 1 for s in range(stages)}}
    assert (f"setmaxnreg_dec_sync_aligned_u32_{W.WOQ_REGISTERS[2][0]}();" in producer) == (consumers == 2)
    # thread 0 prefetches a ring of raw slices, then per slice x's tile and the raw refill
    assert _expect_tx_bytes(producer) == [bm * raw_bk] * stages + [bn * bk * 2, bm * raw_bk]
    assert "tvm_builtin_cuda_warpgroup_sync(1);" in producer and "fence_proxy_proxy_async_shared__cta" in producer
    # each thread: BM / 16 chunks of 8 values, row tx / 8 + 16 i, chunk tx % 8
    raws, stores, scales = _RAW.findall(producer), _A_STORE.findall(producer), _SCALE.findall(producer)
    assert len(raws) == len(stores) == len(scales) == bm // 16
    word = 8 * bits // 8  # bytes of 8 values
    for i, ((ctype, raw), store, scale) in enumerate(zip(raws, stores, scales)):
        assert ctype == ("uint2" if bits == 8 else "uint")
        for kt in (0, 5):
            for t in (0, 9, 127):
                row, chunk = i * 16 + t // 8, t % 8
                names = {"kt": kt, "threadIdx.x": t}
                # CTA (0, 0): the first tile of features and of tokens
                expr = lambda e: _c_int(re.sub(r"\(\(int\)blockIdx\.[xy]\)", "0", e.replace("((int)threadIdx.x)", str(t))),
                                        **names)
                assert expr(raw) * word == raw_at + (kt % stages) * bm * raw_bk + row * raw_bk + chunk * word
                assert expr(store) * 16 == (kt % stages) * bm * bk * 2 + row * 128 + (chunk ^ row % 8) * 16
                assert expr(scale) == row * (k // group) + (kt * bk + chunk * 8) // group
    assert "mma_async" not in producer and "y_ptr[" not in producer
    assert consumer.count(f"{F16_WGMMA}m64n{bn}k16_f32_f16_f16_1_1_0_0(") == bk // 16
    assert "cp_async_bulk_tensor_g2s" not in consumer
    # y[token, feature]: one store per accumulator, the bias per feature
    assert consumer.count("y_ptr[") == bn // 2 and len(re.findall(r"\bb_ptr\[", consumer)) == bn // 2


F16_WGMMA = "wgmma_f16_ss_mma_async_sync_aligned_"


@pytest.mark.parametrize("shape, dtype, knobs, message", [
    ({**WOQ_SHAPE, "group": 4}, "float16", None, "multiple of 8"),
    ({**WOQ_SHAPE, "bits": 2}, "float16", None, "weights of 4 or 8 bits"),
    ({**WOQ_SHAPE, "m": 8}, "float16", {"block_n": 16}, "m=8 is not a positive multiple of 16"),
    ({**WOQ_SHAPE, "n": 96}, "float16", {"warpgroups": 2}, "n=96 is not a positive multiple of 128"),
    (WOQ_SHAPE, "float32", None, "float16 or bfloat16, not float32"),
    (WOQ_SHAPE, "float16", {"specialised": 0}, "knob specialised=0"),
])
def test_what_the_woq_kernel_cannot_compute_raises(shape, dtype, knobs, message):
    with pytest.raises(ValueError, match=message):
        W.gemm_woq(shape, dtype, knobs)


@pytest.mark.parametrize("m, n, expected", [
    (16, 4096, {"block_n": 16, "warpgroups": 1}),     # a decode batch: 64 features a CTA
    (512, 4096, {"warpgroups": 1}),                   # 256 tokens x 64 features a CTA
    (1024, 4096, {"dequant_first": 1}),               # from 1024 tokens W is dequantised first
    (4096, 4096, {"dequant_first": 1}),
    (96, 4096, {"block_n": 32, "warpgroups": 1}),
])
def test_the_woq_default_tile_follows_the_tokens(m, n, expected):
    shape = {"m": m, "n": n, "k": 4096, "group": 128, "bits": 4}
    assert W.woq_fill_tile(shape, "float16") == {**W.WOQ_DEFAULT_KNOBS, **expected}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("bits, knobs", [(4, None), (8, {"block_n": 16, "warpgroups": 1}), (4, {"dequant_first": 1})],
                         ids=["int4", "int8-bn16", "int4-dequant-first"])
def test_nvcc_compiles_the_woq_kernel_without_spills(bits, knobs, tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text(_source(W.gemm_woq({"m": 4096, "n": 4096, "k": 4096, "group": 128, "bits": bits}, "bfloat16",
                                      knobs)))
    result = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
                             "-o", str(tmp_path / "kernel.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ptxas = result.stdout + result.stderr
    assert "spill" in ptxas and not re.search(r"[1-9]\d* bytes spill", ptxas), ptxas[-2000:]
    assert "serialized" not in ptxas and "C7508" not in ptxas, ptxas[-2000:]
    if knobs is None:
        assert "Used 168 registers" in ptxas, ptxas[-2000:]


def test_woq_dequant_first_is_two_kernels_and_one_configuration():
    """dequant_first=1: W dequantised once into a workspace (8 values, one 16-byte store a thread,
    q * scale in float32 rounded once), then the float16 GEMM at its own default tile, bias only;
    the other knobs stay at their defaults, so the search meets it once."""
    shape = {"m": 256, "n": 512, "k": 512, "group": 64, "bits": 4}
    func = W.gemm_woq(shape, "float16", {"dequant_first": 1})
    assert [str(b.dtype) for b in param_buffers(func)] == ["float16", "uint8", "float32", "float16", "float16"]
    source = _source(func)
    kernels = source.split('extern "C" __global__')[-2:]
    dequant, gemm = kernels
    assert "wd_ptr)[" in dequant and "= out16_ptr[0];" in dequant and "mma_async" not in dequant
    assert dequant.count("scale_ptr[0]))") == 8
    bm, bn, _ = W.tile_shape(W.fill_tile({"m": 256, "n": 512, "k": 512}, "float16"))
    assert f"m64n{bn}k16" in gemm and "cp_async_bulk_tensor_g2s" in gemm and "max(" not in gemm
    for knobs in ({"dequant_first": 1, "stages": 3}, {"dequant_first": 1, "block_n": 128}):
        with pytest.raises(ValueError, match="other knobs stay at their defaults"):
            W.gemm_woq(shape, "float16", knobs)
    with pytest.raises(ValueError, match="not a positive multiple"):  # the GEMM's 64-row tile
        W.gemm_woq({**shape, "m": 16}, "float16", {"dequant_first": 1})


# --- grouped GEMM (a mixture of experts' expert GEMMs) -------------------------------------------

@pytest.mark.parametrize("b_layout, offset", [("kn", "grp * 128"), ("nk", "grp * 256")])
def test_the_grouped_gemm_reads_its_groups_weight_and_skips_empty_tiles(b_layout, offset):
    func = W.grouped_gemm_act({"m": 512, "n": 256, "k": 128}, 4, "float16", {"warpgroups": 1, "block_n": 64},
                              act="relu", b_layout=b_layout, out_dtype="float32")
    # A (m, k), the 4 weights stacked, the group of every 64 rows, C in float32
    stacked = (4 * 128, 256) if b_layout == "kn" else (4 * 256, 128)
    assert [(tuple(int(d) for d in b.shape), str(b.dtype)) for b in param_buffers(func)] == [
        ((512, 128), "float16"), (stacked, "float16"), ((512 // W.GROUP_ROWS,), "int32"), ((512, 256), "float32")]
    body = _kernel_body(_source(func))
    # a 64-row tile reads its own entry; a tile of no group does nothing
    assert re.search(r"int grp = G_ptr\[.*\];\n\s*if \(0 <= grp\) \{", body), body[:2000]
    # every TMA copy of B starts at the group's weight
    copies = [line for line in body.splitlines() if "B_map" in line and "cp_async_bulk_tensor" in line]
    assert copies and all(offset in line for line in copies), copies


def test_a_grouped_gemm_needs_groups_and_one_weight():
    with pytest.raises(ValueError, match="groups=0"):
        W.grouped_gemm_act({"m": 512, "n": 256, "k": 128}, 0)
    with pytest.raises(ValueError, match="2\\^31"):
        W.grouped_gemm_act({"m": 512, "n": 16384, "k": 16384}, 16)


# --- split-K (gemm_split_k) -----------------------------------------------------------------------

SKINNY = {"m": 128, "n": 4096, "k": 4096}


@pytest.mark.parametrize("shape, knobs, message", [
    ({**SKINNY, "m": 512}, {}, "fill the SMs without splitting K"),
    ({**SKINNY, "k": 512}, {}, "not 4 shares of 4 or more"),          # 8 slices
    ({**SKINNY, "k": 4160}, {}, "not 4 shares"),                       # 65 slices
    (SKINNY, {"split_k": 8}, "not one wave of 75% to 100% of the 132"),  # 32 tiles x 8
    (SKINNY, {"split_k": 2}, "not one wave of 75% to 100%"),              # 32 tiles x 2: SMs idle
    ({**SKINNY, "n": 11008}, {"block_n": 256, "split_k": 2}, "not one wave"),  # 43 tiles x 2
    (SKINNY, {"raster": 8}, "raster=8 is not one of"),
])
def test_what_split_k_cannot_compute_raises(shape, knobs, message):
    with pytest.raises(ValueError, match=message):
        W.gemm_split_k(shape, "float16", knobs)


@pytest.mark.parametrize("shape, tile, splits", [
    (SKINNY, (128, 128, 1), 4),                        # 32 tiles x 4
    ({**SKINNY, "m": 64}, (64, 128, 0), 4),           # one consumer warpgroup: the one-role kernel
    ({**SKINNY, "m": 256}, (128, 128, 1), 2),
])
def test_the_split_k_default_fills_one_wave_with_large_tiles(shape, tile, splits):
    knobs = W.split_k_fill(shape, "float16")
    assert (*W.tile_shape(knobs)[:2], knobs["specialised"]) == tile and knobs["split_k"] == splits
    ctas = shape["m"] // tile[0] * (shape["n"] // tile[1]) * splits
    assert W.WAVE_FILL_MIN * W.SM_COUNT <= ctas <= W.SM_COUNT


def test_the_deepest_ring_that_keeps_the_fewest_waves():
    """fill_tile's small tiles: 5 stages where any depth is one wave (128 x 4096: 128 CTAs of 64 x
    64), 4 where 5 (2 CTAs a SM by shared memory) would take two waves of 344 CTAs and 4 (3 a SM) one."""
    assert W.fill_tile(SKINNY, "float16")["stages"] == 5
    wide = W.fill_tile({**SKINNY, "n": 11008}, "float16")
    assert (W.tile_shape(wide)[:2], wide["stages"]) == ((64, 64), 4)


def test_split_k_partials_are_float32_per_split_and_the_sum_rounds_once():
    func = W.gemm_split_k({"m": 128, "n": 4096, "k": 1024}, "bfloat16", {"split_k": 4}, "gelu_tanh", bias=False)
    assert [str(b.dtype) for b in param_buffers(func)] == ["bfloat16"] * 3  # (A, B, C): no bias
    gemm, total = _source(func).split('extern "C" __global__')[-2:]
    # the partials: C's stores, two float32 columns at once, into the workspace
    assert _packed_stores(gemm.replace("partials_ptr", "C_ptr"), "uint64_t") == 128 // 4
    assert "(((int)blockIdx.z) * 256)" in gemm  # the second split's 4 slices of 64 start at column 256
    assert "tanhf(" in total and "tanhf(" not in gemm and total.count("((float4*)partials_ptr)[") == 4
    assert total.count("(nv_bfloat16)") == 4  # each of the 4 columns rounded once
    with pytest.raises(ValueError, match="split-K partials"):
        cfg = W._config({"m": 128, "n": 4096, "k": 1024}, "float16", {"split_k": 4}, 1, "nk", None,
                        W.SPLIT_K_KNOBS, W.SPLIT_K_DEFAULT_KNOBS)
        W._gemm(cfg, "bad", [], lambda acc, *_: acc, False)  # partials in float16
