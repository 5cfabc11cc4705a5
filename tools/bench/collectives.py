"""Wall time spent inside torch.distributed collectives in this process
(waiting for the other ranks included): the share of a step they take.

``install()`` wraps the module-level collectives that vLLM's communicators
and the MoE communication methods call (``dist.all_reduce(...)`` and the
like), so every call through ``torch.distributed`` is timed.
"""

import functools
import time

import torch.distributed as dist

NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
         "barrier", "all_gather_object", "broadcast_object_list")
_totals = {"seconds": 0.0, "calls": 0}


def install() -> None:
    for name in NAMES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_bench_timed", False):
            continue

        @functools.wraps(fn)
        def timed(*args, _fn=fn, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _totals["seconds"] += time.perf_counter() - start
                _totals["calls"] += 1

        timed._bench_timed = True
        setattr(dist, name, timed)


def totals() -> dict[str, float]:
    return dict(_totals)
