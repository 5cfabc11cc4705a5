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
    step_cos_sin: Optional["StepCosSin"] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotate the first ``cos_sin_cache.shape[-1]`` dims of every head.

    ``cos_sin_cache`` is [max_position, rotary_dim] holding cos || sin of
    ``position * inv_freq``; the rotation runs in float32. Returns new
    tensors with the shapes and dtypes of ``query`` and ``key``. The
    reference gathers cos/sin per call (``step_cos_sin`` is the NPU path's).
    """
    return _rotate_query_key(_apply_ref, positions, query, key,
                             cos_sin_cache, head_size, is_neox_style)


def _rotary_mul_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        dtype: torch.dtype, is_neox_style: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions`` as ``npu_rotary_mul`` takes them: BSND
    ``[1, T, 1, rotary_dim]`` in ``dtype``, each angle repeated for both
    dims of its pair (the halves in neox style, adjacent dims in GPT-J
    style)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).to(
        dtype).chunk(2, dim=-1)
    if is_neox_style:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos = cos.repeat_interleave(2, -1)
        sin = sin.repeat_interleave(2, -1)
    return (cos.view(1, -1, 1, rotary_dim), sin.view(1, -1, 1, rotary_dim))


class StepCosSin:
    """cos/sin computed once per forward step and shared by every layer.

    Every decoder layer rotates the same positions with the same table
    (vLLM's ``get_rope`` gives all layers one rotary module), so the first
    layer of a forward computes them and the others reuse them. The key is
    the forward context (vLLM sets a new one for every model call) and the
    positions tensor. In a captured graph the first layer's computation is
    recorded from the positions buffer, so every replay recomputes it, once.
    Without a forward context (a bare call) nothing is reused.
    """

    def __init__(self) -> None:
        self._key: Optional[tuple[object, torch.Tensor]] = None
        self._cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def get(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
            dtype: torch.dtype,
            is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import forward_context
        context = forward_context._forward_context
        cached = self._cos_sin
        if (context is not None and cached is not None
                and self._key is not None and self._key[0] is context
                and self._key[1] is positions and cached[0].dtype == dtype):
            return cached
        cos_sin = _rotary_mul_cos_sin(positions, cos_sin_cache, dtype,
                                      is_neox_style)
        if context is not None:
            self._key, self._cos_sin = (context, positions), cos_sin
        return cos_sin


def _rotary_embedding_npu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
    step_cos_sin: Optional[StepCosSin] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One ``npu_rotary_mul`` for query and key together.

    The rotated dims of query and key are stacked along the heads (one
    copy), rotated by one kernel, and each joined again with its pass-
    through dims (one copy each): four kernels per layer, plus the cos/sin
    gather once per step (``step_cos_sin``).
    """
    import torch_npu
    _check(positions, query, cos_sin_cache, head_size)
    rotary_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.numel()
    if step_cos_sin is None:
        cos, sin = _rotary_mul_cos_sin(positions, cos_sin_cache, query.dtype,
                                       is_neox_style)
    else:
        cos, sin = step_cos_sin.get(positions, cos_sin_cache, query.dtype,
                                    is_neox_style)
    q = query.view(num_tokens, -1, head_size)
    parts = [q] if key is None else [q, key.view(num_tokens, -1, head_size)]
    stacked = torch.cat([p[..., :rotary_dim] for p in parts], dim=1)
    # BSND: [1, T, Nq + Nk, rotary_dim], cos/sin [1, T, 1, rotary_dim].
    rotated = torch_npu.npu_rotary_mul(
        stacked.unsqueeze(0),
        cos,
        sin,
        rotary_mode="half" if is_neox_style else "interleave").squeeze(0)
    outputs, start = [], 0
    for part, x in zip(parts, (query, key)):
        heads = part.shape[1]
        rot = rotated[:, start:start + heads]
        start += heads
        if rotary_dim < head_size:
            rot = torch.cat((rot, part[..., rotary_dim:]), dim=-1)
        outputs.append(rot.reshape(x.shape))
    return outputs[0], (outputs[1] if key is not None else None)


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
        # Every layer's rotary is this module: cos/sin once per step.
        self.step_cos_sin = StepCosSin()
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
                                self.is_neox_style,
                                step_cos_sin=self.step_cos_sin)
