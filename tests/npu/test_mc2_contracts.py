"""The double's MC2 kernels (npu_moe_distribute_dispatch_v2 / combine_v2).

Two EP ranks in one process. The valid round trip gives the documented
result (each token's rows, each scaled by its expert, weighted by its
scales), whatever the row layout; then each documented limit fires.
"""

import pytest
import torch

from tests.npu.helpers import REAL_NPU, on_both_ranks

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="checks the double; a real NPU has the real contracts")

E, K, H = 4, 2, 64
BS = (3, 2)  # different per rank: global_bs = max_bs * ep_world_size


def _inputs(rank: int, bs: int, hidden: int = H):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(bs, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K]
                       for _ in range(bs)]).int()
    weights = torch.rand(bs, K, generator=gen)
    return x, ids, weights


def _round_trip(group, rank, hidden=H, global_bs=2 * max(BS), **changes):
    import torch_npu
    x, ids, weights = _inputs(rank, BS[rank], hidden)
    common = dict(group_ep=group.get_hccl_comm_name(rank), ep_world_size=2,
                  ep_rank_id=rank, moe_expert_num=E, global_bs=global_bs)
    common.update(changes)
    (expand_x, _, assist, token_nums, recv_counts, tp_counts,
     expand_scales) = torch_npu.npu_moe_distribute_dispatch_v2(
         x, ids, expert_scales=weights, expert_token_nums_type=1, **common)
    # "Expert" e of this rank scales its rows by e + 1.
    local = E // 2
    results = expand_x.clone()
    start = 0
    for j, n in enumerate(token_nums.tolist()):
        results[start:start + n] *= rank * local + j + 1
        start += n
    out = torch_npu.npu_moe_distribute_combine_v2(
        results, ids, assist, recv_counts, weights, tp_send_counts=tp_counts,
        expand_scales=expand_scales, **common)
    expected = (x.float().unsqueeze(1) * (ids.float() + 1).unsqueeze(2) *
                weights.unsqueeze(2)).sum(1)
    return out, expected, expand_x, token_nums


def test_round_trip(groups):
    for out, expected, expand_x, token_nums in on_both_ranks(
            groups, _round_trip):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=2e-2,
                                   atol=2e-2)
        # A = global_bs * min(local_E, K); past the received rows: NaN.
        assert expand_x.shape == (2 * max(BS) * min(E // 2, K), H)
        assert expand_x[int(token_nums.sum()):].isnan().all()
    total = sum(int(r[3].sum()) for r in on_both_ranks(groups, _round_trip))
    assert total == sum(BS) * K  # every (token, slot) pair once


def _fails(groups, match, both=False, **changes):
    """One rank's call fails before any exchange (or, with ``both``, on
    each rank after the exchange of batch sizes)."""
    if both:
        def call(group, rank):
            with pytest.raises(RuntimeError, match=match):
                _round_trip(group, rank, **changes)
        on_both_ranks(groups, call)
    else:
        with pytest.raises(RuntimeError, match=match):
            _round_trip(groups[0], 0, **changes)


def test_documented_limits(groups, monkeypatch):
    _fails(groups, "ep_world_size 4 but group_ep has 2", ep_world_size=4)
    _fails(groups, "multiple of 32", hidden=48)
    _fails(groups, "moe_expert_num 3 must be", moe_expert_num=3)
    _fails(groups, "not an HCCL communicator name", group_ep="nccl_comm")
    _fails(groups, "ep_rank_id 1 is not this rank", ep_rank_id=1)
    _fails(groups, "global_bs must be max_bs", both=True, global_bs=0)
    _fails(groups, "max_bs >= every rank's BS", both=True, global_bs=4)
    with pytest.raises(NotImplementedError, match="fullmesh"):
        _round_trip(groups[0], 0, comm_alg="hierarchy")
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION", "250")
    _fails(groups, r"H 64 must be in \[1024, 8192\]")


def test_expert_ids_and_scales(groups):
    import torch_npu
    group = groups[0]
    x, ids, weights = _inputs(0, 3)
    common = dict(group_ep=group.get_hccl_comm_name(0), ep_world_size=2,
                  ep_rank_id=0, moe_expert_num=E, global_bs=2 * max(BS))
    same = ids.clone()
    same[0, 1] = same[0, 0]
    with pytest.raises(RuntimeError, match="ids of a row must differ"):
        torch_npu.npu_moe_distribute_dispatch_v2(x, same, **common)
    with pytest.raises(RuntimeError, match="int32"):
        torch_npu.npu_moe_distribute_dispatch_v2(x, ids.long(), **common)
    with pytest.raises(RuntimeError, match="expand_scales is required"):
        torch_npu.npu_moe_distribute_combine_v2(
            x, ids, torch.zeros(x.shape[0] * 128, dtype=torch.int32),
            torch.zeros(E + 2 * 6 * K, dtype=torch.int32), weights,
            **dict(common, global_bs=0))
