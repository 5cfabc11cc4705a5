"""torch_npu, as a contract double on CPU tensors (test-only).

Importing it does what importing torch_npu does: ``torch.npu`` appears and
the ``hccl`` process-group backend is registered (``_hccl``: HCCL's
checks, gloo underneath). The ops are in ``_ops``.
"""

import sys

import torch
import torch.distributed as dist

from . import npu as _npu_module
from ._formats import get_npu_format, npu_format_cast  # noqa: F401
from ._hccl import HcclContractGroup

# isort: off
from ._mc2 import (npu_moe_distribute_combine_v2,  # noqa: F401
                   npu_moe_distribute_dispatch_v2)
from ._moe import npu_moe_token_unpermute  # noqa: F401
from ._ops import (  # noqa: F401
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_reshape_and_cache, npu_add_rms_norm, npu_dynamic_quant,
    npu_fused_infer_attention_score, npu_grouped_matmul,
    npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_quant_matmul,
    npu_quantize, npu_rms_norm, npu_rotary_mul, npu_swiglu)
# isort: on

CONTRACT_DOUBLE = True
__version__ = "2.8.0+contract-double"

npu = _npu_module


def _register() -> None:
    # The real torch_npu also names the PrivateUse1 backend "npu"; the
    # double does not: its tensors are CPU tensors, and with a named
    # backend torch.distributed would take it for the accelerator.
    if not hasattr(torch, "npu"):
        torch.npu = _npu_module
        sys.modules["torch.npu"] = _npu_module
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", HcclContractGroup,
                                      devices=["cpu"])


_register()


def npu_fusion_attention(*args, **kwargs):
    """Imported by transformers when torch_npu is present; the plugin never
    calls it."""
    raise NotImplementedError("the torch_npu double does not implement "
                              "npu_fusion_attention")
