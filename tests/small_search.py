"""MetaSchedule sized for the tests' budgets of 1 to 24 trials on a 2-core machine: the test process
(conftest) and the commands it forks (tests/cli_forkserver.py) search with it. The same search
strategy, builder and runner; only the defaults below change: the search population, the builder
processes, and how long each timed repeat lasts at least (TIMING_MIN_REPEAT_MS)."""

SEARCH_POPULATION = 64
BUILDER_WORKERS = 1
# The least milliseconds one timed repeat lasts (its calls are averaged): TVM's evaluators, the
# runner's (MetaSchedule: 100) and compare's wall-clock timer (autofuse: 20 to 50). Every timing
# still runs its repeats, warm-up and median as it would; no test asserts how precise a
# microsecond kernel's time is, and 10 repeats of 50 ms per timed kernel were most of a small
# tune command (choose, the untuned and best columns: 10 of its 21 s).
TIMING_MIN_REPEAT_MS = 1


def _smaller_search_population():
    """MetaSchedule's evolutionary search breeds 512 candidates a round even for one trial: most of a
    small session's CPU in the search itself (4 patterns x 1 trial: 125 s of CPU, 36 s with a
    population of 16). The same EvolutionarySearch, with SEARCH_POPULATION."""
    from tvm.s_tir.meta_schedule.search_strategy import EvolutionarySearch, SearchStrategy

    default = SearchStrategy.create

    def create(kind="evolutionary", *args, **kwargs):
        if kind == "evolutionary" and not args and not kwargs:
            return EvolutionarySearch(population_size=SEARCH_POPULATION)
        return default(kind, *args, **kwargs)

    SearchStrategy.create = staticmethod(create)


def _fewer_builder_processes():
    """autofuse's builder keeps one process per core for a session, and each first imports TVM and
    autofuse (~5 s of CPU): on 2 cores, a good part of a small session. One builder process builds
    the tests' small kernels in about the same time."""
    from autofuse.tune import PooledBuilder

    default = PooledBuilder.__init__

    def init(self, *args, max_workers=None, **kwargs):
        default(self, *args, max_workers=BUILDER_WORKERS if max_workers is None else max_workers, **kwargs)

    PooledBuilder.__init__ = init


def _capped(function):
    """``function`` with its ``min_repeat_ms`` argument (keyword or positional) at most
    TIMING_MIN_REPEAT_MS; its default when not given (0 or 20 ms) is capped as well."""
    import functools
    import inspect

    signature = inspect.signature(function)

    @functools.wraps(function)
    def capped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bound.arguments["min_repeat_ms"] = min(bound.arguments["min_repeat_ms"], TIMING_MIN_REPEAT_MS)
        return function(*bound.args, **bound.kwargs)

    capped.small_search_capped = True
    return capped


def _shorter_timed_repeats():
    """TIMING_MIN_REPEAT_MS for every timer: TVM's time_evaluator of a kernel and of a Relax VM
    (autofuse.measure.time_function, the model's latency, the roofline), compare's wall-clock
    timer (autofuse.measure.time_calls), and MetaSchedule's runner (EvaluatorConfig's default,
    which LocalRunner and RPCRunner send with each candidate to the process that times it)."""
    import tvm
    from tvm.runtime.vm import VirtualMachine
    from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig

    from autofuse import measure

    for owner, name in ((tvm.runtime.Module, "time_evaluator"), (VirtualMachine, "time_evaluator"),
                        (measure, "time_calls")):
        if not getattr(getattr(owner, name), "small_search_capped", False):
            setattr(owner, name, _capped(getattr(owner, name)))
    defaults = EvaluatorConfig._field_defaults
    EvaluatorConfig.__new__.__defaults__ = tuple(
        min(value, TIMING_MIN_REPEAT_MS) if field == "min_repeat_ms" else value for field, value in defaults.items())


def use_small_search():
    _smaller_search_population()
    _fewer_builder_processes()
    _shorter_timed_repeats()
