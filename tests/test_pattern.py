import pytest

from autofuse.errors import AutofuseError
from autofuse.pattern import FLOAT_DTYPES, Knobs, Pattern, ShapeParam, fit_tiles
from autofuse.registry import get_pattern


@pytest.mark.parametrize("extent,inner,expected", [
    (256, [4, 16], [4, 4, 16]), (12, [8], [2, 6]), (7, [4], [7, 1]), (16, [32], [1, 16])])
def test_fit_tiles_is_a_perfect_tiling(extent, inner, expected):
    tiles = fit_tiles(extent, inner)
    assert tiles == expected
    product = 1
    for t in tiles:
        product *= t
    assert product == extent


def test_resolve_shape_checks_values():
    pattern = get_pattern("linear_bias_relu")
    assert pattern.resolve_shape({"m": "64"})["m"] == 64
    with pytest.raises(AutofuseError, match="not an integer"):
        pattern.resolve_shape({"m": "1.5"})
    with pytest.raises(AutofuseError, match="positive"):
        pattern.resolve_shape({"m": "0"})
    with pytest.raises(AutofuseError, match="no shape parameter"):
        pattern.resolve_shape({"zz": "3"})


def test_unknown_pattern_suggests_a_close_name():
    with pytest.raises(AutofuseError, match="did you mean 'linear_bias_relu'"):
        get_pattern("linear_bias_rel")


def _tiny_loop_schedule():
    from tvm import s_tir
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def copy(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("copy"):
                vi = T.axis.spatial(64, i)
                b[vi] = a[vi]

    sch = s_tir.Schedule(copy)
    return sch, sch.get_loops(sch.get_sblock("copy"))[0]


def test_knob_overrides_replace_defaults_in_order_and_none_keeps_one():
    sch, loop = _tiny_loop_schedule()
    knobs = Knobs(sch, tunable=False, overrides=[[8], None, 64])
    assert knobs.tile(loop, 2, [4]) == [8, 8]
    assert knobs.tile(loop, 2, [4]) == [16, 4]
    assert knobs.choice([0, 16, 64], 16) == 64
    assert knobs.choice([0, 16, 64], 16) == 16  # overrides used up: defaults again


def test_knob_override_outside_the_candidates_is_refused():
    sch, _ = _tiny_loop_schedule()
    with pytest.raises(ValueError, match="not among candidates"):
        Knobs(sch, tunable=False, overrides=[7]).choice([0, 16, 64], 16)


def test_template_apply_passes_overrides_to_its_knobs():
    from autofuse.target import parse_target
    pattern = get_pattern("linear_bias_relu")
    template = next(t for t in pattern.templates if t.name == "cuda_tiled_epilogue")
    func = pattern.build(pattern.resolve_shape(None, "small"), "float32")
    default = template.apply(func, parse_target("h200"), tunable=False)
    wider = template.apply(func, parse_target("h200"), tunable=False, overrides=[[8], [2]])
    assert 'T.thread_binding(16, thread="threadIdx.y")' in str(default.mod)
    assert 'T.thread_binding(8, thread="threadIdx.y")' in str(wider.mod)
    assert 'T.thread_binding(2, thread="vthread.y")' in str(wider.mod)


def _module_namespace(**functions):
    def fn(*args, **kwargs):
        return None
    names = ("build", "reference", "make_inputs", "flops", "nbytes")
    namespace = {"__name__": "search_spaces.demo_family.demo_pattern"}
    namespace.update({n: functions.get(n, fn) for n in names})
    namespace.update({n: f for n, f in functions.items() if n not in names})
    return namespace


def test_from_module_takes_the_conventional_names():
    def nbytes(shape, dtype):
        return 7.0

    namespace = _module_namespace(nbytes=nbytes)
    pattern = Pattern.from_module(namespace, description="d", shape_params=[ShapeParam("n", 4, 2)], templates=[])
    assert (pattern.name, pattern.family) == ("demo_pattern", "demo_family")
    assert pattern.bytes is nbytes and pattern.build is namespace["build"]
    assert pattern.dtypes == FLOAT_DTYPES
    assert pattern.onnx_graph is None and pattern.sdpa is None  # optional: absent from the module


def test_from_module_fields_override_the_module():
    def sdpa(torch, shape, *inputs):
        return inputs

    def other_build(shape, dtype):
        return None

    pattern = Pattern.from_module(_module_namespace(sdpa=sdpa), name="renamed", build=other_build, dtypes=("float32",),
                                  description="d", shape_params=[], templates=[])
    assert pattern.name == "renamed" and pattern.family == "demo_family"
    assert pattern.build is other_build and pattern.sdpa is sdpa and pattern.dtypes == ("float32",)


def test_from_module_names_what_the_module_lacks():
    namespace = _module_namespace()
    del namespace["make_inputs"]
    with pytest.raises(TypeError, match="gives no description, make_inputs$"):
        Pattern.from_module(namespace, shape_params=[], templates=[])


def test_registered_patterns_take_their_module_functions():
    import search_spaces.attention.cross_attention as module
    pattern = get_pattern("cross_attention")
    assert pattern.build is module.build and pattern.bytes is module.nbytes and pattern.sdpa is module.sdpa


def test_shape_param_with_sizes_keeps_name_doc_and_minimum():
    param = ShapeParam("causal", 1, 1, "mask", minimum=0)
    assert param.with_sizes(0, 1) == ShapeParam("causal", 0, 1, "mask", minimum=0)
