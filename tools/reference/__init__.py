"""Offline GLM-4.5 + MTP reference (no vLLM): checkpoint I/O, the MTP layer
in plain torch, greedy generation and speculative-decoding acceptance.

The oracle that the tests and the nightly (``tools.nightly``) compare vLLM
against, so it lives with the tools users run; the fixture builder
(``tests/fixtures/build_tiny_glm45.py``) and the rehearsal's checkpoint
(``tools.dev.rehearsal.depth``) build on it too. Command line:
``python -m tools.reference --model-dir DIR --k 1 2 3``."""

from .acceptance import Glm45Reference, measure_acceptance
from .checkpoint import (load_main_model, load_mtp_layer, load_tensors,
                         read_config, save_sharded)
from .mtp import MtpDims, MtpLayer

__all__ = [
    "Glm45Reference", "MtpDims", "MtpLayer", "load_main_model",
    "load_mtp_layer", "load_tensors", "measure_acceptance", "read_config",
    "save_sharded"
]
