"""A contract double of ``torch_npu``, for running the NPU code paths on CPU.

Test-only: production code never imports it. ``torch_npu/`` below is a
package of that name; with its parent folder first on ``sys.path`` it is what
``import torch_npu`` finds. ``make install`` writes a ``.pth`` file into the
venv that does exactly that in every process (engine cores, DP ranks, the
API server) when ``VLLM_ASCEND_NPU_DOUBLE=1``; with
``VLLM_ASCEND_DEVICE=npu`` the plugin then takes its NPU code paths with CPU
tensors underneath.

Every torch_npu op and ``torch.npu`` function the plugin calls first checks
the op's documented contract (each check cites its documentation) and raises
the error the real op would; then it computes the result from the
documented semantics. Calls are recorded by call site (``file:line`` under
``vllm_ascend/``) in ``$VLLM_ASCEND_NPU_DOUBLE_TRACE`` when that is set, so a
test can tell which call sites the suite reached.
"""

import importlib
import sys
from pathlib import Path

DOUBLE_PATH = str(Path(__file__).resolve().parent)


def install():
    """Make ``import torch_npu`` return the double in this process."""
    if DOUBLE_PATH not in sys.path:
        sys.path.insert(0, DOUBLE_PATH)
    real = sys.modules.get("torch_npu")
    if real is not None and not getattr(real, "CONTRACT_DOUBLE", False):
        raise RuntimeError("the real torch_npu is already imported")
    return importlib.import_module("torch_npu")


def uninstall() -> None:
    import torch
    if DOUBLE_PATH in sys.path:
        sys.path.remove(DOUBLE_PATH)
    for name in [n for n in sys.modules
                 if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    sys.modules.pop("torch.npu", None)
    if hasattr(torch, "npu"):
        del torch.npu
