"""Checkpoint quantization: ``python -m tools.quantize.w8a8`` writes an
Ascend W8A8 checkpoint from a float one (used by the quantization benchmark,
the rehearsal and the tests)."""
