"""The double's ACL graphs charge what an NPU charges (streams, pool memory)
and record without computing; the plugin's graph wrapper and platform stay
within that. Each contract is called the wrong way and gets the error."""

import gc
import importlib
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="contracts of the torch_npu double (a real NPU is "
    "checked by the npu-marked tests)")


@pytest.fixture
def npu():
    with torch_npu_in_process():
        _graphs = importlib.import_module("torch_npu._graphs")
        graphs_before = _graphs.streams.graphs
        communicators_before = set(_graphs.streams.communicators)
        _graphs._pools.clear()
        _graphs._free_at_first_capture.clear()
        yield torch.npu, _graphs
        _graphs.streams.graphs = graphs_before
        _graphs.streams.communicators = communicators_before
        _graphs._pools.clear()
        _graphs._free_at_first_capture.clear()


def _capture(npu_api, fn, *args, pool=None):
    graph = npu_api.NPUGraph()
    with npu_api.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


def test_capture_past_the_stream_budget_fails_with_207008(npu, monkeypatch):
    npu_api, graphs = npu
    # torch.npu.graph collects garbage at every capture; vLLM's capture
    # turns that off as well (1,800 collections take minutes).
    monkeypatch.setattr(gc, "collect", lambda *args, **kwargs: 0)
    x = torch.ones(4)
    taken = []
    with pytest.raises(graphs.StreamResourceError, match="207008"):
        for _ in range(graphs.NPU_STREAMS):
            taken.append(_capture(npu_api, torch.mul, x, 2)[0])
    # The runtime's streams and one per graph: 1,800 graphs fit.
    assert len(taken) == graphs.NPU_STREAMS - graphs.RUNTIME_STREAMS
    for graph in taken:
        graph.reset()
    _capture(npu_api, torch.mul, x, 2)  # reset gives the streams back


def test_communicating_graphs_take_group_streams(npu):
    npu_api, graphs = npu
    x = torch.ones(4)
    graph = npu_api.NPUGraph()
    with npu_api.graph(graph):
        torch.mul(x, 2)
        graphs.current_capture().uses_communicator("tp")
        graphs.current_capture().uses_communicator("ep")
    assert graph.streams == 1 + 2 * 2
    assert {"tp", "ep"} <= graphs.streams.communicators


def _pool_after_pieces(npu_api, graphs, weak: bool) -> int:
    """Capture 10 pieces of one size each in a shared pool, keeping each
    output as vLLM's wrapper does (weakly) or strongly."""
    from vllm_ascend.compilation.graph_wrapper import weak_output
    pool = npu_api.graph_pool_handle()
    x = torch.ones(1 << 16)
    kept = []
    for _ in range(10):
        graph, out = _capture(npu_api, torch.mul, x, 2, pool=pool)
        kept.append(weak_output(graph, out) if weak else out)
        del out
    return graphs.pool_bytes()


def test_strong_outputs_grow_the_pool_weak_ones_are_reused(npu):
    npu_api, graphs = npu
    block = (1 << 16) * 4
    strong = _pool_after_pieces(npu_api, graphs, weak=False)
    graphs._pools.clear()
    weak = _pool_after_pieces(npu_api, graphs, weak=True)
    assert strong == 10 * block
    assert weak == block
    free, total = npu_api.mem_get_info()
    assert total - free >= weak  # charged to the device


def test_pool_past_free_device_memory_is_out_of_memory(npu, monkeypatch):
    """Graph pools take what the weights and KV cache left free."""
    npu_api, graphs = npu
    state = graphs.npu.state
    free = 1 << 20
    monkeypatch.setattr(
        state.__class__, "total_memory",
        property(lambda self: self.allocated() + self.workspace + free))
    _capture(npu_api, torch.zeros, free // 4 - 1024)
    with pytest.raises(RuntimeError, match="NPU out of memory"):
        _capture(npu_api, torch.zeros, free // 4)


def test_capture_records_without_computing(npu):
    """A capture's output (and state created lazily inside it) is garbage
    until a replay writes it; temporaries are not kept."""
    npu_api, _ = npu
    x = torch.arange(4.0)
    lazy = {}

    def forward(x):
        if "table" not in lazy:  # built on first use, inside the capture
            lazy["table"] = torch.arange(4.0) * 10
        tmp = x + 1
        return tmp * 2 + lazy["table"]

    graph, out = _capture(npu_api, forward, x)
    assert torch.isnan(out).all()
    assert torch.isnan(lazy["table"]).all()
    graph.replay()
    assert torch.equal(lazy["table"], torch.arange(4.0) * 10)
    assert torch.equal(out, (x + 1) * 2 + lazy["table"])


def test_replay_writes_outputs_after_temporaries_are_freed(npu):
    npu_api, _ = npu
    from vllm_ascend.compilation.graph_wrapper import weak_output
    x = torch.arange(6.0)
    graph, out = _capture(npu_api, lambda x: (x + 1) * 2, x)
    weak = weak_output(graph, out)
    del out
    for value in (1.0, 5.0):
        x.fill_(value)
        graph.replay()
        assert torch.equal(weak, torch.full((6, ), (value + 1) * 2))


def test_npu_context_is_per_thread(npu, monkeypatch):
    """A thread runs on NPU 0 until it selects one: the platform's
    set_device selects the worker's NPU on vLLM's Ray DAG thread."""
    from vllm_ascend.platform import NpuPlatform
    npu_api, _ = npu
    npu_api.set_device(3)
    seen = {}

    def dag_thread(select: bool):
        if select:
            NpuPlatform.set_device(SimpleNamespace(type="npu", index=3))
        seen[select] = npu_api.current_device()

    for select in (False, True):
        t = threading.Thread(target=dag_thread, args=(select, ))
        t.start()
        t.join()
    assert seen == {False: 0, True: 3}
    assert npu_api.current_device() == 3
