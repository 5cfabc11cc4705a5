import pytest

from tests.compilation import graph_mutations
from tests.compilation.graph_jobs import (MODES_PER_K, graph_mode, job, result,
                                          write_checkpoint)
from tests.utils.engine import run_engines


@pytest.fixture(scope="session")
def graph_runs(tmp_path_factory) -> dict:
    """Every engine run of the graph-mode and mutation tests, two at a time
    (2 cores): the no-MTP eager reference, eager and each graph mode with
    MTP k = 1 and 2 (graph_jobs.MODES_PER_K), and each mutation (the runs:
    graph_jobs.py). Keys: ``"reference"``, ``(k, mode)``,
    ``("mutation", name)``."""
    model = write_checkpoint(tmp_path_factory.mktemp("glm45-graphs"))
    jobs = {"reference": job(model, 0, enforce_eager=True)}
    for k, modes in MODES_PER_K.items():
        jobs[(k, "eager")] = job(model, k, enforce_eager=True)
        for mode in modes:
            jobs[(k, mode)] = job(model, k, **graph_mode(mode))
    for name, k in graph_mutations.RUNS.items():
        jobs[("mutation", name)] = job(
            model, k, setup=f"{graph_mutations.__name__}:{name}",
            **graph_mode("FULL_DECODE_ONLY"))
    return run_engines(jobs)


@pytest.fixture(scope="session")
def reference(graph_runs):
    """Greedy tokens of the graph-mode test batch, eager and without MTP:
    what every graph mode and k must give."""
    return result(graph_runs["reference"])["outputs"]
