"""The plugin's model runners: vLLM's GPU model runner on an NPU or the CPU.

Everything device-neutral (input preparation, the persistent batch, KV-cache
binding, sampling, speculative decoding bookkeeping) is vLLM's.
``AscendModelRunner`` swaps what both devices need (the rejection sampler,
vLLM's is triton-only, the MTP proposer and the MoE method per step); one
subclass per device holds its streams, synchronization and graphs.
"""

import contextlib
import time
from typing import TYPE_CHECKING, Optional, Union

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed.parallel_state import graph_capture
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ascend.compilation import stream_budget
from vllm_ascend.compilation.graph_mode import budget_of
from vllm_ascend.compilation.graph_wrapper import graph_stats
from vllm_ascend.distributed import moe_comm
from vllm_ascend.ops import weight_format
from vllm_ascend.sample import AscendRejectionSampler
from vllm_ascend.spec_decode.mtp_proposer import make_proposer
from vllm_ascend.worker.streams import cpu_streams, use_npu_streams

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)


class AscendModelRunner(GPUModelRunner):

    def __init__(self, vllm_config: VllmConfig, torch_device: torch.device):
        with self.device_streams():
            super().__init__(vllm_config, torch_device)
        self.cascade_attn_enabled = False
        if hasattr(self, "rejection_sampler"):
            self.rejection_sampler = AscendRejectionSampler()
        if isinstance(getattr(self, "drafter", None), EagleProposer):
            self.drafter = make_proposer(vllm_config, torch_device, self)
        self._drafted = False
        self._drafts_under_dp = (
            isinstance(getattr(self, "drafter", None), EagleProposer)
            and self.parallel_config.data_parallel_size > 1)

    def execute_model(
        self,
        scheduler_output: "SchedulerOutput",
        intermediate_tensors: Optional[IntermediateTensors] = None,
    ) -> Union[ModelRunnerOutput, AsyncModelRunnerOutput,
               IntermediateTensors]:
        self._drafted = False
        moe_comm.begin_step()
        output = super().execute_model(scheduler_output, intermediate_tensors)
        if (self._drafts_under_dp and not self._drafted
                and scheduler_output.total_num_scheduled_tokens > 0):
            # vLLM skips the draft in a step where a request would pass
            # max_model_len; the other DP ranks may be drafting, and their
            # draft's collectives must be matched.
            self.drafter.dummy_run(1)
        return output

    def _dummy_run(self, *args, **kwargs):
        # A step of its own (an idle DP rank's, a capture's, the profile
        # run's): its MoE layers choose their communication method anew.
        moe_comm.begin_step()
        return super()._dummy_run(*args, **kwargs)

    def propose_draft_token_ids(self, *args, **kwargs):
        self._drafted = True
        return super().propose_draft_token_ids(*args, **kwargs)

    def device_streams(self) -> contextlib.AbstractContextManager:
        """What ``torch.cuda``'s stream and event API is while vLLM's
        runner is built."""
        raise NotImplementedError

    def _init_device_properties(self) -> None:
        pass


class NpuModelRunner(AscendModelRunner):
    """On the NPU: its streams, its synchronization and its graphs (vLLM
    captures them with the platform's wrapper, patch 0010)."""

    def __init__(self, vllm_config: VllmConfig, torch_device: torch.device):
        # Before the weights load: they are cast to NZ (ops.weight_format).
        weight_format.allow_internal_formats()
        super().__init__(vllm_config, torch_device)

    def device_streams(self) -> contextlib.AbstractContextManager:
        use_npu_streams()
        return contextlib.nullcontext()

    def get_dp_padding(self,
                       num_tokens: int) -> tuple[int, Optional[torch.Tensor]]:
        # DP ranks pad to the largest batch so that they replay the same
        # graph size. Eager, each rank runs its own count, as vLLM does
        # under enforce_eager, and the forward context gathers the counts
        # for the MoE dispatch. vLLM 0.11's _dummy_run would otherwise tell
        # the MoE layer it has the padded count while feeding it the
        # unpadded one.
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            return 0, None
        return super().get_dp_padding(num_tokens)

    def capture_model(self) -> int:
        """vLLM's capture of every size, then the MTP draft's graphs; the
        bytes the graph pools took."""
        start = time.perf_counter()
        graph_bytes = super().capture_model()
        capture_draft = getattr(getattr(self, "drafter", None),
                                "capture_graphs", None)
        if capture_draft is not None:
            # As vLLM's captures: on a side stream (NPU graphs cannot be
            # captured on the default one) that first waits for the work
            # queued on the current stream.
            with graph_capture(device=self.device):
                graph_bytes += capture_draft()
        graph_stats.capture_seconds = time.perf_counter() - start
        graphs = sum(graph_stats.captured.values())
        spec = self.vllm_config.speculative_config
        budget = budget_of(self.vllm_config,
                           spec.num_speculative_tokens if spec else 0)
        logger.info(
            "Captured %d graph(s) for %s in %.1f s; graph pool %.2f MiB; "
            "streams %d of %d.", graphs,
            sorted({key[2] for key in graph_stats.captured}, reverse=True),
            graph_stats.capture_seconds, graph_bytes / (1 << 20),
            budget.streams_taken(graphs), stream_budget.NPU_STREAMS)
        return graph_bytes

    def _sync_device(self) -> None:
        torch.npu.synchronize()


class CpuReferenceModelRunner(AscendModelRunner):
    """On the CPU reference device: eager, as vLLM's CPU runner."""

    def device_streams(self) -> contextlib.AbstractContextManager:
        return cpu_streams()

    def get_dp_padding(self,
                       num_tokens: int) -> tuple[int, Optional[torch.Tensor]]:
        # Eager: each DP rank runs its own count (see NpuModelRunner).
        return 0, None

    def _sync_device(self) -> None:
        pass
