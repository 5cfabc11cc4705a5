"""W8A8_DYNAMIC MoE experts: int8 w13/w2 with per-channel scales.

The checkpoint stores, per expert, ``gate_proj``/``up_proj``/``down_proj``
``.weight`` (int8), ``.weight_scale`` and ``.weight_offset`` ([out, 1]);
vLLM's expert mapping loads them into ``w13_*`` / ``w2_*``, the scales per
channel (``quant_method="channel"``). Routing and the MoE communication
method are those of the float experts.
"""

from typing import Callable, Optional

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                         FusedMoEQuantConfig)
from vllm.model_executor.layers.fused_moe.layer import (
    FusedMoEMethodBase, FusedMoeWeightScaleSupported)
from vllm.model_executor.utils import set_weight_attrs

from vllm_ascend.distributed import moe_comm
from vllm_ascend.distributed.moe_comm.base import GroupedMLP
from vllm_ascend.ops import weight_format
from vllm_ascend.ops.moe.fused_moe import route, set_expert_layout
from vllm_ascend.ops.moe.quant_experts import (expert_scale_dtype,
                                               grouped_mlp_w8a8_npu,
                                               moe_experts_w8a8)


class AscendW8A8DynamicFusedMoEMethod(FusedMoEMethodBase):

    def __init__(self, moe: FusedMoEConfig, prefix: str):
        super().__init__(moe)
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, num_experts: int,
                       hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if self.moe.has_bias:
            raise NotImplementedError(
                f"{self.prefix} has expert biases; vllm_ascend implements "
                "bias-free experts only (GLM-4.5 has none).")
        inter = intermediate_size_per_partition
        shapes = {
            "w13": (num_experts, 2 * inter, hidden_size),
            "w2": (num_experts, hidden_size, inter),
        }
        for name, shape in shapes.items():
            weight = Parameter(torch.empty(shape, dtype=torch.int8),
                               requires_grad=False)
            layer.register_parameter(f"{name}_weight", weight)
            set_weight_attrs(weight, extra_weight_attrs)
            for suffix in ("weight_scale", "weight_offset"):
                param = Parameter(torch.empty(*shape[:2],
                                              1,
                                              dtype=torch.float32),
                                  requires_grad=False)
                layer.register_parameter(f"{name}_{suffix}", param)
                set_weight_attrs(param, extra_weight_attrs)
                set_weight_attrs(param, {
                    "quant_method":
                    FusedMoeWeightScaleSupported.CHANNEL.value
                })

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("w13", "w2"):
            if torch.count_nonzero(getattr(layer, f"{name}_weight_offset")):
                raise ValueError(
                    f"{self.prefix}: the experts' {name} weight_offset is "
                    "not zero: vllm_ascend runs symmetric int8 weights only; "
                    "re-export the checkpoint with symmetric per-channel "
                    "weights (msModelSlim w_sym=True).")
            delattr(layer, f"{name}_weight_offset")
            scale = getattr(layer, f"{name}_weight_scale").data
            setattr(layer, f"{name}_weight_scale",
                    Parameter(scale.squeeze(-1).to(
                        expert_scale_dtype(layer.moe_config.in_dtype)).
                              contiguous(),
                              requires_grad=False))
        set_expert_layout(layer)
        # Last: the weights in their final layout, read fastest in the
        # NPU's NZ format.
        layer.w13_weight.data = weight_format.to_nz(layer.w13_weight.data)
        layer.w2_weight.data = weight_format.to_nz(layer.w2_weight.data)

    def get_fused_moe_quant_config(
            self, layer: torch.nn.Module) -> Optional[FusedMoEQuantConfig]:
        # Used by vLLM's modular (triton) kernels only; ours take the
        # scales from the layer.
        return None

    def maybe_make_prepare_finalize(self) -> None:
        # FusedMoE.forward_impl calls the communicator's dispatch/combine.
        return None

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        use_grouped_topk: bool = False,
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
            return moe_experts_w8a8(
                x,
                layer.w13_weight,
                layer.w2_weight,
                layer.w13_weight_scale,
                layer.w2_weight_scale,
                topk_weights,
                topk_ids,
                expert_map=expert_map,
                apply_router_weight_on_input=apply_router_weight_on_input,
                activation=activation)

        def grouped(rows, group_ends, row_scales):
            # The MC2 dispatch hands over int8 rows (takes_int8).
            return grouped_mlp_w8a8_npu(rows, row_scales, group_ends,
                                        layer.w13_weight, layer.w2_weight,
                                        layer.w13_weight_scale,
                                        layer.w2_weight_scale, x.dtype)

        return moe_comm.current(x.shape[0]).experts(
            layer, x, topk_weights, topk_ids, expert_map, compute,
            apply_router_weight_on_input,
            grouped=(GroupedMLP(grouped, takes_int8=True)
                     if activation == "silu" else None))
