"""Seeded requests are reproducible whatever else is in the batch."""

import torch

from tests.sample.rejection_inputs import (GREEDY, bonus_tensor,
                                           sampling_metadata, spec_metadata)
from vllm_ascend.sample import AscendRejectionSampler

VOCAB = 32
K = 3


def seeded_request_logits() -> torch.Tensor:
    # Flat enough that drafts are often rejected and recovered tokens vary.
    return torch.linspace(1.0, -1.0, VOCAB).repeat(K, 1)


SEEDED_DRAFTS = [0, 1, 5]


def seeded_request_draft_probs() -> torch.Tensor:
    # More peaked than the target on the drafts: p/q < 1, so they can fail.
    return torch.softmax(torch.linspace(3.0, -3.0, VOCAB), -1).repeat(K, 1)


def run_alone(seed: int, global_seed: int,
              draft_probs: bool) -> tuple[list[int], torch.Tensor]:
    """The seeded request as the only request of the batch."""
    torch.manual_seed(global_seed)
    gen = torch.Generator().manual_seed(seed)
    probs = seeded_request_draft_probs() if draft_probs else None
    out = AscendRejectionSampler()(
        spec_metadata([SEEDED_DRAFTS]), probs, seeded_request_logits(),
        bonus_tensor([7]),
        sampling_metadata([0.9], top_k=[20], top_p=[0.95],
                          generators={0: gen}))
    return AscendRejectionSampler.parse_output(out, VOCAB)[0], gen.get_state()


def run_in_batch(seed: int, global_seed: int,
                 draft_probs: bool) -> tuple[list[int], torch.Tensor, bool]:
    """The same request at index 3 of a mixed batch with other seeded and
    unseeded, greedy and random requests, some without drafts."""
    torch.manual_seed(global_seed)
    gen = torch.Generator().manual_seed(seed)
    idle_gen = torch.Generator().manual_seed(1234)
    idle_state = idle_gen.get_state()
    other_gen = torch.Generator().manual_seed(seed + 1)
    drafts = [[3, 4], [], [9], SEEDED_DRAFTS, [], [1, 2, 3]]
    others = torch.randn(6, VOCAB)
    logits = torch.cat([others[:3], seeded_request_logits(), others[3:]])
    probs = None
    if draft_probs:
        probs = torch.softmax(torch.randn(9, VOCAB), -1)
        probs[3:6] = seeded_request_draft_probs()
    sm = sampling_metadata(
        [1.0, 0.5, GREEDY, 0.9, 1.0, 1.3],
        top_k=[VOCAB, 5, VOCAB, 20, VOCAB, 10],
        top_p=[1.0, 0.8, 1.0, 0.95, 1.0, 0.7],
        generators={0: other_gen, 3: gen, 4: idle_gen})
    out = AscendRejectionSampler()(spec_metadata(drafts), probs, logits,
                                   bonus_tensor([0, 1, 2, 7, 4, 5]), sm)
    row = AscendRejectionSampler.parse_output(out, VOCAB)[3]
    idle_untouched = torch.equal(idle_gen.get_state(), idle_state)
    return row, gen.get_state(), idle_untouched


def test_seeded_request_is_independent_of_the_batch():
    for draft_probs in (False, True):
        outputs = set()
        for seed in range(12):
            alone, state_alone = run_alone(seed, 100 + seed, draft_probs)
            batched, state_batched, idle_untouched = run_in_batch(
                seed, 200 + seed, draft_probs)
            assert alone == batched, (seed, draft_probs)
            # Same draws from the request's generator in both batches.
            assert torch.equal(state_alone, state_batched)
            # A seeded request without drafts draws nothing.
            assert idle_untouched
            outputs.add(tuple(alone))
        # The seed matters: different seeds give different outputs.
        assert len(outputs) > 3, outputs


def test_unseeded_request_follows_the_global_generator():
    drafts = [SEEDED_DRAFTS]
    sm = sampling_metadata([1.0])
    results = set()
    for global_seed in range(8):
        torch.manual_seed(global_seed)
        out = AscendRejectionSampler()(spec_metadata(drafts), None,
                                       seeded_request_logits(),
                                       bonus_tensor([7]), sm)
        torch.manual_seed(global_seed)
        again = AscendRejectionSampler()(spec_metadata(drafts), None,
                                         seeded_request_logits(),
                                         bonus_tensor([7]), sm)
        assert torch.equal(out, again)
        results.add(tuple(out[0].tolist()))
    assert len(results) > 1
