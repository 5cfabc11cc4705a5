"""W8A8 layers built by their quantization methods, without an engine: a
bare module gets the method's parameters, random int8 weights and scales,
then ``process_weights_after_loading``, as vLLM's loader does."""

from contextlib import contextmanager

import pytest
import torch
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig, FusedMoEParallelConfig)

from tests.utils.npu import torch_npu_in_process
from vllm_ascend.ops import quant, weight_format
from vllm_ascend.ops.moe import experts as moe_experts
from vllm_ascend.ops.moe import fused_moe as moe_fused
from vllm_ascend.quantization.fused_moe import AscendW8A8DynamicFusedMoEMethod
from vllm_ascend.quantization.linear import (AscendW8A8DynamicLinearMethod,
                                             AscendW8A8LinearMethod)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(*shape, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=_gen(seed),
                         dtype=torch.int8)


def _ignore(*args, **kwargs) -> None:
    pass


def linear(static: bool, k: int = 128, parts=(64, 32), seed: int = 0,
           dtype: torch.dtype = torch.bfloat16):
    """(layer, method) of a fused linear with ``parts`` outputs."""
    layer = torch.nn.Module()
    layer.params_dtype = dtype
    cls = AscendW8A8LinearMethod if static else AscendW8A8DynamicLinearMethod
    method = cls("model.layers.0.self_attn.qkv_proj")
    n = sum(parts)
    method.create_weights(layer, k, list(parts), k, n, dtype,
                          weight_loader=_ignore)
    with torch.no_grad():
        layer.weight.copy_(_int8(n, k, seed=seed))
        layer.weight_scale.copy_(
            torch.rand(n, 1, generator=_gen(seed + 1)) * 1e-3 + 1e-4)
        layer.weight_offset.zero_()
        if static:
            layer.input_scale.fill_(0.03)
            layer.input_offset.fill_(4.0)
            layer.quant_bias.copy_(
                torch.randint(-900, 900, (n, ), generator=_gen(seed + 2)))
            layer.deq_scale.copy_(
                torch.rand(n, generator=_gen(seed + 3)) * 1e-4)
    method.process_weights_after_loading(layer)
    return layer, method


def experts(num_experts: int = 4, hidden: int = 128, inter: int = 64,
            seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """(layer, method) of W8A8_DYNAMIC experts after loading."""
    parallel = FusedMoEParallelConfig(tp_size=1, dp_size=1, ep_size=1,
                                      tp_rank=0, dp_rank=0, ep_rank=0,
                                      use_ep=False)
    config = FusedMoEConfig(num_experts=num_experts, experts_per_token=2,
                            hidden_dim=hidden, num_local_experts=num_experts,
                            moe_parallel_config=parallel, in_dtype=dtype)
    layer = torch.nn.Module()
    layer.moe_config = config
    method = AscendW8A8DynamicFusedMoEMethod(config, "model.layers.1.mlp")
    method.create_weights(layer, num_experts, hidden, inter, dtype,
                          weight_loader=_ignore)
    with torch.no_grad():
        for i, name in enumerate(("w13", "w2")):
            weight = getattr(layer, f"{name}_weight")
            weight.copy_(_int8(*weight.shape, seed=seed + i))
            getattr(layer, f"{name}_weight_scale").copy_(
                torch.rand(*weight.shape[:2], 1, generator=_gen(seed + 2 + i))
                * 1e-3 + 1e-4)
            getattr(layer, f"{name}_weight_offset").zero_()
    method.process_weights_after_loading(layer)
    return layer, method


# The functions the device chose at import, and their NPU versions.
NPU_FUNCTIONS = [
    (weight_format, "to_nz", weight_format._to_nz_npu),
    (weight_format, "format_of", weight_format._format_of_npu),
    (quant, "dynamic_quant", quant._dynamic_quant_npu),
    (quant, "static_quant", quant._static_quant_npu),
    (quant, "quant_matmul", quant._quant_matmul_npu),
    (moe_fused, "expert_weight_layout",
     moe_experts._expert_weight_layout_npu),
]


@contextmanager
def npu_paths(monkeypatch: pytest.MonkeyPatch, allow_internal_format=True):
    """The layers' NPU code paths in this process, through torch_npu (the
    double off an NPU), with ``allow_internal_format`` as the NPU runner
    sets it (``None``: the SoC's default)."""
    with torch_npu_in_process() as torch_npu, monkeypatch.context() as m:
        for module, name, npu_function in NPU_FUNCTIONS:
            m.setattr(module, name, npu_function)
        saved = torch.npu.config.allow_internal_format
        if allow_internal_format:
            weight_format.allow_internal_formats()
        try:
            yield torch_npu
        finally:
            torch.npu.config.allow_internal_format = saved
