"""Install the venv's import hook for the torch_npu contract double.

With ``VLLM_ASCEND_NPU_DOUBLE=1`` in the environment, every Python process
of the venv (the engine core, DP ranks, the API server, pytest) finds the
double (``tests/npu_double/torch_npu``) when it imports ``torch_npu``.
Without it the hook does nothing. ``make install`` runs it as
``python -m tools.dev.install_npu_double``: a ``.pth`` file imports a small
module that adds a finder for the one package name, ``torch_npu``.
``VLLM_ASCEND_NPU_DOUBLE_PACKAGE`` points it at another checkout's double
(a git worktree sharing this venv).
"""

import site
from pathlib import Path

PACKAGE = (Path(__file__).resolve().parents[2] / "tests" / "npu_double" /
           "torch_npu")
MODULE = "vllm_ascend_npu_double_hook"
FINDER = f'''"""Written by tools.dev.install_npu_double: with
VLLM_ASCEND_NPU_DOUBLE=1, ``import torch_npu`` finds the contract double."""

import importlib.abc
import importlib.util
import os
import sys

PACKAGE = os.environ.get("VLLM_ASCEND_NPU_DOUBLE_PACKAGE",
                         {str(PACKAGE)!r})


class TorchNpuDoubleFinder(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):
        if name != "torch_npu":
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(PACKAGE, "__init__.py"),
            submodule_search_locations=[PACKAGE])


if os.environ.get("VLLM_ASCEND_NPU_DOUBLE") == "1" and not any(
        isinstance(f, TorchNpuDoubleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, TorchNpuDoubleFinder())
'''


def main() -> None:
    site_packages = Path(site.getsitepackages()[0])
    (site_packages / f"{MODULE}.py").write_text(FINDER)
    path = site_packages / "vllm-ascend-npu-double.pth"
    path.write_text(f"import {MODULE}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
