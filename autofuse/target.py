"""Target names the user types, turned into TVM targets, and the database folder name of each.

TVM 0.27 takes targets as dicts only. ``llvm`` means this CPU: its ``mcpu`` (without it LLVM emits
SSE2-only code, ~3x slower GEMMs) and its core count. Named GPU targets carry the limits
MetaSchedule's thread-binding rules need.
"""

from __future__ import annotations

import json
import os
import re

import tvm
from tvm.target import Target, codegen

from .errors import AutofuseError

NAMED_TARGETS = {
    "h200": {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
             "max_shared_memory_per_block": 49152, "thread_warp_size": 32, "registers_per_block": 65536},
}
NAMED_TARGETS["cuda"] = NAMED_TARGETS["h200"]


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def use_host_cores() -> int:
    """Size TVM's CPU thread pool to this process's cores, as ``compare`` pins every contender,
    unless ``TVM_NUM_THREADS`` is set; returns the count. Call before the first kernel runs; the
    tuner's runner processes inherit it. TVM's own default on x86 is half the logical cores (it
    assumes two hyper-threads a core), which on a VM of single-thread cores times every candidate
    on half the machine."""
    if not os.environ.get("TVM_NUM_THREADS"):
        os.environ["TVM_NUM_THREADS"] = str(host_cores())
    return int(os.environ["TVM_NUM_THREADS"])


def host_llvm() -> dict:
    return {"kind": "llvm", "num-cores": host_cores(), "mcpu": codegen.llvm_get_system_cpu()}


def parse_target(spec: str) -> Target:
    """``llvm``, a named target (``cuda``, ``h200``), or a JSON dict of TVM target attributes."""
    spec = spec.strip()
    if spec == "llvm":
        config = host_llvm()
    elif spec in NAMED_TARGETS:
        config = dict(NAMED_TARGETS[spec])
    elif spec.startswith("{"):
        try:
            config = json.loads(spec)
        except json.JSONDecodeError as err:
            raise AutofuseError(f"target JSON does not parse: {err}") from None
        if not isinstance(config, dict) or "kind" not in config:
            raise AutofuseError('target JSON must be an object with a "kind", e.g. {"kind": "llvm"}')
        if config["kind"] == "llvm":
            config = {**host_llvm(), **config}
    else:
        names = ", ".join(["llvm", *sorted(NAMED_TARGETS)])
        raise AutofuseError(f"unknown target {spec!r}: use one of {names} or a JSON dict of target attributes")
    try:
        return Target(config)
    except Exception as err:  # TVM raises several types for a bad dict
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AutofuseError(f"TVM rejects target {json.dumps(config)}: {first}") from None


def target_key(target: Target) -> str:
    """Readable folder name for the target's records, e.g. ``llvm-znver4-2core`` or ``cuda-sm_90``."""
    kind = target.kind.name
    attrs = target.attrs
    if kind == "llvm":
        parts = [kind]
        if "mcpu" in attrs:
            parts.append(str(attrs["mcpu"]))
        if "num-cores" in attrs:
            parts.append(f"{int(attrs['num-cores'])}core")
        key = "-".join(parts)
    elif kind == "cuda":
        key = f"cuda-{attrs['arch']}" if "arch" in attrs else "cuda"
    else:
        key = kind
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def device_for(target: Target) -> tvm.runtime.Device:
    return tvm.device(target.kind.name if target.kind.name != "llvm" else "cpu", 0)
