"""The MTP proposer for GLM-4.5 on the Ascend path."""

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.eagle import EagleProposer

logger = init_logger(__name__)


class AscendMtpProposer(EagleProposer):
    """vLLM's EAGLE/MTP proposer, drafting with the GLM-4.5 MTP layer."""


def make_proposer(vllm_config: VllmConfig, device: torch.device,
                  runner) -> EagleProposer:
    return AscendMtpProposer(vllm_config, device, runner)
