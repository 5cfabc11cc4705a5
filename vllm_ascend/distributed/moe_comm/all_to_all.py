"""All-to-all EP: each (token, expert) pair goes only to the rank holding
the expert, with per-rank counts exchanged first. The counts are data
dependent (read on the host), so the method runs outside captured graphs."""

from typing import Optional

import torch
import torch.distributed as dist
from vllm.distributed import get_ep_group

from vllm_ascend.distributed.moe_comm.base import (ExpertsFn, GroupedMLP,
                                                   MoECommMethod)
from vllm_ascend.distributed.moe_comm.exchange import (owner_table, pair_rows,
                                                       tp_share, weighted_sum)


def _exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group) -> torch.Tensor:
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits,
                           group=group)
    return out


class AllToAllMoEComm(MoECommMethod):
    name = "alltoall"
    graph_safe = False

    def experts(self, layer: torch.nn.Module, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor], compute: ExpertsFn,
                apply_router_weight_on_input: bool,
                grouped: Optional[GroupedMLP] = None) -> torch.Tensor:
        ep = get_ep_group()
        group = ep.device_group
        share = tp_share(x.shape[0], layer)
        weights, ids = topk_weights[share], topk_ids[share]
        owner = owner_table(layer, expert_map)[ids.flatten().long()]
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=ep.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        rows = pair_rows(x[share], weights, apply_router_weight_on_input)
        recv_x = _exchange(rows[order], recv, send, group)
        recv_ids = _exchange(ids.flatten()[order], recv, send, group)
        ones = torch.ones((recv_x.shape[0], 1),
                          dtype=topk_weights.dtype,
                          device=x.device)
        # The NPU's expert kernels take no empty batch: a rank that receives
        # no pair has nothing to compute.
        results = (compute(recv_x, ones, recv_ids.unsqueeze(1), expert_map)
                   if recv_x.shape[0] else recv_x)
        back = _exchange(results, send, recv, group)
        pair_results = torch.empty_like(back)
        pair_results[order] = back
        return weighted_sum(x, share, pair_results, weights,
                            apply_router_weight_on_input)
