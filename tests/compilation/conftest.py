import pytest

from tests.compilation import graph_mutations
from tests.e2e.engine import run_engines

GRAPH_MODES = ("PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# k = 2 runs the mode that holds both kinds of graph (piecewise for mixed
# batches, full for uniform decode); k = 1 runs each.
MODES_PER_K = {1: GRAPH_MODES, 2: ("FULL_AND_PIECEWISE", )}


@pytest.fixture(scope="session")
def graph_runs() -> dict:
    """Every engine run of the graph-mode and mutation tests, two at a time
    (2 cores): the no-MTP eager reference, eager and each graph mode with
    MTP k = 1 (k = 2: FULL_AND_PIECEWISE), and each mutation. Keys: ``"reference"``, ``(k, mode)``,
    ``("mutation", name)``."""
    from tests.compilation.test_graph_modes import _graph_mode, _job
    jobs = {"reference": _job(0, enforce_eager=True)}
    for k, modes in MODES_PER_K.items():
        jobs[(k, "eager")] = _job(k, enforce_eager=True)
        for mode in modes:
            jobs[(k, mode)] = _job(k, **_graph_mode(mode))
    for name, k in graph_mutations.RUNS.items():
        jobs[("mutation", name)] = _job(
            k, setup=f"{graph_mutations.__name__}:{name}",
            **_graph_mode("FULL_DECODE_ONLY"))
    return run_engines(jobs)


def _result(run):
    if isinstance(run, BaseException):
        raise run
    return run


@pytest.fixture(scope="session")
def reference(graph_runs):
    """Greedy tokens of the graph-mode test batch, eager and without MTP:
    what every graph mode and k must give."""
    return _result(graph_runs["reference"])["outputs"]
