"""Write the venv's ``.pth`` hook for the torch_npu contract double.

With ``VLLM_ASCEND_NPU_DOUBLE=1`` in the environment, every Python process
of the venv (the engine core, DP ranks, the API server, pytest) puts
``tests/npu_double`` first on ``sys.path``, so ``import torch_npu`` finds the
double. Without it the hook does nothing. ``make install`` runs it as
``python -m tools.dev.install_npu_double``.
"""

import site
from pathlib import Path

DOUBLE = Path(__file__).resolve().parents[2] / "tests" / "npu_double"
HOOK = ("import os, sys; os.environ.get('VLLM_ASCEND_NPU_DOUBLE') == '1' "
        f"and {str(DOUBLE)!r} not in sys.path "
        f"and sys.path.insert(0, {str(DOUBLE)!r})\n")


def main() -> None:
    path = Path(site.getsitepackages()[0], "vllm-ascend-npu-double.pth")
    path.write_text(HOOK)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
