"""The plugin's worker: vLLM's GPU worker with the device parts replaced."""

import gc
from typing import Optional

import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.utils import set_random_seed
from vllm.platforms import current_platform
from vllm.utils import GiB_bytes
from vllm.v1.worker.gpu_worker import (Worker,
                                       init_worker_distributed_environment)

from vllm_ascend import device
from vllm_ascend.worker.model_runner import AscendModelRunner

logger = init_logger(__name__)

# Same default as vLLM's CPU backend when VLLM_CPU_KVCACHE_SPACE is unset.
DEFAULT_CPU_KV_CACHE_GIB = 4


class AscendWorker(Worker):

    def init_device(self) -> None:
        choice = device.current()
        if choice.is_npu:
            self.device = torch.device(f"npu:{self.local_rank}")
        else:
            self.device = torch.device("cpu")
        current_platform.set_device(self.device)
        if self.model_config.dtype not in current_platform.supported_dtypes:
            raise ValueError(
                f"dtype {self.model_config.dtype} is not supported on "
                f"{choice.device_type}; use one of "
                f"{current_platform.supported_dtypes}.")
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method,
                                            self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        if choice.is_npu:
            gc.collect()
            torch.npu.empty_cache()
            self.init_free_memory, self.total_memory = torch.npu.mem_get_info()
        self.model_runner: AscendModelRunner = AscendModelRunner(
            self.vllm_config, self.device)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        # The profile run exercises the largest batch (and the drafter) on
        # both devices, so a shape problem shows up here, before serving.
        on_npu = device.current().is_npu
        if on_npu:
            torch.npu.reset_peak_memory_stats()
        self.model_runner.profile_run()
        if self.cache_config.kv_cache_memory_bytes:
            return self.cache_config.kv_cache_memory_bytes
        if not on_npu:
            return self._cpu_kv_cache_bytes()
        peak = torch.npu.max_memory_allocated()
        requested = self.total_memory * self.cache_config.gpu_memory_utilization
        used_by_others = self.total_memory - self.init_free_memory
        available = int(requested - used_by_others - peak)
        logger.info("Available KV cache memory: %.2f GiB (peak %.2f GiB)",
                    available / GiB_bytes, peak / GiB_bytes)
        return available

    def _cpu_kv_cache_bytes(self) -> int:
        space = envs.VLLM_CPU_KVCACHE_SPACE
        if space is not None:
            return int(space * GiB_bytes)
        # Unset: vLLM's CPU default, but never more than max_num_seqs
        # full-length sequences can use (draft layers included).
        specs = self.model_runner.get_kv_cache_spec().values()
        block_size = self.cache_config.block_size
        blocks_per_seq = -(-self.model_config.max_model_len // block_size)
        needed = (self.scheduler_config.max_num_seqs * blocks_per_seq *
                  sum(spec.page_size_bytes for spec in specs))
        space_bytes = min(DEFAULT_CPU_KV_CACHE_GIB * GiB_bytes, needed)
        logger.info_once(
            "VLLM_CPU_KVCACHE_SPACE is unset: %.3f GiB of KV cache on the CPU "
            "reference device (enough for max_num_seqs full-length "
            "sequences, at most %d GiB).", space_bytes / GiB_bytes,
            DEFAULT_CPU_KV_CACHE_GIB)
        return int(space_bytes)

    def compile_or_warm_up_model(self) -> None:
        if device.current().is_npu:
            super().compile_or_warm_up_model()
            return
        # No graphs on the CPU reference device: one warm-up step of the
        # largest decode batch, then a clean random state.
        max_num_reqs = min(self.scheduler_config.max_num_seqs,
                           self.scheduler_config.max_num_batched_tokens)
        _, last_hidden_states = self.model_runner._dummy_run(
            num_tokens=max_num_reqs, skip_eplb=True)
        self.model_runner._dummy_sampler_run(hidden_states=last_hidden_states)
        set_random_seed(self.model_config.seed)

    def sleep(self, level: int = 1) -> None:
        logger.warning("Sleep mode is not supported by vllm_ascend; ignored.")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        logger.warning("Sleep mode is not supported by vllm_ascend; ignored.")

