"""The routed experts: y[t] = sum_k w[t,k] * W2_e (silu(G_e x) * U_e x).

``w13`` is [E_local, 2I, H] (gate rows, then up rows), ``w2`` is
[E_local, H, I]. ``topk_ids`` are global expert ids; with expert
parallelism ``expert_map`` maps a global id to a local one, -1 when another
rank holds the expert, and this rank adds nothing for it.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from vllm_ascend.device import npu_kernels


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           topk_weights: torch.Tensor, topk_ids: torch.Tensor,
           activation: str) -> None:
    if activation != "silu":
        raise NotImplementedError(
            f"MoE activation {activation!r} is not implemented by "
            "vllm_ascend; only 'silu' (SwiGLU experts) is.")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("moe_experts expects x [T, H], w13 [E, 2I, H] and "
                         f"w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}.")
    num_experts, two_i, hidden = w13.shape
    if (hidden != x.shape[1] or w2.shape != (num_experts, hidden, two_i // 2)
            or two_i % 2):
        raise ValueError(
            f"inconsistent MoE shapes: x {tuple(x.shape)}, w13 "
            f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}; expected w13 "
            "[E, 2I, H] and w2 [E, H, I].")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k].")


def _local_ids(topk_ids: torch.Tensor,
               expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    ids = topk_ids.long()
    return ids if expert_map is None else expert_map[ids].long()


def moe_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """One matmul pair per expert that has tokens, accumulated in float32."""
    _check(x, w13, w2, topk_weights, topk_ids, activation)
    local = _local_ids(topk_ids, expert_map)
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local[local >= 0].unique().tolist():
        tokens, slots = (local == e).nonzero(as_tuple=True)
        weight = topk_weights[tokens, slots].float().unsqueeze(1)
        xe = x[tokens].float()
        if apply_router_weight_on_input:
            xe = xe * weight
        gate_up = xe @ w13[e].float().t()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        ye = h @ w2[e].float().t()
        if not apply_router_weight_on_input:
            ye = ye * weight
        out.index_add_(0, tokens, ye)
    return out.to(x.dtype)


def _moe_experts_npu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """Permute by expert, two grouped matmuls with SwiGLU, un-permute.

    Non-local experts (expert_map -1) go to a sink id ``E_local`` that lies
    outside ``active_expert_range``, so the kernels skip them. The
    un-permute is a torch ``index_add_`` over the scatter index of
    ``npu_moe_init_routing_v2`` (row_idx_type=1: row i of the permuted
    tokens came from flat slot ``t * k + j``).
    """
    _check(x, w13, w2, topk_weights, topk_ids, activation)
    if apply_router_weight_on_input:
        return moe_experts_ref(x, w13, w2, topk_weights, topk_ids,
                               expert_map=expert_map,
                               apply_router_weight_on_input=True,
                               activation=activation)
    permuted, src_slot, group_ends = _npu_permute(x, topk_ids, expert_map,
                                                  w13.shape[0])
    y = grouped_mlp_npu(permuted, group_ends, w13, w2)
    return _npu_unpermute(y, src_slot, group_ends, topk_weights, x)


def grouped_mlp_npu(rows: torch.Tensor, group_ends: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Rows grouped by local expert (``group_ends``: cumulative counts)
    through their experts' SwiGLU MLP; rows past the last group are left
    undefined, as npu_grouped_matmul leaves them."""
    import torch_npu
    gate_up = grouped_matmul_npu(rows, w13, group_ends)
    h = torch_npu.npu_swiglu(gate_up, dim=-1)
    return grouped_matmul_npu(h, w2, group_ends)


def grouped_matmul_npu(rows: torch.Tensor, w: torch.Tensor,
                       group_ends: torch.Tensor, **quant) -> torch.Tensor:
    """One npu_grouped_matmul of grouped rows with per-expert weights
    ``w`` [E, N, K]; ``quant``: its scale arguments for int8 rows."""
    import torch_npu
    return torch_npu.npu_grouped_matmul([rows], [w.transpose(1, 2)],
                                        group_list=group_ends,
                                        split_item=2,
                                        group_type=0,
                                        group_list_type=0,
                                        **quant)[0]


def _npu_permute(
    x: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor], num_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens sorted by local expert: (permuted rows, the flat slot each row
    came from, cumulative group ends)."""
    import torch_npu
    num_tokens, top_k = topk_ids.shape
    local = _local_ids(topk_ids, expert_map)
    local = torch.where(local >= 0, local,
                        torch.full_like(local, num_local)).to(torch.int32)
    permuted, src_slot, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        local,
        active_num=num_tokens * top_k,
        expert_capacity=-1,
        expert_num=num_local + 1,
        drop_pad_mode=0,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[0, num_local],
        row_idx_type=1)
    # Cumulative group ends (group_list_type=0): a count list may not have
    # length 1, which a rank holding one expert would pass.
    return permuted, src_slot, counts.cumsum(0)


def _npu_unpermute(y: torch.Tensor, src_slot: torch.Tensor,
                   group_ends: torch.Tensor, topk_weights: torch.Tensor,
                   x: torch.Tensor) -> torch.Tensor:
    # Rows past sum(group_list) (the tokens of other ranks' experts) are
    # left undefined by npu_grouped_matmul: they may hold Inf or NaN, which
    # a zero weight does not cancel. Select them away before the sum.
    top_k = topk_weights.shape[1]
    rows = torch.arange(y.shape[0], device=y.device)
    valid = rows < group_ends[-1]
    slot = torch.where(valid, src_slot.long(), torch.zeros_like(rows))
    weight = topk_weights.flatten().float()[slot]
    contrib = torch.where(valid.unsqueeze(1), y.float() * weight.unsqueeze(1),
                          0.0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, slot // top_k, contrib)
    return out.to(x.dtype)


moe_experts = _moe_experts_npu if npu_kernels() else moe_experts_ref
