"""The double's MC2 kernels (npu_moe_distribute_dispatch_v2 / combine_v2)
against op-plugin 7.2.0, the version torch-npu 2.8.0 ships (CANN 8.3.RC1),
and the plugin's use of them (``mc2_kernels``).

EP ranks in one process (threads): 2 as an Atlas A3, 16 as an A2 (the
smallest EP size 7.2.0 admits there). The round trip, called with what the
plugin passes on each SoC, gives the documented result (each token's rows,
each scaled by its expert, weighted by its scales), whatever the row
layout; then each documented limit fires, and the plugin admits the
configurations the kernels take and no other.
"""

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.utils.npu import REAL_NPU, on_both_ranks

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="checks the double; a real NPU has the real contracts")

A3 = "250"
SOC_ENV = "VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION"
K = 2
BS = (3, 2)  # rank r's BS is BS[r % 2]: global_bs = max_bs * ep_world_size
H_A2, H_A3 = 64, 1024  # A3 takes H in [1024, 8192]
E_A3 = 4
# Atlas A2: 16 ranks with the most experts a rank may hold (24).
W_A2, E_A2 = 16, 16 * 24


@pytest.fixture(scope="module")
def groups16(groups):
    """16 ranks of the double's ``hccl`` process group (threads)."""
    from torch_npu._hccl import HcclContractGroup
    store = dist.HashStore()
    with ThreadPoolExecutor(W_A2) as pool:
        return list(pool.map(
            lambda rank: HcclContractGroup(store, rank, W_A2,
                                           timedelta(seconds=60)),
            range(W_A2)))


@pytest.fixture
def a3(monkeypatch):
    monkeypatch.setenv(SOC_ENV, A3)


def _on_all(groups, fn):
    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(fn, groups, range(len(groups))))


def _inputs(rank: int, experts: int, hidden: int):
    gen = torch.Generator().manual_seed(rank)
    bs = BS[rank % 2]
    x = torch.randn(bs, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:K]
                       for _ in range(bs)]).int()
    weights = torch.rand(bs, K, generator=gen)
    return x, ids, weights


def _expected(x, ids, weights):
    """Expert e scales its rows by e + 1."""
    return (x.float().unsqueeze(1) * (ids.float() + 1).unsqueeze(2) *
            weights.unsqueeze(2)).sum(1)


def _arguments(group, rank: int, world: int, experts: int, a3: bool):
    """What the plugin passes both kernels (``FusedMC2Kernels.experts``):
    the TP-domain arguments only on Atlas A3."""
    name = group.get_hccl_comm_name(rank)
    common = dict(group_ep=name, ep_world_size=world, ep_rank_id=rank,
                  moe_expert_num=experts, global_bs=world * max(BS))
    if a3:
        common.update(group_tp=name, tp_world_size=1, tp_rank_id=0)
    return common


def _round_trip(group, rank, *, world, experts, hidden, a3, dispatch=(),
                combine=(), **changes):
    """Dispatch, "experts", combine as the plugin calls them; ``changes``
    to both calls, ``dispatch`` / ``combine`` to one."""
    import torch_npu
    x, ids, weights = _inputs(rank, experts, hidden)
    common = {**_arguments(group, rank, world, experts, a3), **changes}
    (expand_x, _, assist, token_nums, recv_counts, tp_counts,
     expand_scales) = torch_npu.npu_moe_distribute_dispatch_v2(
         x, ids, **{"expert_token_nums_type": 1, **common, **dict(dispatch)})
    local = experts // world
    results = expand_x.clone()
    start = 0
    for j, n in enumerate(token_nums.tolist()):
        results[start:start + n] *= rank * local + j + 1
        start += n
    out = torch_npu.npu_moe_distribute_combine_v2(
        results, ids, assist, recv_counts, weights,
        **{"tp_send_counts": tp_counts if a3 else None,
           "expand_scales": expand_scales, **common, **dict(combine)})
    return dict(out=out, expected=_expected(x, ids, weights),
                expand_x=expand_x, token_nums=token_nums,
                recv_counts=recv_counts, tp_counts=tp_counts,
                expand_scales=expand_scales)


def _a2(group, rank, **changes):
    return _round_trip(group, rank, **{
        **dict(world=W_A2, experts=E_A2, hidden=H_A2, a3=False), **changes})


def _a3(group, rank, **changes):
    return _round_trip(group, rank, **{
        **dict(world=2, experts=E_A3, hidden=H_A3, a3=True), **changes})


def _check_round_trip(got, world, experts):
    for r in got:
        assert r["out"].dtype == torch.bfloat16
        torch.testing.assert_close(r["out"].float(), r["expected"],
                                   rtol=2e-2, atol=2e-2)
        # A = global_bs * min(local_E, K); past the received rows: NaN.
        rows = world * max(BS) * min(experts // world, K)
        assert r["expand_x"].shape[0] == rows
        assert r["expand_x"][int(r["token_nums"].sum()):].isnan().all()
    # every (token, slot) pair once
    assert sum(int(r["token_nums"].sum()) for r in got) == sum(
        BS[r % 2] for r in range(world)) * K


def test_round_trip_a2(groups16):
    got = _on_all(groups16, _a2)
    _check_round_trip(got, W_A2, E_A2)
    for r in got:
        # No TP domain on A2: tp_recv_counts has tp_world_size (0)
        # elements; expand_scales float32 [A]; ep_recv_counts E.
        assert r["tp_counts"].shape == (0, )
        assert r["expand_scales"].shape == (r["expand_x"].shape[0], )
        assert r["recv_counts"].shape == (E_A2, )


def test_round_trip_a3(groups, a3):
    got = on_both_ranks(groups, _a3)
    _check_round_trip(got, 2, E_A3)
    for r in got:
        assert r["tp_counts"].shape == (1, ) and r["expand_scales"] is None


def _fails(call, group, match, error=RuntimeError, **changes):
    """Rank 0's call fails before any exchange."""
    with pytest.raises(error, match=match):
        call(group, 0, **changes)


def _fail_on_all(groups, call, match, **changes):
    """Every rank's call fails (after the dispatch's exchange)."""
    def each(group, rank):
        with pytest.raises(RuntimeError, match=match):
            call(group, rank, **changes)
    _on_all(groups, each)


def test_a2_ep_sizes(groups, groups16):
    """op-plugin 7.2.0 dispatch_v2.md:97-98: A2 fullmesh EP 16, 32, 64,
    128, 256 (2-8 are newer CANN's)."""
    _fails(_round_trip, groups[0], r"ep_world_size 2 is not one of "
           r"\[16, 32, 64, 128, 256\]", world=2, experts=4, hidden=H_A2,
           a3=False)
    _fails(_a2, groups16[0], "ep_world_size 8 is not one of",
           ep_world_size=8)


def test_a2_experts_per_rank(groups16):
    """dispatch_v2.md:104, combine_v2.md:70: at most 24 experts per A2
    rank (the round trip runs at 24)."""
    _fails(_a2, groups16[0], r"moe_expert_num / ep_world_size = 25 must "
           "be <= 24", moe_expert_num=W_A2 * 25)


def test_a2_no_tp_domain(groups16):
    """dispatch_v2.md:120,124,128 and combine_v2.md:73: A2 has no TP
    domain; tp_send_counts keeps the default None, even the dispatch's
    0-element tp_recv_counts."""
    _fails(_a2, groups16[0], "tp_world_size 1: Atlas A2 has no TP domain",
           tp_world_size=1)
    _fails(_a2, groups16[0], "tp_rank_id 1: Atlas A2", tp_rank_id=1)
    _fails(_a2, groups16[0], "group_tp 'other'", group_tp="other")
    _fail_on_all(groups16, _a2, "tp_send_counts: Atlas A2 has no TP",
                 combine=dict(tp_send_counts=torch.zeros(0,
                                                         dtype=torch.int32)))


def test_a2_expert_scales_only_hierarchical(groups16, monkeypatch):
    """MoeDistributeDispatchV2KernelOpApi.cpp:149-153 (7.2.0): expert_scales
    is the A2 hierarchical scheme's; fullmesh leaves it None and still
    hands combine the dispatch's expand_scales (combine_v2.md:83)."""
    _fails(_a2, groups16[0], "expert_scales is for the Atlas A2 "
           "hierarchical", dispatch=dict(expert_scales=torch.rand(3, K)))
    _fail_on_all(groups16, _a2, "expand_scales is required on Atlas A2",
                 combine=dict(expand_scales=None))
    monkeypatch.setenv("HCCL_INTRA_PCIE_ENABLE", "1")
    monkeypatch.setenv("HCCL_INTRA_ROCE_ENABLE", "0")
    _fails(_a2, groups16[0], "fullmesh algorithm only", NotImplementedError)


def test_a3_contracts(groups, a3):
    """A3: H in [1024, 8192] (dispatch_v2.md:201), no expert_scales
    (:115), no comm_alg (:153), tp_world_size in [0, 2] (:125), and
    combine's tp_send_counts int32 [tp_world_size] (combine_v2.md:74):
    not the empty tensor of tp_world_size 0."""
    _fails(_a3, groups[0], r"H 64 must be in \[1024, 8192\]", hidden=64)
    _fails(_a3, groups[0], "not supported on Atlas A3",
           dispatch=dict(expert_scales=torch.rand(3, K)))
    _fails(_a3, groups[0], "comm_alg is not supported on Atlas A3",
           comm_alg="fullmesh")
    _fails(_a3, groups[0], r"tp_world_size 3 not in \[0, 2\]",
           tp_world_size=3)
    _fails(_a3, groups[0], "no TP domain", NotImplementedError,
           tp_world_size=2)

    def no_tp(group, rank):
        with pytest.raises(RuntimeError, match="tp_send_counts must be"):
            _a3(group, rank, tp_world_size=0, group_tp="")
    on_both_ranks(groups, no_tp)


def test_documented_limits(groups16):
    _fails(_a2, groups16[0], "ep_world_size 32 but group_ep has 16",
           ep_world_size=32, moe_expert_num=32)
    _fails(_a2, groups16[0], "multiple of 32", hidden=48)
    _fails(_a2, groups16[0], "moe_expert_num 40 must be",
           moe_expert_num=40)
    _fails(_a2, groups16[0], "not an HCCL communicator name",
           group_ep="nccl_comm")
    _fails(_a2, groups16[0], "ep_rank_id 1 is not this rank", ep_rank_id=1)
    with pytest.raises(NotImplementedError, match="fullmesh"):
        _a2(groups16[0], 0, comm_alg="hierarchy")


def test_global_bs(groups16):
    _fail_on_all(groups16, _a2, "global_bs must be max_bs", global_bs=0)
    _fail_on_all(groups16, _a2, "max_bs >= every rank's BS",
                 global_bs=2 * W_A2)


def test_expert_ids(groups16):
    import torch_npu
    x, ids, _ = _inputs(0, E_A2, H_A2)
    common = _arguments(groups16[0], 0, W_A2, E_A2, a3=False)
    same = ids.clone()
    same[0, 1] = same[0, 0]
    with pytest.raises(RuntimeError, match="ids of a row must differ"):
        torch_npu.npu_moe_distribute_dispatch_v2(x, same, **common)
    with pytest.raises(RuntimeError, match="int32"):
        torch_npu.npu_moe_distribute_dispatch_v2(x, ids.long(), **common)


# The plugin's admission of a configuration (mc2_kernels.unsupported_reason)


def _config(dp, tp, experts, hidden=5120, top_k=8):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            data_parallel_size=dp, tensor_parallel_size=tp,
            enable_eplb=False, expert_placement_strategy="linear"),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(
            n_routed_experts=experts, num_experts_per_tok=top_k,
            hidden_size=hidden)))


@pytest.mark.parametrize("family,config,reason", [
    # A2 fullmesh: EP 16/32/64/128/256 only (dispatch_v2.md:98).
    ("A2", _config(1, 8, 64), r"EP size 8 is not one of \(16, 32"),
    ("A2", _config(2, 2, 4, hidden=64, top_k=2), "EP size 4 is not one of"),
    ("A2", _config(2, 8, 160), None),  # 10 experts per rank
    # At most 24 experts per rank on A2 (dispatch_v2.md:104).
    ("A2", _config(2, 8, 16 * 24), None),
    ("A2", _config(2, 8, 16 * 25), "25 experts per rank"),
    ("A2", _config(4, 8, 32 * 25), "25 experts per rank"),
    ("A2", _config(16, 16, 256 * 2), None),
    # A3: EP [2, 768] (dispatch_v2.md:100), H [1024, 8192] (:201), no
    # experts-per-rank limit.
    ("A3", _config(2, 2, 4, hidden=1024, top_k=2), None),
    ("A3", _config(1, 8, 8 * 25), None),
    ("A3", _config(2, 2, 4, hidden=64, top_k=2),
     r"hidden size 64 is outside \[1024, 8192\]"),
])
def test_admission(family, config, reason, monkeypatch):
    from vllm_ascend.distributed.moe_comm import mc2_kernels
    monkeypatch.delenv("HCCL_INTRA_PCIE_ENABLE", raising=False)
    got = mc2_kernels.unsupported_reason(config, 256, family)
    if reason is None:
        assert got is None
    else:
        assert got is not None and re.search(reason, got), got


def test_admission_a2_hierarchical(monkeypatch):
    """HCCL_INTRA_PCIE_ENABLE=1 HCCL_INTRA_ROCE_ENABLE=0 run the hierarchy
    algorithm (dispatch_v2.md:150): EP 16, 32, 64 (:99), without the 24
    experts-per-rank limit (:221)."""
    from vllm_ascend.distributed.moe_comm import mc2_kernels
    monkeypatch.setenv("HCCL_INTRA_PCIE_ENABLE", "1")
    monkeypatch.setenv("HCCL_INTRA_ROCE_ENABLE", "0")
    assert mc2_kernels.unsupported_reason(_config(2, 8, 16 * 25), 256,
                                          "A2") is None
    assert "EP size 128 is not one of (16, 32, 64)" in (
        mc2_kernels.unsupported_reason(_config(16, 8, 128), 256, "A2"))


# The plugin's calls (FusedMC2Kernels.experts) on the double


def _plugin_experts(monkeypatch, groups, family, experts, hidden,
                    int8=False):
    """Each rank's ``FusedMC2Kernels.experts`` over all its tokens, with
    the grouped MLP scaling local expert j's rows by its id + 1 (``int8``:
    a W8A8 layer's, which takes int8 rows with their scales)."""
    from vllm_ascend.distributed.moe_comm import mc2_kernels
    from vllm_ascend.distributed.moe_comm.base import GroupedMLP
    world = len(groups)
    ranks = threading.local()
    monkeypatch.setattr(mc2_kernels, "get_ep_group", lambda: SimpleNamespace(
        world_size=world, rank_in_group=ranks.rank))

    def run(group, rank):
        ranks.rank = rank
        kernels = mc2_kernels.FusedMC2Kernels(max(BS), family)
        kernels._comm_name = group.get_hccl_comm_name(rank)
        x, ids, weights = _inputs(rank, experts, hidden)
        local = experts // world

        def grouped(rows, ends, row_scales):
            assert (row_scales is not None) == int8
            assert rows.dtype == (torch.int8 if int8 else torch.bfloat16)
            if int8:
                rows = (rows.float() * row_scales.unsqueeze(1)).to(
                    torch.bfloat16)
            out = rows.clone()
            start = 0
            for j, end in enumerate(ends.tolist()):
                out[start:end] *= rank * local + j + 1
                start = end
            return out
        out = kernels.experts(x, slice(0, x.shape[0]), weights, ids.long(),
                              experts, GroupedMLP(grouped, takes_int8=int8))
        half_step = x.float().abs().amax(-1) / 127 / 2
        bound = (half_step * (weights * (ids.float() + 1)).sum(-1)).amax()
        return out, _expected(x, ids, weights), float(bound)
    return _on_all(groups, run)


def test_plugin_calls_a2(groups16, monkeypatch):
    for out, expected, _ in _plugin_experts(monkeypatch, groups16, "A2",
                                            E_A2, H_A2):
        torch.testing.assert_close(out.float(), expected, rtol=2e-2,
                                   atol=2e-2)


def test_plugin_calls_a3(groups, a3, monkeypatch):
    for out, expected, _ in _plugin_experts(monkeypatch, groups, "A3",
                                            E_A3, H_A3):
        torch.testing.assert_close(out.float(), expected, rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.parametrize("family,hierarchical", [
    ("A2", False), ("A2", True), ("A3", False)])
def test_plugin_arguments(groups, monkeypatch, family, hierarchical):
    """What the plugin passes per SoC, as vllm-ascend 0.11 does: Atlas A3
    the TP-domain arguments with tp_world_size 1 (no TP domain,
    dispatch_v2.md:125) and the dispatch's tp_recv_counts; Atlas A2 none
    of them (:124, combine_v2.md:73), expert_scales (the routing weights,
    float32) only to the hierarchical scheme, the dispatch's expand_scales
    to combine either way (combine_v2.md:83)."""
    import torch_npu

    from vllm_ascend.distributed.moe_comm import mc2_kernels
    from vllm_ascend.distributed.moe_comm.base import GroupedMLP
    calls = {}
    scales_out = None if family == "A3" else torch.rand(6)
    tp_out = torch.zeros(1 if family == "A3" else 0, dtype=torch.int32)

    def dispatch(x, ids, **kw):
        calls["dispatch"] = kw
        return (x, None, "assist", torch.tensor([x.shape[0]]), "recv",
                tp_out, scales_out)

    def combine(y, ids, assist, recv, weights, **kw):
        calls["combine"] = kw
        return y
    monkeypatch.setattr(torch_npu, "npu_moe_distribute_dispatch_v2",
                        dispatch)
    monkeypatch.setattr(torch_npu, "npu_moe_distribute_combine_v2",
                        combine)
    monkeypatch.setattr(mc2_kernels, "get_ep_group", lambda: SimpleNamespace(
        world_size=16, rank_in_group=0))
    kernels = mc2_kernels.FusedMC2Kernels(
        4, family, *([hierarchical] if hierarchical else []))
    kernels._comm_name = "comm"
    weights = torch.rand(3, K, dtype=torch.bfloat16)
    kernels.experts(torch.zeros(3, H_A2, dtype=torch.bfloat16), slice(0, 3),
                    weights, torch.zeros(3, K, dtype=torch.long), E_A2,
                    GroupedMLP(lambda rows, ends, scales: rows))
    sent = calls["dispatch"]["expert_scales"]
    if hierarchical:
        assert sent.dtype == torch.float32
        assert torch.equal(sent, weights.float())
    else:
        assert sent is None
    assert calls["combine"]["expand_scales"] is scales_out
    tp = dict(group_tp="comm", tp_world_size=1, tp_rank_id=0)
    for kw in calls.values():
        if family == "A3":
            assert {k: kw[k] for k in tp} == tp
        else:
            assert not set(tp) & set(kw)
    assert calls["combine"]["tp_send_counts"] is (
        tp_out if family == "A3" else None)


# int8 dispatch (quant_mode=2): W8A8 experts


def _dispatched(monkeypatch):
    """Wrap the double's dispatch: per call, what it hands this rank."""
    import torch_npu
    real = torch_npu.npu_moe_distribute_dispatch_v2
    seen = []

    def dispatch(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(dict(quant_mode=kwargs.get("quant_mode", 0),
                         expand_x=out[0], dynamic_scales=out[1],
                         rows=int(out[3][-1])))  # cumulative token counts
        return out
    monkeypatch.setattr(torch_npu, "npu_moe_distribute_dispatch_v2",
                        dispatch)
    return seen


def _bytes_per_row(call) -> int:
    """What one dispatched token row occupies: its hidden values, and its
    scale when quantized."""
    per_row = call["expand_x"].shape[1] * call["expand_x"].element_size()
    if call["quant_mode"] == 2:
        per_row += call["dynamic_scales"].element_size()
    return per_row


@pytest.mark.parametrize("family", ["A3", "A2"])
def test_int8_dispatch_halves_the_bytes(family, groups, groups16, a3,
                                        monkeypatch):
    """A W8A8 layer's MC2 dispatch quantizes each token (quant_mode=2,
    dispatch_v2.md:143): int8 rows with float32 per-token scales
    (:167-168), about half the bytes of the bfloat16 rows a float layer
    sends, and the same result within int8 rounding."""
    if family == "A2":
        monkeypatch.delenv(SOC_ENV)
        groups, experts, hidden = groups16, E_A2, 1024
    else:
        experts, hidden = E_A3, H_A3
    bytes_per_row = {}
    for int8 in (False, True):
        seen = _dispatched(monkeypatch)
        for out, expected, bound in _plugin_experts(
                monkeypatch, groups, family, experts, hidden, int8=int8):
            # int8: each value within half a quantization step (max|x| /
            # 127) of each row, times its weighted expert multipliers.
            atol = (bound + 3e-2) if int8 else 3e-2
            torch.testing.assert_close(out.float(), expected, rtol=3e-2,
                                       atol=atol)
        assert {c["quant_mode"] for c in seen} == {2 if int8 else 0}
        for call in seen:
            valid = call["expand_x"][:call["rows"]]
            assert valid.dtype == (torch.int8 if int8 else torch.bfloat16)
            if int8:
                scales = call["dynamic_scales"]
                assert scales.dtype == torch.float32
                assert scales.shape == (call["expand_x"].shape[0], )
        bytes_per_row[int8] = {_bytes_per_row(c) for c in seen}
    (plain, ), (quantized, ) = bytes_per_row[False], bytes_per_row[True]
    assert plain == 2 * hidden and quantized == hidden + 4
    assert quantized <= 0.51 * plain


def test_int8_dispatch_contract(groups, a3):
    """dispatch_v2.md:40-50: q = int8(x * 127 / max|x|) per token,
    dynamic_scales = max|x| / 127; quant_mode is 0 or 2 (:143), scales
    only with 2 (:106)."""
    def run(group, rank):
        import torch_npu
        x, ids, _ = _inputs(rank, E_A3, H_A3)
        common = _arguments(group, rank, 2, E_A3, True)
        expand_x, scales, _, counts, *_ = (
            torch_npu.npu_moe_distribute_dispatch_v2(
                x, ids, quant_mode=2, expert_token_nums_type=1, **common))
        rows = int(counts.sum())
        peak = expand_x[:rows].abs().amax(dim=1)
        assert expand_x.dtype == torch.int8 and bool((peak == 127).all())
        return expand_x[:rows].float() * scales[:rows].unsqueeze(1), x
    got = on_both_ranks(groups, run)
    # Every received row is some token of some rank, dequantized within
    # half a step of int8.
    tokens = torch.cat([x.float() for _, x in got])
    for rows, _ in got:
        nearest = (rows.unsqueeze(1) - tokens.unsqueeze(0)).abs().amax(-1)
        step = tokens.abs().amax(-1) / 127
        assert bool((nearest.min(dim=1).values
                     <= step[nearest.argmin(dim=1)] * 0.51).all())
    for change, match in [(dict(quant_mode=1), "quant_mode 1 must be"),
                          (dict(scales=torch.ones(E_A3, H_A3)),
                           "scales are for dynamic quantization")]:
        _fails(_a3, groups[0], match, dispatch=change)
