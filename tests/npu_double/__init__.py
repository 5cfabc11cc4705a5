"""A contract double of ``torch_npu``, for running the NPU code paths on CPU.

Test-only: production code never imports it. ``torch_npu/`` below is a
package of that name. ``make install`` (``tools.dev.install_npu_double``)
adds an import hook to the venv that makes ``import torch_npu`` find it in
every process (engine cores, DP ranks, the API server) when
``VLLM_ASCEND_NPU_DOUBLE=1``; :func:`install` does the same in this process.
With ``VLLM_ASCEND_DEVICE=npu`` the plugin then takes its NPU code paths
with CPU tensors underneath. The double's graphs (``torch_npu/_emulator.py``
and ``_graphs.py``) record and replay as an NPU's do.

Every torch_npu op and ``torch.npu`` function the plugin calls first checks
the op's documented contract (each check cites its documentation) and raises
the error the real op would; then it computes the result from the
documented semantics. Calls are recorded by call site (``file:line`` under
``vllm_ascend/``) in ``$VLLM_ASCEND_NPU_DOUBLE_TRACE`` when that is set, so a
test can tell which call sites the suite reached.
"""

import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent / "torch_npu"


def install():
    """Make ``import torch_npu`` return the double in this process."""
    real = sys.modules.get("torch_npu")
    if real is not None:
        if not getattr(real, "CONTRACT_DOUBLE", False):
            raise RuntimeError("the real torch_npu is already imported")
        return real
    spec = importlib.util.spec_from_file_location(
        "torch_npu", PACKAGE / "__init__.py",
        submodule_search_locations=[str(PACKAGE)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_npu"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["torch_npu"]
        raise
    return module


def uninstall() -> None:
    import torch
    for name in [n for n in sys.modules
                 if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    sys.modules.pop("torch.npu", None)
    if hasattr(torch, "npu"):
        del torch.npu
