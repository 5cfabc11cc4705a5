"""Which MoE communication method a step uses, and the configurations that
fail at startup."""

import re
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_ascend import checks
from vllm_ascend.distributed import moe_comm


def _config(dp=2, tp=1, ep=True, graphs=False, tokens=256, **model):
    hf = dict(model_type="glm4_moe", num_attention_heads=4,
              num_key_value_heads=2, n_routed_experts=8,
              moe_intermediate_size=64, intermediate_size=256,
              first_k_dense_replace=1)
    hf.update(model)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp,
                                        tensor_parallel_size=tp,
                                        enable_expert_parallel=ep),
        compilation_config=SimpleNamespace(
            cudagraph_mode=(CUDAGraphMode.FULL_AND_PIECEWISE
                            if graphs else CUDAGraphMode.NONE)),
        model_config=SimpleNamespace(enforce_eager=False, hf_text_config=hf),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens))


@pytest.fixture
def step(monkeypatch):
    """Choose as a worker does: configure, then one step at a time, with
    the DP-synced largest batch of the forward context. The worker's
    selection is the module's; a fresh one here, put back afterwards."""
    monkeypatch.setattr(moe_comm, "_selection", moe_comm._Selection())

    def run(config, max_tokens, env=None):
        monkeypatch.delenv(moe_comm.MOE_COMM_ENV, raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        moe_comm.configure(config)
        moe_comm.begin_step()
        context = SimpleNamespace(dp_metadata=SimpleNamespace(
            max_tokens_across_dp_cpu=torch.tensor(max_tokens)))
        monkeypatch.setattr(moe_comm.forward_context, "_forward_context",
                            context)
        return moe_comm.current(1).name

    return run


def test_default_choice(step):
    assert step(_config(ep=False), 4) == "allgather"
    assert step(_config(), 256) == "mc2"
    assert step(_config(), 257) == "allgather"
    assert step(_config(), 300, {moe_comm.MC2_CAPACITY_ENV: "512"}) == "mc2"
    assert step(_config(), 4, {moe_comm.MOE_COMM_ENV: "alltoall"}) == (
        "alltoall")


def test_one_method_per_step(step, monkeypatch):
    """The draft after the target (a different batch) keeps the target's
    method; the next step chooses again."""
    assert step(_config(), 8) == "mc2"
    big = SimpleNamespace(dp_metadata=SimpleNamespace(
        max_tokens_across_dp_cpu=torch.tensor(1000)))
    monkeypatch.setattr(moe_comm.forward_context, "_forward_context", big)
    assert moe_comm.current(1000).name == "mc2"
    moe_comm.begin_step()
    assert moe_comm.current(1000).name == "allgather"


def test_mc2_torch_exchange_stays_out_of_npu_graphs(step, monkeypatch):
    """On an NPU whose fused MC2 kernels do not take the configuration, MC2
    runs HCCL all_to_all_single, which no proven ACL graph captures
    (vllm-ascend runs all-to-all only eagerly): graph mode uses all-gather
    at every batch size, eager mode MC2, and MC2 forced in graph mode fails
    at startup. With the kernels MC2 runs in graphs."""
    assert step(_config(graphs=True), 8) == "allgather"
    assert step(_config(), 8) == "mc2"
    assert step(_config(), 300) == "allgather"
    with pytest.raises(ValueError, match="MOE_COMM=mc2: the fused MC2 "
                       "kernels do not take this configuration"):
        step(_config(graphs=True), 8, {moe_comm.MOE_COMM_ENV: "mc2"})
    assert step(_config(), 8,
                {moe_comm.MOE_COMM_ENV: "mc2"}) == "mc2"
    assert moe_comm.MC2MoEComm(256, object()).graph_safe
    assert not moe_comm.MC2MoEComm(256, None).graph_safe


@pytest.mark.parametrize("env,config,message", [
    ("nccl", _config(), "is not a MoE communication method"),
    ("mc2", _config(ep=False), "needs --enable-expert-parallel"),
    ("alltoall", _config(dp=1, tp=1), "needs --enable-expert-parallel"),
    ("alltoall", _config(graphs=True), "cannot run in captured graphs"),
    ("mc2", _config(tokens=2048), "below --max-num-batched-tokens 2048"),
])
def test_forced_method_that_cannot_run(monkeypatch, env, config, message):
    monkeypatch.setenv(moe_comm.MOE_COMM_ENV, env)
    with pytest.raises(ValueError, match=message):
        moe_comm.check_config(config)


def test_forced_methods_that_can_run(monkeypatch):
    for env, config in (("alltoall", _config()),
                        ("mc2", _config()), ("allgather", _config(ep=False))):
        monkeypatch.setenv(moe_comm.MOE_COMM_ENV, env)
        moe_comm.check_config(config)
    monkeypatch.setenv(moe_comm.MC2_CAPACITY_ENV, "0")
    with pytest.raises(ValueError, match="must be a positive integer"):
        moe_comm.check_config(_config())


@pytest.mark.parametrize("config,message", [
    (_config(tp=2, num_key_value_heads=3), "cannot split the model's 3 KV"),
    (_config(tp=4, num_key_value_heads=2, dp=1), None),
    (_config(tp=2, moe_intermediate_size=65), "moe_intermediate_size 65"),
    (_config(tp=2, intermediate_size=255), "intermediate_size 255"),
    (_config(tp=2, intermediate_size=255, first_k_dense_replace=0), None),
    (_config(dp=4, tp=4, n_routed_experts=8), "at least one routed expert"),
    (_config(dp=4, tp=4, n_routed_experts=8, ep=False), None),
])
def test_parallel_layout(config, message):
    if message is None:
        checks.check_parallel_layout(config)
    else:
        with pytest.raises(ValueError, match=message):
            checks.check_parallel_layout(config)


def test_sequence_parallelism_refused():
    """Root cause of the all-gather EP + MTP shape errors: with sequence
    parallelism the draft's embedding is reduce-scattered to N/TP rows
    while its hidden states stay N. vllm_ascend runs no such pass: asking
    for it fails at startup instead of being ignored."""
    config = _config(tp=2)
    config.compilation_config.pass_config = SimpleNamespace(
        enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="sequence parallelism"):
        checks.check_parallel_layout(config)
    config.compilation_config.pass_config.enable_sequence_parallelism = False
    checks.check_parallel_layout(config)


def _kernel_config(dp=2, tp=8, experts=160, top_k=8, hidden=5120,
                   eplb=False, placement="linear"):
    """GLM-4.5's MoE by default, as the report serves it (DP 2 x TP 8)."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            data_parallel_size=dp, tensor_parallel_size=tp,
            enable_eplb=eplb, expert_placement_strategy=placement),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(
            n_routed_experts=experts, num_experts_per_tok=top_k,
            hidden_size=hidden)))


@pytest.mark.parametrize("family,changes,reason", [
    ("A2", {}, None),
    ("A3", {}, None),
    (None, {}, "neither Atlas A2 nor A3"),
    # EP 12: not a size the A2 fullmesh kernels take; A3 takes it.
    ("A2", dict(dp=3, tp=4, experts=192), "EP size 12 is not one of"),
    ("A3", dict(dp=3, tp=4, experts=192), None),
    ("A2", dict(experts=100), "divisible by the EP size 16"),
    ("A2", dict(top_k=17, experts=176), "top-k 17"),
    ("A2", dict(hidden=5000), "hidden size 5000 is not a multiple of 32"),
    ("A3", dict(hidden=64), r"outside \[1024, 8192\]"),
    ("A2", dict(hidden=64, dp=2, tp=1, experts=4, top_k=2),
     "EP size 2 is not one of"),
    ("A2", dict(eplb=True), "EPLB"),
    ("A2", dict(placement="round_robin"), "round_robin"),
])
def test_fused_mc2_kernel_limits(family, changes, reason):
    """The fused MC2 kernels' documented limits (op-plugin's
    dispatch_v2/combine_v2 pages): outside them MC2 runs the torch
    exchange, and the reason is logged."""
    from vllm_ascend.distributed.moe_comm import mc2_kernels
    got = mc2_kernels.unsupported_reason(_kernel_config(**changes), 256,
                                         family)
    if reason is None:
        assert got is None
    else:
        assert got is not None and re.search(reason, got), got


def test_fused_mc2_tokens_per_rank():
    from vllm_ascend.distributed.moe_comm import mc2_kernels

    # Each TP rank sends its share: capacity / TP rows per EP rank.
    assert mc2_kernels.max_tokens_per_rank(256, 8) == 32
    assert mc2_kernels.max_tokens_per_rank(5, 2) == 3
    config = _kernel_config(tp=1, dp=16)
    assert mc2_kernels.unsupported_reason(config, 256, "A2") is None
    assert "exceed the kernels' 256" in mc2_kernels.unsupported_reason(
        config, 257, "A2")
    assert mc2_kernels.unsupported_reason(config, 512, "A3") is None
