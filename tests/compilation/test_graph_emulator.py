"""The torch_npu double's graph emulator has a device graph's semantics,
not "call again".

A replay re-executes what the capture recorded on the captured storages: it
follows values copied into captured buffers, and goes stale, as on an NPU,
for a Python value that changed, a buffer rebound instead of copied into or
a tensor created after capture. What a capture cannot record fails at
capture, naming the operation.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EMULATOR = (Path(__file__).resolve().parents[1] / "npu_double" / "torch_npu" /
            "_emulator.py")


def _load_emulator():
    """The emulator module alone (pure torch), without installing the
    double as ``torch_npu``."""
    name = "tests_graph_emulator"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EMULATOR)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.fixture(scope="module")
def ge():
    return _load_emulator()


def _capture(ge, fn):
    graph = ge.NPUGraph()
    with ge.graph(graph):
        out = fn()
    return graph, out


def test_replay_follows_values_copied_into_captured_buffers(ge):
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    weight = torch.ones(3, 4)
    graph, out = _capture(ge, lambda: torch.relu(x @ weight - 3).sum(dim=0))
    x.copy_(torch.full((2, 3), 2.0))
    graph.replay()
    torch.testing.assert_close(out, torch.relu(x @ weight - 3).sum(dim=0))
    assert graph.num_replays == 1


def test_ops_that_may_alias_but_copied_are_recomputed(ge):
    # reshape of a non-contiguous tensor and to(dtype) copy although their
    # schemas say "may alias": a replay must recompute them.
    x = torch.randn(4, 6)
    graph, out = _capture(ge, lambda: (x.t().reshape(-1).to(torch.float64) * 2,
                                   x.view(-1)))
    x.copy_(torch.randn(4, 6))
    graph.replay()
    torch.testing.assert_close(out[0], x.t().reshape(-1).double() * 2)
    assert out[1].data_ptr() == x.data_ptr()


@torch.library.custom_op("vllm_ascend_test::scale_and_copy",
                         mutates_args=("buf", ))
def _scale_and_copy(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    buf.copy_(x)
    return x * 3


def test_op_that_mutates_and_returns_new_tensor(ge):
    x, buf = torch.ones(3), torch.zeros(3)
    graph, out = _capture(ge, lambda: _scale_and_copy(x, buf) + 1)
    x.fill_(2.0)
    graph.replay()
    assert buf.tolist() == [2.0] * 3
    assert out.tolist() == [7.0] * 3


def test_python_value_changed_after_capture_is_frozen(ge):
    x = torch.ones(3)
    state = {"scale": 2.0}
    graph, out = _capture(ge, lambda: x * state["scale"])
    state["scale"] = 10.0
    graph.replay()
    assert out.tolist() == [2.0] * 3


def test_rebound_buffer_and_new_tensor_are_not_seen(ge):
    buffers = {"x": torch.ones(3)}
    graph, out = _capture(ge, lambda: buffers["x"] + 1)
    buffers["x"] = torch.full((3, ), 5.0)  # rebound, not copied into
    graph.replay()
    assert out.tolist() == [2.0] * 3
    buffers["x"].fill_(7.0)  # a tensor created after capture
    graph.replay()
    assert out.tolist() == [2.0] * 3


def test_host_list_argument_mutated_after_capture_is_frozen(ge):
    x = torch.arange(8, dtype=torch.float32)
    sizes = [2, 6]
    graph, out = _capture(ge, lambda: torch.stack(
        [part.sum() for part in x.split(sizes)]))
    sizes[0], sizes[1] = 4, 4
    graph.replay()
    assert out.tolist() == [1.0, 27.0]


@pytest.mark.parametrize("op,name", [
    (lambda x: x.sum().item(), "item"),
    (lambda x: (x + 1).tolist(), "tolist"),
    (lambda x: (x + 1).cpu(), "cpu"),
    (lambda x: (x + 1).numpy(), "numpy"),
    (lambda x: bool(x.sum() > 0), "_local_scalar_dense"),
    (lambda x: (x > 0).nonzero(), "nonzero"),
    (lambda x: x[x > 0], "index"),
    (lambda x: x.unique(), "unique"),
    (lambda x: x.repeat_interleave(x.long()), "repeat_interleave"),
])
def test_capture_rejects_host_syncs_and_data_dependent_shapes(ge, op, name):
    x = torch.arange(4, dtype=torch.float32)
    with pytest.raises(ge.GraphCaptureError, match=name):
        _capture(ge, lambda: op(x))
    # The failed capture left nothing behind: the host API works again.
    assert (x + 1).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_host_values_of_tensors_outside_the_graph_are_readable(ge):
    host_lengths = torch.tensor([3, 5])  # metadata built before capture
    x = torch.ones(8)
    graph, out = _capture(ge, lambda: x[:sum(host_lengths.tolist())] * 2)
    assert out.shape == (8, )


@torch.library.custom_op("vllm_ascend_test::prefix_sums",
                         mutates_args=("out", ))
def _prefix_sums(x: torch.Tensor, lengths: list[int],
                 out: torch.Tensor) -> None:
    """A kernel with host arguments, like the fused attention."""
    for i, n in enumerate(lengths):
        out[i] = x[:n].sum()


def _capture_task(ge, x, out, lengths):
    event = ge.ExternalEvent()
    graph = ge.NPUGraph()
    with ge.graph(graph):
        event.wait()
        event.reset()
        ge.graph_task_group_begin()
        _prefix_sums(x, lengths, out)
        handle = ge.graph_task_group_end()
    return graph, event, handle


def test_task_update_replaces_host_arguments_before_replay(ge):
    x, out = torch.arange(1.0, 9.0), torch.zeros(2)
    graph, event, handle = _capture_task(ge, x, out, [1, 2])
    ge.graph_task_update_begin(None, handle)
    _prefix_sums(x, [4, 8], out)  # recorded, not run
    ge.graph_task_update_end()
    assert out.tolist() == [1.0, 3.0]
    event.record()
    graph.replay()
    assert out.tolist() == [10.0, 36.0]


def test_replay_without_task_update_fails(ge):
    x, out = torch.arange(1.0, 9.0), torch.zeros(2)
    graph, event, handle = _capture_task(ge, x, out, [1, 2])
    event.record()
    graph.replay()  # updated once (here: the record alone)
    with pytest.raises(ge.GraphReplayError, match="no task update"):
        graph.replay()  # the graph reset the event: no update since


def test_task_update_with_other_tensors_fails(ge):
    x, out = torch.arange(1.0, 9.0), torch.zeros(2)
    graph, event, handle = _capture_task(ge, x, out, [1, 2])
    other = x.clone()
    ge.graph_task_update_begin(None, handle)
    with pytest.raises(ge.GraphReplayError, match="host arguments only"):
        _prefix_sums(other, [4, 8], out)
    with pytest.raises(ge.GraphReplayError, match="replaced 0 of"):
        ge.graph_task_update_end()


def test_pool_bytes_count_what_the_capture_allocated(ge):
    x = torch.zeros(256)
    graph, _ = _capture(ge, lambda: (x + 1) * 2)
    assert graph.pool_bytes == 2 * 256 * 4


def _collective_replays(rank: int, port: int, queue) -> None:
    """Capture an all-reduce between two ops on a gloo rank, replay it with
    new inputs; the number of replays that read a stale sum."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    try:
        x = torch.zeros(1 << 16)
        out = torch.zeros(1 << 16)

        def forward():
            y = x * 1.0
            dist.all_reduce(y)  # gloo runs it on its own thread
            out.copy_(y + 0)

        graph, _ = _capture(_load_emulator(), forward)
        stale = 0
        for i in range(20):
            x.fill_(rank + 1 + i)
            graph.replay()
            stale += not torch.all(out == (1 + i) + (2 + i))
        queue.put((rank, stale))
    except Exception as e:  # reported by the test, not lost in a child
        queue.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_replayed_collective_completes_before_the_ops_after_it(ge):
    """A device stream orders a collective before the ops that read it;
    the replay waits on it too (a TP all-reduce in graph mode)."""
    import multiprocessing

    from vllm.utils import get_open_port

    # Spawned: a child forked from a process whose torch thread pools are
    # running may hang in its first parallel op.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = get_open_port()
    procs = [ctx.Process(target=_collective_replays, args=(r, port, queue))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    assert results == {0: 0, 1: 0}
