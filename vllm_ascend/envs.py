"""Environment variables read by vllm_ascend."""

import os

# "auto" (default): npu when torch_npu imports and sees a device, else the
# CPU reference device. "npu" or "cpu" forces one.
VLLM_ASCEND_DEVICE_ENV = "VLLM_ASCEND_DEVICE"


def requested_device() -> str:
    return os.environ.get(VLLM_ASCEND_DEVICE_ENV, "auto").strip().lower()
