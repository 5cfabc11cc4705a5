"""The torch_npu implementations against the torch references.

On an Ascend NPU they run the real kernels; elsewhere the torch_npu
contract double, which checks each call against the op's documentation
before it computes.
"""

from unittest import mock

import pytest
import torch

from tests.utils.npu import REAL_NPU, to_npu, torch_npu_in_process
from vllm_ascend.ops import activation, layernorm
from vllm_ascend.ops import rotary_embedding as rope_ops
from vllm_ascend.ops.moe import experts, routing

pytestmark = pytest.mark.npu

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def torch_npu_module():
    with torch_npu_in_process() as module:
        yield module


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return to_npu(torch.randn(*shape, generator=g).to(dtype))


def close(a, b, dtype):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(),
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.skipif(not REAL_NPU, reason="the process chose the reference "
                    "ops at import: needs an Ascend NPU")
def test_npu_path_is_selected():
    assert layernorm.rms_norm is not layernorm.rms_norm_ref
    assert experts.moe_experts is not experts.moe_experts_ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    x, res = rand(2, 7, 128, dtype=dtype).unbind(0)
    w = rand(128, dtype=dtype, seed=1)
    close(layernorm._rms_norm_npu(x, w, 1e-6),
          layernorm.rms_norm_ref(x, w, 1e-6), dtype)
    for a, b in zip(layernorm._add_rms_norm_npu(x, res, w, 1e-6),
                    layernorm.add_rms_norm_ref(x, res, w, 1e-6)):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = rand(9, 256, dtype=dtype)
    close(activation._silu_and_mul_npu(x), activation.silu_and_mul_ref(x),
          dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_partial_rotary(dtype, neox):
    head, rot = 128, 64  # GLM-4.5: head_dim 128, partial_rotary_factor 0.5
    angles = torch.outer(torch.arange(4096, dtype=torch.float64),
                         1e6**(-torch.arange(0, rot, 2) / rot).double())
    cache = to_npu(torch.cat((angles.cos(), angles.sin()), -1).float())
    positions = to_npu(torch.tensor([0, 3, 100, 4095]))
    q = rand(4, 8 * head, dtype=dtype)
    k = rand(4, 2 * head, dtype=dtype, seed=1)
    got = rope_ops._rotary_embedding_npu(positions, q, k, cache, head, neox)
    ref = rope_ops.rotary_embedding_ref(positions, q, k, cache, head, neox)
    for a, b in zip(got, ref):
        close(a, b, dtype)


@pytest.mark.parametrize("num_experts,n_group,topk_group,kernel", [
    (160, 1, 1, False), (160, 8, 4, False), (256, 8, 4, True),
    (256, 1, 1, True)
], ids=["glm-160-1-1", "glm-160-8-4", "deepseek-256-8-4", "256-1-1"])
def test_sigmoid_routing(torch_npu_module, num_experts, n_group, topk_group,
                         kernel):
    """npu_moe_gating_top_k where CANN 8.3 takes it (256 experts, as
    vllm-ascend v0.11.0 calls it); GLM-4.5's 160 experts on torch."""
    logits = rand(16, num_experts)
    bias = rand(num_experts, seed=1) * 0.1
    kwargs = dict(renormalize=True, use_grouped_topk=True,
                  num_expert_group=n_group, topk_group=topk_group,
                  scoring_func="sigmoid", routed_scaling_factor=1.0,
                  e_score_correction_bias=bias)
    with mock.patch.object(torch_npu_module, "npu_moe_gating_top_k",
                           wraps=torch_npu_module.npu_moe_gating_top_k) as op:
        w_npu, ids_npu = routing._select_experts_npu(logits, 8, **kwargs)
    assert op.called == kernel
    w_ref, ids_ref = routing.select_experts_ref(logits, 8, **kwargs)
    ids_npu, order_npu = ids_npu.cpu().sort(-1)
    ids_ref, order_ref = ids_ref.cpu().sort(-1)
    assert torch.equal(ids_npu, ids_ref)
    close(w_npu.cpu().gather(1, order_npu), w_ref.cpu().gather(1, order_ref),
          torch.float32)


# bfloat16 only: the fused un-permute takes bfloat16 (the NPU runs GLM-4.5
# in bfloat16, a startup check).
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("local_experts", [16, 8, 1],
                         ids=["all-local", "ep-half", "ep-one-expert"])
def test_moe_experts(dtype, local_experts):
    num_experts, hidden, inter, top_k = 16, 256, 128, 4
    x = rand(32, hidden, dtype=dtype)
    w13 = rand(num_experts, 2 * inter, hidden, dtype=dtype, seed=1) * 0.05
    w2 = rand(num_experts, hidden, inter, dtype=dtype, seed=2) * 0.05
    weights, ids = routing.select_experts_ref(rand(32, num_experts, seed=3),
                                              top_k, renormalize=True)
    expert_map = None
    if local_experts < num_experts:  # this rank holds the last ones
        first = num_experts - local_experts
        expert_map = torch.full((num_experts, ), -1, dtype=torch.int32)
        expert_map[first:] = torch.arange(local_experts, dtype=torch.int32)
        expert_map = to_npu(expert_map)
        w13, w2 = w13[first:], w2[first:]
    layout = experts._expert_weight_layout_npu
    got = experts._moe_experts_npu(x, layout(w13), layout(w2), weights, ids,
                                   expert_map=expert_map)
    ref = experts.moe_experts_ref(x, w13, w2, weights, ids,
                                  expert_map=expert_map)
    close(got, ref, dtype)
