import pytest

from autofuse.errors import AutofuseError
from autofuse.pattern import fit_tiles
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
