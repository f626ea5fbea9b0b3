"""What the CUDA template tests share: compiling a scheduled module for the H200 through nvcc (what
loading it on the device does), reading kernel limits off the generated source, and drawing knob
samples from a template's design space the way MetaSchedule's search draws them. Nothing runs on a
GPU here; benchmarks/gpu_check_templates.py checks the numbers on one."""

import re
import shutil

import pytest
import tvm
from tvm import s_tir
from tvm.s_tir.schedule import Trace

from autofuse.target import parse_target

H200 = parse_target("h200")
MAX_THREADS = 1024
MAX_STATIC_SHARED = 48 * 1024
_SCALAR_BYTES = {"nv_bfloat16": 2, "half": 2, "float": 4, "int": 4, "uint": 4, "double": 8,
                 "longlong": 8, "ulonglong": 8, "char": 1, "uchar": 1, "signed char": 1, "unsigned char": 1,
                 "int8_t": 1, "uint8_t": 1, "int64_t": 8, "bool": 1}


def require_nvcc():
    """Skip the calling module where CUDA kernels cannot be compiled (no nvcc, or a TVM without
    CUDA codegen, or an nvcc that cannot target sm_90)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: CUDA kernels cannot be compiled here", allow_module_level=True)
    try:
        cuda_source(probe_module())
    except Exception as err:
        pytest.skip(f"TVM cannot compile CUDA here: {str(err).strip().splitlines()[-1]}",
                    allow_module_level=True)


def probe_module() -> tvm.IRModule:
    """The smallest CUDA kernel: whether this machine can compile or emulate CUDA at all."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def scale(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("b"):
                vi = T.axis.spatial(64, i)
                b[vi] = a[vi] * T.float32(2)

    return tvm.IRModule({"main": scale})


# Sources nvcc has compiled for sm_90 in this process: a knob sample that draws the default's
# knobs, or the probe every module compiles, is the same text, which nvcc compiled the same way.
_ACCEPTED: set[str] = set()


def cuda_source(mod) -> str:
    """The CUDA source of ``mod``, after nvcc accepted it for sm_90."""
    from tvm.support import nvcc

    source = tvm.tirx.build(mod, target=H200).imports[0].inspect_source("")
    if source not in _ACCEPTED:
        with H200:  # nvcc reads the arch off the current target
            nvcc.compile_cuda(source, target_format="fatbin", arch="sm_90", compiler="nvcc")
        _ACCEPTED.add(source)
    return source


def template_named(pattern, name):
    return next(t for t in pattern.templates if t.name == name)


def _bytes(ctype: str) -> int:
    """Size of a CUDA element type as TVM names them: float, half4, nv_bfloat164, ..."""
    base, lanes = re.fullmatch(r"(nv_bfloat16|[a-z_]+?\d*_t|[a-z ]+?)(\d*)", ctype.strip()).groups()
    return _SCALAR_BYTES[base] * int(lanes or 1)


def _definitions(source: str) -> list[str]:
    """The kernel definitions of the source (not their forward declarations), in order."""
    chunks = source.split('extern "C" __global__')[1:]
    return [chunk for chunk in chunks if chunk.split("\n", 1)[0].rstrip().endswith("{")]


def kernels(source: str) -> list[tuple[int, int]]:
    """(threads per block, static shared bytes) of each kernel of the source."""
    found = []
    for body in _definitions(source):
        bound = re.search(r"__launch_bounds__\((\d+)\)", body)
        threads = int(bound.group(1)) if bound else 1  # TVM writes no bound for a one-thread kernel
        shared = sum(_bytes(ty) * int(n) for ty, n in
                     re.findall(r"__shared__ (?:alignas\(\d+\) )?((?:signed |unsigned )?\w+) \w+\[(\d+)\]", body))
        found.append((threads, shared))
    return found


def assert_within_limits(source: str) -> None:
    """Every kernel fits the h200 target: 1024 threads per block, 48 KiB of static shared memory."""
    found = kernels(source)
    assert found, "no kernel in the source"
    for threads, shared in found:
        assert threads <= MAX_THREADS and shared <= MAX_STATIC_SHARED, (threads, shared)


def _loops(node):
    """Every For under ``node`` (TIR statements, blocks and their inits), outermost first."""
    from tvm import tirx

    if isinstance(node, tirx.For):
        yield node
    if isinstance(node, tirx.SeqStmt):
        for stmt in node.seq:
            yield from _loops(stmt)
    for field in ("block", "body", "init", "then_case", "else_case"):
        child = getattr(node, field, None)
        if isinstance(child, tirx.Stmt) or type(child).__name__ == "SBlock":
            yield from _loops(child)


def _thread_extents(mod):
    """Per kernel (a loop bound to blockIdx), the extents of the loops bound to each threadIdx."""
    kernels, inside = [], set()
    for loop in _loops(mod["main"].body):
        tag = loop.thread_binding.thread_tag if loop.thread_binding is not None else ""
        if tag.startswith("blockIdx") and loop not in inside:
            extents = {}
            for sub in _loops(loop.body):
                inside.add(sub)
                name = sub.thread_binding.thread_tag if sub.thread_binding is not None else ""
                if name.startswith("threadIdx"):
                    extents.setdefault(name, set()).add(int(sub.extent))
            kernels.append(extents)
    return kernels


def assert_one_extent_per_thread_tag(mod):
    """Loops of one kernel bound to the same threadIdx with different extents compile (nvcc is
    happy) into wrong code: TVM launches the largest and leaves the shorter loops unpredicated."""
    found = _thread_extents(mod)
    assert found
    for extents in found:
        assert all(len(e) == 1 for e in extents.values()), extents


def replayed(template, func, seeds):
    """Schedules drawn from the template's design space with its decisions removed."""
    design = s_tir.Schedule(func, seed=1)
    template.schedule(design, H200, tunable=True)
    space = Trace(design.trace.insts, {})
    for seed in seeds:
        sch = s_tir.Schedule(func, seed=seed)
        space.apply_to_schedule(sch, remove_postproc=True)
        yield sch
