"""The step-cost instrument (``torch_npu._cost``, the double's cost meter)
on small known computations, and a smoke of the report
(``tools.bench.step_cost``) on a tiny W8A8 checkpoint."""

import pytest
import torch

from tests.utils.npu import REAL_NPU, on_both_ranks, torch_npu_in_process

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(REAL_NPU, reason="counts through the double"),
]

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tnpu():
    with torch_npu_in_process() as module:
        yield module


@pytest.fixture
def meter(tnpu):
    from torch_npu._cost import CostMeter
    return CostMeter()


def test_a_torch_npu_op_is_one_kernel_and_its_insides_none(tnpu, meter):
    x = torch.randn(4, 64, dtype=BF16)
    w = torch.ones(64, dtype=BF16)
    with meter, meter.scope("op", device=True) as cost:
        tnpu.npu_rms_norm(x, w)
    # The double computes the norm with several torch ops; one launch.
    assert dict(cost.kernels) == {"torch_npu.npu_rms_norm": 1}


def test_views_launch_nothing_and_aten_ops_one_each(tnpu, meter):
    x = torch.randn(4, 8)
    with meter, meter.scope("views", device=True) as views:
        x.view(2, 16).transpose(0, 1).t()[1:, 2].expand(3)
        x.reshape(32).detach()
        torch.empty(5)
    with meter, meter.scope("ops", device=True) as ops:
        y = x + 1
        y.mul_(2)
        x.transpose(0, 1).contiguous()  # a copy
    assert views.num_kernels == 0, views.kernels
    assert ops.num_kernels == 3, ops.kernels


def test_host_reads_of_device_tensors_are_syncs_with_their_site(meter):
    host = torch.arange(4)  # never touched by device work
    with meter:
        with meter.scope("step", device=True):
            y = torch.arange(4) * 2  # device work
        with meter.scope("read") as read:
            y.sum().item()
            y.tolist()
            y.tolist()  # the host copy of the last read: no second sync
            host.tolist()  # a host tensor: no sync
        with meter.scope("d2h") as d2h:
            y.add_(1)
            y.cpu()
        with meter.scope("mask") as mask:
            y[y > 2]
            torch.npu.synchronize()
    assert [s.kind for s in read.syncs] == ["item", "tolist"]
    assert read.syncs[0].site.startswith("tests/npu/test_step_cost.py:")
    assert [s.kind for s in d2h.syncs] == ["cpu"]
    assert [s.kind for s in mask.syncs] == ["index", "torch.npu.synchronize"]


def test_graph_replay_launches_its_recorded_kernels(tnpu, meter):
    x = torch.randn(4, 64, dtype=BF16)
    w = torch.ones(64, dtype=BF16)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        y = tnpu.npu_rms_norm(x, w)[0]
        z = (y * 2).view(-1)
    with meter, meter.scope("replay") as replay:
        graph.replay()
        graph.replay()
    assert dict(replay.kernels) == {"torch_npu.npu_rms_norm": 2,
                                    "aten.mul": 2}
    assert z.shape == (256, )


def test_all_to_all_bytes(tnpu, groups, meter):
    rows = torch.ones(6, 32, dtype=BF16)

    def exchange(group, rank):
        out = torch.empty_like(rows)
        group.alltoall_base(out, rows, [], [],
                            torch.distributed.AllToAllOptions()).wait()

    with meter, meter.scope("a2a") as cost:
        on_both_ranks(groups, exchange)
    assert [(e.op, e.nbytes, e.dtype, e.rows) for e in cost.exchanges] == [
        ("hccl.alltoall_base", 6 * 32 * 2, "bfloat16", 6)] * 2
    assert cost.kernels == {"hccl.alltoall_base": 2}


def test_inactive_meter_changes_nothing(tnpu, meter):
    x = torch.randn(4, 64, dtype=BF16)
    w = torch.ones(64, dtype=BF16)
    with meter:
        pass
    import torch_npu._emulator as emulator
    assert emulator.observer is None
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist
    torch.testing.assert_close(tnpu.npu_rms_norm(x, w)[0],
                               tnpu.npu_rms_norm(x, w)[0])


def test_report_smoke(tmp_path):
    """One MTP k=1 engine through the double, default graph mode: the
    verify step's forward is a replay whose kernels are counted the same in
    every metered step, with no host sync inside; the output read is named;
    the W8A8 weights' formats are reported."""
    from tools.bench import step_cost
    shape = dict(step_cost.MODEL_SHAPE, num_hidden_layers=2,
                 hidden_size=64, intermediate_size=128)
    model = step_cost.write_checkpoint(tmp_path / "w8a8", shape)
    spec = {"engine": step_cost._engine(model), "k": 1, "per_layer": False,
            "prompts": step_cost.PROMPTS[:2], "new_tokens": 7}
    got = step_cost.run_child(step_cost.ROOT, spec, 300, tmp_path / "log")
    steps = got["metered_steps"]
    assert len(steps) == len(step_cost.METERED_STEPS)
    forward = [s["forward"]["kernels"] for s in steps]
    assert forward[0] > 0 and len(set(forward)) == 1, forward
    assert all(not s["forward"]["syncs"] for s in steps)
    assert all(s["draft_forward"]["calls"] == 1 for s in steps)
    read = [x["site"] for s in steps for x in s["runner"]["syncs"]]
    assert read and all(site.startswith(("vllm/", "vllm_ascend/"))
                        for site in read), read
    int8 = got["weights"]["target"]["int8"]
    assert sum(e["count"] for e in int8.values()) > 0
    assert got["host_s_per_step"] > 0
