"""Rotary position embedding as GLM-4.5 uses it.

GLM-4.5 calls ``get_rope(head_dim, rotary_dim=head_dim,
partial_rotary_factor=0.5)`` without rope scaling: a plain
``RotaryEmbedding`` with ``rotary_dim = head_dim // 2`` and the default
``is_neox_style=True``. Only the first ``rotary_dim`` dims of each head
rotate; in neox style dim ``i`` pairs with dim ``i + rotary_dim // 2``.
"""

from typing import Optional

import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from vllm_ascend.device import npu_kernels


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                is_neox_style: bool) -> torch.Tensor:
    """Rotate pairs of ``x`` [T, N, rotary_dim] by cos/sin [T, 1, rot/2]."""
    if is_neox_style:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _apply_ref(positions: torch.Tensor, x: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int,
               is_neox_style: bool) -> torch.Tensor:
    rotary_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.numel()
    heads = x.reshape(num_tokens, -1, head_size)
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).float(
    ).unsqueeze(1).chunk(2, dim=-1)
    rot = _rotate_ref(heads[..., :rotary_dim].float(), cos, sin,
                      is_neox_style)
    out = torch.cat((rot.to(x.dtype), heads[..., rotary_dim:]), dim=-1)
    return out.reshape(x.shape)


def _check(positions: torch.Tensor, query: torch.Tensor,
           cos_sin_cache: torch.Tensor, head_size: int) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            f"rotary_dim {rotary_dim} (the cos||sin cache width) must be "
            f"even and at most head_size {head_size}.")
    if query.numel() % (positions.numel() * head_size):
        raise ValueError(
            f"query of shape {tuple(query.shape)} is not "
            f"[{positions.numel()} tokens, heads * {head_size}]: pass one "
            "position per token.")


def _rotate_query_key(apply, positions: torch.Tensor, query: torch.Tensor,
                      key: Optional[torch.Tensor],
                      cos_sin_cache: torch.Tensor, head_size: int,
                      is_neox_style: bool
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Check the shapes once, then rotate query and (if any) key."""
    _check(positions, query, cos_sin_cache, head_size)
    q = apply(positions, query, cos_sin_cache, head_size, is_neox_style)
    k = None if key is None else apply(positions, key, cos_sin_cache,
                                       head_size, is_neox_style)
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotate the first ``cos_sin_cache.shape[-1]`` dims of every head.

    ``cos_sin_cache`` is [max_position, rotary_dim] holding cos || sin of
    ``position * inv_freq``; the rotation runs in float32. Returns new
    tensors with the shapes and dtypes of ``query`` and ``key``.
    """
    return _rotate_query_key(_apply_ref, positions, query, key,
                             cos_sin_cache, head_size, is_neox_style)


def _apply_npu(positions: torch.Tensor, x: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int,
               is_neox_style: bool) -> torch.Tensor:
    import torch_npu
    rotary_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.numel()
    heads = x.reshape(num_tokens, -1, head_size)
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).to(
        x.dtype).chunk(2, dim=-1)
    if is_neox_style:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos = cos.repeat_interleave(2, -1)
        sin = sin.repeat_interleave(2, -1)
    # BSND layout: [1, T, N, rotary_dim] with cos/sin [1, T, 1, rotary_dim].
    rot = torch_npu.npu_rotary_mul(
        heads[..., :rotary_dim].unsqueeze(0).contiguous(),
        cos.view(1, num_tokens, 1, rotary_dim),
        sin.view(1, num_tokens, 1, rotary_dim),
        rotary_mode="half" if is_neox_style else "interleave").squeeze(0)
    out = torch.cat((rot, heads[..., rotary_dim:]), dim=-1)
    return out.reshape(x.shape)


def _rotary_embedding_npu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return _rotate_query_key(_apply_npu, positions, query, key,
                             cos_sin_cache, head_size, is_neox_style)


rotary_embedding = (_rotary_embedding_npu
                    if npu_kernels() else rotary_embedding_ref)


@CustomOp.register_oot(name="RotaryEmbedding")
class AscendRotaryEmbedding(RotaryEmbedding):
    """vLLM's RotaryEmbedding backed by ``rotary_embedding``.

    vLLM stores cos/sin in the model dtype, computed from float32 angles
    (at position 4095 a float32 angle is already off by ~2e-4 rad). This
    class keeps its own cache: angles in float64, cos/sin stored in float32.
    """

    def __init__(self, head_size: int, rotary_dim: int,
                 max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype) -> None:
        super().__init__(head_size, rotary_dim, max_position_embeddings,
                         base, is_neox_style, dtype)
        self.cos_sin_cache_f32: torch.Tensor
        self.register_buffer("cos_sin_cache_f32",
                             self._exact_cos_sin_cache(),
                             persistent=False)

    def _exact_cos_sin_cache(self) -> torch.Tensor:
        # float64 on the host: vLLM builds the model inside
        # ``with torch.device(<accelerator>)``, where a factory without a
        # device lands on the NPU, which has no float64 kernels. Only the
        # float32 result goes to the device (where vLLM's cache is).
        host = torch.device("cpu")
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64,
                                 device=host) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponents)
        positions = torch.arange(self.max_position_embeddings,
                                 dtype=torch.float64,
                                 device=host)
        angles = torch.outer(positions, inv_freq)
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
        return cache.to(self.cos_sin_cache.device)

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        cache = self.cos_sin_cache_f32
        if cache.device != query.device:
            cache = self.cos_sin_cache_f32 = cache.to(query.device)
        return rotary_embedding(positions, query, key, cache, self.head_size,
                                self.is_neox_style)
