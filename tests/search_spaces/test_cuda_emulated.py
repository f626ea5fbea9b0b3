"""Every pattern's CUDA templates compute the right numbers: the CUDA source TVM generates for the
H200 runs on the CPU under cuda_emulator (each CUDA thread a fiber, real barriers and warp
shuffles, both thread orders) and its outputs are compared with the pattern's numpy reference at the
pattern's tolerance, as autofuse.verify.check_module does on a device.

Per (pattern, CUDA template) pair: the fixed default knobs and one knob sample replayed the way
MetaSchedule replays it, at the pattern's small shape in its first dtype (float32 for every
schedule rule's pattern), and the default knobs in its last dtype (bfloat16 or float16; wmma is
not emulated, so its float16 path is skipped). The kernel templates: test_kernel_templates_emulated. The small shapes emulate in well under a second each; no override is
needed. The last tests check the emulator itself: on hand-written kernels it must compute
shuffle and warp-synchronous reductions right and catch a race, an out-of-bounds write, a
misaligned vector load and a divergent barrier, and it must catch a known TVM miscompile (mixed
thread extents), or a passing template would prove little.
"""

import re

import numpy as np
import pytest
from cuda_emulator import (EmulatorError, Launch, NotEmulated, Program, emulate, emulate_program, rewrite_source,
                           unavailable_reason)
from cuda_support import H200, replayed

from autofuse.pattern import Template
from autofuse.registry import all_patterns

_reason = unavailable_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

# Schedule rules; kernel templates (tirx): test_kernel_templates_emulated.py
CASES = [(p, t) for p in all_patterns().values() for t in p.templates
         if isinstance(t, Template) and t.applies_to(H200)]
IDS = [f"{p.name}-{t.name}" for p, t in CASES]
SEED = 2  # the replayed knob sample


def _check(pattern, mod, shape, dtype, workdir, what, warp_lockstep=True):
    inputs = pattern.make_inputs(shape, dtype, 1234)
    try:
        outputs = emulate(mod, inputs, workdir, warp_lockstep=warp_lockstep)
    except NotEmulated as err:
        pytest.skip(f"not emulated: {err}")
    result = pattern.check(outputs, inputs, shape, dtype)
    assert result.ok, f"{what} at {shape} {dtype}: {result.message} (max abs error {result.max_abs_err:.3g})"


@pytest.mark.parametrize("pattern,template", CASES, ids=IDS)
def test_default_knobs_match_reference(pattern, template, tmp_path):
    shape, dtype = pattern.small_shape(), pattern.dtypes[0]
    sch = template.apply(pattern.build(shape, dtype), H200, tunable=False)
    _check(pattern, sch.mod, shape, dtype, tmp_path, f"{template.name} (default knobs)")


HALF_CASES = [(p, t, p.dtypes[-1]) for p, t in CASES if len(p.dtypes) > 1]


@pytest.mark.parametrize("pattern,template,dtype", HALF_CASES, ids=[f"{p.name}-{t.name}-{d}" for p, t, d in HALF_CASES])
def test_default_knobs_match_reference_in_half_types(pattern, template, dtype, tmp_path):
    shape = pattern.small_shape()
    sch = template.apply(pattern.build(shape, dtype), H200, tunable=False)
    _check(pattern, sch.mod, shape, dtype, tmp_path, f"{template.name} (default knobs)")


@pytest.mark.parametrize("pattern,template", CASES, ids=IDS)
def test_replayed_sample_matches_reference(pattern, template, tmp_path):
    shape, dtype = pattern.small_shape(), pattern.dtypes[0]
    sch = next(replayed(template, pattern.build(shape, dtype), [SEED]))
    decisions = [str(v) for v in sch.trace.decisions.values()]
    _check(pattern, sch.mod, shape, dtype, tmp_path, f"{template.name} (sample {SEED}: {decisions})")


# Shapes where a template takes a path the small shape does not: flash_attention with a padded
# last key tile (its V tile read as a whole window ending at seq_kv) and GQA.
EDGE_SHAPES = [("flash_attention", "cuda_flash", {"seq_kv": 70, "seq_q": 13}),
               ("flash_attention", "cuda_flash", {"seq_kv": 70, "seq_q": 70, "heads": 4, "kv_heads": 2})]


@pytest.mark.parametrize("name,tname,over", EDGE_SHAPES, ids=[f"{n}-{o}" for n, _, o in EDGE_SHAPES])
def test_edge_shapes_match_reference(name, tname, over, tmp_path):
    pattern = all_patterns()[name]
    template = next(t for t in pattern.templates if t.name == tname)
    shape, dtype = pattern.resolve_shape(dict(pattern.small_shape(), **over)), pattern.dtypes[0]
    sch = template.apply(pattern.build(shape, dtype), H200, tunable=False)
    _check(pattern, sch.mod, shape, dtype, tmp_path, f"{tname} (default knobs)")


# Rows no power-of-two thread count divides (8000 vectors at vocab 32000, 250 at 1000 columns).
UNEVEN_ROWS = [("spec_accept", "cuda_rows_then_batch", {"vocab": 32000, "batch": 1, "k": 1}),
               ("softmax_dropout", "cuda_rows", {"cols": 1000, "rows": 3}),
               ("softmax_dropout", "cuda_rows_reread", {"cols": 4000, "rows": 2})]


@pytest.mark.parametrize("name,tname,over", UNEVEN_ROWS, ids=[f"{n}-{t}-{o}" for n, t, o in UNEVEN_ROWS])
def test_uneven_rows_do_not_rely_on_warp_lockstep(name, tname, over, tmp_path):
    """Row reductions over a power-of-two thread count (the last chunk predicated), which TVM
    lowers to shuffles: right without lockstep. With 250 or 25 threads TVM's shared-memory tree
    ends in warp-synchronous volatile code that CUDA does not promise to run in lockstep."""
    pattern = all_patterns()[name]
    template = next(t for t in pattern.templates if t.name == tname)
    shape, dtype = pattern.resolve_shape(dict(pattern.small_shape(), **over)), pattern.dtypes[0]
    sch = template.apply(pattern.build(shape, dtype), H200, tunable=False)
    extents = [int(n) for n in re.findall(r'T.thread_binding\((\d+), thread="threadIdx.x"\)', str(sch.mod))]
    assert extents and all(n & (n - 1) == 0 for n in extents), extents
    _check(pattern, sch.mod, shape, dtype, tmp_path, f"{tname} (default knobs)", warp_lockstep=False)


_BULK_COPY = """  __shared__ alignas(64) float buf[64];
  __shared__ alignas(8) uint64_t bar[1];
  if (threadIdx.x == 0) tvm_builtin_ptx_mbarrier_init_init_shared_b64(tvm_builtin_cuda_cvta_generic_to_shared(bar), 1);
  __syncthreads();
  if (threadIdx.x == 0) {{
    tvm_builtin_ptx_mbarrier_arrive_expect_tx_arrive_expect_tx_shared_b64(tvm_builtin_cuda_cvta_generic_to_shared(bar), 256);
    tvm_builtin_ptx_cp_async_bulk_g2s_cluster_async_bulk_shared__cluster_global_mbarrier__complete_tx__bytes(
        tvm_builtin_cuda_cvta_generic_to_shared(buf), x_ptr + blockIdx.x * 64, 256,
        tvm_builtin_cuda_cvta_generic_to_shared(bar));
  }}
  {wait}
  y_ptr[i] = buf[63 - threadIdx.x];
"""
_CLUSTER_SWAP = """  __shared__ alignas(64) float buf[64];
  unsigned int remote;
  tvm_builtin_ptx_mapa_u32_shared__cluster_u32(remote, tvm_builtin_cuda_cvta_generic_to_shared(&buf[threadIdx.x]),
                                               1 - tvm_builtin_cluster_ctaid_x());
  tvm_builtin_ptx_st_shared__cluster_f32(remote, x_ptr[i]);
  tvm_builtin_ptx_barrier_cluster_arrive_cluster_arrive_aligned();
  {wait}
  y_ptr[i] = buf[threadIdx.x];
"""
# The emulator on hand-written kernels in TVM's style: 2 blocks of 64 threads (one cluster of two
# for the cluster kernels), x -> y (128 floats).
_SIGNATURE = ('extern "C" __global__ void __launch_bounds__(64) k(float* __restrict__ x_ptr, '
              "float* __restrict__ y_ptr) {\n  int i = ((int)blockIdx.x) * 64 + ((int)threadIdx.x);\n")
_KERNELS = {
    # each half-warp's sums of 16 values land in the first lane of each 16
    "shuffle_sum": """  float v = x_ptr[i];
  uint mask = __activemask();
  for (int off = 8; off > 0; off >>= 1) v += __shfl_down_sync(mask, v, off, 16);
  v = __shfl_xor_sync(mask, v, 0);  // the width defaults to 32
  y_ptr[i] = __shfl_sync(mask, v, 0, 16);
""",
    # TVM's reduction over a group that is not a whole number of warps: a shared-memory tree whose
    # last steps are warp-synchronous volatile accesses; then lane 0 alone stores the total while
    # the rest of its warp goes on to __activemask (the warp reconverges before it)
    "warp_synchronous_sum": """  __shared__ alignas(64) float buf[64];
  __shared__ alignas(64) float total[1];
  buf[threadIdx.x] = x_ptr[i];
  __syncthreads();
  if (threadIdx.x < 32) buf[threadIdx.x] = buf[threadIdx.x] + buf[threadIdx.x + 32];
  __syncthreads();
  if (threadIdx.x < 16) {
    for (int off = 16; off > 0; off >>= 1) {
      float w = ((volatile float*)buf)[threadIdx.x] + ((volatile float*)buf)[threadIdx.x + off];
      ((volatile float*)buf)[threadIdx.x] = w;
    }
  }
  if (threadIdx.x == 0) ((volatile float*)total)[0] = ((volatile float*)buf)[0];
  uint mask = __activemask();
  float lane0 = __shfl_sync(mask, x_ptr[i], 0, 32);
  __syncthreads();
  y_ptr[i] = total[0] + lane0 * 0.0f;
""",
    "reverse_with_barrier": """  __shared__ alignas(64) float buf[64];
  buf[threadIdx.x] = x_ptr[i];
  __syncthreads();
  y_ptr[i] = buf[63 - threadIdx.x];
""",
    "reverse_without_barrier": """  __shared__ alignas(64) float buf[64];
  buf[threadIdx.x] = x_ptr[i];
  y_ptr[i] = buf[63 - threadIdx.x];
""",
    "write_past_the_end": "  y_ptr[i + 1] = x_ptr[i];\n",
    "misaligned_float4": """  if (threadIdx.x == 0) *(float4*)(y_ptr + i) = *(float4*)(x_ptr + i + 2);
  y_ptr[i] = x_ptr[i];
""",
    "divergent_barrier": """  if (threadIdx.x < 32) __syncthreads();
  y_ptr[i] = x_ptr[i];
""",
    # thread 0 bulk-copies the block's 64 values into shared memory; everyone waits on the mbarrier
    "bulk_copy_through_mbarrier": _BULK_COPY.format(wait="tvm_builtin_cuda_mbarrier_wait(bar, 0);"),
    "bulk_copy_without_wait": _BULK_COPY.format(wait=""),
    # the two blocks of a cluster swap their values through each other's shared memory
    "cluster_swap": _CLUSTER_SWAP.format(wait="tvm_builtin_ptx_barrier_cluster_wait_cluster_wait_aligned();"),
    "cluster_swap_without_wait": _CLUSTER_SWAP.format(wait=""),
}
_EXPECTED = {
    "shuffle_sum": lambda x: np.repeat(x.reshape(-1, 16).sum(axis=1), 16),
    "reverse_with_barrier": lambda x: x.reshape(2, 64)[:, ::-1].reshape(-1),
    "warp_synchronous_sum": lambda x: np.repeat(x.reshape(2, 64).sum(axis=1), 64),
    "bulk_copy_through_mbarrier": lambda x: x.reshape(2, 64)[:, ::-1].reshape(-1),
    "cluster_swap": lambda x: x.reshape(2, 64)[::-1].reshape(-1),
}
_ERRORS = {
    "reverse_without_barrier": "between thread orders",
    "write_past_the_end": "outside buffer y",
    "misaligned_float4": "misaligned 16-byte access",
    "divergent_barrier": "different synchronisation points",
    "bulk_copy_without_wait": "between thread orders",
    "cluster_swap_without_wait": "between thread orders",
}


def test_emulator_catches_tvm_mixed_thread_extents(tmp_path):
    """Two loops of one kernel bound to threadIdx.x with extents 64 and 32: TVM launches 64 threads
    and leaves the second loop unpredicated (cuda_support.assert_one_extent_per_thread_tag), so
    threads 32-63 read past b and write past d. The guard bytes must show it."""
    import tvm
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def mixed(a: T.Buffer((64,), "float32"), b: T.Buffer((32,), "float32"),
              c: T.Buffer((64,), "float32"), d: T.Buffer((32,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for i in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("c"):
                    vi = T.axis.spatial(64, i)
                    c[vi] = a[vi] * T.float32(2)
            for j in T.thread_binding(32, thread="threadIdx.x"):
                with T.sblock("d"):
                    vj = T.axis.spatial(32, j)
                    d[vj] = b[vj] + T.float32(1)

    a, b = np.arange(64, dtype="float32"), np.arange(32, dtype="float32")
    with pytest.raises(EmulatorError, match="wrote outside buffer d"):
        emulate(tvm.IRModule({"main": mixed}), [a, b], tmp_path)


@pytest.mark.parametrize("name", list(_KERNELS))
def test_emulator_on_handwritten_kernels(name, tmp_path):
    program = Program(rewrite_source(_SIGNATURE + _KERNELS[name] + "}\n"),
                      [Launch("k", ("x", "y"), (2, 1, 1), (64, 1, 1),
                              cluster=(2, 1, 1) if name.startswith("cluster") else (1, 1, 1))],
                      [("x", (128,), "float32"), ("y", (128,), "float32")], {})
    x = np.random.default_rng(0).standard_normal(128).astype("float32")
    if name in _EXPECTED:
        (y,) = emulate_program(program, [x], tmp_path)
        np.testing.assert_allclose(y, _EXPECTED[name](x), rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(EmulatorError, match=_ERRORS[name]):
            emulate_program(program, [x], tmp_path)

