import inspect
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _getmodule_without_a_futile_scan(real):
    """TVMScript's parser calls ``inspect.stack()`` for every ``T.prim_func`` and buffer it parses.
    For a frame whose file is not on disk (``<frozen runpy>`` under ``python -m pytest``,
    ``<frozen importlib._bootstrap>`` inside an import), ``inspect.getmodule`` then scans all of
    ``sys.modules`` (thousands of modules in a test session), three times a frame, and finds none:
    that made every TensorIR parse here 4x slower, and the import of TVM's CUDA tensor
    intrinsics (~500 parses) 50 s of CPU instead of 3. Such a frame gets what the scan would give
    it, without the scan: the module its name was already mapped to, else None."""
    def getmodule(object, _filename=None):
        if _filename is not None and _filename[:1] == "<" and _filename[-1:] == ">" and inspect.isframe(object):
            name = inspect.modulesbyfile.get(_filename) or inspect.modulesbyfile.get(
                os.path.normcase(os.path.abspath(_filename)))
            return sys.modules.get(name) if name else None
        return real(object, _filename)
    return getmodule


inspect.getmodule = _getmodule_without_a_futile_scan(inspect.getmodule)

SEARCH_POPULATION = 64


def _smaller_search_population():
    """The tests tune budgets of 1 to 24 trials, for which MetaSchedule's evolutionary search still
    breeds 512 candidates a round: most of a small session's CPU (4 patterns x 1 trial: 125 s of
    CPU, 36 s with a population of 16). Tuning in the test process searches with SEARCH_POPULATION
    instead: the same EvolutionarySearch, a smaller population."""
    from tvm.s_tir.meta_schedule.search_strategy import EvolutionarySearch, SearchStrategy

    default = SearchStrategy.create

    def create(kind="evolutionary", *args, **kwargs):
        if kind == "evolutionary" and not args and not kwargs:
            return EvolutionarySearch(population_size=SEARCH_POPULATION)
        return default(kind, *args, **kwargs)

    SearchStrategy.create = staticmethod(create)


_smaller_search_population()


def run_cli(*args, cwd=None, timeout=900):
    """``autofuse ARGS`` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)


def store_roofline(db_root) -> None:
    """Roofline figures stored in ``db_root`` for this CPU, so a benchmark run there does not spend
    half a minute measuring them."""
    import dataclasses
    import json
    import pathlib

    from autofuse.roofline import Machine
    from autofuse.target import host_cores, parse_target, target_key

    folder = pathlib.Path(db_root) / target_key(parse_target("llvm"))
    folder.mkdir(parents=True)
    machine = Machine(10.0, 100.0, "test", "test", host_cores(), bandwidth_ladder=[[1 << 20, 20.0], [1 << 28, 10.0]],
                      peak_label="FMA peak")
    (folder / "roofline.json").write_text(json.dumps(dataclasses.asdict(machine)))


@pytest.fixture(scope="session")
def tuned_db(tmp_path_factory):
    """One tiny tuning run shared by the tests that need records: linear_bias_relu at its small
    shape, 8 trials of the union space."""
    root = tmp_path_factory.mktemp("db")
    result = run_cli("tune", "--pattern", "linear_bias_relu", "--small", "--trials", "8", "--seed", "1",
                     "--db", str(root), "--no-progress", "--json", str(root / "rows.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


@pytest.fixture(scope="session")
def built_mlp(tmp_path_factory):
    """models/mlp.onnx built with --fusion patterns and no records."""
    out = tmp_path_factory.mktemp("built") / "mlp.so"
    result = run_cli("build", os.path.join(REPO, "models", "mlp.onnx"), "--db", "none", "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out
