"""Which implementation each op uses: decided once per process.

Every op module picks its NPU (torch_npu) or torch reference implementation
at import time from ``vllm_ascend.device.current()``, so no call pays for the
choice and a process never mixes the two.
"""

import functools

from vllm.logger import init_logger

from vllm_ascend import device

logger = init_logger(__name__)


@functools.cache
def use_npu() -> bool:
    """True when the ops run torch_npu kernels, False for the reference."""
    on_npu = device.current().is_npu
    logger.info("vllm_ascend ops use the %s implementations.",
                "torch_npu" if on_npu else "torch reference")
    return on_npu
