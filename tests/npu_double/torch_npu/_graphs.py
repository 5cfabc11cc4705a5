"""ACL graphs as an NPU has them: the emulator plus the device's resources.

The graph emulator (``_emulator``)
gives the semantics of ``torch.npu.NPUGraph``; this subclass adds what the
device charges for a graph and how it fails:

- Streams. A captured graph holds a stream until it is reset; an NPU has
  2,048 (ACL's limit), of which the runtime keeps some: vllm-ascend, which
  runs on that hardware, leaves 248 and so captures at most 1,800 graphs
  (v0.11.0 ``vllm_ascend/utils.py`` ``update_aclgraph_sizes``). In HCCL's
  default (FFTS+) expansion a communicator first used in a graph takes 40
  streams of its own, and every graph that communicates takes two more per
  communicator it uses (the same function's formula). Past the budget
  capture fails with ACL's error 207008 ("Stream resources are
  insufficient", the text vllm-ascend main classifies in
  ``compilation/acl_graph.py``).
- Pool memory. Graphs captured with the same ``pool`` share one private
  pool of the caching allocator: a block a capture allocates stays taken
  while any tensor handed out on it is alive, and goes back to the pool
  (for later captures) when none is; the pool keeps its peak reserved.
  That peak is charged to the emulated device (``npu.state``), and a
  capture that would take the pools past the memory free when capture
  began (after the weights and the KV cache) fails as an NPU's allocator
  does.
- Capture records, it does not compute. What a capture allocated and
  still hands out afterwards (its outputs, state created lazily inside it)
  holds garbage until a replay writes it: here NaN for floating tensors
  and the dtype's largest value otherwise. Blocks nothing holds after the
  capture are given back: the double frees them and allocates them again
  for each replay.
"""

import dataclasses

import torch

from . import _emulator as graph_emulator
from . import npu

NPU_STREAMS = 2048
RUNTIME_STREAMS = 248
COMMUNICATOR_STREAMS = 40
STREAMS_PER_COMMUNICATOR_PER_GRAPH = 2


class StreamResourceError(RuntimeError):
    pass


@dataclasses.dataclass
class _Streams:
    """The device's streams taken by graphs and communicators."""
    graphs: int = 0
    communicators: set = dataclasses.field(default_factory=set)

    @property
    def taken(self) -> int:
        return (RUNTIME_STREAMS + self.graphs +
                COMMUNICATOR_STREAMS * len(self.communicators))

    def take(self, graph_streams: int, communicators: set) -> None:
        new = communicators - self.communicators
        needed = graph_streams + COMMUNICATOR_STREAMS * len(new)
        if self.taken + needed > NPU_STREAMS:
            raise StreamResourceError(
                "AclmdlRICaptureEnd failed, error code is 207008: Stream "
                f"resources are insufficient (the graph needs {needed} of "
                f"the NPU's {NPU_STREAMS} streams, {self.taken} are taken). "
                "Capture fewer graphs: fewer cudagraph_capture_sizes, or "
                "FULL_DECODE_ONLY.")
        self.graphs += graph_streams
        self.communicators |= communicators


streams = _Streams()


@dataclasses.dataclass
class _Pool:
    """One private pool of the caching allocator."""
    live: int = 0
    peak: int = 0


_pools: dict[int, _Pool] = {}
# The device memory free when the first graph was captured: weights and
# the KV cache are in place by then, and graph pools take what is left.
# (Measured once: the emulator's own bookkeeping during a capture is host
# memory, which a device does not spend.)
_free_at_first_capture: list[int] = []


def _free_for_graphs() -> int:
    if not _free_at_first_capture:
        state = npu.state
        _free_at_first_capture.append(state.total_memory -
                                      state.allocated() - state.workspace)
    return _free_at_first_capture[0]


def pool_bytes() -> int:
    """What the graph pools hold reserved: each one's peak."""
    return sum(pool.peak for pool in _pools.values())


def _poison(produced: graph_emulator.Produced) -> None:
    dtype = produced.dtype
    t = torch.empty(0, dtype=dtype).set_(produced.storage)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    elif dtype == torch.bool:
        t.fill_(True)
    elif not dtype.is_complex:
        t.fill_(torch.iinfo(dtype).max)


class NPUGraph(graph_emulator.EmulatedGraph):
    """``torch.npu.NPUGraph``: the emulator with the device's streams,
    pool memory and uninitialized capture outputs."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = _Pool()
        self.communicators: set = set()
        self.streams = 0
        self._freed: list[graph_emulator.Produced] = []

    def capture_begin(self, pool=None, capture_error_mode: str = "global"
                      ) -> None:
        # torch_npu NPUGraph::capture_begin, as CUDAGraph's: "NPU graphs
        # must be captured on a non-default stream".
        if npu._current_stream in (None, npu._default_stream):
            raise RuntimeError(
                "NPU graphs must be captured on a non-default stream "
                "(capture inside torch.npu.stream(<a torch.npu.Stream>))")
        _free_for_graphs()
        super().capture_begin(pool, capture_error_mode)
        self._pool = _pools.setdefault(pool if pool is not None else id(self),
                                       _Pool())
        self.communicators = set()
        self._freed = []

    def uses_communicator(self, name: str) -> None:
        """A collective on this communicator was captured."""
        self.communicators.add(name)

    def _allocated(self, produced: graph_emulator.Produced) -> None:
        pool = self._pool
        pool.live += produced.nbytes
        pool.peak = max(pool.peak, pool.live)
        state = npu.state
        if pool_bytes() > _free_for_graphs():
            raise RuntimeError(
                f"NPU out of memory. Tried to allocate "
                f"{produced.nbytes / (1 << 20):.2f} MiB (NPU "
                f"{state.current_device}; "
                f"{state.total_memory / (1 << 30):.2f} GiB total capacity; "
                f"{pool_bytes() / (1 << 20):.2f} MiB reserved by graph "
                "pools) during graph capture")

    def _unused(self, produced: graph_emulator.Produced) -> None:
        self._pool.live -= produced.nbytes

    def _captured(self) -> None:
        cost = 1 + STREAMS_PER_COMMUNICATOR_PER_GRAPH * len(
            self.communicators)
        streams.take(cost, self.communicators)
        self.streams = cost
        for produced in self.produced.values():
            if produced.unused and not produced.output:
                produced.storage.resize_(0)
                self._freed.append(produced)
            else:
                _poison(produced)

    def replay(self) -> None:
        for produced in self._freed:
            produced.storage.resize_(produced.nbytes)
        try:
            super().replay()
        finally:
            for produced in self._freed:
                produced.storage.resize_(0)

    def reset(self) -> None:
        streams.graphs -= self.streams
        self.streams = 0
        super().reset()


def current_capture():
    """The graph being captured, if any."""
    return graph_emulator.EmulatedGraph._capturing


def uses_communicator(communicator) -> None:
    """A collective on ``communicator`` (a group's gloo backend under the
    double) is being captured: the graph takes its streams."""
    graph = current_capture()
    if isinstance(graph, NPUGraph):
        graph.uses_communicator(id(communicator))
