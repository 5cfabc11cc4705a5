"""Shared helpers for the server tests: the checkpoint and the launcher."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The trained tiny GLM-4.5 checkpoint with its tokenizer."""
    needed = ("config.json", "tokenizer.json",
              "model.safetensors.index.json")
    missing = [n for n in needed if not (FIXTURE / n).exists()]
    if missing:
        pytest.skip(f"{FIXTURE} lacks {missing}: build it with "
                    "python -m tests.fixtures.build_tiny_glm45")
    return FIXTURE
