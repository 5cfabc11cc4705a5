"""How many graph capture sizes fit in an NPU's streams.

Every captured ACL graph holds a device stream until it is destroyed, and
an NPU has 2,048; past them capture fails with ``207008 Stream resources
are insufficient`` (or ``207005 Alloc sq cq fail`` on older drivers).
vllm-ascend, which runs on that hardware, leaves 248 to the runtime (graphs
at most 1,800) and, in HCCL's default (FFTS+) expansion, counts per
communication group 40 streams of its own plus two more for every graph
that communicates on it (v0.11.0 ``update_aclgraph_sizes``). Here the same
accounting covers every graph the plugin captures per size: one per piece
(attention layers + 1) in the piecewise modes, one full graph in the full
modes, and one MTP draft graph when the draft is captured.

Where vLLM's sizes do not fit, sizes are dropped evenly, keeping the
smallest and the largest, with one warning naming them: a batch between
two kept sizes is padded up to the next one.
"""

import dataclasses
import math

NPU_STREAMS = 2048
# Streams vllm-ascend leaves to the runtime (its 1,800-graph ceiling).
RUNTIME_STREAMS = 248
# Per communication group: streams HCCL takes once, and per graph using it.
GROUP_STREAMS = 40
GROUP_STREAMS_PER_GRAPH = 2


@dataclasses.dataclass(frozen=True)
class GraphBudget:
    """Streams a configuration's graphs take per capture size."""
    graphs_per_size: int  # pieces + full graph + draft graph
    groups_per_graph: int  # communication groups one forward uses
    groups: int  # communication groups any captured forward may use

    @property
    def streams_per_size(self) -> int:
        return self.graphs_per_size * (
            1 + GROUP_STREAMS_PER_GRAPH * self.groups_per_graph)

    @property
    def streams_for_graphs(self) -> int:
        return NPU_STREAMS - RUNTIME_STREAMS - GROUP_STREAMS * self.groups

    def streams_taken(self, graphs: int) -> int:
        """Streams in use once ``graphs`` graphs are captured."""
        return (RUNTIME_STREAMS + GROUP_STREAMS * self.groups + graphs *
                (1 + GROUP_STREAMS_PER_GRAPH * self.groups_per_graph))

    @property
    def max_sizes(self) -> int:
        return max(0, self.streams_for_graphs // self.streams_per_size)


def graph_budget(num_attention_layers: int, piecewise: bool, full: bool,
                 draft: bool, tensor_parallel: int, data_parallel: int,
                 expert_parallel: bool) -> GraphBudget:
    graphs = ((num_attention_layers + 1) if piecewise else 0) + int(full) \
        + int(draft)
    # One forward talks on the TP group and on one MoE exchange group (the
    # DP group, or the EP group, which spans DP x TP).
    moe_exchange = data_parallel > 1 or (expert_parallel
                                         and tensor_parallel > 1)
    per_graph = int(tensor_parallel > 1) + int(moe_exchange)
    # Across sizes the MoE method may change (all-gather over DP, MC2 over
    # EP): both groups are set up.
    groups = int(tensor_parallel > 1) + int(data_parallel > 1) + int(
        expert_parallel and data_parallel * tensor_parallel > 1)
    return GraphBudget(graphs, per_graph, max(groups, per_graph))


def keep_evenly(sizes: list[int], count: int) -> list[int]:
    """``count`` of ``sizes`` (ascending), evenly spaced, the smallest and
    the largest kept."""
    sizes = sorted(sizes)
    if count >= len(sizes):
        return sizes
    if count <= 0:
        return []
    if count == 1:
        return [sizes[0]]
    step = (len(sizes) - 1) / (count - 1)
    return sorted({sizes[math.floor(i * step + 0.5)] for i in range(count)})
