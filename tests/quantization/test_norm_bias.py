"""Anti-outlier (msModelSlim m4) checkpoints: the tool writes norm biases
whose shift the q/k/v biases compensate, and a described norm bias that no
norm of the served model takes fails at startup, naming it. (The layer:
tests/ops/test_norm_act.py; served end to end: test_w8a8_engine.py.)"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.utils.quantized_checkpoints import FIXTURE, _tool
from vllm_ascend import checks
from vllm_ascend.quantization.description import (DESCRIPTION_FILE,
                                                  QuantDescription)

CONFIG = json.loads((FIXTURE / "config.json").read_text())
NUM_LAYERS = CONFIG["num_hidden_layers"]
HIDDEN = CONFIG["hidden_size"]


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _vllm_config(path, with_mtp: bool):
    spec = (SimpleNamespace(method="glm4_moe_mtp") if with_mtp else None)
    model = SimpleNamespace(hf_config=CONFIG, model=str(path),
                            quantization="ascend")
    return SimpleNamespace(model_config=model, speculative_config=spec,
                           load_config=SimpleNamespace(load_format="auto"))


def test_tool_writes_compensated_norm_biases(anti_outlier_dirs):
    path = anti_outlier_dirs["w8a8"]
    tensors = _tensors(path)
    described = QuantDescription.from_dir(path)
    described.check_tensors(tensors)
    assert described.norm_biases == [
        f"model.layers.{i}.input_layernorm.bias" for i in range(NUM_LAYERS)
    ]
    assert {described.types[n] for n in described.norm_biases} == {"FLOAT"}
    source = _tool().load_state(FIXTURE)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    for i in range(NUM_LAYERS):
        bias = tensors[f"model.layers.{i}.input_layernorm.bias"].double()
        assert bias.abs().max() > 1e-2, i
        for proj in "qkv":
            layer = f"model.layers.{i}.self_attn.{proj}_proj"
            w = (tensors[f"{layer}.weight"].double() *
                 tensors[f"{layer}.weight_scale"].double())
            # The served linear on the shifted norm output computes what
            # it computed on the unshifted one with the source's bias.
            torch.testing.assert_close(
                (x + bias) @ w.T + tensors[f"{layer}.bias"].double(),
                x @ w.T + source[f"{layer}.bias"].double(),
                rtol=1e-5, atol=1e-5)
    # The unshifted norms have no bias.
    assert not any(n.endswith("post_attention_layernorm.bias")
                   for n in tensors)


def test_tool_needs_attention_biases(tmp_path):
    src = tmp_path / "no-bias"
    shutil.copytree(FIXTURE, src)
    config = dict(CONFIG, attention_bias=False)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="attention_bias false"):
        _tool().main(["--model", str(src), "--out", str(tmp_path / "out"),
                      "--anti-outlier"])


def test_startup_accepts_the_tool_output(anti_outlier_dirs):
    for path in anti_outlier_dirs.values():
        for with_mtp in (False, True):
            checks.check_checkpoint(_vllm_config(path, with_mtp))


@pytest.mark.parametrize("name", [
    "model.layers.1.mlp.shared_experts.norm.bias",
    f"model.layers.{NUM_LAYERS + 1}.input_layernorm.bias",
])
def test_startup_names_a_norm_bias_no_norm_takes(anti_outlier_dirs,
                                                  tmp_path, name):
    path = tmp_path / "ckpt"
    shutil.copytree(anti_outlier_dirs["w8a8"], path)
    tensors = _tensors(path)
    tensors[name] = torch.ones(HIDDEN)
    save_file(tensors, str(path / "model.safetensors"))
    entries = json.loads((path / DESCRIPTION_FILE).read_text())
    entries[name] = "FLOAT"
    (path / DESCRIPTION_FILE).write_text(json.dumps(entries))
    with pytest.raises(ValueError) as error:
        checks.check_checkpoint(_vllm_config(path, with_mtp=True))
    message = str(error.value)
    assert f"lists {name}, a norm bias (anti-outlier m4) that no norm" \
        in message and "\n" not in message


def test_every_glm45_norm_may_have_a_bias():
    """Dense and MoE layers, q/k norms, the final norm and the MTP
    layer's norms: each is an RMSNorm that takes a bias."""
    norms = [n for n in checks.expected_glm45_tensors(CONFIG, True)
             if n.endswith("norm.weight")]
    mtp = f"model.layers.{NUM_LAYERS}"
    assert {f"{mtp}.{n}.weight" for n in ("enorm", "hnorm",
                                          "shared_head.norm",
                                          "input_layernorm")} <= set(norms)
    entries = {n.removesuffix("weight") + "bias": "FLOAT" for n in norms}
    described = QuantDescription(entries, "desc.json")
    assert len(described.norm_biases) == len(norms)
    described.check_norm_biases(norms)


def test_norm_bias_must_be_float():
    name = "model.layers.0.input_layernorm.bias"
    with pytest.raises(ValueError, match=f"{name} is W8A8_DYNAMIC: a norm "
                       "bias is added in float"):
        QuantDescription({name: "W8A8_DYNAMIC"}, "desc.json")
