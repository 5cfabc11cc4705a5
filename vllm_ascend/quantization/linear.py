"""W8A8 linear methods: int8 weights with per-channel scales, activations
quantized per tensor with calibrated scales (W8A8) or per token at run
time (W8A8_DYNAMIC)."""

from typing import Optional

import torch
from torch.nn import Parameter
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.linear import (LinearMethodBase,
                                               RowParallelLinear)
from vllm.model_executor.parameter import (ChannelQuantScaleParameter,
                                           ModelWeightParameter,
                                           PerTensorScaleParameter)

from vllm_ascend.ops import quant, weight_format


def _check_symmetric(layer: torch.nn.Module, prefix: str) -> None:
    if torch.count_nonzero(layer.weight_offset.data):
        raise ValueError(
            f"{prefix}.weight_offset is not zero: vllm_ascend runs "
            "symmetric int8 weights only; re-export the checkpoint with "
            "symmetric per-channel weights (msModelSlim w_sym=True).")


def _replace(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    setattr(layer, name, Parameter(data, requires_grad=False))


class AscendW8A8DynamicLinearMethod(LinearMethodBase):
    """W8A8_DYNAMIC: y = (q_x @ q_w^T) * w_scale[n] * x_scale[t]."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module,
                       input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        loader = extra_weight_attrs["weight_loader"]
        out = sum(output_partition_sizes)
        layer.register_parameter(
            "weight",
            ModelWeightParameter(data=torch.empty(out,
                                                  input_size_per_partition,
                                                  dtype=torch.int8),
                                 input_dim=1,
                                 output_dim=0,
                                 weight_loader=loader))
        for name in ("weight_scale", "weight_offset"):
            layer.register_parameter(
                name,
                ChannelQuantScaleParameter(data=torch.empty(
                    out, 1, dtype=torch.float32),
                                           output_dim=0,
                                           weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _check_symmetric(layer, self.prefix)
        # The matmul kernels take the weight as x2 [K, N], read fastest in
        # the NPU's NZ format.
        _replace(layer, "weight",
                 weight_format.to_nz(layer.weight.data.t().contiguous()))
        _replace(layer, "weight_scale",
                 layer.weight_scale.data.flatten().float())
        del layer.weight_offset

    def apply(self,
              layer: torch.nn.Module,
              x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q, x_scale = quant.dynamic_quant(x2)
        y = quant.quant_matmul(q,
                               layer.weight,
                               layer.weight_scale,
                               pertoken_scale=x_scale,
                               out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class AscendW8A8LinearMethod(AscendW8A8DynamicLinearMethod):
    """W8A8 (static): q_x = round(x / input_scale + input_offset),
    y = (q_x @ q_w^T + quant_bias[n]) * deq_scale[n], where the checkpoint's
    quant_bias cancels the input offset and deq_scale = input_scale *
    weight_scale."""

    def create_weights(self, layer: torch.nn.Module,
                       input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        super().create_weights(layer, input_size_per_partition,
                               output_partition_sizes, input_size,
                               output_size, params_dtype,
                               **extra_weight_attrs)
        loader = extra_weight_attrs["weight_loader"]
        out = sum(output_partition_sizes)
        for name in ("input_scale", "input_offset"):
            # One value per fused part (q, k, v): they must agree.
            layer.register_parameter(
                name,
                PerTensorScaleParameter(data=torch.full(
                    (len(output_partition_sizes), ),
                    torch.nan,
                    dtype=torch.float32),
                                        weight_loader=loader))
        layer.register_parameter(
            "quant_bias",
            ChannelQuantScaleParameter(data=torch.empty(out,
                                                        dtype=torch.int32),
                                       output_dim=0,
                                       weight_loader=loader))
        layer.register_parameter(
            "deq_scale",
            ChannelQuantScaleParameter(data=torch.empty(out,
                                                        dtype=torch.float32),
                                       output_dim=0,
                                       weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        for name in ("input_scale", "input_offset"):
            values = getattr(layer, name).data
            if values.isnan().any() or not bool((values == values[0]).all()):
                raise ValueError(
                    f"{self.prefix}: the fused parts' {name} values "
                    f"{values.tolist()} differ; they quantize one input and "
                    "must be equal: re-export the checkpoint.")
            _replace(layer, name, values[:1].clone())
        # What the quantization multiplies by, in the activations' dtype,
        # once here rather than at every call (buffers: not checkpoint
        # parameters).
        reciprocal, offset = quant.static_quant_params(
            layer.input_scale.data, layer.input_offset.data,
            layer.params_dtype)
        layer.register_buffer("input_scale_reciprocal", reciprocal,
                              persistent=False)
        layer.register_buffer("input_offset_cast", offset, persistent=False)
        if (isinstance(layer, RowParallelLinear)
                and get_tensor_model_parallel_rank() > 0):
            # Each rank's partial sum is dequantized; the offset correction
            # (a full-K sum) is added once, on rank 0, like the bias.
            layer.quant_bias.data.zero_()

    def apply(self,
              layer: torch.nn.Module,
              x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q = quant.static_quant(x2, layer.input_scale_reciprocal,
                               layer.input_offset_cast)
        y = quant.quant_matmul(q,
                               layer.weight,
                               layer.deq_scale,
                               bias=layer.quant_bias,
                               out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
