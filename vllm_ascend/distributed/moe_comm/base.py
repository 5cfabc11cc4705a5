"""One interface for the MoE communication methods.

A method decides where the routed experts of a token are computed:

- ``dispatch`` / ``combine`` run around the whole MoE layer when vLLM calls
  the EP group's (data parallelism): all-gather moves every DP rank's
  tokens to every rank and sums the partial results back; the exchanging
  methods leave the tokens where they are.
- ``experts`` runs around the expert computation, after routing: all-gather
  computes this rank's experts for every token it holds; the exchanging
  methods send each (token, expert) pair to the rank that holds the expert
  and bring the result back.

``compute(x, topk_weights, topk_ids, expert_map)`` is the layer's expert
kernel (float or W8A8) on global expert ids; rows whose expert another rank
holds come back zero. ``grouped`` (a ``GroupedMLP``), where the layer has
one (the NPU's SwiGLU experts), runs rows already grouped by local expert
(cumulative counts) through their experts' MLP: what the NPU's fused MC2
dispatch hands over.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch

ExpertsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    torch.Tensor]


@dataclass(frozen=True)
class GroupedMLP:
    """``run(rows, group_ends, row_scales)``: the layer's grouped experts.

    ``takes_int8`` (W8A8 experts): the rows may come quantized, int8 with
    float32 per-row scales, so an exchange can send int8 (half the bytes
    of bfloat16) and the experts skip their own quantization; float rows
    come with ``row_scales`` None.
    """
    run: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
                  torch.Tensor]
    takes_int8: bool = False

    def __call__(self,
                 rows: torch.Tensor,
                 group_ends: torch.Tensor,
                 row_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.run(rows, group_ends, row_scales)


class MoECommMethod(ABC):
    name: str
    # Static shapes and no host reads: may run inside a captured graph.
    graph_safe: bool

    def dispatch(self, communicator, hidden_states: torch.Tensor,
                 router_logits: torch.Tensor, is_sequence_parallel: bool):
        return hidden_states, router_logits

    def combine(self, communicator, hidden_states: torch.Tensor,
                is_sequence_parallel: bool) -> torch.Tensor:
        return hidden_states

    @abstractmethod
    def experts(self, layer: torch.nn.Module, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor], compute: ExpertsFn,
                apply_router_weight_on_input: bool,
                grouped: Optional[GroupedMLP] = None) -> torch.Tensor:
        raise NotImplementedError
