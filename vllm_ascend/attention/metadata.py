"""The attention batch as the kernels see it: host lengths included, and
their padding to the batch a graph was captured for."""

import enum
from dataclasses import dataclass

import torch
from vllm.attention.backends.abstract import AttentionMetadata


class AscendAttentionState(enum.Enum):
    """What a batch holds; the NPU picks its kernel variant from it."""
    PREFILL_NO_CACHE = 0
    DECODE_ONLY = 1
    SPEC_DECODING = 2
    CHUNKED_PREFILL = 3


@dataclass
class AscendAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    attn_state: AscendAttentionState
    # Context length of each request as the kernels take it (host values):
    # from seq_lens_cpu, which is exact except in draft steps 2..k of the
    # padded drafter batch, where the NPU path keeps it as an upper bound
    # (no device read; backend.draft_host_seq_lens).
    seq_lens_list: list[int]
    # Cumulative query lengths (query_start_loc[1:]) as the kernels take
    # them, host values read at build time.
    query_ends: list[int]


def classify_batch(query_lens: torch.Tensor, seq_lens: torch.Tensor,
                   max_query_len: int) -> AscendAttentionState:
    if max_query_len == 1:
        return AscendAttentionState.DECODE_ONLY
    if bool((query_lens == seq_lens).all()):
        return AscendAttentionState.PREFILL_NO_CACHE
    return AscendAttentionState.CHUNKED_PREFILL


def fits(num_reqs: int, num_tokens: int, captured_reqs: int,
         captured_tokens: int) -> bool:
    """Whether a batch can replay a graph captured for ``captured_reqs``
    requests and ``captured_tokens`` tokens: its padding tokens need a
    padding request to belong to."""
    if num_reqs > captured_reqs or num_tokens > captured_tokens:
        return False
    return num_tokens == captured_tokens or num_reqs < captured_reqs


def host_arguments(metadata: AscendAttentionMetadata, num_reqs: int,
                   num_tokens: int) -> tuple[list[int], list[int]]:
    """The kernel's cumulative query lengths and context lengths for this
    batch, padded to a captured batch of ``num_reqs`` requests and
    ``num_tokens`` tokens. The padding tokens go to padding requests that
    attend only to themselves; their outputs are never read."""
    query_ends = list(metadata.query_ends)
    seq_lens = list(metadata.seq_lens_list)
    missing_reqs = num_reqs - len(query_ends)
    end = query_ends[-1] if query_ends else 0
    missing_tokens = num_tokens - end
    if not fits(len(query_ends), end, num_reqs, num_tokens):
        raise RuntimeError(
            f"a batch of {len(query_ends)} request(s) and {end} token(s) "
            f"does not fit a graph captured for {num_reqs} request(s) and "
            f"{num_tokens} token(s)")
    for i in range(missing_reqs):
        share = missing_tokens // missing_reqs + (
            i < missing_tokens % missing_reqs)
        end += share
        query_ends.append(end)
        seq_lens.append(share)
    return query_ends, seq_lens
