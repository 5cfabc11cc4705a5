"""The plugin's static graph wrapper: vLLM's CUDAGraphWrapper on
``torch.npu.NPUGraph`` (the torch_npu double's graphs in CI).

vLLM dispatches (forward context: runtime mode and batch descriptor) and
this wrapper captures on the first call for a descriptor and replays after,
exactly as CUDAGraphWrapper does; only the graph API differs. It also counts
captures and replays per descriptor, for the logs and the tests.
"""

import contextlib
import dataclasses
import gc
from collections import Counter
from contextlib import ExitStack

import torch
from torch.utils._pytree import tree_map
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger

from vllm_ascend.attention import graph_tasks

logger = init_logger(__name__)


@dataclasses.dataclass
class GraphStats:
    """Captures and replays by (wrapper role, runtime mode, num_tokens)."""
    captured: Counter = dataclasses.field(default_factory=Counter)
    replayed: Counter = dataclasses.field(default_factory=Counter)
    pool_bytes: int = 0
    capture_seconds: float = 0.0

    def as_dict(self) -> dict:
        key = lambda k: f"{k[0]}:{k[1]}:{k[2]}"  # noqa: E731
        return {
            "captured": {key(k): v for k, v in self.captured.items()},
            "replayed": {key(k): v for k, v in self.replayed.items()},
            "pool_bytes": self.pool_bytes,
            "capture_seconds": self.capture_seconds,
        }


graph_stats = GraphStats()


@dataclasses.dataclass
class AscendGraphEntry(CUDAGraphEntry):
    """vLLM's entry of one captured graph, with the graph's attention
    launches, whose host arguments are updated before each replay."""
    attention_tasks: list[graph_tasks.AttentionTask] = dataclasses.field(
        default_factory=list)


@contextlib.contextmanager
def capturing_into(graph, pool, quiet: bool):
    """``torch.npu.graph(graph, pool=pool)`` on the current stream (vLLM's
    capture stream). ``quiet``: without the collection and cache emptying
    it starts with, for every piece of a forward after the first (vLLM's
    ``gc_disable``)."""
    if not quiet:
        torch.npu.synchronize()
        gc.collect()
        torch.npu.empty_cache()
    graph.capture_begin(pool=pool)
    try:
        yield
    finally:
        graph.capture_end()


def _graph_bytes(graph) -> int:
    return getattr(graph, "pool_bytes", 0)


def weak_output(graph, output):
    """The graph's output without keeping its pool memory allocated (vLLM's
    ``weak_ref_tensors``, which needs vLLM's compiled extension): later
    captures reuse the blocks, and every replay rewrites them. On an NPU a
    tensor on the same device memory that does not own it; the torch_npu
    double's graphs make their own."""
    weak = getattr(graph, "weak_output", None)
    if weak is not None:
        return weak(output)

    def unowned(t):
        if not isinstance(t, torch.Tensor):
            return t
        storage = torch._C._construct_storage_from_data_pointer(
            t.untyped_storage().data_ptr(), t.device,
            t.untyped_storage().nbytes())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, t.storage_offset(), t.size(), t.stride())

    return tree_map(unowned, output)


class AscendGraphWrapper(CUDAGraphWrapper):
    """Captures and replays ``runnable`` as one device graph per batch
    descriptor (a piecewise piece or the whole model)."""

    role = "target"

    def __call__(self, *args, **kwargs):
        forward_context = get_forward_context()
        mode = forward_context.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        return self.run(forward_context.batch_descriptor, args, kwargs)

    def run(self, descriptor, args, kwargs):
        """Capture the graph of ``descriptor`` on its first run, replay it
        after."""
        entry = self.concrete_cudagraph_entries.setdefault(
            descriptor, AscendGraphEntry(batch_descriptor=descriptor))
        key = (self.role, self.runtime_mode.name, descriptor.num_tokens)
        if entry.cudagraph is None:
            return self._capture(entry, key, args, kwargs)
        if self.is_debugging_mode:
            addresses = [x.data_ptr() for x in args
                         if isinstance(x, torch.Tensor)]
            assert addresses == entry.input_addresses, (
                f"graph inputs moved between capture and replay: expected "
                f"{entry.input_addresses}, got {addresses}")
        graph_stats.replayed[key] += 1
        if self.runtime_mode == CUDAGraphMode.FULL:
            graph_tasks.update_tasks(entry.attention_tasks,
                                     get_forward_context().attn_metadata)
        entry.cudagraph.replay()
        return entry.output

    def _capture(self, entry: AscendGraphEntry, key, args, kwargs):
        if self.cudagraph_options.debug_log_enable:
            logger.debug("Capturing a graph on (%s, %s)",
                         self.runtime_mode.name, entry.batch_descriptor)
        validate_cudagraph_capturing_enabled()
        entry.input_addresses = [
            x.data_ptr() for x in args if isinstance(x, torch.Tensor)
        ]
        graph = torch.npu.NPUGraph()
        tasks: list[graph_tasks.AttentionTask] = []
        with ExitStack() as stack:
            if self.runtime_mode == CUDAGraphMode.FULL:
                stack.enter_context(graph_tasks.collecting(tasks))
            # Many pieces per forward: collect and empty the cache once,
            # for the first.
            stack.enter_context(
                capturing_into(graph, self.graph_pool,
                               quiet=self.cudagraph_options.gc_disable))
            output = self.runnable(*args, **kwargs)
            if self.cudagraph_options.weak_ref_output:
                # The last piece: no later graph reads its output, so its
                # blocks go back to the pool now.
                output = weak_output(graph, output)
        # Held weakly, as vLLM does: a strong reference keeps every piece's
        # output of every size allocated in the shared pool.
        entry.output = weak_output(graph, output)
        entry.cudagraph = graph
        entry.attention_tasks = tasks
        compilation_counter.num_cudagraph_captured += 1
        graph_stats.captured[key] += 1
        graph_stats.pool_bytes += _graph_bytes(graph)
        return output
