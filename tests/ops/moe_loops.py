"""Independent per-token python loops for MoE routing and experts (float64).

Written from the GLM-4.5 routing description, not from the code under test.
"""

import math
from typing import Optional

import torch


def route_token(logits: list[float], bias: Optional[list[float]], top_k: int,
                n_group: int, topk_group: int, renormalize: bool,
                scale: float, scoring: str) -> dict[int, float]:
    """{expert: weight} for one token."""
    if scoring == "sigmoid":
        s = [1 / (1 + math.exp(-v)) for v in logits]
    else:
        m = max(logits)
        ex = [math.exp(v - m) for v in logits]
        s = [v / sum(ex) for v in ex]
    num_experts = len(s)
    c = s if bias is None else [si + bi for si, bi in zip(s, bias)]
    size = num_experts // n_group
    group_score = []
    for g in range(n_group):
        members = sorted(c[g * size:(g + 1) * size], reverse=True)
        group_score.append(sum(members[:2]) if bias is not None else
                           members[0])
    groups = sorted(range(n_group), key=lambda g: -group_score[g])
    groups = groups[:topk_group]
    candidates = [e for e in range(num_experts) if e // size in groups]
    chosen = sorted(candidates, key=lambda e: -c[e])[:top_k]
    w = [s[e] for e in chosen]
    if renormalize:
        w = [v / sum(w) for v in w]
    return {e: v * scale for e, v in zip(chosen, w)}


def route(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
          n_group: int, topk_group: int, renormalize: bool, scale: float,
          scoring: str) -> list[dict[int, float]]:
    b = None if bias is None else bias.double().tolist()
    return [
        route_token(row, b, top_k, n_group, topk_group, renormalize, scale,
                    scoring) for row in logits.double().tolist()
    ]


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            routes: list[dict[int, float]]) -> torch.Tensor:
    """y[t] = sum_e w * W2_e (silu(gate_e x) * up_e x), float64."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, r in enumerate(routes):
        xt = x[t].double()
        for e, w in r.items():
            gate = w13[e, :inter].double() @ xt
            up = w13[e, inter:].double() @ xt
            h = gate * torch.sigmoid(gate) * up
            out[t] += w * (w2[e].double() @ h)
    return out
