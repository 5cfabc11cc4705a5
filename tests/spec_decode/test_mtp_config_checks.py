"""Startup checks of GLM-4.5 MTP settings the plugin does not run."""

from types import SimpleNamespace

import pytest

from vllm_ascend.spec_decode.mtp_proposer import (MAX_MTP_SPECULATIVE_TOKENS,
                                                  check_mtp_config)


def _config(arch: str, k: int):
    draft = SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]))
    spec = SimpleNamespace(draft_model_config=draft, num_speculative_tokens=k)
    return SimpleNamespace(speculative_config=spec)


@pytest.mark.parametrize("k", range(1, MAX_MTP_SPECULATIVE_TOKENS + 1))
def test_supported_draft_lengths_pass(k):
    check_mtp_config(_config("Glm4MoeMTPModel", k))


def test_too_many_speculative_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="num_speculative_tokens=4 is more"):
        check_mtp_config(_config("Glm4MoeMTPModel", 4))


def test_other_drafts_and_no_speculation_are_left_alone():
    check_mtp_config(_config("EagleLlamaForCausalLM", 5))
    check_mtp_config(SimpleNamespace(speculative_config=None))
