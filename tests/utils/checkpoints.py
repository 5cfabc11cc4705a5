"""Random tiny GLM-4.5 checkpoints with any architecture options.

The committed fixture is one configuration; these cover the others (QK norm
off, more dense layers, other expert counts, MTP copies absent) so that the
plugin is tested for GLM-4.5 in general, not for one file.
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, partial_rotary_factor=0.5,
            use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
            max_position_embeddings=1024, num_nextn_predict_layers=1,
            tie_word_embeddings=False)


def write_random_glm45(path: Path, seed: int = 0, mtp_copies: bool = True,
                       **overrides) -> Path:
    """Save a random GLM-4.5 checkpoint with real tensor names, including
    the MTP layer ``model.layers.<num_hidden_layers>.*``."""
    torch.manual_seed(seed)
    config = Glm4MoeConfig(**{**BASE, **overrides}, torch_dtype="float32")
    model = Glm4MoeForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, tensor in state.items():
        if name.endswith("e_score_correction_bias"):
            tensor.normal_(0, 0.1)
    n, hidden = config.num_hidden_layers, config.hidden_size
    if config.num_nextn_predict_layers:
        mtp = f"model.layers.{n}."
        # The MTP block is a MoE decoder layer like the last main one.
        last = f"model.layers.{n - 1}."
        for name in list(state):
            if name.startswith(last):
                state[name.replace(last, mtp)] = torch.randn_like(
                    state[name]) * 0.05 + state[name]
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            state[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
        state[f"{mtp}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
        if mtp_copies:
            state[f"{mtp}embed_tokens.weight"] = state[
                "model.embed_tokens.weight"].clone()
            state[f"{mtp}shared_head.head.weight"] = state[
                "lm_head.weight"].clone()
    path.mkdir(parents=True, exist_ok=True)
    config.architectures = ["Glm4MoeForCausalLM"]
    config.save_pretrained(path)
    save_file({k: v.contiguous()
               for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
