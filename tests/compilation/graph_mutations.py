"""Deliberate bugs for the graph-mode mutation tests, one per failure class
of full graphs + MTP; each is applied in the engine's process before it
starts (``run_engine(..., setup="tests.compilation.graph_mutations:NAME")``).
"""

import torch

# The mutations the engine tests run, with their k (FULL_DECODE_ONLY).
RUNS = {"stale_attention_lengths": 1, "rebound_slot_mapping": 1,
        "shared_task_store": 1, "host_sync_in_attention": 1,
        "boolean_mask_in_draft": 1, "unaligned_capture_sizes": 2}


def stale_attention_lengths() -> None:
    """Replay without updating the attention tasks (the event is recorded,
    so the replay runs): attention keeps the lengths of the capture."""
    from vllm_ascend.attention import graph_tasks

    def record_only(tasks, attn_metadata):
        for task in tasks:
            task.event.record(None)

    graph_tasks.update_tasks = record_only


def rebound_slot_mapping() -> None:
    """Rebind the slot-mapping buffer each step instead of copying into
    the one the graphs captured."""
    from vllm_ascend.attention.backend import AscendAttentionMetadataBuilder
    original = AscendAttentionMetadataBuilder._persistent_slot_mapping

    def rebind(self, slot_mapping, num_tokens):
        self.slot_mapping = torch.full_like(self.slot_mapping, -1)
        return original(self, slot_mapping, num_tokens)

    AscendAttentionMetadataBuilder._persistent_slot_mapping = rebind


def host_sync_in_attention() -> None:
    """Read a device value on the host inside the attention layer, which
    full graphs capture."""
    from vllm_ascend.attention.backend import AscendAttentionImpl
    original = AscendAttentionImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata,
                *args, **kwargs):
        if attn_metadata is not None:
            int(attn_metadata.slot_mapping.max().item())
        return original(self, layer, query, key, value, kv_cache,
                        attn_metadata, *args, **kwargs)

    AscendAttentionImpl.forward = forward


def unaligned_capture_sizes() -> None:
    """Capture the sizes as given, not rounded to multiples of 1 + k."""
    from vllm_ascend.compilation import graph_mode
    graph_mode.align_capture_sizes = lambda sizes, k: sizes


def shared_task_store() -> None:
    """One attention parameter store per graph size for the target and the
    draft together: each replay updates the other's tasks too."""
    from vllm_ascend.compilation.graph_wrapper import AscendGraphWrapper
    store: dict[int, list] = {}
    original = AscendGraphWrapper._capture

    def capture(self, entry, key, args, kwargs):
        output = original(self, entry, key, args, kwargs)
        shared = store.setdefault(key[2], [])
        shared.extend(entry.attention_tasks)
        entry.attention_tasks = shared
        return output

    AscendGraphWrapper._capture = capture


def boolean_mask_in_draft() -> None:
    """The MTP layer's position-0 mask as a boolean index write (what patch
    0007 removed): the row count needs a host sync."""
    from vllm.model_executor.models.glm4_moe_mtp import (
        Glm4MoeMultiTokenPredictorLayer as Layer)
    original = Layer.forward

    def forward(self, input_ids, positions, previous_hidden_states,
                inputs_embeds=None, spec_step_index=0):
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[positions == 0] = 0
        return original(self, input_ids, positions, previous_hidden_states,
                        inputs_embeds, spec_step_index)

    Layer.forward = forward
