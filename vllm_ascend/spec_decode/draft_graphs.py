"""Full graphs of the MTP draft: the whole MTP layer, attention inside.

vLLM 0.11 does not compile GLM-4.5's MTP layer, so there are no pieces to
capture: the draft is captured whole, one graph per capture size, with
:class:`DraftGraphWrapper`. Each graph is captured for
``min(size, max_num_seqs)`` requests; since every length the attention
kernel sees is a host argument updated before each replay (padded to the
captured requests), a graph replays any draft step of at most that many
requests and tokens (with room for its padding tokens): the first step over
the verify batch (1 + k tokens per request) and the later ones (one token
per request, padded to a size); a step that does not fit runs eager.
Its attention tasks live in its own entries, apart from the target's.
"""

import time

import torch
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import (BatchDescriptor, get_forward_context,
                                  set_forward_context)
from vllm.logger import init_logger
from vllm.v1.attention.backends.utils import CommonAttentionMetadata

from vllm_ascend.attention.metadata import fits
from vllm_ascend.compilation.graph_wrapper import (AscendGraphEntry,
                                                   AscendGraphWrapper,
                                                   graph_stats)

logger = init_logger(__name__)


def draft_graphs_enabled(vllm_config: VllmConfig) -> bool:
    """Draft graphs go with the target's full graphs (FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE): in PIECEWISE mode the uncompiled draft runs eager.
    Not under data parallelism: the MoE collectives of the draft would be
    inside the graph."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    return (mode is not None and mode.decode_mode() == CUDAGraphMode.FULL
            and bool(compilation.cudagraph_capture_sizes)
            and vllm_config.parallel_config.data_parallel_size == 1)


class DraftGraphWrapper(AscendGraphWrapper):
    """The draft model as full graphs, one per capture size."""

    role = "draft"

    def __init__(self, runnable, vllm_config: VllmConfig) -> None:
        super().__init__(runnable, vllm_config, CUDAGraphMode.FULL)

    def _entry(self, num_tokens: int) -> AscendGraphEntry | None:
        return self.concrete_cudagraph_entries.get(
            BatchDescriptor(num_tokens=num_tokens))

    def _fits(self, entry: AscendGraphEntry, num_tokens: int) -> bool:
        metadata = get_forward_context().attn_metadata
        if not metadata:
            return False
        batch = next(iter(metadata.values()))
        return all(
            fits(batch.num_reqs, batch.num_actual_tokens, task.num_reqs,
                 num_tokens)
            for task in entry.attention_tasks)

    def __call__(self, *args, **kwargs):
        num_tokens = kwargs["positions"].shape[0]
        entry = self._entry(num_tokens)
        if entry is None or not self._fits(entry, num_tokens):
            return self.runnable(*args, **kwargs)
        return self.run(BatchDescriptor(num_tokens=num_tokens), args, kwargs)

    def capture(self, num_tokens: int, **kwargs) -> None:
        if self._entry(num_tokens) is None:
            self.run(BatchDescriptor(num_tokens=num_tokens), (), kwargs)


def _dummy_metadata(proposer, num_tokens: int) -> CommonAttentionMetadata:
    """A batch of ``min(num_tokens, max_num_seqs)`` requests holding
    ``num_tokens`` tokens, each attending to its own tokens; no KV writes."""
    runner = proposer.runner
    num_reqs = min(num_tokens, runner.max_num_reqs)
    query_lens = torch.full((num_reqs, ), num_tokens // num_reqs,
                            dtype=torch.int32)
    query_lens[:num_tokens % num_reqs] += 1
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    device = proposer.device
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=query_lens.to(device),
        seq_lens_cpu=query_lens,
        num_computed_tokens_cpu=torch.zeros_like(query_lens),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(query_lens.max()),
        block_table_tensor=runner.input_batch.block_table[0].
        get_device_tensor(num_reqs),
        slot_mapping=torch.full((num_tokens, ), -1, dtype=torch.int64,
                                device=device),
    )


@torch.inference_mode()
def capture_draft_graphs(proposer) -> int:
    """Capture the draft's graphs for every capture size, largest first;
    returns the bytes their pool took."""
    wrapper: DraftGraphWrapper = proposer.model
    sizes = sorted(proposer.vllm_config.compilation_config.
                   cudagraph_capture_sizes, reverse=True)
    builder = proposer.runner.attn_groups[0][0].metadata_builders[0]
    start, pool_before = time.perf_counter(), graph_stats.pool_bytes
    set_cudagraph_capturing_enabled(True)
    try:
        for num_tokens in sizes:
            metadata = builder.build_for_drafting(
                _dummy_metadata(proposer, num_tokens), draft_index=0)
            per_layer = {name: metadata for name in proposer.attn_layer_names}
            inputs = dict(input_ids=proposer.input_ids[:num_tokens],
                          positions=proposer.positions[:num_tokens],
                          hidden_states=proposer.hidden_states[:num_tokens],
                          inputs_embeds=None)
            if num_tokens == sizes[0]:
                # Warm up once, as vLLM does before its captures: what the
                # kernels allocate on first use stays out of graphs. Its own
                # forward context, as every model call has: what a forward
                # computes once for all layers (the rotary cos/sin) is then
                # computed inside the capture, from the positions buffer.
                with set_forward_context(per_layer, proposer.vllm_config,
                                         num_tokens=num_tokens):
                    wrapper.runnable(**inputs)
            with set_forward_context(per_layer, proposer.vllm_config,
                                     num_tokens=num_tokens):
                wrapper.capture(num_tokens, **inputs)
    finally:
        set_cudagraph_capturing_enabled(False)
    pool_bytes = graph_stats.pool_bytes - pool_before
    logger.info(
        "Captured %d MTP draft graph(s) for sizes %s in %.1f s; graph pool "
        "%.2f MiB.", len(sizes), sizes, time.perf_counter() - start,
        pool_bytes / (1 << 20))
    return pool_bytes
