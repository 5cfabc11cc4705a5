"""The plugin's device communicator.

vLLM's base class runs every collective with torch.distributed on the
group's device backend (HCCL on an NPU, gloo on the CPU reference device);
only the MoE dispatch and combine are ours: they follow the MoE
communication method of the step (``moe_comm``); the all-gather method's
exchange is an all-gather and a reduce-scatter, not vLLM's naive manager
(a broadcast per DP rank, which ACL graphs are not shown to capture).
Without data parallelism vLLM does not call them.
"""

import torch
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase)
from vllm.distributed.parallel_state import get_dp_group
from vllm.forward_context import get_forward_context

from vllm_ascend.distributed import moe_comm


class AscendCommunicator(DeviceCommunicatorBase):

    def dispatch(
            self,
            hidden_states: torch.Tensor,
            router_logits: torch.Tensor,
            is_sequence_parallel: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_all2all:
            return hidden_states, router_logits
        if not is_sequence_parallel:
            _check_synced_count(hidden_states.shape[0])
        return moe_comm.current(hidden_states.shape[0]).dispatch(
            self, hidden_states, router_logits, is_sequence_parallel)

    def combine(self,
                hidden_states: torch.Tensor,
                is_sequence_parallel: bool = False) -> torch.Tensor:
        if not self.use_all2all:
            return hidden_states
        return moe_comm.current(hidden_states.shape[0]).combine(
            self, hidden_states, is_sequence_parallel)


def _check_synced_count(num_tokens: int) -> None:
    """The rows this rank dispatches must be the count it told the other DP
    ranks: the gather and the scatter back are sized from the synced
    counts. A draft whose context carries another count (its synced count
    vs its real length, or padding added after the sync) would otherwise
    exchange rows of the wrong tokens, or fail on a shape far from here."""
    dp_metadata = get_forward_context().dp_metadata
    if dp_metadata is None:
        return
    rank = get_dp_group().rank_in_group
    synced = int(dp_metadata.num_tokens_across_dp_cpu[rank])
    if num_tokens != synced:
        raise RuntimeError(
            f"MoE dispatch on DP rank {rank}: {num_tokens} token rows, but "
            f"the forward context synced {synced} for this rank "
            f"(all ranks: {dp_metadata.num_tokens_across_dp_cpu.tolist()}); "
            "the forward context must be set with the rows the model runs.")
