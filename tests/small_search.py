"""MetaSchedule sized for the tests' budgets of 1 to 24 trials on a 2-core machine: the test process
(conftest) and the commands it forks (tests/cli_forkserver.py) search with it. The same search
strategy, builder and runner; only the two defaults below change."""

SEARCH_POPULATION = 64
BUILDER_WORKERS = 1


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


def use_small_search():
    _smaller_search_population()
    _fewer_builder_processes()
