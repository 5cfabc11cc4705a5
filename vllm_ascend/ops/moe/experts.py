"""The routed experts: y[t] = sum_k w[t,k] * W2_e (silu(G_e x) * U_e x).

``w13`` is [E_local, 2I, H] (gate rows, then up rows), ``w2`` is
[E_local, H, I], as loaded; on the NPU both are transposed once, after
loading, to the [E, K, N] the grouped matmul reads (``expert_weight_layout``).
``topk_ids`` are global expert ids; with expert parallelism ``expert_map``
maps a global id to a local one, -1 when another rank holds the expert, and
this rank adds nothing for it.
"""

from dataclasses import dataclass
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


def expert_weight_layout_ref(w: torch.Tensor) -> torch.Tensor:
    """The reference keeps the loaded [E, N, K] layout."""
    return w


def _expert_weight_layout_npu(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] as loaded -> [E, K, N], contiguous: npu_grouped_matmul
    computes x @ weight[e], and a transposed view makes every call read a
    strided weight. Done once at load, as vllm-ascend does (v0.11.0
    ``common_fused_moe.py`` and ``w8a8_dynamic.py``)."""
    return w.transpose(1, 2).contiguous()


expert_weight_layout = (_expert_weight_layout_npu
                        if npu_kernels() else expert_weight_layout_ref)
"""The layout ``process_weights_after_loading`` gives w13 and w2 on this
device: what ``moe_experts`` and ``grouped_mlp_npu`` take."""


def loaded_layout(w: torch.Tensor) -> torch.Tensor:
    """An NPU-layout [E, K, N] weight viewed as loaded [E, N, K] (for the
    shape checks and the reference fallback; no copy)."""
    return w.transpose(1, 2)


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
    """Permute by expert, two grouped matmuls with SwiGLU, fused
    un-permute. ``w13`` [E, H, 2I] and ``w2`` [E, I, H]: the NPU layout
    (``expert_weight_layout``).

    Non-local experts (expert_map -1) go to a sink id ``E_local`` that lies
    outside ``active_expert_range``, so the kernels skip them.
    """
    _check(x, loaded_layout(w13), loaded_layout(w2), topk_weights, topk_ids,
           activation)
    if apply_router_weight_on_input:
        return moe_experts_ref(x, loaded_layout(w13), loaded_layout(w2),
                               topk_weights, topk_ids,
                               expert_map=expert_map,
                               apply_router_weight_on_input=True,
                               activation=activation)
    routed = npu_permute(x, topk_ids, expert_map, w13.shape[0])
    y = grouped_mlp_npu(routed.rows, routed.group_ends, w13, w2)
    return npu_unpermute(y, routed, topk_weights)


def grouped_mlp_npu(rows: torch.Tensor, group_ends: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor,
                    row_scales: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """Rows grouped by local expert (``group_ends``: cumulative counts)
    through their experts' SwiGLU MLP; rows past the last group are left
    undefined, as npu_grouped_matmul leaves them. Float rows only
    (``row_scales`` is for the int8 experts' interface)."""
    import torch_npu
    assert row_scales is None, "float experts take float rows"
    gate_up = grouped_matmul_npu(rows, w13, group_ends)
    h = torch_npu.npu_swiglu(gate_up, dim=-1)
    return grouped_matmul_npu(h, w2, group_ends)


def grouped_matmul_npu(rows: torch.Tensor, w: torch.Tensor,
                       group_ends: torch.Tensor, **quant) -> torch.Tensor:
    """One npu_grouped_matmul of grouped rows with per-expert weights
    ``w`` [E, K, N] (contiguous); ``quant``: its scale arguments for int8
    rows."""
    import torch_npu
    return torch_npu.npu_grouped_matmul([rows], [w],
                                        group_list=group_ends,
                                        split_item=2,
                                        group_type=0,
                                        group_list_type=0,
                                        **quant)[0]


@dataclass
class Routed:
    """What ``npu_permute`` hands the grouped MLP and ``npu_unpermute``."""
    rows: torch.Tensor  # [T * k, H], grouped by local expert
    # Per flat slot t * k + j: the row holding it; -1 for another rank's
    # expert (init_routing_v2's gather index, row_idx_type=0).
    slot_rows: torch.Tensor
    group_ends: torch.Tensor  # int64 cumulative rows per local expert
    # bool [T, k]: the expert is on this rank; None without an expert map
    # (every expert is).
    local_slots: Optional[torch.Tensor]
    row_scales: Optional[torch.Tensor] = None  # float32 [T * k], int8 rows


def npu_permute(x: torch.Tensor,
                topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor],
                num_local: int,
                quantize: bool = False) -> Routed:
    """Tokens sorted by local expert; with ``quantize``, int8 rows and
    their per-row scales from the same kernel (quant_mode=1: dynamic
    quantization fused into the routing, as vllm-ascend v0.11.0's W8A8
    path does)."""
    import torch_npu
    num_tokens, top_k = topk_ids.shape
    if expert_map is None:
        local, local_slots = topk_ids.to(torch.int32), None
    else:
        local = _local_ids(topk_ids, expert_map)
        local_slots = local >= 0
        local = torch.where(local_slots, local,
                            torch.full_like(local, num_local)).to(torch.int32)
    rows, slot_rows, counts, scales = torch_npu.npu_moe_init_routing_v2(
        x,
        local,
        active_num=num_tokens * top_k,
        expert_capacity=-1,
        expert_num=num_local + 1,
        drop_pad_mode=0,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        quant_mode=1 if quantize else -1,
        active_expert_range=[0, num_local],
        row_idx_type=0)
    # Cumulative group ends (group_list_type=0): a count list may not have
    # length 1, which a rank holding one expert would pass.
    return Routed(rows, slot_rows, counts.cumsum(0), local_slots,
                  scales if quantize else None)


def npu_unpermute(y: torch.Tensor, routed: Routed,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[row of slot (t, j)] in one fused kernel
    (npu_moe_token_unpermute, as vllm-ascend v0.11.0's combine).

    With expert parallelism a slot of another rank's expert has no row: it
    reads row 0 with weight 0. Row 0 holds this rank's first result, unless
    the rank has none, when npu_grouped_matmul leaves it undefined (maybe
    Inf or NaN, which a zero weight does not cancel): then it is zeroed
    first. Without, every slot has its row and the kernel takes them as
    they are.
    """
    import torch_npu
    if routed.local_slots is None:
        return torch_npu.npu_moe_token_unpermute(
            y, routed.slot_rows, probs=topk_weights.to(y.dtype))
    probs = torch.where(routed.local_slots, topk_weights,
                        0.0).to(y.dtype)
    y[:1].masked_fill_(routed.group_ends[-1:] == 0, 0.0)
    return torch_npu.npu_moe_token_unpermute(y,
                                             routed.slot_rows.clamp(min=0),
                                             probs=probs)


moe_experts = _moe_experts_npu if npu_kernels() else moe_experts_ref
