"""MTP speculative decoding changes speed, never text (greedy).

Sixteen prompts decoded together, with k = 1, 2 and 3 draft tokens, with
chunked prefill, and with preemption forced by a KV cache too small for the
batch: every output equals the output without MTP.
"""

import random

import pytest

from tests.e2e.checkpoints import write_random_glm45
from tests.e2e.engine import run_engine

MAX_NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_random_glm45(tmp_path_factory.mktemp("glm45"))
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(1, 60))]
               for _ in range(16)]
    engine = dict(model=str(path), skip_tokenizer_init=True, dtype="float32",
                  max_model_len=256, max_num_seqs=16, seed=0)
    sampling = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    baseline = run_engine(engine, prompts, sampling)["outputs"]
    return engine, prompts, sampling, baseline


@pytest.mark.parametrize("k,mode", [
    (1, dict(enable_chunked_prefill=True, max_num_batched_tokens=48)),
    (2, dict(num_gpu_blocks_override=24)),
    (3, dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
             num_gpu_blocks_override=24)),
], ids=["k1-chunked", "k2-preempted", "k3-chunked-preempted"])
def test_mtp_outputs_equal_no_mtp(setup, k, mode):
    engine, prompts, sampling, baseline = setup
    spec = dict(method="glm4_moe_mtp", num_speculative_tokens=k)
    got = run_engine(dict(engine, speculative_config=spec, **mode), prompts,
                     sampling)
    assert got["outputs"] == baseline
    metrics = got["metrics"]
    # Drafts were really proposed and verified (k per draft).
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == k * drafts
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    if "num_gpu_blocks_override" in mode:
        assert metrics["vllm:num_preemptions"] > 0, metrics
