"""RMSNorm with and without the fused residual add.

An Ascend W8A8 checkpoint quantized with msModelSlim's anti-outlier method
m4 shifts the activations that enter its linears: the norms before them
get a non-zero ``bias`` (listed as ``<norm>.bias`` in
``quant_model_description.json``), added to the normalized output, and the
linears' biases compensate. When the description lists any norm bias,
every RMSNorm has a ``bias`` parameter (zero unless the checkpoint holds
it), added after the norm on both devices; the residual that the fused add
returns stays the un-biased sum.
"""

from typing import Optional, Union

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_ascend.device import npu_kernels


def _add_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The norm bias, added to the norm's output in its dtype (out of
    place: the output may be a captured graph's buffer)."""
    return y if bias is None else y + bias.to(y.dtype)


def rms_norm_ref(x: torch.Tensor,
                 weight: Optional[torch.Tensor],
                 eps: float,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, in float32, cast back once;
    then ``+ bias``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return _add_bias(y.to(x.dtype), bias)


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) + bias, x + residual).

    The sum is normalized in float32 before it is rounded to the residual
    dtype, as vLLM's fused kernels do; the returned residual has no bias.
    """
    s = x.float() + residual.float()
    y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return _add_bias(y.to(x.dtype), bias), s.to(x.dtype)


def _rms_norm_npu(x: torch.Tensor,
                  weight: Optional[torch.Tensor],
                  eps: float,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if weight is None:
        return rms_norm_ref(x, weight, eps, bias)
    import torch_npu
    return _add_bias(torch_npu.npu_rms_norm(x, weight, eps)[0], bias)


def _add_rms_norm_npu(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if weight is None:
        return add_rms_norm_ref(x, residual, weight, eps, bias)
    import torch_npu
    y, _rstd, new_residual = torch_npu.npu_add_rms_norm(
        x, residual, weight, eps)
    return _add_bias(y, bias), new_residual


rms_norm = _rms_norm_npu if npu_kernels() else rms_norm_ref
add_rms_norm = _add_rms_norm_npu if npu_kernels() else add_rms_norm_ref


def norm_bias_described() -> bool:
    """Whether the model being built is an Ascend quantized checkpoint
    whose description lists norm biases (anti-outlier m4)."""
    quant_config = get_current_vllm_config().quant_config
    description = getattr(quant_config, "description", None)
    return bool(description is not None
                and getattr(description, "norm_biases", None))


@CustomOp.register_oot(name="RMSNorm")
class AscendRMSNorm(RMSNorm):
    """vLLM's RMSNorm backed by ``rms_norm`` / ``add_rms_norm``, with the
    norm bias of an anti-outlier (m4) checkpoint."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: Optional[int] = None,
        has_weight: bool = True,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(hidden_size, eps, var_hidden_size, has_weight,
                         dtype)
        self.bias: Optional[torch.nn.Parameter] = None
        if norm_bias_described():
            # Loaded by the model's loader (default_weight_loader) from
            # "<norm>.bias"; zero for a norm the checkpoint has none for.
            self.bias = torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=self.weight.dtype),
                requires_grad=False)

    def forward_oot(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.variance_size_override is not None:
            # Not used by GLM-4.5: keep vLLM's own implementation.
            out = self.forward_native(x, residual)
            if residual is None:
                return _add_bias(out, self.bias)
            return _add_bias(out[0], self.bias), out[1]
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"RMSNorm expected a last dimension of {self.hidden_size}, "
                f"got input of shape {tuple(x.shape)}.")
        weight = self.weight if self.has_weight else None
        if residual is None:
            return rms_norm(x, weight, self.variance_epsilon, self.bias)
        return add_rms_norm(x, residual, weight, self.variance_epsilon,
                            self.bias)
