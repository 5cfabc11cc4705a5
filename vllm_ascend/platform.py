"""The vLLM platforms of the plugin, one per device: ``NpuPlatform`` (the
NPU code paths) and ``CpuReferencePlatform`` (the torch reference kernels,
eager). ``vllm_ascend.register`` names the one ``device.current`` chose."""

import os
from typing import TYPE_CHECKING, Optional

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_ascend import checks, device
from vllm_ascend.compilation.graph_mode import configure_graph_mode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms import _Backend
else:
    VllmConfig = None
    _Backend = None

logger = init_logger(__name__)

# npu_fused_infer_attention_score with a paged KV cache: block_size a
# multiple of 128 in [128, 512]; in the TND layout (head dim != 512) query,
# key and value bfloat16 only (op-plugin 7.2.0
# docs/context/torch_npu-npu_fused_infer_attention_score.md:224).
NPU_BLOCK_SIZE_MULTIPLE, NPU_BLOCK_SIZE_RANGE = 128, (128, 512)
NPU_DTYPES = [torch.bfloat16]
# Its TND layout with more than one query token per request (prefill,
# verification) takes head dims 128 or 192; GLM-4.5's is 128.
NPU_HEAD_SIZES = (128, 192)


class AscendPlatformBase(Platform):
    """What the NPU and the CPU reference device share: the attention
    backend, the communicator, ``--quantization ascend``, the checks and the
    graph settings. One subclass per device holds the rest."""
    _enum = PlatformEnum.OOT
    simple_compile_backend: str = "eager"
    # NPU kernels are tuned for 128-token blocks.
    default_block_size: int = 128
    worker_cls: str = ""

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: "_Backend", head_size: int,
                             dtype: torch.dtype, kv_cache_dtype: Optional[str],
                             block_size: int, use_v1: bool, use_mla: bool,
                             has_sink: bool, use_sparse: bool) -> str:
        if use_mla or use_sparse or has_sink:
            raise NotImplementedError(
                "vllm_ascend serves GLM-4.5 style GQA attention; MLA, sparse "
                "and sink attention are not supported.")
        return "vllm_ascend.attention.backend.AscendAttentionBackend"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm_ascend.distributed.communicator.AscendCommunicator"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("LoRA is not supported by vllm_ascend.")

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention is one opaque op, the split point of piecewise graphs.
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Registers ``--quantization ascend`` and lets the CLI accept it
        (the flag's choices are vLLM's built-in methods)."""
        from vllm_ascend.quantization.config import ASCEND_QUANTIZATION
        if parser is None:
            return
        for action in parser._actions:
            if ("--quantization" in action.option_strings
                    and action.choices is not None
                    and ASCEND_QUANTIZATION not in action.choices):
                action.choices = [*action.choices, ASCEND_QUANTIZATION]

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm_ascend.distributed import moe_comm
        from vllm_ascend.spec_decode.mtp_proposer import check_mtp_config

        if vllm_config.model_config is not None:
            vllm_config.model_config.disable_cascade_attn = True
        cache_config = vllm_config.cache_config
        if cache_config is not None and cache_config.block_size is None:
            cache_config.block_size = cls.default_block_size
        cls.check_device_limits(vllm_config)

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = cls.worker_cls
        if parallel_config.enable_dbo:
            logger.warning("Dual-batch overlap is not supported by "
                           "vllm_ascend; disabled.")
            parallel_config.enable_dbo = False

        cls.check_scheduling(vllm_config.scheduler_config)

        check_mtp_config(vllm_config)
        checks.check_parallel_layout(vllm_config)
        moe_comm.check_config(vllm_config)
        spec = vllm_config.speculative_config
        configure_graph_mode(vllm_config,
                             spec.num_speculative_tokens if spec else 0,
                             graphs=cls.support_static_graph_mode())

        # Workers are spawned: forking after torch threads start is unsafe.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # A checkpoint missing tensors fails here, before any worker starts.
        checks.check_checkpoint(vllm_config)

    @classmethod
    def validate_request(cls, prompt, params, processed_inputs) -> None:
        super().validate_request(prompt, params, processed_inputs)
        checks.check_sampling_params(params)

    @classmethod
    def check_device_limits(cls, vllm_config: "VllmConfig") -> None:
        """What the device's kernels cannot run fails at startup."""

    @classmethod
    def check_scheduling(cls, scheduler_config) -> None:
        """Turn off what the device's runner cannot schedule."""


class NpuPlatform(AscendPlatformBase):
    """The NPU code paths: torch_npu kernels, device graphs and HCCL, on an
    Ascend NPU, or on CPU tensors through the torch_npu contract double
    (``device.tensor_device_type``)."""
    # vLLM builds torch devices from both names.
    device_name: str = device.tensor_device_type()
    device_type: str = device.tensor_device_type()
    dispatch_key: str = device.tensor_dispatch_key()
    ray_device_key: str = "NPU"
    dist_backend: str = "hccl"
    # vLLM sets it per engine (data parallel ranks).
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    supported_dtypes: list[torch.dtype] = list(NPU_DTYPES)
    worker_cls = "vllm_ascend.worker.worker.NpuWorker"

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        # vLLM then computes the capture sizes; configure_graph_mode decides
        # what runs.
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return "vllm_ascend.compilation.graph_wrapper.AscendGraphWrapper"

    @classmethod
    def graph_pool_handle(cls):
        return torch.npu.graph_pool_handle()

    @classmethod
    def mem_get_info(cls, device_=None) -> tuple[int, int]:
        return torch.npu.mem_get_info(device_)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Pinned host memory needs the NPU runtime (not the double's CPU
        # tensors).
        return device.tensor_device_type() == "npu"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.npu.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.npu.get_device_properties(device_id).total_memory

    @classmethod
    def set_device(cls, device_: torch.device) -> None:
        # The NPU is a per-thread context: vLLM's Ray executor selects the
        # worker's device here on its compiled-DAG thread. Under the
        # torch_npu double the worker's tensors are on the CPU: no NPU to
        # select.
        if device_.type == "npu":
            torch.npu.set_device(device_.index)

    @classmethod
    def get_current_memory_usage(cls,
                                 device_: Optional[torch.types.Device] = None
                                 ) -> float:
        torch.npu.reset_peak_memory_stats(device_)
        return torch.npu.max_memory_allocated(device_)

    @classmethod
    def check_device_limits(cls, vllm_config: "VllmConfig") -> None:
        _check_npu_limits(vllm_config)


class CpuReferencePlatform(AscendPlatformBase):
    """The torch reference kernels on the CPU, run eager as vLLM's CPU
    backend runs: no device graphs (they run on an NPU, or on the CPU
    through the torch_npu double), no async scheduling."""
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    ray_device_key: str = ""
    dist_backend: str = "gloo"
    # vLLM sets it per engine (data parallel ranks); nothing to hide on the
    # CPU, but it needs a variable name.
    device_control_env_var: str = "VLLM_ASCEND_CPU_VISIBLE_DEVICES"
    supported_dtypes: list[torch.dtype] = [
        torch.bfloat16, torch.float16, torch.float32
    ]
    # Small test caches still have many blocks.
    default_block_size = 16
    worker_cls = "vllm_ascend.worker.worker.CpuReferenceWorker"

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu-reference"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil
        return psutil.virtual_memory().total

    @classmethod
    def get_current_memory_usage(cls,
                                 device_: Optional[torch.types.Device] = None
                                 ) -> float:
        import psutil
        return psutil.Process().memory_info().rss

    @classmethod
    def check_scheduling(cls, scheduler_config) -> None:
        if scheduler_config.async_scheduling:
            logger.warning("Async scheduling needs device streams; disabled "
                           "on the CPU reference device.")
            scheduler_config.async_scheduling = False


def _check_npu_limits(vllm_config: "VllmConfig") -> None:
    """What the NPU kernels cannot run fails at startup, in one line."""
    model_config = vllm_config.model_config
    if model_config is not None and model_config.dtype not in NPU_DTYPES:
        raise ValueError(
            f"dtype {model_config.dtype} is not supported on the Ascend NPU "
            "(the fused attention's TND layout takes bfloat16 only): use "
            "--dtype bfloat16.")
    if (model_config is not None
            and model_config.get_head_size() not in NPU_HEAD_SIZES):
        raise ValueError(
            f"head_dim {model_config.get_head_size()} is not supported on the "
            "Ascend NPU: the fused attention (TND layout) takes head_dim "
            f"{' or '.join(map(str, NPU_HEAD_SIZES))}.")
    block_size = vllm_config.cache_config.block_size
    low, high = NPU_BLOCK_SIZE_RANGE
    if (block_size % NPU_BLOCK_SIZE_MULTIPLE
            or not low <= block_size <= high):
        raise ValueError(
            f"--block-size {block_size} is not supported on the Ascend NPU "
            "(the fused attention needs a multiple of "
            f"{NPU_BLOCK_SIZE_MULTIPLE} in [{low}, {high}]): use --block-size "
            f"{NpuPlatform.default_block_size}.")
