"""SiluAndMul: silu(x[..., :d]) * x[..., d:]."""

import torch
import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import SiluAndMul

from vllm_ascend.device import npu_kernels


def _check_even(x: torch.Tensor) -> int:
    if x.shape[-1] % 2:
        raise ValueError(
            "silu_and_mul needs gate||up concatenated on the last dimension "
            f"(an even size); got shape {tuple(x.shape)}.")
    return x.shape[-1] // 2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Computed in float32, cast back to the input dtype once."""
    d = _check_even(x)
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _silu_and_mul_npu(x: torch.Tensor) -> torch.Tensor:
    _check_even(x)
    import torch_npu
    return torch_npu.npu_swiglu(x, dim=-1)


silu_and_mul = _silu_and_mul_npu if npu_kernels() else silu_and_mul_ref


@CustomOp.register_oot(name="SiluAndMul")
class AscendSiluAndMul(SiluAndMul):
    """vLLM's SiluAndMul backed by ``silu_and_mul``."""

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
