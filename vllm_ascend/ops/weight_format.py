"""Weight formats: int8 matmul weights in the NPU's FRACTAL_NZ layout.

The NPU's cube unit reads a matrix in 16 x 32-byte fractals; a weight kept
ND is rearranged into them on every call, an NZ weight is read as stored.
vllm-ascend casts its W8A8 linear and expert weights to NZ once, at load
(v0.11.0 ``quantization/w8a8.py``, ``w8a8_dynamic.py``). ``to_nz`` does that
on an NPU and returns the weight unchanged on the CPU reference device,
whose kernels have no formats. The cast needs
``torch.npu.config.allow_internal_format`` (``allow_internal_formats``):
without it torch_npu silently keeps ND, the default on an Atlas A3.
"""

import torch

from vllm_ascend.device import npu_kernels

# aclFormat values (torch_npu.Format).
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


def allow_internal_formats() -> None:
    """Let torch_npu create NZ tensors (the NPU runner calls it before the
    weights load, as vllm-ascend's model runner does)."""
    torch.npu.config.allow_internal_format = True


def _to_nz_npu(w: torch.Tensor) -> torch.Tensor:
    """``w`` (contiguous, [..., K, N] as the kernels take it) in NZ."""
    import torch_npu
    return torch_npu.npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ)


def _format_of_npu(w: torch.Tensor) -> int:
    import torch_npu
    return torch_npu.get_npu_format(w)


def to_nz_ref(w: torch.Tensor) -> torch.Tensor:
    return w


def format_of_ref(w: torch.Tensor) -> int:
    return ACL_FORMAT_ND


if npu_kernels():
    to_nz = _to_nz_npu
    format_of = _format_of_npu
else:
    to_nz = to_nz_ref
    format_of = format_of_ref
