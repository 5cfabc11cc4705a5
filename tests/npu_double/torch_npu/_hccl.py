"""The ``hccl`` process group: HCCL's contract checked, gloo underneath.

Each check is written from torch_npu's ProcessGroupHCCL
(Ascend/pytorch, ``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp`` and
``HCCLUtils.cpp``; the v2.8.0 release branch is what torch_npu 2.8.0
ships) and raises its error text as a RuntimeError. The collective itself
is the gloo backend's, launched as one kernel of the graph emulator, so a
graph capture records it and a replay runs it again without the checks, as
a device graph replays what was captured. Not checkable here: that tensors
live on the NPU (the double's are CPU tensors).

In a capture only the collectives hardware has been shown to capture in an
ACL graph run (``CAPTURED``); any other fails with a GraphCaptureError
naming it and why (``NOT_CAPTURED``). What is proven is what vllm-ascend
v0.11.0 captures in its piecewise and full ACL graphs: the TP all-reduce;
in the all-gather MoE method's decode path the DP all-gather (into a
tensor) and reduce-scatter (``ops/moe/fused_moe_prepare_and_finalize.py``,
``FusedMoEPrepareAndFinalizeWithAllGather``); in the MC2 path the TP
``dist.all_gather`` into a list (``FusedMoEPrepareAndFinalizeWithMC2.
finalize``) besides the fused kernels. A collective a fused kernel issues
inside the double is the kernel's own and is not checked.

Why the gloo backend is called directly rather than through
``super()``: torch's trampoline for a Python ``ProcessGroup`` runs the base
collective with the GIL held (``WORK_OVERRIDE`` in ``PyProcessGroup.hpp``),
while gloo's worker thread, holding its queue lock, may need the GIL to free
a finished collective's tensors (a temporary view whose Python object is
gone). The next collective then waits for that lock with the GIL held: a
deadlock. The backend's own binding releases the GIL.
"""

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _graphs
from ._emulator import GraphCaptureError, capturing, kernel
from ._trace import record

# HCCLUtils.cpp, kScalarTypeToHcclDataType.
MAPPED = {
    torch.uint8, torch.bool, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
    torch.float8_e5m2
}
# checkSupportedDataType: what the reducing collectives take.
REDUCIBLE = {
    torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.bfloat16
}
# allreduce and reduce cast these to int32 first (a pre-hook).
CAST_FOR_ALLREDUCE = {torch.uint8, torch.bool}
_ATEN_NAMES = {torch.float64: "at::kDouble", torch.uint8: "at::kByte",
               torch.bool: "at::kBool"}

_comm_names = itertools.count()

# ProcessGroup methods (the collective's name in torch) of what proven ACL
# graphs capture.
CAPTURED = {"allreduce", "_allgather_base", "allgather",
            "_reduce_scatter_base"}
_EAGER_A2A = ("vllm-ascend v0.11.0 runs all-to-all only eagerly: ALLTOALL "
              "for batches above the MC2 capacity, which is the largest "
              "capture size (model_runner_v1._init_mc2_tokens_capacity, "
              "_select_moe_comm_method); its o_proj all-to-all is TorchAir "
              "only (ascend_config oproj_tensor_parallel_size)")
NOT_CAPTURED = {
    "broadcast": ("vllm-ascend v0.11.0 broadcasts only in NAIVE_MULTICAST, "
                  "which it chooses for prefill, run eagerly "
                  "(model_runner_v1._select_moe_comm_method); its graphs "
                  "exchange DP tokens by all_gather and reduce_scatter"),
    "alltoall_base": _EAGER_A2A,
    "alltoall": _EAGER_A2A,
    "send": "point-to-point runs between pipeline stages, eagerly",
    "recv": "point-to-point runs between pipeline stages, eagerly",
    "barrier": "a barrier synchronizes the host; no graph captures one",
    "reduce": "no proven graph reduces to one root rank",
    "scatter": "no proven graph scatters from one root rank",
    "reduce_scatter": ("proven graphs reduce-scatter into a tensor "
                       "(reduce_scatter_tensor), not into a list"),
}


def _fail(message: str) -> None:
    raise RuntimeError(message)


def _check(cond: bool, message: str) -> None:
    if not cond:
        _fail(message)


def _mapped(t: torch.Tensor) -> None:
    _check(t.dtype in MAPPED, "Unsupported data type for HCCL process group")


def _single(tensors: list[torch.Tensor]) -> torch.Tensor:
    """check_npu_tensors_different_devices on a one-device host."""
    _check(len(tensors) > 0, "Tensor list must be nonempty")
    _check(len(tensors) == 1,
           "Tensor list mustn't be larger than the number of available NPUs")
    return _tensor(tensors[0])


def _tensor(t: torch.Tensor) -> torch.Tensor:
    """check_npu_single_tensor."""
    _check(not t.is_sparse, "Tensors must be NPU and dense")
    # is_contiguous(suggest_memory_format()): channels-last passes.
    _check(t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(
        memory_format=torch.channels_last)), "Tensors must be contiguous")
    _mapped(t)
    return t


def _reducible(t: torch.Tensor, function: str, cast_bool: bool) -> None:
    if cast_bool and t.dtype in CAST_FOR_ALLREDUCE:
        return
    _check(t.dtype in REDUCIBLE, f"HCCL {function}: Unsupported data type "
           f"{_ATEN_NAMES.get(t.dtype, t.dtype)}")


def _reduce_op(op, t: torch.Tensor) -> None:
    """getHcclReduceOp."""
    op = getattr(op, "op", op)
    for name in ("BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            _fail(f"Cannot use ReduceOp.{name} with HCCL")
    if op == dist.ReduceOp.PREMUL_SUM:
        _check(t.dtype in (torch.float16, torch.float32, torch.bfloat16,
                           torch.float64),
               "PreMulSum Data type must be half, float, bfloat16 or double")


@kernel
def _run(collective, *args):
    work = collective(*args)
    work.wait()
    return work


def _capturable(name: str, communicator) -> None:
    """Outside a capture any collective runs; in one, only ``CAPTURED``,
    and the graph takes the communicator's streams."""
    graph = capturing()
    if graph is None:
        return
    _graphs.uses_communicator(communicator)
    if name in CAPTURED:
        return
    raise GraphCaptureError(
        f"HCCL {name} during graph capture: no proven ACL graph captures "
        f"it ({NOT_CAPTURED.get(name, 'not among ' + str(sorted(CAPTURED)))}"
        "). Run it outside graphs, or use all_reduce / all_gather / "
        "reduce_scatter.")


def _launch(collective, *args):
    """One collective on the gloo backend, waited for before the next
    kernel as on a device stream; the caller's wait returns at once. The
    trace records it as ``hccl.<collective>`` at its plugin call site."""
    _capturable(collective.__name__, collective.__self__)
    record(f"hccl.{collective.__name__}")
    return _run(collective, *args)


class HcclContractGroup(dist.ProcessGroup):
    """What ``backend="hccl"`` creates under the double."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._register_backend(torch.device("cpu"),
                               dist.ProcessGroup.BackendType.GLOO,
                               self._gloo)
        self._comm_name = ""

    def getBackendName(self) -> str:
        return "hccl"

    # The HCCL backend's own method; the double's group is its backend.
    def _get_backend(self, device: torch.device):
        return self

    def get_hccl_comm_name(self, rankid: int, *, init_comm: bool = True
                           ) -> str:
        _check(rankid >= 0, f"Invalid rank {rankid}")
        if not self._comm_name and init_comm:
            self._comm_name = f"hccl_double_comm_{next(_comm_names)}"
            _COMMS[self._comm_name] = self
        return self._comm_name

    def allreduce(self, tensors, opts=None):
        t = _single(tensors)
        _reduce_op(opts.reduceOp, t)
        _reducible(t, "allreduce", cast_bool=True)
        return _launch(self._gloo.allreduce, tensors, opts)

    def reduce(self, tensors, opts=None):
        t = _single(tensors)
        _reduce_op(opts.reduceOp, t)
        _reducible(t, "reduce", cast_bool=True)
        return _launch(self._gloo.reduce, tensors, opts)

    def barrier(self, opts=None):
        return _launch(self._gloo.barrier, opts or dist.BarrierOptions())

    def scatter(self, outputs, input_lists, opts=None):
        _single(outputs)
        return _launch(self._gloo.scatter, outputs, input_lists, opts)

    def broadcast(self, tensors, opts=None):
        _single(tensors)
        return _launch(self._gloo.broadcast, tensors, opts)

    def allgather(self, output_lists, input_list, opts=None):
        t = _single(input_list)
        for outputs in output_lists:
            _check(len(outputs) == self.size(),
                   "Tensor list input to scatter/gather must match number "
                   "of collective participants")
            for out in outputs:
                _check(out.dtype == t.dtype, "Tensors must have identical "
                       "type")
                _check(out.numel() == t.numel(), "All tensor operands to "
                       "scatter/gather must have the same size")
        return _launch(self._gloo.allgather, output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=None):
        _tensor(input)
        _tensor(output)
        _check(output.dtype == input.dtype,
               "output tensor must have the same type as input tensor")
        _check(output.numel() == self.size() * input.numel(),
               "output tensor size must be equal to world_size times input "
               "tensor size")
        return _launch(self._gloo._allgather_base, output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        _tensor(input)
        _mapped(output)
        _check(input.dtype == output.dtype,
               "input tensor must be the same type as the output tensor.")
        _check(input.numel() == output.numel() * self.size(),
               "input tensor must be the same size as output size times "
               "world size")
        _reduce_op(opts.reduceOp, input)
        _reducible(input, "_reduce_scatter_base", cast_bool=False)
        return _launch(self._gloo._reduce_scatter_base, output, input, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        _check(len(outputs) > 0 and all(input_lists),
               "Tensor list operands to reduce_scatter must be non-empty")
        t = _single(outputs)
        _reduce_op(opts.reduceOp, t)
        _reducible(t, "reduce_scatter", cast_bool=False)
        return _launch(self._gloo.reduce_scatter, outputs, input_lists, opts)

    def alltoall_base(self, output, input, output_split_sizes,
                      input_split_sizes, opts=None):
        _tensor(input)
        _tensor(output)
        if not output_split_sizes and not input_split_sizes:
            _check(input.numel() == output.numel()
                   and input.dtype == output.dtype,
                   "Tensors are not equal in size or data type")
            _check(output.dim() > 0, "Scalar tensors (0-dim tensors) are not "
                   "supported in alltoall.")
            _check(output.shape[0] % self.size() == 0,
                   "Tensor's dim 0 does not divide equally across group size")
        for splits, t in ((output_split_sizes, output),
                          (input_split_sizes, input)):
            if splits:
                _check(len(splits) == self.size(),
                       "Number of tensor splits not equal to group size")
                _check(sum(splits) == t.shape[0],
                       "Split sizes doesn't match total dim 0 size")
        return _launch(self._gloo.alltoall_base, output, input,
                       output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs, inputs, opts=None):
        _check(len(outputs) == self.size(),
               "the size of output_tensors and worldsize must equal")
        _check(len(inputs) == len(outputs),
               "the size of input_tensors and output_tensors must equal")
        for t in list(outputs) + list(inputs):
            _tensor(t)
        return _launch(self._gloo.alltoall, outputs, inputs, opts)

    def send(self, tensors, dst: int, tag: int):
        _single(tensors)
        return _launch(self._gloo.send, tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        _single(tensors)
        return _launch(self._gloo.recv, tensors, src, tag)

    def recv_anysource(self, tensors, tag: int):
        _fail("ProcessGroupHCCL does not support recv")

    def gather(self, outputs, inputs, opts=None):
        _fail("ProcessGroupHCCL does not support gather")


# HCCL communicator names handed out by get_hccl_comm_name, for the MC2
# kernels' group arguments.
_COMMS: dict[str, HcclContractGroup] = {}


def group_of(comm_name: str, op: str) -> HcclContractGroup:
    group = _COMMS.get(comm_name)
    _check(group is not None, f"{op}: {comm_name!r} is not an HCCL "
           "communicator name (get_hccl_comm_name)")
    _graphs.uses_communicator(group._gloo)
    return group
