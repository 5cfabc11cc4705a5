"""The torch_npu ops the plugin calls: contract checks, then the semantics.

Each check is written from the op's documentation in Ascend/op-plugin at
the 7.2.0 tag (what torch_npu 2.8.0 ships; ``docs/context/<op>.md``, on
master ``docs/zh/custom_APIs/torch_npu/<op>.md``; the
schema in ``op_plugin/config/op_plugin_functions.yaml``) and raises what the
real op raises (RuntimeError from the kernel's parameter checks, TypeError
for an argument the schema does not take). Signatures follow the schemas:
the same argument names, the same keyword-only markers. Results are
computed from the documented formulas, in float32, independently of the
plugin's own references; what the documentation leaves undefined (rows
past the valid ones) is filled with NaN, so a caller that reads it sees it.
"""


import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._device as torch_device_utils
from torch.utils._pytree import tree_flatten

from . import _emulator, _formats
from . import npu as _npu
from ._trace import record, traced

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {message}")


def _dtype(t: torch.Tensor, allowed, op: str, name: str) -> None:
    check(t.dtype in allowed, op,
          f"{name} dtype {t.dtype} is not supported; expected one of "
          f"{[str(d) for d in allowed]}")


def _kernel() -> None:
    _npu.state.kernel_launched()


# --- paged attention ---------------------------------------------------

@traced("torch_npu._npu_reshape_and_cache")
def _npu_reshape_and_cache(key, value, key_cache, value_cache,
                           slot_indices) -> None:
    """ATB ReshapeAndCacheOperation (op_plugin/ops/atb/
    ReshapeAndCachAtb.cpp; CANN ATB docs, "ReshapeAndCacheOperation"):
    key/value [num_tokens, num_heads, head_size], caches [num_blocks,
    block_size, num_heads, head_size], all of one dtype (fp16/bf16/int8),
    slot_indices int32 [num_tokens]; writes the caches in place."""
    op = "_npu_reshape_and_cache"
    _kernel()
    check(key.dim() == 3 and value.dim() == 3, op,
          "key and value must be [num_tokens, num_heads, head_size]")
    check(key_cache.dim() == 4 and value_cache.dim() == 4, op,
          "key_cache and value_cache must be [num_blocks, block_size, "
          "num_heads, head_size] (ND)")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        _dtype(t, HALF + (torch.int8, ), op, name)
    check(len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype})
          == 1, op, "key, value, key_cache and value_cache must have the "
          "same dtype")
    check(key_cache.shape[2:] == key.shape[1:]
          and value_cache.shape[2:] == value.shape[1:], op,
          f"cache heads/head_size {tuple(key_cache.shape[2:])} do not match "
          f"key {tuple(key.shape[1:])}")
    check(slot_indices.dtype == torch.int32, op,
          f"slot_indices must be int32, got {slot_indices.dtype}")
    check(slot_indices.shape == (key.shape[0], ), op,
          f"slot_indices must be [num_tokens={key.shape[0]}], got "
          f"{tuple(slot_indices.shape)}")
    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_indices.long()
    check(bool((slots < num_blocks * block_size).all()), op,
          "slot index past the cache")
    valid = slots >= 0  # padding tokens (the op-plugin golden skips them)
    s = slots[valid]
    key_cache[s // block_size, s % block_size] = key[valid]
    value_cache[s // block_size, s % block_size] = value[valid]


_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD",
            "BNSD_NBSD", "TND", "TND_NTD", "NTD_TND")
MASK_SIZE = 2048


def _int_list(value, op: str, name: str) -> list[int]:
    # SymInt[]? in the schema: a Python list of ints, never a tensor.
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) for v in value):
        raise TypeError(f"{op}(): argument '{name}' must be a list of ints, "
                        f"not {type(value).__name__}")
    return list(value)


_FIA_DOC = "torch_npu-npu_fused_infer_attention_score.md"
# The double's workspace size (elements of query's dtype): nominal.
_WORKSPACE_ELEMENTS = 4096
# Inputs the schema takes that the double does not implement (None or 0).
_FIA_UNIMPLEMENTED = {
    "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
    "quant_offset2", "antiquant_scale", "antiquant_offset",
    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "query_padding_size", "kv_padding_size",
    "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len",
    "query_rope", "key_rope", "key_rope_antiquant_scale", "antiquant_mode",
    "key_antiquant_mode", "value_antiquant_mode"}


@dataclass
class _FiaCall:
    q_lens: list[int]
    kv_lens: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    sparse_mode: int
    scale: float


def _fia_contract(op, query, key, value, *, pse_shift=None, atten_mask=None,
                  actual_seq_lengths=None, actual_seq_lengths_kv=None,
                  block_table=None, num_heads=1, scale=1.0,
                  pre_tokens=2147483647, next_tokens=2147483647,
                  input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                  inner_precise=0, block_size=0, softmax_lse_flag=False,
                  **unsupported) -> _FiaCall:
    """The checks of npu_fused_infer_attention_score (``_FIA_DOC``), which
    its ``.out`` variant and ``_..._get_max_workspace`` (the same schema,
    op_plugin_functions.yaml 7.2.0) make too."""
    bad = set(unsupported) - _FIA_UNIMPLEMENTED
    if bad:
        raise TypeError(f"{op}() got unexpected keyword arguments "
                        f"{sorted(bad)}")
    if any(v is not None and v != 0 for v in unsupported.values()):
        raise NotImplementedError(f"the double does not implement {op} "
                                  "quantization, prefix or rope inputs")
    check(input_layout in _LAYOUTS, op,
          f"input_layout {input_layout!r} is not one of {_LAYOUTS}")
    if input_layout != "TND" or block_table is None:
        raise NotImplementedError(
            f"the double implements {op} for input_layout='TND' with "
            "block_table (paged attention) only")
    # "query: float16, bfloat16 (int8 in full quantization)".
    _dtype(query, HALF, op, "query")
    _dtype(key, HALF, op, "key")
    check(key.dtype == query.dtype and value.dtype == query.dtype, op,
          "query, key and value must have the same dtype")
    check(key.shape == value.shape, op,
          "the shapes of key and value must be completely identical")
    check(key.is_contiguous() and value.is_contiguous(), op,
          "key and value must be contiguous")
    check(query.dim() == 3, op, "TND query must be 3-D [T, N, D]")
    tokens, heads, head_dim = query.shape
    # TND with D != 512 (D == 512 needs query_rope, not implemented):
    # "数据类型仅支持bfloat16", bfloat16 only (_FIA_DOC:224 at 7.2.0, in the
    # TND/TND_NTD/NTD_TND combined limits, lines 209-229).
    check(query.dtype == torch.bfloat16, op,
          f"query dtype {query.dtype}: input_layout TND with head dim "
          f"{head_dim} (!= 512) supports bfloat16 only")
    check(num_heads == heads, op,
          f"num_heads={num_heads} does not match query's N={heads}")
    kv_heads = num_key_value_heads or num_heads
    check(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op,
          "num_heads must be a multiple of num_key_value_heads, at most 64x")
    # Paged attention: block_table 2-D int32 [B, max_blocks]; the cache
    # (blocknum, blocksize, H) with H = KV_N * D.
    check(block_table.dim() == 2 and block_table.dtype == torch.int32, op,
          "block_table must be 2-D int32")
    check(key.dim() == 3 and key.shape[1] == block_size
          and key.shape[2] == kv_heads * head_dim, op,
          f"paged key must be (blocknum, block_size={block_size}, "
          f"KV_N*D={kv_heads * head_dim}), got {tuple(key.shape)}")
    # TND: both length lists required; actual_seq_lengths is cumulative
    # ("each element is the sum of the seqlen of the current batch and all
    # previous batches"); with paged attention actual_seq_lengths_kv holds
    # each request's KV length.
    check(actual_seq_lengths is not None
          and actual_seq_lengths_kv is not None, op,
          "TND needs actual_seq_lengths and actual_seq_lengths_kv")
    cum_q = _int_list(actual_seq_lengths, op, "actual_seq_lengths")
    kv_lens = _int_list(actual_seq_lengths_kv, op, "actual_seq_lengths_kv")
    batch = len(cum_q)
    check(0 < batch <= 4096, op, "TND batch must be in [1, 4096]")
    check(all(a <= b for a, b in zip([0] + cum_q, cum_q)), op,
          "actual_seq_lengths must be non-negative and non-decreasing "
          "(cumulative)")
    check(cum_q[-1] == tokens, op,
          f"actual_seq_lengths ends at {cum_q[-1]}, query has T={tokens}")
    check(len(kv_lens) == batch and block_table.shape[0] == batch, op,
          f"actual_seq_lengths_kv ({len(kv_lens)}) and block_table dim 0 "
          f"({block_table.shape[0]}) must equal the batch ({batch})")
    q_lens = [b - a for a, b in zip([0] + cum_q, cum_q)]
    max_q = max(q_lens)
    if max_q > 1:
        # Q_S > 1: "block_size minimum 128, maximum 512, a multiple of
        # 128"; TND (D != 512) head dims 128 or 192.
        check(block_size % 128 == 0 and 128 <= block_size <= 512, op,
              f"block_size={block_size}: with Q_S > 1 paged attention "
              "needs a multiple of 128 in [128, 512]")
        check(head_dim in (128, 192), op,
              f"TND with Q_S > 1 supports head dim 128 or 192, got "
              f"{head_dim}")
    else:
        check(0 < block_size <= 512 and block_size % 16 == 0, op,
              f"block_size={block_size}: must be 16-aligned, at most 512")
        check(head_dim <= 512 and head_dim % 16 == 0, op,
              f"head dim {head_dim} must be 16-aligned, at most 512")
    check(max(kv_lens) <= block_table.shape[1] * block_size, op,
          "block_table has fewer blocks than actual_seq_lengths_kv needs")
    check(sparse_mode in (0, 3), op,
          f"TND supports sparse_mode 0 or 3, got {sparse_mode}")
    if sparse_mode == 3:
        check(atten_mask is not None
              and atten_mask.shape[-2:] == (MASK_SIZE, MASK_SIZE)
              and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8),
              op, "sparse_mode=3 needs the optimized 2048x2048 atten_mask "
              "(bool/int8/uint8)")
        check(all(q <= kv for q, kv in zip(q_lens, kv_lens)), op,
              "each request's query length must not exceed its KV length")
    check(isinstance(scale, float), op, "scale must be a float")
    return _FiaCall(q_lens, kv_lens, heads, kv_heads, head_dim, block_size,
                    sparse_mode, scale)


@traced("torch_npu.npu_fused_infer_attention_score")
def npu_fused_infer_attention_score(query, key, value, *, block_table=None,
                                    **kwargs):
    """torch_npu-npu_fused_infer_attention_score.md (``_FIA_DOC``).

    The double implements the TND layout with a paged KV cache (what the
    plugin calls); the other layouts raise NotImplementedError.
    """
    op = "npu_fused_infer_attention_score"
    _kernel()
    call = _fia_contract(op, query, key, value, block_table=block_table,
                         **kwargs)
    heads, kv_heads, head_dim = call.heads, call.kv_heads, call.head_dim
    block_size = call.block_size
    out = torch.empty_like(query)
    cache_k = key.view(key.shape[0], block_size, kv_heads, head_dim)
    cache_v = value.view_as(cache_k)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(call.q_lens, call.kv_lens)):
        if q_len == 0:
            continue
        blocks = block_table[i, :-(-kv_len // block_size)].long()
        k = cache_k[blocks].flatten(0, 1)[:kv_len].float()
        v = cache_v[blocks].flatten(0, 1)[:kv_len].float()
        k = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        q = query[start:start + q_len].float().transpose(0, 1)
        scores = q @ k.transpose(1, 2) * call.scale
        if call.sparse_mode == 3:  # causal, aligned to the bottom right
            qi = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
            scores.masked_fill_(torch.arange(kv_len).unsqueeze(0) > qi,
                                float("-inf"))
        out[start:start + q_len] = (scores.softmax(-1) @ v).transpose(
            0, 1).to(query.dtype)
        start += q_len
    return out, torch.empty(0, dtype=torch.float32)


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value,
                                                       **kwargs):
    """``torch_npu._npu_fused_infer_attention_score_get_max_workspace``:
    the schema of npu_fused_infer_attention_score (op_plugin_functions.yaml
    7.2.0, ``-> Tensor``); the kernel's largest workspace for these
    arguments, allocated as a 1-D tensor of query's dtype
    (FusedInferAttentionScoreKernelNpuOpApi.cpp 7.2.0, ``..._get_max_
    workspace_symint``), to pass as ``workspace=`` to the ``.out`` variant
    at capture and in every task update (torch_npu-npu-graph_task_group_
    begin.md:68-80, torch_npu-npu-graph_task_update_begin.md:71-91). A host
    call: it checks the arguments as the op's tiling does and launches no
    kernel. The double's size is nominal (its kernel needs none)."""
    op = "_npu_fused_infer_attention_score_get_max_workspace"
    record("torch_npu." + op)
    _fia_contract(op, query, key, value, **kwargs)
    return torch.empty(_WORKSPACE_ELEMENTS, dtype=query.dtype)


def _fia_out_kernel(query, key, value, *, workspace=None, out=None,
                    **kwargs):
    op = "npu_fused_infer_attention_score.out"
    check(isinstance(out, (list, tuple)) and len(out) == 2
          and all(isinstance(t, torch.Tensor) for t in out), op,
          "out must be [attention_out, softmax_lse]")
    attention_out, _ = out
    check(attention_out.shape == query.shape
          and attention_out.dtype == query.dtype, op,
          f"attention_out {tuple(attention_out.shape)} {attention_out.dtype}"
          f" must match query {tuple(query.shape)} {query.dtype}")
    if workspace is not None:
        check(isinstance(workspace, torch.Tensor) and workspace.dim() == 1,
              op, "workspace must be the 1-D tensor _npu_fused_infer_"
              "attention_score_get_max_workspace returns")
    result, _ = npu_fused_infer_attention_score.__wrapped__(
        query, key, value, **kwargs)
    attention_out.copy_(result)


_fia_out_launch = traced("torch_npu.npu_fused_infer_attention_score.out")(
    _fia_out_kernel)


def _fia_out(query, key, value, *, workspace=None, out=None, **kwargs):
    """``npu_fused_infer_attention_score.out``: the same op writing into
    ``out=[attention_out, softmax_lse]`` (what a captured launch and its
    task updates share).

    In a graph, the launch needs ``workspace`` (from
    ``_npu_fused_infer_attention_score_get_max_workspace``), and every task
    update the very workspace of the capture: without one op-plugin takes
    the plain launch path, whose workspace the caching allocator frees when
    the call returns (FusedInferAttentionScoreKernelNpuOpApi.cpp 7.2.0,
    ``npu_fused_infer_attention_score_out_symint``: only ``workspace.has_
    value()`` takes EXEC_UPDATE_NPU_NO_FORMAT_CHECK_CMD), so the captured
    or updated task would address freed memory; the documented capture and
    update pass the same one (torch_npu-npu-graph_task_group_begin.md:68-80,
    torch_npu-npu-graph_task_update_begin.md:71-91). Checked on the host,
    before the launch (an update replaces the captured launch's
    arguments)."""
    op = "npu_fused_infer_attention_score.out"
    if _emulator._updating:
        check(workspace is not None, op,
              "a task update without workspace: pass the workspace the "
              "captured launch got")
        updater = _emulator._updating[-1]
        nodes = updater.group.nodes
        # (Another captured call there: the update's own check names it.)
        if (updater.index < len(nodes)
                and nodes[updater.index].func is _fia_out_kernel):
            captured = nodes[updater.index].kwargs.get("workspace")
            same = isinstance(captured, torch.Tensor) and (
                workspace is captured or
                (workspace.data_ptr() == captured.data_ptr()
                 and workspace.shape == captured.shape))
            check(same, op, "a task update whose workspace is not the "
                  "captured launch's")
    elif _emulator.EmulatedGraph._capturing is not None:
        check(workspace is not None, op,
              "a launch in a graph capture without workspace: pass "
              "_npu_fused_infer_attention_score_get_max_workspace(...)")
    return _fia_out_launch(query, key, value, workspace=workspace, out=out,
                           **kwargs)


npu_fused_infer_attention_score.out = _fia_out


# --- norms and activations ---------------------------------------------

_RMS_PAIRS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
              (torch.float32, torch.float32)}


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _gamma_suffix(x, gamma, op: str) -> None:
    # "gamma_shape = self_shape[n:]": gamma matches trailing dims of x.
    check(x.dim() >= gamma.dim() and tuple(x.shape[x.dim() - gamma.dim():])
          == tuple(gamma.shape), op,
          f"gamma {tuple(gamma.shape)} must equal the trailing dims of "
          f"{tuple(x.shape)}")


@traced("torch_npu.npu_rms_norm")
def npu_rms_norm(self, gamma, epsilon=1e-06):
    """docs/context/(beta)torch_npu-npu_rms_norm.md: x 2-8 dims; dtype
    pairs (x, gamma) fp16/fp32, bf16/fp32, fp16, bf16, fp32; returns
    (y, rstd float32 keep-dims)."""
    op = "npu_rms_norm"
    _kernel()
    check(2 <= self.dim() <= 8, op, f"x must have 2-8 dims, got {self.dim()}")
    check((self.dtype, gamma.dtype) in _RMS_PAIRS, op,
          f"unsupported dtypes x {self.dtype}, gamma {gamma.dtype}")
    _gamma_suffix(self, gamma, op)
    return _rms(self, gamma, epsilon)


@traced("torch_npu.npu_add_rms_norm")
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """torch_npu-npu_add_rms_norm.md (op-plugin master; 7.2.0 has no page,
    same schema): x = x1 + x2, returns (y, rstd, x); x1, x2 fp32/fp16/bf16
    of one shape, 1-8 dims, not empty; gamma of x1's dtype."""
    op = "npu_add_rms_norm"
    _kernel()
    _dtype(x1, FLOATS, op, "x1")
    check(x1.dtype == x2.dtype and x1.shape == x2.shape, op,
          "x1 and x2 must have the same dtype and shape")
    check(gamma.dtype == x1.dtype, op, "gamma must have x1's dtype")
    check(1 <= x1.dim() <= 8 and x1.numel() > 0, op,
          "x1 must have 1-8 dims and not be empty")
    _gamma_suffix(x1, gamma, op)
    s = x1.float() + x2.float()
    y, rstd = _rms(s, gamma, epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)


@traced("torch_npu.npu_swiglu")
def npu_swiglu(self, dim=-1):
    """docs/context/(beta)torch_npu-npu_swiglu.md: silu(A) * B of the two
    halves along dim; 1-8 dims, even along dim, contiguous, not empty."""
    op = "npu_swiglu"
    _kernel()
    _dtype(self, FLOATS, op, "input")
    check(1 <= self.dim() <= 8 and self.numel() > 0, op,
          "input must have 1-8 dims and not be empty")
    check(-self.dim() <= dim < self.dim(), op, f"dim {dim} out of range")
    check(self.shape[dim] % 2 == 0, op,
          f"input size {self.shape[dim]} along dim {dim} must be even")
    check(self.is_contiguous(), op, "non-contiguous input is not supported")
    a, b = self.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


@traced("torch_npu.npu_rotary_mul")
def npu_rotary_mul(self, r1, r2, rotary_mode="half"):
    """torch_npu-npu_rotary_mul.md: out = x * r1 +
    rotate(x) * r2; 4-D input, r1, r2; D even and < 896; in BSND layout
    r1/r2 broadcast as 1S1D, BS1D or BSND (interleave: 1S1D only)."""
    op = "npu_rotary_mul"
    _kernel()
    check(rotary_mode in ("half", "interleave"), op,
          "The rotary_mode of npu_rotary_mul should be half or interleave")
    for name, t in (("input", self), ("r1", r1), ("r2", r2)):
        check(t.dim() == 4, op, f"{name} dimension must be 4")
        _dtype(t, FLOATS, op, name)
    check(r1.shape == r2.shape, op, "r1 and r2 must have the same shape")
    b, s, n, d = self.shape
    check(d % 2 == 0 and d < 896, op, f"D={d} must be even and < 896")
    # half mode: "B, N < 1000" (7.2.0 docs/context/torch_npu-npu_rotary_mul
    # .md:85); the plugin stacks query and key heads along N.
    check(rotary_mode != "half" or (b < 1000 and n < 1000), op,
          f"half mode needs B, N < 1000, got B={b}, N={n}")
    allowed = [(1, s, 1, d), (b, s, 1, d), (b, s, n, d)]
    if rotary_mode == "interleave":
        allowed = [(1, s, 1, d)]
        check(b * n < 1000, op, "interleave needs B*N < 1000")
    check(tuple(r1.shape) in allowed, op,
          f"r1/r2 shape {tuple(r1.shape)} cannot broadcast to BSND input "
          f"{tuple(self.shape)} in {rotary_mode} mode")
    x, cos, sin = self.float(), r1.float(), r2.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return (x * cos + rotated * sin).to(self.dtype)


# --- MoE ---------------------------------------------------------------

@traced("torch_npu.npu_moe_gating_top_k")
def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """torch_npu-npu_moe_gating_top_k.md (and the equivalent
    Python of the master doc): the bias only selects, weights are the
    unbiased scores, normalized only for norm_type 1 (sigmoid)."""
    op = "npu_moe_gating_top_k"
    _kernel()
    check(x.dim() == 2, op, "The x should be 2D")
    _dtype(x, FLOATS, op, "x")
    tokens, experts = x.shape
    check(experts <= 2048, op, "the expert count must be at most 2048")
    # CANN 8.3 (what torch-npu 2.8.0 runs on) takes 256 experts only. The
    # 7.2.0 doc (torch_npu-npu_moe_gating_top_k.md:50) says "at most 2048";
    # the hardware evidence is vllm-ascend v0.11.0, proven on CANN 8.3,
    # which calls the kernel only for 256 global experts
    # (ops/moe/experts_selector.py:180-183, "now npu_moe_gating_top_k can
    # only support 'group_count=256' pattern") and routes 160 (GLM-4.5)
    # through torch; wider use comes with newer CANN (vllm-ascend main).
    check(experts == 256, op,
          f"{experts} experts: on CANN 8.3 the kernel supports the "
          "256-expert pattern only")
    if bias is not None:
        check(bias.dtype == x.dtype, op, "The dtype of x and bias should be "
              "same")
        check(bias.dim() == 1 and bias.shape[0] == experts, op,
              "The bias should be 1D, its first dim same as x second dim")
    check(group_count > 0 and experts % group_count == 0
          and experts // group_count > 2, op,
          "E must be divisible by group_count with a quotient > 2")
    per_group = experts // group_count
    check(-(-per_group // 32) * 32 * group_count <= 2048, op,
          "the per-group expert count aligned to 32, times group_count, "
          "must be at most 2048")
    check(1 <= k_group <= group_count, op, "k_group must be in "
          "[1, group_count]")
    check(1 <= k <= per_group * k_group, op,
          f"k={k} must be in [1, E / group_count * k_group]")
    check(renorm == 0, op, "renorm: only 0 is supported")
    check(norm_type in (0, 1) and group_select_mode in (0, 1), op,
          "norm_type and group_select_mode must be 0 or 1")
    scores = x.float().sigmoid() if norm_type == 1 else x.float().softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    grouped = choice.view(tokens, group_count, per_group)
    if group_select_mode == 1:
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        group_scores = grouped.amax(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
        1, group_scores.topk(k_group, dim=-1).indices, True)
    choice = choice.masked_fill(
        ~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.argsort(dim=-1, descending=True, stable=True)[:, :k]
    y = scores.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return (y.to(x.dtype), ids.to(torch.int32),
            scores if out_flag else torch.empty(0))


@traced("torch_npu.npu_moe_init_routing_v2")
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None,
                            active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0,
                            expert_tokens_num_flag=False, quant_mode=0,
                            active_expert_range=(), row_idx_type=0):
    """torch_npu-npu_moe_init_routing_v2.md: a stable sort of
    the flat (token, slot) pairs by expert; rows of experts outside
    ``active_expert_range = [start, end)`` go last and are invalid."""
    op = "npu_moe_init_routing_v2"
    _kernel()
    check(x.dim() == 2 and expert_idx.dim() == 2
          and x.shape[0] == expert_idx.shape[0], op,
          "x [NUM_ROWS, H] and expert_idx [NUM_ROWS, K] must be 2-D")
    _dtype(x, FLOATS + (torch.int8, ), op, "x")
    check(expert_idx.dtype == torch.int32, op, "expert_idx must be int32")
    rows, top_k = expert_idx.shape
    check(active_num == rows * top_k, op,
          f"active_num must equal NUM_ROWS*K={rows * top_k}")
    check(quant_mode in (-1, 1), op, "quant_mode: only -1 and 1 are "
          "supported")
    # 7.2.0 torch_npu-npu_moe_init_routing_v2.md:69 quant_mode 1 is
    # dynamic quantization: without scale each expanded row by its own
    # max|x| / 127 (formula 4, the golden test's quant_mode 1 branch);
    # expanded_x int8 (:75), expanded_scale float32 [NUM_ROWS * K], the
    # first available rows valid (:80). An int8 x gives meaningless output.
    check(quant_mode == -1 or x.dtype != torch.int8, op,
          "quant_mode=1 needs a float x (int8 x gives meaningless output)")
    check(scale is None and offset is None, op,
          "the double implements the call without scale and offset")
    check(drop_pad_mode == 0, op, "drop_pad_mode: only 0 (dropless) is "
          "supported")
    check(expert_tokens_num_type == 1, op,
          "the double implements expert_tokens_num_type=1 (counts); the "
          "kernel supports 1 and 2")
    check(expert_tokens_num_flag is True, op,
          "expert_tokens_num_flag: only True is supported")
    check(row_idx_type in (0, 1), op, "row_idx_type must be 0 or 1")
    check(len(active_expert_range) == 2, op,
          "active_expert_range must be [expert_start, expert_end]")
    start, end = active_expert_range
    check(0 <= start < end <= expert_num <= 10240, op,
          "need 0 <= expert_start < expert_end <= expert_num <= 10240")
    flat = expert_idx.flatten().long()
    check(bool((flat >= 0).all() and (flat < expert_num).all()), op,
          "expert ids must be in [0, expert_num)")
    key = torch.where(flat < start, torch.iinfo(torch.int32).max, flat)
    order = key.argsort(stable=True)
    in_range = (flat >= start) & (flat < end)
    available = int(in_range.sum())
    expanded_x = x[order // top_k].clone()
    expanded_scale = torch.zeros(rows * top_k, dtype=torch.float32)
    if quant_mode == 1:
        expanded_x, expanded_scale = _dynamic_quant_rows(expanded_x)
        expanded_scale[available:] = float("nan")  # invalid rows
    elif expanded_x.is_floating_point():
        expanded_x[available:] = float("nan")  # invalid rows: undefined
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
    else:
        row_idx = torch.full_like(order, -1, dtype=torch.int32)
        row_idx[order[:available]] = torch.arange(available,
                                                  dtype=torch.int32)
    counts = torch.bincount(flat[in_range] - start,
                            minlength=end - start).to(torch.int64)
    return expanded_x, row_idx, counts, expanded_scale


def _dynamic_quant_rows(x: torch.Tensor):
    """Per row: scale = max|x| / 127, int8 rint(x / scale) (the formula of
    npu_moe_init_routing_v2.md step 4 and npu_dynamic_quant.md)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _rint_int8(x / safe.unsqueeze(-1)), scale


@traced("torch_npu.npu_grouped_matmul")
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None,
                       antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0,
                       group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None):
    """torch_npu-npu_grouped_matmul.md, one x [M, K] and one
    3-D weight [E, K, N] grouped on M (group_type 0, split_item 2/3).

    The doc asks for sum(group_list) == M. The plugin, as vllm-ascend
    under expert parallelism, passes fewer rows (the tokens of other
    ranks' experts last): the double accepts that and leaves the rows past
    the sum undefined (NaN), which is what the kernel does not promise to
    compute.
    """
    op = "npu_grouped_matmul"
    _kernel()
    check(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)),
          op, "x and weight must be lists of tensors")
    check(group_type is not None, op,
          "Requires manual passing group_type, current is None.")
    check(split_item in (0, 1, 2, 3), op, "Invalid value of split_item")
    check(act_type == 0, op, "the double implements act_type 0 (no fused "
          "activation)")
    check(activation_quant_scale is None and activation_quant_offset is None,
          op, "activation_quant_scale/offset only support None")
    if any(t is not None for t in (bias, offset, antiquant_scale,
                                   antiquant_offset, activation_input)):
        raise NotImplementedError("the double implements the grouped "
                                  "matmul without bias, float or int8 "
                                  "with per-channel scales")
    check(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3
          and group_type == 0 and split_item in (2, 3), op,
          "the double implements one x, one 3-D weight, group_type=0, "
          "split_item 2 or 3")
    a, w = x[0], weight[0]
    check(a.dim() == 2, op, "x must be 2-D with split_item 2/3")
    # Formats: the 7.2.0 doc names none; vllm-ascend v0.11.0 passes x ND
    # and int8 weights cast to NZ from contiguous [E, K, N]
    # (w8a8_dynamic.py:268-274), the only NZ weight the double takes.
    _formats.check_nd(a, op, "x")
    if w.dtype != torch.int8:
        _formats.check_nd(w, op, "a float weight")
    _formats.check_nz_weight(w, op, "weight")
    check(a.is_contiguous(), op, "x does not support transposition")
    quantized = a.dtype == torch.int8
    if quantized:
        # The A8W8 case: int8 x and weight, per-channel scale [E, N] (the
        # doc says 1-D; vllm-ascend and the plugin pass [E, N]), per-token
        # scale [M] (float32), a float16/bfloat16 result; the scale is
        # bfloat16 for a bfloat16 result, float32 for float16 (Table 2).
        check(w.dtype == torch.int8, op, "int8 x needs an int8 weight")
        check(output_dtype in HALF, op,
              "int8 x needs output_dtype float16 or bfloat16")
        check(isinstance(scale, (list, tuple)) and len(scale) == 1, op,
              "int8 x needs scale, a list of one tensor")
        check(scale[0].shape == (w.shape[0], w.shape[2]), op,
              f"scale must be [E, N]={[w.shape[0], w.shape[2]]}, got "
              f"{list(scale[0].shape)}")
        _dtype(scale[0], (output_dtype if output_dtype == torch.bfloat16
                          else torch.float32, ), op, "scale")
        check(isinstance(per_token_scale, (list, tuple))
              and len(per_token_scale) == 1, op,
              "per_token_scale must be a list of one tensor")
        check(per_token_scale[0].dtype == torch.float32
              and per_token_scale[0].shape == (a.shape[0], ), op,
              f"per_token_scale must be float32 [M={a.shape[0]}]")
    else:
        check(scale is None and per_token_scale is None, op,
              "scale and per_token_scale need int8 x and weight")
        check(a.dtype == w.dtype and a.dtype in FLOATS, op,
              f"x {a.dtype} and weight {w.dtype} must be one float dtype")
    check(a.shape[1] == w.shape[1], op,
          f"x [M, K={a.shape[1]}] does not match weight [E, K={w.shape[1]}"
          ", N]")
    # InnerLimit: the memory-inner axis (K of a transposed weight).
    w_inner = w.shape[-1] if w.stride(-1) == 1 else w.shape[-2]
    check(a.shape[-1] < 65536 and w_inner < 65536, op,
          "inner axes must be < 65536")
    check(group_list is not None and isinstance(group_list, torch.Tensor),
          op, "group_list (a tensor) must be passed")
    check(group_list.dim() == 1 and group_list.dtype == torch.int64, op,
          "group_list must be 1-D int64")
    check(group_list.shape[0] == w.shape[0] <= 1024, op,
          f"group_list length {group_list.shape[0]} must equal the "
          f"{w.shape[0]} groups of weight (at most 1024)")
    check(group_list_type in (0, 1), op, "group_list_type must be 0 or 1")
    gl = group_list.tolist()
    check(all(v >= 0 for v in gl), op, "group_list must be non-negative")
    if group_list_type == 0:
        check(all(p <= q for p, q in zip(gl, gl[1:])), op,
              "a cumsum group_list must be non-decreasing")
        counts = [q - p for p, q in zip([0] + gl, gl)]
    else:
        check(len(gl) != 1, op, "a count group_list cannot have length 1")
        counts = gl
    check(sum(counts) <= a.shape[0], op,
          f"group_list covers {sum(counts)} rows, x has {a.shape[0]}")
    out = torch.full((a.shape[0], w.shape[2]), float("nan"),
                     dtype=output_dtype or a.dtype)
    row = 0
    for e, n in enumerate(counts):
        rows = slice(row, row + n)
        if quantized:
            acc = (a[rows].double() @ w[e].double()).float()
            y = (acc * scale[0][e].float() *
                 per_token_scale[0][rows].unsqueeze(1))
        else:
            y = a[rows].float() @ w[e].float()
        out[rows] = y.to(out.dtype)
        row += n
    return [out]


# --- W8A8 quantization ---------------------------------------------------
# Checked against op-plugin master (517f2e7, docs/zh/custom_APIs/torch_npu/).

def _rint_int8(x: torch.Tensor) -> torch.Tensor:
    # Round half to even (the kernels' RINT cast), saturate to int8.
    return torch.round(x).clamp(-128, 127).to(torch.int8)


@traced("torch_npu.npu_dynamic_quant")
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None,
                      dst_type=None):
    """torch_npu-npu_dynamic_quant.md: per-token symmetric
    quantization, scale = max|x| / 127 over the last axis; float16 or
    bfloat16 input of more than one dim; (int8 y, float32 scale of
    input.shape[:-1])."""
    op = "npu_dynamic_quant"
    _kernel()
    _dtype(input, HALF, op, "input")
    check(2 <= input.dim() <= 8 and input.numel() > 0, op,
          "input must have 2-8 dims and not be empty")
    check(smooth_scales is None and group_index is None, op,
          "the double implements the call without smooth_scales")
    check(dst_type in (None, torch.int8), op,
          "the double implements dst_type int8 only")
    x = input.float()
    scale = x.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _rint_int8(x / safe.unsqueeze(-1)), scale


@traced("torch_npu.npu_quantize")
def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """torch_npu-npu_quantize.md: y = round(x * scales + zero_points)
    with div_mode=False (x / scales with True); dtype torch.qint8 gives
    int8. With div_mode=False, scales and zero_points (which may be None)
    are 1-D of size 1 or input's last dim, in input's dtype; any axis above
    -2 means the last axis."""
    op = "npu_quantize"
    _kernel()
    _dtype(input, FLOATS, op, "input")
    check(dtype == torch.qint8, op, "the double implements torch.qint8 "
          "(int8) output only")
    check(not div_mode, op, "the double implements div_mode=False (the "
          "mode whose scales are per channel of input's last axis)")
    check(axis > -2, op, "the double implements axis > -2 (the last axis)")
    k = input.shape[-1]
    check(scales is not None, op, "scales must be passed")
    for name, t in (("scales", scales), ("zero_points", zero_points)):
        if t is None:
            continue
        check(t.dim() == 1 and t.shape[0] in (1, k), op,
              f"{name} must be 1-D of size 1 or input's last dim {k}")
        check(t.dtype == input.dtype, op,
              f"{name} dtype {t.dtype} must equal input dtype {input.dtype}")
    y = input.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    return _rint_int8(y)


@traced("torch_npu.npu_quant_matmul")
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None,
                     bias=None, output_dtype=None, x1_dtype=None,
                     x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None):
    """torch_npu-npu_quant_matmul.md, the A8W8 cases:
    int8 x1 [M, K] and x2 [K, N], K and N at most 65535;
    y = (x1 @ x2 + bias) * scale (* pertoken_scale[m]). scale [N] or [1]:
    float32 or bfloat16 (bfloat16 output), float32 with pertoken_scale,
    int64 for float16 output without pertoken_scale (the doc allows float32
    there too, except in graph mode, the plugin's default); pertoken_scale
    float32 [M]; bias int32 [N] (or bfloat16/float32 with bfloat16 output
    or with pertoken_scale)."""
    op = "npu_quant_matmul"
    _kernel()
    check(x1.dtype == torch.int8 and x2.dtype == torch.int8, op,
          "x1 and x2 must be int8")
    # Formats: x1, scale, offset, pertoken_scale, bias ND (:37,53-55); x2
    # ND or cast to NZ from its contiguous (k, n) layout (:42,94-97,432).
    for name, t in (("x1", x1), ("scale", scale), ("offset", offset),
                    ("pertoken_scale", pertoken_scale), ("bias", bias)):
        _formats.check_nd(t, op, name)
    _formats.check_nz_weight(x2, op, "x2")
    check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
          op, f"x1 [M, K] and x2 [K, N] do not match: {list(x1.shape)}, "
          f"{list(x2.shape)}")
    check(x1.shape[1] <= 65535 and x2.shape[1] <= 65535, op,
          "the last dims of x1 and x2 cannot exceed 65535")
    check(offset is None, op, "offset is for int8 output only")
    check(output_dtype in HALF, op, "the double implements float16 or "
          "bfloat16 output")
    n = x2.shape[1]
    check(scale.dim() == 1 and scale.shape[0] in (1, n), op,
          f"scale must be 1-D of size 1 or N={n}")
    if pertoken_scale is not None:
        check(pertoken_scale.dtype == torch.float32
              and pertoken_scale.shape == (x1.shape[0], ), op,
              f"pertoken_scale must be float32 [M={x1.shape[0]}]")
        allowed = ((torch.float32, torch.bfloat16)
                   if output_dtype == torch.bfloat16 else (torch.float32, ))
    else:
        allowed = ((torch.float32, torch.bfloat16)
                   if output_dtype == torch.bfloat16 else (torch.int64, ))
    _dtype(scale, allowed, op, "scale")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == n, op,
              f"bias must be [N={n}]")
        _dtype(bias, (torch.int32, ) if (output_dtype == torch.float16
                                         and pertoken_scale is None) else
               (torch.int32, torch.bfloat16, torch.float32), op, "bias")
    acc = x1.double() @ x2.double()
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    y = acc.float() * scale.float()
    if pertoken_scale is not None:
        y = y * pertoken_scale.unsqueeze(1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype)


# --- float64 on the device ---------------------------------------------
# The NPU runs no float64 (double) kernels: the AI Core has no float64
# arithmetic, and the aclnn kernels the plugin's ops use take no float64
# (every op above rejects it through its dtype checks). Other projects hit
# "DT_DOUBLE not supported" on NPU torch code (diffusers #10123, #10820).
#
# The double's device tensors are CPU tensors, so "float64 on the device"
# cannot be read off a tensor. What it can see is where the plugin's device
# tensors come from: vLLM builds the model inside
# ``with torch.device(<the accelerator>)`` (base_loader.py), which under the
# double is ``torch.device("cpu")``; there a factory called without a
# device (``torch.arange(n)``) creates an NPU tensor on hardware. So while
# the double is imported, such a context is the NPU's: a factory without a
# device that makes a float64 tensor fails, and so does any op that makes
# a float64 tensor from one such device tensor (``.double()``, an op whose
# result promotes to float64). Host work states its device
# (``device="cpu"``) and is not checked; nor is a device tensor created
# with an explicit device, or a parameter (a new tensor object): what the
# guard cannot tell from host tensors, it lets through.

_device_tensors: dict[int, weakref.ref] = {}


def _double_imported() -> bool:
    return getattr(sys.modules.get("torch_npu"), "CONTRACT_DOUBLE", False)


def _is_device_tensor(t) -> bool:
    ref = _device_tensors.get(id(t))
    return ref is not None and ref() is t


def _install_device_float64_guard() -> None:
    """``torch.device`` contexts go through the guard (torch's C++
    ``torch.device.__enter__`` builds ``torch.utils._device.DeviceContext``
    at each entry)."""
    base = torch_device_utils.DeviceContext
    if getattr(base, "npu_double_float64_guard", False):
        return

    class NpuDeviceContext(base):
        npu_double_float64_guard = True

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.device.type != "cpu" or not _double_imported():
                return super().__torch_function__(func, types, args, kwargs)
            on_device = (func in torch_device_utils._device_constructors()
                         and kwargs.get("device") is None) or any(
                             _is_device_tensor(t)
                             for t in tree_flatten((args, kwargs))[0]
                             if isinstance(t, torch.Tensor))
            result = super().__torch_function__(func, types, args, kwargs)
            if on_device:
                for t in tree_flatten(result)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    check(t.dtype != torch.float64, _name(func),
                          "a float64 tensor on the NPU (inside "
                          f"`with torch.device({self.device.type!r})`, the "
                          "double's NPU): the NPU has no float64 kernels; "
                          "compute on the host (device='cpu') and move "
                          "the result")
                    _device_tensors[id(t)] = weakref.ref(t)
            return result

    torch_device_utils.DeviceContext = NpuDeviceContext


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


_install_device_float64_guard()
