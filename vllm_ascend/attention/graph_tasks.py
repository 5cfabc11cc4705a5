"""Attention inside full graphs: captured kernel launches whose host
arguments are updated before every replay.

The NPU fused attention takes the query and context lengths as host
arguments, so a captured launch keeps the lengths of the batch it was
captured with. During a full-graph capture each attention layer launches its
kernel inside a task group, after a wait on an external event (the
``AttentionTask``); before each replay, :func:`update_tasks` relaunches each
captured kernel inside a task update with the lengths of the batch about to
run, padded to the captured batch, and records the event. A replay that was
not updated fails at the wait instead of attending with stale lengths.

The tasks of a graph live with that graph (its wrapper's entry), so the
target's and the draft's graphs never share a parameter store. So does the
kernel's workspace: each graph (one captured size of one role, target or
draft) gets one from the first launch it captures, and that launch, the
graph's other launches of the same shapes and every task update pass it
(the pattern of torch_npu's task-update documentation and vllm-ascend):
a launch without one would get a workspace the allocator frees when the
launch returns, which the replayed task would still address.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm_ascend.attention.metadata import (AscendAttentionMetadata,
                                            host_arguments)

if TYPE_CHECKING:
    from vllm_ascend.attention.paged_attention import PagedAttentionOps


@dataclass
class AttentionTask:
    """One captured attention launch of one layer."""
    layer_name: str
    ops: "PagedAttentionOps"
    handle: Any
    event: Any
    # The captured launch's tensors: query, key_cache, value_cache,
    # block_table; an update must pass the same ones.
    tensors: tuple[torch.Tensor, ...]
    scale: float
    output: torch.Tensor
    num_reqs: int
    # The slots the graph's KV writes read (the builder's buffer).
    slot_mapping: torch.Tensor
    # The kernel's workspace, the one the capture passed (None for a
    # kernel that needs none).
    workspace: Optional[torch.Tensor] = None


_collecting: Optional[list[AttentionTask]] = None
# The workspaces of the graph being captured, by launch shapes.
_workspaces: dict[tuple, Optional[torch.Tensor]] = {}


@contextlib.contextmanager
def collecting(tasks: list[AttentionTask]) -> Iterator[None]:
    """Attention layers that run inside this block (a full-graph capture)
    launch as tasks and append them to ``tasks``."""
    global _collecting, _workspaces
    previous = _collecting, _workspaces
    _collecting, _workspaces = tasks, {}
    try:
        yield
    finally:
        _collecting, _workspaces = previous


def capturing_tasks() -> bool:
    return _collecting is not None


def launch_task(layer_name: str, ops: "PagedAttentionOps",
                query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor,
                metadata: AscendAttentionMetadata, scale: float,
                output: torch.Tensor) -> None:
    """Launch one layer's attention as an updatable task of the graph
    being captured."""
    assert _collecting is not None
    stream = torch.npu.current_stream()
    query_ends, seq_lens = host_arguments(metadata, metadata.num_reqs,
                                          query.shape[0])
    shapes = (type(ops), query.shape, query.dtype, key_cache.shape,
              metadata.block_tables.shape)
    if shapes not in _workspaces:
        _workspaces[shapes] = ops.max_workspace(query, key_cache,
                                                value_cache,
                                                metadata.block_tables,
                                                query_ends, seq_lens, scale)
    workspace = _workspaces[shapes]
    event = torch.npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    ops.launch(query, key_cache, value_cache, metadata.block_tables,
               query_ends, seq_lens, scale, output, workspace)
    handle = torch.npu.graph_task_group_end(stream)
    _collecting.append(
        AttentionTask(layer_name, ops, handle, event,
                      (query, key_cache, value_cache, metadata.block_tables),
                      scale, output, metadata.num_reqs,
                      metadata.slot_mapping, workspace))


def update_tasks(
        tasks: list[AttentionTask],
        attn_metadata: Optional[dict[str, AscendAttentionMetadata]]
) -> None:
    """Give every captured attention launch this batch's lengths.

    A dummy batch (an idle DP rank) has no metadata: the launches keep
    their last lengths, valid for the graph, and no KV is written (its
    slots are set to padding); the outputs are not read."""
    stream = torch.npu.current_stream()
    if not attn_metadata:
        for task in tasks:
            task.slot_mapping.fill_(-1)
            task.event.record(stream)
        return
    for task in tasks:
        query, key_cache, value_cache, block_table = task.tensors
        query_ends, seq_lens = host_arguments(attn_metadata[task.layer_name],
                                              task.num_reqs, query.shape[0])
        torch.npu.graph_task_update_begin(stream, task.handle)
        task.ops.launch(query, key_cache, value_cache, block_table,
                        query_ends, seq_lens, task.scale, task.output,
                        task.workspace)
        torch.npu.graph_task_update_end(stream)
        task.event.record(stream)
