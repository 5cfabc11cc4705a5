"""What a capture does around its graphs (issue 28 S3-9, S4-1): the cache
is emptied once per forward, not once per piece, and graphs are captured on
a side stream that first waits for the work queued before."""

import tempfile

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(REAL_NPU, reason="counts the double's calls"),
]

PIECES = 6


@pytest.fixture
def npu():
    with torch_npu_in_process() as module:
        yield module


def _empty_cache_calls() -> int:
    return torch.npu.state.empty_cache_calls


def test_torch_npu_graph_empties_the_cache_at_every_capture(npu):
    """The double's torch.npu.graph does what torch_npu's __enter__ does
    (torch_npu/npu/graphs.py: synchronize, gc.collect, empty_cache)."""
    x = torch.ones(8)
    before = _empty_cache_calls()
    for _ in range(PIECES):
        with torch.npu.graph(torch.npu.NPUGraph()):
            torch.mul(x, 2)
    assert _empty_cache_calls() - before == PIECES


def test_a_forward_of_many_pieces_empties_the_cache_once(npu, monkeypatch):
    """vLLM's piecewise backend marks every piece after the first
    ``gc_disable``; the plugin's wrapper then neither collects nor empties
    the cache (vLLM patches torch.cuda.empty_cache for that)."""
    from vllm.compilation.cuda_graph import CUDAGraphOptions
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor
    from vllm.platforms import current_platform

    from vllm_ascend.compilation.graph_wrapper import AscendGraphWrapper

    # The NPU platform's pool (this process runs the CPU reference one).
    monkeypatch.setattr(type(current_platform), "_global_graph_pool",
                        torch.npu.graph_pool_handle())
    config = VllmConfig()
    x = torch.ones(8)
    pieces = [
        AscendGraphWrapper(lambda t: torch.mul(t, 2), config,
                           CUDAGraphMode.PIECEWISE,
                           CUDAGraphOptions(gc_disable=i > 0))
        for i in range(PIECES)
    ]
    before = _empty_cache_calls()
    set_cudagraph_capturing_enabled(True)
    try:
        with torch.npu.stream(torch.npu.Stream()):
            for wrapper in pieces:
                wrapper.run(BatchDescriptor(num_tokens=8), (x, ), {})
    finally:
        set_cudagraph_capturing_enabled(False)
    assert all(w.concrete_cudagraph_entries for w in pieces)
    assert _empty_cache_calls() - before == 1


def test_no_capture_on_the_default_stream(npu):
    """torch_npu's NPUGraph::capture_begin: "NPU graphs must be captured
    on a non-default stream"."""
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()


def test_capture_stream_waits_for_queued_work(npu):
    """The runner captures the target's and the draft's graphs in vLLM's
    ``graph_capture``: a side stream that waits for the current one."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (cleanup_dist_env_and_memory,
                                  init_distributed_environment,
                                  initialize_model_parallel)
    from vllm.distributed.parallel_state import (graph_capture,
                                                 model_parallel_is_initialized)

    from vllm_ascend.worker.streams import use_npu_streams

    saved = {name: getattr(torch.cuda, name) for name in
             ("Event", "Stream", "current_stream", "default_stream",
              "stream")}
    use_npu_streams()
    # A 1-rank world, unless another test module's is still up.
    own_world = not model_parallel_is_initialized()
    try:
        if own_world:
            with set_current_vllm_config(VllmConfig()):
                init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, backend="gloo",
                    distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
                initialize_model_parallel(1, 1)
        queued_on = torch.npu.current_stream()
        with graph_capture(device=torch.device("cpu")) as context:
            assert torch.npu.current_stream() is context.stream
            assert context.stream is not queued_on
            assert context.stream.waited_on == [queued_on]
            graph = torch.npu.NPUGraph()
            graph.capture_begin()
            torch.mul(torch.ones(4), 2)
            graph.capture_end()
    finally:
        if own_world:
            cleanup_dist_env_and_memory()
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
