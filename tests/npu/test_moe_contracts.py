"""The double's fused MoE kernels against op-plugin 7.2.0: the un-permute
(``npu_moe_token_unpermute``) and the routing with dynamic quantization
(``npu_moe_init_routing_v2`` quant_mode=1). Each result is checked against
the documented formula written here, each documented limit fires."""

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="checks the double; a real NPU has the real contracts")

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tnpu():
    with torch_npu_in_process() as module:
        yield module


def _case(tokens=5, top_k=3, hidden=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(BF16)
    index = torch.randperm(tokens * top_k, generator=gen).int()
    probs = torch.rand(tokens, top_k, generator=gen).to(BF16)
    return rows, index, probs


def test_unpermute_formula(tnpu):
    """_op_plugin_docs.py:10912 (7.2.0): out[t] = sum_k probs[t, k] *
    permuted_tokens[sorted_indices[t * K + k]], bfloat16 out."""
    rows, index, probs = _case()
    out = tnpu.npu_moe_token_unpermute(rows, index, probs=probs)
    want = torch.stack([
        sum(probs[t, k].float() * rows[index[t * 3 + k]].float()
            for k in range(3)) for t in range(5)
    ])
    assert out.dtype == BF16 and out.shape == (5, 16)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    # Without probs K is 1: a plain gather (:10917).
    assert torch.equal(tnpu.npu_moe_token_unpermute(rows, index),
                       rows[index.long()])
    # int64 indices as the doc names them (:10916).
    assert torch.equal(
        tnpu.npu_moe_token_unpermute(rows, index.long(), probs=probs), out)


@pytest.mark.parametrize("change,match", [
    (dict(permuted_tokens=torch.zeros(15, 16)), "bfloat16"),
    (dict(permuted_tokens=torch.zeros(15, 2, 8, dtype=BF16)), "2-D"),
    (dict(probs=torch.rand(5, 3)), "probs dtype"),
    (dict(probs=torch.rand(15, dtype=BF16)), "probs must be 2-D"),
    (dict(probs=torch.rand(4, 3, dtype=BF16)), "probs must be \\[num_tokens=5"),
    (dict(sorted_indices=torch.arange(15, dtype=torch.int16)), "int32"),
    (dict(sorted_indices=torch.arange(15).int().view(3, 5)), "1-D"),
    (dict(sorted_indices=torch.arange(15).int() - 1), r"lie in \[0, 15\)"),
    (dict(sorted_indices=torch.arange(12).int()), "num_tokens \\* topK"),
    (dict(padded_mode=True), "padded_mode=False"),
])
def test_unpermute_limits(tnpu, change, match):
    rows, index, probs = _case()
    kwargs = dict(permuted_tokens=rows, sorted_indices=index, probs=probs)
    with pytest.raises(RuntimeError,
                       match=f"npu_moe_token_unpermute: .*{match}"):
        tnpu.npu_moe_token_unpermute(**{**kwargs, **change})


def test_routing_with_dynamic_quantization(tnpu):
    """npu_moe_init_routing_v2.md (7.2.0) :69 quant_mode=1: each valid
    expanded row int8 round(x / s), s = max|x| / 127 (formula 4), its s in
    expanded_scale (:80); the gather index row_idx_type=0 (:71) names each
    flat slot's row, -1 for experts outside the active range."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 8, generator=gen) * 3).to(BF16)
    ids = torch.tensor([[1, 4], [0, 1], [4, 3]], dtype=torch.int32)
    q, slot_rows, counts, scales = tnpu.npu_moe_init_routing_v2(
        x, ids, active_num=6, expert_capacity=-1, expert_num=5,
        drop_pad_mode=0, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=1,
        active_expert_range=[0, 4], row_idx_type=0)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert counts.tolist() == [1, 2, 0, 1]
    assert slot_rows.tolist() == [1, -1, 0, 2, -1, 3]
    for slot, row in enumerate(slot_rows.tolist()):
        if row < 0:
            continue
        source = x[slot // 2].float()
        s = source.abs().max() / 127
        assert torch.isclose(scales[row], s)
        assert torch.equal(q[row], torch.round(source / s).to(torch.int8))
    with pytest.raises(RuntimeError, match="quant_mode=1 needs a float x"):
        tnpu.npu_moe_init_routing_v2(
            q[:3], ids, active_num=6, expert_num=5,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,
            quant_mode=1, active_expert_range=[0, 4])
