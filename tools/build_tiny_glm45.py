"""Build the tiny trained GLM-4.5 checkpoint (with its MTP layer).

    python tools/build_tiny_glm45.py --seed 0 --out tests/fixtures/tiny-glm45

Steps, all deterministic from ``--seed``: a template corpus
(``glm45ref.corpus``), a byte-level BPE tokenizer trained on it, a
``Glm4MoeForCausalLM`` with GLM-4.5's config keys trained jointly with the
MTP layer (``glm45ref.mtp``; its embedding and head tied to the main
model's), then the MTP layer alone distilled on the main model's greedy
choices. Writes the checkpoint in the real GLM-4.5 layout (2 safetensors
shards + index, the MTP layer at ``model.layers.<num_hidden_layers>`` with
copies of the embedding and head), the tokenizer, held-out prompts, and a
README with the measured greedy MTP acceptance.
"""

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glm45ref import corpus  # noqa: E402
from glm45ref.acceptance import Glm45Reference, measure_acceptance  # noqa
from glm45ref.checkpoint import save_sharded  # noqa: E402
from glm45ref.mtp import MtpDims, MtpLayer  # noqa: E402

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def glm45_config(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """GLM-4.5's config.json key set, tiny sizes."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": ids[corpus.EOS],
        "eos_token_id": [ids[corpus.EOS], ids[corpus.USER]],
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": vocab_size,
    }


def train_tokenizer(docs: list[str], vocab_size: int, out: Path):
    """Byte-level BPE; encoding plain text prepends ``[gMASK]<sop>``."""
    from tokenizers import (Tokenizer, decoders, models, pre_tokenizers,
                            processors, trainers)
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=corpus.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(docs, trainer)
    gmask, sop = tok.token_to_id(corpus.GMASK), tok.token_to_id(corpus.SOP)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{corpus.GMASK} {corpus.SOP} $A",
        pair=f"{corpus.GMASK} {corpus.SOP} $A $B",
        special_tokens=[(corpus.GMASK, gmask), (corpus.SOP, sop)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=corpus.SOP,
        eos_token=corpus.EOS,
        pad_token=corpus.EOS,
        additional_special_tokens=[corpus.GMASK, corpus.SYSTEM, corpus.USER,
                                   corpus.ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return fast


class Windows:
    """Training windows that start at document starts (position 0 is
    ``[gMASK]``, as at inference) and run on into the following documents."""

    def __init__(self, docs_ids: list[list[int]], length: int,
                 seed: int) -> None:
        self.stream = [t for d in docs_ids for t in d]
        self.starts, acc = [], 0
        for d in docs_ids:
            if acc + length < len(self.stream):
                self.starts.append(acc)
            acc += len(d)
        self.length = length
        self.rng = random.Random(seed)

    def batch(self, size: int) -> torch.Tensor:
        rows = []
        for _ in range(size):
            s = self.rng.choice(self.starts)
            rows.append(self.stream[s:s + self.length])
        return torch.tensor(rows)


def routers(model, mtp: MtpLayer) -> list[tuple[Any, Any]]:
    """(gate module, how to read its last top-k) for every MoE layer."""
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeTopkRouter)

    found = []
    for module in model.modules():
        if isinstance(module, Glm4MoeTopkRouter):
            slot: dict[str, torch.Tensor] = {}

            def hook(_m, _i, out, slot=slot):
                slot["idx"] = out[0].detach()

            module.register_forward_hook(hook)
            found.append((module, lambda slot=slot: slot.get("idx")))
    found.append((mtp.mlp.gate, lambda: mtp.mlp.last_topk))
    return found


@torch.no_grad()
def balance(gates: list, n_experts: int, speed: float) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): nudge each
    expert's ``e_score_correction_bias`` toward equal load."""
    for gate, last in gates:
        idx = last()
        if idx is None:
            continue
        load = torch.bincount(idx.flatten(), minlength=n_experts).float()
        gate.e_score_correction_bias += speed * torch.sign(load.mean() -
                                                           load)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def mtp_inputs(x: torch.Tensor, hidden: torch.Tensor):
    """MTP at position p reads token p+1 and the main hidden state at p."""
    t = x.shape[1] - 1
    pos = torch.arange(t - 1)[None].expand(x.shape[0], -1)
    return x[:, 1:t], pos, hidden[:, :t - 1]


def train_joint(model, mtp: MtpLayer, windows: Windows, args,
                log: list) -> None:
    """Main LM loss + mtp_weight * MTP loss (token t+2), tied embed/head."""
    params = list({id(p): p for p in list(model.parameters()) +
                   list(mtp.parameters())}.values())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    gates = routers(model, mtp)
    n_exp = model.config.n_routed_experts
    model.train()
    mtp.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, 50)
        x = windows.batch(args.batch)
        hidden = model.model(input_ids=x[:, :-1]).last_hidden_state
        logits = model.lm_head(hidden)
        lm = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        ids, pos, prev = mtp_inputs(x, hidden)
        out, _ = mtp(ids, pos, prev)
        mtp_loss = F.cross_entropy(mtp.logits(out).flatten(0, 1),
                                   x[:, 2:].flatten())
        loss = lm + args.mtp_weight * mtp_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance(gates, n_exp, args.balance_speed)
        if step % 50 == 0 or step == args.steps - 1:
            log.append({"phase": "joint", "step": step, "lm": lm.item(),
                        "mtp": mtp_loss.item()})
            print(json.dumps(log[-1]), flush=True)


@torch.no_grad()
def greedy_batch(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuations of equal-length prompts."""
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                         max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out


def distill_mtp(model, mtp: MtpLayer, windows: Windows, docs_ids,
                args, log: list) -> None:
    """MTP alone learns the main model's greedy token at t+2, on corpus
    windows and on the main model's own greedy continuations."""
    model.eval()
    mtp.train()
    shared = {id(mtp.embed_tokens.weight), id(mtp.shared_head.head.weight)}
    params = [p for p in mtp.parameters() if id(p) not in shared]
    for p in model.parameters():
        p.requires_grad_(False)
    rng = random.Random(args.seed + 1)
    starts = [d[:args.gen_prompt_len] for d in docs_ids
              if len(d) > args.gen_prompt_len]
    generated = []
    for _ in range(args.gen_batches):
        prompts = torch.tensor(rng.sample(starts, args.batch))
        generated.append(greedy_batch(model, prompts, args.gen_new_tokens))
    opt = torch.optim.AdamW(params, lr=args.distill_lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    gates = [(mtp.mlp.gate, lambda: mtp.mlp.last_topk)]
    for step in range(args.distill_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.distill_steps, args.distill_lr, 20)
        if step % 2 == 0:
            x = windows.batch(args.batch)
        else:
            x = generated[rng.randrange(len(generated))]
        with torch.no_grad():
            hidden = model.model(input_ids=x).last_hidden_state
            # main model's greedy token after position p+1 (for t+2)
            target = model.lm_head(hidden).argmax(-1)[:, 1:-1]
        ids, pos, prev = mtp_inputs(x, hidden)
        out, _ = mtp(ids, pos, prev)
        loss = F.cross_entropy(mtp.logits(out).flatten(0, 1),
                               target.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance(gates, model.config.n_routed_experts, args.balance_speed)
        if step % 50 == 0 or step == args.distill_steps - 1:
            log.append({"phase": "distill", "step": step,
                        "mtp": loss.item()})
            print(json.dumps(log[-1]), flush=True)


def checkpoint_tensors(model, mtp: MtpLayer) -> dict[str, torch.Tensor]:
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    for k, v in mtp.state_dict().items():
        tensors[prefix + k] = v.detach().clone()
    return tensors


def write_readme(out: Path, info: dict[str, Any]) -> None:
    """The fixture's README, numbers filled in from this build."""
    acc = info["acceptance"]
    rows = "\n".join(
        f"| {k[1:]} | {r['acceptance_rate']:.3f} | "
        f"{', '.join(f'{a:.3f}' for a in r['per_position_acceptance'])} | "
        f"{r['mean_accepted_length']:.3f} | {r['num_steps']} |"
        for k, r in acc.items())
    shards = ", ".join(f"`{n}` {b / 2**20:.2f} MiB"
                       for n, b in info["shard_bytes"].items())
    text = f"""# tiny-glm45: a trained GLM-4.5-architecture checkpoint with MTP

Built by `tools/build_tiny_glm45.py` (do not edit by hand; re-run it):

    {info["command"]}

torch {info["torch_version"]}, transformers {info["transformers_version"]},
{info["args"]["threads"]} CPU thread(s); training took
{info["train_seconds"]:.0f} s ({info["total_seconds"]:.0f} s in all) with a
machine load average of {info.get("load_average", "n/a")} (on a shared CPU
the time grows with the load).
Same seed, same torch: the same tensors (float reductions may differ across
torch versions or thread counts).

## What it is
- `config.json`: GLM-4.5's config keys (`Glm4MoeForCausalLM`, `glm4_moe`),
  3 main layers (layer 0 dense, layers 1-2 MoE: 8 routed experts, top-2,
  1 shared expert, sigmoid routing with `e_score_correction_bias`,
  `routed_scaling_factor` 2.5), hidden 128, 4 heads x 32 (2 KV heads),
  `partial_rotary_factor` 0.5, qk-norm, attention bias, float32.
- `model-0000{{1,2}}-of-00002.safetensors` + `model.safetensors.index.json`
  ({shards}): real tensor names; the MTP layer is `model.layers.3.*`
  (`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
  `shared_head.head`, a full MoE decoder block). Its `embed_tokens` and
  `shared_head.head` are copies of `model.embed_tokens` and `lm_head`
  (they were tied during training).
- `tokenizer.json`, `tokenizer_config.json`: byte-level BPE trained on the
  corpus; plain encoding prepends `[gMASK]<sop>`; eos and pad
  `<|endoftext|>`; a chat template `[gMASK]<sop><|user|>\\n...<|assistant|>\\n`.
- `heldout_prompts.json`: {acc["k1"]["num_prompts"]} prompts (text and token ids) that
  no training document starts with.
- `build_info.json`: arguments, losses, timings, the numbers below.

## How it was trained
Corpus: `glm45ref.corpus.documents(seed, {info["args"]["num_docs"]})`, template
English about a seeded toy world. Phase 1: main LM loss +
{info["args"]["mtp_weight"]} x MTP loss (token t+2) for {info["args"]["steps"]} steps; the
MTP layer reads the main model's hidden state after `model.norm`, exactly
what vLLM's `Glm4MoeModel.forward` returns to the drafter. Phase 2: the
main model frozen, the MTP layer alone learns the main model's greedy token
at t+2 ({info["args"]["distill_steps"]} steps, corpus windows and greedy continuations).
Auxiliary-loss-free balancing moves `e_score_correction_bias`.

## Measured greedy MTP acceptance (held-out prompts, {acc["k1"]["max_new_tokens"]} new tokens)
Replaying speculative decoding with `tools/glm45_reference.py`
(`glm45ref.measure_acceptance`): per step k drafts, accepted while they
equal the main model's greedy tokens. The steps and accepted counts are
what vLLM's spec-decode counters (`num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`, per position) report for the same prompts with
`temperature=0`, `max_tokens={acc["k1"]["max_new_tokens"]}`, `ignore_eos=True`, provided
vLLM's greedy outputs equal the reference's.

| k | acceptance rate | per position | mean accepted length | steps |
|---|---|---|---|---|
{rows}

k=1 token-level (first draft at every generated position):
{acc["k1"]["token_level_k1_acceptance"]:.3f}.

Reproduce the numbers:

    .venv/bin/python tools/glm45_reference.py --model-dir tests/fixtures/tiny-glm45 --k 1 2 3
"""
    (out / "README.md").write_text(text)


def measure_all(out: Path, max_new_tokens: int) -> dict[str, Any]:
    """Held-out acceptance for k = 1, 2, 3."""
    heldout = json.loads((out / "heldout_prompts.json").read_text())
    prompts = [h["token_ids"] for h in heldout]
    ref = Glm45Reference(out)
    results = {}
    for k in (1, 2, 3):
        r = measure_acceptance(out, prompts, max_new_tokens, k,
                               reference=ref)
        r.pop("outputs")
        r.pop("model_dir")
        results[f"k{k}"] = r
        print(json.dumps({f"k{k}": r}), flush=True)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-docs", type=int, default=20000)
    p.add_argument("--vocab-size", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--balance-speed", type=float, default=1e-3)
    p.add_argument("--distill-steps", type=int, default=250)
    p.add_argument("--distill-lr", type=float, default=2e-3)
    p.add_argument("--gen-batches", type=int, default=6)
    p.add_argument("--gen-prompt-len", type=int, default=10)
    p.add_argument("--gen-new-tokens", type=int, default=80)
    p.add_argument("--num-heldout", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--remeasure", action="store_true",
                   help="no training: measure <out> again, update "
                   "build_info.json and README.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import transformers
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.remeasure:
        info = json.loads((args.out / "build_info.json").read_text())
        info["acceptance"] = measure_all(args.out, args.max_new_tokens)
        (args.out / "build_info.json").write_text(
            json.dumps(info, indent=1) + "\n")
        write_readme(args.out, info)
        return 0
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    docs = corpus.documents(args.seed, args.num_docs)
    tok = train_tokenizer(docs, args.vocab_size, out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in corpus.SPECIAL_TOKENS}
    vocab = max(512, -(-len(tok) // 64) * 64)
    docs_ids = [tok(d)["input_ids"] + [ids[corpus.EOS]] for d in docs]
    prompts_text = corpus.heldout_prompts(args.seed, docs, args.num_heldout)
    heldout = [{"text": t, "token_ids": tok(t)["input_ids"]}
               for t in prompts_text]
    (out / "heldout_prompts.json").write_text(json.dumps(heldout, indent=1)
                                              + "\n")

    config = glm45_config(vocab, ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "_from_model_config": True,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "transformers_version": config["transformers_version"],
    }, indent=2) + "\n")

    hf_config = Glm4MoeConfig(**{k: v for k, v in config.items()
                                 if k not in ("architectures",
                                              "model_type")})
    model = Glm4MoeForCausalLM(hf_config).float()
    mtp = MtpLayer(MtpDims.from_config(config),
                   embed_tokens=model.model.embed_tokens,
                   lm_head=model.lm_head)
    shared = {id(mtp.embed_tokens.weight), id(mtp.shared_head.head.weight)}
    for name, p in mtp.named_parameters():
        if id(p) not in shared and p.dim() == 2:
            torch.nn.init.normal_(p, std=config["initializer_range"])

    log: list[dict] = []
    windows = Windows(docs_ids, args.seq_len + 1, args.seed)
    t_train = time.time()
    train_joint(model, mtp, windows, args, log)
    distill_mtp(model, mtp, windows, docs_ids, args, log)
    train_seconds = time.time() - t_train

    files = save_sharded(out, checkpoint_tensors(model, mtp))
    results = measure_all(out, args.max_new_tokens)
    info = {
        "command": "python tools/build_tiny_glm45.py " +
        " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "train_seconds": round(train_seconds, 1),
        "load_average": round(os.getloadavg()[1], 1),
        "total_seconds": round(time.time() - t0, 1),
        "shard_bytes": {f.name: f.stat().st_size for f in files},
        "acceptance": results,
        "log": log,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    write_readme(out, info)
    print(json.dumps({k: info[k] for k in ("train_seconds",
                                           "total_seconds",
                                           "shard_bytes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
