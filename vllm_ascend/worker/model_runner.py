"""The plugin's model runner: vLLM's GPU model runner on an NPU or the CPU.

Everything device-neutral (input preparation, the persistent batch, KV-cache
binding, sampling, speculative decoding bookkeeping) is vLLM's. This class
only swaps what needs a device: streams and events, synchronization, the
rejection sampler (vLLM's is triton-only) and the MTP proposer.
"""

from typing import Optional

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ascend import device
from vllm_ascend.sample import AscendRejectionSampler
from vllm_ascend.spec_decode.mtp_proposer import make_proposer
from vllm_ascend.worker.streams import device_streams

logger = init_logger(__name__)


class AscendModelRunner(GPUModelRunner):

    def __init__(self, vllm_config: VllmConfig, torch_device: torch.device):
        with device_streams():
            super().__init__(vllm_config, torch_device)
        self.cascade_attn_enabled = False
        if hasattr(self, "rejection_sampler"):
            self.rejection_sampler = AscendRejectionSampler()
        if isinstance(getattr(self, "drafter", None), EagleProposer):
            self.drafter = make_proposer(vllm_config, torch_device, self)

    def get_dp_padding(self,
                       num_tokens: int) -> tuple[int, Optional[torch.Tensor]]:
        # DP ranks pad to the largest batch so that they replay the same
        # graph size. Without graphs (the CPU reference device, eager) each
        # rank runs its own count, as vLLM does under enforce_eager, and the
        # forward context gathers the counts for the MoE dispatch. vLLM
        # 0.11's _dummy_run would otherwise tell the MoE layer it has the
        # padded count while feeding it the unpadded one.
        if (self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
                or not device.current().is_npu):
            return 0, None
        return super().get_dp_padding(num_tokens)

    def _init_device_properties(self) -> None:
        pass

    def _sync_device(self) -> None:
        if device.current().is_npu:
            torch.npu.synchronize()
