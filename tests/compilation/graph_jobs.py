"""The engine runs of the graph-mode and mutation tests: the test batch,
the graph modes per MTP k, and ``run_engine`` arguments for each; built by
the ``graph_runs`` fixture (conftest.py), checked by test_graph_modes.py and
test_graph_mutations.py.

Graphs are the NPU's: the runs take the NPU code paths (on an NPU, or
through the torch_npu double, whose graphs capture and replay as an NPU's
do), so the checkpoint has what the NPU kernels take (bfloat16, head_dim
128, 128-token blocks). The CPU reference device runs eager.
"""

import random
from pathlib import Path

from tests.utils.checkpoints import write_random_glm45
from tests.utils.npu import NPU_ENV

# The reference serve command's capture sizes.
ORIGINAL_SIZES = [1, 4, 8, 16, 32, 48, 64]
MAX_NEW = 16
MAX_BATCHED_TOKENS = 40
MAX_NUM_SEQS = 16
# k = 1 runs each kind of graph alone (piecewise for every batch, full for
# uniform decode); k = 2 the default mode, which holds both. (The default
# mode at k = 1 and 3: tests/npu/test_npu_engine.py.)
MODES_PER_K = {1: ("PIECEWISE", "FULL_DECODE_ONLY"),
               2: ("FULL_AND_PIECEWISE", )}
NUM_LAYERS = 3


def write_checkpoint(path: Path) -> Path:
    """A random GLM-4.5 checkpoint the NPU kernels take: 3 layers (the
    first dense), head_dim 128."""
    return write_random_glm45(path, seed=11, head_dim=128,
                              num_hidden_layers=NUM_LAYERS)


def prompts() -> list[list[int]]:
    """11 requests: decode batches of 11, then fewer as requests finish,
    i.e. token counts both on and between the capture sizes; three cross a
    128-token block while decoding, so a small KV pool preempts."""
    rng = random.Random(3)
    lengths = [rng.randrange(8, 20) for _ in range(8)] + [112, 116, 120]
    rng.shuffle(lengths)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


def engine(model: Path, k: int, **mode) -> dict:
    engine = dict(model=str(model), skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=256,
                  max_num_seqs=MAX_NUM_SEQS, seed=0,
                  enable_chunked_prefill=True,
                  max_num_batched_tokens=MAX_BATCHED_TOKENS,
                  num_gpu_blocks_override=4, **mode)
    if k:
        engine["speculative_config"] = dict(method="glm4_moe_mtp",
                                            num_speculative_tokens=k)
    return engine


def job(model: Path, k: int, setup: str | None = None, **mode) -> dict:
    """``run_engine`` arguments for the test batch with MTP k (0: none)."""
    batch = prompts()
    # Staggered lengths: requests finish at different steps.
    sampling = [dict(temperature=0, max_tokens=MAX_NEW - (i % 4),
                     ignore_eos=True) for i in range(len(batch))]
    return dict(engine=engine(model, k, **mode), prompts=batch,
                sampling=sampling, inspect=True, setup=setup, env=NPU_ENV)


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
