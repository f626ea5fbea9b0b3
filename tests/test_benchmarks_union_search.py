"""benchmarks/union_search.py's summary: the union over the better of its arms per seed, the arms it
fell behind, and a space whose search failed (MetaSchedule's generic rules on some TensorIR) shown
as failed and left out of the rivals instead of ending the run."""

import importlib.util
import os

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def union_search():
    spec = importlib.util.spec_from_file_location("union_search", os.path.join(REPO, "benchmarks", "union_search.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(space, ms, **extra):
    return {"space": space, "seed": 0, "best_ms": ms, "retimed_ms": ms, **extra}


def test_the_union_is_judged_against_the_better_arm(union_search):
    cases = [{"label": "a", "runs": [_run("template", 2.0), _run("generic", 1.0), _run("union", 1.2)]}]
    summary = union_search.summarize(cases)
    assert summary["union_over_best_arm"]["a"] == pytest.approx(1.2)
    assert summary["union_behind_an_arm"]["a"] == [{"seed": 0, "arm": "generic", "ratio": pytest.approx(1.2)}]


def test_a_failed_arm_is_shown_and_left_out(union_search):
    failed = {"space": "generic", "seed": 0, "best_ms": None, "error": "generic space fails"}
    cases = [{"label": "b", "runs": [_run("template", 2.0), failed, _run("union", 1.9)], "default_ms": {"0": 2.5}}]
    summary = union_search.summarize(cases)
    assert summary["union_over_best_arm"]["b"] == pytest.approx(0.95) and not summary["union_behind_an_arm"]
    report = {"trials": 4, "seeds": [0], "cases": cases, "summary": summary}
    row = next(line for line in union_search.markdown(report).splitlines() if line.startswith("| b |"))
    assert "| fails |" in row and "0.950" in row
