"""The tiny trained GLM-4.5 checkpoint and the offline MTP reference."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tools.reference import (Glm45Reference, load_tensors, measure_acceptance,
                             read_config)

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"

# The keys of the published GLM-4.5 config.json.
GLM45_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "pad_token_id",
    "eos_token_id", "head_dim", "hidden_act", "hidden_size",
    "partial_rotary_factor", "initializer_range", "intermediate_size",
    "max_position_embeddings", "model_type", "moe_intermediate_size",
    "norm_topk_prob", "num_attention_heads", "n_group", "topk_group",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor",
    "num_experts_per_tok", "first_k_dense_replace", "num_hidden_layers",
    "num_key_value_heads", "rms_norm_eps", "rope_scaling", "rope_theta",
    "num_nextn_predict_layers", "tie_word_embeddings", "torch_dtype",
    "transformers_version", "use_cache", "use_qk_norm", "vocab_size"
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is ~10x faster than two on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors() -> dict:
    return load_tensors(FIXTURE)


@pytest.fixture(scope="module")
def ref() -> Glm45Reference:
    return Glm45Reference(FIXTURE)


@pytest.fixture(scope="module")
def heldout() -> list:
    return json.loads((FIXTURE / "heldout_prompts.json").read_text())


def test_config_has_glm45_keys_and_exercised_values(config):
    assert set(config) == GLM45_KEYS
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["model_type"] == "glm4_moe"
    expected = {
        "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 0.5, "use_qk_norm": True,
        "attention_bias": True, "tie_word_embeddings": False,
        "torch_dtype": "float32"
    }
    assert {k: config[k] for k in expected} == expected
    assert 512 <= config["vocab_size"] <= 1024


def test_two_shards_and_index_cover_every_tensor(tensors):
    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(tensors)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == size
    on_disk = sum((FIXTURE / f).stat().st_size for f in files)
    assert on_disk < 8 * 2**20


def test_main_model_loads_without_missing_keys(config, tensors):
    from transformers import Glm4MoeForCausalLM

    model, info = Glm4MoeForCausalLM.from_pretrained(
        str(FIXTURE), dtype=torch.float32, output_loading_info=True)
    assert model.dtype == torch.float32
    assert info["missing_keys"] == []
    assert info["mismatched_keys"] == []
    mtp = f"model.layers.{config['num_hidden_layers']}."
    # Only the MTP layer is left over, and all of it is.
    assert set(info["unexpected_keys"]) == {
        k for k in tensors if k.startswith(mtp)}
    assert not any(k.startswith(mtp) for k in model.state_dict())


def test_mtp_tensors_exist_with_their_shapes(config, tensors):
    h, v = config["hidden_size"], config["vocab_size"]
    hd, heads = config["head_dim"], config["num_attention_heads"]
    kv, inter = config["num_key_value_heads"], config["moe_intermediate_size"]
    n = config["n_routed_experts"]
    p = f"model.layers.{config['num_hidden_layers']}."
    want = {
        "embed_tokens.weight": (v, h), "enorm.weight": (h,),
        "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, h),
        "self_attn.q_proj.bias": (heads * hd,),
        "self_attn.k_proj.weight": (kv * hd, h),
        "self_attn.k_proj.bias": (kv * hd,),
        "self_attn.v_proj.weight": (kv * hd, h),
        "self_attn.v_proj.bias": (kv * hd,),
        "self_attn.o_proj.weight": (h, heads * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate.weight": (n, h), "mlp.gate.e_score_correction_bias": (n,),
        "mlp.shared_experts.gate_proj.weight": (inter, h),
        "mlp.shared_experts.up_proj.weight": (inter, h),
        "mlp.shared_experts.down_proj.weight": (h, inter),
    }
    for e in range(n):
        want[f"mlp.experts.{e}.gate_proj.weight"] = (inter, h)
        want[f"mlp.experts.{e}.up_proj.weight"] = (inter, h)
        want[f"mlp.experts.{e}.down_proj.weight"] = (h, inter)
    got = {k[len(p):]: tuple(t.shape) for k, t in tensors.items()
           if k.startswith(p)}
    assert got == want
    # Trained with load balancing: the correction bias is not all zeros.
    assert tensors[p + "mlp.gate.e_score_correction_bias"].abs().sum() > 0


def test_mtp_copies_equal_main_embedding_and_head(config, tensors):
    p = f"model.layers.{config['num_hidden_layers']}."
    assert torch.equal(tensors[p + "embed_tokens.weight"],
                       tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[p + "shared_head.head.weight"],
                       tensors["lm_head.weight"])
    assert not torch.equal(tensors["lm_head.weight"],
                           tensors["model.embed_tokens.weight"])


def test_tokenizer_loads_and_matches_heldout_ids(heldout):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURE))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == tok.eos_token
    assert tok.bos_token == "<sop>"
    for item in heldout:
        assert tok(item["text"])["input_ids"] == item["token_ids"]
        assert tok.decode(item["token_ids"],
                          skip_special_tokens=True) == item["text"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"


def _hf_mtp_step(config, tensors, main_hidden, token_ids, positions):
    """The MTP step written with transformers' own GLM-4.5 modules."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer, Glm4MoeRotaryEmbedding)

    cfg = Glm4MoeConfig(**{k: v for k, v in config.items()
                           if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    idx = config["num_hidden_layers"]
    p = f"model.layers.{idx}."
    block = Glm4MoeDecoderLayer(cfg, layer_idx=idx).eval()
    block.load_state_dict({k[len(p):]: v for k, v in tensors.items()
                           if k.startswith(p) and k[len(p):].split(".")[0]
                           in ("self_attn", "mlp", "input_layernorm",
                               "post_attention_layernorm")})

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                   config["rms_norm_eps"])

    emb = tensors[p + "embed_tokens.weight"][token_ids]
    emb = emb * (positions != 0)[..., None]
    x = F.linear(
        torch.cat([rms(emb, tensors[p + "enorm.weight"]),
                   rms(main_hidden, tensors[p + "hnorm.weight"])], -1),
        tensors[p + "eh_proj.weight"])
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    cos_sin = Glm4MoeRotaryEmbedding(cfg)(x, positions)
    out = block(x, attention_mask=mask, position_ids=positions,
                position_embeddings=cos_sin)
    logits = F.linear(rms(out, tensors[p + "shared_head.norm.weight"]),
                      tensors[p + "shared_head.head.weight"])
    return out, logits


@torch.no_grad()
def test_reference_mtp_step_matches_transformers_modules(
        config, tensors, ref, heldout):
    prompt = heldout[0]["token_ids"]
    tokens, hidden = ref.greedy(prompt, 4)
    # The hidden state handed to MTP is the main model's after model.norm.
    assert torch.allclose(hidden, ref.main.model(
        torch.tensor([tokens[:-1]])).last_hidden_state[0], atol=1e-5)
    logits = ref.main(torch.tensor([tokens])).logits[0]
    p = len(prompt)
    assert torch.equal(logits[p - 1:-1].argmax(-1), torch.tensor(tokens[p:]))
    n = hidden.shape[0]
    ids = torch.tensor([tokens[1:n + 1]])
    pos = torch.arange(n)[None]
    want_h, want_logits = _hf_mtp_step(config, tensors, hidden[None], ids,
                                       pos)
    got_h, _ = ref.mtp(ids, pos, hidden[None])
    assert torch.allclose(got_h, want_h, atol=1e-4)
    assert torch.allclose(ref.mtp.logits(got_h), want_logits, atol=1e-4)
    # Position 0 is masked: its token must not change the output there.
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % config["vocab_size"]
    assert torch.allclose(ref.mtp(other, pos, hidden[None])[0][0, 0],
                          got_h[0, 0])


@torch.no_grad()
def test_draft_chain_with_cache_matches_full_recompute(ref, heldout):
    prompt = heldout[1]["token_ids"]
    tokens, hidden = ref.greedy(prompt, 6)
    g, (k, v) = ref.mtp_prefill(tokens, hidden)
    m = len(prompt) + 2
    drafts = ref.draft_chain(g[m - 1], m - 1, (k[:, :, :m], v[:, :, :m]), 3)
    # Recompute without a cache: true inputs 0..m-1, then each draft fed
    # back with the previous MTP output at the next position.
    ids = list(tokens[1:m + 1])
    prev = [hidden[i] for i in range(m)]
    want = []
    for _ in range(3):
        out, _ = ref.mtp(torch.tensor([ids]), torch.arange(len(ids))[None],
                         torch.stack(prev)[None])
        want.append(int(ref.mtp.logits(out[0, -1]).argmax()))
        ids.append(want[-1])
        prev.append(out[0, -1])
    assert drafts == want


@torch.no_grad()
def test_reference_greedy_matches_transformers_generate(ref, heldout):
    prompt = heldout[2]["token_ids"]
    tokens, _ = ref.greedy(prompt, 12)
    out = ref.main.generate(torch.tensor([prompt]), max_new_tokens=12,
                            min_new_tokens=12, do_sample=False)
    assert tokens == out[0].tolist()


def test_heldout_acceptance_k1_is_at_least_80_percent(ref, heldout):
    prompts = [h["token_ids"] for h in heldout]
    r = measure_acceptance(FIXTURE, prompts, 48, 1, reference=ref)
    assert r["num_steps"] > 100
    assert r["acceptance_rate"] >= 0.8, r
    assert r["mean_accepted_length"] == pytest.approx(
        1 + r["acceptance_rate"])


def test_heldout_prompts_were_not_training_prefixes(heldout):
    from tools.reference import corpus

    info = json.loads((FIXTURE / "build_info.json").read_text())
    args = info["args"]
    docs = corpus.documents(int(args["seed"]), int(args["num_docs"]))
    texts = [h["text"] for h in heldout]
    assert texts == corpus.heldout_prompts(int(args["seed"]), docs,
                                           len(texts))
    for t in texts:
        assert not any(d.startswith(t) for d in docs)


def test_bad_input_is_rejected_with_a_clear_error(ref, tmp_path):
    with pytest.raises(ValueError, match="no prompts"):
        measure_acceptance(FIXTURE, [], 4, 1, reference=ref)
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        ref.simulate([1, 2, 3], 4, 0)
    with pytest.raises(ValueError, match="token ids must lie"):
        ref.greedy([10**6], 2)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "glm4_moe", "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="no MTP layer"):
        read_config(tmp_path)
