"""The MC2 kernels: ``npu_moe_distribute_dispatch_v2`` / ``_combine_v2``.

Checks written from op-plugin 7.2.0 (the version torch-npu 2.8.0 ships,
CANN 8.3.RC1): ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md``
and ``..._combine_v2.md`` (``D:`` and ``C:`` with their lines below) and the
op's C++ (``op_plugin/ops/opapi/MoeDistributeDispatchV2KernelOpApi.cpp``,
``CPP:``), for the SoC ``torch.npu.get_soc_version()`` reports (A2 by
default, ``VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION``), with the ``""``/
``fullmesh`` algorithm. What the double does not implement (dispatch
``scales``, int4-packed x, shared-expert ranks, the special experts, a TP
domain, the hierarchy algorithm) raises NotImplementedError.

The exchange runs over the gloo group behind the HCCL communicator name
(``get_hccl_comm_name``). Expert ``e`` lives on rank ``e // local_E``.
``expand_x`` holds the rows this rank received, grouped by local expert
(then source rank, token, slot); rows past them are NaN, as the kernel
leaves them undefined. ``assist_info_for_combine`` and ``ep_recv_counts``
are opaque to the caller: the double keeps its own layout in them.
"""

import os

import torch
from torch._C._distributed_c10d import AllgatherOptions

from . import npu as _npu
from ._hccl import group_of
from ._ops import HALF, check
from ._trace import traced

# D:97-99, C:63-65 (Atlas A2, fullmesh; hierarchy: 16, 32, 64).
A2_EP_SIZES = {16, 32, 64, 128, 256}
# D:104, C:70 (Atlas A2: moe_expert_num / (ep_world_size -
# shared_expert_rank_num); the hierarchy algorithm is exempt, D:221).
A2_MAX_EXPERTS_PER_RANK = 24


def soc_is_a3() -> bool:
    version = _npu.soc_version()
    check(220 <= version <= 225 or 250 <= version <= 255, "MC2",
          f"soc version {version} is neither Atlas A2 (220-225) nor A3 "
          "(250-255)")
    return version >= 250


def _hierarchy_env() -> bool:
    """comm_alg "" runs the hierarchy algorithm on Atlas A2 under these
    (D:150, C:134)."""
    return (os.environ.get("HCCL_INTRA_PCIE_ENABLE") == "1"
            and os.environ.get("HCCL_INTRA_ROCE_ENABLE") == "0")


def _algorithm(op: str, comm_alg: str) -> None:
    a3 = soc_is_a3()
    # D:148-153, C:132-137: A3 takes the default only; A2 "", "fullmesh",
    # "hierarchy".
    if a3:
        check(comm_alg == "", op, "comm_alg is not supported on Atlas A3: "
              "leave it \"\"")
    else:
        check(comm_alg in ("", "fullmesh", "hierarchy"), op,
              f"comm_alg {comm_alg!r} is not \"\", \"fullmesh\" or "
              "\"hierarchy\" (Atlas A2)")
    if comm_alg == "hierarchy" or (not a3 and comm_alg == ""
                                   and _hierarchy_env()):
        raise NotImplementedError(
            f"{op}: the double implements the fullmesh algorithm only "
            f"(comm_alg {comm_alg!r})")


def _tp_domain(op: str, a3: bool, group_ep: str, group_tp: str,
               tp_world_size: int, tp_rank_id: int) -> None:
    """No TP domain: what each SoC takes for it."""
    if a3:
        # D:125, C:108: [0, 2], 0 and 1 mean no TP domain; D:129, C:112:
        # tp_rank_id 0 without one.
        check(0 <= tp_world_size <= 2, op,
              f"tp_world_size {tp_world_size} not in [0, 2] (Atlas A3)")
        if tp_world_size == 2:
            raise NotImplementedError(f"{op}: the double implements no TP "
                                      "domain (tp_world_size 2)")
        check(tp_rank_id == 0, op, "tp_rank_id must be 0 without a TP "
              "domain (tp_world_size 0 or 1)")
        return
    # D:124, C:107: Atlas A2 has no TP domain, tp_world_size the default
    # 0; D:128, C:111: tp_rank_id the default 0; D:120, C:103: group_tp
    # the default "" (eager) or group_ep (graph mode).
    check(tp_world_size == 0, op, f"tp_world_size {tp_world_size}: Atlas "
          "A2 has no TP domain, leave the default 0")
    check(tp_rank_id == 0, op, f"tp_rank_id {tp_rank_id}: Atlas A2 has no "
          "TP domain, leave the default 0")
    check(group_tp in ("", group_ep), op, f"group_tp {group_tp!r}: Atlas A2 "
          "takes the default \"\" or group_ep")


def _common(op: str, expert_ids, group_ep, ep_world_size, ep_rank_id,
            moe_expert_num, shared_expert_rank_num, group_tp, tp_world_size,
            tp_rank_id, special_experts: int, bs: int, hidden: int):
    """The checks dispatch and combine share; the group and local_E."""
    a3 = soc_is_a3()
    # D:95, C:61
    check(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, op,
          "group_ep must be an HCCL communicator name of length [1, 128)")
    group = group_of(group_ep, op)
    # D:97-100, C:62-66
    if a3:
        check(2 <= ep_world_size <= 768, op,
              f"ep_world_size {ep_world_size} not in [2, 768] (Atlas A3)")
    else:
        check(ep_world_size in A2_EP_SIZES, op,
              f"ep_world_size {ep_world_size} is not one of "
              f"{sorted(A2_EP_SIZES)} (Atlas A2, fullmesh)")
    check(group.size() == ep_world_size, op,
          f"ep_world_size {ep_world_size} but group_ep has "
          f"{group.size()} ranks")
    # D:102, C:68
    check(0 <= ep_rank_id < ep_world_size and ep_rank_id == group.rank(),
          op, f"ep_rank_id {ep_rank_id} is not this rank ({group.rank()}) "
          "of group_ep")
    if shared_expert_rank_num or special_experts:
        raise NotImplementedError(f"{op}: the double implements no shared-"
                                  "expert ranks and no special experts")
    # D:103, C:69
    check(1 <= moe_expert_num <= 1024
          and moe_expert_num % ep_world_size == 0, op,
          f"moe_expert_num {moe_expert_num} must be in [1, 1024] and "
          f"divisible by ep_world_size {ep_world_size}")
    local = moe_expert_num // ep_world_size
    # D:104, C:70
    check(a3 or local <= A2_MAX_EXPERTS_PER_RANK, op,
          f"moe_expert_num / ep_world_size = {local} must be <= "
          f"{A2_MAX_EXPERTS_PER_RANK} (Atlas A2, fullmesh)")
    _tp_domain(op, a3, group_ep, group_tp, tp_world_size, tp_rank_id)
    # D:94, C:53
    check(expert_ids.dim() == 2 and expert_ids.dtype == torch.int32, op,
          "expert_ids must be int32 [BS, K]")
    top_k = expert_ids.shape[1]
    # D:207, C:177
    check(0 < top_k <= min(16, moe_expert_num), op,
          f"K {top_k} must be in (0, min(16, moe_expert_num)]")
    # D:203-205, C:173-175
    max_bs = 512 if a3 else 256
    check(0 < bs <= max_bs, op, f"BS {bs} must be in (0, {max_bs}]")
    # D:198-201, C:167-171
    if a3:
        check(1024 <= hidden <= 8192, op, f"H {hidden} must be in [1024, "
              "8192] (Atlas A3)")
    else:
        check(0 < hidden <= 7168 and hidden % 32 == 0, op,
              f"H {hidden} must be in (0, 7168] and a multiple of 32 "
              "(Atlas A2, fullmesh)")
    # D:94, C:53
    ids = expert_ids.long()
    check(bool(((ids >= 0) & (ids < moe_expert_num)).all()), op,
          f"expert_ids must lie in [0, moe_expert_num={moe_expert_num})")
    sorted_ids = ids.sort(dim=1).values
    check(bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()), op,
          "the K expert ids of a row must differ")
    return group, local


def _ep_counts_size(ep_world_size: int, local: int) -> int:
    """ep_recv_counts' length without a TP domain and without
    expert_scales (CPP:124-128,145; D:174 on A3; on A2 the extra
    2 * global_bs * K * server_num of D:173 is allocated only with
    expert_scales, CPP:149-153, the hierarchical scheme)."""
    return ep_world_size * local


def _all_gather_rows(group, t: torch.Tensor, rows: int) -> torch.Tensor:
    """[W, rows, ...]: every rank's ``t`` padded to ``rows``."""
    padded = t.new_zeros((rows, ) + tuple(t.shape[1:]))
    padded[:t.shape[0]] = t
    out = padded.new_empty((group.size() * rows, ) + tuple(t.shape[1:]))
    group._allgather_base(out, padded.contiguous(), AllgatherOptions()).wait()
    return out.view((group.size(), ) + tuple(padded.shape))


def _all_bs(group, bs: int) -> list[int]:
    out = torch.empty(group.size(), dtype=torch.int64)
    group._allgather_base(out, torch.tensor([bs]), AllgatherOptions()).wait()
    return out.tolist()


def _active_rows(op: str, x_active_mask, bs: int, bs_all: list[int]):
    """D:107-111, C:76-80 (the 1-D form, both SoCs)."""
    if x_active_mask is None:
        return torch.ones(bs, dtype=torch.bool)
    check(x_active_mask.dtype == torch.bool
          and tuple(x_active_mask.shape) == (bs, ), op,
          f"x_active_mask must be bool [BS={bs}] (the double implements "
          "the 1-D form)")
    ints = x_active_mask.int()
    check(bool((ints[1:] <= ints[:-1]).all()), op,
          "x_active_mask: true must come before false")
    check(len(set(bs_all)) == 1 or bool(x_active_mask.all()), op,
          "when BS differs between ranks every token must be active")
    return x_active_mask


def _rows_bound(op: str, global_bs: int, bs_all: list[int], world: int,
                local: int, top_k: int) -> int:
    """A: the rows expand_x holds (D:144, D:195, C:126, C:165; CPP:97,
    109)."""
    if global_bs == 0:
        check(len(set(bs_all)) == 1, op,
              f"BS differs between ranks {bs_all}: global_bs must be "
              "max_bs * ep_world_size, not 0")
        return bs_all[0] * world * min(local, top_k)
    check(global_bs % world == 0 and global_bs // world >= max(bs_all), op,
          f"global_bs {global_bs} must be max_bs * ep_world_size with "
          f"max_bs >= every rank's BS {bs_all}")
    return global_bs * min(local, top_k)


@traced("torch_npu.npu_moe_distribute_dispatch_v2")
def npu_moe_distribute_dispatch_v2(
        x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        *, scales=None, x_active_mask=None, expert_scales=None,
        elastic_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
        expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
        quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
        zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    """The signature of D:88."""
    op = "npu_moe_distribute_dispatch_v2"
    _npu.state.kernel_launched()
    _algorithm(op, comm_alg)
    # D:93
    check(x.dim() == 2 and x.dtype in HALF, op,
          "x must be bfloat16/float16 [BS, H] (the double does not "
          "implement int32-packed x)")
    bs, hidden = x.shape
    check(tuple(expert_ids.shape[:1]) == (bs, ), op,
          f"expert_ids must have BS={bs} rows")
    group, local = _common(op, expert_ids, group_ep, ep_world_size,
                           ep_rank_id, moe_expert_num,
                           shared_expert_rank_num, group_tp, tp_world_size,
                           tp_rank_id, zero_expert_num + copy_expert_num +
                           const_expert_num, bs, hidden)
    # D:143: 0 (no quantization) or 2 (dynamic: int8 expand_x with
    # per-token dynamic_scales, D:40-65, D:167-168). D:106: scales (a
    # per-expert smoothing factor) are optional with 2 and not taken with 0.
    check(quant_mode in (0, 2), op, f"quant_mode {quant_mode} must be 0 "
          "(no quantization) or 2 (dynamic quantization)")
    check(quant_mode == 2 or scales is None, op,
          "scales are for dynamic quantization (quant_mode 2) only")
    if scales is not None:
        raise NotImplementedError(f"{op}: the double implements quant_mode "
                                  "2 without scales")
    # D:117
    check(elastic_info is None, op, "elastic_info is reserved: pass None")
    # D:146
    check(expert_token_nums_type in (0, 1), op,
          "expert_token_nums_type must be 0 or 1")
    a3 = soc_is_a3()
    top_k = expert_ids.shape[1]
    # D:115: none on Atlas A3. CPP:149-153: on A2 expert_scales sizes
    # ep_recv_counts for the hierarchical scheme ("a2分层方案"), which
    # comm_alg "" runs only under HCCL_INTRA_PCIE_ENABLE=1 and
    # HCCL_INTRA_ROCE_ENABLE=0 (D:150); vllm-ascend passes it only then.
    check(expert_scales is None or not a3, op, "expert_scales is not "
          "supported on Atlas A3: leave it None")
    check(expert_scales is None, op, "expert_scales is for the Atlas A2 "
          "hierarchical scheme (HCCL_INTRA_PCIE_ENABLE=1, "
          "HCCL_INTRA_ROCE_ENABLE=0): in fullmesh leave it None")
    bs_all = _all_bs(group, bs)
    active = _active_rows(op, x_active_mask, bs, bs_all)
    rows = _rows_bound(op, global_bs, bs_all, ep_world_size, local, top_k)

    max_bs = max(bs_all)
    xs = _all_gather_rows(group, x.float(), max_bs)
    ids = _all_gather_rows(group, expert_ids.long(), max_bs)
    alive = _all_gather_rows(group, active.to(torch.uint8), max_bs).bool()
    first = ep_rank_id * local
    # D:167 (no TP domain: A rows); int8 with quant_mode 2. Rows past the
    # received ones are undefined: NaN, or with int8 their scales NaN.
    quantized = quant_mode == 2
    expand_x = (torch.zeros((rows, hidden), dtype=torch.int8) if quantized
                else torch.full((rows, hidden), float("nan"), dtype=x.dtype))
    # D:168: float32 [A] with quant_mode 2 (without: no output, empty).
    dynamic_scales = (torch.full((rows, ), float("nan"))
                      if quantized else torch.empty(0))
    # The double's combine info: (source rank, token, slot) per row (D:169:
    # [A * 128] int32, opaque, D:188).
    assist = torch.zeros(rows * 128, dtype=torch.int32)
    counts = torch.zeros(local, ep_world_size, dtype=torch.int64)
    row = 0
    for e in range(local):
        for src in range(ep_world_size):
            valid = alive[src, :bs_all[src]].unsqueeze(1)
            tokens, slots = ((ids[src, :bs_all[src]] == first + e)
                             & valid).nonzero(as_tuple=True)
            n = tokens.numel()
            check(row + n <= rows, op, f"more than A={rows} rows for this "
                  "rank: global_bs is too small")
            if quantized:
                # D:42-50: each token quantized at its source, its scale
                # 1 / (127 / max|x|) sent along.
                q, scale = _quantize_tokens(xs[src, tokens])
                expand_x[row:row + n] = q
                dynamic_scales[row:row + n] = scale
            else:
                expand_x[row:row + n] = xs[src, tokens].to(x.dtype)
            info = torch.stack([torch.full_like(tokens, src), tokens, slots],
                               dim=1)
            assist[3 * row:3 * (row + n)] = info.flatten().int()
            counts[e, src] = n
            row += n
    # D:146, D:171
    per_expert = counts.sum(dim=1)
    expert_token_nums = (per_expert.cumsum(0)
                         if expert_token_nums_type == 0 else per_expert)
    recv = counts.flatten().cumsum(0).int()
    ep_recv_counts = torch.zeros(_ep_counts_size(ep_world_size, local),
                                 dtype=torch.int32)
    ep_recv_counts[:recv.numel()] = recv
    # CPP:146: tp_world_size elements (none on A2, D:177; D:178 on A3).
    tp_recv_counts = torch.zeros(tp_world_size, dtype=torch.int32)
    # D:180-182: A2 float32 [A] (undefined without expert_scales: NaN);
    # A3 None.
    expand_scales = None if a3 else torch.full((rows, ), float("nan"))
    return (expand_x, dynamic_scales, assist, expert_token_nums,
            ep_recv_counts, tp_recv_counts, expand_scales)


def _quantize_tokens(x: torch.Tensor):
    """D:42-46 without scales: value = 127 / max|x| per token, int8 of
    x * value (rounded to nearest even, saturated), and 1 / value."""
    x = x.float()
    peak = x.abs().amax(dim=-1)
    value = torch.where(peak > 0, 127.0 / peak, torch.ones_like(peak))
    q = torch.round(x * value.unsqueeze(-1)).clamp(-128, 127)
    return q.to(torch.int8), 1.0 / value


@traced("torch_npu.npu_moe_distribute_combine_v2")
def npu_moe_distribute_combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
        expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        *, tp_send_counts=None, x_active_mask=None, expand_scales=None,
        shared_expert_x=None, elastic_info=None, ori_x=None,
        const_expert_alpha_1=None, const_expert_alpha_2=None,
        const_expert_v=None, group_tp="", tp_world_size=0, tp_rank_id=0,
        expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
        global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0,
        copy_expert_num=0, const_expert_num=0):
    """The signature of C:45. y[t] = sum_k expert_scales[t, k] * (the row
    expert ids[t, k] computed for t), [BS, H] in expand_x's dtype
    (C:20-24, C:152)."""
    op = "npu_moe_distribute_combine_v2"
    _npu.state.kernel_launched()
    _algorithm(op, comm_alg)
    # C:50
    check(expand_x.dim() == 2 and expand_x.dtype in HALF, op,
          "expand_x must be bfloat16/float16 [A, H]")
    rows, hidden = expand_x.shape
    bs = expert_ids.shape[0]
    group, local = _common(op, expert_ids, group_ep, ep_world_size,
                           ep_rank_id, moe_expert_num,
                           shared_expert_rank_num, group_tp, tp_world_size,
                           tp_rank_id, zero_expert_num + copy_expert_num +
                           const_expert_num, bs, hidden)
    top_k = expert_ids.shape[1]
    a3 = soc_is_a3()
    # C:60
    check(expert_scales is not None and expert_scales.dtype == torch.float32
          and tuple(expert_scales.shape) == (bs, top_k), op,
          f"expert_scales must be float32 [BS, K]=[{bs}, {top_k}]")
    # C:54
    check(assist_info_for_combine.dtype == torch.int32
          and tuple(assist_info_for_combine.shape) == (rows * 128, ), op,
          f"assist_info_for_combine must be int32 [A * 128]={rows * 128}")
    # C:56-58, D:188: the dispatch's ep_recv_counts as it is.
    size = _ep_counts_size(ep_world_size, local)
    check(ep_send_counts.dtype == torch.int32
          and tuple(ep_send_counts.shape) == (size, ), op,
          f"ep_send_counts must be int32 [{size}] (dispatch's "
          "ep_recv_counts)")
    if a3:
        # C:74: int32 [tp_world_size], the dispatch's tp_recv_counts. A
        # tensor for tp_world_size 0 is empty (CPP:146); vllm-ascend passes
        # tp_world_size 1 with it (unverified on hardware: an empty one may
        # work).
        check(tp_send_counts is None
              or (tp_send_counts.dtype == torch.int32
                  and tuple(tp_send_counts.shape) == (tp_world_size, )
                  and tp_world_size >= 1), op,
              "tp_send_counts must be the dispatch's int32 "
              f"[tp_world_size={tp_world_size}] tp_recv_counts, non-empty "
              "(tp_world_size 1 without a TP domain)")
        # C:84
        check(expand_scales is None, op, "expand_scales is not supported "
              "on Atlas A3: leave it None")
    else:
        # C:73: no TP domain on Atlas A2, the default input.
        check(tp_send_counts is None, op, "tp_send_counts: Atlas A2 has no "
              "TP domain, leave the default None")
        # C:83
        check(expand_scales is not None
              and expand_scales.dtype == torch.float32
              and tuple(expand_scales.shape) == (rows, ), op,
              f"expand_scales is required on Atlas A2: float32 [A={rows}] "
              "(dispatch's output)")
    # C:86-100
    if shared_expert_x is not None or ori_x is not None:
        raise NotImplementedError(f"{op}: the double implements neither "
                                  "shared_expert_x nor ori_x")
    check(elastic_info is None and const_expert_alpha_1 is None
          and const_expert_alpha_2 is None and const_expert_v is None, op,
          "elastic_info and the const expert inputs are not supported: "
          "pass None")
    # C:128-130
    if comm_quant_mode != 0:
        raise NotImplementedError(f"{op}: the double implements "
                                  "comm_quant_mode 0 only")
    bs_all = _all_bs(group, bs)
    _active_rows(op, x_active_mask, bs, bs_all)
    check(rows == _rows_bound(op, global_bs, bs_all, ep_world_size, local,
                              top_k), op,
          "expand_x rows differ from the dispatch's A for these arguments")
    valid = int(ep_send_counts[local * ep_world_size - 1])
    results = _all_gather_rows(group, expand_x[:valid].float(), rows)
    infos = _all_gather_rows(group, assist_info_for_combine[:3 * valid]
                             .view(-1, 3), rows)
    valids = _all_bs(group, valid)
    out = torch.zeros(bs, hidden, dtype=torch.float32)
    for src in range(ep_world_size):
        info = infos[src, :valids[src]].long()
        mine = info[:, 0] == ep_rank_id
        tokens, slots = info[mine, 1], info[mine, 2]
        out.index_add_(0, tokens, results[src, :valids[src]][mine]
                       * expert_scales[tokens, slots].unsqueeze(1))
    return out.to(expand_x.dtype)
