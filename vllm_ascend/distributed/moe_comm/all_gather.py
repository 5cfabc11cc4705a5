"""All-gather EP: every rank sees every DP rank's tokens, computes the
experts it holds, and the partial results are summed back per token.
Without data parallelism the tokens are already everywhere and only the
experts run.

The exchange uses only the collectives ACL graphs are shown to capture,
as vllm-ascend's all-gather method does (v0.11.0
``FusedMoEPrepareAndFinalizeWithAllGather``): each rank pads its rows to the
largest rank's count, one all-gather (into a tensor) per input, the padding
dropped; the results padded back and reduce-scattered, so that each rank
keeps the sum over ranks of its own rows. Not vLLM's naive multicast: it
broadcasts once per DP rank, and no proven ACL graph captures an HCCL
broadcast (vllm-ascend runs it only eagerly, for prefill).

Shapes come from the DP-synced counts of the forward context (host
values): in graph mode the DP ranks are padded to one count, so nothing is
padded or dropped and the shapes are those of the captured size.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from vllm.distributed import get_dp_group, get_ep_group, get_tp_group
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.forward_context import get_forward_context

from vllm_ascend.distributed.moe_comm.base import (ExpertsFn, GroupedMLP,
                                                   MoECommMethod)


def _layout(is_sequence_parallel: bool
            ) -> tuple[GroupCoordinator, list[int]]:
    """The group the tokens travel on and each of its ranks' rows. Without
    sequence parallelism the TP ranks of a DP rank hold the same tokens:
    the DP group exchanges them, and the TP all-reduce after the layer sums
    the TP ranks' partial results. A sequence-parallel layer's TP ranks each
    hold a chunk of their DP rank's tokens: the EP group (DP x TP)."""
    dp_metadata = get_forward_context().dp_metadata
    if is_sequence_parallel:
        group, sp_size = get_ep_group(), get_tp_group().world_size
    else:
        group, sp_size = get_dp_group(), 1
    ends = dp_metadata.cu_tokens_across_sp(sp_size).tolist()
    counts = [end - start for start, end in zip([0] + ends[:-1], ends)]
    return group, counts


def _gather(group: GroupCoordinator, x: torch.Tensor,
            counts: list[int]) -> torch.Tensor:
    """Every rank's rows, in rank order."""
    width = max(counts)
    if x.shape[0] < width:
        x = F.pad(x, (0, 0, 0, width - x.shape[0]))
    gathered = group.all_gather(x.contiguous(), 0)
    if all(count == width for count in counts):
        return gathered
    return torch.cat([
        gathered[rank * width:rank * width + count]
        for rank, count in enumerate(counts)
    ])


def _reduce_scatter(group: GroupCoordinator, y: torch.Tensor,
                    counts: list[int]) -> torch.Tensor:
    """This rank's rows, summed over the ranks."""
    width = max(counts)
    if any(count != width for count in counts):
        y = torch.cat([
            F.pad(rows, (0, 0, 0, width - count))
            for rows, count in zip(y.split(counts), counts)
        ])
    mine = counts[group.rank_in_group]
    return group.reduce_scatter(y.contiguous(), 0)[:mine]


class AllGatherMoEComm(MoECommMethod):
    name = "allgather"
    graph_safe = True

    def dispatch(self, communicator, hidden_states, router_logits,
                 is_sequence_parallel):
        group, counts = _layout(is_sequence_parallel)
        rank = group.rank_in_group
        if hidden_states.shape[0] != counts[rank]:
            raise RuntimeError(
                f"MoE dispatch on {group.unique_name} rank {rank}: "
                f"{hidden_states.shape[0]} token rows, but the forward "
                f"context gives this rank {counts[rank]} (all ranks: "
                f"{counts}).")
        return (_gather(group, hidden_states, counts),
                _gather(group, router_logits, counts))

    def combine(self, communicator, hidden_states, is_sequence_parallel):
        group, counts = _layout(is_sequence_parallel)
        return _reduce_scatter(group, hidden_states, counts)

    def experts(self, layer: torch.nn.Module, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor], compute: ExpertsFn,
                apply_router_weight_on_input: bool,
                grouped: Optional[GroupedMLP] = None) -> torch.Tensor:
        return compute(x, topk_weights, topk_ids, expert_map)
