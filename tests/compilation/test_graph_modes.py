"""Graph modes with MTP on the NPU code paths (through the torch_npu double
without an NPU): same tokens, same acceptance as eager, and graphs really
captured and replayed.

The reference serve command's capture sizes ``[1, 4, 8, 16, 32, 48, 64]``,
rounded to multiples of ``1 + k``; batches that hit them and batches that
miss them (prefill chunks run eager), chunked prefill, forced preemption.
"""

import pytest

from tests.compilation.graph_jobs import (MAX_BATCHED_TOKENS, MAX_NUM_SEQS,
                                          MODES_PER_K, NUM_LAYERS,
                                          ORIGINAL_SIZES, result)


def _accepted(run: dict) -> tuple:
    m = run["metrics"]
    return (m["vllm:spec_decode_num_drafts"],
            m["vllm:spec_decode_num_accepted_tokens"],
            tuple(m["vllm:spec_decode_num_accepted_tokens_per_pos"]))


def _sizes_of(keys, mode: str, role: str = "target") -> dict[int, int]:
    """{num_tokens: count} of one role's graphs of one runtime mode."""
    out: dict[int, int] = {}
    for key, n in keys.items():
        key_role, runtime_mode, size = key.split(":")
        if key_role == role and runtime_mode == mode:
            out[int(size)] = n
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_graph_modes_match_eager_with_mtp(graph_runs, reference, k):
    eager = result(graph_runs[(k, "eager")])
    assert eager["outputs"] == reference
    assert eager["inspect"]["graphs"]["captured"] == {}
    assert eager["metrics"]["vllm:num_preemptions"] > 0

    step = 1 + k
    want_sizes = sorted({-(-s // step) * step for s in ORIGINAL_SIZES
                         if -(-s // step) * step <= MAX_BATCHED_TOKENS})
    # Full graphs hold uniform batches: up to max_num_seqs requests of
    # 1 + k tokens.
    want_full = [s for s in want_sizes if step <= s <= MAX_NUM_SEQS * step]
    for mode in MODES_PER_K[k]:
        run = result(graph_runs[(k, mode)])
        info = run["inspect"]
        assert run["outputs"] == reference, mode
        assert _accepted(run) == _accepted(eager), mode
        assert run["metrics"]["vllm:num_preemptions"] > 0
        assert info["cudagraph_mode"] == mode
        assert sorted(info["capture_sizes"]) == want_sizes
        captured = info["graphs"]["captured"]
        replayed = info["graphs"]["replayed"]
        if "PIECEWISE" in mode:
            # One graph per piece per size: 1 + num_layers pieces.
            pieces = _sizes_of(captured, "PIECEWISE")
            assert sorted(pieces) == want_sizes, captured
            assert set(pieces.values()) == {1 + NUM_LAYERS}, captured
            assert _sizes_of(replayed, "PIECEWISE"), replayed
        if "FULL" in mode:
            # One graph per size, attention inside; decode steps replayed
            # several sizes (11 requests, then fewer as they finish).
            full = _sizes_of(captured, "FULL")
            assert sorted(full) == want_full, captured
            assert set(full.values()) == {1}, captured
            assert len(_sizes_of(replayed, "FULL")) >= 2, replayed
            # The draft: one graph per capture size, replayed at each
            # draft step that fits one.
            draft = _sizes_of(captured, "FULL", role="draft")
            assert sorted(draft) == want_sizes, captured
            assert _sizes_of(replayed, "FULL", role="draft"), replayed
        else:
            assert not _sizes_of(captured, "FULL"), captured
            assert not _sizes_of(captured, "FULL", role="draft"), captured
        if mode == "PIECEWISE":
            assert len(_sizes_of(replayed, "PIECEWISE")) >= 2, replayed
