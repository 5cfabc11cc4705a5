from pathlib import Path

import pytest

from tests.utils.quantized_checkpoints import (FIXTURE, float_anti_outlier,
                                               quantize)


@pytest.fixture(scope="session")
def w8a8_dirs(tmp_path_factory) -> dict[str, Path]:
    """The trained fixture as W8A8 (static attention, dynamic MLP and
    experts), with its MTP layer quantized and with it float."""
    tmp = tmp_path_factory.mktemp("w8a8")
    return {
        "quantized_mtp": quantize(FIXTURE, tmp / "quantized-mtp"),
        "float_mtp": quantize(FIXTURE, tmp / "float-mtp", "--float-mtp"),
    }


@pytest.fixture(scope="session")
def anti_outlier_dirs(tmp_path_factory) -> dict[str, Path]:
    """The fixture with anti-outlier (m4) norm biases: W8A8 written by the
    tool with ``--anti-outlier``, and the same shift without quantization
    (every tensor FLOAT, the float model's function)."""
    tmp = tmp_path_factory.mktemp("anti-outlier")
    return {
        "w8a8": quantize(FIXTURE, tmp / "w8a8", "--anti-outlier"),
        "float": float_anti_outlier(FIXTURE, tmp / "float"),
    }
