"""The double's ``hccl`` process group checks HCCL's contract.

Two ranks in one process (threads over one store). Each case first makes
the valid call on both ranks (gloo computes it), then breaks one argument
on one rank: the call fails before anything is sent, as ProcessGroupHCCL
fails in its argument checks.
"""

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from tests.utils.npu import REAL_NPU
from tests.utils.npu import on_both_ranks as _both

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="checks the double; a real NPU has the real contracts")


def _opts(cls, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


ALLREDUCE = dist.AllreduceOptions


def test_allreduce(groups):
    def valid(group, rank):
        t = torch.full((2, 3), rank + 1, dtype=torch.bfloat16)
        group.allreduce([t], ALLREDUCE()).wait()
        b = torch.tensor([rank == 0, False])
        group.allreduce([b], _opts(ALLREDUCE,
                                   reduceOp=dist.ReduceOp.MAX)).wait()
        return t, b

    for t, b in _both(groups, valid):
        assert torch.equal(t, torch.full((2, 3), 3, dtype=torch.bfloat16))
        assert b.tolist() == [True, False]  # bool: cast to int32 first
    group = groups[0]
    with pytest.raises(RuntimeError, match="Tensors must be contiguous"):
        group.allreduce([torch.ones(3, 2).t()], ALLREDUCE())
    with pytest.raises(RuntimeError, match="HCCL allreduce: Unsupported data "
                       "type at::kDouble"):
        group.allreduce([torch.ones(2, dtype=torch.float64)], ALLREDUCE())
    with pytest.raises(RuntimeError,
                       match="Cannot use ReduceOp.BAND with HCCL"):
        group.allreduce([torch.ones(2, dtype=torch.int32)],
                        _opts(ALLREDUCE, reduceOp=dist.ReduceOp.BAND))
    with pytest.raises(RuntimeError, match="Unsupported data type for HCCL"):
        group.allreduce([torch.ones(2, dtype=torch.complex64)], ALLREDUCE())
    with pytest.raises(RuntimeError, match="larger than the number of"):
        group.allreduce([torch.ones(2), torch.ones(2)], ALLREDUCE())


def test_all_gather_into_tensor(groups):
    def valid(group, rank):
        out = torch.empty(4, dtype=torch.int64)
        group._allgather_base(out, torch.tensor([rank, 10 + rank]),
                              AllgatherOptions()).wait()
        return out

    assert all(out.tolist() == [0, 10, 1, 11] for out in _both(groups, valid))
    group = groups[0]
    with pytest.raises(RuntimeError, match="world_size times input"):
        group._allgather_base(torch.empty(3), torch.ones(2),
                              AllgatherOptions())
    with pytest.raises(RuntimeError, match="same type as input"):
        group._allgather_base(torch.empty(4), torch.ones(2,
                                                         dtype=torch.int32),
                              AllgatherOptions())


def test_reduce_scatter_tensor(groups):
    def valid(group, rank):
        out = torch.empty(2)
        group._reduce_scatter_base(out, torch.arange(4.) + rank,
                                   dist.ReduceScatterOptions()).wait()
        return out

    assert [o.tolist() for o in _both(groups, valid)] == [[1., 3.], [5., 7.]]
    group = groups[0]
    with pytest.raises(RuntimeError, match="output size times world size"):
        group._reduce_scatter_base(torch.empty(2), torch.ones(3),
                                   dist.ReduceScatterOptions())
    with pytest.raises(RuntimeError, match="HCCL _reduce_scatter_base: "
                       "Unsupported data type at::kBool"):
        # Unlike allreduce, no cast to int32 first.
        group._reduce_scatter_base(torch.empty(2, dtype=torch.bool),
                                   torch.ones(4, dtype=torch.bool),
                                   dist.ReduceScatterOptions())


def test_all_to_all_single(groups):
    def valid(group, rank):
        # Uneven splits: rank 0 sends 1 row to itself and 2 to rank 1.
        inp = torch.arange(3.) + 10 * rank
        splits_in = [1, 2] if rank == 0 else [2, 1]
        splits_out = [1, 2] if rank == 0 else [2, 1]
        out = torch.empty(sum(splits_out))
        group.alltoall_base(out, inp, splits_out, splits_in,
                            dist.AllToAllOptions()).wait()
        return out

    assert [o.tolist() for o in _both(groups, valid)] == [[0., 10., 11.],
                                                          [1., 2., 12.]]
    group = groups[0]
    with pytest.raises(RuntimeError, match="Split sizes doesn't match"):
        group.alltoall_base(torch.empty(3), torch.empty(3), [1, 2], [1, 1],
                            dist.AllToAllOptions())
    with pytest.raises(RuntimeError, match="not equal to group size"):
        group.alltoall_base(torch.empty(3), torch.empty(3), [3], [3],
                            dist.AllToAllOptions())
    with pytest.raises(RuntimeError, match="does not divide equally"):
        group.alltoall_base(torch.empty(3), torch.empty(3), [], [],
                            dist.AllToAllOptions())
    with pytest.raises(RuntimeError, match="not equal in size or data type"):
        group.alltoall_base(torch.empty(4), torch.empty(4, dtype=torch.int32),
                            [], [], dist.AllToAllOptions())


def test_unsupported_and_comm_names(groups):
    group = groups[0]
    with pytest.raises(RuntimeError, match="does not support gather"):
        group.gather([[torch.empty(2)] * 2], [torch.ones(2)],
                     dist.GatherOptions())
    with pytest.raises(RuntimeError, match="Invalid rank -1"):
        group.get_hccl_comm_name(-1)
    name = group._get_backend(torch.device("cpu")).get_hccl_comm_name(0)
    assert name and group.get_hccl_comm_name(0) == name
    assert groups[1].get_hccl_comm_name(1) != name


@contextmanager
def _capturing():
    """A graph capture recording (the double's ``torch.npu.graph``)."""
    from torch_npu._emulator import EmulatedGraph
    graph = EmulatedGraph()
    graph.capture_begin()
    try:
        yield graph
    finally:
        graph.capture_end()


def test_proven_collectives_run_in_a_capture(groups):
    """all_reduce, all_gather (into a tensor and into a list) and
    reduce_scatter (into a tensor): what vllm-ascend's ACL graphs capture."""
    inputs = [torch.full((2, ), rank + 1.) for rank in range(2)]
    gathered = [torch.empty(4) for _ in range(2)]
    listed = [[torch.empty(2), torch.empty(2)] for _ in range(2)]
    scattered = [torch.empty(2) for _ in range(2)]

    def proven(group, rank):
        group.allreduce([inputs[rank]], ALLREDUCE()).wait()
        group._allgather_base(gathered[rank], inputs[rank],
                              AllgatherOptions()).wait()
        group.allgather([listed[rank]], [inputs[rank]],
                        AllgatherOptions()).wait()
        group._reduce_scatter_base(scattered[rank], gathered[rank],
                                   dist.ReduceScatterOptions()).wait()

    with _capturing():
        _both(groups, proven)
    for rank in range(2):
        assert inputs[rank].tolist() == [3., 3.]
        assert gathered[rank].tolist() == [3.] * 4
        assert [t.tolist() for t in listed[rank]] == [[3., 3.]] * 2
        assert scattered[rank].tolist() == [6., 6.]


def _broadcast(group):
    group.broadcast([torch.ones(2)], _opts(dist.BroadcastOptions,
                                           rootRank=0))


def _all_to_all_single(group):
    group.alltoall_base(torch.empty(2), torch.ones(2), [], [],
                        dist.AllToAllOptions())


def _all_to_all(group):
    group.alltoall([torch.empty(1), torch.empty(1)],
                   [torch.ones(1), torch.ones(1)], dist.AllToAllOptions())


def _send(group):
    group.send([torch.ones(2)], 1, 0)


def _recv(group):
    group.recv([torch.empty(2)], 1, 0)


def _barrier(group):
    group.barrier()


def _reduce(group):
    group.reduce([torch.ones(2)], dist.ReduceOptions())


def _scatter(group):
    group.scatter([torch.empty(2)], [[torch.ones(2), torch.ones(2)]],
                  dist.ScatterOptions())


def _reduce_scatter_list(group):
    group.reduce_scatter([torch.empty(2)], [[torch.ones(2), torch.ones(2)]],
                         dist.ReduceScatterOptions())


REFUSED = [
    (_broadcast, "broadcast", "only in NAIVE_MULTICAST, which it chooses "
     "for prefill, run eagerly"),
    (_all_to_all_single, "alltoall_base", "all-to-all only eagerly"),
    (_all_to_all, "alltoall", "all-to-all only eagerly"),
    (_send, "send", "pipeline stages, eagerly"),
    (_recv, "recv", "pipeline stages, eagerly"),
    (_barrier, "barrier", "synchronizes the host"),
    (_reduce, "reduce", "one root rank"),
    (_scatter, "scatter", "one root rank"),
    (_reduce_scatter_list, "reduce_scatter", "not into a list"),
]


@pytest.mark.parametrize("call,name,why", REFUSED,
                         ids=[name for _, name, _ in REFUSED])
def test_unproven_collectives_fail_in_a_capture(groups, call, name, why):
    """Collectives that no proven ACL graph captures fail in a capture
    before anything is sent, naming the collective and the evidence."""
    with _capturing():
        from torch_npu._emulator import GraphCaptureError
        with pytest.raises(GraphCaptureError) as error:
            call(groups[0])
    message = str(error.value)
    assert message.startswith(f"HCCL {name} during graph capture: no "
                              "proven ACL graph captures it"), message
    assert why in message, message


# vLLM's naive all2all multicast: one broadcast per rank of a temporary
# slice. Gloo's worker frees a finished slice under its queue lock, and that
# needs the GIL when the slice's Python object is already gone.
_MULTICAST = """
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
import torch, torch.distributed as dist
from tests.utils.npu import torch_npu_in_process
with torch_npu_in_process():
    from torch_npu._hccl import HcclContractGroup
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda rank: HcclContractGroup(
            store, rank, 2, timedelta(seconds=30)), range(2)))

    def multicast(group, rank):
        buffer = torch.zeros(64, 8)
        for step in range(2000):
            for src in range(2):
                opts = dist.BroadcastOptions()
                opts.rootRank = src
                group.broadcast([buffer[32 * src:32 * (src + 1)]],
                                opts).wait()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(multicast, groups, range(2)))
print("done")
"""


def test_collectives_do_not_hold_the_gil_while_gloo_frees_tensors():
    """A collective must not wait for gloo's queue with the GIL held (torch's
    Python-ProcessGroup trampoline does): without that, this loop deadlocks
    within a few hundred steps."""
    try:
        done = subprocess.run([sys.executable, "-c", _MULTICAST],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail("broadcasts of temporary slices deadlocked in the "
                    "double's hccl group")
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
