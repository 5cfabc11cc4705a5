"""W8A8 checkpoints written by tools/quantize_w8a8.py, for the tests."""

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"


def _tool():
    spec = importlib.util.spec_from_file_location(
        "quantize_w8a8", ROOT / "tools" / "quantize_w8a8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize(src: Path, dst: Path, *flags: str) -> Path:
    """Run the tool in-process (its report line is dropped)."""
    with contextlib.redirect_stdout(io.StringIO()):
        _tool().main(["--model", str(src), "--out", str(dst), *flags])
    return dst
