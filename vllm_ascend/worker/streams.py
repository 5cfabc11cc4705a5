"""Map the CUDA stream and event types vLLM's runner creates to the device.

vLLM's GPU model runner builds ``torch.cuda.Stream``/``Event`` objects in its
constructor. On an NPU these are torch_npu's streams and events; on the CPU
reference device vLLM's own CPU placeholders (no-ops) stand in.
"""

import contextlib
from collections.abc import Iterator

import torch
from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper

from vllm_ascend import device


@contextlib.contextmanager
def _npu_streams() -> Iterator[None]:
    saved = torch.cuda.Event, torch.cuda.Stream
    try:
        torch.cuda.Event, torch.cuda.Stream = torch.npu.Event, torch.npu.Stream
        yield
    finally:
        torch.cuda.Event, torch.cuda.Stream = saved


def device_streams() -> contextlib.AbstractContextManager:
    return _npu_streams() if device.current().is_npu else _torch_cuda_wrapper()
