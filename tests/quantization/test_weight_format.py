"""W8A8 on the NPU code paths: int8 weights load in FRACTAL_NZ with the
same outputs as ND (S3-1), and static W8A8 launches the quantization alone,
its reciprocal scale and offset computed at load (S3-8)."""

import pytest
import torch

from tests.quantization import w8a8_layers
from tests.utils.npu import REAL_NPU, to_npu
from vllm_ascend.ops import weight_format
from vllm_ascend.ops.moe import experts

pytestmark = [pytest.mark.npu, pytest.mark.usefixtures("dist_world")]

NZ, ND = weight_format.ACL_FORMAT_FRACTAL_NZ, weight_format.ACL_FORMAT_ND


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)


@pytest.mark.parametrize("static", [False, True])
def test_linear_weight_is_nz_with_the_nd_outputs(monkeypatch, static):
    x = _x(7, 128, seed=5)
    with w8a8_layers.npu_paths(monkeypatch):
        layer, method = w8a8_layers.linear(static)
        assert weight_format.format_of(layer.weight) == NZ
        assert layer.weight.shape == (128, 96)  # x2 [K, N], as before
        got = method.apply(layer, to_npu(x))
        with monkeypatch.context() as m:
            m.setattr(weight_format, "to_nz", weight_format.to_nz_ref)
            nd_layer, _ = w8a8_layers.linear(static)
            assert weight_format.format_of(nd_layer.weight) == ND
            want = method.apply(nd_layer, to_npu(x))
    assert torch.equal(got.cpu(), want.cpu())
    # And the CPU reference device's output, within bfloat16.
    ref_layer, ref_method = w8a8_layers.linear(static)
    ref = ref_method.apply(ref_layer, x)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=1e-2,
                               atol=1e-2)


def test_expert_weights_are_nz(monkeypatch):
    with w8a8_layers.npu_paths(monkeypatch):
        layer, _ = w8a8_layers.experts()
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            assert weight.dtype == torch.int8
            assert weight_format.format_of(weight) == NZ, name
            assert weight.is_contiguous()


def test_expert_matmuls_nz_equal_nd(monkeypatch):
    """Each expert weight, NZ as loaded, in the grouped matmul the expert
    MLP launches: the ND weights' output, bit for bit."""
    g = torch.Generator().manual_seed(9)
    group_ends = torch.tensor([3, 3, 8, 12], dtype=torch.int64)

    def matmuls(layer, torch_npu):
        outs = []
        for name, k in (("w13", 128), ("w2", 64)):
            rows = (torch.randn(12, k, generator=g) * 2).to(torch.bfloat16)
            q, s = torch_npu.npu_dynamic_quant(to_npu(rows))
            outs.append(experts.grouped_matmul_npu(
                q, getattr(layer, f"{name}_weight"), to_npu(group_ends),
                scale=[getattr(layer, f"{name}_weight_scale")],
                per_token_scale=[s], output_dtype=torch.bfloat16))
        return outs

    with w8a8_layers.npu_paths(monkeypatch) as torch_npu:
        with monkeypatch.context() as m:
            m.setattr(weight_format, "to_nz", weight_format.to_nz_ref)
            g.manual_seed(9)
            want = matmuls(w8a8_layers.experts()[0], torch_npu)
        g.manual_seed(9)
        got = matmuls(w8a8_layers.experts()[0], torch_npu)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.skipif(REAL_NPU, reason="the SoC of the double")
def test_without_the_switch_an_a3_keeps_nd(monkeypatch):
    """allow_internal_format is False by default on an Atlas A3; torch_npu
    then makes the cast's result ND (and warns): the runner must set it."""
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION", "250")
    with w8a8_layers.npu_paths(monkeypatch, allow_internal_format=False):
        assert torch.npu.config.allow_internal_format is False
        with pytest.warns(UserWarning, match="allow_internel_format=False"):
            layer, _ = w8a8_layers.linear(static=False)
        assert weight_format.format_of(layer.weight) == ND
        weight_format.allow_internal_formats()
        layer, _ = w8a8_layers.linear(static=False)
        assert weight_format.format_of(layer.weight) == NZ


def _launches(graph) -> list[str]:
    """The kernels a capture recorded (views launch nothing)."""
    return [str(getattr(node.func, "__name__", node.func))
            for node in graph._nodes
            if getattr(node, "kind", "alias") != "alias"]


@pytest.mark.skipif(REAL_NPU, reason="counts the double's graph record")
def test_static_quant_launches_the_two_kernels_only(monkeypatch):
    x = _x(4, 128, seed=6)
    with w8a8_layers.npu_paths(monkeypatch):
        layer, method = w8a8_layers.linear(static=True)
        eager = method.apply(layer, x)
        static_x = x.clone()
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            out = method.apply(layer, static_x)
        launches = _launches(graph)
        graph.replay()
        replayed = out.clone()
    # Before, every call also ran 1/scale (reciprocal, mul) and the casts
    # of the reciprocal and the offset to bfloat16: 6 launches.
    assert launches == ["npu_quantize", "npu_quant_matmul"], launches
    assert torch.equal(replayed, eager)
    # The precomputed values are what the per-call code computed.
    assert layer.input_scale_reciprocal.dtype == torch.bfloat16
    assert torch.equal(layer.input_scale_reciprocal,
                       (1 / layer.input_scale.float()).bfloat16())
    assert torch.equal(layer.input_offset_cast,
                       layer.input_offset.bfloat16())
