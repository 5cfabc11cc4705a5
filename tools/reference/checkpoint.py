"""Read and write GLM-4.5 checkpoints in the real layout.

``config.json`` with GLM-4.5's keys, ``model-0000i-of-0000n.safetensors``
shards plus ``model.safetensors.index.json``, tensor names as in the
published checkpoints, the MTP layer at ``model.layers.<num_hidden_layers>``.
"""

import json
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from .mtp import MtpDims, MtpLayer

INDEX_NAME = "model.safetensors.index.json"
PathLike = Union[str, Path]


def _layer_of(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _order(name: str) -> tuple:
    """embed, layers in order (MTP last), final norm, lm_head."""
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, _layer_of(name), name)
    if name.startswith("model.norm"):
        return (2, 0, name)
    return (3, 0, name)


def save_sharded(out_dir: PathLike, tensors: dict[str, torch.Tensor],
                 num_shards: int = 2) -> list[Path]:
    """Writes the tensors in ``num_shards`` files split at equal sizes."""
    out = Path(out_dir)
    names = sorted(tensors, key=_order)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    acc = 0
    for name, size in zip(names, sizes):
        shard = min(num_shards - 1, acc * num_shards // total)
        shards[shard][name] = tensors[name].detach().contiguous().clone()
        acc += size
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append(out / fname)
        weight_map.update({n: fname for n in shard})
    index = {
        "metadata": {
            "total_size": total
        },
        "weight_map": dict(sorted(weight_map.items(),
                                  key=lambda kv: _order(kv[0]))),
    }
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files


def load_tensors(model_dir: PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a sharded (or single-file) checkpoint."""
    d = Path(model_dir)
    index = d / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"]
                           .values()))
    elif (d / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{d} has neither {INDEX_NAME} nor model.safetensors; pass the "
            "directory of a Hugging Face style checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(d / f)))
    return tensors


def read_config(model_dir: PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; is {model_dir} a "
                                "checkpoint directory?")
    config = json.loads(path.read_text())
    if config.get("model_type") != "glm4_moe":
        raise ValueError(f"{path}: model_type is {config.get('model_type')!r}"
                         ", expected 'glm4_moe' (a GLM-4.5 checkpoint)")
    if int(config.get("num_nextn_predict_layers", 0)) < 1:
        raise ValueError(f"{path}: num_nextn_predict_layers must be >= 1 for "
                         "an MTP reference; this checkpoint has no MTP layer")
    return config


def mtp_prefix(config: dict[str, Any]) -> str:
    return f"model.layers.{config['num_hidden_layers']}."


def load_main_model(model_dir: PathLike):
    """The main model as transformers' ``Glm4MoeForCausalLM`` (float32).

    The MTP tensors are skipped quietly: transformers does not use them.
    """
    from transformers import Glm4MoeForCausalLM

    layer = read_config(model_dir)["num_hidden_layers"]
    quiet = type("Glm4MoeForCausalLM", (Glm4MoeForCausalLM, ), {
        "_keys_to_ignore_on_load_unexpected": [rf"model\.layers\.{layer}\."]
    })
    model = quiet.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def load_mtp_layer(model_dir: PathLike,
                   tensors: Optional[dict[str, torch.Tensor]] = None
                   ) -> MtpLayer:
    """The MTP layer from its own tensors (including its embed/head copies).

    Raises if a tensor of the layer is missing or unexpected.
    """
    config = read_config(model_dir)
    if tensors is None:
        tensors = load_tensors(model_dir)
    prefix = mtp_prefix(config)
    own = {k[len(prefix):]: v for k, v in tensors.items()
           if k.startswith(prefix)}
    if not own:
        raise ValueError(f"{model_dir}: no tensors under {prefix!r}; the MTP "
                         "layer must sit at index num_hidden_layers")
    layer = MtpLayer(MtpDims.from_config(config))
    layer.load_state_dict(own, strict=True)
    return layer.eval()
