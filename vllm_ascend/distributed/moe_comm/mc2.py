"""MC2-style EP: the all-to-all exchange with fixed-size buffers, so that
every shape is static and nothing is read on the host (graph capture).

Each rank sends every other rank a buffer of ``capacity * top_k`` rows
(the most pairs it can route to one rank when it holds at most
``capacity`` tokens), empty rows marked by the expert id E (no rank's);
the receiver computes its experts on all rows and sends them back in
place. This is the contract of the NPU's fused MC2 kernels
(npu_moe_distribute_dispatch_v2 / combine_v2), which run instead on an
NPU whose kernels take the configuration (``mc2_kernels``); elsewhere it is
torch.distributed's all_to_all_single.

Graphs: the fused kernels are captured in vllm-ascend's ACL graphs (its
MC2 decode path), HCCL's all-to-all never is (v0.11.0 runs ALLTOALL only
above the MC2 capacity, the largest capture size: eagerly). So on an NPU
without the kernels the method is not graph-safe and graph mode uses
all-gather instead (``moe_comm``). The CPU reference device runs eager.
"""

from typing import Optional

import torch
import torch.distributed as dist
from vllm.distributed import get_ep_group

from vllm_ascend.distributed.moe_comm.base import (ExpertsFn, GroupedMLP,
                                                   MoECommMethod)
from vllm_ascend.distributed.moe_comm.exchange import (owner_table, pair_rows,
                                                       tp_share, weighted_sum)
from vllm_ascend.distributed.moe_comm.mc2_kernels import FusedMC2Kernels


class MC2MoEComm(MoECommMethod):
    name = "mc2"
    # Static shapes either way; whether a device graph captures it depends
    # on the exchange (an instance's graph_safe).
    graph_safe = True

    def __init__(self, capacity: int,
                 kernels: Optional[FusedMC2Kernels] = None):
        self.capacity = capacity
        self.kernels = kernels
        # The torch exchange (HCCL all_to_all_single) stays out of graphs.
        self.graph_safe = kernels is not None

    def experts(self, layer: torch.nn.Module, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor], compute: ExpertsFn,
                apply_router_weight_on_input: bool,
                grouped: Optional[GroupedMLP] = None) -> torch.Tensor:
        if x.shape[0] > self.capacity:
            raise RuntimeError(
                f"MC2 MoE method: {x.shape[0]} tokens on this rank exceed "
                f"its capacity {self.capacity}; raise "
                "VLLM_ASCEND_MC2_CAPACITY or use VLLM_ASCEND_MOE_COMM="
                "allgather.")
        share = tp_share(x.shape[0], layer)
        if (self.kernels is not None and grouped is not None
                and not apply_router_weight_on_input):
            return self.kernels.experts(x, share, topk_weights, topk_ids,
                                        expert_map.shape[0], grouped)
        ep = get_ep_group()
        group = ep.device_group
        ranks = ep.world_size
        weights, ids = topk_weights[share], topk_ids[share]
        top_k = ids.shape[1]
        per_rank = self.capacity * top_k
        owner = owner_table(layer, expert_map)[ids.flatten().long()]
        # Slot of each pair in its owner's buffer: how many pairs before it
        # go to the same owner.
        hit = owner.unsqueeze(1) == torch.arange(ranks, device=x.device)
        slot = (hit.long().cumsum(0) - 1).gather(1, owner.unsqueeze(1))
        dest = owner * per_rank + slot.squeeze(1)

        rows = pair_rows(x[share], weights, apply_router_weight_on_input)
        send_x = x.new_zeros((ranks * per_rank, x.shape[1]))
        send_x[dest] = rows
        send_ids = torch.full((ranks * per_rank, ),
                              expert_map.shape[0],
                              dtype=ids.dtype,
                              device=x.device)
        send_ids[dest] = ids.flatten()
        recv_x = torch.empty_like(send_x)
        recv_ids = torch.empty_like(send_ids)
        dist.all_to_all_single(recv_x, send_x, group=group)
        dist.all_to_all_single(recv_ids, send_ids, group=group)

        # Empty rows carry id E, which maps to no local expert.
        padded_map = torch.cat([expert_map, expert_map.new_full((1, ), -1)])
        ones = torch.ones((recv_x.shape[0], 1),
                          dtype=topk_weights.dtype,
                          device=x.device)
        results = compute(recv_x, ones, recv_ids.unsqueeze(1), padded_map)
        back = torch.empty_like(results)
        dist.all_to_all_single(back, results, group=group)
        return weighted_sum(x, share, back[dest], weights,
                            apply_router_weight_on_input)
