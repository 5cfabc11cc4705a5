"""The integer references against float64 formulas, and the torch_npu
paths (the contract double off an NPU) against the references."""

import pytest
import torch
import torch.nn.functional as F

from tests.utils.npu import to_npu, torch_npu_in_process
from vllm_ascend.ops import quant
from vllm_ascend.ops.moe import experts, quant_experts


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(*shape, seed=0) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=_gen(seed),
                         dtype=torch.int8)


def test_dynamic_quant_formula():
    x = torch.randn(6, 64, generator=_gen(0)) * 3
    x[2] = 0.0
    q, scale = quant.dynamic_quant_ref(x)
    x64 = x.double()
    want_scale = x64.abs().amax(dim=1) / 127
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale.double(), want_scale, rtol=1e-6,
                               atol=0)
    rows = want_scale > 0
    ratio = x64[rows] / want_scale[rows].unsqueeze(1)
    # Round to nearest (a float32 division may land a hair off a tie).
    assert (q[rows].double() - ratio).abs().max() <= 0.5 + 1e-5
    assert q[rows].abs().amax(dim=1).eq(127).all()
    assert q[2].eq(0).all() and scale[2] == 0


def test_rounding_is_half_to_even_and_saturates():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5]])
    q, scale = quant.dynamic_quant_ref(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -2, 0]]
    r, o = quant.static_quant_params(torch.tensor([0.5]), torch.tensor([3.0]),
                                     torch.float32)
    q = quant.static_quant_ref(torch.tensor([100.0, -100.0, 0.25, 1.0]), r, o)
    # 100/0.5+3 and -100/0.5+3 saturate; 0.25/0.5+3 = 3.5 -> 4 (even).
    assert q.tolist() == [127, -128, 4, 5]


def test_static_quant_formula():
    x = torch.randn(5, 32, generator=_gen(1))
    q = quant.static_quant_ref(
        x, *quant.static_quant_params(torch.tensor([0.02]),
                                      torch.tensor([-7.0]), x.dtype))
    want = (x.double() / 0.02 - 7).clamp(-128, 127)
    assert (q.double() - want).abs().max() <= 0.5 + 1e-5


@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_matmul_is_exact_integer_then_scaled(with_bias):
    q, w_t = _int8(7, 96, seed=2), _int8(96, 40, seed=3)
    scale = torch.rand(40, generator=_gen(4)) * 1e-2
    pertoken = torch.rand(7, generator=_gen(5))
    bias = (torch.randint(-5000, 5000, (40, ), generator=_gen(6)).to(
        torch.int32) if with_bias else None)
    acc = q.long() @ w_t.long()
    if with_bias:
        acc = acc + bias.long()
    # The accumulator is exact: dequantized with unit scales it is the
    # int64 product.
    ones = torch.ones(40)
    got = quant.quant_matmul_ref(q, w_t, ones, bias=bias,
                                 out_dtype=torch.float32)
    assert torch.equal(got.double(), acc.double())
    got = quant.quant_matmul_ref(q, w_t, scale, pertoken, bias,
                                 out_dtype=torch.float32)
    want = acc.double() * scale.double() * pertoken.double().unsqueeze(1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=-1) / 127
    return (torch.round(w / scale.unsqueeze(-1)).to(torch.int8),
            scale.float())


def _experts_case(seed=0, tokens=9, experts_=4, hidden=64, inter=32, k=2):
    g = _gen(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13, s13 = _quantize_weight(
        torch.randn(experts_, 2 * inter, hidden, generator=g) * 0.1)
    w2, s2 = _quantize_weight(
        torch.randn(experts_, hidden, inter, generator=g) * 0.1)
    logits = torch.randn(tokens, experts_, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return x, w13, w2, s13, s2, weights, ids.to(torch.int32)


def test_w8a8_experts_formula():
    """Per token and per chosen expert in float64: quantize the token,
    integer matmul, dequantize, SwiGLU, quantize, matmul, weight."""
    x, w13, w2, s13, s2, weights, ids = _experts_case()
    got = quant_experts.moe_experts_w8a8_ref(x, w13, w2, s13, s2, weights,
                                             ids)
    want = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]

    def qdyn(v):
        scale = v.abs().max() / 127
        return torch.round(v / scale), scale

    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            q, s = qdyn(x[t].double())
            gate_up = (w13[e].double() @ q) * s13[e].double() * s
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            q2, s_h = qdyn(h)
            y = (w2[e].double() @ q2) * s2[e].double() * s_h
            want[t] += float(weights[t, j]) * y
    # float32 dequantization and a rare rounding flip of h: a few ulps of
    # int8 steps at most.
    torch.testing.assert_close(got.double(), want, rtol=2e-3,
                               atol=2e-3 * want.abs().max().item())


def test_w8a8_experts_close_to_float_experts():
    x, w13, w2, s13, s2, weights, ids = _experts_case(seed=1)
    got = quant_experts.moe_experts_w8a8_ref(x, w13, w2, s13, s2, weights,
                                             ids)
    float_out = experts.moe_experts_ref(x, w13.float() * s13.unsqueeze(-1),
                                        w2.float() * s2.unsqueeze(-1),
                                        weights, ids)
    error = (got - float_out).norm() / float_out.norm()
    assert error < 0.02, error


def test_w8a8_experts_skip_other_ranks_experts():
    x, w13, w2, s13, s2, weights, ids = _experts_case(seed=2)
    # This rank holds experts 2 and 3 (as its local 0 and 1).
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    got = quant_experts.moe_experts_w8a8_ref(x, w13[2:], w2[2:], s13[2:],
                                             s2[2:], weights, ids,
                                             expert_map=expert_map)
    keep = (ids >= 2)
    want = quant_experts.moe_experts_w8a8_ref(x, w13, w2, s13, s2,
                                              weights * keep, ids)
    torch.testing.assert_close(got, want)


@pytest.mark.npu
class TestNpuAgainstReference:

    @pytest.fixture(scope="class", autouse=True)
    def torch_npu_module(self):
        with torch_npu_in_process() as module:
            yield module

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_dynamic_quant(self, dtype):
        x = (torch.randn(11, 128, generator=_gen(7)) * 4).to(dtype)
        q, s = quant._dynamic_quant_npu(to_npu(x))
        q_ref, s_ref = quant.dynamic_quant_ref(x)
        torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
        assert (q.cpu().int() - q_ref.int()).abs().max() <= 1

    def test_static_quant(self):
        x = torch.randn(5, 128, generator=_gen(8)).to(torch.bfloat16)
        r, o = quant.static_quant_params(torch.tensor([0.03]),
                                         torch.tensor([4.0]), x.dtype)
        q = quant._static_quant_npu(to_npu(x), to_npu(r), to_npu(o))
        q_ref = quant.static_quant_ref(x, r, o)
        assert q.dtype == torch.int8
        assert torch.equal(q.cpu(), q_ref)

    @pytest.mark.parametrize("static", [False, True])
    def test_quant_matmul(self, static):
        q, w_t = _int8(6, 128, seed=9), _int8(128, 64, seed=10)
        scale = torch.rand(64, generator=_gen(11)) * 1e-3
        pertoken = None if static else torch.rand(6, generator=_gen(12))
        bias = (torch.randint(-900, 900, (64, ), generator=_gen(13)).to(
            torch.int32) if static else None)
        got = quant._quant_matmul_npu(
            to_npu(q), to_npu(w_t), to_npu(scale),
            None if pertoken is None else to_npu(pertoken),
            None if bias is None else to_npu(bias), torch.bfloat16)
        want = quant.quant_matmul_ref(q, w_t, scale, pertoken, bias,
                                      torch.bfloat16)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu().float(), want.float(),
                                   rtol=1e-2, atol=1e-2)

    @pytest.mark.parametrize("with_map", [False, True])
    def test_w8a8_experts(self, with_map):
        x, w13, w2, s13, s2, weights, ids = _experts_case(seed=14,
                                                          hidden=128)
        x = x.to(torch.bfloat16)
        dtype = quant_experts.expert_scale_dtype(x.dtype)
        s13, s2 = s13.to(dtype), s2.to(dtype)
        expert_map = (torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
                      if with_map else None)
        local = slice(1, 3) if with_map else slice(None)
        args = (x, w13[local], w2[local], s13[local], s2[local], weights,
                ids)
        # The NPU path reads the weights in their NPU layout [E, K, N].
        layout = experts._expert_weight_layout_npu
        npu_args = (x, layout(w13[local]), layout(w2[local]), s13[local],
                    s2[local], weights, ids)
        got = quant_experts._moe_experts_w8a8_npu(
            *(to_npu(a) for a in npu_args),
            expert_map=None if expert_map is None else to_npu(expert_map))
        want = quant_experts.moe_experts_w8a8_ref(*args,
                                                  expert_map=expert_map)
        torch.testing.assert_close(got.cpu().float(), want.float(),
                                   rtol=3e-2,
                                   atol=3e-2 * want.abs().max().item())
