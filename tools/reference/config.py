"""GLM-4.5's ``config.json``: the key set of the published checkpoint, at the
tiny fixture's sizes (``tests/fixtures/build_tiny_glm45.py``); the rehearsal
(``tools/dev/rehearsal/depth.py``) overrides the shape with GLM-4.5's own."""

import json
from pathlib import Path
from typing import Any

from . import corpus


def glm45_config(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """GLM-4.5's config.json key set, tiny sizes."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": ids[corpus.EOS],
        "eos_token_id": [ids[corpus.EOS], ids[corpus.USER]],
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": vocab_size,
    }


def write_config_files(out: Path, config: dict[str, Any]) -> None:
    """``config.json`` and the ``generation_config.json`` that goes with
    it."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "_from_model_config": True,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "transformers_version": config["transformers_version"],
    }, indent=2) + "\n")
