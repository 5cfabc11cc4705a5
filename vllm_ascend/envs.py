"""Environment variables read by vllm_ascend."""

import os

# "auto" (default): npu when torch_npu imports and sees a device, else the
# CPU reference device. "npu" or "cpu" forces one.
VLLM_ASCEND_DEVICE_ENV = "VLLM_ASCEND_DEVICE"


def requested_device() -> str:
    return os.environ.get(VLLM_ASCEND_DEVICE_ENV, "auto").strip().lower()


# "1" skips the startup check that a local GLM-4.5 checkpoint holds every
# tensor its config needs. vLLM's own tests of the patch series build
# partial checkpoints on purpose (tools/vllm_tree.py sets it for them).
VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV = "VLLM_ASCEND_SKIP_CHECKPOINT_CHECK"


def skip_checkpoint_check() -> bool:
    return os.environ.get(VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV, "0") == "1"


# "1": ``import torch_npu`` finds the test-only contract double of
# tests/npu_double (the dev install puts it on sys.path) and, with
# VLLM_ASCEND_DEVICE=npu, the plugin takes its NPU code paths with CPU
# tensors underneath. For CI on machines without an NPU.
VLLM_ASCEND_NPU_DOUBLE_ENV = "VLLM_ASCEND_NPU_DOUBLE"


def npu_double() -> bool:
    return os.environ.get(VLLM_ASCEND_NPU_DOUBLE_ENV, "0") == "1"
