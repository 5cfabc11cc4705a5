"""Which MoE communication method a step uses, and the configurations that
fail at startup."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_ascend import checks
from vllm_ascend.distributed import moe_comm


def _config(dp=2, tp=1, ep=True, graphs=True, tokens=256, **model):
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
    the DP-synced largest batch of the forward context."""

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


@pytest.mark.parametrize("env,config,message", [
    ("nccl", _config(), "is not a MoE communication method"),
    ("mc2", _config(ep=False), "needs --enable-expert-parallel"),
    ("alltoall", _config(dp=1, tp=1), "needs --enable-expert-parallel"),
    ("alltoall", _config(), "cannot run in captured graphs"),
    ("mc2", _config(tokens=2048), "below --max-num-batched-tokens 2048"),
])
def test_forced_method_that_cannot_run(monkeypatch, env, config, message):
    monkeypatch.setenv(moe_comm.MOE_COMM_ENV, env)
    with pytest.raises(ValueError, match=message):
        moe_comm.check_config(config)


def test_forced_methods_that_can_run(monkeypatch):
    for env, config in (("alltoall", _config(graphs=False)),
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
