"""vllm_ascend: Ascend NPU platform plugin for vLLM v0.11.0 (patched).

On a host where torch_npu sees an NPU the plugin runs on ``npu``
(``NpuPlatform``); elsewhere on the CPU reference device
(``CpuReferencePlatform``), or, with the torch_npu contract double, the NPU
code paths on CPU tensors.
"""

import logging

import vllm.logger  # noqa: F401  (configures the "vllm" logger on import)


def _share_vllm_logging() -> None:
    """Log through vLLM's handlers and level (VLLM_LOGGING_LEVEL,
    VLLM_CONFIGURE_LOGGING): vLLM's logging config only covers the ``vllm``
    logger tree, and ours is ``vllm_ascend``."""
    ours, theirs = logging.getLogger(__name__), logging.getLogger("vllm")
    if not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = theirs.propagate


_share_vllm_logging()


def register() -> str:
    """``vllm.platform_plugins`` entry point: the platform class of the
    device this process runs on."""
    from vllm_ascend import device, startup_errors
    startup_errors.install()
    return device.platform_class()


def register_ops() -> None:
    """``vllm.general_plugins`` entry point, loaded by every process."""
    from vllm_ascend.ops import register_oot_ops
    register_oot_ops()
    # Registers --quantization ascend.
    import vllm_ascend.quantization.config  # noqa: F401
