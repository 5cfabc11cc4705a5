"""The engine runs of the graph-mode and mutation tests: the test batch,
the graph modes per MTP k, and ``run_engine`` arguments for each; built by
the ``graph_runs`` fixture (conftest.py), checked by test_graph_modes.py and
test_graph_mutations.py."""

import json
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-glm45"
# The original command's capture sizes.
ORIGINAL_SIZES = [1, 4, 8, 16, 32, 48, 64]
MAX_NEW = 20
GRAPH_MODES = ("PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# k = 2 runs the mode that holds both kinds of graph (piecewise for mixed
# batches, full for uniform decode); k = 1 runs each.
MODES_PER_K = {1: GRAPH_MODES, 2: ("FULL_AND_PIECEWISE", )}


def prompts() -> list[list[int]]:
    heldout = json.loads((FIXTURE / "heldout_prompts.json").read_text())
    ids = [p["token_ids"] for p in heldout]
    # 11 requests: decode batches of 11, then fewer as requests finish,
    # i.e. token counts both on and between the capture sizes.
    return (ids * 3)[:11]


def engine(k: int, **mode) -> dict:
    engine = dict(model=str(FIXTURE), dtype="float32", max_model_len=256,
                  max_num_seqs=16, seed=0, enable_chunked_prefill=True,
                  max_num_batched_tokens=40, num_gpu_blocks_override=20,
                  block_size=16, **mode)
    if k:
        engine["speculative_config"] = dict(method="glm4_moe_mtp",
                                            num_speculative_tokens=k)
    return engine


def job(k: int, setup: str | None = None, **mode) -> dict:
    """``run_engine`` arguments for the test batch with MTP k (0: none)."""
    batch = prompts()
    # Staggered lengths: requests finish at different steps.
    sampling = [dict(temperature=0, max_tokens=MAX_NEW - (i % 4),
                     ignore_eos=True) for i in range(len(batch))]
    return dict(engine=engine(k, **mode), prompts=batch,
                sampling=sampling, inspect=True, setup=setup)


def graph_mode(cudagraph_mode: str) -> dict:
    return dict(compilation_config={"cudagraph_mode": cudagraph_mode,
                                    "cudagraph_capture_sizes":
                                    ORIGINAL_SIZES})


def result(run):
    """A run of ``graph_runs``: its result, or its engine's failure
    raised."""
    if isinstance(run, BaseException):
        raise run
    return run
