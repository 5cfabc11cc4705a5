"""GLM-4.5 through the plugin's NPU code paths (the torch_npu double here).

The engines take every NPU branch: platform configuration (graph mode by
default, capture sizes, bfloat16), the worker's memory profiling and KV
sizing, the runner's streams, the fused attention, the MoE kernels with and
without expert parallelism, and the hccl backend. Outputs are compared with
the CPU reference device in the same dtype (bfloat16: the NPU kernels take
no float32), and MTP outputs with the outputs without MTP.
"""

import random

import pytest

from tests.utils.checkpoints import write_random_glm45
from tests.utils.dp_engine import run_dp_engine
from tests.utils.engine import run_engine
from tests.utils.npu import (NPU_ENV, REAL_NPU, assert_equal_up_to_near_tie,
                             trace_path)

TRACE_ENV = "VLLM_ASCEND_NPU_DOUBLE_TRACE"

pytestmark = pytest.mark.npu

MAX_NEW = 16
MAX_MODEL_LEN = 256
# The report's capture sizes; GLM-4.5's head_dim (the fused attention's TND
# layout takes 128 or 192).
CAPTURE_SIZES = [1, 4, 8, 16, 32, 48, 64]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_random_glm45(tmp_path_factory.mktemp("glm45-h128"),
                              head_dim=128, seed=1)
    rng = random.Random(5)
    # Short prompts, two that cross a 128-token block while decoding (with
    # a small KV pool they preempt each other), one that reaches
    # max_model_len.
    lengths = [rng.randrange(1, 40) for _ in range(5)] + [120, 122, 242]
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]
    engine = dict(model=str(path), skip_tokenizer_init=True,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0,
                  kv_cache_memory_bytes=64 << 20,
                  compilation_config={"cudagraph_capture_sizes":
                                      CAPTURE_SIZES})
    sampling = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    reference = run_engine(dict(engine, dtype="bfloat16"), prompts,
                           dict(sampling, logprobs=2))
    return engine, prompts, sampling, reference


@pytest.fixture(scope="module")
def setup_a3(tmp_path_factory, setup):
    """``setup`` with a hidden size of 1024, for the fused MC2 kernels on
    an Atlas A3 (op-plugin 7.2.0 takes H in [1024, 8192] there; an A2
    takes EP 16 and up only)."""
    engine, prompts, sampling, _ = setup
    path = write_random_glm45(tmp_path_factory.mktemp("glm45-h1024"),
                              head_dim=128, seed=1, hidden_size=1024)
    # Two sizes to capture (multiples of 1 + k = 3; the ranks' batches
    # decode at 3 to 9 tokens); the reference eager (graph modes equal eager:
    # tests/compilation).
    engine = dict(engine, model=str(path),
                  compilation_config={"cudagraph_capture_sizes": [3, 9]})
    reference = run_engine(dict(engine, dtype="bfloat16", enforce_eager=True),
                           prompts, dict(sampling, logprobs=2))
    return engine, prompts, sampling, reference


def _npu(setup, inspect=False, env=None, **changes):
    engine, prompts, sampling, _ = setup
    return run_engine(dict(engine, **changes), prompts, sampling,
                      env={**NPU_ENV, **(env or {})}, inspect=inspect)


@pytest.fixture(scope="module")
def graph_mode_run(setup):
    return _npu(setup, inspect=True)


# The speculation watchdog set to pause at its first window (a floor no
# draft reaches) and to probe every few steps: speculation switches off
# and on while the batch decodes.
SWITCHING = dict(fallback_acceptance_floor=0.99, fallback_window=4,
                 fallback_probe_interval=3)


def _check_reference(got, setup):
    ref = setup[3]
    assert_equal_up_to_near_tie(got["outputs"], ref["outputs"],
                                ref["logprobs"])


def test_npu_paths_equal_reference_device(setup, graph_mode_run):
    _check_reference(graph_mode_run, setup)
    info = graph_mode_run["inspect"]
    # The NPU configuration path: vLLM's capture sizes, custom ops on
    # (inductor off), vLLM's default graph mode (FULL_AND_PIECEWISE),
    # captured with the double's torch.npu.NPUGraph (the emulator) for
    # every size and replayed while decoding.
    assert info["capture_sizes"] == sorted(CAPTURE_SIZES, reverse=True)
    assert info["use_inductor"] is False and info["custom_rms_norm"] is True
    assert info["compilation_level"] == 3
    assert info["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    captured = {int(key.rsplit(":", 1)[1])
                for key in info["graphs"]["captured"]}
    assert captured == set(CAPTURE_SIZES)
    assert info["graphs"]["replayed"]
    assert info["device"] == "cpu"  # the double's tensors


@pytest.mark.heavy  # make nightly: CI time
def test_async_scheduling_on_npu(setup, graph_mode_run):
    # vLLM runs async scheduling with an engine-core process only.
    got = _npu(setup, inspect=True, async_scheduling=True,
               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    assert got["inspect"]["async_scheduling"] is True
    assert got["outputs"] == graph_mode_run["outputs"]


@pytest.mark.parametrize("k,mode", [
    # make nightly: FULL_DECODE_ONLY at k = 1 runs in CI in
    # tests/compilation/test_graph_modes.py.
    pytest.param(1, dict(enable_chunked_prefill=True,
                         max_num_batched_tokens=48,
                         compilation_config={
                             "cudagraph_mode": "FULL_DECODE_ONLY",
                             "cudagraph_capture_sizes": CAPTURE_SIZES}),
                 marks=pytest.mark.heavy),
    (2, dict(num_gpu_blocks_override=3)),
    (3, dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
             num_gpu_blocks_override=3)),
], ids=["k1-chunked", "k2-preempted", "k3-chunked-preempted-switching"])
def test_mtp_outputs_equal_no_mtp(setup, graph_mode_run, k, mode):
    # k = 1 and 2: the draft length chosen per step (0 to k tokens, the
    # verify batches in and out of the captured sizes); k = 3: the watchdog
    # switching.
    spec = dict(method="glm4_moe_mtp", num_speculative_tokens=k,
                adaptive_draft_length=k < 3, **(SWITCHING if k == 3 else {}))
    got = _npu(setup, inspect=True, speculative_config=spec, **mode)
    assert got["outputs"] == graph_mode_run["outputs"]
    metrics = got["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    if k == 3:
        assert metrics["vllm:spec_decode_num_pauses"] == 1, metrics
    if k == 2:
        # Some steps drafted 1 token.
        assert metrics["vllm:spec_decode_num_draft_tokens"] < (
            2 * metrics["vllm:spec_decode_num_drafts"]), metrics
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    if "num_gpu_blocks_override" in mode:
        assert metrics["vllm:num_preemptions"] > 0, metrics
    # Capture sizes rounded to multiples of 1 + k.
    assert all(s % (1 + k) == 0 for s in got["inspect"]["capture_sizes"])
    assert got["inspect"]["draft_embed_ptr"] == got["inspect"][
        "target_embed_ptr"]
    if "compilation_config" in mode:
        # Verify batches and draft steps replayed full graphs: the fused
        # attention's .out launches updated through the double's
        # task-update contract.
        graphs = got["inspect"]["graphs"]
        for role in ("target", "draft"):
            assert any(key.startswith(f"{role}:FULL:")
                       for key in graphs["replayed"]), graphs


# Where each MoE communication method's exchange reaches the NPU (the
# double's trace: plugin call site and op or HCCL collective).
METHOD_SITES = {
    "mc2": [("moe_comm/mc2_kernels.py:",
             "torch_npu.npu_moe_distribute_dispatch_v2"),
            ("moe_comm/mc2_kernels.py:",
             "torch_npu.npu_moe_distribute_combine_v2")],
    "alltoall": [("moe_comm/all_to_all.py:", "hccl.alltoall_base")],
    "allgather": [("moe_comm/all_gather.py:", "hccl._allgather_base"),
                  ("moe_comm/all_gather.py:", "hccl._reduce_scatter_base")],
}


def _reached(trace: str, sites: list[tuple[str, str]]) -> bool:
    lines = trace.splitlines()
    return all(any(f in line and line.endswith(":" + op) for line in lines)
               for f, op in sites)


@pytest.mark.parametrize("tp,k,ep,method,per_rank,a3", [
    pytest.param(2, 2, True, None, [[0, 1, 2], [3]], True,
                 marks=pytest.mark.heavy),
    (1, 2, True, None, [[0, 1, 2], [3]], True),
    # All-gather: every method equals one process at the MoE layer in CI
    # (tests/distributed/test_moe_comm.py); the engine run in make nightly.
    pytest.param(1, 2, True, "allgather", [[0, 4], [1, 2, 3]], False,
                 marks=pytest.mark.heavy),
    (1, 1, True, "alltoall", [[3], [0, 1, 2]], False),
    pytest.param(1, 2, False, None, [[1], [0, 2, 3]], False,
                 marks=pytest.mark.heavy),
], ids=["dp2xtp2-ep-k2", "dp2-ep-k2", "dp2-ep-allgather-k2",
        "dp2-ep-alltoall-k1-eager", "dp2-k2"])
def test_parallel_mtp_equals_reference(request, setup, tmp_path, tp, k, ep,
                                       method, per_rank, a3):
    """DP=2 (also x TP=2: 4 processes, in `make nightly`) with MTP, with
    and without expert parallelism, each MoE communication method over
    hccl. With expert parallelism MC2 is the default: the fused
    dispatch/combine kernels (as an Atlas A3: op-plugin 7.2.0's A2 kernels
    take EP 16 and up), each TP rank sending its share of the tokens (a TP
    rank without one sends a token whose result it drops: the kernels take
    no empty batch). All-to-all reads its
    counts on the host, so it runs eager. The ranks sum expert outputs in
    another order than one rank does, so the comparison with the one-rank
    reference stops at the first near-tie."""
    engine, prompts, sampling, reference = (
        request.getfixturevalue("setup_a3") if a3 else setup)
    # Each rank's watchdog pauses and probes, and (with MC2) its draft length
    # policy chooses, on its own schedule: a rank that skips its draft joins
    # the other's draft collectives, and every rank drafts the configured
    # length (its scheduler keeps what it chose). A rank whose policy chose
    # no draft for its few steps may finish before a window of drafts.
    adaptive = method is None
    engine = dict(engine, enable_expert_parallel=ep,
                  tensor_parallel_size=tp,
                  enforce_eager=method == "alltoall",
                  speculative_config=dict(method="glm4_moe_mtp",
                                          num_speculative_tokens=k,
                                          adaptive_draft_length=adaptive,
                                          **SWITCHING))
    env = {**NPU_ENV, TRACE_ENV: str(tmp_path / "trace.txt")}
    if a3:
        env["VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION"] = "250"
    if method:
        env["VLLM_ASCEND_MOE_COMM"] = method
    outs = run_dp_engine(engine, [[prompts[i] for i in r] for r in per_rank],
                         [sampling] * len(per_rank), env=env,
                         timeout=240 * tp)
    for indices, out in zip(per_rank, outs):
        assert_equal_up_to_near_tie(
            out["outputs"], [reference["outputs"][i] for i in indices],
            [reference["logprobs"][i] for i in indices])
        assert out["metrics"]["vllm:spec_decode_num_drafts"] > 0
    pauses = [out["metrics"]["vllm:spec_decode_num_pauses"] for out in outs]
    assert max(pauses) == 1 and (adaptive or min(pauses) == 1), pauses
    if REAL_NPU:
        return
    trace = (tmp_path / "trace.txt").read_text()
    if tp > 1:
        assert "hccl.allreduce" in trace
    # The methods that exchanged tokens: the forced one only; by default
    # with EP, MC2 (and for batches above its capacity all-to-all on an
    # Atlas A3, all-gather on an A2); without EP, all-gather across DP
    # ranks; with one DP rank, none.
    if method:
        required = allowed = {method}
    elif ep:
        required = {"mc2"}
        allowed = {"mc2", "alltoall" if a3 else "allgather"}
    else:
        required = allowed = {"allgather"} if len(per_rank) > 1 else set()
    reached = {name for name, sites in METHOD_SITES.items()
               if _reached(trace, sites)}
    assert required <= reached <= allowed, reached
    # The session's record of NPU call sites (test_npu_call_sites).
    with open(trace_path(), "a") as f:
        f.write(trace)
