"""KV-cache sizing on the NPU counts memory outside torch's allocator.

HCCL buffers and the ATB/aclnn workspaces are allocated on first use,
during the profile run, and torch's peak does not see them. The double
charges such a workspace at the first kernel; the KV cache must leave room
for it.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process
from vllm_ascend.worker import streams
from vllm_ascend.worker.worker import NpuWorker, _non_torch_memory

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="drives the double's emulated memory")
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture
def npu_memory(monkeypatch):
    with torch_npu_in_process() as tnpu:
        monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB", "4")
        monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_WORKSPACE_MIB", "96")
        state = tnpu.npu.state
        state.workspace, state.peak = 0, 0
        torch_bytes = {"now": 0}

        def allocated():
            state.peak = max(state.peak, torch_bytes["now"])
            return torch_bytes["now"]

        monkeypatch.setattr(state, "allocated", allocated)
        yield tnpu, state, torch_bytes


def _worker_at_start(utilization: float) -> SimpleNamespace:
    """What NpuWorker.init_device records, for kv_cache_bytes."""
    free, total = torch.npu.mem_get_info()
    return SimpleNamespace(
        cache_config=SimpleNamespace(gpu_memory_utilization=utilization),
        init_free_memory=free,
        init_non_torch_memory=_non_torch_memory(free, total))


def test_kv_cache_leaves_room_for_memory_outside_torch(npu_memory):
    tnpu, state, torch_bytes = npu_memory
    worker = _worker_at_start(0.5)
    # Weights and the profile run: a 1 GiB torch peak; the first kernel
    # launch allocates the workspace outside torch.
    torch.npu.reset_peak_memory_stats()
    torch_bytes["now"] = GiB
    tnpu.npu_swiglu(torch.randn(2, 4))
    torch_bytes["now"] = 300 * MiB
    available = NpuWorker.kv_cache_bytes(worker)
    # 0.5 of 4 GiB, less the torch peak, less the 96 MiB workspace.
    assert available == 2 * GiB - GiB - 96 * MiB
    # Everything then in use fits the requested share of the device.
    assert (available + state.peak + state.workspace) <= 2 * GiB


def test_kv_cache_error_when_nothing_is_left(npu_memory):
    _, state, torch_bytes = npu_memory
    worker = _worker_at_start(0.1)
    torch_bytes["now"] = GiB
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        NpuWorker.kv_cache_bytes(worker)


def test_cuda_stream_api_maps_to_npu_for_the_process(monkeypatch):
    with torch_npu_in_process():
        for name in streams.CUDA_STREAM_API:
            monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
        streams.use_npu_streams()
        # What vLLM's runner calls at every step with async scheduling.
        stream = torch.cuda.Stream()
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            event.record()
        event.synchronize()
        assert isinstance(torch.cuda.default_stream(), torch.npu.Stream)
