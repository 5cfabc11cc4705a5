"""Startup checks in-process: checkpoint tensor names, request limits and
the short form of CLI configuration errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.utils.checkpoints import write_random_glm45
from vllm_ascend import checks
from vllm_ascend.checks import (check_glm45_checkpoint, check_sampling_params,
                                expected_glm45_tensors)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    """Copy a checkpoint, dropping tensors from its shards and index."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in dst.glob("*.safetensors"):
        tensors = load_file(str(path))
        if any(n in tensors for n in names):
            save_file({k: v for k, v in tensors.items() if k not in names},
                      str(path), metadata={"format": "pt"})
    if index is not None:
        for name in names:
            index["weight_map"].pop(name, None)
        index_path.write_text(json.dumps(index))
    return dst


def test_fixture_passes(model_dir):
    check_glm45_checkpoint(model_dir, _config(model_dir), with_mtp=True)


def test_expected_names_cover_the_fixture(model_dir):
    """Every fixture tensor is expected, except the MTP layer's optional
    copies of the embedding and LM head."""
    config = _config(model_dir)
    names = checks.checkpoint_tensor_names(model_dir)
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert names - expected_glm45_tensors(config, with_mtp=True) == {
        f"{mtp}embed_tokens.weight", f"{mtp}shared_head.head.weight"}
    # 3 layers: 1 dense, 2 MoE of 8 experts, and the MTP MoE layer.
    experts = [n for n in expected_glm45_tensors(config, True)
               if ".mlp.experts." in n]
    assert len(experts) == 3 * 8 * 3


@pytest.mark.parametrize("overrides", [
    dict(use_qk_norm=False, attention_bias=False, first_k_dense_replace=2,
         num_hidden_layers=3, n_routed_experts=6, mtp_copies=False),
    dict(tie_word_embeddings=True, n_shared_experts=0),
], ids=["no_qk_norm_no_bias_2_dense_no_copies", "tied_no_shared"])
def test_other_architectures_pass(tmp_path, overrides):
    path = write_random_glm45(tmp_path / "ckpt", **overrides)
    config = _config(path)
    check_glm45_checkpoint(path, config, with_mtp=True)
    names = checks.checkpoint_tensor_names(path)
    expected = expected_glm45_tensors(config, with_mtp=True)
    assert expected <= names
    if overrides.get("tie_word_embeddings"):
        assert "lm_head.weight" not in expected
    if not overrides.get("attention_bias", True):
        assert not any(n.endswith("_proj.bias") for n in expected)


def test_missing_expert_is_named(model_dir, tmp_path):
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    path = _copy_without(model_dir, tmp_path / "ckpt", gone)
    with pytest.raises(ValueError) as err:
        check_glm45_checkpoint(path, _config(path), with_mtp=False)
    assert f"missing 1 tensor(s) that its config.json requires: {gone}." \
        in str(err.value)
    assert "re-download or re-export" in str(err.value)


def test_missing_mtp_tensor_only_matters_with_mtp(model_dir, tmp_path):
    gone = "model.layers.3.eh_proj.weight"
    path = _copy_without(model_dir, tmp_path / "ckpt", gone)
    check_glm45_checkpoint(path, _config(path), with_mtp=False)
    with pytest.raises(ValueError, match="model.layers.3.eh_proj.weight") \
            as err:
        check_glm45_checkpoint(path, _config(path), with_mtp=True)
    assert "serve without --speculative-config" in str(err.value)


def test_many_missing_are_summarized(model_dir, tmp_path):
    gone = [f"model.layers.2.mlp.experts.{e}.{p}.weight" for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")]
    path = _copy_without(model_dir, tmp_path / "ckpt", *gone)
    with pytest.raises(ValueError) as err:
        check_glm45_checkpoint(path, _config(path), with_mtp=False)
    message = str(err.value)
    assert "missing 24 tensor(s)" in message
    assert f"... ({24 - checks.MAX_LISTED} more)" in message
    # Natural order: expert 0 is listed first, expert 10 would not sort
    # before expert 2.
    assert message.index("experts.0.") < message.index("experts.1.")


def test_absent_shard_is_named(model_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(model_dir, path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError,
                       match="model-00002-of-00002.safetensors"):
        check_glm45_checkpoint(path, _config(path), with_mtp=True)


class _Params:
    def __init__(self, n: int) -> None:
        self.n = n


def test_n_limit(monkeypatch):
    monkeypatch.delenv(checks.MAX_N_ENV, raising=False)
    check_sampling_params(_Params(checks.DEFAULT_MAX_N))
    with pytest.raises(ValueError, match=r"n=129 completions per request"):
        check_sampling_params(_Params(checks.DEFAULT_MAX_N + 1))
    monkeypatch.setenv(checks.MAX_N_ENV, "4")
    with pytest.raises(ValueError, match="at most 4"):
        check_sampling_params(_Params(5))
    monkeypatch.setenv(checks.MAX_N_ENV, "zero")
    with pytest.raises(ValueError, match="VLLM_ASCEND_MAX_N='zero'"):
        check_sampling_params(_Params(1))


HOOK_SCRIPT = """
import sys
sys.argv[0] = {argv0!r}
from vllm_ascend import startup_errors
startup_errors.install()
from pydantic import BaseModel, field_validator
class Spec(BaseModel):
    k: int
    @field_validator("k")
    @classmethod
    def positive(cls, v):
        if v < 1:
            raise ValueError("k must be positive: set k to 1")
        return v
Spec(k=0)
"""


@pytest.mark.parametrize("argv0", ["/venv/bin/vllm", "script.py"])
def test_cli_config_error_is_one_line(argv0):
    proc = subprocess.run(
        [sys.executable, "-c", HOOK_SCRIPT.format(argv0=argv0)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "k must be positive: set k to 1" in proc.stderr
    if argv0.endswith("vllm"):
        assert "Traceback" not in proc.stderr
        assert proc.stderr.splitlines()[0] == (
            "Error: k must be positive: set k to 1")
    else:
        # Scripts that import vLLM keep their tracebacks.
        assert "Traceback" in proc.stderr


def _vllm_config(path: Path, load_format: str = "auto"):
    from types import SimpleNamespace
    model = SimpleNamespace(hf_config=_config(path), model=str(path),
                            quantization=None)
    return SimpleNamespace(model_config=model, speculative_config=None,
                           load_config=SimpleNamespace(
                               load_format=load_format))


def test_startup_check_applies_to_local_safetensors_only(
        model_dir, tmp_path, monkeypatch):
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    path = _copy_without(model_dir, tmp_path / "ckpt", gone)
    with pytest.raises(ValueError, match=gone):
        checks.check_checkpoint(_vllm_config(path))
    # Dummy weights, or a directory with only config.json: the loader's.
    checks.check_checkpoint(_vllm_config(path, load_format="dummy"))
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(path / "config.json", config_only)
    checks.check_checkpoint(_vllm_config(config_only))
    # vLLM's own tests build partial checkpoints on purpose.
    monkeypatch.setenv("VLLM_ASCEND_SKIP_CHECKPOINT_CHECK", "1")
    checks.check_checkpoint(_vllm_config(path))
