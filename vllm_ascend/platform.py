"""The vLLM platform of the plugin: an Ascend NPU or the CPU reference."""

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_ascend import device

_choice = device.current()


class AscendPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = _choice.device_type
    device_type: str = _choice.device_type
    dispatch_key: str = "PrivateUse1" if _choice.is_npu else "CPU"
    ray_device_key: str = "NPU" if _choice.is_npu else ""
    dist_backend: str = _choice.dist_backend
    device_control_env_var: str = ("ASCEND_RT_VISIBLE_DEVICES"
                                   if _choice.is_npu else "")
    simple_compile_backend: str = "eager"

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Pinned host memory needs an accelerator runtime.
        return _choice.is_npu

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        if _choice.is_npu:
            return torch.npu.get_device_name(device_id)
        return "cpu-reference"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        if _choice.is_npu:
            return torch.npu.get_device_properties(device_id).total_memory
        import psutil
        return psutil.virtual_memory().total
