"""vLLM's unquantized MoE method, routed and computed by our ops.

vLLM 0.11 binds ``UnquantizedFusedMoEMethod.forward_native`` to
``forward_cuda``, which needs triton's ``fused_experts``; off CUDA that is
None. This replacement routes with ``select_experts`` and runs
``moe_experts`` through the step's MoE communication method
(``distributed.moe_comm``); ``FusedMoE.forward_impl`` (shared experts, EP
dispatch/combine on the plugin's communicator, reductions) is vLLM's.
"""

from typing import Callable, Optional

import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.layer import (
    UnquantizedFusedMoEMethod)

from vllm_ascend.distributed import moe_comm
from vllm_ascend.distributed.moe_comm.base import GroupedMLP
from vllm_ascend.ops.moe.experts import (expert_weight_layout, grouped_mlp_npu,
                                         moe_experts)
from vllm_ascend.ops.moe.routing import select_experts


def set_expert_layout(layer: torch.nn.Module) -> None:
    """Give w13/w2 the layout this device's expert kernels read
    (``experts.expert_weight_layout``), once, after loading."""
    for name in ("w13_weight", "w2_weight"):
        weight = getattr(layer, name)
        laid_out = expert_weight_layout(weight.data)
        if laid_out is not weight.data:
            setattr(layer, name,
                    torch.nn.Parameter(laid_out, requires_grad=False))


def route(
    layer: torch.nn.Module,
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    use_grouped_topk: bool,
    topk_group: Optional[int],
    num_expert_group: Optional[int],
    global_num_experts: int,
    custom_routing_function: Optional[Callable],
    scoring_func: str,
    routed_scaling_factor: float,
    e_score_correction_bias: Optional[torch.Tensor],
    enable_eplb: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) [T, k] for every MoE method of the plugin."""
    if enable_eplb:
        raise NotImplementedError(
            "Expert load balancing (enable_eplb) is not supported by "
            "vllm_ascend yet; start vLLM without --enable-eplb.")
    if getattr(layer, "zero_expert_num", 0):
        raise NotImplementedError(
            "Zero experts are not supported by vllm_ascend.")
    if (global_num_experts > 0
            and router_logits.shape[-1] != global_num_experts):
        raise ValueError(
            f"router_logits have {router_logits.shape[-1]} experts but "
            f"the layer has global_num_experts={global_num_experts}.")
    if custom_routing_function is not None and not use_grouped_topk:
        return custom_routing_function(hidden_states=x,
                                       gating_output=router_logits,
                                       topk=top_k,
                                       renormalize=renormalize)
    return select_experts(router_logits,
                          top_k,
                          renormalize=renormalize,
                          use_grouped_topk=use_grouped_topk,
                          num_expert_group=num_expert_group,
                          topk_group=topk_group,
                          scoring_func=scoring_func,
                          routed_scaling_factor=routed_scaling_factor,
                          e_score_correction_bias=e_score_correction_bias)


@CustomOp.register_oot(name="UnquantizedFusedMoEMethod")
class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):

    def maybe_make_prepare_finalize(self) -> None:
        # No modular all2all kernels (pplx/DeepEP): FusedMoE.forward_impl
        # calls the communicator's dispatch/combine (moe_comm's methods).
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # w13/w2 take this device's layout (the NPU's [E, K, N], contiguous;
        # the reference's as loaded). vLLM's version imports the ROCm AITER
        # module and packs weights for its CPU kernels: neither applies.
        if self.moe.has_bias:
            raise NotImplementedError(
                f"{layer.__class__.__name__} has expert biases; vllm_ascend "
                "implements bias-free experts only (GLM-4.5 has none).")
        set_expert_layout(layer)

    def forward_oot(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        use_grouped_topk: bool,
        top_k: int,
        router_logits: torch.Tensor,
        renormalize: bool,
        topk_group: Optional[int] = None,
        num_expert_group: Optional[int] = None,
        global_num_experts: int = -1,
        expert_map: Optional[torch.Tensor] = None,
        custom_routing_function: Optional[Callable] = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: Optional[torch.Tensor] = None,
        apply_router_weight_on_input: bool = False,
        activation: str = "silu",
        enable_eplb: bool = False,
        expert_load_view: Optional[torch.Tensor] = None,
        logical_to_physical_map: Optional[torch.Tensor] = None,
        logical_replica_count: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        topk_weights, topk_ids = route(
            layer,
            x,
            router_logits,
            top_k,
            renormalize=renormalize,
            use_grouped_topk=use_grouped_topk,
            topk_group=topk_group,
            num_expert_group=num_expert_group,
            global_num_experts=global_num_experts,
            custom_routing_function=custom_routing_function,
            scoring_func=scoring_func,
            routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias,
            enable_eplb=enable_eplb)

        def compute(x, topk_weights, topk_ids, expert_map):
            return moe_experts(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights,
                topk_ids,
                expert_map=expert_map,
                apply_router_weight_on_input=apply_router_weight_on_input,
                activation=activation)

        def grouped(rows, group_ends, row_scales):
            return grouped_mlp_npu(rows, group_ends, layer.w13_weight,
                                   layer.w2_weight, row_scales)

        return moe_comm.current(x.shape[0]).experts(
            layer, x, topk_weights, topk_ids, expert_map, compute,
            apply_router_weight_on_input,
            grouped=GroupedMLP(grouped) if activation == "silu" else None)

    # With custom ops disabled (inductor), CustomOp dispatches to
    # forward_native, which vLLM bound to the triton path.
    forward_native = forward_oot
