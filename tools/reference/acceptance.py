"""Greedy generation and MTP draft acceptance, as speculative decoding sees it.

Greedy speculative decoding emits exactly the main model's greedy tokens; the
MTP layer only decides how many arrive per step. So the reference first runs
the main model greedily (keeping the hidden state after ``model.norm`` at
every position), then replays the engine's schedule: after the main model
commits token x_m, the MTP layer drafts k tokens from position m - 1 (its
attention cache holds positions 0..m-1 computed from committed tokens), the
drafts are accepted while they equal x_{m+1}, x_{m+2}, ..., and the next step
starts after the accepted tokens plus the main model's own (bonus) token.
The counts are those of vLLM's spec-decode metrics for the same run
(``num_drafts`` = steps, ``num_draft_tokens``, ``num_accepted_tokens``).
"""

from pathlib import Path
from typing import Any, Optional, Union

import torch

from .checkpoint import load_main_model, load_mtp_layer, load_tensors
from .mtp import KVCache, MtpLayer


class Glm45Reference:
    """The main model (transformers) plus the MTP layer (plain torch)."""

    def __init__(self, model_dir: Union[str, Path]) -> None:
        self.model_dir = Path(model_dir)
        self.main = load_main_model(model_dir)
        self.mtp: MtpLayer = load_mtp_layer(model_dir,
                                            load_tensors(model_dir))

    @torch.no_grad()
    def greedy(self, prompt: list[int],
               max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Prompt + greedy tokens, and the final-norm hidden state of every
        position the main model ran (all tokens but the last)."""
        from transformers import DynamicCache

        if not prompt:
            raise ValueError("empty prompt: give at least one token id")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got "
                             f"{max_new_tokens}")
        vocab = self.main.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}); "
                             f"got min {min(prompt)}, max {max(prompt)}")
        cache = DynamicCache(config=self.main.config)
        tokens = list(prompt)
        hidden = []
        step_in = torch.tensor([prompt])
        for _ in range(max_new_tokens):
            out = self.main.model(input_ids=step_in,
                                  past_key_values=cache,
                                  use_cache=True)
            h = out.last_hidden_state[0]
            hidden.append(h)
            nxt = int(self.main.lm_head(h[-1]).argmax())
            tokens.append(nxt)
            step_in = torch.tensor([[nxt]])
        return tokens, torch.cat(hidden)

    @torch.no_grad()
    def mtp_prefill(self, tokens: list[int],
                    hidden: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        """MTP over every position p: token p+1, main hidden p, position p."""
        n = hidden.shape[0]
        ids = torch.tensor([tokens[1:n + 1]])
        pos = torch.arange(n)[None]
        out, cache = self.mtp(ids, pos, hidden[None])
        return out[0], cache

    @torch.no_grad()
    def draft_chain(self, first_hidden: torch.Tensor, position: int,
                    past: KVCache, k: int) -> list[int]:
        """k drafts starting from the MTP output at ``position``.

        ``past`` must hold the MTP cache of positions 0..position.
        """
        drafts = [int(self.mtp.logits(first_hidden).argmax())]
        h = first_hidden
        for j in range(1, k):
            out, past = self.mtp(torch.tensor([[drafts[-1]]]),
                                 torch.tensor([[position + j]]),
                                 h.view(1, 1, -1), past)
            h = out[0, 0]
            drafts.append(int(self.mtp.logits(h).argmax()))
        return drafts

    @torch.no_grad()
    def simulate(self, prompt: list[int], max_new_tokens: int,
                 k: int) -> dict[str, Any]:
        """Replays speculative decoding with k drafts on one prompt.

        Follows vLLM's v1 schedule with ``max_tokens=max_new_tokens`` and
        ``ignore_eos``: the prefill commits the first token, then every step
        verifies k drafts (also when the request will be cut at
        max_new_tokens, so the last drafts are checked against greedy
        tokens past the limit) until max_new_tokens tokens are out.
        """
        if k < 1:
            raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
        tokens, hidden = self.greedy(prompt, max_new_tokens + k)
        g, (keys, values) = self.mtp_prefill(tokens, hidden)
        end = len(prompt) + max_new_tokens  # tokens[P:end] are the outputs
        first_drafts = self.mtp.logits(g).argmax(-1)
        token_hits = [
            int(first_drafts[p]) == tokens[p + 2]
            for p in range(len(prompt) - 1, end - 2)
        ]
        accepted_at = [0] * k
        steps = 0
        m = len(prompt)  # x_m was just sampled by the main model
        while m < end - 1:
            past = (keys[:, :, :m], values[:, :, :m])
            drafts = self.draft_chain(g[m - 1], m - 1, past, k)
            a = 0
            while a < k and drafts[a] == tokens[m + 1 + a]:
                accepted_at[a] += 1
                a += 1
            steps += 1
            m += a + 1
        return {
            "tokens": tokens[:end],
            "steps": steps,
            "accepted_at": accepted_at,
            "token_hits": sum(token_hits),
            "token_total": len(token_hits),
        }


def measure_acceptance(model_dir: Union[str, Path],
                       prompts: list[list[int]],
                       max_new_tokens: int,
                       k: int = 1,
                       reference: Optional[Glm45Reference] = None
                       ) -> dict[str, Any]:
    """Greedy MTP acceptance of ``model_dir`` over ``prompts``.

    The counts use vLLM's names (``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``). Returns also
    ``acceptance_rate`` (accepted / drafted tokens),
    ``per_position_acceptance`` (share of steps whose draft j was accepted),
    ``mean_accepted_length`` (1 + accepted per step: tokens per step),
    ``token_level_k1_acceptance`` (first draft vs the greedy token at every
    generated position) and the greedy ``outputs`` (new tokens per prompt).
    """
    if not prompts:
        raise ValueError("no prompts given")
    ref = reference or Glm45Reference(model_dir)
    steps, hits, total = 0, 0, 0
    accepted_at = [0] * k
    outputs = []
    for prompt in prompts:
        r = ref.simulate(list(prompt), max_new_tokens, k)
        steps += r["steps"]
        accepted_at = [a + b for a, b in zip(accepted_at, r["accepted_at"])]
        hits += r["token_hits"]
        total += r["token_total"]
        outputs.append(r["tokens"][len(prompt):])
    accepted = sum(accepted_at)
    return {
        "model_dir": str(model_dir),
        "k": k,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "num_steps": steps,
        "num_drafts": steps,
        "num_draft_tokens": steps * k,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": accepted_at,
        "acceptance_rate": accepted / max(1, steps * k),
        "per_position_acceptance": [a / max(1, steps) for a in accepted_at],
        "mean_accepted_length": 1 + accepted / max(1, steps),
        "token_level_k1_acceptance": hits / max(1, total),
        "outputs": outputs,
    }
