"""MC2 on the NPU: torch_npu's fused dispatch and combine kernels.

``npu_moe_distribute_dispatch_v2`` sends each (token, expert) pair to the
rank that holds the expert and hands over the rows it received grouped by
local expert; the layer's grouped MLP runs them;
``npu_moe_distribute_combine_v2`` sends the results back and sums them
with the routing weights. Shapes are static (``global_bs`` fixes the
buffers), so the kernels run inside captured graphs.

The kernels take fewer configurations than the exchange in torch
(``mc2.py``): op-plugin's documented limits (master 517f2e7,
``torch_npu-npu_moe_distribute_dispatch_v2.md``, fullmesh algorithm) are
checked once at startup by ``unsupported_reason``; outside them MC2 runs
the torch exchange, and the log line says why.
"""

from typing import Optional

import torch
import torch.distributed as dist
from vllm.distributed import get_ep_group
from vllm.logger import init_logger

from vllm_ascend import device
from vllm_ascend.distributed.moe_comm.base import GroupedFn
from vllm_ascend.ops._backend import use_npu

logger = init_logger(__name__)

A2_EP_SIZES = (2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256)


def soc_family(soc_version: int) -> Optional[str]:
    """torch_npu's SoC code: Atlas A2 (Ascend910B) or A3 (Ascend910_93)."""
    if 220 <= soc_version <= 225:
        return "A2"
    if 250 <= soc_version <= 255:
        return "A3"
    return None


def max_tokens_per_rank(capacity: int, tp_size: int) -> int:
    """Rows one EP rank sends: its TP share of the DP rank's batch."""
    return -(-capacity // tp_size)


def unsupported_reason(vllm_config, capacity: int,
                       family: Optional[str]) -> Optional[str]:
    """Why the fused kernels cannot run this configuration, or None."""
    if family is None:
        return "the SoC is neither Atlas A2 nor A3"
    parallel = vllm_config.parallel_config
    hf = vllm_config.model_config.hf_text_config
    ep_size = parallel.data_parallel_size * parallel.tensor_parallel_size
    experts = getattr(hf, "n_routed_experts", None) or getattr(
        hf, "num_experts", 0)
    top_k = getattr(hf, "num_experts_per_tok", 0)
    hidden = hf.hidden_size
    max_bs = max_tokens_per_rank(capacity, parallel.tensor_parallel_size)
    if family == "A2" and ep_size not in A2_EP_SIZES:
        return f"EP size {ep_size} is not one of {A2_EP_SIZES} on Atlas A2"
    if family == "A3" and not 2 <= ep_size <= 768:
        return f"EP size {ep_size} is outside [2, 768] on Atlas A3"
    if not 1 <= experts <= 1024 or experts % ep_size:
        return (f"{experts} routed experts: the kernels take 1-1024, "
                f"divisible by the EP size {ep_size}")
    if not 0 < top_k <= min(16, experts):
        return f"top-k {top_k} is outside (0, 16]"
    if family == "A2" and (hidden > 7168 or hidden % 32):
        return (f"hidden size {hidden} is not a multiple of 32 up to 7168 "
                "(Atlas A2)")
    if family == "A3" and not 1024 <= hidden <= 8192:
        return f"hidden size {hidden} is outside [1024, 8192] (Atlas A3)"
    limit = 512 if family == "A3" else 256
    if max_bs > limit:
        return (f"{max_bs} tokens per rank (VLLM_ASCEND_MC2_CAPACITY / TP) "
                f"exceed the kernels' {limit}")
    if parallel.enable_eplb:
        return "EPLB places redundant experts the kernels do not know"
    if parallel.expert_placement_strategy != "linear":
        return ("the kernels place experts linearly, not "
                f"{parallel.expert_placement_strategy}")
    return None


class FusedMC2Kernels:
    """One MoE layer's experts through dispatch, grouped MLP, combine."""

    def __init__(self, max_bs: int, family: str):
        self.max_bs = max_bs
        # Atlas A2 exchanges the routing weights with the tokens
        # (expert_scales in, expand_scales out); A3's fullmesh does not.
        self.exchange_scales = family == "A2"
        self._comm_name = ""

    def comm_name(self) -> str:
        """The EP group's HCCL communicator name (``group_ep``)."""
        if not self._comm_name:
            group = get_ep_group().device_group
            backend = group._get_backend(
                torch.device(device.current().torch_device_type))
            self._comm_name = backend.get_hccl_comm_name(dist.get_rank())
        return self._comm_name

    def experts(self, x: torch.Tensor, share: slice,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, grouped: GroupedFn) -> torch.Tensor:
        """``x``'s rows ``share`` through the experts (``exchange.
        tp_share``); zeros elsewhere."""
        import torch_npu
        ep = get_ep_group()
        # The kernels take no empty batch: a TP rank without a share sends
        # its DP rank's first token and drops the result.
        send = share if share.stop > share.start else slice(0, 1)
        ids = topk_ids[send].to(torch.int32)
        weights = topk_weights[send].float()
        common = dict(group_ep=self.comm_name(),
                      ep_world_size=ep.world_size,
                      ep_rank_id=ep.rank_in_group,
                      moe_expert_num=num_experts,
                      global_bs=self.max_bs * ep.world_size)
        (expand_x, _, assist, group_ends, recv_counts, tp_counts,
         expand_scales) = torch_npu.npu_moe_distribute_dispatch_v2(
             x[send],
             ids,
             expert_scales=weights if self.exchange_scales else None,
             expert_token_nums_type=0,
             **common)
        y = grouped(expand_x, group_ends)
        rows = torch_npu.npu_moe_distribute_combine_v2(
            y,
            ids,
            assist,
            recv_counts,
            weights,
            tp_send_counts=tp_counts,
            expand_scales=expand_scales if self.exchange_scales else None,
            **common)
        out = torch.zeros_like(x)
        if share.stop > share.start:
            out[share] = rows
        return out


def create(vllm_config, capacity: int) -> Optional[FusedMC2Kernels]:
    """The fused kernels when this NPU and configuration take them (logged
    once per process either way); None on the CPU reference device."""
    if not use_npu():
        return None
    import torch_npu
    family = soc_family(torch.npu.get_soc_version())
    reason = unsupported_reason(vllm_config, capacity, family)
    if reason is None and not hasattr(torch_npu,
                                      "npu_moe_distribute_dispatch_v2"):
        reason = "this torch_npu has no npu_moe_distribute_dispatch_v2"
    if reason is not None:
        logger.info("MC2: the torch exchange (all_to_all_single), not the "
                    "fused kernels: %s", reason)
        return None
    assert family is not None
    logger.info("MC2: fused npu_moe_distribute_dispatch_v2/combine_v2 "
                "kernels (Atlas %s)", family)
    return FusedMC2Kernels(
        max_tokens_per_rank(capacity,
                            vllm_config.parallel_config.tensor_parallel_size),
        family)
