"""vLLM layers built outside an engine: a VllmConfig and a 1-rank world."""

from collections.abc import Iterator

import pytest
import torch

import vllm_ascend


@pytest.fixture(scope="session", autouse=True)
def plugin_ops() -> None:
    """What vLLM's general-plugin loader does in every process."""
    vllm_ascend.register_ops()


@pytest.fixture
def vllm_config(dist_world):
    """A fresh VllmConfig (layer names must be unique per config)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def float32_default() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)
