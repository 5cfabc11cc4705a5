"""Choose the device the plugin runs on: an Ascend NPU or the CPU reference.

The choice is made once per process and never falls back silently: a host
where torch_npu is installed but does not import is an error, and so is a
forced ``npu`` without torch_npu. It answers two questions, one function
each: :func:`npu_kernels` (do the NPU code paths run: torch_npu kernels,
device graphs, HCCL?) and :func:`tensor_device_type` (where do tensors
live?). The answers differ only under the torch_npu contract double, which
runs the NPU code paths on CPU tensors.
"""

import functools
import importlib.util
from dataclasses import dataclass

from vllm.logger import init_logger

from vllm_ascend import envs

logger = init_logger(__name__)

DEVICES = ("auto", "npu", "cpu")


@dataclass(frozen=True)
class DeviceChoice:
    device_type: str  # the code paths: "npu" (torch_npu) or "cpu"
    dist_backend: str  # "hccl" or "gloo"
    reason: str
    # Where tensors live: "npu", or "cpu" on the reference device and under
    # the torch_npu contract double (the NPU code paths on CPU tensors).
    torch_device_type: str = ""

    def __post_init__(self) -> None:
        if not self.torch_device_type:
            object.__setattr__(self, "torch_device_type", self.device_type)

    @property
    def npu_kernels(self) -> bool:
        return self.device_type == "npu"


NPU = ("npu", "hccl")
CPU = ("cpu", "gloo")


def _npu_device_count() -> int:
    """Import torch_npu; raise with a clear message if it is broken."""
    try:
        import torch
        import torch_npu
    except Exception as exc:
        raise RuntimeError(
            f"torch_npu is installed but failed to import ({exc!r}). Fix the "
            "CANN/torch_npu installation (source the CANN set_env.sh and "
            "install the torch_npu matching torch), or set "
            f"{envs.VLLM_ASCEND_DEVICE_ENV}=cpu to run on the CPU reference "
            "device.") from exc
    if envs.npu_double() and not getattr(torch_npu, "CONTRACT_DOUBLE", False):
        raise RuntimeError(
            f"{envs.VLLM_ASCEND_NPU_DOUBLE_ENV}=1 but the torch_npu imported "
            f"from {torch_npu.__file__} is not the contract double: run "
            "`make install` (it puts tests/npu_double on the path), or unset "
            f"{envs.VLLM_ASCEND_NPU_DOUBLE_ENV}.")
    return torch.npu.device_count()


def choose(requested: str, torch_npu_installed: bool) -> DeviceChoice:
    if requested not in DEVICES:
        raise ValueError(
            f"{envs.VLLM_ASCEND_DEVICE_ENV}={requested!r} is not a device "
            f"vllm_ascend knows; use one of {', '.join(DEVICES)}.")
    if requested == "cpu":
        return DeviceChoice(*CPU, reason=f"{envs.VLLM_ASCEND_DEVICE_ENV}=cpu")
    if not torch_npu_installed:
        if requested == "npu":
            raise RuntimeError(
                f"{envs.VLLM_ASCEND_DEVICE_ENV}=npu but torch_npu is not "
                "installed: install requirements-npu.txt on an Ascend host, "
                f"or unset {envs.VLLM_ASCEND_DEVICE_ENV}.")
        return DeviceChoice(*CPU, reason="torch_npu is not installed")
    count = _npu_device_count()
    if count > 0 and envs.npu_double():
        return DeviceChoice(
            *NPU, torch_device_type="cpu",
            reason=f"the torch_npu contract double "
            f"({envs.VLLM_ASCEND_NPU_DOUBLE_ENV}=1): NPU code paths on CPU "
            "tensors")
    if count > 0:
        return DeviceChoice(*NPU, reason=f"torch_npu sees {count} NPU(s)")
    if requested == "npu":
        raise RuntimeError(
            f"{envs.VLLM_ASCEND_DEVICE_ENV}=npu but torch_npu sees no NPU: "
            "check the driver (npu-smi info) and ASCEND_RT_VISIBLE_DEVICES.")
    return DeviceChoice(*CPU, reason="torch_npu sees no NPU")


def npu_kernels() -> bool:
    """Whether this process runs the NPU code paths (torch_npu kernels,
    device graphs, HCCL), on an NPU or through the contract double; False
    on the CPU reference device."""
    return current().npu_kernels


def tensor_device_type() -> str:
    """Where this process's tensors live: "npu", or "cpu" (the reference
    device, and the NPU code paths under the contract double)."""
    return current().torch_device_type


def tensor_dispatch_key() -> str:
    """The torch dispatch key of this process's tensors."""
    return "PrivateUse1" if tensor_device_type() == "npu" else "CPU"


def platform_class() -> str:
    """The vLLM platform of this process's device."""
    if npu_kernels():
        return "vllm_ascend.platform.NpuPlatform"
    return "vllm_ascend.platform.CpuReferencePlatform"


def tensor_device(local_rank: int):
    """The torch device of this rank's tensors."""
    import torch
    if tensor_device_type() == "npu":
        return torch.device("npu", local_rank)
    return torch.device("cpu")


@functools.cache
def current() -> DeviceChoice:
    choice = choose(envs.requested_device(),
                    importlib.util.find_spec("torch_npu") is not None)
    logger.info("vllm_ascend runs on %s (%s); ops use the %s kernels.",
                choice.device_type, choice.reason,
                "torch_npu" if choice.npu_kernels else "torch reference")
    return choice
