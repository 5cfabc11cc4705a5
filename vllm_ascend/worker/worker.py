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
from vllm_ascend.distributed import moe_comm
from vllm_ascend.worker.model_runner import (AscendModelRunner,
                                             CpuReferenceModelRunner,
                                             NpuModelRunner)

logger = init_logger(__name__)

# Same default as vLLM's CPU backend when VLLM_CPU_KVCACHE_SPACE is unset.
DEFAULT_CPU_KV_CACHE_GIB = 4


def _non_torch_memory(free: int, total: int) -> int:
    """Device memory in use that torch's allocator does not hold."""
    return total - free - torch.npu.memory_reserved()


class AscendWorker(Worker):
    """vLLM's GPU worker with the device parts in one subclass per device
    (``NpuWorker``, ``CpuReferenceWorker``)."""

    model_runner_cls: type[AscendModelRunner] = AscendModelRunner

    def init_device(self) -> None:
        self.device = device.tensor_device(self.local_rank)
        self.select_device()
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method,
                                            self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        # Before the memory baseline and the KV sizing: the MoE
        # communication creates the EP communicator MC2 uses (its HCCL
        # buffer), and the first ATB op its workspace.
        moe_comm.configure(self.vllm_config)
        self.warm_up()
        self.record_memory_at_start()
        self.model_runner: AscendModelRunner = self.model_runner_cls(
            self.vllm_config, self.device)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        # The profile run exercises the largest batch (and the drafter) on
        # both devices, so a shape problem shows up here, before serving.
        self.release_cached_memory()
        self.model_runner.profile_run()
        if self.cache_config.kv_cache_memory_bytes:
            return self.cache_config.kv_cache_memory_bytes
        return self.kv_cache_bytes()

    def select_device(self) -> None:
        pass

    def warm_up(self) -> None:
        pass

    def record_memory_at_start(self) -> None:
        pass

    def release_cached_memory(self) -> None:
        pass

    def kv_cache_bytes(self) -> int:
        raise NotImplementedError

    def sleep(self, level: int = 1) -> None:
        logger.warning("Sleep mode is not supported by vllm_ascend; ignored.")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        logger.warning("Sleep mode is not supported by vllm_ascend; ignored.")


class NpuWorker(AscendWorker):
    model_runner_cls = NpuModelRunner

    def select_device(self) -> None:
        torch.npu.set_device(self.local_rank)

    def warm_up(self) -> None:
        """One small ATB op, so that ATB's first-use set-up (its workspace)
        happens before the KV cache is sized, not in the first served step:
        what vllm-ascend v0.11.0's ``_warm_up_atb`` does (worker_v1.py:
        330-341). The op is the ATB kernel every step runs first
        (ReshapeAndCache), on a one-slot cache."""
        import torch_npu

        # One token, one head of 128, into one block of 128 slots: the
        # shapes the attention runs (bfloat16, head dim and block size 128).
        key = torch.zeros((1, 1, 128), dtype=torch.bfloat16,
                          device=self.device)
        cache = torch.zeros((1, 128, 1, 128), dtype=torch.bfloat16,
                            device=self.device)
        slots = torch.zeros(1, dtype=torch.int32, device=self.device)
        torch_npu._npu_reshape_and_cache(key, key, cache, cache.clone(),
                                         slots)
        torch.npu.synchronize()

    def record_memory_at_start(self) -> None:
        gc.collect()
        torch.npu.empty_cache()
        self.init_free_memory, self.total_memory = torch.npu.mem_get_info()
        self.init_non_torch_memory = _non_torch_memory(
            self.init_free_memory, self.total_memory)

    def release_cached_memory(self) -> None:
        gc.collect()
        torch.npu.empty_cache()
        torch.npu.reset_peak_memory_stats()

    def kv_cache_bytes(self) -> int:
        """What is left of ``gpu_memory_utilization`` of the NPU after what
        was in use at start-up, the profile run's torch peak, and memory
        that appeared outside torch's allocator since (HCCL buffers, the
        ATB and aclnn workspaces, allocated on first use)."""
        free, total = torch.npu.mem_get_info()
        peak = torch.npu.max_memory_allocated()
        non_torch = (_non_torch_memory(free, total) -
                     self.init_non_torch_memory)
        requested = total * self.cache_config.gpu_memory_utilization
        used_at_start = total - self.init_free_memory
        available = int(requested - used_at_start - peak - non_torch)
        logger.info(
            "Available KV cache memory: %.2f GiB (of %.2f GiB requested: "
            "%.2f GiB in use at start, %.2f GiB torch peak, %.2f GiB "
            "outside torch).", available / GiB_bytes, requested / GiB_bytes,
            used_at_start / GiB_bytes, peak / GiB_bytes,
            non_torch / GiB_bytes)
        if available <= 0:
            raise ValueError(
                f"No NPU memory is left for the KV cache "
                f"({available / GiB_bytes:.2f} GiB): raise "
                "--gpu-memory-utilization "
                f"({self.cache_config.gpu_memory_utilization}), lower "
                "--max-num-batched-tokens or --max-num-seqs, or set "
                "--kv-cache-memory.")
        return available


class CpuReferenceWorker(AscendWorker):
    model_runner_cls = CpuReferenceModelRunner

    def kv_cache_bytes(self) -> int:
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
