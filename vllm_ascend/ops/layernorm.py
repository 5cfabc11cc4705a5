"""RMSNorm with and without the fused residual add."""

from typing import Optional, Union

import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_ascend.ops._backend import use_npu


def rms_norm_ref(x: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, in float32, cast back once."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def add_rms_norm_ref(
        x: torch.Tensor, residual: torch.Tensor,
        weight: Optional[torch.Tensor],
        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual).

    The sum is normalized in float32 before it is rounded to the residual
    dtype, as vLLM's fused kernels do.
    """
    s = x.float() + residual.float()
    y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), s.to(x.dtype)


def _rms_norm_npu(x: torch.Tensor, weight: Optional[torch.Tensor],
                  eps: float) -> torch.Tensor:
    if weight is None:
        return rms_norm_ref(x, weight, eps)
    import torch_npu
    return torch_npu.npu_rms_norm(x, weight, eps)[0]


def _add_rms_norm_npu(
        x: torch.Tensor, residual: torch.Tensor,
        weight: Optional[torch.Tensor],
        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if weight is None:
        return add_rms_norm_ref(x, residual, weight, eps)
    import torch_npu
    y, _rstd, new_residual = torch_npu.npu_add_rms_norm(
        x, residual, weight, eps)
    return y, new_residual


rms_norm = _rms_norm_npu if use_npu() else rms_norm_ref
add_rms_norm = _add_rms_norm_npu if use_npu() else add_rms_norm_ref


@CustomOp.register_oot(name="RMSNorm")
class AscendRMSNorm(RMSNorm):
    """vLLM's RMSNorm backed by ``rms_norm`` / ``add_rms_norm``."""

    def forward_oot(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.variance_size_override is not None:
            # Not used by GLM-4.5: keep vLLM's own implementation.
            return self.forward_native(x, residual)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"RMSNorm expected a last dimension of {self.hidden_size}, "
                f"got input of shape {tuple(x.shape)}.")
        weight = self.weight if self.has_weight else None
        if residual is None:
            return rms_norm(x, weight, self.variance_epsilon)
        return add_rms_norm(x, residual, weight, self.variance_epsilon)
