"""Greedy rejection sampling against a plain python loop, output layout,
parse_output and input errors."""

import dataclasses
import importlib.util
import random

import pytest
import torch
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

from tests.sample.rejection_inputs import (GREEDY, bonus_tensor,
                                           sampling_metadata, spec_metadata)
from vllm_ascend.sample import AscendRejectionSampler

VOCAB = 16
npu_available = (importlib.util.find_spec("torch_npu") is not None
                 and hasattr(torch, "npu") and torch.npu.is_available())


def reference_greedy(drafts: list[list[int]], logits: torch.Tensor,
                     bonus: list[int]) -> list[list[int]]:
    """Accept while draft == argmax; emit the argmax at the first mismatch;
    append the bonus token when everything was accepted."""
    out, row_start = [], 0
    for req, req_drafts in enumerate(drafts):
        row = []
        for j, draft in enumerate(req_drafts):
            best = int(logits[row_start + j].argmax())
            row.append(best)
            if draft != best:
                break
        else:
            row.append(bonus[req])
        out.append(row)
        row_start += len(req_drafts)
    return out


def random_case(rng: random.Random, batch: int, max_k: int, p_match: float):
    counts = [rng.randint(0, max_k) for _ in range(batch)]
    logits = torch.randn(sum(counts), VOCAB)
    drafts, t = [], 0
    for n in counts:
        row = []
        for _ in range(n):
            best = int(logits[t].argmax())
            row.append(best if rng.random() < p_match else rng.randrange(
                VOCAB))
            t += 1
        drafts.append(row)
    bonus = [rng.randrange(VOCAB) for _ in range(batch)]
    return drafts, logits, bonus


def padded(rows: list[list[int]], width: int) -> list[list[int]]:
    return [r + [PLACEHOLDER_TOKEN_ID] * (width - len(r)) for r in rows]


def test_greedy_matches_python_loop():
    rng = random.Random(0)
    torch.manual_seed(0)
    sampler = AscendRejectionSampler()
    seen_lengths = set()
    for case in range(300):
        drafts, logits, bonus = random_case(rng, rng.randint(1, 8),
                                            rng.choice([1, 2, 3, 5]),
                                            rng.choice([0.0, 0.6, 0.9, 1.0]))
        if sum(map(len, drafts)) == 0:
            continue
        want = reference_greedy(drafts, logits, bonus)
        md = spec_metadata(drafts)
        out = sampler(md, None, logits.clone(), bonus_tensor(bonus),
                      sampling_metadata(None))
        assert out.dtype == torch.int32
        assert out.tolist() == padded(want, md.max_spec_len + 1), case
        assert sampler.parse_output(out, VOCAB) == want
        seen_lengths.update((len(r), len(d)) for r, d in zip(want, drafts))
    # The cases cover first-token rejection, partial runs and full accepts.
    assert {(1, 3), (2, 3), (4, 3)} <= seen_lengths


@pytest.mark.parametrize("draft_probs", [False, True])
def test_greedy_rows_of_mixed_batch(draft_probs: bool):
    rng = random.Random(1)
    torch.manual_seed(1)
    sampler = AscendRejectionSampler()
    for _ in range(50):
        batch = rng.randint(2, 8)
        drafts, logits, bonus = random_case(rng, batch, 4, 0.7)
        if sum(map(len, drafts)) == 0:
            continue
        greedy = [rng.random() < 0.5 for _ in range(batch)]
        temps = [GREEDY if g else rng.choice([0.5, 1.0, 1.5]) for g in greedy]
        probs = (torch.softmax(torch.randn_like(logits), -1)
                 if draft_probs else None)
        # Each of vLLM's top-k/top-p paths: none, top-k only, top-p only,
        # both.
        use_k, use_p = rng.random() < 0.5, rng.random() < 0.5
        sm = sampling_metadata(
            temps,
            top_k=[rng.choice([2, 5, VOCAB]) for _ in range(batch)]
            if use_k else None,
            top_p=[rng.choice([0.5, 0.9, 1.0]) for _ in range(batch)]
            if use_p else None)
        out = sampler(spec_metadata(drafts), probs, logits.clone(),
                      bonus_tensor(bonus), sm)
        got = sampler.parse_output(out, VOCAB)
        want = reference_greedy(drafts, logits, bonus)
        for i in range(batch):
            if greedy[i]:
                assert got[i] == want[i]
            else:
                # Random rows: an accepted prefix of the drafts, then one
                # recovered token or the bonus.
                n = len(got[i]) - 1
                assert got[i][:n] == drafts[i][:n]
                if n == len(drafts[i]):
                    assert got[i][n] == bonus[i]


def test_batch_without_drafts_returns_bonus_tokens():
    sampler = AscendRejectionSampler()
    out = sampler(spec_metadata([[], []]), None, torch.empty(0, VOCAB),
                  bonus_tensor([3, 4]), sampling_metadata([1.0, 1.0]))
    assert out.tolist() == [[3], [4]]


def test_one_dimensional_bonus_as_in_the_dummy_run():
    sampler = AscendRejectionSampler()
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    out = sampler(spec_metadata([[5], [0]]), None, logits,
                  torch.tensor([7, 8], dtype=torch.int32),
                  sampling_metadata(None))
    assert out.tolist() == [[5, 7], [5, PLACEHOLDER_TOKEN_ID]]


def test_parse_output_drops_placeholders_and_out_of_vocab():
    sampler = AscendRejectionSampler()
    logits = torch.zeros(4, VOCAB)
    for row, best in enumerate([2, 3, 9, 1]):
        logits[row, best] = 1.0
    drafts = [[2, 3], [4], [1]]
    out = sampler(spec_metadata(drafts), None, logits,
                  bonus_tensor([11, 12, VOCAB + 5]), sampling_metadata(None))
    assert out.tolist() == [[2, 3, 11], [9, -1, -1], [1, VOCAB + 5, -1]]
    assert sampler.parse_output(out, VOCAB) == [[2, 3, 11], [9], [1]]


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(logits=torch.zeros(2, VOCAB)), "target_logits"),
    (lambda a: a.update(probs=torch.zeros(3, VOCAB + 1)), "draft_probs"),
    (lambda a: a.update(bonus=bonus_tensor([1])), "bonus_token_ids"),
    (lambda a: a.update(sm=dataclasses.replace(a["sm"], temperature=None)),
     "temperature"),
])
def test_bad_input_is_a_clear_error(mutate, message):
    args = dict(md=spec_metadata([[1, 2], [3]]),
                probs=None,
                logits=torch.zeros(3, VOCAB),
                bonus=bonus_tensor([1, 2]),
                sm=sampling_metadata([1.0, GREEDY]))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        AscendRejectionSampler()(args["md"], args["probs"], args["logits"],
                                 args["bonus"], args["sm"])


def test_too_many_draft_tokens_is_a_clear_error():
    drafts = [[0] * 129]
    with pytest.raises(ValueError, match="MAX_SPEC_LEN"):
        AscendRejectionSampler()(spec_metadata(drafts), None,
                                 torch.zeros(129, VOCAB), bonus_tensor([0]),
                                 sampling_metadata(None))


@pytest.mark.skipif(not npu_available,
                    reason="needs an Ascend NPU with torch_npu")
def test_npu_matches_cpu_greedy():  # pragma: no cover - NPU only
    rng = random.Random(2)
    drafts, logits, bonus = random_case(rng, 8, 3, 0.7)
    sampler = AscendRejectionSampler()
    want = sampler(spec_metadata(drafts), None, logits.clone(),
                   bonus_tensor(bonus), sampling_metadata(None))
    got = sampler(spec_metadata(drafts, "npu"), None, logits.to("npu"),
                  bonus_tensor(bonus, "npu"),
                  sampling_metadata(None, device="npu"))
    assert got.cpu().tolist() == want.tolist()


def test_bfloat16_logits():
    """Model-dtype logits: greedy rows match the float32 reference and
    random rows still return a valid layout."""
    rng = random.Random(3)
    torch.manual_seed(3)
    drafts, logits, bonus = random_case(rng, 6, 3, 0.7)
    logits = logits.to(torch.bfloat16)
    temps = [GREEDY, 0.8, GREEDY, 1.0, GREEDY, 0.6]
    sampler = AscendRejectionSampler()
    out = sampler(spec_metadata(drafts), None, logits.clone(),
                  bonus_tensor(bonus), sampling_metadata(temps))
    got = sampler.parse_output(out, VOCAB)
    want = reference_greedy(drafts, logits.float(), bonus)
    for i, temp in enumerate(temps):
        if temp == GREEDY:
            assert got[i] == want[i]
        else:
            assert got[i][:-1] == drafts[i][:len(got[i]) - 1]
