"""Patch 0001 is necessary: pristine v0.11.0 rejects glm4_moe_mtp."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from vllm.config import ModelConfig, ParallelConfig
from vllm.config.speculative import SpeculativeConfig
try:
    spec = SpeculativeConfig(
        target_model_config=ModelConfig(model=sys.argv[1], dtype="float32"),
        target_parallel_config=ParallelConfig(),
        method="glm4_moe_mtp", num_speculative_tokens=1)
except Exception as exc:
    print("REJECTED", type(exc).__name__, str(exc).replace("\\n", " "))
else:
    print("ACCEPTED", spec.method,
          spec.draft_model_config.hf_config.architectures[0])
"""


@pytest.fixture(scope="module")
def glm_config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 256, "num_nextn_predict_layers": 1,
        "torch_dtype": "float32"}))
    return path


def _parse(vllm_path: Path, model: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(vllm_path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model)],
                          cwd=vllm_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_pristine_rejects_and_patched_accepts(tmp_path, glm_config_dir):
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT / "vllm"), "archive", "v0.11.0", "vllm/"],
        capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(pristine)], input=archive,
                   check=True)

    before = _parse(pristine, glm_config_dir)
    assert before.startswith("REJECTED"), before
    assert "glm4_moe_mtp" in before or "literal" in before.lower()

    after = _parse(ROOT / "vllm", glm_config_dir)
    assert after == "ACCEPTED mtp Glm4MoeMTPModel", after
