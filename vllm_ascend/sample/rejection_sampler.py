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

Cost: the target logits get temperature/top-k/top-p and one logsumexp pass
over [num_tokens, vocab]; the softmax, residual and noise are computed for one
row per request (its first rejected position), not for every draft token.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from vllm.logger import init_logger
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (GREEDY_TEMPERATURE, MAX_SPEC_LEN,
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

        layout = DraftLayout.build(metadata.cu_num_draft_tokens, num_tokens,
                                   metadata.max_spec_len)
        draft_token_ids = metadata.draft_token_ids.to(torch.long)

        target_argmax = is_greedy = None
        if not sampling_metadata.all_random:
            # Taken before the logits are scaled in place; top-k/top-p never
            # drop the maximum, so this is the argmax of the greedy target.
            target_argmax = target_logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            assert target_argmax is not None
            accepted = draft_token_ids == target_argmax
        else:
            logits = process_target_logits(target_logits, layout.token_to_req,
                                           sampling_metadata)
            uniform = generate_uniforms(num_tokens,
                                        metadata.num_draft_tokens,
                                        sampling_metadata.generators, device)
            noise = generate_exponential_noise(batch_size, logits.shape[-1],
                                               metadata.num_draft_tokens,
                                               sampling_metadata.generators,
                                               device)
            # p(x) without materializing softmax over [num_tokens, vocab].
            target_p = (logits.gather(1, draft_token_ids[:, None])[:, 0] -
                        logits.logsumexp(dim=-1)).exp()
            if draft_probs is None:
                draft_q = torch.ones_like(target_p)
            else:
                draft_q = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
            accepted = self.accept_draft(target_p, draft_q, uniform)
            if target_argmax is not None:
                assert sampling_metadata.temperature is not None
                is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
                accepted = torch.where(is_greedy[layout.token_to_req],
                                       draft_token_ids == target_argmax,
                                       accepted)

        num_accepted = layout.accepted_prefix_length(accepted)
        # The token index of each request's first rejection; clamped where
        # every draft was accepted (its emitted token is then unused).
        first_rejected = layout.start + num_accepted
        first_rejected.clamp_(max=num_tokens - 1)
        if sampling_metadata.all_greedy:
            assert target_argmax is not None
            emitted = target_argmax[first_rejected]
        else:
            # Only one recovered token per request is ever emitted: sample
            # it at the first rejection only, not at every draft position.
            emitted = sample_recovered_tokens(
                draft_token_ids[first_rejected],
                None if draft_probs is None else draft_probs[first_rejected],
                logits[first_rejected].softmax(dim=-1, dtype=torch.float32),
                noise)
            if target_argmax is not None:
                assert is_greedy is not None
                emitted = torch.where(is_greedy, target_argmax[first_rejected],
                                      emitted)
        return layout.assemble_output(num_accepted, emitted, draft_token_ids,
                                      bonus)

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


@dataclass
class DraftLayout:
    """Where each request's draft tokens sit in the flattened token axis."""

    token_to_req: torch.Tensor  # [num_tokens]
    start: torch.Tensor  # [batch_size]: index of the request's first draft
    num_drafts: torch.Tensor  # [batch_size, 1]
    token_idx: torch.Tensor  # [batch_size, max_spec_len]: 0 where invalid
    valid: torch.Tensor  # [batch_size, max_spec_len]

    @classmethod
    def build(cls, cu_num_draft_tokens: torch.Tensor, num_tokens: int,
              max_spec_len: int) -> "DraftLayout":
        cu = cu_num_draft_tokens.to(torch.long)
        num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
        start = cu - num_drafts
        positions = torch.arange(num_tokens, device=cu.device)
        token_to_req = torch.searchsorted(cu, positions, right=True)
        pos = torch.arange(max_spec_len, device=cu.device)
        valid = pos < num_drafts[:, None]
        token_idx = torch.where(valid, start[:, None] + pos,
                                torch.zeros_like(pos))
        return cls(token_to_req, start, num_drafts[:, None], token_idx, valid)

    def accepted_prefix_length(self, accepted: torch.Tensor) -> torch.Tensor:
        """[batch_size]: drafts accepted before the first rejection."""
        accepted_pad = accepted[self.token_idx] & self.valid
        return accepted_pad.to(torch.int32).cumprod(dim=1).sum(dim=1)

    def assemble_output(self, num_accepted: torch.Tensor,
                        emitted: torch.Tensor, draft_token_ids: torch.Tensor,
                        bonus_token_ids: torch.Tensor) -> torch.Tensor:
        """[batch_size, max_spec_len + 1] int32: the accepted drafts, then
        ``emitted`` at the first rejection or the bonus token when all were
        accepted; PLACEHOLDER_TOKEN_ID elsewhere."""
        batch_size, max_spec_len = self.valid.shape
        device = self.valid.device
        pos = torch.arange(max_spec_len, device=device)
        num_accepted = num_accepted[:, None]
        tokens = torch.where(pos < num_accepted,
                             draft_token_ids[self.token_idx],
                             emitted[:, None])
        keep = self.valid & (pos <= num_accepted)
        output = torch.full((batch_size, max_spec_len + 1),
                            PLACEHOLDER_TOKEN_ID,
                            dtype=torch.int32,
                            device=device)
        output[:, :max_spec_len] = torch.where(
            keep, tokens, torch.full_like(tokens, PLACEHOLDER_TOKEN_ID))
        columns = torch.arange(max_spec_len + 1, device=device)
        takes_bonus = ((columns == self.num_drafts)
                       & (num_accepted == self.num_drafts))
        return torch.where(takes_bonus, bonus_token_ids[:, None], output)


def process_target_logits(logits: torch.Tensor, token_to_req: torch.Tensor,
                          sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k and top-p per request, as float32 logits: the
    softmax of a row is the target distribution at that draft position.

    Greedy rows of a mixed batch use temperature 1; their values are not
    used. ``logits`` is scaled in place when it is already float32.
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
    return apply_top_k_top_p(logits, top_k, top_p)


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
    draft_token_ids: torch.Tensor,  # [rows] int64
    draft_probs: Optional[torch.Tensor],  # [rows, vocab] or None
    target_probs: torch.Tensor,  # [rows, vocab]
    noise: torch.Tensor,  # [rows, vocab] Exp(1)
) -> torch.Tensor:
    """[rows] samples of normalize(max(p - q, 0)), one per row.

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


def _starts(num_draft_tokens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in num_draft_tokens:
        starts.append(total)
        total += n
    return starts
