"""Map the CUDA stream and event API vLLM's runner uses to the device.

vLLM's GPU model runner builds ``torch.cuda.Stream``/``Event`` objects in its
constructor, captures graphs on a ``torch.cuda.Stream`` and, with async
scheduling, calls ``torch.cuda.Event``, ``current_stream`` and ``stream`` at
every step. On an NPU these are torch_npu's for the life of the worker
process (it runs nothing on CUDA); on the CPU reference device vLLM's CPU
placeholders stand in while the runner is built (async scheduling is off
there).
"""

import contextlib

import torch
from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper

CUDA_STREAM_API = ("Event", "Stream", "current_stream", "default_stream",
                   "stream")


def use_npu_streams() -> None:
    """Point ``torch.cuda``'s stream and event API at ``torch.npu``."""
    for name in CUDA_STREAM_API:
        setattr(torch.cuda, name, getattr(torch.npu, name))


def cpu_streams() -> contextlib.AbstractContextManager:
    """vLLM's CPU placeholders for the stream and event API, while vLLM's
    runner is built."""
    return _torch_cuda_wrapper()
