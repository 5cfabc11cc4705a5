"""What exists before the KV cache is sized (issue 28, S3-13): the EP
group's HCCL communicator MC2 uses, and ATB's workspace. vllm-ascend
v0.11.0 fetches the communicator name in its MC2 dispatcher's
``__init__`` (``token_dispatcher.py:86-91``) and runs one small ATB op
(``worker_v1.py:330-341``); created lazily, at the first MC2 call or the
first step, their memory falls outside the budget the KV cache leaves."""

from types import SimpleNamespace

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="reads the double's communicator and memory state")


def _ep_config():
    """GLM-4.5's MoE on an Atlas A3, DP 2 (EP 2): the fused MC2 kernels
    take it."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            data_parallel_size=2, tensor_parallel_size=1,
            enable_expert_parallel=True, enable_eplb=False,
            expert_placement_strategy="linear"),
        compilation_config=SimpleNamespace(cudagraph_mode=None,
                                           cudagraph_capture_sizes=None),
        model_config=SimpleNamespace(
            enforce_eager=True,
            hf_text_config=SimpleNamespace(n_routed_experts=160,
                                           num_experts_per_tok=8,
                                           hidden_size=5120)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256))


def test_configure_creates_the_ep_communicator(groups, monkeypatch):
    """``moe_comm.configure`` (the worker's init_device, before the memory
    baseline) leaves the EP group with its HCCL communicator."""
    from vllm_ascend import device
    from vllm_ascend.distributed import moe_comm
    from vllm_ascend.distributed.moe_comm import mc2_kernels
    group = groups[0]
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION", "250")
    monkeypatch.delenv(moe_comm.MOE_COMM_ENV, raising=False)
    monkeypatch.setattr(device, "npu_kernels", lambda: True)
    monkeypatch.setattr(mc2_kernels, "get_ep_group", lambda: SimpleNamespace(
        device_group=group, rank_in_group=0, world_size=2))
    monkeypatch.setattr(moe_comm, "_selection", moe_comm._Selection())
    assert group.get_hccl_comm_name(0, init_comm=False) == ""
    moe_comm.configure(_ep_config())
    name = group.get_hccl_comm_name(0, init_comm=False)
    assert name != ""
    kernels = moe_comm._selection.methods["mc2"].kernels
    assert kernels is not None and kernels.comm_name() == name


def test_atb_workspace_is_in_the_memory_baseline(monkeypatch):
    """init_device: MoE communication, then one ATB op, then the memory
    baseline; the double charges the ATB workspace at that first kernel,
    so the baseline the KV sizing subtracts from already holds it."""
    from vllm_ascend.worker import worker as worker_module
    from vllm_ascend.worker.worker import NpuWorker
    with torch_npu_in_process() as tnpu:
        state = tnpu.npu.state
        state.workspace = 0
        events = []
        monkeypatch.setattr(worker_module, "init_worker_distributed_"
                            "environment", lambda *args: None)
        monkeypatch.setattr(worker_module, "set_random_seed",
                            lambda seed: None)
        monkeypatch.setattr(worker_module.moe_comm, "configure",
                            lambda config: events.append("moe_comm"))
        real_warm_up = NpuWorker.warm_up

        def warm_up(self):
            real_warm_up(self)
            events.append(("warm_up", state.workspace))
        monkeypatch.setattr(NpuWorker, "warm_up", warm_up)
        real_record = NpuWorker.record_memory_at_start

        def record(self):
            events.append("baseline")
            real_record(self)
        monkeypatch.setattr(NpuWorker, "record_memory_at_start", record)
        worker = object.__new__(NpuWorker)
        worker.local_rank, worker.rank = 0, 0
        worker.distributed_init_method = ""
        worker.vllm_config = None
        worker.model_config = SimpleNamespace(seed=0)
        worker.model_runner_cls = lambda config, dev: None
        worker.init_device()
        assert events == ["moe_comm", ("warm_up", state.workspace_bytes),
                          "baseline"]
        assert worker.init_non_torch_memory >= state.workspace_bytes
        assert worker.device == torch.device("cpu")
