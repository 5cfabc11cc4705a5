"""What a step costs the device, counted through the double.

:class:`CostMeter` is a context manager (test and benchmark only). While it
is active it counts, per *scope* (a label the caller opens around a part of
the step, e.g. ``forward`` or ``draft``):

- **kernels**: each torch_npu op and each HCCL collective is one launch
  (the double's ``kernel`` functions; what the double computes inside is
  not counted); each aten op on a device tensor is one launch, except
  views and metadata-only ops (:data:`NO_LAUNCH`, or an output aliasing an
  input); a graph replay launches its recorded nodes, counted by the same
  rules;
- **host syncs**: a host read of a device tensor (``item``, ``tolist``,
  ``cpu``, ``numpy``), an op whose output shape depends on device values
  (``nonzero``, boolean-mask indexing, ``unique``, ...), and
  ``torch.npu.synchronize`` / ``Stream.synchronize`` / ``Event.synchronize``;
  each is named by its call site (``vllm_ascend/...:line`` or
  ``vllm/...:line``);
- **bytes** handed to each MoE exchange (HCCL collectives, MC2 dispatch and
  combine), with their dtype and the exchange's call site.

In the double device tensors are CPU tensors, so which tensors live on the
device is tracked: what :meth:`CostMeter.on_device` is told (weights, KV
cache, the runner's device buffers), everything inside a scope opened with
``device=True`` (a model forward: nothing there is host work), outputs of
kernels and of ops reading device tensors, and tensors written from device
tensors. A host read of a tensor already read since its last device write
reads the host copy: no second sync.

Nothing changes when no meter is active: the emulator calls the meter only
through ``_emulator.observer``.
"""

import contextlib
import dataclasses
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import (TorchDispatchMode,
                                          _disable_current_modes)
from torch.utils._pytree import tree_flatten

from . import _emulator

aten = torch.ops.aten

# aten ops that launch nothing: allocation, metadata, aliasing, host reads.
NO_LAUNCH = {
    aten.empty.memory_format, aten.empty_strided.default,
    aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach.default, aten.alias.default,
    aten.lift_fresh.default, aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor, aten.set_.source_Storage, aten.resize_.default,
    aten._local_scalar_dense.default, aten.is_pinned.default,
    aten.is_same_size.default, aten.sym_size.int, aten.sym_stride.int,
    aten.sym_numel.default, aten.sym_storage_offset.default,
    aten.equal.default,  # CPU-only op in the double's tests
}
# Host reads of a tensor's values.
HOST_READS = ("tolist", "cpu", "numpy")
# The frames a call site is named by, innermost first.
_SITE_ROOTS = ("/vllm_ascend/", "/vllm/vllm/", "/site-packages/vllm/",
               "/tools/", "/tests/")
_DOUBLE_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site() -> str:
    """The innermost frame outside the double and torch, as
    ``vllm_ascend/x.py:line`` (or ``vllm/...``)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_DOUBLE_DIR) and "/torch/" not in name:
            for root in _SITE_ROOTS:
                at = name.rfind(root)
                if at >= 0:
                    rel = name[at + 1:]
                    if rel.startswith(("vllm/vllm/", "site-packages/")):
                        rel = rel[rel.index("vllm/"):]
                        if rel.startswith("vllm/vllm/"):
                            rel = rel[len("vllm/"):]
                    return f"{rel}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclasses.dataclass
class Sync:
    kind: str  # "tolist", "item", "nonzero", "synchronize", ...
    site: str
    tag: Optional[str] = None  # the meter's tag then (e.g. a draft step)


@dataclasses.dataclass
class Exchange:
    """One collective or MC2 kernel of a MoE exchange."""
    op: str
    site: str
    nbytes: int  # payload this rank hands over
    dtype: str
    rows: int  # token rows (MC2: token x top-k copies)


@dataclasses.dataclass
class ScopeCost:
    kernels: Counter = dataclasses.field(default_factory=Counter)
    syncs: list[Sync] = dataclasses.field(default_factory=list)
    exchanges: list[Exchange] = dataclasses.field(default_factory=list)
    calls: int = 0  # times the scope was entered

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "kernels": self.num_kernels,
                "kernel_names": dict(self.kernels.most_common()),
                "syncs": [dataclasses.asdict(s) for s in self.syncs],
                "exchanges": [dataclasses.asdict(e) for e in self.exchanges]}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def launches(func, inputs: list[torch.Tensor],
             outputs: list[torch.Tensor]) -> bool:
    """Whether an aten op (or a kernel function) is a kernel launch."""
    if not isinstance(func, torch._ops.OpOverload):
        return True  # a kernel function (torch_npu op, collective)
    if func in NO_LAUNCH or func.namespace != "aten":
        return func.namespace not in ("aten", "prim") and func not in NO_LAUNCH
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write
                       for r in returns):
        storages = {_key(t) for t in inputs}
        if all(_key(t) in storages for t in outputs):
            return False  # a view
    return True


def _runtime_call(fn) -> bool:
    """A ``torch.npu`` runtime function the double traces (device_count,
    synchronize, ...): host API, not a kernel."""
    return getattr(fn, "__module__", "").endswith(".npu")


def _kernel_name(fn, args) -> str:
    if getattr(fn, "__name__", "") == "_run" and args:
        return "hccl." + getattr(args[0], "__name__", "collective")
    if isinstance(fn, torch._ops.OpOverload):
        return str(fn.overloadpacket).replace("aten::", "aten.")
    return "torch_npu." + getattr(fn, "__name__", str(fn))


# Payload of each MoE exchange, from the call's arguments alone (the same in
# an eager launch and a replay).
def _collective_bytes(args) -> Optional[tuple[str, int, str, int]]:
    collective = args[0]
    name = getattr(collective, "__name__", "")
    tensors = _tensors(args[1:])
    if not tensors:
        return None
    # The collective's input: alltoall_base(out, in, ...),
    # _allgather_base(out, in), _reduce_scatter_base(out, in),
    # allreduce([t]), allgather([[outs]], [in]).
    if name in ("alltoall_base", "_allgather_base", "_reduce_scatter_base"):
        sent = tensors[1]
    else:
        sent = tensors[-1]
    return ("hccl." + name, sent.nbytes, str(sent.dtype).replace(
        "torch.", ""), sent.shape[0] if sent.dim() else 1)


def _mc2_bytes(name: str, args, kwargs) -> tuple[str, int, str, int]:
    """Every (token, expert) copy: MC2 dispatch sends ``H`` values in the
    dispatched dtype (int8 with ``quant_mode`` 1/2, plus one float32
    scale), combine sends each expert's row back in ``expand_x``'s dtype."""
    if name.endswith("dispatch_v2"):
        x, expert_ids = args[0], args[1]
        copies, hidden = expert_ids.numel(), x.shape[-1]
        if kwargs.get("quant_mode", 0):
            return (name, copies * (hidden + 4), "int8", copies)
        return (name, copies * hidden * x.element_size(),
                str(x.dtype).replace("torch.", ""), copies)
    expand_x, expert_ids = args[0], args[1]
    copies = expert_ids.numel()
    return (name, copies * expand_x.shape[-1] * expand_x.element_size(),
            str(expand_x.dtype).replace("torch.", ""), copies)


class _MeterMode(TorchDispatchMode):
    """The meter's view of the dispatcher."""

    def __init__(self, meter: "CostMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "vllm":
            # vLLM's Python custom ops (attention, MoE): what runs inside
            # is counted, as a device graph holds it.
            with self:
                return func.redispatch(_emulator._CPU_KEYS, *args, **kwargs)
        result = func(*args, **kwargs)
        self.meter.dispatched(func, args, kwargs, result)
        return result


class CostMeter:
    """Counts kernels, host syncs and exchange bytes per scope (module
    docstring). ``with meter:`` turns it on; ``meter.scope(label)`` names
    what runs inside; ``meter.costs`` holds the result."""

    def __init__(self) -> None:
        self._mode = _MeterMode(self)
        self.costs: dict[str, ScopeCost] = {}
        self._scopes: list[tuple[str, bool]] = []
        self._device: set[int] = set()
        self._host_copy: set[int] = set()  # read since last device write
        # Per thread (ranks may run as threads): inside a kernel nothing is
        # counted; inside a host-read method its inner reads are not syncs.
        self._local = threading.local()
        self._restore: list[tuple[Any, str, Any]] = []
        self._active = False
        self._seen_graphs: set[int] = set()
        # A label the caller sets, stored with each sync (e.g. "draft2").
        self.tag: Optional[str] = None

    # -- the caller's API -------------------------------------------------
    def on_device(self, *tensors: torch.Tensor) -> None:
        """Tensors that live on the device (weights, caches, buffers)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device.add(_key(t))

    @contextlib.contextmanager
    def scope(self, label: str, device: bool = False) -> Iterator[ScopeCost]:
        """Attribute what runs inside to ``label``; ``device``: every
        tensor op inside is device work (a model forward)."""
        cost = self.costs.setdefault(label, ScopeCost())
        cost.calls += 1
        inherited = bool(self._scopes and self._scopes[-1][1])
        self._scopes.append((label, device or inherited))
        try:
            yield cost
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside (e.g. a warm-up the caller runs)."""
        self._kernel_depth += 1
        try:
            yield
        finally:
            self._kernel_depth -= 1

    def reset(self) -> None:
        self.costs = {}

    # -- state ------------------------------------------------------------
    @property
    def _kernel_depth(self) -> int:
        return getattr(self._local, "kernel_depth", 0)

    @_kernel_depth.setter
    def _kernel_depth(self, value: int) -> None:
        self._local.kernel_depth = value

    @property
    def _reading(self) -> int:
        return getattr(self._local, "reading", 0)

    @_reading.setter
    def _reading(self, value: int) -> None:
        self._local.reading = value

    @property
    def _counting(self) -> bool:
        return (self._active and self._kernel_depth == 0
                and _emulator.EmulatedGraph._capturing is None)

    def _cost(self) -> ScopeCost:
        label = self._scopes[-1][0] if self._scopes else "unscoped"
        return self.costs.setdefault(label, ScopeCost())

    def _in_device_scope(self) -> bool:
        return bool(self._scopes and self._scopes[-1][1])

    def is_device(self, t: torch.Tensor) -> bool:
        return _key(t) in self._device

    def _wrote(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            key = _key(t)
            self._device.add(key)
            self._host_copy.discard(key)

    def _sync(self, kind: str) -> None:
        self._cost().syncs.append(Sync(kind, call_site(), self.tag))

    # -- kernels and syncs from the dispatcher ----------------------------
    def dispatched(self, func, args, kwargs, result) -> None:
        if not self._counting or self._reading:
            return  # inside a host read: what it makes is a host copy
        inputs = _tensors((args, kwargs))
        outputs = _tensors(result)
        device = self._in_device_scope() or any(
            self.is_device(t) for t in inputs)
        if not device:
            # Host work: what it allocates is host memory (an address a
            # freed device tensor had is not a device tensor now).
            for t in outputs:
                self._device.discard(_key(t))
            return
        if func is aten._local_scalar_dense.default:
            if not self._reading and not self._host_copy_valid(inputs[0]):
                self._sync("item")
            return
        if (func in _emulator._DATA_DEPENDENT_OPS
                or _emulator._has_bool_index(func, args)):
            self._sync(func.overloadpacket.__name__)
        if launches(func, inputs, outputs):
            self._cost().kernels[_kernel_name(func, args)] += 1
        written = outputs + [
            t for t, a in zip(args, func._schema.arguments)
            if isinstance(t, torch.Tensor) and a.alias_info is not None
            and a.alias_info.is_write
        ]
        self._wrote(written)
        return

    def _host_copy_valid(self, t: torch.Tensor) -> bool:
        return _key(t) in self._host_copy

    # -- kernels from the emulator (``_emulator.observer``) ---------------
    def launch(self, fn: Callable, run: Callable, args, kwargs):
        """A kernel function: one launch, nothing inside counted."""
        if not self._counting:
            return run()
        self._kernel_depth += 1
        try:
            # Nothing inside is counted; a collective's gloo thread must not
            # meet this thread's dispatch mode.
            with _disable_current_modes():
                result = run()
        finally:
            self._kernel_depth -= 1
        if not _runtime_call(fn) and not getattr(self._local, "aten_only",
                                                 False):
            self._counted_kernel(fn, args, kwargs)
            self._wrote(_tensors(result))
        return result

    def replay(self, graph, run: Callable) -> None:
        """A graph replay: its recorded nodes, by the same rules. A vLLM
        custom op the emulator recorded as one call (the MoE layer's) is
        Python around kernels, which a device graph holds one by one: what
        runs inside it is counted."""
        if not self._counting:
            return run()
        if id(graph) not in self._seen_graphs:
            self._seen_graphs.add(id(graph))
            for node in graph._nodes:
                if isinstance(node, _emulator._Node):
                    self._device.update(
                        _key(t) for t in _tensors((node.args, node.kwargs,
                                                   node.outputs)))
        cost = self._cost()
        with torch.no_grad():
            for node in graph._nodes:
                func = getattr(node, "func", None)
                if (isinstance(func, torch._ops.OpOverload)
                        and func.namespace == "vllm"):
                    self._run_custom_op(node)
                    continue
                if isinstance(node, _emulator._Node) and node.kind != "alias":
                    if isinstance(func, torch._ops.OpOverload):
                        inputs = _tensors((node.args, node.kwargs))
                        if launches(func, inputs, node.outputs):
                            cost.kernels[_kernel_name(func, node.args)] += 1
                    elif not _runtime_call(func):
                        self._counted_kernel(func, node.args, node.kwargs)
                with self.paused():
                    node.run()
        graph.num_replays += 1
        self._host_copy.clear()

    def _run_custom_op(self, node) -> None:
        """A vLLM custom op node: its aten ops counted through the meter's
        mode; its kernels are not (the capture recorded each as a node of
        its own, counted there), nor the emulator's copy of its outputs
        into the captured ones."""
        self._local.aten_only = True
        try:
            result = node.func(*node.args, **node.kwargs)
        finally:
            self._local.aten_only = False
        with self.paused():
            for captured, new in zip(node.outputs, _tensors(result)):
                if new.data_ptr() != captured.data_ptr():
                    captured.copy_(new)

    def _counted_kernel(self, fn, args, kwargs) -> None:
        cost = self._cost()
        name = _kernel_name(fn, args)
        cost.kernels[name] += 1
        moved = None
        if name.startswith("hccl."):
            moved = _collective_bytes(args)
        elif "moe_distribute" in name:
            moved = _mc2_bytes(name, args, kwargs)
        if moved is not None:
            op, nbytes, dtype, rows = moved
            cost.exchanges.append(Exchange(op, call_site(), nbytes, dtype,
                                           rows))

    # -- host methods and device synchronization --------------------------
    def _patch(self, owner: Any, name: str, wrapper: Callable) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def _host_read(self, name: str) -> Callable:
        meter = self

        def wrapper(original):

            def method(tensor, *args, **kwargs):
                if (meter._counting and meter.is_device(tensor)
                        and not meter._host_copy_valid(tensor)
                        and not meter._reading):
                    meter._sync(name)
                    meter._host_copy.add(_key(tensor))
                meter._reading += 1
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    meter._reading -= 1

            return method

        return wrapper

    def _device_wait(self, name: str) -> Callable:
        meter = self

        def wrapper(original):

            def wait(*args, **kwargs):
                if meter._counting:
                    meter._sync(name)
                    meter._host_copy.update(meter._device)
                return original(*args, **kwargs)

            return wait

        return wrapper

    def __enter__(self):
        from . import npu
        for name in HOST_READS:
            self._patch(torch.Tensor, name, self._host_read(name))
        self._patch(torch.Tensor, "item", self._host_read("item"))
        self._patch(npu, "synchronize",
                    self._device_wait("torch.npu.synchronize"))
        self._patch(npu.Stream, "synchronize",
                    self._device_wait("Stream.synchronize"))
        self._patch(npu.Event, "synchronize",
                    self._device_wait("Event.synchronize"))
        if _emulator.observer is not None:
            raise RuntimeError("a CostMeter is already active")
        _emulator.observer = self
        self._active = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._active = False
        _emulator.observer = None
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore = []
        self._mode.__exit__(*exc)
