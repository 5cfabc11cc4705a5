"""A device graph on the CPU: ``torch.npu.NPUGraph``'s semantics in torch.

Capture records every tensor operation that runs (through a dispatch mode),
tensor arguments by the tensors (so by storage) and every other argument by
value, copied at capture. Replay re-executes exactly that record on the
captured storages: functional ops write their results into the tensors
captured as their outputs, in-place and ``out=`` ops write where they wrote,
views alias what they aliased. So, as on an NPU, a replay does not see a
Python value that changed, a tensor created after capture or a buffer that was
rebound instead of copied into: the output goes stale.

What a real capture cannot record fails here too, naming the operation: a host
sync (``.item()``, ``.tolist()``, ``.cpu()``/``.numpy()`` of a recorded tensor)
or an output whose shape depends on data (``nonzero``, boolean-mask indexing,
``unique``, ...).

A kernel is one recorded call: a torch op outside ``aten`` (a library's
registered kernel) or a Python function marked with :func:`kernel` (the CPU
reference kernels, the torch_npu double's ops); what it does inside is not
recorded, its host arguments are frozen. vLLM's attention custom ops
(``torch.ops.vllm.unified_attention*``) are Python wrappers, not kernels:
the capture records what runs inside them, as a device graph would.

Task groups and task updates follow torch_npu's contract
(``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``ExternalEvent``): a group captured around one kernel call can have that
call's host arguments replaced before a replay by calling the same op again,
with the same tensors, inside an update; a replay that reaches an
``ExternalEvent.wait`` whose event no update recorded fails.
"""

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import (TorchDispatchMode,
                                          _disable_current_modes)
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten


class GraphCaptureError(RuntimeError):
    """An operation a device graph cannot capture ran during capture."""


class GraphReplayError(RuntimeError):
    """A replay or task update broke the graph's contract."""


# Host syncs: the value has to reach the host while the graph is recorded.
_HOST_SYNC_OPS = {aten._local_scalar_dense.default}
# Output shapes that depend on tensor values.
_DATA_DEPENDENT_OPS = {
    aten.nonzero.default, aten.nonzero_static.default,
    aten.masked_select.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor, aten.argwhere.default,
}
_HOST_METHODS = ("item", "tolist", "cpu", "numpy")
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _framework_ops() -> set:
    """vLLM's attention custom ops: Python code around the backend's
    kernels, which a full graph holds one by one. (vLLM's other custom ops,
    e.g. the MoE dispatch under data parallelism, stay one call.)"""
    import vllm.attention.layer  # noqa: F401  (registers them)
    return {torch.ops.vllm.unified_attention.default,
            torch.ops.vllm.unified_attention_with_output.default}


def _may_alias(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write
        for r in returns)


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


def _has_bool_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put_.default,
                    aten.index_put.default, aten._index_put_impl_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
               for i in indices or ())


def _is_work(x: Any) -> bool:
    """A c10d Work, as a collective op called through the dispatcher
    returns it (a TorchScript object)."""
    return (isinstance(x, torch.ScriptObject)
            and x._type().qualified_name().endswith(".c10d.Work"))


def _is_collective(func, result) -> bool:
    return (getattr(func, "namespace", None) == "_c10d_functional"
            or any(_is_work(x) for x in tree_flatten(result)[0]))


def _wait(leaves: list, produced: list[torch.Tensor]) -> None:
    """Wait for a replayed collective before the ops after it read its
    output, as a device stream orders them.

    A c10d op (allreduce_, broadcast_, ...) returns a Work its caller waited
    on outside the record (dist.all_reduce's work.wait()). A traced one
    (_c10d_functional.all_reduce + wait_tensor) writes its new output
    asynchronously, and the wait the graph recorded waits on the tensor
    captured, not on this one.
    """
    works = [leaf for leaf in leaves if _is_work(leaf)]
    for work in works:
        work.wait()
    if not works:  # traced
        for t in produced:
            torch.ops._c10d_functional.wait_tensor(t)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class _Node:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]
    # "alias": its outputs alias its inputs (a view, or an op that may alias
    # and did, such as reshape or to), nothing to run; "mutate": it writes
    # into its arguments (and may return new tensors too); "compute": it
    # produced new tensors.
    kind: str
    # A collective (a c10d op returning a Work, or a traced
    # _c10d_functional op): gloo writes its result on its own thread.
    collective: bool = False

    def run(self) -> None:
        if self.kind == "alias":
            return  # the captured outputs alias the captured storages
        result = self.func(*self.args, **self.kwargs)
        leaves = tree_flatten(result)[0]
        produced = [t for t in leaves if isinstance(t, torch.Tensor)]
        if self.collective:
            _wait(leaves, produced)
        for captured, new in zip(self.outputs, produced):
            # New tensors (also those an op that mutates returns besides)
            # land where the capture put them.
            if new.data_ptr() != captured.data_ptr():
                captured.copy_(new)


def _kind(func, inputs: list[torch.Tensor],
          outputs: list[torch.Tensor]) -> str:
    if not hasattr(func, "_schema"):
        return "compute"  # a kernel: replay runs it again
    if _mutates(func):
        return "mutate"
    if _may_alias(func):
        input_storages = {_storage_key(t) for t in inputs}
        if all(_storage_key(t) in input_storages for t in outputs):
            return "alias"
    return "compute"


@dataclass
class _Wait:
    event: "ExternalEvent"

    def run(self) -> None:
        if not self.event._recorded:
            raise GraphReplayError(
                "graph replay reached an ExternalEvent.wait that no task "
                "update recorded: update the graph's tasks (and record the "
                "event) before every replay")


@dataclass
class _Reset:
    event: "ExternalEvent"

    def run(self) -> None:
        self.event._recorded = False


@dataclass
class TaskGroup:
    """The handle ``graph_task_group_end`` returns: the captured calls of
    one group, whose host arguments an update may replace."""
    nodes: list[_Node] = field(default_factory=list)


@dataclass
class Produced:
    """A storage a capture allocated: on a device, a block of the graph's
    pool, free again once no tensor handed out on it is alive."""
    storage: torch.UntypedStorage
    nbytes: int
    dtype: torch.dtype
    # The tensors the captured code got on it (the record holds aliases).
    handed_out: list = field(default_factory=list)
    # Marked a graph output (weak_output): replays write it for the caller.
    output: bool = False
    # Nothing handed out on it is alive any more.
    unused: bool = False

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.handed_out)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """Another tensor on ``t``'s storage, same view."""
    with _disable_current_modes():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


# Tensors captures handed out, by id, with the alias records hold instead
# (any graph's: a piece's output is the next piece's input).
_ALIASES: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _held(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        entry = _ALIASES.get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[1]
    return x


_FRAMEWORK_OPS: Optional[set] = None


class _Recorder(TorchDispatchMode):

    def __init__(self, graph: "EmulatedGraph") -> None:
        super().__init__()
        self.graph = graph
        global _FRAMEWORK_OPS
        if _FRAMEWORK_OPS is None:
            _FRAMEWORK_OPS = _framework_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNC_OPS:
            raise GraphCaptureError(
                f"{func} (a host sync, e.g. Tensor.item()) during graph "
                "capture: a device graph cannot read a value on the host")
        if func in _DATA_DEPENDENT_OPS or _has_bool_index(func, args):
            raise GraphCaptureError(
                f"{func} during graph capture: its output shape depends on "
                "tensor values (nonzero, boolean-mask indexing, unique); use "
                "a static-shape formulation (torch.where, masks)")
        if func in _FRAMEWORK_OPS:
            # vLLM's attention op is a Python wrapper: record its insides.
            with self:
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        result = func(*args, **kwargs)
        self.graph._record(func, args, kwargs, result)
        return result


class _Updater(TorchDispatchMode):
    """Replaces the calls of a task group instead of running them."""

    def __init__(self, group: TaskGroup) -> None:
        super().__init__()
        self.group = group
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _may_alias(func):
            # A view launches nothing: it runs, as the caller's host code.
            return func(*args, **(kwargs or {}))
        return self.replace(func, args, kwargs or {})

    def replace(self, func, args, kwargs) -> None:
        if self.index >= len(self.group.nodes):
            raise GraphReplayError(
                f"task update calls {_name(func)} but the task group holds "
                f"only {len(self.group.nodes)} captured call(s)")
        node = self.group.nodes[self.index]
        if node.func is not func:
            raise GraphReplayError(
                f"task update calls {_name(func)} where the group captured "
                f"{_name(node.func)}")
        old = [t for t in tree_flatten((node.args, node.kwargs))[0]
               if isinstance(t, torch.Tensor)]
        new = [t for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)]
        if [(t.data_ptr(), t.shape) for t in old] != [(t.data_ptr(), t.shape)
                                                      for t in new]:
            raise GraphReplayError(
                f"task update of {_name(func)} passes other tensors than the "
                "captured call: an update changes host arguments only")
        node.args, node.kwargs = tree_map(lambda x: x, (args, kwargs))
        self.index += 1
        return None


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or str(func)


class EmulatedGraph:
    """``torch.npu.NPUGraph``'s interface: capture_begin/end, replay, reset,
    pool."""

    _capturing: Optional["EmulatedGraph"] = None

    def __init__(self) -> None:
        self._nodes: list[Any] = []
        self._recorder: Optional[_Recorder] = None
        self._seen: set[int] = set()
        self._pool_bytes = 0
        self._group: Optional[TaskGroup] = None
        self._restore: list[tuple[str, Callable]] = []
        self._in_kernel = False
        self.num_replays = 0
        # Storages the capture allocated (the record holds aliases instead
        # of the tensors handed out on them, so their liveness shows).
        self.produced: dict[int, Produced] = {}

    # -- capture ---------------------------------------------------------
    def capture_begin(self, pool=None, capture_error_mode: str = "global"
                      ) -> None:
        if EmulatedGraph._capturing is not None:
            raise GraphCaptureError("a graph capture is already running")
        self.reset()
        EmulatedGraph._capturing = self
        self._recorder = _Recorder(self)
        self._recorder.__enter__()
        self._guard_host_methods()

    def capture_end(self) -> None:
        assert self._recorder is not None
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        self._unguard_host_methods()
        EmulatedGraph._capturing = None
        if self._group is not None:
            raise GraphCaptureError(
                "graph_task_group_begin without graph_task_group_end")
        self._captured()

    def _captured(self) -> None:
        """After a capture: what a device does with the pool (the double's
        NPU graph frees, poisons and charges; the CPU's keeps all)."""

    def _allocated(self, produced: Produced) -> None:
        """A storage allocated during the capture."""

    def _unused(self, produced: Produced) -> None:
        """The last tensor handed out on a storage of the capture died."""

    def _check_unused(self, produced: Produced) -> None:
        if not produced.unused and not produced.alive():
            produced.unused = True
            self._unused(produced)

    @contextlib.contextmanager
    def _kernel_scope(self):
        """Inside a kernel: nothing is recorded, host reads are its own."""
        self._in_kernel = True
        try:
            with _disable_current_modes():
                yield
        finally:
            self._in_kernel = False

    def _record(self, func, args, kwargs, result) -> None:
        outputs = [t for t in tree_flatten(result)[0]
                   if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)]
        kind = _kind(func, inputs, outputs)
        if kind == "compute":
            for t in outputs:
                key = _storage_key(t)
                if key not in self._seen:
                    nbytes = t.untyped_storage().nbytes()
                    self._pool_bytes += nbytes
                    self.produced[key] = Produced(t.untyped_storage(),
                                                  nbytes, t.dtype)
                    self._allocated(self.produced[key])
        for t in inputs + outputs:
            self._seen.add(_storage_key(t))
        # Containers copied: a list mutated after capture stays as captured;
        # tensors on the capture's storages held as aliases.
        node = _Node(func, *tree_map(_held, (args, kwargs)),
                     [self._hand_out(t) for t in outputs], kind,
                     _is_collective(func, result))
        self._nodes.append(node)
        if self._group is not None and kind != "alias":
            # A view launches no task: the group holds the kernels.
            self._group.nodes.append(node)

    def _hand_out(self, t: torch.Tensor) -> torch.Tensor:
        """The alias the record holds for an output handed to the code (a
        view's own ``_base`` would keep what it views alive)."""
        held = _held(t)
        if held is t:
            held = _alias(t)
            key = id(t)
            ref = weakref.ref(t, lambda _: _ALIASES.pop(key, None))
            _ALIASES[key] = (ref, held)
            produced = self.produced.get(_storage_key(t))
            if produced is not None:
                produced.handed_out.append(weakref.ref(
                    t, lambda _: self._check_unused(produced)))
        return held

    def weak_output(self, output: Any) -> Any:
        """The graph's output as a tensor that does not keep it allocated
        (vLLM's ``weak_ref_tensors``); a replay writes it."""

        def weak(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            produced = self.produced.get(_storage_key(x))
            if produced is not None:
                produced.output = True
            return _alias(x)

        return tree_map(weak, output)

    def _guard_host_methods(self) -> None:
        seen = self._seen

        def guard(name: str, original: Callable) -> Callable:

            def method(tensor, *args, **kwargs):
                if not self._in_kernel and _storage_key(tensor) in seen:
                    raise GraphCaptureError(
                        f"Tensor.{name}() of a tensor the graph recorded, "
                        "during graph capture: a host sync cannot be "
                        "captured")
                return original(tensor, *args, **kwargs)

            return method

        for name in _HOST_METHODS:
            original = getattr(torch.Tensor, name)
            self._restore.append((name, original))
            setattr(torch.Tensor, name, guard(name, original))

    def _unguard_host_methods(self) -> None:
        for name, original in self._restore:
            setattr(torch.Tensor, name, original)
        self._restore = []

    # -- replay ----------------------------------------------------------
    def replay(self) -> None:
        if observer is not None:
            return observer.replay(self, self._replay)
        self._replay()

    def _replay(self) -> None:
        with torch.no_grad():
            for node in self._nodes:
                node.run()
        self.num_replays += 1

    def reset(self) -> None:
        self._nodes = []
        self._seen = set()
        self._pool_bytes = 0
        self.produced = {}

    def pool(self) -> int:
        return id(self)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the tensors the capture allocated (its memory pool)."""
        return self._pool_bytes


class graph:
    """``torch.npu.graph(npu_graph, pool=None, stream=None)``."""

    def __init__(self, npu_graph: EmulatedGraph, pool=None, stream=None,
                 capture_error_mode: str = "global") -> None:
        self.npu_graph = npu_graph
        self.pool = pool

    def __enter__(self) -> None:
        self.npu_graph.capture_begin(self.pool)

    def __exit__(self, *exc) -> None:
        self.npu_graph.capture_end()


def graph_pool_handle() -> int:
    return id(object())


def capturing() -> Optional[EmulatedGraph]:
    """The graph recording the code running now: none outside a capture
    and inside a kernel (what a kernel does is not recorded)."""
    graph_ = EmulatedGraph._capturing
    return None if graph_ is None or graph_._in_kernel else graph_


def _capturing(api: str) -> EmulatedGraph:
    current = EmulatedGraph._capturing
    if current is None:
        raise GraphCaptureError(f"{api} outside a graph capture")
    return current


def graph_task_group_begin(stream=None) -> None:
    current = _capturing("graph_task_group_begin")
    if current._group is not None:
        raise GraphCaptureError("task groups do not nest")
    current._group = TaskGroup()


def graph_task_group_end(stream=None) -> TaskGroup:
    current = _capturing("graph_task_group_end")
    group, current._group = current._group, None
    if group is None:
        raise GraphCaptureError(
            "graph_task_group_end without graph_task_group_begin")
    return group


_updating: list[_Updater] = []
# The cost meter counting kernel launches and replays (``_cost.CostMeter``),
# if one is active.
observer: Optional[Any] = None


def graph_task_update_begin(stream, handle: TaskGroup) -> None:
    if EmulatedGraph._capturing is not None:
        raise GraphReplayError("task update during a graph capture")
    if _updating:
        raise GraphReplayError("task updates do not nest")
    updater = _Updater(handle)
    updater.__enter__()
    _updating.append(updater)


def graph_task_update_end(stream=None) -> None:
    if not _updating:
        raise GraphReplayError(
            "graph_task_update_end without graph_task_update_begin")
    updater = _updating.pop()
    updater.__exit__(None, None, None)
    if updater.index != len(updater.group.nodes):
        raise GraphReplayError(
            f"task update replaced {updater.index} of the group's "
            f"{len(updater.group.nodes)} captured call(s)")


class ExternalEvent:
    """``torch.npu.ExternalEvent``: waited on and reset inside a graph,
    recorded by the task update before each replay."""

    def __init__(self) -> None:
        self._recorded = False

    def record(self, stream=None) -> None:
        self._recorded = True

    def wait(self, stream=None) -> None:
        current = EmulatedGraph._capturing
        if current is not None:
            current._nodes.append(_Wait(self))

    def reset(self, stream=None) -> None:
        current = EmulatedGraph._capturing
        if current is not None:
            current._nodes.append(_Reset(self))
        else:
            self._recorded = False


def kernel(fn: Callable) -> Callable:
    """Mark a Python function as one device kernel launch.

    Outside a capture it runs. During a capture it runs once and is recorded
    as one call (its tensors by storage, its other arguments by value, what
    it does inside unrecorded, host reads included); a replay calls it again
    with the captured arguments. Inside a task update it is not run: its new
    host arguments replace those of the group's next captured call.
    """

    @functools.wraps(fn)
    def launch(*args, **kwargs):
        if _updating:
            return _updating[-1].replace(fn, args, kwargs)
        if observer is not None:
            return observer.launch(fn, lambda: _launch(fn, args, kwargs),
                                   args, kwargs)
        return _launch(fn, args, kwargs)

    return launch


def _launch(fn: Callable, args: tuple, kwargs: dict):
    graph_ = EmulatedGraph._capturing
    if graph_ is None or graph_._in_kernel:
        return fn(*args, **kwargs)
    with graph_._kernel_scope():
        result = fn(*args, **kwargs)
    graph_._record(fn, args, kwargs, result)
    return result


# torch.npu's names for the same API.
NPUGraph = EmulatedGraph
