"""MC2 on the NPU: torch_npu's fused dispatch and combine kernels.

``npu_moe_distribute_dispatch_v2`` sends each (token, expert) pair to the
rank that holds the expert and hands over the rows it received grouped by
local expert; the layer's grouped MLP runs them;
``npu_moe_distribute_combine_v2`` sends the results back and sums them
with the routing weights. Shapes are static (``global_bs`` fixes the
buffers), so the kernels run inside captured graphs.

The kernels take fewer configurations than the exchange in torch
(``mc2.py``). Their limits are those of op-plugin 7.2.0, the version
torch-npu 2.8.0 ships (CANN 8.3.RC1): ``docs/context/torch_npu-npu_moe_
distribute_dispatch_v2.md`` and ``..._combine_v2.md`` (cited below as
dispatch_v2.md / combine_v2.md with their lines). ``unsupported_reason``
checks them once at startup; outside them MC2 runs the torch exchange, and
the log line says why. The arguments per SoC are those hardware-proven
code passes (vllm-ascend 0.11): the TP-domain arguments only on Atlas A3,
``expert_scales`` only to the Atlas A2 hierarchical algorithm.
"""

import os
from typing import Optional

import torch
from vllm.distributed import get_ep_group
from vllm.logger import init_logger

from vllm_ascend import device
from vllm_ascend.distributed.moe_comm.base import GroupedMLP

logger = init_logger(__name__)

# Atlas A2 EP sizes: fullmesh, hierarchy (dispatch_v2.md:97-99,
# combine_v2.md:63-65). Atlas A3: [2, 768] (dispatch_v2.md:100).
A2_EP_SIZES = (16, 32, 64, 128, 256)
A2_HIERARCHY_EP_SIZES = (16, 32, 64)
A3_EP_RANGE = (2, 768)
# moe_expert_num / (ep_world_size - shared_expert_rank_num) on Atlas A2
# (dispatch_v2.md:104, combine_v2.md:70); not required by the hierarchy
# algorithm (dispatch_v2.md:221).
A2_MAX_EXPERTS_PER_RANK = 24


def soc_family(soc_version: int) -> Optional[str]:
    """torch_npu's SoC code: Atlas A2 (Ascend910B) or A3 (Ascend910_93)."""
    if 220 <= soc_version <= 225:
        return "A2"
    if 250 <= soc_version <= 255:
        return "A3"
    return None


def a2_hierarchical() -> bool:
    """With ``comm_alg`` "" (the plugin's) the Atlas A2 kernels run the
    hierarchy algorithm when HCCL_INTRA_PCIE_ENABLE=1 and
    HCCL_INTRA_ROCE_ENABLE=0, fullmesh otherwise (dispatch_v2.md:150)."""
    return (os.environ.get("HCCL_INTRA_PCIE_ENABLE") == "1"
            and os.environ.get("HCCL_INTRA_ROCE_ENABLE") == "0")


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
    hierarchical = family == "A2" and a2_hierarchical()
    if family == "A2":
        sizes = A2_HIERARCHY_EP_SIZES if hierarchical else A2_EP_SIZES
        if ep_size not in sizes:
            return (f"EP size {ep_size} is not one of {sizes} on Atlas A2 "
                    f"({'hierarchy' if hierarchical else 'fullmesh'}, "
                    "op-plugin 7.2.0)")
    elif not A3_EP_RANGE[0] <= ep_size <= A3_EP_RANGE[1]:
        return f"EP size {ep_size} is outside {list(A3_EP_RANGE)} on Atlas A3"
    # dispatch_v2.md:103
    if not 1 <= experts <= 1024 or experts % ep_size:
        return (f"{experts} routed experts: the kernels take 1-1024, "
                f"divisible by the EP size {ep_size}")
    if (family == "A2" and not hierarchical
            and experts // ep_size > A2_MAX_EXPERTS_PER_RANK):
        return (f"{experts // ep_size} experts per rank ({experts} / EP "
                f"{ep_size}) exceed the {A2_MAX_EXPERTS_PER_RANK} of Atlas "
                "A2 (fullmesh, op-plugin 7.2.0)")
    # dispatch_v2.md:207
    if not 0 < top_k <= min(16, experts):
        return f"top-k {top_k} is outside (0, 16]"
    # dispatch_v2.md:198-201 (the hierarchy algorithm's larger bound needs
    # a driver of 25.0.RC1.1 or later, :200: the fullmesh one is kept).
    if family == "A2" and (hidden > 7168 or hidden % 32):
        return (f"hidden size {hidden} is not a multiple of 32 up to 7168 "
                "(Atlas A2)")
    if family == "A3" and not 1024 <= hidden <= 8192:
        return f"hidden size {hidden} is outside [1024, 8192] (Atlas A3)"
    # dispatch_v2.md:203-205
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

    def __init__(self, max_bs: int, family: str,
                 hierarchical: bool = False):
        self.max_bs = max_bs
        self.a3 = family == "A3"
        # expert_scales feeds only Atlas A2's hierarchical scheme
        # (op-plugin 7.2.0 MoeDistributeDispatchV2KernelOpApi.cpp:149-153
        # sizes ep_recv_counts for it); A3 takes none (dispatch_v2.md:115).
        self.send_scales = family == "A2" and hierarchical
        self._comm_name = ""

    def comm_name(self) -> str:
        """The EP group's HCCL communicator name (``group_ep``). Asking for
        it creates the communicator (and its HCCL buffer): ``create`` does
        it at configuration, before the KV cache is sized, as vllm-ascend
        v0.11.0's MC2 dispatcher does in its ``__init__``
        (``token_dispatcher.py:86-91``)."""
        if not self._comm_name:
            ep = get_ep_group()
            backend = ep.device_group._get_backend(
                torch.device(device.tensor_device_type()))
            self._comm_name = backend.get_hccl_comm_name(ep.rank_in_group)
        return self._comm_name

    def experts(self, x: torch.Tensor, share: slice,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, grouped: GroupedMLP) -> torch.Tensor:
        """``x``'s rows ``share`` through the experts (``exchange.
        tp_share``); zeros elsewhere. For int8 experts the dispatch
        quantizes each token (quant_mode=2, dispatch_v2.md:143): int8 rows
        and their float32 scales travel, half the bytes of bfloat16, as
        vllm-ascend v0.11.0 sends its W8A8 tokens
        (``token_dispatcher.py:124``)."""
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
        # No TP domain. Atlas A2 takes none: group_tp "", tp_world_size 0
        # (dispatch_v2.md:119-128, combine_v2.md:102-111). Atlas A3 reads
        # tp_world_size 1 as none (dispatch_v2.md:125) and is passed it
        # with the EP group's name, as vllm-ascend does.
        tp = dict(group_tp=self.comm_name(), tp_world_size=1,
                  tp_rank_id=0) if self.a3 else {}
        int8 = grouped.takes_int8
        (expand_x, row_scales, assist, group_ends, recv_counts, tp_counts,
         expand_scales) = torch_npu.npu_moe_distribute_dispatch_v2(
             x[send],
             ids,
             expert_scales=weights if self.send_scales else None,
             quant_mode=2 if int8 else 0,
             expert_token_nums_type=0,
             **common,
             **tp)
        y = grouped(expand_x, group_ends, row_scales if int8 else None)
        # Atlas A2 combine requires the dispatch's expand_scales
        # (combine_v2.md:82-84), with or without expert_scales; its
        # tp_send_counts keeps the default None (combine_v2.md:72-74): the
        # dispatch's tp_recv_counts has tp_world_size elements, none here.
        rows = torch_npu.npu_moe_distribute_combine_v2(
            y,
            ids,
            assist,
            recv_counts,
            weights,
            tp_send_counts=tp_counts if self.a3 else None,
            expand_scales=None if self.a3 else expand_scales,
            **common,
            **tp)
        out = torch.zeros_like(x)
        if share.stop > share.start:
            out[share] = rows
        return out


def device_family() -> Optional[str]:
    """This NPU's family ("A2", "A3"); None on the CPU reference device."""
    if not device.npu_kernels():
        return None
    return soc_family(torch.npu.get_soc_version())


def create(vllm_config, capacity: int) -> Optional[FusedMC2Kernels]:
    """The fused kernels when this NPU and configuration take them (logged
    once per process either way), their EP communicator created; None on
    the CPU reference device."""
    if not device.npu_kernels():
        return None
    import torch_npu
    family = device_family()
    reason = unsupported_reason(vllm_config, capacity, family)
    if reason is None and not hasattr(torch_npu,
                                      "npu_moe_distribute_dispatch_v2"):
        reason = "this torch_npu has no npu_moe_distribute_dispatch_v2"
    if reason is not None:
        logger.info("MC2: the torch exchange (all_to_all_single), not the "
                    "fused kernels: %s", reason)
        return None
    assert family is not None
    hierarchical = family == "A2" and a2_hierarchical()
    logger.info("MC2: fused npu_moe_distribute_dispatch_v2/combine_v2 "
                "kernels (Atlas %s%s)", family,
                ", hierarchy" if hierarchical else "")
    kernels = FusedMC2Kernels(
        max_tokens_per_rank(capacity,
                            vllm_config.parallel_config.tensor_parallel_size),
        family, hierarchical)
    kernels.comm_name()
    return kernels
