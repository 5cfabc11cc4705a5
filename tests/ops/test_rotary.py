"""Rotary embedding as GLM-4.5 builds it, against a complex rotation."""

from unittest import mock

import pytest
import torch

from vllm_ascend.ops import rotary_embedding as rope_ops

HEAD, HEADS, KV_HEADS, BASE = 32, 4, 2, 1e6


def rotate_complex(x, positions, head_size, rotary_dim, neox):
    """Each pair of rotated dims as one complex number times e^(i*pos*f)."""
    t = x.shape[0]
    h = x.double().reshape(t, -1, head_size).clone()
    half = rotary_dim // 2
    j = torch.arange(half, dtype=torch.float64)
    freq = BASE**(-2 * j / rotary_dim)
    angle = positions.double()[:, None] * freq[None, :]  # [t, half]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    re_idx, im_idx = ((j.long(), j.long() + half) if neox else
                      (2 * j.long(), 2 * j.long() + 1))
    z = torch.complex(h[..., re_idx], h[..., im_idx]) * rot
    h[..., re_idx], h[..., im_idx] = z.real, z.imag
    return h.reshape(x.shape)


def glm_rope(dtype):
    from vllm.model_executor.layers.rotary_embedding import get_rope
    return get_rope(HEAD, rotary_dim=HEAD, max_position=4096, base=BASE,
                    rope_scaling=None, partial_rotary_factor=0.5,
                    dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5),
                                       (torch.bfloat16, 2e-2)])
def test_glm_rope_is_replaced_partial_neox_and_exact(vllm_config, dtype,
                                                     tol):
    rope = glm_rope(dtype)
    assert type(rope) is rope_ops.AscendRotaryEmbedding
    assert (rope.rotary_dim, rope.is_neox_style) == (HEAD // 2, True)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 130, 4095])
    q = torch.randn(5, HEADS * HEAD, generator=g).to(dtype)
    k = torch.randn(5, KV_HEADS * HEAD, generator=g).to(dtype)
    with mock.patch.object(rope_ops, "rotary_embedding",
                           wraps=rope_ops.rotary_embedding) as spy:
        q_out, k_out = rope(positions, q, k)
    spy.assert_called_once()
    assert q_out.shape == q.shape and q_out.dtype == dtype
    for inp, out in ((q, q_out), (k, k_out)):
        expected = rotate_complex(inp, positions, HEAD, HEAD // 2, neox=True)
        torch.testing.assert_close(out.double(), expected, rtol=tol,
                                   atol=tol)
        # The second half of every head does not rotate: bit-identical.
        tail = (slice(None), slice(None), slice(HEAD // 2, None))
        assert torch.equal(out.view(5, -1, HEAD)[tail],
                           inp.view(5, -1, HEAD)[tail])


def test_position_zero_is_identity_and_norms_are_kept(vllm_config):
    rope = glm_rope(torch.float32)
    q = torch.randn(3, HEADS * HEAD)
    q_out, k_out = rope(torch.zeros(3, dtype=torch.long), q, None)
    assert k_out is None
    torch.testing.assert_close(q_out, q)
    q_out, _ = rope(torch.tensor([5, 900, 17]), q, None)
    torch.testing.assert_close(q_out.view(3, -1, HEAD).norm(dim=-1),
                               q.view(3, -1, HEAD).norm(dim=-1))


def test_gptj_style_reference_pairs_adjacent_dims():
    rot = 8
    positions = torch.tensor([3, 11])
    inv = BASE**(-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    freqs = torch.arange(16, dtype=torch.float64)[:, None] * inv
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).float()
    x = torch.randn(2, 3 * 16)
    out, _ = rope_ops.rotary_embedding_ref(positions, x, None, cache, 16,
                                           is_neox_style=False)
    torch.testing.assert_close(out.double(),
                               rotate_complex(x, positions, 16, rot, False))


def test_reference_agrees_with_vllm_native_in_float32(vllm_config):
    # vLLM's cache has float32 angles: agreement to float32 angle rounding.
    rope = glm_rope(torch.float32)
    positions = torch.randint(0, 4096, (6, ))
    q = torch.randn(6, HEADS, HEAD)
    k = torch.randn(6, KV_HEADS, HEAD)
    ours = rope.forward_oot(positions, q, k)
    native = rope.forward_native(positions, q, k)
    for a, b in zip(ours, native):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_wrong_token_count_is_a_clear_error():
    cache = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="one position per token"):
        rope_ops.rotary_embedding_ref(torch.arange(3), torch.randn(2, 32),
                                      None, cache, 16, True)


def test_exact_cache_is_computed_on_the_host(vllm_config):
    """vLLM builds the model inside ``with torch.device(<accelerator>)``:
    the float64 angles must not be computed there (the NPU has no float64
    kernels, and the torch_npu double refuses float64 on its device); the
    float32 table lands on the device."""
    from tests.utils.npu import REAL_NPU, torch_npu_in_process
    with torch_npu_in_process(), torch.device("npu" if REAL_NPU else "cpu"):
        rope = rope_ops.AscendRotaryEmbedding(HEAD, HEAD // 2, 4096, BASE,
                                              True, torch.float32)
    cache = rope.cos_sin_cache_f32
    assert cache.dtype == torch.float32
    assert cache.device == rope.cos_sin_cache.device
    rot = HEAD // 2
    inv = BASE**(-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv
    want = torch.cat((angles.cos(), angles.sin()), -1).float()
    assert torch.equal(cache.cpu(), want)
