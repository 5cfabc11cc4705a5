"""Mixture-of-experts ops: expert selection, the experts, the vLLM method."""
