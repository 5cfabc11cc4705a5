"""Ascend (msModelSlim) W8A8 checkpoints: ``--quantization ascend``."""
