"""Write an Ascend W8A8 checkpoint (msModelSlim's layout) from a float
GLM-4.5 checkpoint, for ``vllm serve ... --quantization ascend``.

    python -m tools.quantize.w8a8 --model SRC --out DST [--float-mtp]
        [--dynamic-only] [--anti-outlier] [--calib-file PROMPTS.json]

Per layer (msModelSlim's names, see vllm_ascend/quantization):
- attention projections: W8A8 (static), with per-tensor activation scale
  and offset calibrated on a few prompts (min/max of each projection's
  input in a float forward), ``quant_bias`` = -offset * sum_k w_q and
  ``deq_scale`` = input_scale * weight_scale; with ``--dynamic-only``
  W8A8_DYNAMIC like the rest;
- dense MLP, shared and routed experts: W8A8_DYNAMIC (per-token
  activations at run time);
- every weight: int8, per output channel symmetric (scale = max|w|/127,
  offset 0);
- FLOAT: embeddings, LM heads, norms, the router and its bias, the
  attention biases, and with ``--float-mtp`` every tensor of the MTP layer
  (``model.layers.<num_hidden_layers>.*``). Without it the MTP layer's
  linears (``eh_proj`` included) are W8A8_DYNAMIC: the tool runs no MTP
  forward to calibrate static scales.

With ``--anti-outlier``, as msModelSlim's anti-outlier method m4 does for
its shift: each main-model layer's ``input_layernorm`` output is centered
per channel (shift s = (max + min) / 2 over the calibration prompts), the
norm gets ``bias`` = -s (FLOAT in the description) and the q/k/v biases,
which it feeds, take ``bias + W s`` with W the weight as served
(dequantized), so that W (x_n - s) + bias + W s = W x_n + bias: the float
function is unchanged and the static activation range is the shifted one.
Norms whose linears have no bias (``post_attention_layernorm`` before the
MLP or experts, the MTP layer's, the final norm) are not shifted: vLLM's
GLM-4.5 layers have no bias to compensate in; nor is the MTP layer's
``input_layernorm`` (no MTP forward to calibrate). Needs
``attention_bias``.

It writes ``model.safetensors``, ``quant_model_description.json``, the
config with ``"quantization_config": {"quant_method": "ascend"}`` and the
tokenizer and generation files. A tool for small checkpoints (tests,
fixtures): it holds the model in memory and calibrates with transformers.
"""

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DESCRIPTION_FILE = "quant_model_description.json"
ATTENTION = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$")
MLP = re.compile(r"\.mlp\.(shared_experts\.|experts\.\d+\.)?"
                 r"(gate|up|down)_proj\.weight$")
EH_PROJ = re.compile(r"\.eh_proj\.weight$")
COPY_FILES = ("tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json", "tokenizer.model")
DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens that the model then verifies.",
    "def add(a, b):\n    return a + b\n",
    "In 1905 Einstein published four papers.",
]


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                state[name] = f.get_tensor(name)
    if not state:
        sys.exit(f"error: no *.safetensors in {model_dir}")
    return state


def quantize_weight(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale,
            "weight_offset": torch.zeros_like(scale)}


def static_params(q: dict[str, torch.Tensor], low: float,
                  high: float) -> dict[str, torch.Tensor]:
    """Per-tensor asymmetric activation quantization over [low, high]."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / 255 if high > low else 1.0
    offset = float(round(-128 - low / scale))
    w_sum = q["weight"].to(torch.int64).sum(dim=1)
    return {
        "input_scale": torch.tensor([scale], dtype=torch.float32),
        "input_offset": torch.tensor([offset], dtype=torch.float32),
        "quant_bias": (-offset * w_sum).to(torch.int32),
        "deq_scale": (scale * q["weight_scale"].squeeze(1)).float(),
    }


def calibrate(
    src: Path,
    names: list[str],
    prompts: list[str],
    num_layers: int,
    channel_names: tuple[str, ...] = ()
) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[torch.Tensor,
                                                           torch.Tensor]]]:
    """min/max of each named linear's input over ``prompts`` (float
    forward of the main model with transformers), and per input channel
    for ``channel_names``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # The MTP layer's tensors are not the causal LM's: loading warns.
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(src),
                                                 dtype=torch.float32)
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src))
        batches = [tokenizer(p, return_tensors="pt").input_ids
                   for p in prompts]
    except (OSError, ValueError):
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        batches = [torch.randint(1, vocab, (1, 32), generator=gen)
                   for _ in prompts]
    ranges: dict[str, list[float]] = {}
    channels: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name.removesuffix(".weight")]

        def hook(_mod, args, _out, key=name):
            x = args[0].detach()
            low, high = ranges.setdefault(key, [float("inf"),
                                                float("-inf")])
            ranges[key] = [min(low, x.min().item()), max(high,
                                                         x.max().item())]

        hooks.append(module.register_forward_hook(hook))
    for name in channel_names:
        module = modules[name.removesuffix(".weight")]

        def channel_hook(_mod, args, _out, key=name):
            x = args[0].detach().flatten(0, -2)
            low, high = x.amin(dim=0), x.amax(dim=0)
            if key in channels:
                low = torch.minimum(low, channels[key][0])
                high = torch.maximum(high, channels[key][1])
            channels[key] = (low, high)

        hooks.append(module.register_forward_hook(channel_hook))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    missing = [n for n in names if n not in ranges]
    missing += [n for n in channel_names if n not in channels]
    if missing:
        sys.exit(f"error: calibration never reached {missing[0]}")
    return {k: (v[0], v[1]) for k, v in ranges.items()}, channels


def shifted_norms(num_layers: int) -> dict[str, list[str]]:
    """Norm -> the linears it feeds, for the norms ``--anti-outlier``
    shifts: each main-model layer's input_layernorm (q/k/v have biases)."""
    return {
        f"model.layers.{i}.input_layernorm":
        [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        for i in range(num_layers)
    }


def anti_outlier(
    state: dict[str, torch.Tensor], norms: dict[str, list[str]],
    channels: dict[str, tuple[torch.Tensor, torch.Tensor]],
    served_weight: Callable[[str], torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Give each norm in ``norms`` the bias -s (s: the center of its
    output's per-channel range, ``channels[<first linear>.weight]``) and
    its linears' biases ``+ W s`` (``served_weight(name)``: the weight as
    served, float); in place. Returns the linears' shifted input ranges."""
    shifted = {}
    for norm, linears in norms.items():
        low, high = (t.double() for t in channels[f"{linears[0]}.weight"])
        norm_bias = (-(high + low) / 2).to(state[f"{norm}.weight"].dtype)
        state[f"{norm}.bias"] = norm_bias
        # Compensate the shift as stored (rounded to the norm's dtype).
        shift = -norm_bias.double()
        for linear in linears:
            bias = state.get(f"{linear}.bias")
            if bias is None:
                sys.exit(f"error: --anti-outlier: {linear} has no bias to "
                         f"compensate the shift of {norm} in")
            w = served_weight(f"{linear}.weight").double()
            state[f"{linear}.bias"] = (bias.double() +
                                       w @ shift).to(bias.dtype)
            shifted[f"{linear}.weight"] = (low - shift, high - shift)
    return shifted


def dequantized(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return params["weight"].double() * params["weight_scale"].double()


def plan(state: dict[str, torch.Tensor], num_layers: int, float_mtp: bool,
         dynamic_only: bool) -> dict[str, str]:
    """Weight name -> W8A8 / W8A8_DYNAMIC for every linear to quantize."""
    methods = {}
    for name in state:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        is_mtp = layer is not None and int(layer.group(1)) >= num_layers
        if is_mtp and float_mtp:
            continue
        if ATTENTION.search(name):
            methods[name] = ("W8A8_DYNAMIC" if dynamic_only or is_mtp
                             else "W8A8")
        elif MLP.search(name) or (is_mtp and EH_PROJ.search(name)):
            methods[name] = "W8A8_DYNAMIC"
    return methods


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--float-mtp", action="store_true",
                        help="keep every tensor of the MTP layer float")
    parser.add_argument("--dynamic-only", action="store_true",
                        help="W8A8_DYNAMIC everywhere (no calibration)")
    parser.add_argument("--anti-outlier", action="store_true",
                        help="shift the input_layernorm outputs as "
                        "msModelSlim's m4 does: non-zero norm biases, "
                        "compensated in the q/k/v biases")
    parser.add_argument("--calib-file", type=Path,
                        help="JSON list of calibration prompts")
    args = parser.parse_args(argv)

    config = json.loads((args.model / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    state = load_state(args.model)
    methods = plan(state, num_layers, args.float_mtp, args.dynamic_only)
    static = sorted(n for n, m in methods.items() if m == "W8A8")
    prompts = (json.loads(args.calib_file.read_text())
               if args.calib_file else DEFAULT_PROMPTS)
    norms = shifted_norms(num_layers) if args.anti_outlier else {}
    if norms and not config.get("attention_bias", False):
        sys.exit("error: --anti-outlier compensates the input_layernorm "
                 "shift in the q/k/v biases, and this model has none "
                 "(attention_bias false)")
    channel_names = tuple(f"{linears[0]}.weight"
                          for linears in norms.values())
    ranges, channels = (calibrate(args.model, static, prompts, num_layers,
                                  channel_names)
                        if static or channel_names else ({}, {}))
    quantized = {name: quantize_weight(state[name]) for name in methods}
    if norms:
        shifted = anti_outlier(
            state, norms, channels, lambda name: dequantized(
                quantized[name]) if name in quantized else state[name])
        for name, (low, high) in shifted.items():
            if name in ranges:
                ranges[name] = (low.min().item(), high.max().item())

    out: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {
        "model_quant_type": "W8A8_DYNAMIC" if args.dynamic_only else "W8A8",
        "version": "1.0.0",
    }
    for name, tensor in state.items():
        method = methods.get(name)
        if method is None:
            out[name] = tensor
            description[name] = "FLOAT"
            continue
        layer = name.removesuffix(".weight")
        params = quantized[name]
        if method == "W8A8":
            params.update(static_params(params, *ranges[name]))
        for suffix, value in params.items():
            out[f"{layer}.{suffix}"] = value.contiguous()
            description[f"{layer}.{suffix}"] = method

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out / "model.safetensors"),
              metadata={"format": "pt"})
    (args.out / DESCRIPTION_FILE).write_text(
        json.dumps(description, indent=1) + "\n")
    config["quantization_config"] = {"quant_method": "ascend"}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) +
                                          "\n")
    for name in COPY_FILES:
        if (args.model / name).exists():
            shutil.copy(args.model / name, args.out / name)
    counts: dict[str, int] = {}
    for method in methods.values():
        counts[method] = counts.get(method, 0) + 1
    float_mb = sum(t.numel() * t.element_size()
                   for t in state.values()) / 2**20
    quant_mb = sum(t.numel() * t.element_size()
                   for t in out.values()) / 2**20
    print(f"Wrote {args.out}: {counts} linear weights quantized, "
          f"MTP layer {'float' if args.float_mtp else 'quantized'}, "
          f"{len(norms)} norm biases (anti-outlier); "
          f"{float_mb:.1f} MiB -> {quant_mb:.1f} MiB.")


if __name__ == "__main__":
    main()
