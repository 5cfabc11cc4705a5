"""Sampling for the Ascend plugin: torch rejection sampling for spec decode."""

from vllm_ascend.sample.rejection_sampler import AscendRejectionSampler

__all__ = ["AscendRejectionSampler"]
