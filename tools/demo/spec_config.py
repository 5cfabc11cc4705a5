"""Show that the patched vLLM resolves the GLM-4.5 MTP speculative method.

Writes a small GLM-4.5 config and parses the speculative config the way
``vllm serve --speculative-config '{"method": "glm4_moe_mtp", ...}'`` does.
"""

import json
import tempfile
from pathlib import Path

from vllm.config import ModelConfig, ParallelConfig
from vllm.config.speculative import SpeculativeConfig

CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256,
    "num_nextn_predict_layers": 1, "torch_dtype": "float32",
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        spec = SpeculativeConfig(
            target_model_config=ModelConfig(model=tmp, dtype="float32"),
            target_parallel_config=ParallelConfig(),
            method="glm4_moe_mtp", num_speculative_tokens=1)
        draft = spec.draft_model_config.hf_config
        print(f"method=glm4_moe_mtp -> {spec.method}, draft "
              f"{draft.architectures[0]} ({draft.model_type}), "
              f"{spec.num_speculative_tokens} speculative token(s)")


if __name__ == "__main__":
    main()
