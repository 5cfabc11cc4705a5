"""Int8 quantization, quantized matmul and quantized experts (W8A8).

One interface per op, chosen once per process (``device.npu_kernels``): the
torch_npu kernels on an NPU, exact integer references elsewhere. The
references take int8 operands, accumulate exactly (every int8 product sum
is an integer below 2**31 for K < 131072, held exactly in float64, then
int32), and dequantize in float32 as the NPU kernels do:

- ``dynamic_quant(x)``: per-token symmetric int8, scale = max|x_t| / 127,
  q = clamp(round_half_even(x / scale), -128, 127);
- ``static_quant(x, r, o)``: per-tensor asymmetric int8,
  q = clamp(round_half_even(x * r + o), -128, 127), with r = 1 / scale and
  o = offset in x's dtype, as npu_quantize takes them: computed once, at
  load, by ``static_quant_params``;
- ``quant_matmul(q, w_t, scale, pertoken_scale, bias)``:
  y = float32(q @ w_t + bias) * scale[n] (* pertoken_scale[m]), with
  ``w_t`` int8 [K, N] (the NPU's x2 layout) and ``bias`` int32.
"""

from typing import Optional

import torch

from vllm_ascend.device import npu_kernels

INT8_MIN, INT8_MAX = -128, 127


def _round_to_int8(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def dynamic_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., K], float32 scale [...]); an all-zero row has scale 0
    and quantizes to zeros."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _round_to_int8(xf / safe.unsqueeze(-1)), scale


def static_quant_params(
        scale: torch.Tensor, offset: torch.Tensor,
        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reciprocal scale and the offset in the activations' ``dtype``,
    one element each (npu_quantize multiplies by scales of its input's
    dtype), from the calibrated float32 ``scale`` and ``offset``. Computed
    at load so that a call launches the quantization alone."""
    return ((1.0 / scale.float()).to(dtype).reshape(1),
            offset.to(dtype).reshape(1))


def static_quant_ref(x: torch.Tensor, r: torch.Tensor,
                     o: torch.Tensor) -> torch.Tensor:
    """``r``, ``o``: ``static_quant_params`` in x's dtype."""
    return _round_to_int8(x.float() * r.float() + o.float())


def quant_matmul_ref(q: torch.Tensor,
                     w_t: torch.Tensor,
                     scale: torch.Tensor,
                     pertoken_scale: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    acc = (q.double() @ w_t.double()).to(torch.int32)
    if bias is not None:
        acc = acc + bias.to(torch.int32)
    y = acc.float() * scale.float()
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    return y.to(out_dtype)


def _dynamic_quant_npu(
        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu
    return torch_npu.npu_dynamic_quant(x)


def _static_quant_npu(x: torch.Tensor, r: torch.Tensor,
                      o: torch.Tensor) -> torch.Tensor:
    """npu_quantize with div_mode=False: x * r + o."""
    import torch_npu
    return torch_npu.npu_quantize(x, r, o, torch.qint8, -1, False)


def _quant_matmul_npu(q: torch.Tensor,
                      w_t: torch.Tensor,
                      scale: torch.Tensor,
                      pertoken_scale: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    import torch_npu
    return torch_npu.npu_quant_matmul(q,
                                      w_t,
                                      scale,
                                      pertoken_scale=pertoken_scale,
                                      bias=bias,
                                      output_dtype=out_dtype)


if npu_kernels():
    dynamic_quant = _dynamic_quant_npu
    static_quant = _static_quant_npu
    quant_matmul = _quant_matmul_npu
else:
    dynamic_quant = dynamic_quant_ref
    static_quant = static_quant_ref
    quant_matmul = quant_matmul_ref
