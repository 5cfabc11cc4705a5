"""MTP speculative decoding changes speed, never text (greedy).

Sixteen prompts decoded together, with k = 1, 2 and 3 draft tokens, with
chunked prefill, and with preemption forced by a KV cache too small for the
batch (k = 3 with the draft length chosen per step, 0 to 3): every output
equals the output without MTP. The k = 1 run also shows
that the draft shares the target's KV cache pool, block tables, embedding
and LM head.
"""

import random

import pytest

from tests.utils.checkpoints import BASE, write_random_glm45
from tests.utils.engine import run_engine, run_engines

MAX_NEW = 24
KV_BYTES = 16 << 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_random_glm45(tmp_path_factory.mktemp("glm45"))
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(1, 60))]
               for _ in range(15)]
    # Drafts would pass max_model_len: the output is cut there, as without
    # MTP.
    prompts.append([rng.randrange(1, 256) for _ in range(250)])
    engine = dict(model=str(path), skip_tokenizer_init=True, dtype="float32",
                  max_model_len=256, max_num_seqs=16, seed=0,
                  kv_cache_memory_bytes=KV_BYTES)
    sampling = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    baseline = run_engine(engine, prompts, sampling)["outputs"]
    return engine, prompts, sampling, baseline


def _run_mtp(setup, k, adaptive=False, **mode):
    engine, prompts, sampling, _ = setup
    spec = dict(method="glm4_moe_mtp", num_speculative_tokens=k,
                adaptive_draft_length=adaptive)
    return run_engine(dict(engine, speculative_config=spec, **mode), prompts,
                      sampling, inspect=True)


@pytest.fixture(scope="module")
def k1_run(setup):
    return _run_mtp(setup, 1, enable_chunked_prefill=True,
                    max_num_batched_tokens=48)


def _check(got, baseline, k, adaptive=False):
    assert got["outputs"] == baseline
    assert len(baseline[-1]) == 256 - 250
    metrics = got["metrics"]
    # Drafts were really proposed and verified: k per draft, except where
    # the scheduler cut them at max_model_len.
    drafts = metrics["vllm:spec_decode_num_drafts"]
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0
    if adaptive:
        # The length chosen per step: shorter drafts than k, too.
        assert drafts <= draft_tokens < k * drafts
    else:
        assert (k - 1) * drafts < draft_tokens <= k * drafts
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k


def test_k1_chunked_prefill(setup, k1_run):
    _check(k1_run, setup[3], 1)


# k = 2 preempted runs in CI through the double (tests/npu/test_npu_engine.py).
@pytest.mark.parametrize("k,mode", [
    pytest.param(2, dict(num_gpu_blocks_override=24),
                 marks=pytest.mark.heavy),
    (3, dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
             num_gpu_blocks_override=24, adaptive=True)),
], ids=["k2-preempted", "k3-chunked-preempted-adaptive"])
def test_mtp_outputs_equal_no_mtp(setup, k, mode):
    got = _run_mtp(setup, k, **mode)
    _check(got, setup[3], k, mode.get("adaptive", False))
    assert got["metrics"]["vllm:num_preemptions"] > 0, got["metrics"]


def test_draft_shares_kv_cache_pool_and_block_tables(k1_run):
    info = k1_run["inspect"]
    draft_layers = info["draft_attn_layers"]
    mtp_layer = BASE["num_hidden_layers"]
    assert draft_layers == [f"model.layers.{mtp_layer}.self_attn.attn"]
    # One KV cache group holds the target's layers and the draft's: one
    # block-table set and one slot mapping serve both.
    assert len(info["kv_cache_groups"]) == 1
    assert set(draft_layers) < set(info["kv_cache_groups"][0])
    assert info["num_block_tables"] == 1
    blocks = info["kv_cache_num_blocks"]
    assert len(set(blocks.values())) == 1
    # KV-cache sizing counts the draft layer: the same memory holds blocks
    # for num_hidden_layers + 1 layers.
    page = 2 * 16 * BASE["num_key_value_heads"] * BASE["head_dim"] * 4
    assert blocks[draft_layers[0]] == KV_BYTES // (page * (mtp_layer + 1))


def test_draft_shares_embedding_and_lm_head(k1_run):
    info = k1_run["inspect"]
    # No vocab-sized tensor of its own: the draft runs on the target's
    # embedding and LM head modules (patch 0005).
    assert info["draft_own_vocab_params"] == []
    assert info["draft_embed_ptr"] == info["target_embed_ptr"]
    assert info["draft_lm_head_ptrs"] == [info["target_lm_head_ptr"]]
    assert info["drafter_class"] == "AscendMtpProposer"


# The series' own tests accept each name (patch 0001); serving each: nightly.
@pytest.mark.heavy
def test_every_mtp_method_name_serves_the_same(setup, k1_run):
    """`deepseek_mtp` (how GLM-4.5/4.6 were served before `glm4_moe_mtp`
    was accepted) and `mtp` run the same draft: same tokens, same
    acceptance. The two engines run side by side."""
    engine, prompts, sampling, _ = setup
    engine = dict(engine, enable_chunked_prefill=True,
                  max_num_batched_tokens=48)
    runs = run_engines({
        method: dict(engine=dict(engine, speculative_config=dict(
            method=method, num_speculative_tokens=1)),
                     prompts=prompts, sampling=sampling)
        for method in ("mtp", "deepseek_mtp")
    })
    for method, got in runs.items():
        assert not isinstance(got, AssertionError), f"{method}: {got}"
        assert got["outputs"] == k1_run["outputs"], method
        for name in ("vllm:spec_decode_num_drafts",
                     "vllm:spec_decode_num_accepted_tokens"):
            assert got["metrics"][name] == k1_run["metrics"][name], name
