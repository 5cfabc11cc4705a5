"""Expert selection (the router) for GLM-4.5 and softmax MoE models.

Contract (vLLM 0.11 ``grouped_topk`` / ``fused_topk``):

1. scores = sigmoid(logits) or softmax(logits), in float32;
2. the experts are chosen on ``scores + e_score_correction_bias`` (the bias
   only chooses);
3. grouped top-k: experts form ``num_expert_group`` equal groups; a group
   scores the sum of its 2 best biased scores (its best score without a
   bias); only the ``topk_group`` best groups are eligible;
4. weights = the unbiased scores of the chosen experts, divided by their sum
   when ``renormalize``, then times ``routed_scaling_factor``.
"""

from typing import Optional

import torch

from vllm_ascend.device import npu_kernels

SCORING_FUNCS = ("sigmoid", "softmax")


def _scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return router_logits.float().sigmoid()
    if scoring_func == "softmax":
        return router_logits.float().softmax(dim=-1)
    raise ValueError(f"MoE scoring_func {scoring_func!r} is not supported; "
                     f"use one of {', '.join(SCORING_FUNCS)}.")


def _check_groups(num_experts: int, top_k: int, num_expert_group: int,
                  topk_group: int) -> None:
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"{num_experts} experts cannot form {num_expert_group} equal "
            "groups: check n_group in the model config.")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, "
                         f"n_group={num_expert_group}].")
    eligible = topk_group * (num_experts // num_expert_group)
    if top_k > eligible:
        raise ValueError(
            f"top_k={top_k} experts cannot be chosen from the {eligible} "
            f"experts of {topk_group} group(s).")


def _mask_ineligible_groups(choice: torch.Tensor, num_expert_group: int,
                            topk_group: int, biased: bool) -> torch.Tensor:
    """``choice`` with the experts outside the ``topk_group`` best groups
    at -inf."""
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, num_expert_group, -1)
    if biased:
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
    return choice.masked_fill(~keep, float("-inf"))


def select_experts_ref(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    use_grouped_topk: bool = False,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights float32 [T, top_k], global expert ids int32)."""
    num_tokens, num_experts = router_logits.shape
    scores = _scores(router_logits, scoring_func)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    if use_grouped_topk:
        if num_expert_group is None or topk_group is None:
            raise ValueError("grouped top-k needs num_expert_group and "
                             "topk_group.")
        _check_groups(num_experts, top_k, num_expert_group, topk_group)
        if topk_group < num_expert_group:
            # With every group eligible (GLM-4.5: one group) the mask
            # keeps all experts: seven kernels per layer for nothing.
            choice = _mask_ineligible_groups(choice, num_expert_group,
                                             topk_group,
                                             e_score_correction_bias
                                             is not None)
    elif top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} is larger than the {num_experts} experts.")
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


# The expert count ``npu_moe_gating_top_k`` runs with on CANN 8.3 (torch-npu
# 2.8.0): its documentation allows up to 2048, but vllm-ascend v0.11.0, the
# release proven on that CANN, calls it only for 256 experts (DeepSeek-V3's
# pattern: "now npu_moe_gating_top_k can only support 'group_count=256'
# pattern", ops/moe/experts_selector.py) and routes every other model,
# GLM-4.5's 160 experts among them, through torch.
NPU_GATING_NUM_EXPERTS = 256


def _npu_gating_applies(num_experts: int, renormalize: bool,
                        use_grouped_topk: bool, num_expert_group: Optional[int],
                        scoring_func: str) -> bool:
    """Where ``npu_moe_gating_top_k`` computes exactly the contract above
    and the pinned CANN runs it.

    The kernel always normalizes the chosen weights and needs more than 2
    experts per group and at most 2048 once each group's count is rounded
    up to a multiple of 32; on CANN 8.3 it takes 256 experts only.
    """
    groups = num_expert_group if use_grouped_topk else 1
    if groups is None or groups < 1 or num_experts % groups:
        return False
    per_group = num_experts // groups
    return (scoring_func == "sigmoid" and renormalize
            and num_experts == NPU_GATING_NUM_EXPERTS and per_group > 2
            and -(-per_group // 32) * 32 * groups <= 2048)


def _select_experts_npu(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    use_grouped_topk: bool = False,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = router_logits.shape[-1]
    if not _npu_gating_applies(num_experts, renormalize, use_grouped_topk,
                               num_expert_group, scoring_func):
        return select_experts_ref(
            router_logits, top_k, renormalize=renormalize,
            use_grouped_topk=use_grouped_topk,
            num_expert_group=num_expert_group, topk_group=topk_group,
            scoring_func=scoring_func,
            routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias)
    import torch_npu
    groups = num_expert_group if use_grouped_topk else 1
    k_group = topk_group if use_grouped_topk else 1
    assert groups is not None and k_group is not None
    _check_groups(num_experts, top_k, groups, k_group)
    bias = (None if e_score_correction_bias is None else
            e_score_correction_bias.to(router_logits.dtype))
    topk_weights, topk_ids, _ = torch_npu.npu_moe_gating_top_k(
        router_logits,
        k=top_k,
        bias=bias,
        k_group=k_group,
        group_count=groups,
        group_select_mode=1 if bias is not None else 0,
        renorm=0,
        norm_type=1,
        out_flag=False,
        routed_scaling_factor=routed_scaling_factor,
        eps=1e-20)
    return topk_weights.float(), topk_ids.to(torch.int32)


select_experts = _select_experts_npu if npu_kernels() else select_experts_ref
