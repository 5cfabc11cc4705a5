"""register_ops(): the general-plugin entry point that installs our ops."""

from importlib.metadata import entry_points

import vllm_ascend
from vllm_ascend.ops.activation import AscendSiluAndMul
from vllm_ascend.ops.layernorm import AscendRMSNorm
from vllm_ascend.ops.moe.fused_moe import AscendUnquantizedFusedMoEMethod
from vllm_ascend.ops.rotary_embedding import AscendRotaryEmbedding


def test_register_ops_is_the_general_plugin_entry_point():
    plugins = {ep.name: ep.value
               for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("ascend_ops") == "vllm_ascend:register_ops"


def test_register_ops_twice_is_harmless_and_maps_vllm_names():
    from vllm.model_executor.custom_op import CustomOp
    vllm_ascend.register_ops()
    vllm_ascend.register_ops()
    expected = {
        "RMSNorm": AscendRMSNorm,
        "SiluAndMul": AscendSiluAndMul,
        "RotaryEmbedding": AscendRotaryEmbedding,
        "UnquantizedFusedMoEMethod": AscendUnquantizedFusedMoEMethod,
    }
    for name, cls in expected.items():
        assert CustomOp.op_registry_oot[name] is cls
