"""Rejection sampling for speculative decoding, in plain torch.

vLLM v0.11.0's ``RejectionSampler`` launches triton kernels, which exist on
neither the CPU reference device nor an Ascend NPU. ``AscendRejectionSampler``
keeps its contract (inputs, output layout, ``parse_output``) and replaces the
kernels with batched torch ops, so the same code is the NPU path too (on
torch_npu tensors) until a fused kernel replaces it.

The algorithm is the lossless one of https://arxiv.org/abs/2211.17192: a draft
token x is accepted with probability min(1, p(x) / q(x)); at the first
rejection a recovered token is drawn from normalize(max(p - q, 0)); when every
draft is accepted the bonus token is appended. Greedy requests accept a draft
while it equals the target argmax and emit the argmax at the first mismatch.

Randomness: one float64 uniform per draft token and one exponential noise
vector per request (only one recovered token per request is ever used, the
one at its first rejection). Seeded requests draw both from their own
generator, uniforms first, so their output does not depend on the rest of the
batch; requests without draft tokens draw nothing.
"""

from typing import Optional

import torch
from vllm.logger import init_logger
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (GREEDY_TEMPERATURE,
                                              MAX_SPEC_LEN,
                                              PLACEHOLDER_TOKEN_ID,
                                              RejectionSampler)
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

logger = init_logger(__name__)


class AscendRejectionSampler(RejectionSampler):
    """Drop-in replacement of vLLM's ``RejectionSampler`` without triton.

    ``forward`` returns ``[batch_size, max_spec_len + 1]`` int32 token ids,
    ``PLACEHOLDER_TOKEN_ID`` after the first rejection (or after the bonus
    token); ``RejectionSampler.parse_output`` reads it unchanged.
    """

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        # [num_tokens, vocab_size] or None: the draft was one-hot (greedy).
        draft_probs: Optional[torch.Tensor],
        # [num_tokens, vocab_size]; may be modified in place.
        target_logits: torch.Tensor,
        # [batch_size, 1] (or [batch_size])
        bonus_token_ids: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        check_inputs(metadata, draft_probs, target_logits, bonus_token_ids,
                     sampling_metadata)
        batch_size = len(metadata.num_draft_tokens)
        num_tokens = metadata.draft_token_ids.shape[0]
        device = target_logits.device
        bonus = bonus_token_ids.reshape(-1).to(torch.int32)
        if num_tokens == 0:
            # No request has a draft: every request emits its bonus token.
            return bonus.view(batch_size, 1).clone()

        cu_num_draft_tokens = metadata.cu_num_draft_tokens.to(torch.long)
        num_draft_tokens = torch.diff(cu_num_draft_tokens,
                                      prepend=cu_num_draft_tokens.new_zeros(1))
        token_to_req = token_request_indices(cu_num_draft_tokens, num_tokens)
        draft_token_ids = metadata.draft_token_ids.to(torch.long)

        greedy_accepted = greedy_emitted = None
        if not sampling_metadata.all_random:
            # Taken before the logits are scaled in place; top-k/top-p never
            # drop the maximum, so this is the argmax of the greedy target.
            target_argmax = target_logits.argmax(dim=-1)
            greedy_accepted = draft_token_ids == target_argmax
            greedy_emitted = target_argmax
        if sampling_metadata.all_greedy:
            assert greedy_accepted is not None and greedy_emitted is not None
            accepted, emitted = greedy_accepted, greedy_emitted
        else:
            target_probs = compute_target_probs(target_logits, token_to_req,
                                                sampling_metadata)
            uniform = generate_uniforms(num_tokens,
                                        metadata.num_draft_tokens,
                                        sampling_metadata.generators, device)
            noise = generate_exponential_noise(batch_size,
                                               target_probs.shape[-1],
                                               metadata.num_draft_tokens,
                                               sampling_metadata.generators,
                                               device)
            target_p = target_probs.gather(1, draft_token_ids[:, None])[:, 0]
            if draft_probs is None:
                draft_q = torch.ones_like(target_p)
            else:
                draft_q = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
            accepted = self.accept_draft(target_p, draft_q, uniform)
            emitted = sample_recovered_tokens(draft_token_ids, draft_probs,
                                              target_probs,
                                              noise[token_to_req])
            if greedy_accepted is not None:
                assert greedy_emitted is not None
                is_greedy = (sampling_metadata.temperature
                             == GREEDY_TEMPERATURE)[token_to_req]
                accepted = torch.where(is_greedy, greedy_accepted, accepted)
                emitted = torch.where(is_greedy, greedy_emitted, emitted)

        return assemble_output(accepted, emitted, draft_token_ids, bonus,
                               cu_num_draft_tokens, num_draft_tokens,
                               metadata.max_spec_len)

    def accept_draft(self, target_prob: torch.Tensor, draft_prob: torch.Tensor,
                     uniform: torch.Tensor) -> torch.Tensor:
        """Accept draft x with probability min(1, p(x) / q(x)).

        ``uniform`` is in [0, 1): ``u * q < p`` never accepts a token the
        target gives probability 0. A draft with q(x) == 0 is rejected, as
        upstream does, rather than dividing by zero.
        """
        return (draft_prob > 0) & (uniform * draft_prob < target_prob)


def check_inputs(metadata: SpecDecodeMetadata,
                 draft_probs: Optional[torch.Tensor],
                 target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                 sampling_metadata: SamplingMetadata) -> None:
    """Shape checks that need no device sync; raise ValueError on misuse."""
    batch_size = len(metadata.num_draft_tokens)
    num_tokens = sum(metadata.num_draft_tokens)
    if metadata.max_spec_len > MAX_SPEC_LEN:
        raise ValueError(
            f"max_spec_len={metadata.max_spec_len} exceeds MAX_SPEC_LEN="
            f"{MAX_SPEC_LEN}; lower num_speculative_tokens.")
    if (metadata.draft_token_ids.ndim != 1
            or metadata.draft_token_ids.shape[0] != num_tokens):
        raise ValueError(
            "draft_token_ids must be 1-D with sum(num_draft_tokens)="
            f"{num_tokens} entries, got shape "
            f"{tuple(metadata.draft_token_ids.shape)}.")
    if tuple(metadata.cu_num_draft_tokens.shape) != (batch_size, ):
        raise ValueError(
            f"cu_num_draft_tokens must have shape ({batch_size},) (one "
            "cumulative count per request), got "
            f"{tuple(metadata.cu_num_draft_tokens.shape)}.")
    if target_logits.ndim != 2 or target_logits.shape[0] != num_tokens:
        raise ValueError(
            f"target_logits must be [num_draft_tokens={num_tokens}, vocab], "
            f"got {tuple(target_logits.shape)}: pass the logits at the draft "
            "positions only (spec_decode_metadata.target_logits_indices).")
    if draft_probs is not None and draft_probs.shape != target_logits.shape:
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)} but "
            f"target_logits has {tuple(target_logits.shape)}; they must "
            "match, or pass draft_probs=None for one-hot drafts.")
    if bonus_token_ids.numel() != batch_size:
        raise ValueError(
            f"bonus_token_ids must hold one token per request ({batch_size}),"
            f" got shape {tuple(bonus_token_ids.shape)}.")
    if not sampling_metadata.all_greedy and (
            sampling_metadata.temperature is None):
        raise ValueError("sampling_metadata.temperature is None but the "
                         "batch is not all greedy.")


def token_request_indices(cu_num_draft_tokens: torch.Tensor,
                          num_tokens: int) -> torch.Tensor:
    """[num_tokens]: the request each flattened draft token belongs to."""
    positions = torch.arange(num_tokens,
                             dtype=cu_num_draft_tokens.dtype,
                             device=cu_num_draft_tokens.device)
    return torch.searchsorted(cu_num_draft_tokens, positions, right=True)


def compute_target_probs(logits: torch.Tensor, token_to_req: torch.Tensor,
                         sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k and top-p per request, then softmax (float32).

    Greedy rows of a mixed batch use temperature 1; their probabilities are
    not used. ``logits`` is scaled in place when it is already float32.
    """
    assert sampling_metadata.temperature is not None
    temperature = sampling_metadata.temperature[token_to_req]
    temperature = torch.where(temperature == GREEDY_TEMPERATURE,
                              torch.ones_like(temperature), temperature)
    logits = logits.to(torch.float32)
    logits.div_(temperature.to(torch.float32).unsqueeze(-1))
    top_k = (None if sampling_metadata.top_k is None else
             sampling_metadata.top_k[token_to_req])
    top_p = (None if sampling_metadata.top_p is None else
             sampling_metadata.top_p[token_to_req])
    logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


def generate_uniforms(num_tokens: int, num_draft_tokens: list[int],
                      generators: dict[int, torch.Generator],
                      device: torch.device) -> torch.Tensor:
    """[num_tokens] float64 uniforms in [0, 1); seeded requests use their own
    generator (float64: float32 returns exactly 0.0 too often)."""
    uniform = torch.rand(num_tokens, dtype=torch.float64, device=device)
    if generators:
        starts = _starts(num_draft_tokens)
        for req_idx, generator in generators.items():
            n = num_draft_tokens[req_idx]
            if n > 0:
                start = starts[req_idx]
                uniform[start:start + n].uniform_(generator=generator)
    return uniform


def generate_exponential_noise(batch_size: int, vocab_size: int,
                               num_draft_tokens: list[int],
                               generators: dict[int, torch.Generator],
                               device: torch.device) -> torch.Tensor:
    """[batch_size, vocab_size] Exp(1) noise, one row per request.

    argmax(w / E) over i.i.d. Exp(1) E samples index i with probability
    w_i / sum(w): sampling without normalizing and without a cumsum.
    """
    noise = torch.empty(batch_size,
                        vocab_size,
                        dtype=torch.float32,
                        device=device)
    noise.exponential_()
    for req_idx, generator in generators.items():
        if num_draft_tokens[req_idx] > 0:
            noise[req_idx].exponential_(generator=generator)
    # An exact 0 would turn a zero weight into 0/0 = nan, which argmax picks.
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def sample_recovered_tokens(
    draft_token_ids: torch.Tensor,  # [num_tokens] int64
    draft_probs: Optional[torch.Tensor],  # [num_tokens, vocab] or None
    target_probs: torch.Tensor,  # [num_tokens, vocab]
    noise: torch.Tensor,  # [num_tokens, vocab], the request's noise row
) -> torch.Tensor:
    """[num_tokens] samples of normalize(max(p - q, 0)).

    With one-hot drafts that is p without the draft token. When the residual
    is zero everywhere (p == q up to rounding, so a rejection could only come
    from rounding), the token is drawn from p.
    """
    if draft_probs is None:
        residual = target_probs.scatter(1, draft_token_ids[:, None], 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return residual.div_(noise).argmax(dim=-1)


def assemble_output(
    accepted: torch.Tensor,  # [num_tokens] bool
    emitted: torch.Tensor,  # [num_tokens]: the token emitted on rejection
    draft_token_ids: torch.Tensor,  # [num_tokens]
    bonus_token_ids: torch.Tensor,  # [batch_size] int32
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    num_draft_tokens: torch.Tensor,  # [batch_size]
    max_spec_len: int,
) -> torch.Tensor:
    """Lay the per-token decisions out as [batch_size, max_spec_len + 1].

    Row i holds the accepted prefix of its drafts, then the token emitted at
    the first rejection, or the bonus token when all drafts were accepted;
    PLACEHOLDER_TOKEN_ID elsewhere.
    """
    device = accepted.device
    batch_size = num_draft_tokens.shape[0]
    pos = torch.arange(max_spec_len, device=device)
    num_drafts = num_draft_tokens[:, None]
    valid = pos < num_drafts  # [batch_size, max_spec_len]
    token_idx = (cu_num_draft_tokens - num_draft_tokens)[:, None] + pos
    token_idx = torch.where(valid, token_idx, torch.zeros_like(token_idx))

    accepted_pad = accepted[token_idx] & valid
    num_accepted = accepted_pad.to(torch.int32).cumprod(dim=1).sum(
        dim=1, keepdim=True)
    tokens = torch.where(pos < num_accepted, draft_token_ids[token_idx],
                         emitted[token_idx])
    keep = valid & (pos <= num_accepted)
    placeholder = torch.full_like(tokens, PLACEHOLDER_TOKEN_ID)
    output = torch.full((batch_size, max_spec_len + 1),
                        PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int32,
                        device=device)
    output[:, :max_spec_len] = torch.where(keep, tokens, placeholder)

    columns = torch.arange(max_spec_len + 1, device=device)
    takes_bonus = (columns == num_drafts) & (num_accepted == num_drafts)
    return torch.where(takes_bonus, bonus_token_ids[:, None], output)


def _starts(num_draft_tokens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in num_draft_tokens:
        starts.append(total)
        total += n
    return starts
