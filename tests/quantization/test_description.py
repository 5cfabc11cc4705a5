"""Reading ``quant_model_description.json``: each bad input is one error
that names the tensor and what to do."""

import json

import pytest
from safetensors import safe_open

from vllm_ascend.quantization.description import (DESCRIPTION_FILE,
                                                  QuantDescription)

LAYER = "model.layers.0.self_attn"


def _description(w8a8_dir) -> dict:
    return json.loads((w8a8_dir / DESCRIPTION_FILE).read_text())


def _names(w8a8_dir) -> set[str]:
    with safe_open(str(w8a8_dir / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_tool_output_is_consistent(w8a8_dirs):
    for path in w8a8_dirs.values():
        described = QuantDescription.from_dir(path)
        described.check_tensors(_names(path))
        assert described.metadata["model_quant_type"] == "W8A8"
        assert described.layer_type(f"{LAYER}.qkv_proj", {}) == "W8A8"
        assert described.layer_type("model.layers.0.mlp.gate_up_proj",
                                    {}) == "W8A8_DYNAMIC"
        assert described.experts_type(
            "model.layers.1.mlp.experts") == "W8A8_DYNAMIC"
        assert described.types["model.embed_tokens.weight"] == "FLOAT"
        assert described.types["lm_head.weight"] == "FLOAT"
    float_mtp = QuantDescription.from_dir(w8a8_dirs["float_mtp"])
    mtp = {t for n, t in float_mtp.types.items()
           if n.startswith("model.layers.3.")}
    assert mtp == {"FLOAT"}
    quantized = QuantDescription.from_dir(w8a8_dirs["quantized_mtp"])
    assert quantized.types["model.layers.3.eh_proj.weight"] == "W8A8_DYNAMIC"


def test_no_description(tmp_path):
    with pytest.raises(ValueError, match="--quantization ascend needs "
                       f"{DESCRIPTION_FILE} in {tmp_path}, and there is none"):
        QuantDescription.from_dir(tmp_path)


@pytest.mark.parametrize("qtype,message", [
    ("W4A8_DYNAMIC", "is W4A8_DYNAMIC, which vllm_ascend does not support "
     "yet"),
    ("INT3", "has unknown quantization type 'INT3'"),
])
def test_unsupported_types(w8a8_dirs, qtype, message):
    entries = _description(w8a8_dirs["quantized_mtp"])
    entries[f"{LAYER}.o_proj.weight"] = qtype
    with pytest.raises(ValueError, match=message) as error:
        QuantDescription(entries, "desc.json")
    assert f"{LAYER}.o_proj.weight" in str(error.value)


def test_undescribed_and_absent_tensors(w8a8_dirs):
    path = w8a8_dirs["quantized_mtp"]
    entries, names = _description(path), _names(path)
    name = "model.layers.2.mlp.experts.5.down_proj.weight_scale"
    del entries[name]
    with pytest.raises(ValueError, match=f"does not describe 1 tensor.*"
                       f"{name}. Re-export"):
        QuantDescription(entries, "desc.json").check_tensors(names)
    entries = _description(path)
    with pytest.raises(ValueError, match=f"lists 1 tensor.* the checkpoint "
                       f"does not have: {name}. Download"):
        QuantDescription(entries, "desc.json").check_tensors(names - {name})


def test_w8a8_layer_without_scales(w8a8_dirs):
    path = w8a8_dirs["quantized_mtp"]
    entries, names = _description(path), _names(path)
    for suffix in ("deq_scale", ):
        del entries[f"{LAYER}.o_proj.{suffix}"]
        names.discard(f"{LAYER}.o_proj.{suffix}")
    with pytest.raises(ValueError,
                       match=f"{LAYER}.o_proj.weight is W8A8 but the "
                       f"checkpoint has no {LAYER}.o_proj.deq_scale"):
        QuantDescription(entries, "desc.json").check_tensors(names)


def test_fused_parts_must_agree(w8a8_dirs):
    entries = _description(w8a8_dirs["quantized_mtp"])
    entries[f"{LAYER}.k_proj.weight"] = "FLOAT"
    described = QuantDescription(entries, "desc.json")
    with pytest.raises(ValueError, match=f"the parts of fused layer "
                       f"{LAYER}.qkv_proj have different quantization "
                       "types"):
        described.layer_type(f"{LAYER}.qkv_proj", {})
    entries = _description(w8a8_dirs["quantized_mtp"])
    entries["model.layers.1.mlp.experts.3.up_proj.weight"] = "FLOAT"
    with pytest.raises(ValueError, match="experts of model.layers.1.mlp."
                       "experts mix quantization types"):
        QuantDescription(entries, "d").experts_type(
            "model.layers.1.mlp.experts")
