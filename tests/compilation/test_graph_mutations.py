"""Mutation tests of full graphs + MTP: each failure class behind the
garbled output of full graphs + MTP on Ascend, put back on purpose
(``graph_mutations.py``), shows as wrong tokens or a clear capture/replay
error; ``test_graph_modes.py`` shows the same runs correct without it."""

import pytest

from tests.compilation.graph_jobs import result


def _run(graph_runs, mutation: str) -> dict:
    return result(graph_runs[("mutation", mutation)])


@pytest.mark.parametrize("mutation", [
    # Verify-batch attention keeps the lengths frozen at capture.
    "stale_attention_lengths",
    # The KV writes of a replay go to the slots of the buffer the graph
    # captured, not to the rebound one.
    "rebound_slot_mapping",
])
def test_mutation_gives_wrong_tokens(graph_runs, reference, mutation):
    got = _run(graph_runs, mutation)
    assert got["inspect"]["graphs"]["replayed"], "no graph was replayed"
    assert got["outputs"] != reference, mutation


def test_shared_parameter_store_is_caught(graph_runs, reference):
    """Target and draft graphs of one size sharing their attention tasks:
    the draft's replay updates the target's tasks with the draft's batch
    (and the reverse), so the run fails or its tokens are wrong."""
    got = graph_runs[("mutation", "shared_task_store")]
    if isinstance(got, AssertionError):
        assert "engine failed" in str(got)
    else:
        assert got["outputs"] != reference


def test_host_sync_in_a_captured_forward_fails_capture(graph_runs):
    # (A replay without any task update fails at the event wait:
    # test_graph_emulator.py::test_replay_without_task_update_fails.)
    failure = graph_runs[("mutation", "host_sync_in_attention")]
    assert isinstance(failure, AssertionError), "the capture did not fail"
    assert "engine failed" in str(failure)
    assert ("GraphCaptureError: Tensor.item() of a tensor the graph "
            "recorded") in str(failure)


def test_host_sync_in_the_draft_forward_fails_capture(graph_runs):
    """The MTP layer's position-0 mask written with a boolean index, as
    before patch 0007: the draft graph's capture fails and names the op."""
    failure = graph_runs[("mutation", "boolean_mask_in_draft")]
    assert isinstance(failure, AssertionError), "the capture did not fail"
    assert "GraphCaptureError: aten.index_put_" in str(failure)
    assert "depends on tensor values" in str(failure)


def test_unaligned_capture_sizes_stay_correct(graph_runs, reference):
    """Sizes that are not multiples of 1 + k: a captured verify batch then
    ends with a partial request, and each replay pads the host lengths to
    the captured batch, so the tokens stay right. The plugin still rounds
    the sizes (no graph wastes a partial request's tokens)."""
    got = _run(graph_runs, "unaligned_capture_sizes")
    assert any(size % 3 for size in got["inspect"]["capture_sizes"])
    assert got["outputs"] == reference
