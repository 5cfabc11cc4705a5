"""The NPU MoE experts take vllm-ascend's fast path, with unchanged
outputs: contiguous [E, K, N] expert weights, the fused un-permute
(no float32 copies of the routed rows), the W8A8 activations quantized in
the routing kernel. Kernels are counted as a device graph records them
(the double's graph emulator: one recorded call is one kernel launch).

Measured on this case before the change (transposed weight views, the
un-permute in float32 torch ops, a separate quantization): 27 kernels for
the float experts and 28 for W8A8, with 342,020 and 367,108 bytes
allocated in the capture; after: 20 and 20, 126,789 and 118,853 bytes.
"""

import collections

import pytest
import torch

from tests.utils.npu import REAL_NPU, to_npu, torch_npu_in_process
from vllm_ascend.ops.moe import experts, quant_experts, routing

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(REAL_NPU, reason="counts the double's recorded "
                       "kernels"),
]

NUM_EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 16, 256, 128, 4, 16
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def tnpu():
    with torch_npu_in_process() as module:
        yield module


def _rand(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(BF16)


def _case(seed=0, local_first=8):
    """This rank holds experts local_first.. of 16 (expert parallelism)."""
    x = _rand(TOKENS, HIDDEN, seed=seed)
    logits = torch.randn(TOKENS, NUM_EXPERTS,
                         generator=torch.Generator().manual_seed(seed + 1))
    weights, ids = routing.select_experts_ref(logits, TOP_K,
                                              renormalize=True)
    local = NUM_EXPERTS - local_first
    expert_map = torch.full((NUM_EXPERTS, ), -1, dtype=torch.int32)
    expert_map[local_first:] = torch.arange(local, dtype=torch.int32)
    return x, weights, ids, expert_map


def _float_weights(local=8):
    return (_rand(local, 2 * INTER, HIDDEN, seed=10, scale=0.05),
            _rand(local, HIDDEN, INTER, seed=11, scale=0.05))


def _int8_weights(local=8):
    gen = torch.Generator().manual_seed(12)
    w13 = torch.randint(-127, 128, (local, 2 * INTER, HIDDEN), generator=gen,
                        dtype=torch.int8)
    w2 = torch.randint(-127, 128, (local, HIDDEN, INTER), generator=gen,
                       dtype=torch.int8)
    s13 = (torch.rand(local, 2 * INTER, generator=gen) * 1e-3).to(BF16)
    s2 = (torch.rand(local, HIDDEN, generator=gen) * 1e-3).to(BF16)
    return w13, w2, s13, s2


def _captured(fn):
    """(output, kernels by name, float32 bytes allocated) of one capture,
    and the graph."""
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = fn()
    kernels = collections.Counter(
        getattr(node.func, "__name__", str(node.func))
        for node in graph._nodes if node.kind != "alias")
    fp32 = sum(p.nbytes for p in graph.produced.values()
               if p.dtype == torch.float32)
    return out, kernels, fp32, graph


def test_expert_weights_are_laid_out_once():
    """The NPU layout is [E, K, N], contiguous, the same values; the CPU
    reference keeps the loaded layout (this process chose it)."""
    w13, _ = _float_weights()
    laid = experts._expert_weight_layout_npu(w13)
    assert laid.shape == (8, HIDDEN, 2 * INTER) and laid.is_contiguous()
    assert torch.equal(laid, w13.transpose(1, 2))
    assert experts.expert_weight_layout is experts.expert_weight_layout_ref
    assert experts.expert_weight_layout(w13) is w13


def test_grouped_matmul_reads_contiguous_weights(tnpu, monkeypatch):
    real = tnpu.npu_grouped_matmul
    seen = []

    def grouped_matmul(x, weight, **kwargs):
        seen.append((weight[0].is_contiguous(), tuple(weight[0].shape)))
        return real(x, weight, **kwargs)
    monkeypatch.setattr(tnpu, "npu_grouped_matmul", grouped_matmul)
    x, weights, ids, expert_map = _case()
    w13, w2 = _float_weights()
    layout = experts._expert_weight_layout_npu
    experts._moe_experts_npu(x, layout(w13), layout(w2), weights, ids,
                             expert_map=expert_map)
    assert seen == [(True, (8, HIDDEN, 2 * INTER)),
                    (True, (8, INTER, HIDDEN))]


def test_float_experts_fused_unpermute():
    x, weights, ids, expert_map = _case()
    w13, w2 = _float_weights()
    layout = experts._expert_weight_layout_npu
    n13, n2 = layout(w13), layout(w2)
    out, kernels, fp32, graph = _captured(lambda: experts._moe_experts_npu(
        x, n13, n2, weights, ids, expert_map=expert_map))
    assert kernels["npu_moe_token_unpermute"] == 1
    assert kernels["index_add_.default"] == 0
    assert sum(kernels.values()) <= 20, kernels
    # No float32 copy of the routed rows (T * k * H) nor of the output:
    # float32 only for per-slot weights and flags.
    assert fp32 < TOKENS * HIDDEN * 4, fp32
    graph.replay()
    want = experts.moe_experts_ref(x, w13, w2, weights, ids,
                                   expert_map=expert_map)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2,
                               atol=2e-2)


def test_without_expert_parallelism_no_slot_is_masked():
    """Every expert on this rank (no expert map): no sink id, no weight
    masking, no row-0 guard: 7 kernels instead of 19 with an expert map, the
    same result as the reference."""
    x, weights, ids, _ = _case(seed=7)
    w13, w2 = _float_weights(local=NUM_EXPERTS)
    layout = experts._expert_weight_layout_npu
    n13, n2 = layout(w13), layout(w2)
    out, kernels, _, graph = _captured(lambda: experts._moe_experts_npu(
        x, n13, n2, weights, ids))
    everything_local = torch.arange(NUM_EXPERTS, dtype=torch.int32)
    _, mapped, _, _ = _captured(lambda: experts._moe_experts_npu(
        x, n13, n2, weights, ids, expert_map=to_npu(everything_local)))
    assert sum(kernels.values()) <= sum(mapped.values()) - 10, (kernels,
                                                              mapped)
    graph.replay()
    want = experts.moe_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2,
                               atol=2e-2)


def test_w8a8_experts_quantize_in_the_routing(tnpu, monkeypatch):
    real = tnpu.npu_moe_init_routing_v2
    modes = []

    def routing_v2(x, ids, **kwargs):
        modes.append((x.dtype, kwargs["quant_mode"]))
        return real(x, ids, **kwargs)
    monkeypatch.setattr(tnpu, "npu_moe_init_routing_v2", routing_v2)
    x, weights, ids, expert_map = _case(seed=3)
    w13, w2, s13, s2 = _int8_weights()
    layout = experts._expert_weight_layout_npu
    n13, n2 = layout(w13), layout(w2)
    out, kernels, _, graph = _captured(
        lambda: quant_experts._moe_experts_w8a8_npu(
            x, n13, n2, s13, s2, weights, ids, expert_map=expert_map))
    assert modes == [(BF16, 1)]
    # One quantization left: SwiGLU's output, before the second matmul.
    assert kernels["npu_dynamic_quant"] == 1
    assert kernels["npu_moe_token_unpermute"] == 1
    assert sum(kernels.values()) <= 20, kernels
    graph.replay()
    want = quant_experts.moe_experts_w8a8_ref(x, w13, w2, s13, s2, weights,
                                              ids, expert_map=expert_map)
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2,
                               atol=3e-2 * want.abs().max().item())


def test_rank_without_rows_returns_zeros():
    """No token routes to this rank's experts: the grouped matmuls compute
    no row (all are undefined, NaN in the double) and the un-permute reads
    row 0 with weight 0 for every slot; it must give zeros, not NaN."""
    x, weights, ids, _ = _case(seed=5)
    x, weights, ids = x[:2], weights[:2], ids[:2]  # 8 of 16 experts used
    unused = torch.ones(NUM_EXPERTS, dtype=torch.bool)
    unused[ids.flatten().long()] = False
    first = int(unused.nonzero()[0])
    expert_map = torch.full((NUM_EXPERTS, ), -1, dtype=torch.int32)
    expert_map[first] = 0
    w13, w2 = _float_weights(local=1)
    layout = experts._expert_weight_layout_npu
    out = experts._moe_experts_npu(x, layout(w13), layout(w2), weights, ids,
                                   expert_map=to_npu(expert_map))
    assert torch.equal(out, torch.zeros_like(x))
