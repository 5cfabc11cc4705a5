"""Builders shared by the rejection sampler tests."""

from typing import Optional

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

GREEDY = float(GREEDY_TEMPERATURE)


def spec_metadata(drafts: list[list[int]],
                  device: str = "cpu") -> SpecDecodeMetadata:
    return SpecDecodeMetadata.make_dummy(drafts, torch.device(device))


def sampling_metadata(
    temperature: Optional[list[float]],
    top_k: Optional[list[int]] = None,
    top_p: Optional[list[float]] = None,
    generators: Optional[dict[int, torch.Generator]] = None,
    device: str = "cpu",
) -> SamplingMetadata:
    """temperature None means an all-greedy batch; GREEDY marks greedy rows
    of a mixed batch, as vLLM's InputBatch does."""
    all_greedy = temperature is None or all(t == GREEDY for t in temperature)
    all_random = temperature is not None and all(t != GREEDY
                                                 for t in temperature)
    temp = (None if temperature is None else torch.tensor(
        temperature, dtype=torch.float32, device=device))
    return SamplingMetadata(
        temperature=temp,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=(None if top_p is None else torch.tensor(
            top_p, dtype=torch.float32, device=device)),
        top_k=(None if top_k is None else torch.tensor(
            top_k, dtype=torch.int32, device=device)),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(0),
        presence_penalties=torch.zeros(0),
        repetition_penalties=torch.zeros(0),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def bonus_tensor(bonus: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(bonus, dtype=torch.int32, device=device)[:, None]


def spec_metadata_from_tensor(drafts: torch.Tensor) -> SpecDecodeMetadata:
    """[batch, k] draft tokens, k per request: big batches without the
    quadratic list flattening of make_dummy."""
    batch, k = drafts.shape
    return SpecDecodeMetadata(
        draft_token_ids=drafts.reshape(-1).to(torch.int32),
        num_draft_tokens=[k] * batch,
        cu_num_draft_tokens=torch.arange(1, batch + 1, dtype=torch.int32) * k,
        target_logits_indices=torch.zeros(batch * k, dtype=torch.int32),
        bonus_logits_indices=torch.zeros(batch, dtype=torch.int32),
        logits_indices=torch.zeros(batch * (k + 1), dtype=torch.int32),
    )
