"""The plugin's ops for GLM-4.5: one interface per op, two implementations.

Each op module exposes a function (the interface) chosen once per process
between the torch_npu kernels and a torch reference (``*_ref``), plus the
vLLM CustomOp replacement that calls it:

- ``layernorm``: ``rms_norm``, ``add_rms_norm``; ``AscendRMSNorm``.
- ``activation``: ``silu_and_mul``; ``AscendSiluAndMul``.
- ``rotary_embedding``: ``rotary_embedding``; ``AscendRotaryEmbedding``.
- ``moe.routing``: ``select_experts``; ``moe.experts``: ``moe_experts``;
  ``moe.fused_moe``: ``AscendUnquantizedFusedMoEMethod``.

``VocabParallelEmbedding`` and ``LogitsProcessor`` run unchanged on the OOT
platform (their ``forward_oot`` is vLLM's torch ``forward_native``).
"""

import importlib

OP_MODULES = (
    "vllm_ascend.ops.layernorm",
    "vllm_ascend.ops.activation",
    "vllm_ascend.ops.rotary_embedding",
    "vllm_ascend.ops.moe.fused_moe",
)


def register_oot_ops() -> None:
    """Import the modules whose classes register with CustomOp.

    Registration happens once, at first import; calling again is harmless.
    """
    for name in OP_MODULES:
        importlib.import_module(name)
