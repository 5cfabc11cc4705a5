"""What the exchanging methods (all-to-all, MC2) share: which tokens this
rank sends, which rank holds each expert, and the weighted sum of the
results that come back."""

from typing import Optional

import torch
from vllm.distributed import get_ep_group, get_tp_group
from vllm.model_executor.layers.fused_moe.layer import determine_expert_map


def tp_share(num_tokens: int, layer: torch.nn.Module) -> slice:
    """The tokens this TP rank sends. TP ranks of one DP rank hold the same
    tokens; each sends its share once, returns zeros for the others, and
    the TP all-reduce after the MoE layer (the model's, or FusedMoE's
    reduce_results) puts the shares together. A sequence-parallel layer's
    TP ranks hold different tokens already: each sends all of its own."""
    if getattr(layer, "is_sequence_parallel", False):
        return slice(0, num_tokens)
    tp = get_tp_group()
    per_rank = -(-num_tokens // tp.world_size)
    start = min(tp.rank_in_group * per_rank, num_tokens)
    return slice(start, min(start + per_rank, num_tokens))


def owner_table(layer: torch.nn.Module,
                expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """EP rank that holds each global expert, cached on the layer. vLLM
    places experts by a deterministic rule (linear or round-robin); the
    rule that reproduces this rank's own expert_map is the one in use. No
    collective, so that a first call inside a graph capture is harmless."""
    owner = getattr(layer, "_moe_comm_owner", None)
    if owner is not None:
        return owner
    ep = get_ep_group()
    if expert_map is None:
        raise ValueError("the all-to-all and MC2 MoE methods need expert "
                         "parallelism (--enable-expert-parallel)")
    num_experts = expert_map.shape[0]
    for strategy in ("linear", "round_robin"):
        maps = [
            determine_expert_map(ep.world_size, rank, num_experts,
                                 strategy)[1]
            for rank in range(ep.world_size)
        ]
        if torch.equal(maps[ep.rank_in_group].to(expert_map.device),
                       expert_map):
            break
    else:
        raise RuntimeError(
            f"{getattr(layer, 'layer_name', 'MoE layer')}: its expert map "
            "matches neither linear nor round-robin placement; the "
            "all-to-all and MC2 MoE methods cannot find expert owners. Use "
            "VLLM_ASCEND_MOE_COMM=allgather.")
    owner = torch.full((num_experts, ), -1, dtype=torch.long)
    for rank, m in enumerate(maps):
        owner[m >= 0] = rank
    owner = owner.to(expert_map.device)
    layer._moe_comm_owner = owner
    return owner


def weighted_sum(x: torch.Tensor, share: slice, pair_results: torch.Tensor,
                 topk_weights: torch.Tensor,
                 apply_router_weight_on_input: bool) -> torch.Tensor:
    """[T, H]: for this rank's share, sum_k w[t, k] * result[t, k] in
    float32 (the weights were applied before sending with
    apply_router_weight_on_input); zeros elsewhere."""
    top_k = topk_weights.shape[1]
    y = pair_results.float().view(-1, top_k, x.shape[1])
    if not apply_router_weight_on_input:
        y = y * topk_weights.float().unsqueeze(-1)
    out = torch.zeros_like(x)
    out[share] = y.sum(dim=1).to(x.dtype)
    return out


def pair_rows(x: torch.Tensor, topk_weights: torch.Tensor,
              apply_router_weight_on_input: bool) -> torch.Tensor:
    """One row per (token, slot), token-major: what is sent."""
    top_k = topk_weights.shape[1]
    rows = x.repeat_interleave(top_k, dim=0)
    if apply_router_weight_on_input:
        rows = (rows.float() *
                topk_weights.flatten().float().unsqueeze(1)).to(x.dtype)
    return rows
