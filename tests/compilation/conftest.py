import pytest


@pytest.fixture(scope="session")
def reference():
    """Greedy tokens of the graph-mode test batch, eager and without MTP:
    what every graph mode and k must give."""
    from tests.compilation.test_graph_modes import _run
    return _run(0, enforce_eager=True)["outputs"]
