"""The acceptance vLLM reports is what the MTP head really predicts.

The trained fixture's held-out prompts are decoded greedily with MTP through
the plugin; the offline reference (transformers for the main model, plain
torch for the MTP layer, no vLLM) replays the same speculative schedule.
The reported acceptance must match the reference's within 2 points: a wrong
position, a stale hidden state or an off-by-one slot keeps the text intact
but shows up here.
"""

import json
from pathlib import Path

import pytest

from tests.utils.engine import run_engine
from tools.reference.acceptance import Glm45Reference, measure_acceptance

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"

MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts():
    heldout = json.loads((FIXTURE / "heldout_prompts.json").read_text())
    return [p["token_ids"] for p in heldout]


@pytest.fixture(scope="module")
def reference():
    return Glm45Reference(FIXTURE)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.heavy), 2])
def test_reported_acceptance_matches_reference(prompts, reference, k):
    want = measure_acceptance(FIXTURE, prompts, MAX_NEW, k=k,
                              reference=reference)
    engine = dict(model=str(FIXTURE), dtype="float32", max_model_len=512,
                  max_num_seqs=16, seed=0, kv_cache_memory_bytes=32 << 20,
                  speculative_config=dict(method="glm4_moe_mtp",
                                          num_speculative_tokens=k))
    got = run_engine(engine, prompts,
                     dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert got["outputs"] == want["outputs"]
    m = got["metrics"]
    rate = (m["vllm:spec_decode_num_accepted_tokens"] /
            m["vllm:spec_decode_num_draft_tokens"])
    assert abs(rate - want["acceptance_rate"]) <= 0.02, (rate, want)
    per_pos = [a / m["vllm:spec_decode_num_drafts"]
               for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    for got_p, want_p in zip(per_pos, want["per_position_acceptance"]):
        assert abs(got_p - want_p) <= 0.02, (per_pos, want)
    if k == 1:
        # The trained head really predicts.
        assert rate >= 0.8
