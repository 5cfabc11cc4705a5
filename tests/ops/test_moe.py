"""MoE routing and experts against per-token loops; GLM-4.5 MoE blocks."""

import pytest
import torch

from tests.ops.moe_loops import experts as experts_loop
from tests.ops.moe_loops import route
from vllm_ascend.ops.moe import experts as experts_ops
from vllm_ascend.ops.moe import routing
from vllm_ascend.ops.moe.fused_moe import AscendUnquantizedFusedMoEMethod

E, H, INTER = 8, 32, 16


def as_dicts(weights, ids):
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


def assert_same_routes(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert set(g) == set(e)
        for k in e:
            assert g[k] == pytest.approx(e[k], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (2, 1),
                                                (4, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_bias_grouped_routing_matches_loop(n_group, topk_group,
                                                   renormalize):
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    logits = torch.randn(6, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.5
    weights, ids = routing.select_experts_ref(
        logits, 3, renormalize=renormalize, use_grouped_topk=True,
        num_expert_group=n_group, topk_group=topk_group,
        scoring_func="sigmoid", routed_scaling_factor=2.5,
        e_score_correction_bias=bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    expected = route(logits, bias, 3, n_group, topk_group, renormalize, 2.5,
                     "sigmoid")
    assert_same_routes(as_dicts(weights, ids), expected)


def _ops_run(fn) -> list[str]:
    """The aten ops ``fn`` dispatches, views left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ops: list[str] = []
    with Record():
        fn()
    return ops


def test_routing_with_every_group_eligible_skips_the_group_mask():
    """GLM-4.5 has one expert group: the group mask would keep every
    expert, so it is not computed (the routes are the loop's above)."""
    logits, bias = torch.randn(4, E), torch.randn(E)

    def route_with(n_group, topk_group):
        return lambda: routing.select_experts_ref(
            logits, 2, renormalize=True, use_grouped_topk=True,
            num_expert_group=n_group, topk_group=topk_group,
            scoring_func="sigmoid", e_score_correction_bias=bias)

    masked = _ops_run(route_with(2, 1))
    for n_group in (1, 2):
        unmasked = _ops_run(route_with(n_group, n_group))
        assert "masked_fill" not in unmasked and "scatter_" not in unmasked
        assert len(unmasked) <= len(masked) - 6, (unmasked, masked)


def test_bias_only_chooses_and_never_weights():
    logits = torch.zeros(1, E)
    bias = torch.zeros(E)
    bias[5] = 10.0  # chosen because of the bias, weighted without it
    weights, ids = routing.select_experts_ref(
        logits, 1, renormalize=False, use_grouped_topk=True,
        num_expert_group=1, topk_group=1, scoring_func="sigmoid",
        e_score_correction_bias=bias)
    assert ids.tolist() == [[5]]
    assert weights.tolist() == [[0.5]]


def test_softmax_routing_matches_loop():
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(3))
    weights, ids = routing.select_experts_ref(logits, 2, renormalize=True)
    assert_same_routes(as_dicts(weights, ids),
                       route(logits, None, 2, 1, 1, True, 1.0, "softmax"))


def test_routing_errors_name_the_problem():
    logits = torch.randn(2, E)
    with pytest.raises(ValueError, match="scoring_func 'relu'"):
        routing.select_experts_ref(logits, 2, renormalize=True,
                                   scoring_func="relu")
    with pytest.raises(ValueError, match="cannot form 3 equal groups"):
        routing.select_experts_ref(logits, 2, renormalize=True,
                                   use_grouped_topk=True, num_expert_group=3,
                                   topk_group=1, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="top_k=5 experts cannot be chosen"):
        routing.select_experts_ref(logits, 5, renormalize=True,
                                   use_grouped_topk=True, num_expert_group=4,
                                   topk_group=2, scoring_func="sigmoid")


def random_experts(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    logits = torch.randn(7, E, generator=g)
    return x, w13, w2, logits


def test_experts_match_loop():
    x, w13, w2, logits = random_experts(4)
    weights, ids = routing.select_experts_ref(logits, 3, renormalize=True)
    out = experts_ops.moe_experts_ref(x, w13, w2, weights, ids)
    expected = experts_loop(x, w13, w2, as_dicts(weights, ids))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_expert_parallel_ranks_sum_to_the_full_layer():
    x, w13, w2, logits = random_experts(5)
    weights, ids = routing.select_experts_ref(logits, 3, renormalize=True)
    full = experts_ops.moe_experts_ref(x, w13, w2, weights, ids)
    per_rank = []
    for rank in range(2):
        local = slice(rank * E // 2, (rank + 1) * E // 2)
        expert_map = torch.full((E, ), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(E // 2, dtype=torch.int32)
        per_rank.append(
            experts_ops.moe_experts_ref(x, w13[local], w2[local], weights,
                                        ids, expert_map=expert_map))
    assert not torch.allclose(per_rank[0], full)
    torch.testing.assert_close(per_rank[0] + per_rank[1], full)


def test_router_weight_on_input_for_top1():
    x, w13, w2, logits = random_experts(6)
    weights, ids = routing.select_experts_ref(logits, 1, renormalize=False)
    out = experts_ops.moe_experts_ref(x, w13, w2, weights, ids,
                                      apply_router_weight_on_input=True)
    expected = experts_loop(x * weights, w13, w2,
                            [{e: 1.0} for e in ids.flatten().tolist()])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_experts_errors_name_the_problem():
    x, w13, w2, logits = random_experts(7)
    weights, ids = routing.select_experts_ref(logits, 2, renormalize=True)
    with pytest.raises(NotImplementedError, match="'gelu'"):
        experts_ops.moe_experts_ref(x, w13, w2, weights, ids,
                                    activation="gelu")
    with pytest.raises(ValueError, match="inconsistent MoE shapes"):
        experts_ops.moe_experts_ref(x, w13, w2[:, :, :-1], weights, ids)


def fill_random(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def glm_config(n_group, topk_group):
    from transformers import Glm4MoeConfig
    return Glm4MoeConfig(hidden_size=H, moe_intermediate_size=INTER,
                         intermediate_size=64, n_routed_experts=E,
                         num_experts_per_tok=3, n_shared_experts=1,
                         n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=True, routed_scaling_factor=2.5,
                         hidden_act="silu")


@pytest.mark.parametrize("n_group,topk_group,dtype,tol",
                         [(1, 1, torch.float32, 1e-4),
                          (4, 2, torch.float32, 1e-4),
                          (1, 1, torch.bfloat16, 3e-2)])
def test_glm45_moe_block_matches_loop(vllm_config, float32_default, n_group,
                                      topk_group, dtype, tol):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.glm4_moe import Glm4MoE
    config = glm_config(n_group, topk_group)
    torch.set_default_dtype(dtype)  # the float32_default fixture restores it
    block = Glm4MoE(config, prefix="model.layers.1.mlp")
    assert type(block.experts.quant_method) is AscendUnquantizedFusedMoEMethod
    fill_random(block, seed=n_group)
    block.experts.quant_method.process_weights_after_loading(block.experts)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(11))
    x = x.to(dtype)
    with set_forward_context(None, vllm_config), torch.no_grad():
        out = block(x)
    assert out.dtype == dtype

    logits = x.double() @ block.gate.weight.double().t()
    routes = route(logits, block.gate.e_score_correction_bias, 3, n_group,
                   topk_group, True, 1.0, "sigmoid")
    routed = experts_loop(x, block.experts.w13_weight,
                          block.experts.w2_weight, routes)
    shared = block.shared_experts
    gate_up = x.double() @ shared.gate_up_proj.weight.double().t()
    gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
    shared_out = (gate * torch.sigmoid(gate) * up) @ \
        shared.down_proj.weight.double().t()
    expected = routed * 2.5 + shared_out
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_plain_fused_moe_softmax_layer_matches_loop(vllm_config,
                                                    float32_default):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoE
    layer = FusedMoE(num_experts=E, top_k=2, hidden_size=H,
                     intermediate_size=INTER, renormalize=False,
                     prefix="moe")
    assert type(layer.quant_method) is AscendUnquantizedFusedMoEMethod
    fill_random(layer, seed=9)
    layer.quant_method.process_weights_after_loading(layer)
    x, _, _, logits = random_experts(12)
    with set_forward_context(None, vllm_config), torch.no_grad():
        out = layer(x, logits)
    expected = experts_loop(
        x, layer.w13_weight, layer.w2_weight,
        route(logits, None, 2, 1, 1, False, 1.0, "softmax"))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_cpu_reference_is_the_selected_moe_implementation():
    assert routing.select_experts is routing.select_experts_ref
    assert experts_ops.moe_experts is experts_ops.moe_experts_ref
