"""Run a CUDA-scheduled TVM module on the CPU, to check a CUDA template's numbers without a GPU.

How: the module is lowered the way ``tvm.tirx.build`` lowers it for the H200 (same pipeline, same
CUDA code generator), so the CUDA source is exactly what the GPU would get; the host function tells
which kernels are launched, in which order, with which buffers and grid/block sizes, and which
global workspaces TVM allocates between kernels. The source is then compiled with g++ against
cuda_emulator.h (next to this file), which emulates the CUDA subset TVM emits: each CUDA thread is a
fiber, blocks run one after another, ``__syncthreads`` is a block barrier and warp shuffles exchange
values among the lanes that reached them. The program runs twice, threads and blocks in ascending
then descending order; the two results must agree bit for bit, or the kernel has a race.

What it checks besides the numbers: unwritten outputs and shared memory read before written (they
start as NaN/-1 bytes), writes outside a buffer (guard bytes around each), writes into an input,
misaligned vector accesses, divergent barriers/shuffles, more than 1024 threads or 48 KiB of static
shared memory per block, launch bounds. TVM's warp-synchronous reduction tails (volatile shared
memory, no ``__syncwarp``) run in warp lockstep, as on the GPU in practice (``warp_lockstep``).
Half and bfloat16 run as _Float16 and a rounding struct. TVM's PTX helpers are emulated by name
(EMULATED_HELPERS, _HELPER_FAMILIES; their definitions, inline PTX, are dropped from the source):
mbarriers, bulk and TMA tensor copies between global and shared memory (the host function's
``cuTensorMapEncodeTiled`` calls become emulated tensor maps, swizzles included), wgmma (A and B
through shared-memory matrix descriptors or A from registers; float16, bfloat16, int8), named
barriers, fences, programmatic dependent launch, cuda_attention's split counter. Copies and wgmma
complete at once. A cluster's blocks run together (barrier.cluster, stores to another block's
shared memory). Not emulated (``NotEmulated``): wmma/mma.sync, other inline PTX, cp.async, kernels
with scalar parameters, host-side loops around launches. Floating-point results can differ from a
GPU's in the last bits (no FMA contraction, exact ``__expf``), far inside the patterns' tolerances.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tvm
from cuda_support import H200, probe_module
from tvm import tirx

from autofuse.measure import param_buffers

HEADER = Path(__file__).resolve().with_name("cuda_emulator.h")
CXX_FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-fwrapv", "-w")
RUN_TIMEOUT_S = 120
_UNSUPPORTED = {  # what, in the kernels, the emulator cannot run: name -> regex
    "tensor cores (wmma/mma)": r"\b(wmma|mma_sync|ldmatrix)\b|\bmma\.",
    "inline PTX": r"\b(?:asm|__asm__)\s*(?:volatile\s*|__volatile__\s*)?\(",
    "cp.async / TMA": r"\bcp\.async\b|__pipeline_",
}
# Device functions the header emulates (PTX wrappers): their definitions in the source are dropped.
EMULATED_HELPERS = frozenset(a or b for a, b in re.findall(r"^#define (tvm_builtin_\w+)\(|^inline \w+ (autofuse_\w+)\(",
                                                               HEADER.read_text(), re.M))
# Families of helpers, by name: a call "name()" becomes the string; "name(" becomes what the function
# gives for the name's match. Their definitions are dropped.
_HELPER_FAMILIES = [
    (r"tvm_builtin_ptx_setmaxnreg_\w+", "((void)0)"),  # register reallocation: nothing to emulate
    (r"tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_\d+", "((void)0)"),  # wgmma completes at once
    (r"tvm_builtin_ptx_cp_async_bulk_tensor_g2s_cluster_async_bulk_tensor_[1-5]d_shared__cluster_global_mbarrier"
     r"__complete_tx__bytes", lambda m: "emu::tensor_load(__LINE__, "),
    (r"tvm_builtin_ptx_cp_async_bulk_tensor_s2g_async_bulk_tensor_[1-5]d_global_shared__cta_tile_bulk_group",
     lambda m: "emu::tensor_store(__LINE__, "),
    (r"tvm_builtin_ptx_wgmma_(f16|bf16)_ss_mma_async_sync_aligned_m64n(\d+)k16_f32_\w+?_1_1_([01])_([01])",
     lambda m: f"emu::wgmma_ss<{m[2]}, {_WGMMA_TYPES[m[1]]}, {m[3]}, {m[4]}>(__LINE__, "),
    (r"tvm_builtin_ptx_wgmma_int_ss_mma_async_sync_aligned_m64n(\d+)k32_s32_(s8|u8)_\2",
     lambda m: f"emu::wgmma_ss<{m[1]}, {_WGMMA_TYPES[m[2]]}, 0, 0, int32_t>(__LINE__, "),
    (r"tvm_builtin_ptx_wgmma_(f16|bf16)_rs_mma_async_sync_aligned_m64n(\d+)k16_f32_\w+?_1_1_([01])",
     lambda m: f"emu::wgmma_rs<{m[2]}, {_WGMMA_TYPES[m[1]]}, {m[3]}>(__LINE__, "),
]
_WGMMA_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "s8": "int8_t", "u8": "uint8_t"}
# Launch parameters that only change how a launch waits for the one before (kernels run in order here)
_ORDERING_TAGS = {"tirx.use_programtic_dependent_launch", "tirx.use_programmatic_dependent_launch"}


class EmulatorError(AssertionError):
    """The emulated program did not compile, crashed, or showed a bug (message says which)."""


class NotEmulated(Exception):
    """The module uses something this emulator does not model."""


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple[str, ...]  # buffer names, in the kernel's parameter order
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared: int = 0
    cluster: tuple[int, int, int] = (1, 1, 1)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """A ``cuTensorMapEncodeTiled`` call of the host function (dimension 0 innermost)."""

    buffer: str
    dtype: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, of dimensions 1..rank-1
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int


@dataclasses.dataclass
class Program:
    """What the host function does, and the kernels' source rewritten for the emulator."""

    source: str
    launches: list[Launch]
    params: list[tuple[str, tuple[int, ...], str]]  # name, shape, dtype of the PrimFunc's params
    workspaces: dict[str, int]  # global buffers TVM allocates between kernels: name -> bytes
    tensor_maps: dict[str, TensorMap] = dataclasses.field(default_factory=dict)  # kernel argument -> map


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (no C++ compiler, or a TVM without CUDA codegen), or None."""
    if shutil.which("g++") is None:
        return "g++ not found: the CUDA emulator compiles kernels with it"
    try:
        lower(probe_module())
    except Exception as err:  # e.g. a TVM built without the CUDA code generator
        lines = str(err).strip().splitlines() or [type(err).__name__]
        return f"TVM cannot emit CUDA source here: {lines[-1]}"
    return None


def lower(mod: tvm.IRModule, target=H200, warp_lockstep: bool = True) -> Program:
    """The CUDA source and kernel launches ``tvm.tirx.build(mod, target)`` would produce
    (``warp_lockstep``: see ``rewrite_source``)."""
    from tvm.target import Target
    from tvm.tirx.build import codegen_build, split_host_device_mods

    func = mod["main"]
    params = [(b.name, tuple(int(d) for d in b.shape), str(b.dtype)) for b in param_buffers(func)]
    target = Target(target).with_host("llvm" if tvm.runtime.enabled("llvm") else "c")
    lowered = tvm.tirx.transform.BindTarget(target)(mod)
    if func.attrs is not None and bool(func.attrs.get("autofuse.tirx", False)):
        # kernels written in the tirx script go through its own pipeline, as tvm.compile sends them
        pipeline, _, finalize_device = tvm.tirx.get_tir_pipeline("tirx")
    else:
        pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    host, devices = split_host_device_mods(pipeline(lowered))
    source = "\n".join(codegen_build(finalize_device()(dev), t).inspect_source("")
                       for t, dev in devices.items() if len(dev.functions))
    walk = _HostWalk([p[0] for p in params])
    for host_func in host.functions.values():
        walk.visit(host_func.body, inside=None)
    if not walk.launches:
        raise NotEmulated("the host function launches no kernel")
    return Program(rewrite_source(source, warp_lockstep), walk.launches, params,
                   {name: _nbytes(buf.shape, buf.dtype) for name, buf in walk.workspaces}, walk.tensor_maps)


class _HostWalk:
    """Kernel launches (``call_ffi_kernel``) in lowered host code, in order, with their buffer
    arguments traced back to a parameter or a workspace (an ``AllocBuffer``: global memory TVM
    allocates between kernels; storage rewriting may pass it as views of another dtype)."""

    def __init__(self, param_names):
        self.param_names = param_names
        self.launches: list[Launch] = []
        self.workspaces: list[tuple[str, object]] = []  # unique name, buffer
        self.views: list[tuple[object, object]] = []  # a DeclBuffer's buffer, the buffer whose data it uses
        self.tensor_maps: dict[str, TensorMap] = {}  # one entry per encode call ("name" or "name#2", ...)
        self.current_map: dict[str, str] = {}  # a map variable's latest encode

    def visit(self, stmt, inside):
        kind = type(stmt).__name__
        if kind == "AllocBuffer":
            name = stmt.buffer.name
            taken = set(self.param_names) | {n for n, _ in self.workspaces}
            self.workspaces.append((name if name not in taken else f"{name}_{len(self.workspaces)}", stmt.buffer))
        elif kind == "DeclBuffer" and _is_call(stmt.data, "tirx.buffer_data"):
            self.views.append((stmt.buffer, stmt.data.args[0]))
        elif kind == "Evaluate" and _is_call(stmt.value, "tirx.tvm_call_packed") and \
                str(stmt.value.args[0].value) == "runtime.cuTensorMapEncodeTiled":
            self._tensor_map(stmt.value.args[1:])
        elif kind == "Evaluate" and _is_call(stmt.value, "tirx.call_ffi_kernel"):
            if inside is not None:
                raise NotEmulated(f"a kernel launch inside a host-side {inside} (a loop left unbound?)")
            self.launches.append(self._launch(stmt.value))
        if kind == "For":
            inside = "loop"
        elif kind == "IfThenElse" and inside is None:
            inside = "condition"
        if isinstance(stmt, tirx.SeqStmt):
            for sub in stmt.seq:
                self.visit(sub, inside)
        for field in ("body", "then_case", "else_case"):
            sub = getattr(stmt, field, None)
            if isinstance(sub, tirx.Stmt):
                self.visit(sub, inside)

    def _buffer(self, buf) -> str:
        """The parameter or workspace whose memory ``buf`` (maybe a view of a view) uses."""
        for _ in range(64):
            for name, alloc in self.workspaces:
                if alloc.same_as(buf):
                    return name
            target = next((t for v, t in self.views if v.same_as(buf) and not t.same_as(buf)), None)
            if target is None:
                break
            buf = target
        if self.param_names.count(buf.name) == 1:
            return buf.name
        raise NotEmulated(f"kernel argument {buf.name!r} is neither a parameter nor a workspace")

    def _tensor_map(self, args):
        name, dtype, rank = args[0].name, str(args[1].value), int(args[2])
        rest = [int(a) for a in args[4:]]
        if len(rest) != rank + (rank - 1) + rank + rank + 4:
            raise NotEmulated(f"a cuTensorMapEncodeTiled call of {len(args) + 1} arguments for rank {rank}")
        dims, rest = rest[:rank], rest[rank:]
        strides, rest = rest[:rank - 1], rest[rank - 1:]
        box, rest = rest[:rank], rest[rank:]
        element_strides, rest = rest[:rank], rest[rank:]
        key = name if name not in self.tensor_maps else f"{name}#{len(self.tensor_maps)}"
        self.tensor_maps[key] = TensorMap(self._data(args[3]), dtype, tuple(dims), tuple(strides), tuple(box),
                                          tuple(element_strides), rest[0], rest[1])
        self.current_map[name] = key

    def _data(self, arg) -> str:
        """The parameter or workspace a pointer argument (``buf.data``) points into."""
        if _is_call(arg, "tirx.buffer_data"):
            return self._buffer(arg.args[0])
        if isinstance(arg, tirx.Var) and self.param_names.count(arg.name) == 1:
            return arg.name
        raise NotEmulated(f"kernel argument {arg} is neither a parameter nor a workspace")

    def _launch(self, call) -> Launch:
        tags = [str(t) for t in call.attrs.launch_params if str(t) not in _ORDERING_TAGS]
        other = [t for t in tags if not t.startswith(("blockIdx.", "threadIdx.", "clusterCtaIdx."))
                 and t != "tirx.use_dyn_shared_memory"]
        if other:
            raise NotEmulated(f"a launch with {', '.join(other)}")
        extents = call.args[len(call.args) - len(tags):]
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            raise NotEmulated("a launch with symbolic grid or block sizes")
        dims = dict(zip(tags, (int(e) for e in extents)))
        args = []
        for arg in call.args[1:len(call.args) - len(tags)]:
            if isinstance(arg, tirx.Var) and arg.name in self.current_map:
                args.append(self.current_map[arg.name])
            elif _is_call(arg, "tirx.buffer_data"):
                args.append(self._buffer(arg.args[0]))
            else:
                raise NotEmulated(f"a kernel argument that is neither a buffer nor a tensor map: {arg}")
        return Launch(call.args[0].value, tuple(args),
                      tuple(dims.get(f"blockIdx.{a}", 1) for a in "xyz"),
                      tuple(dims.get(f"threadIdx.{a}", 1) for a in "xyz"),
                      dims.get("tirx.use_dyn_shared_memory", 0),
                      tuple(dims.get(f"clusterCtaIdx.{a}", 1) for a in "xyz"))


def _is_call(expr, op: str) -> bool:
    return type(expr).__name__ == "Call" and getattr(expr.op, "name", "") == op


def _nbytes(shape, dtype) -> int:
    return int(np.prod([int(d) for d in shape])) * tvm.runtime.DataType(str(dtype)).bits // 8


def rewrite_source(source: str, warp_lockstep: bool = True) -> str:
    """CUDA source (TVM's, or written by hand in its style) with shared arrays and pointer casts
    routed through the emulator; NotEmulated if it uses what the emulator lacks.

    ``warp_lockstep``: the lanes of a warp run volatile shared-memory accesses in lockstep, which
    TVM's warp-synchronous reduction code (no ``__syncwarp``) relies on, as converged warps provide
    in practice. False treats that code as the race CUDA's programming guide calls it since Volta."""
    source = _drop_emulated_helpers(source)
    kernels = source[source.index('extern "C"'):] if 'extern "C"' in source else source
    for what, pattern in _UNSUPPORTED.items():
        found = re.search(pattern, kernels)
        if found:
            line = kernels[kernels.rfind("\n", 0, found.start()) + 1:kernels.find("\n", found.start())].strip()
            raise NotEmulated(f"{what} in the kernel source ({line[:120]!r})")
    # Shared arrays live in the emulator's per-block arena, poisoned at every block start.
    ctype = r"((?:unsigned |signed )?\w+)"
    source = re.sub(r"(?:volatile\s+)?__shared__\s+(?:alignas\((\d+)\)\s+)?" + ctype + r"\s+(\w+)\[(\d+)\];",
                    lambda m: f"{m[2]}* {m[3]} = emu::shared_array<{m[2]}>({m[4]}, {m[1] or 16});", source)
    source = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+|alignas\(\d+\)\s+)?" + ctype + r"\s+(\w+)\[\];",
                    lambda m: f"{m[1]}* {m[2]} = ({m[1]}*)emu::dynamic_shared();", source)
    if "__shared__" in source.replace("#define __shared__", ""):
        line = next(x for x in source.splitlines() if "__shared__" in x)
        raise NotEmulated(f"a shared memory declaration the emulator does not parse: {line.strip()}")
    # Warp-synchronous volatile accesses run in lockstep (cuda_emulator.h, emu::lockstep).
    if warp_lockstep:
        source = re.sub(r"\(\(volatile " + ctype + r"\*\)(\w+)\)",
                        r"((volatile \1*)emu::lockstep(\2, __LINE__))", source)
    # `*(float4*)(p)` -> `*emu::vector_at<float4>(__LINE__, p)`: the closing parenthesis is p's.
    return re.sub(r"\*\(" + ctype + r"\*\)\(", r"*emu::vector_at<\1>(__LINE__, ", source)


def _definition(prelude: str, name: str) -> tuple[int, int] | None:
    """Where the definition of function ``name`` in ``prelude`` starts and ends (its closing brace
    included; braces in string literals not counted), or None."""
    found = re.search(r"^(?:template\s*<[^<>;{}]*>\s*)?[^\n;{}]*?\b" + name + r"\s*\([^;{}]*\)\s*\{", prelude, re.M)
    if not found:
        return None
    depth, quoted, i = 0, False, found.end() - 1
    while i < len(prelude):
        ch = prelude[i]
        if quoted:
            i += ch == "\\"
            quoted = ch != '"'
        elif ch == '"':
            quoted = True
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth == 0:
                break
        i += 1
    return found.start(), i + 1


def _drop_emulated_helpers(source: str) -> str:
    """``source`` without the prelude's definitions of EMULATED_HELPERS and _HELPER_FAMILIES, the
    families' calls rewritten; NotEmulated where a kernel calls another helper around inline PTX."""
    split = source.find('extern "C"')
    prelude, kernels = (source[:split], source[split:]) if split >= 0 else (source, "")
    for name in sorted(EMULATED_HELPERS | set(re.findall(r"\b(tvm_builtin_\w+|autofuse_\w+)\s*\(", kernels))):
        span = _definition(prelude, name)
        if span is None:
            continue
        if name in EMULATED_HELPERS or any(re.fullmatch(family, name) for family, _ in _HELPER_FAMILIES):
            prelude = prelude[:span[0]] + prelude[span[1]:]
        elif re.search(_UNSUPPORTED["inline PTX"], prelude[span[0]:span[1]]):
            raise NotEmulated(f"inline PTX in {name}, which the kernels call")
    for family, becomes in _HELPER_FAMILIES:
        if isinstance(becomes, str):
            kernels = re.sub(r"\b" + family + r"\(\)", becomes, kernels)
        else:
            kernels = re.sub(r"\b" + family + r"\(", becomes, kernels)
    return prelude + kernels


def _main_cpp(program: Program) -> str:
    """The emulated program: loads the buffers, runs the launches (checking the guard bytes after
    each), saves the parameters."""
    names = [p[0] for p in program.params] + list(program.workspaces)
    index = {n: i for i, n in enumerate(names)}
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in program.params]
    sizes += list(program.workspaces.values())
    lines = ['#include "cuda_emulator.h"', '#include "kernels.inc"', "",
             "int main(int argc, char** argv) {",
             "  emu::install_crash_handler();",
             '  bool emu_reverse = argc > 2 && argv[2][0] == \'r\';',
             f"  static const char* emu_names[] = {{{', '.join(_c_string(n) for n in names)}}};",
             f"  static const size_t emu_sizes[] = {{{', '.join(str(s) for s in sizes)}}};",
             f"  emu::Buffers emu_bufs(argv[1], emu_names, emu_sizes, {len(names)}, {len(program.params)});"]
    maps = {}  # tensor map -> its C++ variable
    for i, (name, m) in enumerate(program.tensor_maps.items()):
        maps[name] = f"emu_map{i}"
        elsize = tvm.runtime.DataType(m.dtype).bits // 8
        for field, ctype in (("dims", "unsigned int"), ("strides", "unsigned long long"), ("box", "unsigned int"),
                             ("element_strides", "unsigned int")):
            lines.append(f"  static const {ctype} emu_map{i}_{field}[] = {{{', '.join(map(str, getattr(m, field) or (0,)))}}};")
        lines += [f"  static CUtensorMap emu_map{i};  // {name}",
                  f"  emu::make_tensor_map(&emu_map{i}, emu_bufs.data({index[m.buffer]}), {elsize}, {len(m.dims)}, "
                  f"emu_map{i}_dims, emu_map{i}_strides, emu_map{i}_box, emu_map{i}_element_strides, {m.interleave}, "
                  f"{m.swizzle});"]
    for launch in program.launches:
        args = ", ".join(f"&{maps[a]}" if a in maps else f"emu_bufs.data({index[a]})" for a in launch.args)
        name = _c_string(launch.kernel)
        grid, block, cluster = (", ".join(map(str, dims)) for dims in (launch.grid, launch.block, launch.cluster))
        lines += ["  {",
                  f"    void* emu_args[] = {{{args}}};",
                  f"    auto entry = [](void* const* a) {{ emu::invoke(::{launch.kernel}, a); }};",
                  f"    emu::Kernel emu_kernel{{{name}, entry, emu_args}};",
                  f"    emu::launch(emu_kernel, dim3{{{grid}}}, dim3{{{block}}}, {launch.dynamic_shared}, "
                  f"emu_reverse, dim3{{{cluster}}});",
                  f"    emu_bufs.check_guards({name});",
                  "  }"]
    lines += ['  emu_bufs.save(emu_reverse ? "reverse" : "forward");', "  return 0;", "}", ""]
    return "\n".join(lines)


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_launch_bounds(program: Program) -> None:
    bounds = dict((name, int(n)) for n, name in re.findall(r"__launch_bounds__\((\d+)\)\s+(\w+)\(", program.source))
    for launch in program.launches:
        threads = int(np.prod(launch.block))
        if launch.kernel in bounds and threads > bounds[launch.kernel]:
            raise EmulatorError(f"{launch.kernel} launches {threads} threads per block but declares "
                                f"__launch_bounds__({bounds[launch.kernel]}): the launch would fail")


@functools.cache
def _precompiled_header() -> list[str]:
    """``-I`` of a folder holding cuda_emulator.h precompiled with CXX_FLAGS (once a process; g++
    takes it in place of the header, whose parse was a third of each program's compile), or nothing
    where g++ cannot precompile it (each program then parses the header)."""
    text = HEADER.read_bytes()
    folder = Path(tempfile.gettempdir()) / f"autofuse-emulator-pch-{os.getpid()}-{hashlib.sha1(text).hexdigest()[:12]}"
    folder.mkdir(exist_ok=True)
    (folder / HEADER.name).write_bytes(text)
    done = subprocess.run(["g++", *CXX_FLAGS, "-x", "c++-header", str(folder / HEADER.name), "-o",
                           str(folder / f"{HEADER.name}.gch")], capture_output=True, text=True)
    if done.returncode:
        shutil.rmtree(folder, ignore_errors=True)
        return []
    import atexit
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return [f"-I{folder}"]


def build(program: Program, workdir: Path) -> Path:
    """Compile the emulated program into ``workdir``; its path."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _check_launch_bounds(program)
    (workdir / "kernels.inc").write_text(program.source)
    (workdir / "main.cpp").write_text(_main_cpp(program))
    stubs = workdir / "include"
    stubs.mkdir(exist_ok=True)
    for header in ("cuda.h", "cuda_fp16.h", "cuda_bf16.h"):  # the header defines what they would
        (stubs / header).write_text(f"// TVM's prelude includes <{header}>; cuda_emulator.h stands in for it\n")
    # TVM includes it where a kernel uses an inf or NaN constant.
    (stubs / "math_constants.h").write_text("#define CUDART_INF_F __builtin_huge_valf()\n"
                                            "#define CUDART_NAN_F __builtin_nanf(\"\")\n")
    exe = workdir / "emulated"
    cmd = ["g++", *CXX_FLAGS, *_precompiled_header(), f"-I{HEADER.parent}", f"-I{stubs}", str(workdir / "main.cpp"),
           "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        errors = [x for x in done.stderr.splitlines() if "error" in x] or done.stderr.splitlines()
        raise EmulatorError(f"g++ could not compile the emulated kernels ({workdir / 'kernels.inc'}):\n"
                            + "\n".join(errors[:12])[-3000:])
    return exe


def run(exe: Path, program: Program, inputs: Sequence[np.ndarray], workdir: Path,
        reverse: bool = False) -> list[np.ndarray]:
    """Run the program once on ``inputs`` (the first parameters); every parameter's final value."""
    workdir = Path(workdir)
    for i, ((name, shape, dtype), array) in enumerate(zip(program.params, inputs)):
        array = np.ascontiguousarray(array)
        if array.shape != shape or array.dtype != np.dtype(dtype):
            raise ValueError(f"input {name}: {array.dtype}{list(array.shape)}, the kernel takes {dtype}{list(shape)}")
        array.tofile(workdir / f"in{i}.bin")
    for i in range(len(inputs), len(program.params)):
        (workdir / f"in{i}.bin").unlink(missing_ok=True)  # outputs start poisoned
    order = "reverse" if reverse else "forward"
    try:
        done = subprocess.run([str(exe), str(workdir), order], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EmulatorError(f"the emulated kernels ran over {RUN_TIMEOUT_S} s ({order} order)") from None
    if done.returncode:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        raise EmulatorError(f"the emulated kernels failed ({order} order, {how}):\n"
                            f"{done.stderr.strip()[-2000:]}{_quote_lines(done.stderr, program.source)}")
    return [np.fromfile(workdir / f"{order}{i}.bin", dtype=dtype).reshape(shape)
            for i, (_, shape, dtype) in enumerate(program.params)]


def _quote_lines(stderr: str, source: str) -> str:
    """The kernel source lines an emulator message points at ("at line 123")."""
    lines = source.splitlines()
    quoted = [f"\n  kernels.inc:{n}: {lines[int(n) - 1].strip()}"
              for n in dict.fromkeys(re.findall(r"(?:at line |@)(\d+)", stderr)) if 0 < int(n) <= len(lines)]
    return "".join(quoted[:4])


def emulate(mod: tvm.IRModule, inputs: Sequence[np.ndarray], workdir: os.PathLike,
            warp_lockstep: bool = True) -> list[np.ndarray]:
    """The outputs (the parameters after ``inputs``) of ``mod`` built for the H200, computed on the
    CPU in ``workdir``; see ``emulate_program`` for what raises, ``rewrite_source`` for the flag."""
    return emulate_program(lower(mod, warp_lockstep=warp_lockstep), inputs, workdir)


def emulate_program(program: Program, inputs: Sequence[np.ndarray], workdir: os.PathLike) -> list[np.ndarray]:
    """Build and run ``program`` in both thread orders; the outputs. Raises EmulatorError when the
    program fails, writes into an input, or gives different bits with threads and blocks run in the
    opposite order (a race: the GPU promises no order)."""
    exe = build(program, Path(workdir))
    forward = run(exe, program, inputs, workdir)
    backward = run(exe, program, inputs, workdir, reverse=True)
    for (name, _, _), given, after in zip(program.params, inputs, forward):
        if not np.array_equal(_bits(np.asarray(given)), _bits(after)):
            raise EmulatorError(f"the kernels wrote into input {name!r}")
    for (name, _, _), a, b in zip(program.params[len(inputs):], forward[len(inputs):], backward[len(inputs):]):
        differ = (_bits(a) != _bits(b)).any(axis=1)
        if differ.any():
            raise EmulatorError(f"output {name!r} differs in {int(differ.sum())} of {a.size} elements between "
                                "thread orders (ascending vs descending): a data race or a missing barrier")
    return forward[len(inputs):]


def _bits(array: np.ndarray) -> np.ndarray:
    """The bytes of each element, one row per element (NaNs compare by their bits)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, flat.dtype.itemsize)
