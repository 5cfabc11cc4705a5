"""``--quantization ascend``: Ascend W8A8 checkpoints (msModelSlim).

Each layer's method comes from its prefix in the checkpoint's
``quant_model_description.json``: FLOAT layers run vLLM's (and the
plugin's) unquantized methods, W8A8 and W8A8_DYNAMIC layers ours. The
embedding and the LM head stay float (a "with float mtp" checkpoint's MTP
layer shares them with the target).
"""

from typing import Any, Optional

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers import linear as vllm_linear
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.linear import (LinearBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization import (
    register_quantization_config)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig, QuantizeMethodBase)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod, VocabParallelEmbedding)

from vllm_ascend.quantization import description as desc
from vllm_ascend.quantization.description import (DESCRIPTION_FILE,
                                                  QuantDescription)
from vllm_ascend.quantization.linear import (AscendW8A8DynamicLinearMethod,
                                             AscendW8A8LinearMethod)

logger = init_logger(__name__)

ASCEND_QUANTIZATION = "ascend"

# Our linear methods build vLLM parameters (ModelWeightParameter, ...)
# whose own loaders shard them: the layers must call those loaders.
for _cls in (AscendW8A8LinearMethod, AscendW8A8DynamicLinearMethod):
    if _cls.__name__ not in vllm_linear.WEIGHT_LOADER_V2_SUPPORTED:
        vllm_linear.WEIGHT_LOADER_V2_SUPPORTED.append(_cls.__name__)


@register_quantization_config(ASCEND_QUANTIZATION)
class AscendQuantConfig(QuantizationConfig):

    def __init__(self, description: Optional[QuantDescription] = None):
        super().__init__()
        self.description = description
        self._logged: set[str] = set()

    def __repr__(self) -> str:
        source = self.description.source if self.description else None
        return f"AscendQuantConfig(description={source})"

    def get_name(self) -> str:
        return ASCEND_QUANTIZATION

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        from vllm.platforms import current_platform
        return current_platform.supported_dtypes

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # None: vLLM then builds the config empty (or from config.json's
        # quantization_config) and maybe_update_config reads the
        # description from the model directory, with our error if absent.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AscendQuantConfig":
        # config.json's {"quant_method": "ascend"}, or the description
        # itself.
        if any("." in key for key in config):
            return cls(QuantDescription(config, DESCRIPTION_FILE))
        return cls()

    def maybe_update_config(self, model_name: str) -> None:
        if self.description is None:
            self.description = QuantDescription.from_dir(model_name)
        logger.info(
            "Ascend quantization from %s: %d tensors (%s).",
            self.description.source, len(self.description.types),
            ", ".join(f"{t} {n}" for t, n in sorted(
                self.description.type_counts().items())))
        if self.description.norm_biases:
            logger.info(
                "%d norm biases (anti-outlier): every RMSNorm adds its "
                "bias after the norm.", len(self.description.norm_biases))

    def _described(self) -> QuantDescription:
        if self.description is None:
            raise ValueError(
                f"--quantization ascend: no {DESCRIPTION_FILE} was read; "
                "serve a directory that holds one.")
        return self.description

    def get_quant_method(self, layer: torch.nn.Module,
                         prefix: str) -> Optional[QuantizeMethodBase]:
        described = self._described()
        if isinstance(layer, LinearBase):
            qtype = described.layer_type(prefix, self.packed_modules_mapping)
            if qtype == desc.W8A8:
                return AscendW8A8LinearMethod(prefix)
            if qtype == desc.W8A8_DYNAMIC:
                return AscendW8A8DynamicLinearMethod(prefix)
            return UnquantizedLinearMethod()
        if isinstance(layer, FusedMoE):
            from vllm_ascend.ops.moe.fused_moe import (
                AscendUnquantizedFusedMoEMethod)
            from vllm_ascend.quantization.fused_moe import (
                AscendW8A8DynamicFusedMoEMethod)
            qtype = described.experts_type(prefix)
            if qtype == desc.W8A8_DYNAMIC:
                return AscendW8A8DynamicFusedMoEMethod(layer.moe_config,
                                                       prefix)
            if qtype == desc.W8A8:
                raise ValueError(
                    f"{prefix}: static W8A8 experts are not supported by "
                    "vllm_ascend; export the experts as W8A8_DYNAMIC.")
            return AscendUnquantizedFusedMoEMethod(layer.moe_config)
        if isinstance(layer, VocabParallelEmbedding):
            qtype = described.types.get(f"{prefix}.weight", desc.FLOAT)
            if qtype != desc.FLOAT:
                raise ValueError(
                    f"{prefix}.weight is {qtype}: vllm_ascend keeps the "
                    "embedding and LM head float; re-export them as FLOAT.")
            return UnquantizedEmbeddingMethod()
        return None
