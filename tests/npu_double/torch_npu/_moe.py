"""The fused MoE un-permute: ``npu_moe_token_unpermute``.

op-plugin 7.2.0 ships its documentation as the op's docstring, not as a
``docs/context`` page: ``codegen/templates/_op_plugin_docs.py:10905-10953``
(cited as ``U:`` with its lines); the schema is
``op_plugin/config/op_plugin_functions.yaml:6886`` and the output shape
``op_plugin/utils/KernelNpuOutputSize.cpp:2097-2114`` (``S:``). The golden
test (``test/test_custom_ops/test_npu_moe_token_permute_and_unpermute.py``
``test_unpermute``) fixes the index convention: ``sorted_indices[s]`` is the
row of ``permuted_tokens`` that holds flat slot ``s = t * K + k``, the
*gather* index ``npu_moe_init_routing_v2`` returns with ``row_idx_type=0``;
vllm-ascend v0.11.0 passes exactly that (``ops/moe/token_dispatcher.py:
392-395``).
"""

import torch

from . import npu as _npu
from ._ops import check
from ._trace import traced


@traced("torch_npu.npu_moe_token_unpermute")
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None,
                            padded_mode=False, restore_shape=None):
    """U:10912: out[t] = sum_k probs[t, k] * permuted_tokens[
    sorted_indices[t * K + k]] (K = probs.shape[1], 1 without probs),
    summed in float32, returned in permuted_tokens' dtype (yaml:6891)."""
    op = "npu_moe_token_unpermute"
    _npu.state.kernel_launched()
    # U:10915, S:2104
    check(permuted_tokens.dim() == 2, op,
          "permuted_tokens must be 2-D [num_tokens * topK, hidden_size]")
    check(permuted_tokens.dtype == torch.bfloat16, op,
          f"permuted_tokens dtype {permuted_tokens.dtype} is not supported; "
          "expected torch.bfloat16")
    # U:10916, S:2106. The doc names int64; the golden test and
    # vllm-ascend v0.11.0 pass init_routing_v2's int32 index.
    check(sorted_indices.dim() == 1, op, "sorted_indices must be 1-D")
    check(sorted_indices.dtype in (torch.int32, torch.int64), op,
          f"sorted_indices dtype {sorted_indices.dtype} is not supported; "
          "expected int32 or int64")
    # U:10918, U:10925: padded_mode False only (restore_shape unused).
    check(padded_mode is False, op, "only padded_mode=False is supported")
    top_k = 1
    if probs is not None:
        # U:10917, S:2101
        check(probs.dim() == 2, op, "probs must be 2-D [num_tokens, topK]")
        check(probs.dtype == torch.bfloat16, op,
              f"probs dtype {probs.dtype} is not supported; expected "
              "torch.bfloat16")
        top_k = probs.shape[1]
        check(top_k > 0, op, "topK must be greater than zero")
    slots = sorted_indices.shape[0]
    # U:10915-10917: permuted_tokens and sorted_indices have num_tokens *
    # topK rows, probs num_tokens.
    check(slots % top_k == 0 and permuted_tokens.shape[0] == slots, op,
          f"permuted_tokens has {permuted_tokens.shape[0]} rows and "
          f"sorted_indices {slots}: both must be num_tokens * topK")
    num_tokens = slots // top_k  # S:2112
    check(probs is None or probs.shape[0] == num_tokens, op,
          f"probs must be [num_tokens={num_tokens}, topK={top_k}]")
    index = sorted_indices.long()
    check(bool(((index >= 0) & (index < slots)).all()), op,
          f"sorted_indices must lie in [0, {slots})")
    rows = permuted_tokens[index].float().view(num_tokens, top_k, -1)
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)
