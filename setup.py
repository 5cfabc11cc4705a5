"""vllm_ascend: the Ascend NPU platform plugin for the patched vLLM v0.11.0."""

from setuptools import find_packages, setup

setup(
    name="vllm_ascend",
    version="0.11.0",
    description="Ascend NPU plugin for vLLM: GLM-4.5 MoE with MTP speculative "
    "decoding, with a CPU reference device that runs the same code path",
    packages=find_packages(include=["vllm_ascend", "vllm_ascend.*"]),
    python_requires=">=3.10",
    entry_points={
        "vllm.platform_plugins": ["ascend = vllm_ascend:register"],
        "vllm.general_plugins": ["ascend_ops = vllm_ascend:register_ops"],
    },
)
