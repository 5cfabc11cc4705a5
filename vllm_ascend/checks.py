"""Startup validation of GLM-4.5 checkpoints.

vLLM's loader reports unloaded parameters, but a fused-experts parameter
counts as loaded as soon as one expert's tensor arrives: a checkpoint that
lacks some experts' tensors loads without an error and serves from
uninitialized memory. This check compares a checkpoint's tensor names (read
from the safetensors headers, no data) with the names a GLM-4.5 config
implies, before any process is spawned.
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_ascend import envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

GLM45_MODEL_TYPES = ("glm4_moe", )
MTP_METHODS = ("glm4_moe_mtp", "mtp")
# How many missing names an error lists before it summarizes.
MAX_LISTED = 12


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _decoder_layer(prefix: str, index: int, config: Any) -> set[str]:
    names = {f"{prefix}input_layernorm.weight",
             f"{prefix}post_attention_layernorm.weight",
             f"{prefix}self_attn.o_proj.weight"}
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.add(f"{prefix}self_attn.{proj}.weight")
        if _get(config, "attention_bias", False):
            names.add(f"{prefix}self_attn.{proj}.bias")
    if _get(config, "use_qk_norm", False):
        names |= {f"{prefix}self_attn.q_norm.weight",
                  f"{prefix}self_attn.k_norm.weight"}
    mlp = ("gate_proj", "up_proj", "down_proj")
    experts = _get(config, "n_routed_experts")
    if experts is None or index < _get(config, "first_k_dense_replace", 0):
        return names | {f"{prefix}mlp.{p}.weight" for p in mlp}
    names |= {f"{prefix}mlp.gate.weight",
              f"{prefix}mlp.gate.e_score_correction_bias"}
    names |= {f"{prefix}mlp.experts.{e}.{p}.weight"
              for e in range(experts) for p in mlp}
    if _get(config, "n_shared_experts"):
        names |= {f"{prefix}mlp.shared_experts.{p}.weight" for p in mlp}
    return names


def expected_glm45_tensors(config: Any, with_mtp: bool) -> set[str]:
    """Tensor names a GLM-4.5 checkpoint must hold for ``config`` (a
    ``PretrainedConfig`` or a config.json dict). The MTP layers'
    ``embed_tokens`` and ``shared_head.head`` are optional: GLM-4.6 omits
    these copies of the main model's tensors."""
    layers = _get(config, "num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(
            f"num_hidden_layers={layers!r} in the model config: a GLM-4.5 "
            "config needs a positive layer count.")
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not _get(config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    for i in range(layers):
        names |= _decoder_layer(f"model.layers.{i}.", i, config)
    if with_mtp:
        for i in range(layers,
                       layers + _get(config, "num_nextn_predict_layers", 0)):
            prefix = f"model.layers.{i}."
            names |= _decoder_layer(prefix, i, config)
            names |= {f"{prefix}{n}.weight"
                      for n in ("enorm", "hnorm", "eh_proj",
                                "shared_head.norm")}
    return names


def checkpoint_tensor_names(model_dir: Path) -> set[str]:
    """All tensor names in a directory's ``*.safetensors`` files (headers
    only). Shards listed in an index but absent are an error."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        absent = sorted({f for f in weight_map.values()
                         if not (model_dir / f).exists()})
        if absent:
            raise ValueError(
                f"{index} lists shard(s) that are not in {model_dir}: "
                f"{', '.join(absent)}. Download the missing shard(s) or "
                "re-export the checkpoint.")
    if not files:
        raise ValueError(
            f"{model_dir} has no *.safetensors files: point the model at a "
            "directory holding the checkpoint's safetensors shards.")
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _summarize(names: Iterable[str]) -> str:
    names = sorted(names, key=_natural_key)
    listed = ", ".join(names[:MAX_LISTED])
    if len(names) > MAX_LISTED:
        listed += f", ... ({len(names) - MAX_LISTED} more)"
    return listed


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def check_glm45_checkpoint(model_dir: Path, config: Any,
                           with_mtp: bool) -> None:
    """Raise ``ValueError`` naming the tensors ``config`` needs that the
    checkpoint in ``model_dir`` does not have."""
    missing = expected_glm45_tensors(config, with_mtp) - \
        checkpoint_tensor_names(model_dir)
    if not missing:
        return
    layers = _get(config, "num_hidden_layers")
    mtp = [n for n in missing if (_layer_index(n) or -1) >= layers]
    hint = ("The checkpoint is incomplete: re-download or re-export it "
            "(all shards), or fix config.json if it describes a different "
            "model.")
    if mtp and len(mtp) == len(missing):
        hint = (f"The MTP layer (model.layers.{layers}.*) is incomplete: use "
                "a checkpoint that includes it, or serve without "
                "--speculative-config.")
    raise ValueError(
        f"Checkpoint {model_dir} is missing {len(missing)} tensor(s) that "
        f"its config.json requires: {_summarize(missing)}. {hint}")


def check_checkpoint(vllm_config: "VllmConfig") -> None:
    """Validate a local GLM-4.5 checkpoint (float or Ascend W8A8) at
    startup.

    Call from ``AscendPlatformBase.check_and_update_config``: it runs in the API
    server (or ``LLM``) process before the engine core is spawned, so a bad
    checkpoint fails in seconds with this message instead of a worker
    traceback, or not at all (missing experts).
    """
    model_config = vllm_config.model_config
    if model_config is None or envs.skip_checkpoint_check():
        return
    hf_config = model_config.hf_config
    model_dir = Path(model_config.model)
    if _get(hf_config, "model_type") not in GLM45_MODEL_TYPES:
        return
    load_format = str(getattr(vllm_config.load_config, "load_format",
                              "auto"))
    has_weights = model_dir.is_dir() and (
        any(model_dir.glob("*.safetensors"))
        or (model_dir / "model.safetensors.index.json").exists())
    quantization = model_config.quantization
    if (not has_weights or quantization not in (None, "ascend")
            or load_format not in ("auto", "safetensors")):
        # Hub names are resolved by the loader; a directory without
        # safetensors (config only, other formats, dummy weights) is the
        # loader's to judge; other quantized layouts rename tensors
        # (packed weights) and are checked by their loader.
        logger.debug("Skipping the GLM-4.5 checkpoint check for %s.",
                     model_config.model)
        return
    spec = vllm_config.speculative_config
    with_mtp = spec is not None and spec.method in MTP_METHODS
    check_glm45_checkpoint(model_dir, hf_config, with_mtp)
    if quantization == "ascend":
        from vllm_ascend.quantization.description import QuantDescription
        description = QuantDescription.from_dir(model_dir)
        description.check_tensors(checkpoint_tensor_names(model_dir))
        # Anti-outlier (m4) norm biases: each must have its RMSNorm (the
        # MTP layer's too: skipped with the layer when it is not served).
        description.check_norm_biases(
            n for n in expected_glm45_tensors(hf_config, with_mtp=True)
            if n.endswith("norm.weight"))


def check_parallel_layout(vllm_config: "VllmConfig") -> None:
    """A GLM-4.5 that the parallel layout cannot split fails at startup in
    one line (vLLM checks the attention heads itself; the rest would fail
    in a worker, with an assertion deep in a layer)."""
    passes = getattr(vllm_config.compilation_config, "pass_config", None)
    if getattr(passes, "enable_sequence_parallelism", False):
        # Silently ignored otherwise (vllm_ascend compiles without
        # inductor), while capture sizes would still follow it; and a
        # sequence-parallel draft would reduce-scatter its embedding but
        # not its hidden states.
        raise ValueError(
            "sequence parallelism (--compilation-config pass_config "
            "enable_sequence_parallelism or enable_async_tp) is an inductor "
            "pass that vllm_ascend does not run: remove it.")
    model_config = vllm_config.model_config
    if model_config is None:
        return
    config = model_config.hf_text_config
    if _get(config, "model_type") not in GLM45_MODEL_TYPES:
        return
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    kv_heads = _get(config, "num_key_value_heads") or _get(
        config, "num_attention_heads")
    if kv_heads and (tp % kv_heads if tp >= kv_heads else kv_heads % tp):
        raise ValueError(
            f"--tensor-parallel-size {tp} cannot split the model's "
            f"{kv_heads} KV heads (each must divide the other): use a "
            f"tensor-parallel size that divides {kv_heads} or is a "
            f"multiple of it.")
    ep = parallel.enable_expert_parallel
    sizes = {"intermediate_size": _get(config, "intermediate_size")
             if _get(config, "first_k_dense_replace", 0) else None,
             "moe_intermediate_size": _get(config, "moe_intermediate_size")}
    for key, size in sizes.items():
        if size and size % tp:
            raise ValueError(
                f"--tensor-parallel-size {tp} does not divide the model's "
                f"{key} {size}: use a tensor-parallel size that divides it.")
    experts = _get(config, "n_routed_experts") or 0
    ep_size = parallel.data_parallel_size * tp
    if ep and ep_size > 1 and experts < ep_size:
        raise ValueError(
            f"--enable-expert-parallel over {ep_size} ranks (DP x TP) needs "
            f"at least one routed expert per rank, but the model has "
            f"{experts}: use fewer ranks or drop --enable-expert-parallel.")


# The limit is VLLM_ASCEND_MAX_N (vllm_ascend/envs.py says why).
MAX_N_ENV = envs.VLLM_ASCEND_MAX_N_ENV
DEFAULT_MAX_N = envs.DEFAULT_MAX_N


def check_sampling_params(params: Any) -> None:
    """Reject a request whose ``n`` exceeds ``VLLM_ASCEND_MAX_N``.

    Call from ``AscendPlatformBase.validate_request``: vLLM turns the
    ``ValueError`` into an HTTP 400 for that request only.
    """
    n = getattr(params, "n", 1) or 1
    limit = envs.VLLM_ASCEND_MAX_N
    if n > limit:
        raise ValueError(
            f"n={n} completions per request is more than this server allows "
            f"({limit}): ask for at most {limit} (or send several requests); "
            f"the operator can raise the limit with {MAX_N_ENV}.")
