"""Mutation tests of full graphs + MTP: each failure class behind the
garbled output of full graphs + MTP on Ascend, put back on purpose
(``graph_mutations.py``), shows as wrong tokens or a clear capture/replay
error; ``test_graph_modes.py`` shows the same runs correct without it."""

import pytest

from tests.compilation.test_graph_modes import (MAX_NEW, _engine, _graph_mode,
                                                _prompts)
from tests.e2e.engine import run_engine

MUTATIONS = "tests.compilation.graph_mutations"


def _run(k: int, mutation: str, mode: str = "FULL_DECODE_ONLY") -> dict:
    prompts = _prompts()
    sampling = [dict(temperature=0, max_tokens=MAX_NEW - (i % 4),
                     ignore_eos=True) for i in range(len(prompts))]
    return run_engine(_engine(k, **_graph_mode(mode)), prompts, sampling,
                      inspect=True, setup=f"{MUTATIONS}:{mutation}")


@pytest.mark.parametrize("mutation", [
    # Verify-batch attention keeps the lengths frozen at capture.
    "stale_attention_lengths",
    # The KV writes of a replay go to the slots of the buffer the graph
    # captured, not to the rebound one.
    "rebound_slot_mapping",
])
def test_mutation_gives_wrong_tokens(reference, mutation):
    got = _run(1, mutation)
    assert got["inspect"]["graphs"]["replayed"], "no graph was replayed"
    assert got["outputs"] != reference, mutation


def test_shared_parameter_store_is_caught(reference):
    """Target and draft graphs of one size sharing their attention tasks:
    the draft's replay updates the target's tasks with the draft's batch
    (and the reverse), so the run fails or its tokens are wrong."""
    try:
        got = _run(1, "shared_task_store")
    except AssertionError as failure:
        assert "engine failed" in str(failure)
    else:
        assert got["outputs"] != reference


def test_host_sync_in_a_captured_forward_fails_capture():
    # (A replay without any task update fails at the event wait:
    # test_graph_emulator.py::test_replay_without_task_update_fails.)
    with pytest.raises(AssertionError, match="engine failed") as failure:
        _run(1, "host_sync_in_attention")
    assert ("GraphCaptureError: Tensor.item() of a tensor the graph "
            "recorded") in str(failure.value)


def test_unaligned_capture_sizes_stay_correct(reference):
    """Sizes that are not multiples of 1 + k: a captured verify batch then
    ends with a partial request, and each replay pads the host lengths to
    the captured batch, so the tokens stay right. The plugin still rounds
    the sizes (no graph wastes a partial request's tokens)."""
    got = _run(2, "unaligned_capture_sizes")
    assert any(size % 3 for size in got["inspect"]["capture_sizes"])
    assert got["outputs"] == reference
