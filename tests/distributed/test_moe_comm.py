"""The MoE communication methods give every token the single-process MoE
output, under DP x TP with expert parallelism, on gloo.

Each rank builds the same random experts, holds its EP share of them, and
runs what FusedMoE.forward_impl runs around them: the communicator's
dispatch, routing, the method's expert exchange, combine, and the TP
all-reduce of the model. DP ranks hold different numbers of tokens (one
rank a single token, as an idle rank's dummy batch).
"""

import multiprocessing
import os

import pytest
import torch

from vllm_ascend.distributed.moe_comm import METHODS, MOE_COMM_ENV

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


def _experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 4,
            torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 4)


def _tokens(dp_rank: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    return (torch.randn(count, HIDDEN, generator=g),
            torch.randn(count, EXPERTS, generator=g))


def _route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    return weights, ids.to(torch.int32)


class _Refused(Exception):
    """The dispatch refused the rows before any exchange."""


def _no_broadcast(*args, **kwargs):
    raise AssertionError("a MoE exchange broadcast")


def _worker(rank: int, port: int, dp: int, tp: int, counts: list[int],
            methods: list[str], queue, rows: list[int] | None = None,
            sequence_parallel: bool = False) -> None:
    """Each method in turn, in one distributed session. ``rows``: what
    each DP rank runs, when it differs from ``counts``, the counts its
    forward context synced (a dispatch that must fail). With
    ``sequence_parallel`` each TP rank holds its chunk of its DP rank's
    tokens (as a sequence-parallel MoE layer does) and no TP all-reduce
    follows."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import get_ep_group, tensor_model_parallel_all_reduce
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment, destroy_model_parallel,
        init_distributed_environment, initialize_model_parallel)
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.layer import determine_expert_map

    from vllm_ascend.distributed import moe_comm
    from vllm_ascend.distributed.communicator import AscendCommunicator
    from vllm_ascend.ops.moe.experts import moe_experts_ref
    results: dict[str, str | None] = {}
    try:
        init_distributed_environment(
            world_size=dp * tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo")
        dp_rank = rank // tp
        config = VllmConfig(parallel_config=ParallelConfig(
            data_parallel_size=dp,
            data_parallel_rank=dp_rank,
            tensor_parallel_size=tp,
            enable_expert_parallel=True))
        with set_current_vllm_config(config):
            initialize_model_parallel(tp, 1)
            ep = get_ep_group()
            assert isinstance(ep.device_communicator, AscendCommunicator)
            w13, w2 = _experts()
            _, expert_map = determine_expert_map(ep.world_size,
                                                 ep.rank_in_group, EXPERTS)
            mine = expert_map >= 0
            layer = torch.nn.Module()

            def compute(x, weights, ids, expert_map):
                return moe_experts_ref(x, w13[mine], w2[mine], weights, ids,
                                       expert_map=expert_map)

            x, logits = _tokens(dp_rank, (rows or counts)[dp_rank])
            want = moe_experts_ref(x, w13, w2, *_route(logits))
            if sequence_parallel:
                layer.is_sequence_parallel = True
                chunk = -(-x.shape[0] // tp)
                mine_rows = slice((rank % tp) * chunk, (rank % tp + 1) * chunk)
                x, logits, want = (x[mine_rows], logits[mine_rows],
                                   want[mine_rows])
            # No exchange broadcasts: no proven ACL graph captures an HCCL
            # broadcast (vLLM's naive multicast).
            torch.distributed.broadcast = _no_broadcast
            for method in methods:
                os.environ[MOE_COMM_ENV] = method
                moe_comm.configure(config)
                try:
                    with set_forward_context(
                            None,
                            config,
                            num_tokens=counts[dp_rank],
                            num_tokens_across_dp=torch.tensor(counts)):
                        moe_comm.begin_step()
                        chosen = moe_comm.current(x.shape[0])
                        assert chosen.name == method, chosen.name
                        try:
                            hidden, router_logits = ep.dispatch(
                                x, logits, sequence_parallel)
                        except RuntimeError as e:
                            raise _Refused(str(e)) from e
                        weights, ids = _route(router_logits)
                        y = chosen.experts(layer, hidden, weights, ids,
                                           expert_map, compute, False)
                        y = ep.combine(y, sequence_parallel)
                        if tp > 1 and not sequence_parallel:
                            y = tensor_model_parallel_all_reduce(y)
                    torch.testing.assert_close(y, want, rtol=1e-5,
                                               atol=1e-5)
                    results[method] = None
                except _Refused as e:
                    results[method] = f"refused: {e}"
                except AssertionError as e:
                    # After the exchange: every rank goes on to the next.
                    results[method] = repr(e)[-1500:]
        queue.put((rank, results))
    except Exception as e:  # reported by the test, not lost in a child
        queue.put((rank, {**results, "error": repr(e)[-1500:]}))
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def _run(dp: int, tp: int, counts: list[int], methods: list[str],
         rows: list[int] | None = None,
         sequence_parallel: bool = False) -> dict:
    from vllm.utils import get_open_port

    # Spawned: a fork of a test process whose torch threads have run may
    # hang in them.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_worker,
                    args=(rank, port, dp, tp, counts, methods, queue, rows,
                          sequence_parallel))
        for rank in range(dp * tp)
    ]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    return results


def test_methods_give_single_process_output():
    """DP 2 x TP 2, EP over the four ranks; DP rank 0 holds one token."""
    dp, tp = 2, 2
    results = _run(dp, tp, [1, 6], list(METHODS))
    assert results == {rank: dict.fromkeys(METHODS)
                       for rank in range(dp * tp)}, results


@pytest.mark.heavy  # make nightly: CI time
def test_methods_under_sequence_parallel_moe():
    """A sequence-parallel MoE layer (vLLM's DeepSeek-V2 under DP x TP with
    EP; not GLM-4.5): each TP rank sends all of its own tokens; sending a
    share of them would lose the rest, as no TP all-reduce follows. The
    all-gather method gathers over the EP group, each rank's chunk."""
    dp, tp = 2, 2
    methods = list(METHODS)
    results = _run(dp, tp, [2, 6], methods, sequence_parallel=True)
    assert results == {rank: dict.fromkeys(methods)
                       for rank in range(dp * tp)}, results


def test_dispatch_refuses_rows_other_than_the_synced_count():
    """Root causes of the all-gather EP + MTP shape errors: a draft whose
    forward context synced another count than the rows it runs (its
    synced vs real length, padding added after the sync) fails before any
    exchange, in one line naming both."""
    results = _run(2, 1, [3, 5], ["allgather"], rows=[2, 4])
    results = {rank: r.get("allgather", r) for rank, r in results.items()}
    assert results[0].startswith(
        "refused: MoE dispatch on DP rank 0: 2 token rows, but the forward "
        "context synced 3 for this rank"), results
    assert results[1].startswith(
        "refused: MoE dispatch on DP rank 1: 4 token rows, but the forward "
        "context synced 5 for this rank"), results
