"""The quantization description of an Ascend (msModelSlim) checkpoint.

``quant_model_description.json`` maps every tensor name of the checkpoint
to its quantization type (``FLOAT``, ``W8A8``, ``W8A8_DYNAMIC``,
``W4A8_DYNAMIC``); keys without a dot (``model_quant_type``, ``version``)
describe the file. A layer's method is the type of its ``<prefix>.weight``.

A checkpoint quantized with the anti-outlier method m4 also lists the
norms' biases (``<norm>.bias``, FLOAT): the activations entering the
linears were shifted and the linears' biases compensate, so each must be
loaded (``vllm_ascend.ops.layernorm.AscendRMSNorm.bias``).
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DESCRIPTION_FILE = "quant_model_description.json"

FLOAT = "FLOAT"
W8A8 = "W8A8"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W4A8_DYNAMIC = "W4A8_DYNAMIC"
KNOWN_TYPES = (FLOAT, W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC)
SUPPORTED_TYPES = (FLOAT, W8A8, W8A8_DYNAMIC)

# Tensors each quantized linear type stores next to its int8 ``weight``.
LINEAR_TENSORS = {
    W8A8: ("weight", "weight_scale", "weight_offset", "input_scale",
           "input_offset", "quant_bias", "deq_scale"),
    W8A8_DYNAMIC: ("weight", "weight_scale", "weight_offset"),
}

# The name part of a norm's bias (input_layernorm.bias, enorm.bias, ...).
NORM_BIAS = "norm.bias"

# GLM-4.5's fused modules; a model's own packed_modules_mapping wins.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class QuantDescription:
    """Tensor name -> quantization type, validated when read."""

    def __init__(self, entries: dict[str, Any], source: str):
        self.source = source
        self.metadata = {k: v for k, v in entries.items() if "." not in k}
        self.types: dict[str, str] = {}
        for name, qtype in entries.items():
            if "." not in name:
                continue
            if qtype == W4A8_DYNAMIC:
                raise ValueError(
                    f"{source}: {name} is W4A8_DYNAMIC, which vllm_ascend "
                    "does not support yet: export the checkpoint as W8A8 or "
                    "W8A8_DYNAMIC (msModelSlim) or serve the float model.")
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{source}: {name} has unknown quantization type "
                    f"{qtype!r}; expected one of {list(KNOWN_TYPES)}. Fix or "
                    "re-export the description file.")
            if name.endswith(NORM_BIAS) and qtype != FLOAT:
                raise ValueError(
                    f"{source}: {name} is {qtype}: a norm bias is added in "
                    "float after the norm; re-export it as FLOAT.")
            self.types[name] = qtype
        if not self.types:
            raise ValueError(
                f"{source} lists no tensors: it is not an Ascend "
                "quantization description; re-export the checkpoint with "
                "msModelSlim or python -m tools.quantize.w8a8.")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "QuantDescription":
        path = Path(model_dir) / DESCRIPTION_FILE
        if not path.is_file():
            raise ValueError(
                f"--quantization ascend needs {DESCRIPTION_FILE} in "
                f"{model_dir}, and there is none: serve a W8A8 checkpoint "
                "exported by msModelSlim (or python -m tools.quantize.w8a8), "
                "or drop --quantization ascend for a float checkpoint.")
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}).") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{path} must hold one JSON object.")
        return cls(entries, str(path))

    @property
    def norm_biases(self) -> list[str]:
        """The norm biases the description lists (anti-outlier m4)."""
        return sorted(n for n in self.types if n.endswith(NORM_BIAS))

    def check_norm_biases(self, norm_weights: Iterable[str]) -> None:
        """Every listed norm bias belongs to a norm of the served model
        (``norm_weights``: its norms' ``.weight`` names); vLLM's loaders
        skip a bias that no parameter takes, which would serve the shifted
        activations without their shift."""
        norms = set(norm_weights)
        for name in self.norm_biases:
            weight = name.removesuffix("bias") + "weight"
            if weight not in norms:
                raise ValueError(
                    f"{self.source} lists {name}, a norm bias (anti-outlier "
                    "m4) that no norm of the served model takes: it would "
                    "be dropped; re-export the checkpoint without "
                    "anti-outlier for this norm, or check the model config.")

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for qtype in self.types.values():
            counts[qtype] = counts.get(qtype, 0) + 1
        return counts

    def tensor_type(self, name: str) -> str:
        try:
            return self.types[name]
        except KeyError:
            raise ValueError(
                f"{self.source} has no entry for {name}: the description "
                "does not match the model being built; re-export the "
                "checkpoint (or check --quantization).") from None

    def layer_type(self, prefix: str,
                   packed: dict[str, list[str]]) -> str:
        """The type of a (possibly fused) linear layer's weight. The parts
        of a fused layer (q/k/v, gate/up) must agree."""
        head, _, last = prefix.rpartition(".")
        parts = packed.get(last) or DEFAULT_PACKED_MODULES.get(last)
        if not parts:
            return self.tensor_type(f"{prefix}.weight")
        names = [f"{head}.{p}.weight" if head else f"{p}.weight"
                 for p in parts]
        types = {n: self.tensor_type(n) for n in names}
        if len(set(types.values())) > 1:
            listed = ", ".join(f"{n} {t}" for n, t in types.items())
            raise ValueError(
                f"{self.source}: the parts of fused layer {prefix} have "
                f"different quantization types ({listed}); vLLM runs them "
                "as one matmul: quantize them alike.")
        return next(iter(types.values()))

    def experts_type(self, prefix: str) -> str:
        """The one type of all routed experts' weights under ``prefix``
        (``model.layers.<i>.mlp.experts``)."""
        start = f"{prefix}."
        types = {n: t for n, t in self.types.items()
                 if n.startswith(start) and n.endswith(".weight")}
        if not types:
            return self.tensor_type(f"{prefix}.0.gate_proj.weight")
        kinds = set(types.values())
        if len(kinds) > 1:
            sample = {t: n for n, t in types.items()}
            listed = ", ".join(f"{n} {t}" for t, n in sample.items())
            raise ValueError(
                f"{self.source}: the experts of {prefix} mix quantization "
                f"types ({listed}); vLLM runs them as one fused layer: "
                "quantize them alike.")
        return kinds.pop()

    def check_tensors(self, checkpoint: Iterable[str]) -> None:
        """The description and the checkpoint name the same tensors, and
        every quantized layer has its scales."""
        names = set(checkpoint)
        undescribed = sorted(names - self.types.keys())
        if undescribed:
            raise ValueError(
                f"{self.source} does not describe {len(undescribed)} tensor(s) "
                f"of the checkpoint: {_listed(undescribed)}. Re-export the "
                "checkpoint so that the description matches its shards.")
        absent = sorted(self.types.keys() - names)
        if absent:
            raise ValueError(
                f"{self.source} lists {len(absent)} tensor(s) the checkpoint "
                f"does not have: {_listed(absent)}. Download the missing "
                "shard(s) or re-export the checkpoint.")
        for name, qtype in sorted(self.types.items()):
            if qtype == FLOAT or not name.endswith(".weight"):
                continue
            layer = name.removesuffix(".weight")
            for suffix in LINEAR_TENSORS[qtype]:
                if f"{layer}.{suffix}" not in names:
                    raise ValueError(
                        f"{name} is {qtype} but the checkpoint has no "
                        f"{layer}.{suffix}: re-export the checkpoint (a "
                        f"{qtype} layer needs "
                        f"{', '.join(LINEAR_TENSORS[qtype])}).")


def _listed(names: list[str], limit: int = 8) -> str:
    text = ", ".join(names[:limit])
    if len(names) > limit:
        text += f", ... ({len(names) - limit} more)"
    return text
