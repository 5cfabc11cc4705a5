"""Random rejection sampling is lossless: a statistical test.

One big batch of identical requests (N of them, 2 draft tokens each) against
fixed target logits for positions 0 and 1. Whatever the drafts, the token
emitted at position 0 must follow the target distribution p0 (temperature,
top-k and top-p applied, computed here independently of vLLM), and position 1
among the requests whose first draft was accepted must follow p1. Checked by
a chi-square goodness-of-fit test (alpha = 1e-3) plus a total-variation bound;
the same check must reject deliberately wrong samplers.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch
from scipy import stats
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

from tests.sample.rejection_inputs import (bonus_tensor, sampling_metadata,
                                           spec_metadata_from_tensor)
from vllm_ascend.sample import AscendRejectionSampler

VOCAB = 12
N = 30_000
ALPHA = 1e-3  # chi-square p-value below which a distribution is rejected
TV_TOL = 0.03  # total-variation tolerance; sampling noise is ~0.005-0.01
N_WRONG = 5_000  # wrong samplers fail by far; fewer samples suffice
TEMPERATURE, TOP_K, TOP_P = 0.7, 9, 0.93

LOGITS0 = torch.tensor(
    [2.0, 1.5, 1.2, 0.9, 0.7, 0.4, 0.2, -0.1, -0.4, -0.9, -1.5, -3.0])
LOGITS1 = torch.tensor(
    [-0.5, 0.3, 1.8, -1.0, 0.9, 0.0, 1.1, -2.0, 0.6, -0.3, 0.2, 0.5])
# Draft distributions: peaked elsewhere than the target, and with mass on
# tokens that top-k/top-p remove.
Q0 = torch.tensor([1, 6, 2, 1, 1, 1, 1, 1, 1, 1, 2, 3], dtype=torch.float)
Q1 = torch.tensor([3, 1, 1, 1, 4, 1, 1, 2, 1, 1, 1, 1], dtype=torch.float)
Q0, Q1 = Q0 / Q0.sum(), Q1 / Q1.sum()


def reference_probs(logits: torch.Tensor) -> np.ndarray:
    """Target distribution after temperature, top-k then top-p (nucleus:
    the smallest most-probable set whose mass reaches TOP_P)."""
    z = logits.double().numpy() / TEMPERATURE
    order = np.argsort(-z)
    z_k = np.full_like(z, -np.inf)
    z_k[order[:TOP_K]] = z[order[:TOP_K]]
    p = np.exp(z_k - z_k.max())
    p /= p.sum()
    cumulative = np.cumsum(p[order])
    keep = order[:np.searchsorted(cumulative, TOP_P) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


P0, P1 = reference_probs(LOGITS0), reference_probs(LOGITS1)


@dataclass
class FitResult:
    n: int
    p_value: float
    tv: float
    outside_support: int

    @property
    def ok(self) -> bool:
        return (self.outside_support == 0 and self.p_value > ALPHA
                and self.tv < TV_TOL)


def fit(samples: torch.Tensor, p: np.ndarray) -> FitResult:
    counts = np.bincount(samples.numpy(), minlength=VOCAB).astype(float)
    n = int(counts.sum())
    support = p > 0
    outside = int(counts[~support].sum())
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    if outside:
        return FitResult(n, 0.0, tv, outside)
    p_value = stats.chisquare(counts[support], n * p[support]).pvalue
    return FitResult(n, float(p_value), tv, 0)


class AlwaysAccept(AscendRejectionSampler):

    def accept_draft(self, target_prob, draft_prob, uniform):
        return torch.ones_like(target_prob, dtype=torch.bool)


class AlwaysReject(AscendRejectionSampler):

    def accept_draft(self, target_prob, draft_prob, uniform):
        return torch.zeros_like(target_prob, dtype=torch.bool)


class IgnoresDraftProbs(AscendRejectionSampler):
    """Accepts with probability p(x), as if the draft were one-hot."""

    def accept_draft(self, target_prob, draft_prob, uniform):
        return uniform < target_prob


def run(sampler: AscendRejectionSampler,
        with_q: bool,
        seed: int = 0,
        n: int = N):
    """Sample n requests; return (first tokens, second tokens given the
    first draft was accepted, number of first-draft acceptances)."""
    torch.manual_seed(seed)
    if with_q:
        # Drafts must be drawn from the q that is passed in.
        d0 = torch.multinomial(Q0, n, replacement=True)
        d1 = torch.multinomial(Q1, n, replacement=True)
        draft_probs: Optional[torch.Tensor] = torch.stack(
            [Q0, Q1]).repeat(n, 1)
    else:
        # One-hot drafts (an n-gram or greedy drafter): any draft works. Here
        # the target's mode 80% of the time, else a skewed proposal.
        d0 = torch.where(
            torch.rand(n) < 0.8, LOGITS0.argmax(),
            torch.multinomial(Q0, n, replacement=True))
        d1 = torch.where(
            torch.rand(n) < 0.8, LOGITS1.argmax(),
            torch.multinomial(Q1, n, replacement=True))
        draft_probs = None
    drafts = torch.stack([d0, d1], dim=1)
    logits = torch.stack([LOGITS0, LOGITS1]).repeat(n, 1)
    sm = sampling_metadata([TEMPERATURE] * n, top_k=[TOP_K] * n,
                           top_p=[TOP_P] * n)
    out = sampler(spec_metadata_from_tensor(drafts), draft_probs, logits,
                  bonus_tensor([0] * n), sm)
    first_accepted = out[:, 1] != PLACEHOLDER_TOKEN_ID
    assert torch.equal(out[first_accepted, 0], d0[first_accepted].int())
    return (out[:, 0].long(), out[first_accepted, 1].long(),
            int(first_accepted.sum()), d0)


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "q"])
def test_emitted_tokens_follow_the_target(with_q: bool):
    first, second, accepted, d0 = run(AscendRejectionSampler(), with_q)
    fit0, fit1 = fit(first, P0), fit(second, P1)
    assert fit0.ok, fit0
    assert fit1.ok, fit1
    assert fit1.n > N // 3  # enough accepted first drafts to test position 1

    # The acceptance rate is the theoretical one: sum_x q(x) min(1, p/q),
    # i.e. sum_x min(p, q) with q, or E[p(d0)] for one-hot drafts.
    if with_q:
        expected = float(np.minimum(P0, Q0.double().numpy()).sum())
    else:
        expected = float(P0[d0.numpy()].mean())
    assert stats.binomtest(accepted, N, expected).pvalue > ALPHA


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "q"])
@pytest.mark.parametrize("wrong", [AlwaysAccept, AlwaysReject])
def test_the_check_rejects_wrong_samplers(wrong, with_q: bool):
    first, second, _, _ = run(wrong(), with_q, n=N_WRONG)
    fit0 = fit(first, P0)
    assert not fit0.ok, fit0
    assert fit0.p_value < 1e-9 or fit0.outside_support > 0


def test_the_check_rejects_ignoring_draft_probs():
    first, _, _, _ = run(IgnoresDraftProbs(), with_q=True, n=N_WRONG)
    fit0 = fit(first, P0)
    assert not fit0.ok, fit0


def test_reference_target_is_what_the_sampler_targets():
    """Top-k and top-p really cut the support here (else the test above
    would not exercise them)."""
    assert (P0 > 0).sum() < TOP_K and (P1 > 0).sum() < TOP_K
    assert Q0[torch.from_numpy(P0 == 0)].sum() > 0.1


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "q"])
def test_the_check_rejects_recovering_from_the_target(monkeypatch, with_q):
    """A classic bug: on rejection, sample from p instead of max(p - q, 0)."""
    import vllm_ascend.sample.rejection_sampler as rs
    right = rs.sample_recovered_tokens

    def from_target(draft_token_ids, draft_probs, target_probs, noise):
        return right(draft_token_ids, torch.zeros_like(target_probs),
                     target_probs, noise)

    monkeypatch.setattr(rs, "sample_recovered_tokens", from_target)
    first, _, _, _ = run(AscendRejectionSampler(), with_q, n=N_WRONG)
    fit0 = fit(first, P0)
    assert not fit0.ok, fit0
