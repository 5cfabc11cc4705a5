"""The plugin's device communicator.

vLLM's base class runs every collective with torch.distributed on the
group's device backend (HCCL on an NPU, gloo on the CPU reference device);
only the MoE dispatch and combine are ours: they follow the MoE
communication method of the step (``moe_comm``). Without data parallelism
vLLM does not call them.
"""

from typing import Optional

import torch
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.all2all import NaiveAll2AllManager
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase)

from vllm_ascend.distributed import moe_comm


class AscendCommunicator(DeviceCommunicatorBase):

    def __init__(self,
                 cpu_group: ProcessGroup,
                 device: Optional[torch.device] = None,
                 device_group: Optional[ProcessGroup] = None,
                 unique_name: str = ""):
        super().__init__(cpu_group, device, device_group, unique_name)
        if self.use_all2all:
            # The all-gather method's token exchange: vLLM's naive manager
            # (broadcast per DP rank, all-reduce), which any backend runs.
            self.all2all_manager = NaiveAll2AllManager(self.cpu_group)

    def dispatch(
            self,
            hidden_states: torch.Tensor,
            router_logits: torch.Tensor,
            is_sequence_parallel: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_all2all:
            return hidden_states, router_logits
        return moe_comm.current(hidden_states.shape[0]).dispatch(
            self, hidden_states, router_logits, is_sequence_parallel)

    def combine(self,
                hidden_states: torch.Tensor,
                is_sequence_parallel: bool = False) -> torch.Tensor:
        if not self.use_all2all:
            return hidden_states
        return moe_comm.current(hidden_states.shape[0]).combine(
            self, hidden_states, is_sequence_parallel)
