"""The ``torch.npu`` namespace of the double: devices, streams, memory.

An emulated device: ``VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB`` of memory (2 by
default) per NPU, ``ASCEND_RT_VISIBLE_DEVICES`` (or
``VLLM_ASCEND_NPU_DOUBLE_DEVICES``, 8) NPUs. Memory that torch allocates is
the process's resident memory grown since ``set_device``. Memory outside
torch's allocator (the HCCL buffers and the ATB/aclnn workspace a real NPU
allocates on the first kernel launch) is emulated by
``VLLM_ASCEND_NPU_DOUBLE_WORKSPACE_MIB`` (64) charged at the first op call:
it shows in ``mem_get_info`` but not in ``max_memory_allocated``, as on an
NPU.

Streams and events are synchronous: every kernel has finished when its
call returns, so waiting is a no-op, but the API is checked as torch_npu
defines it (``torch_npu/npu/streams.py``, ``torch_npu/npu/utils.py``).
"""

import contextlib
import gc
import os
import threading
from collections import namedtuple
from typing import Any, Optional, Union

import psutil
import torch

from ._trace import record, traced

GiB = 1 << 30
MiB = 1 << 20

NPUDeviceProperties = namedtuple(
    "NPUDeviceProperties", "name total_memory multi_processor_count")


class _State:
    def __init__(self) -> None:
        # The device is a thread's context, as ACL's aclrtSetDevice: a
        # thread that never selected one runs on NPU 0.
        self._thread = threading.local()
        self.initialized = False
        self.baseline_rss = 0
        self.peak = 0
        self.workspace = 0  # non-torch bytes charged so far
        self.empty_cache_calls = 0

    @property
    def current_device(self) -> int:
        return getattr(self._thread, "device", 0)

    @current_device.setter
    def current_device(self, index: int) -> None:
        self._thread.device = index

    @property
    def total_memory(self) -> int:
        gib = float(os.environ.get("VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB", "2"))
        return int(gib * GiB)

    @property
    def workspace_bytes(self) -> int:
        mib = float(
            os.environ.get("VLLM_ASCEND_NPU_DOUBLE_WORKSPACE_MIB", "64"))
        return int(mib * MiB)

    def allocated(self) -> int:
        """Bytes torch's allocator holds (emulated: RSS growth)."""
        if not self.initialized:
            return 0
        now = max(0, psutil.Process().memory_info().rss - self.baseline_rss)
        self.peak = max(self.peak, now)
        return now

    def kernel_launched(self) -> None:
        """The first kernel allocates the runtime's workspace."""
        self.allocated()
        if self.initialized and not self.workspace:
            self.workspace = self.workspace_bytes


state = _State()


@traced("torch.npu.device_count")
def device_count() -> int:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(os.environ.get("VLLM_ASCEND_NPU_DOUBLE_DEVICES", "8"))


def is_available() -> bool:
    return device_count() > 0


def _index(device: Union[None, int, str, torch.device], api: str,
           tensor_device: bool = False) -> int:
    """torch_npu/npu/utils.py ``_get_device_index``: an int, "npu:N" or an
    npu torch.device; anything else is a ValueError. ``tensor_device``: an
    API vLLM hands the runner's device, which under the double is the CPU
    its tensors live on (npu:N on an NPU): that stands for the current
    NPU."""
    if device is None:
        return state.current_device
    if isinstance(device, str):  # "npu" or "npu:N"
        kind, _, number = device.partition(":")
        if kind != "npu" or (number and not number.isdigit()):
            raise ValueError(f"{api}: expected a npu device, but got: "
                             f"{device}")
        index = int(number) if number else state.current_device
    elif (tensor_device and isinstance(device, torch.device)
          and device.type == "cpu"):
        index = state.current_device
    elif isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"{api}: expected a npu device, but got: "
                             f"{device}")
        index = state.current_device if device.index is None else device.index
    elif isinstance(device, int):
        index = device
    else:
        raise ValueError(f"{api}: invalid device {device!r}")
    if not 0 <= index < device_count():
        raise RuntimeError(f"{api}: invalid device ordinal {index} "
                           f"(device count {device_count()})")
    return index


@traced("torch.npu.set_device")
def set_device(device: Union[int, str, torch.device]) -> None:
    state.current_device = _index(device, "set_device")
    if not state.initialized:
        state.initialized = True
        state.baseline_rss = psutil.Process().memory_info().rss


@traced("torch.npu.current_device")
def current_device() -> int:
    return state.current_device


def _check_context(api: str) -> None:
    if not state.initialized:
        raise RuntimeError(f"torch.npu.{api}: no NPU context: call "
                           "torch.npu.set_device first")


@traced("torch.npu.synchronize")
def synchronize(device=None) -> None:
    _index(device, "synchronize")


@traced("torch.npu.get_device_name")
def get_device_name(device=None) -> str:
    _index(device, "get_device_name")
    return "Ascend910B-double"


@traced("torch.npu.get_soc_version")
def get_soc_version() -> int:
    """torch_npu's SoC code: 220-225 Atlas A2 (Ascend910B), 250-255 Atlas
    A3 (Ascend910_93). ``VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION``, 220 (the
    Ascend910B the device name says) by default."""
    return soc_version()


def soc_version() -> int:
    """``get_soc_version`` for the double's own ops (not recorded)."""
    return int(os.environ.get("VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION", "220"))


@traced("torch.npu.get_device_properties")
def get_device_properties(device=None) -> NPUDeviceProperties:
    _index(device, "get_device_properties")
    return NPUDeviceProperties("Ascend910B-double", state.total_memory, 24)


@traced("torch.npu.mem_get_info")
def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) in bytes, torch_npu/npu/memory.py."""
    _index(device, "mem_get_info")
    _check_context("mem_get_info")
    used = state.allocated() + state.workspace + _graphs.pool_bytes()
    return state.total_memory - used, state.total_memory


@traced("torch.npu.empty_cache")
def empty_cache() -> None:
    """Counted: a capture that empties the cache for every piece shows."""
    state.empty_cache_calls += 1


@traced("torch.npu.reset_peak_memory_stats")
def reset_peak_memory_stats(device=None) -> None:
    _index(device, "reset_peak_memory_stats")
    state.peak = 0
    state.allocated()


@traced("torch.npu.max_memory_allocated")
def max_memory_allocated(device=None) -> int:
    _index(device, "max_memory_allocated")
    state.allocated()
    return state.peak


@traced("torch.npu.memory_reserved")
def memory_reserved(device=None) -> int:
    _index(device, "memory_reserved")
    return state.allocated() + _graphs.pool_bytes()


@traced("torch.npu.memory_allocated")
def memory_allocated(device=None) -> int:
    _index(device, "memory_allocated")
    return state.allocated()


class Stream:
    """torch_npu.npu.Stream(device=None, priority=0)."""

    def __init__(self, device=None, priority: int = 0, **kwargs: Any):
        record("torch.npu.Stream")
        if kwargs:
            raise TypeError(f"Stream() got unexpected arguments "
                            f"{sorted(kwargs)}")
        self.device_index = _index(device, "Stream", tensor_device=True)
        self.priority = priority
        self.waited_on: list[Stream] = []

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_event(self, event: "Event") -> None:
        if not isinstance(event, Event):
            raise TypeError("Stream.wait_event expects a torch.npu.Event")

    def wait_stream(self, stream: "Stream") -> None:
        if not isinstance(stream, Stream):
            raise TypeError("Stream.wait_stream expects a torch.npu.Stream")
        # Kernels are synchronous here; kept so tests can see the order
        # work on this stream was made to follow.
        self.waited_on.append(stream)

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event


class Event:
    """torch_npu.npu.Event(enable_timing=False, blocking=False,
    interprocess=False)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **kwargs: Any):
        record("torch.npu.Event")
        if kwargs:
            raise TypeError(f"Event() got unexpected arguments "
                            f"{sorted(kwargs)}")
        self.recorded = False

    def record(self, stream: Optional[Stream] = None) -> None:
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError("Event.record expects a torch.npu.Stream, got "
                            f"{type(stream).__name__}")
        self.recorded = True

    def wait(self, stream: Optional[Stream] = None) -> None:
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError("Event.wait expects a torch.npu.Stream")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_default_stream: Optional[Stream] = None
_current_stream: Optional[Stream] = None


@traced("torch.npu.default_stream")
def default_stream(device=None) -> Stream:
    global _default_stream
    if _default_stream is None:
        _default_stream = Stream(device)
    return _default_stream


@traced("torch.npu.current_stream")
def current_stream(device=None) -> Stream:
    return _current_stream or default_stream(device)


@contextlib.contextmanager
def _stream_context(stream: Optional[Stream]):
    global _current_stream
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError("torch.npu.stream expects a torch.npu.Stream, got "
                        f"{type(stream).__name__}")
    saved = _current_stream
    _current_stream = stream or saved
    try:
        yield
    finally:
        _current_stream = saved


@traced("torch.npu.stream")
def stream(stream: Optional[Stream]):
    return _stream_context(stream)


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    """Kernels of the double draw from the CPU generator."""


def manual_seed(seed: int) -> None:
    pass


# Device graphs: the graph emulator, which follows torch_npu's NPUGraph,
# graph, task-group/task-update and ExternalEvent contracts, with the
# device's streams and pool memory (``_graphs``); each call site recorded.
# isort: off
from . import _emulator  # noqa: E402
from . import _graphs  # noqa: E402
# torch.npu.config (allow_internal_format) with the formats it governs.
from ._formats import config  # noqa: E402,F401
# isort: on


def _recorded(name: str, fn):
    """``fn``, recording the plugin call site of each call as ``name``."""

    def call(*args, **kwargs):
        record(name)
        return fn(*args, **kwargs)

    return call


graph_pool_handle = _recorded("torch.npu.graph_pool_handle",
                              _emulator.graph_pool_handle)
graph_task_group_begin = _recorded("torch.npu.graph_task_group_begin",
                                   _emulator.graph_task_group_begin)
graph_task_group_end = _recorded("torch.npu.graph_task_group_end",
                                 _emulator.graph_task_group_end)
graph_task_update_begin = _recorded("torch.npu.graph_task_update_begin",
                                    _emulator.graph_task_update_begin)
graph_task_update_end = _recorded("torch.npu.graph_task_update_end",
                                  _emulator.graph_task_update_end)


class graph(_emulator.graph):
    """``torch.npu.graph(npu_graph, pool=None, stream=None)``, entered as
    torch_npu 2.8.0's ``torch_npu/npu/graphs.py`` (a copy of
    ``torch.cuda.graph``) enters it: synchronize, ``gc.collect()``,
    ``torch.npu.empty_cache()``, then capture on ``stream`` (by default one
    capture stream, created at the first capture and shared)."""

    default_capture_stream: Optional[Stream] = None

    def __init__(self, npu_graph, pool=None, stream=None,
                 capture_error_mode: str = "global") -> None:
        record("torch.npu.graph")
        super().__init__(npu_graph, pool, stream, capture_error_mode)
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self._stream = stream
        self._stream_ctx = None

    def __enter__(self) -> None:
        synchronize()
        gc.collect()
        empty_cache()
        self._stream_ctx = _stream_context(self._stream)
        self._stream_ctx.__enter__()
        super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._stream_ctx.__exit__(*exc)


class ExternalEvent(_emulator.ExternalEvent):

    def __init__(self) -> None:
        record("torch.npu.ExternalEvent")
        super().__init__()


class NPUGraph(_graphs.NPUGraph):

    def __init__(self) -> None:
        record("torch.npu.NPUGraph")
        super().__init__()
