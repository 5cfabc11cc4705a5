"""Speculation that never loses: the watchdog stops paying for a collapsed
MTP layer, and a request caps its own draft length; the text never changes.

The trained fixture's held-out prompts are decoded greedily with k = 2.
With the MTP layer broken (``collapsed_mtp_layer``: acceptance near 0) the
watchdog pauses speculation within its window, says so once in the log and
in its Prometheus gauge and counter, probes again and pauses again, under
chunked prefill and preemption; with the trained layer and a batch whose
requests cap their draft length at 0, 1 or not at all, it never pauses.
Every output equals transformers' greedy output.
"""

import json
from pathlib import Path

import pytest

from tests.utils.engine import hf_greedy, run_engine

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"
MAX_NEW = 40
WINDOW = 16
PROBE_INTERVAL = 12
PAUSED = "Speculative decoding paused"


@pytest.fixture(scope="module")
def prompts():
    heldout = json.loads((FIXTURE / "heldout_prompts.json").read_text())
    return [p["token_ids"] for p in heldout]


@pytest.fixture(scope="module")
def expected(prompts):
    return hf_greedy(FIXTURE, prompts, MAX_NEW)


def _engine(**mode) -> dict:
    return dict(model=str(FIXTURE), dtype="float32", max_model_len=256,
                max_num_seqs=16, seed=0, kv_cache_memory_bytes=32 << 20,
                **mode)


def _sampling(**extra) -> dict:
    return dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **extra)


def test_collapsed_mtp_layer_falls_back(prompts, expected):
    spec = dict(method="glm4_moe_mtp", num_speculative_tokens=2,
                fallback_window=WINDOW,
                fallback_probe_interval=PROBE_INTERVAL)
    got = run_engine(
        _engine(speculative_config=spec, enable_chunked_prefill=True,
                max_num_batched_tokens=64, num_gpu_blocks_override=40),
        prompts, _sampling(), setup="tests.nightly.injections:"
        "collapsed_mtp_layer", log_match="Speculative decoding")
    assert got["outputs"] == expected
    m = got["metrics"]
    assert m["vllm:num_preemptions"] > 0, m
    # Paused once (failed probes do not count again), and still paused.
    assert m["vllm:spec_decode_num_pauses"] == 1, m
    assert m["vllm:spec_decode_paused"] == 1, m
    assert sum(PAUSED in line for line in got["log"]) == 1, got["log"]
    # It paused within its first window, and probes drafted again: of the
    # 16 x 40 request-steps, only the windows (and the drafts in flight
    # when each closed, at most one step's batch) drafted.
    drafts = m["vllm:spec_decode_num_drafts"]
    assert drafts < 0.5 * len(prompts) * MAX_NEW, m
    assert drafts > WINDOW + len(prompts), m
    accepted = m["vllm:spec_decode_num_accepted_tokens_per_pos"][0]
    assert accepted / drafts < 0.15, m


# Caps through the server and a batch mixing them in the scheduler run in CI
# (tests/server, patch 0012's tests); this engine run in `make nightly`.
@pytest.mark.heavy
def test_good_mtp_layer_and_per_request_caps(prompts, expected):
    spec = dict(method="glm4_moe_mtp", num_speculative_tokens=2,
                fallback_window=WINDOW)
    caps = [0, 1, None, 2]
    sampling = [
        _sampling(**({} if cap is None else dict(
            extra_args={"num_speculative_tokens": cap})))
        for cap in caps * (len(prompts) // len(caps))
    ]
    got = run_engine(_engine(speculative_config=spec), prompts, sampling,
                     log_match=PAUSED)
    assert got["outputs"] == expected
    m = got["metrics"]
    assert m["vllm:spec_decode_num_pauses"] == 0 and got["log"] == [], m
    assert m["vllm:spec_decode_paused"] == 0, m
    # A quarter of the requests never draft; a quarter draft 1 token.
    drafts = m["vllm:spec_decode_num_drafts"]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens"]
    assert drafts <= 0.75 * len(prompts) * MAX_NEW, m
    assert 1.4 * drafts < draft_tokens < 1.9 * drafts, m
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"][0] > 0.7 * drafts
