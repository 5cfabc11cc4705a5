"""W8A8 checkpoints written by ``tools.quantize.w8a8``, for the tests."""

import contextlib
import io
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from tools.quantize import w8a8

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"


def _tool():
    """The quantization tool's module (``python -m tools.quantize.w8a8``)."""
    return w8a8


def quantize(src: Path, dst: Path, *flags: str) -> Path:
    """Run the tool in-process (its report line is dropped)."""
    with contextlib.redirect_stdout(io.StringIO()):
        _tool().main(["--model", str(src), "--out", str(dst), *flags])
    return dst


def float_anti_outlier(src: Path, dst: Path) -> Path:
    """``src`` with the tool's anti-outlier shift and no quantization: the
    norms get their biases, q/k/v compensate with the float weights, every
    tensor FLOAT in the description. Served with ``--quantization
    ascend``, it must compute ``src``'s function."""
    tool = _tool()
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    state = tool.load_state(src)
    norms = tool.shifted_norms(layers)
    channel_names = tuple(f"{linears[0]}.weight"
                          for linears in norms.values())
    with contextlib.redirect_stdout(io.StringIO()):
        _, channels = tool.calibrate(src, [], tool.DEFAULT_PROMPTS, layers,
                                     channel_names)
    tool.anti_outlier(state, norms, channels, state.__getitem__)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in state.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    description = {"model_quant_type": "FLOAT", "version": "1.0.0"}
    description.update({name: "FLOAT" for name in state})
    (dst / tool.DESCRIPTION_FILE).write_text(json.dumps(description))
    config["quantization_config"] = {"quant_method": "ascend"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in tool.COPY_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst
