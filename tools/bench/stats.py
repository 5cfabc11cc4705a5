"""Arithmetic of the benchmark: decode throughput, acceptance, medians.

Pure functions on plain numbers so that they are tested without an engine.
"""

import statistics
from typing import Any, Optional

SPEC_PREFIX = "vllm:spec_decode_"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
DECODE_TIME = "vllm:request_decode_time_seconds"


def decode_tokens_per_s(t_full: float, t_one: float, batch: int,
                        new_tokens: int) -> float:
    """Decode tokens/s from a run of ``new_tokens`` tokens (``t_full``) and a
    run of the same prompts with ``max_tokens=1`` (``t_one``: prefill and the
    first token). The difference is the time of the other ``new_tokens - 1``
    tokens of each of the ``batch`` requests."""
    if new_tokens < 2:
        raise ValueError("decode throughput needs at least 2 new tokens "
                         f"(got {new_tokens}); raise --new-tokens.")
    decode = t_full - t_one
    if decode <= 0:
        raise ValueError(
            f"the {new_tokens}-token run ({t_full:.3f} s) was not slower "
            f"than the 1-token run ({t_one:.3f} s): the timing is noise; "
            "raise --new-tokens or --repeats.")
    return batch * (new_tokens - 1) / decode


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def metric_delta(before: dict[str, Any], after: dict[str, Any],
                 name: str) -> Any:
    """``after - before`` of a counter (number) or vector (list)."""
    new = after.get(name)
    old = before.get(name)
    if new is None:
        return None
    if isinstance(new, list):
        old = old or [0] * len(new)
        return [n - o for n, o in zip(new, old)]
    return new - (old or 0)


def acceptance(drafts: int, draft_tokens: int, accepted: int,
               accepted_per_pos: Optional[list[int]]) -> dict[str, Any]:
    """Acceptance summary as vLLM's spec-decode logger computes it: the
    rate is accepted / draft tokens, the mean acceptance length counts the
    bonus token (1 + accepted / drafts), and position i's rate is the
    fraction of drafts whose i-th draft token was accepted."""
    if accepted > draft_tokens or drafts > draft_tokens:
        raise ValueError(f"inconsistent spec-decode counters: {drafts} "
                         f"drafts, {draft_tokens} draft tokens, {accepted} "
                         "accepted")
    per_pos = list(accepted_per_pos or [])
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_pos":
        [a / drafts for a in per_pos] if drafts else None,
    }
