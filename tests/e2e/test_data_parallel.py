"""Data parallelism (DP=2, also x TP=2) with GLM-4.5 MTP: same greedy text
as DP=1.

Two DP ranks on the CPU reference device (gloo), the trained fixture, with
and without expert parallelism. The MoE layers of both ranks run together
(dispatch and combine across ranks), so every step is collective: a rank
whose requests are done runs dummy batches (target and k draft steps), and
a rank whose request reaches max_model_len skips its draft while the other
drafts. Each case once hung or decoded another request's tokens.
"""

import random
from pathlib import Path

import pytest

from tests.utils.dp_engine import run_dp_engine
from tests.utils.engine import run_engines

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-glm45"
MAX_MODEL_LEN = 64
ENGINE = dict(model=str(FIXTURE), skip_tokenizer_init=True, dtype="float32",
              max_model_len=MAX_MODEL_LEN, max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=64 << 20)

_rng = random.Random(7)
PROMPTS = [[_rng.randrange(1, 600) for _ in range(n)]
           for n in (5, 17, 9, 30, 50, 4)]
# Different lengths: one rank runs out of requests first and idles.
MAX_TOKENS = [24, 6, 10, 20, 20, 40]


def _sampling(indices: list[int]) -> list[dict]:
    return [dict(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
            for i in indices]


ACCEPTANCE = ("vllm:spec_decode_num_drafts",
              "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens")

ALL = tuple(range(len(PROMPTS)))
# TP 2 alone: one DP rank serves every request.
TP2_PER_RANK = [list(ALL)]
# Uneven: rank 1 idles while rank 0 decodes. The tests below share these
# requests (and so the single-process references of their acceptance).
DP_TP_PER_RANK = [[0, 3], [2]]
# (k, expert_parallel, per_rank) of test_dp2_mtp_outputs_equal_dp1.
# k = 2 with EP on uneven ranks runs in CI on the NPU code paths
# (tests/npu/test_npu_engine.py, dp2-ep-k2), here in `make nightly`.
DP2_CASES = [pytest.param(2, True, [[2], [0, 3]], marks=pytest.mark.heavy),
             (1, True, [[0, 3], []]), (2, False, [[4], [0, 3]])]


def _speculative(k: int) -> dict:
    return dict(method="glm4_moe_mtp", num_speculative_tokens=k)


def _job(indices: tuple[int, ...], k: int = 0) -> dict:
    engine = dict(ENGINE, speculative_config=_speculative(k)) if k else ENGINE
    return dict(engine=engine, prompts=[PROMPTS[i] for i in indices],
                sampling=_sampling(list(indices)))


def _mtp_run(item: pytest.Item) -> tuple[int, list[list[int]]] | None:
    """(k, per_rank) of a test below."""
    params = getattr(item, "callspec", None)
    if params is None or "k" not in params.params:
        return None
    k = params.params["k"]
    per_rank = params.params.get("per_rank")
    if per_rank is None:
        per_rank = (TP2_PER_RANK if item.originalname
                    == "test_tp2_mtp_outputs_equal_dp1" else DP_TP_PER_RANK)
    return k, per_rank


@pytest.fixture(scope="module")
def references(request) -> dict:
    """One process each, two at a time: ``"baseline"`` (all requests, no
    MTP) and, per ``(k, requests)`` of a busy rank of a selected test, the
    outputs and spec-decode counters with MTP k."""
    runs = [_mtp_run(item) for item in request.session.items
            if item.module is request.module]
    keys = dict.fromkeys((k, tuple(indices)) for k, per_rank in filter(
        None, runs) for indices in per_rank if indices)
    jobs = {"baseline": _job(ALL),
            **{key: _job(key[1], key[0]) for key in keys}}
    results = run_engines(jobs)
    for key, result in results.items():
        if isinstance(result, AssertionError):
            raise AssertionError(f"{key}: {result}")
    return results


@pytest.fixture(scope="module")
def baseline(references) -> list[list[int]]:
    """DP=1, no MTP."""
    return references["baseline"]["outputs"]


def _run(per_rank: list[list[int]], k: int, expert_parallel: bool,
         tp: int = 1, env: dict | None = None, **engine_args):
    engine = dict(ENGINE, enable_expert_parallel=expert_parallel,
                  tensor_parallel_size=tp,
                  speculative_config=_speculative(k), **engine_args)
    return run_dp_engine(
        engine, [[PROMPTS[i] for i in indices] for indices in per_rank],
        [_sampling(indices) for indices in per_rank], env=env,
        timeout=150 * tp)


def _check_acceptance(references: dict, outs: list[dict],
                      per_rank: list[list[int]], k: int) -> None:
    """Each rank's spec-decode counters are those of one process serving
    the same requests. (Not those of one process serving all of them: the
    batch sizes differ, and with them the float rounding of the draft's
    logits, so a near-tie in a later draft position may flip. At k=2 one
    of 64 accepted tokens did.)"""
    for rank, (out, indices) in enumerate(zip(outs, per_rank)):
        if not indices:
            continue  # An idle rank drafts nothing: _check.
        expected = references[(k, tuple(indices))]["metrics"]
        for name in ACCEPTANCE:
            assert out["metrics"][name] == expected[name], (rank, name)


def _check(outs, per_rank, baseline, k):
    for rank, (indices, out) in enumerate(zip(per_rank, outs)):
        assert out["outputs"] == [baseline[i] for i in indices], rank
        drafts = out["metrics"].get("vllm:spec_decode_num_drafts", 0)
        if indices:
            # Drafts were proposed and verified on every busy rank.
            assert drafts > 0, (rank, out["metrics"])
            assert out["metrics"]["vllm:spec_decode_num_draft_tokens"] <= (
                k * drafts)
        else:
            assert drafts == 0, (rank, out["metrics"])


@pytest.mark.parametrize("k,expert_parallel,per_rank", DP2_CASES,
                         ids=["k2-ep-uneven", "k1-ep-idle-rank",
                              "k2-tp-max-model-len"])
def test_dp2_mtp_outputs_equal_dp1(references, baseline, k, expert_parallel,
                                   per_rank):
    outs = _run(per_rank, k, expert_parallel)
    _check(outs, per_rank, baseline, k)
    _check_acceptance(references, outs, per_rank, k)


# k = 1 in `make nightly`; EP (MC2) runs in CI as DP 2 + EP through the
# double's fused kernels (tests/npu/test_npu_engine.py).
@pytest.mark.parametrize("k,expert_parallel", [
    pytest.param(1, False, marks=pytest.mark.heavy),
    (2, False),
    pytest.param(1, True, marks=pytest.mark.heavy),
], ids=["k1", "k2", "k1-ep"])
def test_dp2_tp2_mtp_outputs_equal_dp1(references, baseline, k,
                                       expert_parallel):
    """DP 2 x TP 2 (4 processes) in the default graph mode. Without expert
    parallelism (the all-gather MoE method) it once answered every prompt
    with wrong text and no error: the naive all2all gathered DP rank 1's
    tokens from the wrong rank and summed the TP partials twice (patch
    0009), and graph replays read TP all-reduces before gloo finished them.
    With expert parallelism each TP rank sends its share of the tokens
    (MC2). ``vllm serve`` runs it with EP at k = 2
    (tests/server/test_parallel_server.py). Each rank's acceptance is that
    of one process serving its requests."""
    outs = _run(DP_TP_PER_RANK, k, expert_parallel, tp=2)
    _check(outs, DP_TP_PER_RANK, baseline, k)
    _check_acceptance(references, outs, DP_TP_PER_RANK, k)


# Forced, both run in CI through the double (tests/npu/test_npu_engine.py).
@pytest.mark.parametrize("method,k", [
    pytest.param("allgather", 2, marks=pytest.mark.heavy),
    pytest.param("alltoall", 1, marks=pytest.mark.heavy),
    pytest.param("alltoall", 2, marks=pytest.mark.heavy),
])
def test_dp2_ep_moe_methods_equal_dp1(references, baseline, method, k):
    """Each MoE communication method forced with EP (MC2, the default with
    EP, and all-gather, the default without, run in the tests above): DP=1
    outputs, and each rank's acceptance is that of one process serving its
    requests. All-to-all reads its counts on the host, so it runs eager."""
    outs = _run(DP_TP_PER_RANK, k, True,
                env={"VLLM_ASCEND_MOE_COMM": method},
                enforce_eager=method == "alltoall")
    _check(outs, DP_TP_PER_RANK, baseline, k)
    _check_acceptance(references, outs, DP_TP_PER_RANK, k)


# TP 2 runs in CI with DP 2 (above).
@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.heavy)
                               for k in (1, 2)])
def test_tp2_mtp_outputs_equal_dp1(references, baseline, k):
    """TP 2 alone (attention heads, MLP, experts and the vocabulary split;
    the draft on the target's embedding and head shards)."""
    outs = _run(TP2_PER_RANK, k, False, tp=2)
    _check(outs, TP2_PER_RANK, baseline, k)
    _check_acceptance(references, outs, TP2_PER_RANK, k)
