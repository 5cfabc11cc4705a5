"""Paged-KV attention kernels: torch_npu on an NPU, a torch reference on CPU.

Both share one interface and one cache layout, ``key_cache`` and
``value_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_size]``,
so the metadata builder and the attention layer are the same on both
devices. The reference loops over requests; it is written for exactness,
not speed.
"""

import functools
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from vllm_ascend import device

if TYPE_CHECKING:
    from vllm_ascend.attention.metadata import AscendAttentionMetadata

# Ascend's fused attention takes a fixed-size causal mask (sparse_mode=3).
_NPU_MASK_SIZE = 2048


class PagedAttentionOps(Protocol):

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        ...

    def launch(self,
               query: torch.Tensor,
               key_cache: torch.Tensor,
               value_cache: torch.Tensor,
               block_table: torch.Tensor,
               query_ends: list[int],
               seq_lens: list[int],
               scale: float,
               output: torch.Tensor,
               workspace: Optional[torch.Tensor] = None) -> None:
        """One attention kernel launch: causal attention of each request's
        query tokens (the last ``q_len`` positions of its ``seq_len``) over
        its paged context. ``query_ends`` (cumulative query lengths) and
        ``seq_lens`` are host arguments, as the NPU kernel takes them: a
        captured launch keeps them until a task update replaces them.
        ``workspace`` (from :meth:`max_workspace`) is the kernel's scratch
        memory: a captured launch and all its task updates pass the same."""
        ...

    def max_workspace(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_table: torch.Tensor,
                      query_ends: list[int], seq_lens: list[int],
                      scale: float) -> Optional[torch.Tensor]:
        """The scratch memory a captured launch with these arguments (and
        its updates) needs, or None for a kernel that needs none."""
        ...

    def attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor,
                  metadata: "AscendAttentionMetadata", scale: float,
                  output: torch.Tensor) -> None:
        ...


class _Attention:
    """``attention``: one launch with the metadata's host arguments."""

    def attention(self, query, key_cache, value_cache, metadata, scale,
                  output) -> None:
        self.launch(query, key_cache, value_cache, metadata.block_tables,
                    metadata.query_ends,
                    metadata.seq_lens_list, scale, output)


def _reference_write_kv_cache(key, value, key_cache, value_cache,
                              slot_mapping) -> None:
    # Padding tokens carry slot -1 (PAD_SLOT_ID): they write nothing.
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def _reference_attention(query, key_cache, value_cache, block_table,
                         query_ends, seq_lens, scale, output) -> None:
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    q_start = 0
    for i, (q_end, seq_len) in enumerate(zip(query_ends, seq_lens)):
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float()
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        # Query token j sits at position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("hls,shd->lhd", probs, v)
        output[q_start:q_end] = out.to(output.dtype)
        q_start = q_end


class ReferencePagedAttention(_Attention):
    """Exact paged attention in torch (float32 softmax)."""

    def write_kv_cache(self, key, value, key_cache, value_cache,
                       slot_mapping) -> None:
        _reference_write_kv_cache(key, value, key_cache, value_cache,
                                  slot_mapping)

    def launch(self,
               query,
               key_cache,
               value_cache,
               block_table,
               query_ends,
               seq_lens,
               scale,
               output,
               workspace=None) -> None:
        _reference_attention(query, key_cache, value_cache, block_table,
                             query_ends, seq_lens, scale, output)

    def max_workspace(self, query, key_cache, value_cache, block_table,
                      query_ends, seq_lens, scale) -> None:
        return None


@functools.cache
def _causal_mask(device_: torch.device) -> torch.Tensor:
    """One mask for every layer (4 MiB; the kernel only reads it): per layer
    it would be 372 MiB on GLM-4.5, allocated after the KV cache is sized."""
    return torch.triu(torch.ones(_NPU_MASK_SIZE, _NPU_MASK_SIZE,
                                 dtype=torch.bool, device=device_),
                      diagonal=1)


class NpuPagedAttention(_Attention):
    """torch_npu kernels: reshape-and-cache and fused infer attention (its
    ``.out`` variant: a captured launch writes where a task update's does)."""

    def __init__(self) -> None:
        self._lse: torch.Tensor | None = None

    def _causal_mask(self, device_: torch.device) -> torch.Tensor:
        return _causal_mask(device_)

    def _softmax_lse(self, device_: torch.device) -> torch.Tensor:
        # Not computed (softmax_lse_flag=False), but an out tensor.
        if self._lse is None:
            self._lse = torch.empty(1, dtype=torch.float32, device=device_)
        return self._lse

    def write_kv_cache(self, key, value, key_cache, value_cache,
                       slot_mapping) -> None:
        import torch_npu
        torch_npu._npu_reshape_and_cache(key=key,
                                         value=value,
                                         key_cache=key_cache,
                                         value_cache=value_cache,
                                         slot_indices=slot_mapping)

    def _arguments(self, query, key_cache, value_cache, block_table,
                   query_ends, seq_lens, scale) -> dict[str, Any]:
        """The fused attention's arguments (TND, paged KV cache viewed as
        (blocks, block_size, KV_N * D), causal mask of sparse_mode 3)."""
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        return dict(query=query,
                    key=key_cache.view(num_blocks, block_size, -1),
                    value=value_cache.view(num_blocks, block_size, -1),
                    atten_mask=self._causal_mask(query.device),
                    block_table=block_table,
                    input_layout="TND",
                    block_size=block_size,
                    actual_seq_lengths=query_ends,
                    actual_seq_lengths_kv=seq_lens,
                    num_key_value_heads=num_kv_heads,
                    num_heads=query.shape[1],
                    scale=scale,
                    sparse_mode=3)

    def max_workspace(self, query, key_cache, value_cache, block_table,
                      query_ends, seq_lens, scale) -> torch.Tensor:
        # What a captured launch and its task updates pass as workspace=
        # (torch_npu-npu-graph_task_group_begin.md, op-plugin 7.2.0): without
        # one the kernel's workspace is freed when the launch returns.
        # The out tensors first: a task group holds the kernel only.
        self._softmax_lse(query.device)
        import torch_npu
        return torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            **self._arguments(query, key_cache, value_cache, block_table,
                              query_ends, seq_lens, scale))

    def launch(self,
               query,
               key_cache,
               value_cache,
               block_table,
               query_ends,
               seq_lens,
               scale,
               output,
               workspace=None) -> None:
        import torch_npu
        torch_npu.npu_fused_infer_attention_score.out(
            **self._arguments(query, key_cache, value_cache, block_table,
                              query_ends, seq_lens, scale),
            workspace=workspace,
            out=[output.view(query.shape), self._softmax_lse(query.device)],
        )


def get_paged_attention_ops() -> PagedAttentionOps:
    if device.npu_kernels():
        return NpuPagedAttention()
    return ReferencePagedAttention()
