"""All-gather EP: every rank sees every DP rank's tokens, computes the
experts it holds, and the partial results are summed back per token
(vLLM's naive all2all manager on the plugin's communicator). Without data
parallelism the tokens are already everywhere and only the experts run."""

from typing import Optional

import torch

from vllm_ascend.distributed.moe_comm.base import (ExpertsFn, GroupedFn,
                                                   MoECommMethod)


class AllGatherMoEComm(MoECommMethod):
    name = "allgather"
    graph_safe = True

    def dispatch(self, communicator, hidden_states, router_logits,
                 is_sequence_parallel):
        return communicator.all2all_manager.dispatch(hidden_states,
                                                     router_logits,
                                                     is_sequence_parallel)

    def combine(self, communicator, hidden_states, is_sequence_parallel):
        return communicator.all2all_manager.combine(hidden_states,
                                                    is_sequence_parallel)

    def experts(self, layer: torch.nn.Module, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor], compute: ExpertsFn,
                apply_router_weight_on_input: bool,
                grouped: Optional[GroupedFn] = None) -> torch.Tensor:
        return compute(x, topk_weights, topk_ids, expert_map)
