"""Build a random GLM-4.5 checkpoint at the real depth, widths scaled down.

    python -m tools.dev.rehearsal.depth [--out DIR] [--hidden-size 64] \
        [--seed 0]

GLM-4.5's config shape (``/work/shared/facts/glm45.md``): 92 decoder
layers, the first 3 dense, then MoE with 160 routed experts, top-8, one
shared expert, ``n_group``/``topk_group`` 1/1; 96 query heads, 8 KV heads,
``head_dim`` 128, partial rotary 0.5, QK norm, QKV bias; vocab 151552; the
MTP layer at ``model.layers.92`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head``, a full MoE decoder block and copies of the embedding and
LM head, as in the published checkpoint). Only ``hidden_size``,
``intermediate_size`` and ``moe_intermediate_size`` are scaled down.

Weights are random from ``--seed`` (small scales: no NaN through 92
layers), written directly as tensors with the real names, in bfloat16 (the
published dtype), sharded like the real checkpoint. The tokenizer is the
fixture's (``tests/fixtures/tiny-glm45``); its vocabulary is smaller than
151552, and the LM head rows past it are zero, as a padded vocabulary's
untrained rows score low: greedy decoding never picks a token the tokenizer
cannot print. Nothing is committed: the checkpoint goes to a cache
directory (default ``$VLLM_ASCEND_CACHE/glm45-depth/...``) and is rebuilt
only when its parameters change (``build_info.json``).
"""

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from tools.dev.fetch_vllm_sdist import default_cache_dir
from tools.reference import corpus
from tools.reference.checkpoint import save_sharded
from tools.reference.config import glm45_config, write_config_files

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
BUILD_INFO = "build_info.json"
FORMAT_VERSION = 1

# GLM-4.5's own values (config.json of zai-org/GLM-4.5); only the widths
# are left to the caller.
GLM45_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 92,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 3,
    "n_routed_experts": 160,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000,
    "use_qk_norm": True,
    "attention_bias": True,
    "vocab_size": 151552,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# GLM-4.5's widths: hidden 5120, dense MLP 12288 (2.4x), experts 1536
# (0.3x). Scaled, the ratios kept where a width stays a multiple of 32.
DEFAULT_HIDDEN = 64
DEFAULT_INTERMEDIATE = 160
DEFAULT_MOE_INTERMEDIATE = 32
# Initialization scales: linear weights like initializer_range; a wider
# router so that routing depends on the token, not only on the bias; an LM
# head that separates the greedy choice from its runner-up by more than
# bfloat16 rounding.
WEIGHT_STD = 0.02
ROUTER_STD = 0.5
BIAS_STD = 0.02
SCORE_BIAS_STD = 0.01
HEAD_STD = 0.1


def depth_config(hidden_size: int = DEFAULT_HIDDEN,
                 intermediate_size: int = DEFAULT_INTERMEDIATE,
                 moe_intermediate_size: int = DEFAULT_MOE_INTERMEDIATE,
                 tokenizer_dir: Path = FIXTURE) -> dict[str, Any]:
    """GLM-4.5's config.json (``glm45_config``'s key set) at the real depth,
    expert and head counts and vocab, with the given widths; special token
    ids from the tokenizer."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    config = glm45_config(GLM45_SHAPE["vocab_size"], ids)
    config.update(GLM45_SHAPE)
    config.update(hidden_size=hidden_size,
                  intermediate_size=intermediate_size,
                  moe_intermediate_size=moe_intermediate_size)
    return config


class _Random:
    """Deterministic bfloat16 tensors from one generator, in call order."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * std).to(dtype)

    @staticmethod
    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=torch.bfloat16)


def _decoder_layer(prefix: str, config: dict[str, Any], moe: bool,
                   rnd: _Random) -> Iterator[tuple[str, torch.Tensor]]:
    h = config["hidden_size"]
    d = config["head_dim"]
    q = config["num_attention_heads"] * d
    kv = config["num_key_value_heads"] * d
    attn = f"{prefix}self_attn."
    yield f"{prefix}input_layernorm.weight", rnd.ones(h)
    yield f"{prefix}post_attention_layernorm.weight", rnd.ones(h)
    for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        yield f"{attn}{name}.weight", rnd.normal(width, h, std=WEIGHT_STD)
        yield f"{attn}{name}.bias", rnd.normal(width, std=BIAS_STD)
    yield f"{attn}o_proj.weight", rnd.normal(h, q, std=WEIGHT_STD)
    yield f"{attn}q_norm.weight", rnd.ones(d)
    yield f"{attn}k_norm.weight", rnd.ones(d)

    def mlp(p: str, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield f"{p}gate_proj.weight", rnd.normal(inter, h, std=WEIGHT_STD)
        yield f"{p}up_proj.weight", rnd.normal(inter, h, std=WEIGHT_STD)
        yield f"{p}down_proj.weight", rnd.normal(h, inter, std=WEIGHT_STD)

    if not moe:
        yield from mlp(f"{prefix}mlp.", config["intermediate_size"])
        return
    experts = config["n_routed_experts"]
    inter = config["moe_intermediate_size"]
    yield f"{prefix}mlp.gate.weight", rnd.normal(experts, h, std=ROUTER_STD)
    # float32 in the published checkpoint.
    yield (f"{prefix}mlp.gate.e_score_correction_bias",
           rnd.normal(experts, std=SCORE_BIAS_STD, dtype=torch.float32))
    for e in range(experts):
        yield from mlp(f"{prefix}mlp.experts.{e}.", inter)
    yield from mlp(f"{prefix}mlp.shared_experts.",
                   inter * config["n_shared_experts"])


def random_tensors(config: dict[str, Any], seed: int,
                   printable_vocab: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, real names, MTP layer last."""
    rnd = _Random(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    layers = config["num_hidden_layers"]
    tensors = {"model.embed_tokens.weight": rnd.normal(vocab, h, std=1.0)}
    for i in range(layers):
        moe = i >= config["first_k_dense_replace"]
        tensors.update(_decoder_layer(f"model.layers.{i}.", config, moe,
                                      rnd))
    tensors["model.norm.weight"] = rnd.ones(h)
    head = torch.zeros(vocab, h, dtype=torch.bfloat16)
    head[:printable_vocab] = rnd.normal(printable_vocab, h, std=HEAD_STD)
    tensors["lm_head.weight"] = head
    for n in range(config["num_nextn_predict_layers"]):
        mtp = f"model.layers.{layers + n}."
        tensors.update(_decoder_layer(mtp, config, True, rnd))
        tensors[f"{mtp}enorm.weight"] = rnd.ones(h)
        tensors[f"{mtp}hnorm.weight"] = rnd.ones(h)
        tensors[f"{mtp}eh_proj.weight"] = rnd.normal(h, 2 * h,
                                                     std=WEIGHT_STD)
        tensors[f"{mtp}shared_head.norm.weight"] = rnd.ones(h)
        # GLM-4.5 carries copies of the embedding and the head here.
        tensors[f"{mtp}embed_tokens.weight"] = (
            tensors["model.embed_tokens.weight"].clone())
        tensors[f"{mtp}shared_head.head.weight"] = head.clone()
    return tensors


def default_out(hidden_size: int, seed: int) -> Path:
    return default_cache_dir() / "glm45-depth" / f"float-h{hidden_size}-s{seed}"


def build(out: Optional[Path] = None, hidden_size: int = DEFAULT_HIDDEN,
          intermediate_size: int = DEFAULT_INTERMEDIATE,
          moe_intermediate_size: int = DEFAULT_MOE_INTERMEDIATE,
          seed: int = 0, num_shards: int = 8,
          force: bool = False) -> tuple[Path, bool]:
    """(the checkpoint directory, whether it was built now). A directory
    built with the same parameters is reused."""
    out = out or default_out(hidden_size, seed)
    config = depth_config(hidden_size, intermediate_size,
                          moe_intermediate_size)
    params = {"format": FORMAT_VERSION, "seed": seed,
              "num_shards": num_shards, "config": config}
    info_path = out / BUILD_INFO
    if not force and info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("params") == params:
            return out, False
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    start = time.perf_counter()
    from tokenizers import Tokenizer
    printable = Tokenizer.from_file(str(FIXTURE / "tokenizer.json")
                                    ).get_vocab_size(with_added_tokens=True)
    tensors = random_tensors(config, seed, printable)
    files = save_sharded(out, tensors, num_shards=num_shards)
    write_config_files(out, config)
    for name in TOKENIZER_FILES:
        if (FIXTURE / name).exists():
            shutil.copy(FIXTURE / name, out / name)
    info = {
        "params": params,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(f.stat().st_size for f in files),
        "printable_vocab": printable,
        "seconds": round(time.perf_counter() - start, 1),
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return out, True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        help="default: $VLLM_ASCEND_CACHE/glm45-depth/"
                        "float-h<H>-s<SEED>")
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_HIDDEN)
    parser.add_argument("--intermediate-size", type=int,
                        default=DEFAULT_INTERMEDIATE)
    parser.add_argument("--moe-intermediate-size", type=int,
                        default=DEFAULT_MOE_INTERMEDIATE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if --out holds this build")
    args = parser.parse_args(argv)
    out, built = build(args.out, args.hidden_size, args.intermediate_size,
                       args.moe_intermediate_size, args.seed,
                       args.num_shards, args.force)
    info = json.loads((out / BUILD_INFO).read_text())
    print(f"{'Built' if built else 'Reused'} {out}: {info['tensors']} "
          f"tensors, {info['parameters'] / 1e6:.1f} M parameters, "
          f"{info['bytes'] / 2**20:.0f} MiB ({info['seconds']} s to build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
