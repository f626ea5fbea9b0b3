"""The ``Pattern`` and ``Template`` types that every file under ``search_spaces/`` fills in.

A pattern is one fused computation: its TensorIR, a numpy reference, seeded inputs, FLOP/byte counts
and hand-designed schedule templates. A template has the shape of dlight's ``ScheduleRule``:
``apply(func, target, tunable)`` returns a schedule, or None when it does not apply. With
``tunable=False`` its knobs take fixed defaults (a good schedule for builds without records); with
``tunable=True`` they are drawn with ``sample_*`` so MetaSchedule can search them. A kernel
template (``autofuse.kernel_templates.KernelTemplate``) is the other kind: a function
``(shape, dtype, knobs) -> PrimFunc`` in the tirx script whose small knob space is searched config by
config; a pattern lists both kinds in ``templates``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight import gpu
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .accuracy import Check, compare, reduction_length
from .errors import AutofuseError
from .measure import param_buffers

# Written into the trace of every template schedule, so a tuning record tells which space produced it.
TEMPLATE_ANNOTATION = "autofuse.template"


class Knobs:
    """Where a template gets its knob values: sampled when tunable, fixed defaults otherwise.

    Knob values may only flow into schedule primitives (split factors, compute-at locations,
    annotations), never into Python control flow: MetaSchedule replays the trace with new decisions,
    and a branch taken on one sample would not be taken on another.
    """

    def __init__(self, sch: s_tir.Schedule, tunable: bool, overrides: Sequence | None = None):
        self.sch = sch
        self.tunable = tunable
        # Fixed values for the template's tile/choice knobs in the order it asks for them (None
        # keeps a default): how a benchmark sweeps settings of one template without a tuner.
        self._overrides = list(overrides or [])

    def _default(self, default):
        if not self._overrides:
            return default
        value = self._overrides.pop(0)
        return default if value is None else value

    def tile(self, loop, n: int, default: Sequence[int], max_innermost_factor: int = 64) -> list:
        """Factors splitting ``loop`` into ``n`` perfect tiles; ``default`` gives the inner n-1."""
        if self.tunable:
            return list(self.sch.sample_perfect_tile(loop, n=n, max_innermost_factor=max_innermost_factor))
        extent = _const_extent(self.sch, loop)
        return fit_tiles(extent, self._default(default))

    def choice(self, candidates: Sequence[int], default: int):
        """One of ``candidates`` (an int knob such as an unroll depth)."""
        if default not in candidates:
            raise ValueError(f"default {default} not among candidates {list(candidates)}")
        if self.tunable:
            probs = [1.0 / len(candidates)] * len(candidates)
            return self.sch.sample_categorical(list(candidates), probs)
        value = self._default(default)
        if value not in candidates:
            raise ValueError(f"knob value {value} not among candidates {list(candidates)}")
        return value

    def compute_location(self, block, default_loop):
        """Where a producer/consumer block goes: sampled, or ``default_loop``."""
        if self.tunable:
            return self.sch.sample_compute_location(block)
        return default_loop


def fit_tiles(extent: int, inner: Sequence[int]) -> list[int]:
    """Perfect tiling of ``extent`` whose inner factors are the largest divisors not above ``inner``."""
    factors = []
    rest = extent
    for want in reversed(list(inner)):
        f = max(d for d in range(1, max(1, min(want, rest)) + 1) if rest % d == 0)
        factors.append(f)
        rest //= f
    return [rest] + list(reversed(factors))


def _const_extent(sch: s_tir.Schedule, loop) -> int:
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        raise ValueError("fixed (untunable) tiles need a constant loop extent")
    return int(extent.value)


class Template(ScheduleRule):
    """A hand-designed schedule template for one pattern, as a dlight-style rule.

    ``fn(sch, target, knobs)`` applies the schedule to ``sch`` in place. ``target_kinds`` says where
    it applies; elsewhere ``apply`` returns None.
    """

    def __init__(self, name: str, fn: Callable[[s_tir.Schedule, Target, Knobs], None],
                 target_kinds: Sequence[str] = ("llvm",), doc: str = ""):
        self.name = name
        self.fn = fn
        self.target_kinds = tuple(target_kinds)
        self.doc = doc or ((fn.__doc__ or "").strip().splitlines() or [""])[0]

    def applies_to(self, target: Target) -> bool:
        return target.kind.name in self.target_kinds

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool,
              overrides: Sequence | None = None) -> s_tir.Schedule | None:
        """``overrides``: fixed knob values in place of the defaults (see ``Knobs``)."""
        if not self.applies_to(target):
            return None
        sch = s_tir.Schedule(func)
        self.schedule(sch, target, tunable, overrides)
        return sch

    def schedule(self, sch: s_tir.Schedule, target: Target, tunable: bool,
                 overrides: Sequence | None = None) -> None:
        """Apply in place to a schedule MetaSchedule (or ``apply``) created."""
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        sch.annotate(blocks[0], TEMPLATE_ANNOTATION, self.name)
        self.fn(sch, target, Knobs(sch, tunable, overrides))

    def __repr__(self) -> str:
        return f"Template({self.name!r})"


def template(name: str, target_kinds: Sequence[str] = ("llvm",)):
    """Decorator turning ``fn(sch, target, knobs)`` into a ``Template``."""
    def wrap(fn):
        return Template(name, fn, target_kinds)
    return wrap


def _dlight_rules():
    return (gpu.Matmul(), gpu.GEMV(), gpu.Reduction(), gpu.GeneralReduction(), gpu.Fallback())


def _dlight(sch: s_tir.Schedule, target: Target, knobs: Knobs) -> None:
    """TVM's dlight GPU rules, the first that applies: the default for patterns without a GPU template."""
    func = sch.mod["main"]
    refused = []
    for rule in _dlight_rules():
        try:
            scheduled = rule.apply(func, target, False)
        except Exception as err:  # a rule that raises on this TensorIR does not apply; try the next
            refused.append(f"{type(rule).__name__}: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")
            continue
        if scheduled is None:
            continue
        if isinstance(scheduled, (list, tuple)):
            scheduled = scheduled[0]
        # A ScheduleFn must schedule the Schedule MetaSchedule handed it, so the rule's schedule of
        # a copy is replayed onto it; dlight draws no random decisions, so the replay is exact.
        scheduled.trace.apply_to_schedule(sch, remove_postproc=False)
        return
    raise ValueError("no dlight GPU rule applies" + (f" ({'; '.join(refused)})" if refused else ""))


# Patterns get this on a GPU until they have a GPU template of their own; it has no knobs.
DLIGHT = Template("dlight", _dlight, target_kinds=("cuda",))


@dataclasses.dataclass(frozen=True)
class RelaxRule:
    """How a pattern is found in a Relax model (``--fusion patterns``).

    ``make()`` returns ``(root, wildcards)``: a ``tvm.relax.dpl`` pattern whose root call is
    replaced, and the named sub-patterns ``rewrite`` needs. ``rewrite(matched, kernel)`` gets the
    matched expressions by name and ``kernel(shape, dtype, args)``, which adds this pattern's
    PrimFunc to the module and returns the ``call_tir``; it returns the replacement of the root, or
    None to leave this match alone (a shape or dtype the pattern does not cover).

    Rules run in decreasing ``priority``: a rule whose subgraph contains another rule's (attention
    contains a softmax) must run first, or the smaller match breaks the larger one up.
    """

    name: str
    make: Callable[[], tuple[Any, dict[str, Any]]]
    rewrite: Callable[[dict[str, Any], Callable], Any]
    priority: int = 0


# What a RelaxRule's ``rewrite`` reads off the expressions it matched.

def static_shape(expr) -> tuple[int, ...] | None:
    """The static shape of a matched expression, or None when it is symbolic."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def constant_value(expr):
    """The numpy value of a matched constant (``is_const()``)."""
    return expr.value.numpy()


def dtype_of(expr) -> str:
    return str(expr.ty.dtype)


@dataclasses.dataclass(frozen=True)
class ShapeParam:
    name: str
    default: int
    small: int
    doc: str = ""
    minimum: int = 1

    def with_sizes(self, default: int, small: int) -> ShapeParam:
        """The same parameter with another default and small size (a shared one, sized for a pattern)."""
        return dataclasses.replace(self, default=default, small=small)


Shape = dict[str, int]

# What nearly every pattern computes in: its TensorIR takes any of them (float32 accumulation).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# Pattern fields a pattern module fills by defining functions of these names (``from_module``);
# ``bytes`` is ``nbytes`` there, not to shadow the builtin.
MODULE_FUNCTIONS = {"build": "build", "reference": "reference", "make_inputs": "make_inputs",
                    "flops": "flops", "bytes": "nbytes", "onnx_graph": "onnx_graph", "sdpa": "sdpa",
                    "torch_function": "torch_function"}


@dataclasses.dataclass
class Pattern:
    """One fused computation and everything needed to tune, check and measure it.

    ``build(shape, dtype)`` returns a PrimFunc whose last ``num_outputs`` parameters are outputs.
    ``make_inputs(shape, dtype, seed)`` returns the input arrays in parameter order;
    ``reference(*inputs)`` returns the output array (or a tuple of them) in numpy; a reference
    that also depends on a non-array shape parameter takes it as ``reference(*inputs, shape=...)``.
    """

    name: str
    family: str
    description: str
    shape_params: Sequence[ShapeParam]
    build: Callable[[Shape, str], tirx.PrimFunc]
    reference: Callable[..., Any]
    make_inputs: Callable[[Shape, str, int], list[np.ndarray]]
    flops: Callable[[Shape], float]
    bytes: Callable[[Shape, str], float]
    # Schedule rules (``Template``) and kernel templates (``kernel_templates.KernelTemplate``), in
    # the order tried.
    templates: Sequence[Any]
    dtypes: Sequence[str] = ("float32",)
    num_outputs: int = 1
    relax_rules: Sequence[RelaxRule] = ()
    # The same computation in standard ONNX ops, for the baselines (onnxruntime, TVM auto-fusion,
    # XLA): graph inputs are make_inputs' arrays in order, outputs the reference's. None: no baselines.
    onnx_graph: Callable[[Shape, str], Any] | None = None
    # The numerical check's scaled error bound per dtype, where autofuse.accuracy's dtype-derived
    # one does not describe this computation (rarely).
    error_bounds: dict[str, float] = dataclasses.field(default_factory=dict)
    # The same computation through torch's scaled_dot_product_attention (the torch-sdpa baseline):
    # ``sdpa(torch, shape, *inputs)`` gets make_inputs' arrays as torch tensors and returns the
    # outputs in the reference's order; torch is passed in, a pattern file never imports it.
    sdpa: Callable[..., Sequence[Any]] | None = None
    # The same work in plain torch, as its users write it, for a pattern whose ONNX graph must do
    # more (no grouped GEMM in ONNX): ``torch_function(torch, shape, *inputs)``, called like sdpa.
    # torch-eager runs it and torch-compile compiles it instead of the ONNX graph.
    torch_function: Callable[..., Sequence[Any]] | None = None
    # Baselines doing more work than this pattern's kernel: contender name (or "onnx_graph": every
    # contender running onnx_graph) -> why, or a function of the shape giving why (None: the same
    # work at that shape). compare shows them labelled, outside ours / best.
    more_work: dict[str, str | Callable[[dict], str | None]] = dataclasses.field(default_factory=dict)

    def more_work_at(self, shape: dict) -> dict[str, str]:
        """``more_work`` at ``shape``: the baselines that do more work there, and why."""
        reasons = {name: reason(shape) if callable(reason) else reason for name, reason in self.more_work.items()}
        return {name: reason for name, reason in reasons.items() if reason}

    @classmethod
    def from_module(cls, namespace: dict[str, Any], **fields) -> Pattern:
        """The pattern a module ``search_spaces/<family>/<name>.py`` declares with
        ``PATTERN = Pattern.from_module(globals(), ...)``: ``name`` and ``family`` from the module's
        name, the functions of ``MODULE_FUNCTIONS``' names it defines or imports (``onnx_graph``,
        ``sdpa`` and ``torch_function`` where it has them), ``dtypes`` ``FLOAT_DTYPES``. ``fields``
        override any of these and give the rest (description, shape_params, templates, ...)."""
        parts = namespace.get("__name__", "").split(".")
        found = {"name": parts[-1], "family": parts[-2] if len(parts) > 1 else "", "dtypes": FLOAT_DTYPES}
        found.update({field: namespace[var] for field, var in MODULE_FUNCTIONS.items() if var in namespace})
        found.update(fields)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and found.get(f.name) in (None, "")]
        if missing:
            raise TypeError(f"pattern module {namespace.get('__name__')!r} gives no {', '.join(missing)}")
        return cls(**found)

    def run_reference(self, inputs, shape: Shape) -> list[np.ndarray]:
        takes_shape = "shape" in inspect.signature(self.reference).parameters
        out = self.reference(*inputs, shape=shape) if takes_shape else self.reference(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def default_shape(self) -> Shape:
        return {p.name: p.default for p in self.shape_params}

    def small_shape(self) -> Shape:
        return {p.name: p.small for p in self.shape_params}

    def resolve_shape(self, overrides: dict[str, Any] | None = None, base: str = "default") -> Shape:
        """The default (or small) shape with ``overrides`` applied, checked."""
        shape = self.small_shape() if base == "small" else self.default_shape()
        for key, value in (overrides or {}).items():
            if key not in shape:
                known = ", ".join(shape) or "none"
                raise AutofuseError(f"pattern {self.name!r} has no shape parameter {key!r} (known: {known})")
            try:
                number = int(str(value), 10)
            except ValueError:
                raise AutofuseError(f"shape parameter {key}={value!r} of {self.name!r} is not an integer") from None
            minimum = next(p.minimum for p in self.shape_params if p.name == key)
            if number < minimum:
                rule = "positive" if minimum == 1 else f">= {minimum}"
                raise AutofuseError(f"shape parameter {key}={number} of {self.name!r} must be {rule}")
            shape[key] = number
        return shape

    def check_dtype(self, dtype: str) -> str:
        if dtype not in self.dtypes:
            raise AutofuseError(f"pattern {self.name!r} supports dtype {', '.join(self.dtypes)}, not {dtype!r}")
        return dtype

    def output_specs(self, func: tirx.PrimFunc) -> list[tuple[tuple[int, ...], str]]:
        """(shape, dtype) of each output buffer, read off the PrimFunc's signature."""
        return [(tuple(int(d) for d in buf.shape), str(buf.dtype))
                for buf in param_buffers(func)[-self.num_outputs:]]

    def templates_for(self, target: Target, func: tirx.PrimFunc | None = None) -> list[Template]:
        """The pattern's own schedule rules for ``target``; on a GPU without one, ``DLIGHT``, and given
        ``func``, only when one of dlight's rules schedules it (a tuning space that raises on its
        first sample would end the session). Kernel templates: ``kernel_templates.kernel_templates_for``."""
        own = [t for t in self.templates if isinstance(t, Template) and t.applies_to(target)]
        if own or not DLIGHT.applies_to(target):
            return own
        if func is not None:
            try:
                DLIGHT.apply(func, target, tunable=False)
            except ValueError:
                return []
        return [DLIGHT]

    def check(self, outputs, inputs, shape: Shape, dtype: str, func: tirx.PrimFunc | None = None) -> Check:
        """``outputs`` against the reference on ``inputs``, at the bound for ``dtype`` and the
        PrimFunc's longest reduction (``func``: the PrimFunc at ``shape``, built when not given)."""
        expected = self.run_reference(inputs, shape)
        bounds = self.check_args(shape, dtype, func)
        return compare(outputs, expected, **bounds)

    def check_args(self, shape: Shape, dtype: str, func: tirx.PrimFunc | None = None) -> dict:
        """``accumulation`` and ``bound`` for ``autofuse.accuracy.compare`` of this pattern's outputs."""
        func = func if func is not None else self.build(shape, dtype)
        return {"accumulation": reduction_length(func), "bound": self.error_bounds.get(dtype)}


def shape_label(shape: Shape) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def onnx_model(name: str, nodes, inputs: Sequence[tuple[str, tuple[int, ...]]],
               outputs: Sequence[tuple[str, tuple[int, ...]]], dtype: str, initializers: dict | None = None,
               opset: int = 17):
    """A checked ONNX model of ``nodes`` (``onnx.helper.make_node``s) for a pattern's
    ``onnx_graph``: graph inputs and outputs of ``dtype``, constants from numpy arrays."""
    import onnx
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        list(nodes), name,
        [helper.make_tensor_value_info(n, elem, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info(n, elem, list(s)) for n, s in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="autofuse")
    onnx.checker.check_model(model)
    return model
