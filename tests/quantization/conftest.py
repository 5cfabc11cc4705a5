from pathlib import Path

import pytest

from tests.quantization.checkpoints import FIXTURE, quantize


@pytest.fixture(scope="session")
def w8a8_dirs(tmp_path_factory) -> dict[str, Path]:
    """The trained fixture as W8A8 (static attention, dynamic MLP and
    experts), with its MTP layer quantized and with it float."""
    tmp = tmp_path_factory.mktemp("w8a8")
    return {
        "quantized_mtp": quantize(FIXTURE, tmp / "quantized-mtp"),
        "float_mtp": quantize(FIXTURE, tmp / "float-mtp", "--float-mtp"),
    }
