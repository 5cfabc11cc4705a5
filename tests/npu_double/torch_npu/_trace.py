"""Record which call sites in ``vllm_ascend/`` reached the double."""

import functools
import os
import sys
from pathlib import Path

import torch

from ._emulator import kernel

TRACE_ENV = "VLLM_ASCEND_NPU_DOUBLE_TRACE"
_PLUGIN_DIR = str(Path(__file__).resolve().parents[3] / "vllm_ascend")
_seen: set[str] = set()


def record(name: str) -> None:
    """Note the plugin line (the innermost on the stack) that led to a call
    of ``name``."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    frame = sys._getframe(2)
    site = f"*:{name}"  # reached from vLLM's code (an aliased type)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PLUGIN_DIR):
            rel = os.path.relpath(filename, os.path.dirname(_PLUGIN_DIR))
            site = f"{rel}:{frame.f_lineno}:{name}"
            break
        frame = frame.f_back
    if site not in _seen:
        _seen.add(site)
        with open(path, "a") as f:
            f.write(site + "\n")


def traced(name: str):
    """Decorator: record the plugin call site of each call to ``name``.

    The op stays one call in a torch.compile graph, as torch_npu's
    registered ops do (Dynamo would otherwise trace into the double and
    fail on its bookkeeping), and one kernel in a device graph (the
    emulator records the launch, not what the double computes inside)."""

    def wrap(fn):
        launch = kernel(fn)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            record(name)
            return launch(*args, **kwargs)

        return torch.compiler.allow_in_graph(inner)

    return wrap
