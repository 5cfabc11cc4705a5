"""The MTP proposer for GLM-4.5 on the Ascend path.

vLLM's EAGLE/MTP proposer already runs the draft in the target's KV cache
group (same block tables and slot mapping) and, with the series' patch 0005,
points the draft at the target's embedding and LM head. This subclass is
what the plugin selects for a GLM-4.5 MTP draft, whichever method name
(``glm4_moe_mtp`` or ``mtp``) asked for it, and reports what it shares.
"""

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_ascend.spec_decode.draft_graphs import (DraftGraphWrapper,
                                                  capture_draft_graphs,
                                                  draft_graphs_enabled)

logger = init_logger(__name__)

GLM4_MOE_MTP_ARCH = "Glm4MoeMTPModel"
# The one MTP layer is applied k times; 1 to 3 is what is tested and what
# GLM-4.5's head predicts usefully (acceptance falls with each step).
MAX_MTP_SPECULATIVE_TOKENS = 3


def check_mtp_config(vllm_config: VllmConfig) -> None:
    """Reject, at startup, a GLM-4.5 MTP setting the plugin does not run."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return
    arch = spec.draft_model_config.hf_config.architectures[0]
    if (arch == GLM4_MOE_MTP_ARCH
            and spec.num_speculative_tokens > MAX_MTP_SPECULATIVE_TOKENS):
        raise ValueError(
            f"num_speculative_tokens={spec.num_speculative_tokens} is more "
            f"than vllm_ascend supports for GLM-4.5 MTP (1 to "
            f"{MAX_MTP_SPECULATIVE_TOKENS}); lower it in --speculative-config.")


def shared_with_target(draft: torch.nn.Module,
                       target: torch.nn.Module) -> list[str]:
    """The target modules a GLM-4.5 MTP draft runs on (patch 0005): its
    embedding, and its LM head when every MTP layer's head is it."""
    shared = []
    if draft.model.embed_tokens is getattr(target.model, "embed_tokens",
                                           None):
        shared.append("embed_tokens")
    heads = {
        id(layer.shared_head.head)
        for layer in draft.model.layers.values()
    }
    if heads == {id(getattr(target, "lm_head", None))}:
        shared.append("lm_head")
    return shared


class AscendMtpProposer(EagleProposer):
    """Drafts with the GLM-4.5 MTP layer, applied ``k`` times."""

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        shared = shared_with_target(self.model, target_model)
        graphs = self.use_cuda_graph and draft_graphs_enabled(self.vllm_config)
        if graphs:
            self.model = DraftGraphWrapper(self.model, self.vllm_config)
        logger.info(
            "GLM-4.5 MTP draft: %d attention layer(s) %s in the target's KV "
            "cache group; shares the target's %s; runs %s.",
            len(self.attn_layer_names), self.attn_layer_names,
            " and ".join(shared) or "nothing",
            "full graphs" if graphs else "eager")

    def capture_graphs(self) -> int:
        """Capture the draft's graphs (after the target's); the bytes of
        their pool."""
        if not isinstance(self.model, DraftGraphWrapper):
            return 0
        return capture_draft_graphs(self)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """Run the draft as a rank without requests must under DP.

        ``propose`` runs the MTP layer ``k`` times (once over the scheduled
        tokens, then once per further draft token), and each run makes
        collectives across the DP ranks (the token counts, the MoE
        dispatch and combine). A rank that only has a dummy batch must make
        as many, or the ranks pair up different calls and hang or mix
        tokens; vLLM's dummy run makes one.
        """
        super().dummy_run(num_tokens)
        if self.vllm_config.parallel_config.data_parallel_size == 1:
            return
        for _ in range(self.num_speculative_tokens - 1):
            super().dummy_run(
                min(num_tokens, self.vllm_config.scheduler_config.max_num_seqs))


def make_proposer(vllm_config: VllmConfig, device: torch.device,
                  runner) -> EagleProposer:
    """The proposer for this draft: ours for GLM-4.5 MTP, else vLLM's."""
    spec = vllm_config.speculative_config
    arch = spec.draft_model_config.hf_config.architectures[0]
    if arch == GLM4_MOE_MTP_ARCH:
        return AscendMtpProposer(vllm_config, device, runner)
    return EagleProposer(vllm_config, device, runner)
