"""Rotary embedding on the NPU path: one rotary kernel per layer, cos/sin
once per forward step, and still right when a captured graph replays.

Kernels are counted as the graph emulator records them (a torch_npu op or
an aten op that computes is one node; views are none), so the count is what
a captured decode step launches.
"""

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process
from vllm_ascend.ops import rotary_embedding as rope_ops

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(REAL_NPU, reason="counts the double's graph records")
]

HEAD, ROT, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 2, 3


@pytest.fixture(scope="module", autouse=True)
def torch_npu_module():
    with torch_npu_in_process() as module:
        yield module


def _cache() -> torch.Tensor:
    inv = 1e6**(-torch.arange(0, ROT, 2, dtype=torch.float64) / ROT)
    angles = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
    return torch.cat((angles.cos(), angles.sin()), -1).float()


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(LAYERS, tokens, HEADS * HEAD, generator=g)
    k = torch.randn(LAYERS, tokens, KV_HEADS * HEAD, generator=g)
    return q.bfloat16(), k.bfloat16()


def _layers(positions, qs, ks, cache, step):
    """What one forward does: every layer rotates its q/k at ``positions``
    through the one rotary module (vLLM's get_rope shares it)."""
    return [
        rope_ops._rotary_embedding_npu(positions, q, k, cache, HEAD, True,
                                       step_cos_sin=step)
        for q, k in zip(qs, ks)
    ]


def _forward_context(vllm_config):
    from vllm.forward_context import set_forward_context
    return set_forward_context(None, vllm_config)


def _captured_kinds(fn) -> list[str]:
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        fn()
    return [
        getattr(node.func, "__name__", str(node.func))
        for node in graph._nodes if getattr(node, "kind", "") != "alias"
    ]


def test_one_rotary_kernel_per_layer_and_cos_sin_once(vllm_config):
    """Before: 7 kernels for q and 7 for k in every layer (gather, cast, 2
    cats, a contiguous copy, the rotary, a cat back), cos/sin gathered per
    layer. Now: 4 per layer (stack q|k, one rotary, join each with its
    pass-through dims) and the cos/sin gather once per step."""
    cache, positions = _cache(), torch.tensor([0, 5, 77, 4095])
    qs, ks = _inputs(4)
    step = rope_ops.StepCosSin()
    with _forward_context(vllm_config):
        kinds = _captured_kinds(
            lambda: _layers(positions, qs, ks, cache, step))
    per_step = 4  # index_select, cast, cat cos, cat sin
    assert len(kinds) == per_step + 4 * LAYERS, kinds
    assert sum("rotary" in k for k in kinds) == LAYERS
    assert sum("index_select" in k for k in kinds) == 1

    # Without a step cache (a bare call) each layer gathers its own.
    with _forward_context(vllm_config):
        kinds = _captured_kinds(
            lambda: _layers(positions, qs, ks, cache, None))
    assert len(kinds) == (per_step + 4) * LAYERS


def test_step_cos_sin_follows_the_positions_across_steps(vllm_config):
    """A new forward context (a new step) or new positions recompute;
    outputs equal the uncached path bit for bit and the reference within
    bfloat16."""
    cache = _cache()
    step = rope_ops.StepCosSin()
    for seed, pos in enumerate(([0, 1, 2, 3], [9, 4000, 17, 3])):
        positions = torch.tensor(pos)
        qs, ks = _inputs(4, seed)
        with _forward_context(vllm_config):
            got = _layers(positions, qs, ks, cache, step)
        want = _layers(positions, qs, ks, cache, None)
        for (gq, gk), (wq, wk), q, k in zip(got, want, qs, ks):
            assert torch.equal(gq, wq) and torch.equal(gk, wk)
            rq, rk = rope_ops.rotary_embedding_ref(positions, q, k, cache,
                                                   HEAD, True)
            torch.testing.assert_close(gq.float(), rq.float(), atol=2e-2,
                                       rtol=2e-2)
            torch.testing.assert_close(gk.float(), rk.float(), atol=2e-2,
                                       rtol=2e-2)


def test_cos_sin_are_recomputed_on_every_replay(vllm_config):
    """In a captured graph the first layer's cos/sin gather is recorded from
    the positions buffer: a replay with new positions rotates by them."""
    cache = _cache()
    positions = torch.tensor([0, 1, 2, 3])
    qs, ks = _inputs(4)
    step = rope_ops.StepCosSin()
    graph = torch.npu.NPUGraph()
    with _forward_context(vllm_config), torch.npu.graph(graph):
        outputs = _layers(positions, qs, ks, cache, step)
    new = torch.tensor([100, 2047, 4095, 7])
    positions.copy_(new)
    graph.replay()
    want = _layers(new, qs, ks, cache, None)
    for (gq, gk), (wq, wk) in zip(outputs, want):
        assert torch.equal(gq, wq) and torch.equal(gk, wk)


def test_cos_sin_once_in_a_compiled_forward(vllm_config):
    """vLLM traces the model with Dynamo (fullgraph): the layers after the
    first read the first one's cos/sin, so the traced graph gathers once."""
    cache, positions = _cache(), torch.tensor([0, 5, 77, 4095])
    qs, ks = _inputs(4)
    step = rope_ops.StepCosSin()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(positions, qs, ks):
        return _layers(positions, qs, ks, cache, step)

    compiled = torch.compile(forward, fullgraph=True, backend=backend)
    with _forward_context(vllm_config):
        got = compiled(positions, list(qs), list(ks))
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert sum("index_select" in t for t in targets) == 1
    assert sum("rotary_mul" in t for t in targets) == LAYERS
    for (gq, gk), (wq, wk) in zip(got, _layers(positions, qs, ks, cache,
                                               None)):
        assert torch.equal(gq, wq) and torch.equal(gk, wk)
