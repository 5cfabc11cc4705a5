"""The vLLM platform of the plugin: an Ascend NPU or the CPU reference."""

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

_choice = device.current()

# NPU kernels are tuned for 128-token blocks; the CPU reference device
# defaults to 16 so that small test caches still have many blocks.
DEFAULT_BLOCK_SIZE = 128 if _choice.is_npu else 16
# npu_fused_infer_attention_score with a paged KV cache: block_size a
# multiple of 128 in [128, 512]; in the TND layout (head dim != 512) query,
# key and value bfloat16 only (op-plugin 7.2.0
# docs/context/torch_npu-npu_fused_infer_attention_score.md:224).
NPU_BLOCK_SIZE_MULTIPLE, NPU_BLOCK_SIZE_RANGE = 128, (128, 512)
NPU_DTYPES = [torch.bfloat16]
# Its TND layout with more than one query token per request (prefill,
# verification) takes head dims 128 or 192; GLM-4.5's is 128.
NPU_HEAD_SIZES = (128, 192)


class AscendPlatform(Platform):
    _enum = PlatformEnum.OOT
    # The type of the tensors' device ("cpu" under the torch_npu double):
    # vLLM builds torch devices from both names.
    device_name: str = _choice.torch_device_type
    device_type: str = _choice.torch_device_type
    dispatch_key: str = ("PrivateUse1" if _choice.torch_device_type == "npu"
                         else "CPU")
    ray_device_key: str = "NPU" if _choice.is_npu else ""
    dist_backend: str = _choice.dist_backend
    # vLLM sets it per engine (data parallel ranks); the CPU reference
    # device has nothing to hide but needs a real variable name.
    device_control_env_var: str = ("ASCEND_RT_VISIBLE_DEVICES"
                                   if _choice.is_npu else
                                   "VLLM_ASCEND_CPU_VISIBLE_DEVICES")
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        if _choice.is_npu:
            return list(NPU_DTYPES)
        return [torch.bfloat16, torch.float16, torch.float32]

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
        from vllm_ascend.compilation.graph_wrapper import device_graph_api
        return device_graph_api().graph_pool_handle()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Pinned host memory needs an accelerator runtime.
        return _choice.torch_device_type == "npu"

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

    @classmethod
    def set_device(cls, device_: torch.device) -> None:
        # The NPU is a per-thread context: vLLM's Ray executor selects the
        # worker's device here on its compiled-DAG thread. Under the
        # torch_npu double the worker's tensors are on the CPU: no NPU to
        # select.
        if _choice.is_npu and device_.type == "npu":
            torch.npu.set_device(device_.index)

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def get_current_memory_usage(cls,
                                 device_: Optional[torch.types.Device] = None
                                 ) -> float:
        if _choice.is_npu:
            torch.npu.reset_peak_memory_stats(device_)
            return torch.npu.max_memory_allocated(device_)
        import psutil
        return psutil.Process().memory_info().rss

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
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        if _choice.is_npu:
            _check_npu_limits(vllm_config)

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = (
                "vllm_ascend.worker.worker.AscendWorker")
        if parallel_config.enable_dbo:
            logger.warning("Dual-batch overlap is not supported by "
                           "vllm_ascend; disabled.")
            parallel_config.enable_dbo = False

        scheduler_config = vllm_config.scheduler_config
        if scheduler_config.async_scheduling and not _choice.is_npu:
            logger.warning("Async scheduling needs device streams; disabled "
                           "on the CPU reference device.")
            scheduler_config.async_scheduling = False

        check_mtp_config(vllm_config)
        checks.check_parallel_layout(vllm_config)
        moe_comm.check_config(vllm_config)
        spec = vllm_config.speculative_config
        configure_graph_mode(
            vllm_config, spec.num_speculative_tokens if spec else 0)

        # Workers are spawned: forking after torch threads start is unsafe.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # A checkpoint missing tensors fails here, before any worker starts.
        checks.check_checkpoint(vllm_config)

    @classmethod
    def validate_request(cls, prompt, params, processed_inputs) -> None:
        super().validate_request(prompt, params, processed_inputs)
        checks.check_sampling_params(params)


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
            f"{DEFAULT_BLOCK_SIZE}.")
