"""vllm_ascend: Ascend NPU platform plugin for vLLM v0.11.0 (patched).

On a host where torch_npu sees an NPU the plugin runs on ``npu``; elsewhere
it runs the same platform on the CPU reference device.
"""


def register() -> str:
    """``vllm.platform_plugins`` entry point: the platform class to use."""
    from vllm_ascend import startup_errors
    startup_errors.install()
    return "vllm_ascend.platform.AscendPlatform"


def register_ops() -> None:
    """``vllm.general_plugins`` entry point, loaded by every process."""
    from vllm_ascend.ops import register_oot_ops
    register_oot_ops()
