"""W8A8_DYNAMIC routed experts: int8 weights with per-channel scales,
activations quantized per token before each grouped matmul (on the NPU the
first quantization runs inside the routing kernel or the MC2 dispatch).

``w13`` is int8 [E_local, 2I, H], ``w2`` int8 [E_local, H, I] (the float
layout of ``experts``), ``w13_scale`` [E_local, 2I], ``w2_scale``
[E_local, H], in ``expert_scale_dtype``. Per expert, as the NPU computes
it:

    q, s = dynamic_quant(x)
    gate_up = (q @ w13^T) * w13_scale * s             (in x.dtype)
    h = silu(gate) * up                               (in x.dtype)
    q2, s2 = dynamic_quant(h)
    y = (q2 @ w2^T) * w2_scale * s2, weighted and summed per token.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from vllm_ascend.device import npu_kernels
from vllm_ascend.ops import quant
from vllm_ascend.ops.moe.experts import (_check, _local_ids,
                                         grouped_matmul_npu, loaded_layout,
                                         npu_permute, npu_unpermute)


def expert_scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-channel scale's dtype: npu_grouped_matmul takes a bfloat16
    scale for a bfloat16 result and a float32 one otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                  w2_scale: torch.Tensor) -> None:
    if (w13.dtype != torch.int8 or w2.dtype != torch.int8
            or w13_scale.shape != w13.shape[:2]
            or w2_scale.shape != w2.shape[:2]):
        raise ValueError(
            "moe_experts_w8a8 expects int8 w13 [E, 2I, H] and w2 [E, H, I] "
            "with float32 scales [E, 2I] and [E, H]; got "
            f"{w13.dtype} {tuple(w13.shape)}, {w2.dtype} {tuple(w2.shape)}, "
            f"{tuple(w13_scale.shape)}, {tuple(w2_scale.shape)}.")


def moe_experts_w8a8_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    _check(x, w13, w2, topk_weights, topk_ids, activation)
    _check_scales(w13, w2, w13_scale, w2_scale)
    local = _local_ids(topk_ids, expert_map)
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local[local >= 0].unique().tolist():
        tokens, slots = (local == e).nonzero(as_tuple=True)
        weight = topk_weights[tokens, slots].float().unsqueeze(1)
        xe = x[tokens]
        if apply_router_weight_on_input:
            xe = (xe.float() * weight).to(x.dtype)
        q, s = quant.dynamic_quant_ref(xe)
        gate_up = quant.quant_matmul_ref(q, w13[e].t(), w13_scale[e], s,
                                         out_dtype=x.dtype).float()
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        q2, s2 = quant.dynamic_quant_ref(h)
        ye = quant.quant_matmul_ref(q2, w2[e].t(), w2_scale[e], s2,
                                    out_dtype=torch.float32)
        if not apply_router_weight_on_input:
            ye = ye * weight
        out.index_add_(0, tokens, ye)
    return out.to(x.dtype)


def _moe_experts_w8a8_npu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """Permute and quantize in one routing kernel, two int8 grouped
    matmuls with SwiGLU between them, fused un-permute
    (``experts._moe_experts_npu``'s steps). ``w13`` [E, H, 2I] and ``w2``
    [E, I, H]: the NPU layout (``experts.expert_weight_layout``)."""
    _check(x, loaded_layout(w13), loaded_layout(w2), topk_weights, topk_ids,
           activation)
    _check_scales(loaded_layout(w13), loaded_layout(w2), w13_scale, w2_scale)
    if apply_router_weight_on_input:
        return moe_experts_w8a8_ref(x, loaded_layout(w13), loaded_layout(w2),
                                    w13_scale, w2_scale, topk_weights,
                                    topk_ids,
                                    expert_map=expert_map,
                                    apply_router_weight_on_input=True,
                                    activation=activation)
    routed = npu_permute(x, topk_ids, expert_map, w13.shape[0],
                         quantize=True)
    y = grouped_mlp_w8a8_npu(routed.rows, routed.row_scales,
                             routed.group_ends, w13, w2, w13_scale,
                             w2_scale, x.dtype)
    return npu_unpermute(y, routed, topk_weights)


def grouped_mlp_w8a8_npu(rows: torch.Tensor, row_scales: torch.Tensor,
                         group_ends: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, w13_scale: torch.Tensor,
                         w2_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """``experts.grouped_mlp_npu`` with int8 weights, on rows that come
    quantized (int8 with float32 per-row ``row_scales``: from the routing
    kernel or the MC2 dispatch); the output in ``out_dtype``."""
    import torch_npu
    gate_up = grouped_matmul_npu(rows, w13, group_ends, scale=[w13_scale],
                                 per_token_scale=[row_scales],
                                 output_dtype=out_dtype)
    h = torch_npu.npu_swiglu(gate_up, dim=-1)
    q2, s2 = torch_npu.npu_dynamic_quant(h)
    return grouped_matmul_npu(q2, w2, group_ends, scale=[w2_scale],
                              per_token_scale=[s2], output_dtype=out_dtype)


moe_experts_w8a8 = (_moe_experts_w8a8_npu
                    if npu_kernels() else moe_experts_w8a8_ref)
