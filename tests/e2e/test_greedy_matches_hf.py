"""Greedy outputs through the plugin equal transformers' Glm4MoeForCausalLM.

Eight prompts of different lengths are decoded together (32 new tokens
each), with chunked prefill forced by a small token budget and with prefix
caching on prompts that share prefixes, over GLM-4.5 variants: QK norm on
and off, one or two dense layers, different expert counts.
"""

import random

import pytest

from tests.utils.checkpoints import write_random_glm45
from tests.utils.engine import hf_greedy, run_engine

MAX_NEW = 32

VARIANTS = {
    "qk_norm": {},
    "no_qk_norm_2_dense_6_experts_top3": dict(
        use_qk_norm=False, first_k_dense_replace=2, num_hidden_layers=3,
        n_routed_experts=6, num_experts_per_tok=3, routed_scaling_factor=1.0),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)]
               for n in (1, 3, 9, 17, 33, 70)]
    # Two prompts share a 40-token prefix: prefix caching reuses its blocks.
    prompts += [shared + [5, 6, 7], shared + [9] * 12]
    return prompts


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = write_random_glm45(tmp_path_factory.mktemp(request.param),
                              **VARIANTS[request.param])
    prompts = _prompts(256)
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


MODES = {
    "qk_norm": dict(enable_chunked_prefill=True, max_num_batched_tokens=32,
                    enable_prefix_caching=True),
    "no_qk_norm_2_dense_6_experts_top3": dict(
        enable_chunked_prefill=False, max_num_batched_tokens=512,
        enable_prefix_caching=False),
}


def test_greedy_matches_transformers(variant):
    name, path, prompts, expected = variant
    mode = MODES[name]
    engine = dict(model=str(path), skip_tokenizer_init=True, dtype="float32",
                  max_model_len=512, max_num_seqs=8, seed=0, **mode)
    got = run_engine(engine, prompts,
                     dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert got["outputs"] == expected
    if mode["enable_prefix_caching"]:
        hits = got["metrics"].get("vllm:prefix_cache_hits", 0)
        assert hits > 0, got["metrics"]
