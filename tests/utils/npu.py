"""Running the plugin's NPU code paths: on an NPU, or through the double.

On a host where torch_npu sees an NPU the tests of ``tests/npu`` and the
``npu``-marked op tests run on it; everywhere else they run through the
torch_npu contract double (``tests/npu_double``), in-process for op tests
and with ``VLLM_ASCEND_DEVICE=npu VLLM_ASCEND_NPU_DOUBLE=1`` for engines.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vllm_ascend import device

REAL_NPU = device.current().torch_device_type == "npu"
# The environment of an engine process that takes the NPU code paths.
NPU_ENV = ({"VLLM_ASCEND_DEVICE": "npu"} if REAL_NPU else {
    "VLLM_ASCEND_DEVICE": "npu",
    "VLLM_ASCEND_NPU_DOUBLE": "1"
})


@contextmanager
def torch_npu_in_process() -> Iterator[object]:
    """torch_npu for this process: the real one on an NPU, else the
    double, removed again afterwards."""
    if REAL_NPU:
        import torch_npu
        yield torch_npu
        return
    from tests import npu_double
    module = npu_double.install()
    torch.npu.set_device(0)
    try:
        yield module
    finally:
        npu_double.uninstall()


def to_npu(t: torch.Tensor) -> torch.Tensor:
    return t.npu() if REAL_NPU else t


def trace_path() -> str:
    return os.environ.get("VLLM_ASCEND_NPU_DOUBLE_TRACE", "")


# The largest top-2 log-probability gap at which two bfloat16 computations
# of the same model (different kernels, different rounding points) may pick
# different greedy tokens.
NEAR_TIE = 0.25


def assert_equal_up_to_near_tie(got: list[list[int]], want: list[list[int]],
                                want_logprobs: list[list[dict]]) -> None:
    """Greedy outputs are equal, or equal up to a position where the
    reference's two best tokens are within ``NEAR_TIE`` and ``got`` took
    the other one; what follows a tie is not compared."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        assert len(g) == len(w), i
        j = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
        top = want_logprobs[i][j]
        assert str(g[j]) in top, (i, j, g[j], top)
        gap = top[str(w[j])] - top[str(g[j])]
        assert gap <= NEAR_TIE, (
            f"request {i} differs at token {j}: {g[j]} vs {w[j]}, log-prob "
            f"gap {gap:.3f} > {NEAR_TIE}")


def on_both_ranks(groups, fn):
    """``fn(group, rank)`` on two ranks at once (threads); the results."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(fn, groups, range(2)))
