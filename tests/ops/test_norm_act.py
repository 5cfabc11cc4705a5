"""RMSNorm and SiluAndMul: references against float64 formulas, and the
OOT registration that puts them under vLLM's classes."""

from unittest import mock

import pytest
import torch

from vllm_ascend.ops import activation, layernorm


def rms_norm_f64(x, w, eps):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5),
                                       (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_ref_matches_formula(dtype, tol, with_weight):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 3).to(dtype)
    w = torch.randn(64, generator=g).to(dtype) if with_weight else None
    out = layernorm.rms_norm_ref(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), rms_norm_f64(x, w, 1e-6),
                               rtol=tol, atol=tol)


def test_add_rms_norm_ref_returns_normed_sum_and_new_residual():
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 4, 32, generator=g).unbind(0)
    w = torch.randn(32, generator=g)
    normed, new_res = layernorm.add_rms_norm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed.double(),
                               rms_norm_f64(x.double() + res, w, 1e-5))


def test_cpu_reference_is_the_selected_implementation():
    # This host has no NPU: the interface must be the torch reference.
    assert layernorm.rms_norm is layernorm.rms_norm_ref
    assert layernorm.add_rms_norm is layernorm.add_rms_norm_ref
    assert activation.silu_and_mul is activation.silu_and_mul_ref


def test_rms_norm_layer_is_replaced_and_routes_to_our_ops(vllm_config):
    from vllm.model_executor.layers.layernorm import RMSNorm
    layer = RMSNorm(32, eps=1e-5)
    assert type(layer) is layernorm.AscendRMSNorm
    assert layer._forward_method == layer.forward_oot
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x, res = torch.randn(2, 3, 32,
                         generator=torch.Generator().manual_seed(0)).unbind(0)
    with mock.patch.object(layernorm, "add_rms_norm",
                           wraps=layernorm.add_rms_norm) as spy:
        normed, new_res = layer(x, res)
    spy.assert_called_once()
    torch.testing.assert_close(new_res, x + res)
    # The layer computes in float32: float32 tolerances.
    f32 = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed.double(),
                               rms_norm_f64(x + res, layer.weight, 1e-5),
                               **f32)
    torch.testing.assert_close(
        layer(x).double(), rms_norm_f64(x, layer.weight, 1e-5), **f32)


def test_rms_norm_layer_rejects_wrong_hidden_size(vllm_config):
    from vllm.model_executor.layers.layernorm import RMSNorm
    with pytest.raises(ValueError, match="last dimension of 32"):
        RMSNorm(32)(torch.randn(2, 16))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6),
                                       (torch.bfloat16, 1e-2)])
def test_silu_and_mul_ref_matches_formula(dtype, tol):
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    x = x.to(dtype)
    gate, up = x.double()[..., :8], x.double()[..., 8:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = activation.silu_and_mul_ref(x)
    assert out.shape == (3, 5, 8) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even size"):
        activation.silu_and_mul_ref(torch.randn(2, 7))


def test_silu_and_mul_layer_is_replaced(vllm_config):
    from vllm.model_executor.layers.activation import SiluAndMul
    layer = SiluAndMul()
    assert type(layer) is activation.AscendSiluAndMul
    x = torch.randn(4, 12)
    with mock.patch.object(activation, "silu_and_mul",
                           wraps=activation.silu_and_mul) as spy:
        out = layer(x)
    spy.assert_called_once()
    torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :6]) *
                               x[:, 6:])


# --- the norm bias of anti-outlier (m4) W8A8 checkpoints -------------------

NORM = "model.layers.0.input_layernorm"


@pytest.fixture
def norm_bias_config(dist_world):
    """A VllmConfig whose ``--quantization ascend`` description lists a
    norm bias, as an msModelSlim m4 checkpoint's does."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_ascend.quantization.config import AscendQuantConfig
    from vllm_ascend.quantization.description import QuantDescription
    description = QuantDescription(
        {f"{NORM}.weight": "FLOAT", f"{NORM}.bias": "FLOAT"}, "desc.json")
    config = VllmConfig()
    config.quant_config = AscendQuantConfig(description)
    with set_current_vllm_config(config):
        yield config


def _biased_norm(dtype=torch.float32):
    from vllm.model_executor.layers.layernorm import RMSNorm
    layer = RMSNorm(32, eps=1e-5, dtype=dtype)
    assert type(layer) is layernorm.AscendRMSNorm
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, 32))
        # What the model's loader does with "<norm>.bias".
        layer.bias.copy_((torch.randn(32, generator=g) * 4).to(dtype))
    return layer


def test_no_norm_bias_without_a_described_one(vllm_config):
    from vllm.model_executor.layers.layernorm import RMSNorm
    layer = RMSNorm(32)
    assert layer.bias is None
    assert "bias" not in dict(layer.named_parameters())


def test_norm_bias_parameter_when_described(norm_bias_config):
    from vllm.model_executor.layers.layernorm import RMSNorm
    layer = RMSNorm(32, dtype=torch.bfloat16)
    params = dict(layer.named_parameters())
    # A parameter: the model's loader finds "<norm>.bias" in params_dict.
    assert set(params) == {"weight", "bias"}
    assert params["bias"].dtype == torch.bfloat16
    assert not params["bias"].any() and not params["bias"].requires_grad


def test_norm_bias_is_added_after_the_norm(norm_bias_config):
    layer = _biased_norm()
    x, res = torch.randn(2, 3, 32,
                         generator=torch.Generator().manual_seed(0)).unbind(0)
    f32 = dict(rtol=1e-6, atol=1e-6)
    bias = layer.bias.double()
    torch.testing.assert_close(
        layer(x).double(), rms_norm_f64(x, layer.weight, 1e-5) + bias, **f32)
    normed, new_res = layer(x, res)
    torch.testing.assert_close(
        normed.double(), rms_norm_f64(x + res, layer.weight, 1e-5) + bias,
        **f32)
    # The residual stream carries the un-biased sum.
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)


@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_bias_on_the_npu_path(norm_bias_config, dtype):
    """The layer on npu_rms_norm / npu_add_rms_norm (the torch_npu double
    off an NPU) gives the CPU reference's biased output and un-biased
    residual."""
    from tests.utils.npu import to_npu, torch_npu_in_process
    layer = _biased_norm(dtype)
    g = torch.Generator().manual_seed(4)
    x, res = (torch.randn(2, 5, 32, generator=g) * 2).to(dtype).unbind(0)
    want_plain = layer(x)
    want_normed, want_res = layer(x, res)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch_npu_in_process():
        layer = layer.to(to_npu(x).device)
        x, res = to_npu(x), to_npu(res)
        with mock.patch.object(layernorm, "rms_norm",
                               layernorm._rms_norm_npu), \
                mock.patch.object(layernorm, "add_rms_norm",
                                  layernorm._add_rms_norm_npu):
            plain = layer(x)
            normed, new_res = layer(x, res)
    for got, want in ((plain, want_plain), (normed, want_normed),
                      (new_res, want_res)):
        torch.testing.assert_close(got.float().cpu(), want.float(),
                                   rtol=tol, atol=tol)
    assert new_res.dtype == dtype
