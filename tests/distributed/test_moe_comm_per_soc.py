"""The MoE communication method per SoC (issue 28, S3-11): above the MC2
capacity an Atlas A3 runs all-to-all, as vllm-ascend v0.11.0
``_select_moe_comm_method`` (main: ``_select_a3_moe_comm_method``) does, an
A2 all-gather; all-to-all only where no rank replays a graph."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_ascend.distributed import moe_comm
from vllm_ascend.distributed.moe_comm import mc2_kernels


@pytest.mark.parametrize(
    "family,fits,graph_safe,graphs,in_range,method",
    [
        # No graphs: MC2 within the capacity; above, per SoC.
        ("A3", True, True, False, False, "mc2"),
        ("A3", False, True, False, False, "alltoall"),
        ("A2", True, True, False, False, "mc2"),
        ("A2", False, True, False, False, "allgather"),
        (None, False, False, False, False, "allgather"),
        # Graphs with the fused MC2 kernels: all-to-all only above every
        # captured size (no rank replays a graph then).
        ("A3", True, True, True, True, "mc2"),
        ("A3", False, True, True, True, "allgather"),
        ("A3", False, True, True, False, "alltoall"),
        ("A2", False, True, True, False, "allgather"),
        # Graphs without the fused kernels: MC2's torch exchange stays out.
        ("A3", True, False, True, True, "allgather"),
        ("A3", True, False, True, False, "allgather"),
        ("A3", False, False, True, False, "alltoall"),
        ("A2", True, False, True, False, "allgather"),
    ])
def test_selection_table(family, fits, graph_safe, graphs, in_range,
                         method):
    name, reason = moe_comm.select_method(expert_parallel=True,
                                          family=family,
                                          fits_mc2=fits,
                                          mc2_graph_safe=graph_safe,
                                          graphs=graphs,
                                          in_graph_range=in_range)
    assert name == method, reason
    assert moe_comm.select_method(expert_parallel=False, family=family,
                                  fits_mc2=fits, mc2_graph_safe=graph_safe,
                                  graphs=graphs,
                                  in_graph_range=in_range)[0] == "allgather"


def _config(graphs, sizes=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=2,
                                        tensor_parallel_size=1,
                                        enable_expert_parallel=True),
        compilation_config=SimpleNamespace(
            cudagraph_mode=(CUDAGraphMode.FULL_AND_PIECEWISE
                            if graphs else CUDAGraphMode.NONE),
            cudagraph_capture_sizes=sizes),
        model_config=SimpleNamespace(enforce_eager=False),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=1024))


@pytest.mark.parametrize("family,graphs,sizes,tokens,method", [
    ("A3", False, None, 300, "alltoall"),
    ("A3", False, None, 200, "mc2"),
    ("A2", False, None, 300, "allgather"),
    ("A3", True, [512, 256, 8], 300, "allgather"),  # may replay a graph
    ("A3", True, [256, 8], 300, "alltoall"),
    ("A3", True, None, 300, "allgather"),  # sizes unknown: any may replay
])
def test_worker_selection_per_soc(monkeypatch, family, graphs, sizes,
                                  tokens, method):
    """A worker's step choice from its configuration, the SoC and the
    DP-synced batch (capacity 256, the default)."""
    monkeypatch.setattr(moe_comm, "_selection", moe_comm._Selection())
    monkeypatch.delenv(moe_comm.MOE_COMM_ENV, raising=False)
    monkeypatch.delenv(moe_comm.MC2_CAPACITY_ENV, raising=False)
    # The fused kernels' admission is mc2_kernels' (tested there): taken.
    monkeypatch.setattr(mc2_kernels, "create", lambda config, cap: object())
    monkeypatch.setattr(mc2_kernels, "device_family", lambda: family)
    moe_comm.configure(_config(graphs, sizes))
    moe_comm.begin_step()
    monkeypatch.setattr(
        moe_comm.forward_context, "_forward_context",
        SimpleNamespace(dp_metadata=SimpleNamespace(
            max_tokens_across_dp_cpu=torch.tensor(tokens))))
    assert moe_comm.current(1).name == method
