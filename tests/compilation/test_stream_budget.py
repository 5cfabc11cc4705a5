"""Capture sizes bounded by the NPU's streams (vllm_ascend.compilation
.stream_budget), at GLM-4.5's depth and at the fixture's."""

import os
from types import SimpleNamespace

import pytest
from vllm.config import CUDAGraphMode

from vllm_ascend.compilation import graph_mode, stream_budget

# vLLM 0.11's default capture sizes for max_num_seqs 256 (1, 2, 4, then
# steps of 8 up to 512), aligned to 1 + k = 2.
DEFAULT_SIZES = sorted({-(-s // 2) * 2
                        for s in [1, 2, 4] + list(range(8, 513, 8))},
                       reverse=True)
GLM45_LAYERS = 92


def _config(mode, layers=GLM45_LAYERS, tp=8, dp=2, ep=True):
    model_config = SimpleNamespace(get_num_layers=lambda parallel: layers)
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                        data_parallel_size=dp,
                                        enable_expert_parallel=ep))


@pytest.mark.parametrize("mode", [
    CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE,
    CUDAGraphMode.FULL_DECODE_ONLY
])
@pytest.mark.parametrize("tp,dp,ep", [(8, 2, True), (2, 2, True),
                                      (16, 1, False), (1, 1, False)])
def test_glm45_depth_fits_in_the_streams(mode, tp, dp, ep):
    """The reference serve command's layout and others at 92 layers + MTP:
    what is kept takes at most the NPU's streams, and dropping was
    needed."""
    config = _config(mode, tp=tp, dp=dp, ep=ep)
    kept = graph_mode._bound_by_streams(config, DEFAULT_SIZES, 1)
    budget = graph_mode.budget_of(config, 1)
    assert kept, "no capture size left"
    assert budget.streams_taken(len(kept) * budget.graphs_per_size) \
        <= stream_budget.NPU_STREAMS
    one_more = budget.streams_taken((len(kept) + 1) *
                                    budget.graphs_per_size)
    assert len(kept) == len(DEFAULT_SIZES) or \
        one_more > stream_budget.NPU_STREAMS
    # The smallest and the largest size stay.
    assert min(kept) == min(DEFAULT_SIZES)
    assert max(kept) == max(DEFAULT_SIZES)
    if mode != CUDAGraphMode.FULL_DECODE_ONLY:
        # One graph per piece (93) per size: vLLM's 66 sizes cannot fit.
        assert len(kept) < len(DEFAULT_SIZES)


def test_original_command_budget():
    """DP 2 x TP 8 + EP, MTP k = 1, the report's capture sizes: per size
    93 pieces + one full graph (no draft graphs under DP), each on the TP
    and the MoE exchange group (1 + 2 * 2 streams); three groups set up."""
    config = _config(CUDAGraphMode.FULL_AND_PIECEWISE)
    budget = graph_mode.budget_of(config, 1)
    assert budget.graphs_per_size == 94
    assert budget.streams_per_size == 94 * 5
    assert budget.streams_for_graphs == 2048 - 248 - 3 * 40
    assert budget.max_sizes == 3
    kept = graph_mode._bound_by_streams(config, [2, 4, 8, 16, 32, 48, 64], 1)
    assert kept == [64, 16, 2]


def test_draft_graphs_counted_without_dp():
    config = _config(CUDAGraphMode.FULL_DECODE_ONLY, tp=16, dp=1, ep=False)
    assert graph_mode.budget_of(config, 1).graphs_per_size == 2
    assert graph_mode.budget_of(config, 0).graphs_per_size == 1


def test_small_model_keeps_every_size():
    config = _config(CUDAGraphMode.FULL_AND_PIECEWISE, layers=3, tp=1, dp=1,
                     ep=False)
    assert graph_mode._bound_by_streams(config, DEFAULT_SIZES,
                                        1) == DEFAULT_SIZES


@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 66, 100])
def test_keep_evenly(count):
    sizes = list(range(1, 67))
    kept = stream_budget.keep_evenly(sizes, count)
    assert len(kept) == min(count, len(sizes))
    assert kept == sorted(kept) and set(kept) <= set(sizes)
    if count >= 2:
        assert kept[0] == 1 and kept[-1] == 66


def test_launch_blocking_refused_with_graphs(monkeypatch):
    from vllm.config import CompilationLevel
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    compilation = SimpleNamespace(
        use_inductor=True, cudagraph_capture_sizes=[4, 2],
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        level=CompilationLevel.PIECEWISE)
    config = SimpleNamespace(
        compilation_config=compilation, model_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    with pytest.raises(ValueError, match="ASCEND_LAUNCH_BLOCKING=1"):
        graph_mode.configure_graph_mode(config, 1, graphs=True)
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    graph_mode.configure_graph_mode(config, 1, graphs=True)
    assert os.environ["ASCEND_LAUNCH_BLOCKING"] == "1"
