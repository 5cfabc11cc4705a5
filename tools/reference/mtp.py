"""GLM-4.5's multi-token-prediction (MTP) layer in plain torch.

One MTP step, as vLLM 0.11 runs it (``glm4_moe_mtp.py`` and
``v1/spec_decode/eagle.py``):

    e = enorm(embed(token at t+1)), zeroed where position == 0
    h = hnorm(previous hidden state at t)
    x = eh_proj(cat(e, h))
    x = decoder_block(x) + residual          # attention + routed MoE
    logits(t+2) = shared_head.head(shared_head.norm(x))

For the first draft the previous hidden state is the main model's output
AFTER ``model.norm`` (what ``Glm4MoeModel.forward`` returns to the runner);
for later drafts it is this layer's own output ``x`` (before
``shared_head.norm``), at position + 1.

Parameter names match the checkpoint tensors under
``model.layers.<num_hidden_layers>.`` so ``load_state_dict`` works on the
stripped names.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MtpDims:
    """The config values the MTP layer needs (a subset of Glm4MoeConfig)."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    use_qk_norm: bool

    @classmethod
    def from_config(cls, config) -> "MtpDims":
        """Reads the fields from a ``Glm4MoeConfig`` or a config.json dict."""
        get = (config.get if isinstance(config, dict) else
               lambda k, d=None: getattr(config, k, d))
        hidden = get("hidden_size")
        heads = get("num_attention_heads")
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim") or hidden // heads,
            moe_intermediate_size=get("moe_intermediate_size"),
            n_routed_experts=get("n_routed_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_shared_experts=get("n_shared_experts"),
            n_group=get("n_group"),
            topk_group=get("topk_group"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            partial_rotary_factor=float(get("partial_rotary_factor", 1.0)),
            rope_theta=float(get("rope_theta")),
            rms_norm_eps=float(get("rms_norm_eps")),
            attention_bias=bool(get("attention_bias")),
            use_qk_norm=bool(get("use_qk_norm")),
        )


class RMSNorm(nn.Module):

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + (rotary_dim,), neox layout."""
    inv_freq = 1.0 / (theta**(
        torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first ``cos.shape[-1]`` dims of x [B, heads, T, D]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):

    def __init__(self, d: MtpDims) -> None:
        super().__init__()
        self.d = d
        h, hd = d.hidden_size, d.head_dim
        self.q_proj = nn.Linear(h, d.num_attention_heads * hd,
                                bias=d.attention_bias)
        self.k_proj = nn.Linear(h, d.num_key_value_heads * hd,
                                bias=d.attention_bias)
        self.v_proj = nn.Linear(h, d.num_key_value_heads * hd,
                                bias=d.attention_bias)
        self.o_proj = nn.Linear(d.num_attention_heads * hd, h, bias=False)
        if d.use_qk_norm:
            self.q_norm = RMSNorm(hd, d.rms_norm_eps)
            self.k_norm = RMSNorm(hd, d.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: Optional[KVCache] = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """x [B, T, H]; past keys/values [B, kv_heads, P, D] precede x."""
        d = self.d
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, d.num_attention_heads, d.head_dim)
        k = self.k_proj(x).view(b, t, d.num_key_value_heads, d.head_dim)
        v = self.v_proj(x).view(b, t, d.num_key_value_heads, d.head_dim)
        if d.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rotary_dim = int(d.head_dim * d.partial_rotary_factor)
        cos, sin = rope_cos_sin(positions, rotary_dim, d.rope_theta)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        total = k.shape[2]
        # Query i sits at cache index total - t + i and sees keys up to it.
        q_idx = torch.arange(total - t, total)[:, None]
        mask = torch.arange(total)[None, :] <= q_idx
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out), (k, v)


class Expert(nn.Module):

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; the bias only chooses, the weights are the scores."""

    def __init__(self, d: MtpDims) -> None:
        super().__init__()
        self.d = d
        self.weight = nn.Parameter(
            torch.empty(d.n_routed_experts, d.hidden_size))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(d.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.d
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores.detach() + self.e_score_correction_bias
        per_group = d.n_routed_experts // d.n_group
        grouped = choice.view(-1, d.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(-1)
        groups = group_scores.topk(d.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(
            -1, d.n_routed_experts)
        choice = choice.masked_fill(keep == 0, float("-inf"))
        idx = choice.topk(d.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, idx)
        if d.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * d.routed_scaling_factor


class MoE(nn.Module):

    def __init__(self, d: MtpDims) -> None:
        super().__init__()
        self.gate = Router(d)
        self.experts = nn.ModuleList(
            Expert(d.hidden_size, d.moe_intermediate_size)
            for _ in range(d.n_routed_experts))
        self.shared_experts = Expert(
            d.hidden_size, d.moe_intermediate_size * d.n_shared_experts)
        self.last_topk: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.gate(flat)
        self.last_topk = idx.detach()
        out = torch.zeros(flat.shape, dtype=weights.dtype)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                y = expert(flat[tok]) * weights[tok, slot, None]
                out = out.index_add(0, tok, y)
        out = out.to(x.dtype) + self.shared_experts(flat)
        return out.view(shape)


class SharedHead(nn.Module):

    def __init__(self, d: MtpDims) -> None:
        super().__init__()
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)


class MtpLayer(nn.Module):
    """The layer ``model.layers.<num_hidden_layers>`` of a GLM-4.5 checkpoint.

    ``embed_tokens`` and ``shared_head.head`` may be the main model's modules
    (tied, as in training) or loaded copies.
    """

    def __init__(self, d: MtpDims,
                 embed_tokens: Optional[nn.Embedding] = None,
                 lm_head: Optional[nn.Linear] = None) -> None:
        super().__init__()
        self.d = d
        self.embed_tokens = embed_tokens or nn.Embedding(
            d.vocab_size, d.hidden_size)
        self.enorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.hnorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d.hidden_size, d.hidden_size,
                                 bias=False)
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size,
                                                d.rms_norm_eps)
        self.mlp = MoE(d)
        self.shared_head = SharedHead(d)
        if lm_head is not None:
            self.shared_head.head = lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        past: Optional[KVCache] = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """input_ids/positions [B, T], previous_hidden [B, T, H].

        Returns the layer output (the next step's previous hidden state) and
        the attention cache including these T tokens.
        """
        e = self.embed_tokens(input_ids)
        e = torch.where((positions == 0)[..., None], torch.zeros_like(e), e)
        x = self.eh_proj(
            torch.cat([self.enorm(e), self.hnorm(previous_hidden)], dim=-1))
        attn, cache = self.self_attn(self.input_layernorm(x), positions, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))
