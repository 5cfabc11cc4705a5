"""The compilation and graph settings, NPU and CPU alike.

vLLM decides the compilation level, the cudagraph mode and the capture sizes
from ``--compilation-config`` and ``--enforce-eager`` (the NPU platform
supports static graph mode, so graphs are the default there; the CPU
reference platform does not, and runs eager); here the capture sizes are
rounded to multiples of ``1 + k``, bounded by the NPU's streams
(``stream_budget``: every piece, full graph and draft graph of a size takes
one) and inductor stays off (it would turn the
plugin's custom ops off, ``CustomOp.default_on``, and needs triton). The
pieces between attention calls are captured by the plugin's graph wrapper;
full graphs hold the attention too, its host arguments updated before each
replay (``attention.graph_tasks``). vLLM's runner keeps full graphs to uniform
batches (the attention backend's ``UNIFORM_BATCH`` support) and runs the
rest piecewise.
"""

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_ascend.compilation import stream_budget
from vllm_ascend.compilation.capture_sizes import align_capture_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def configure_graph_mode(vllm_config: "VllmConfig",
                         num_speculative_tokens: int, graphs: bool) -> None:
    """``graphs``: whether the platform captures device graphs."""
    from vllm.config import CompilationLevel, CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    compilation_config.use_inductor = False
    if not graphs:
        # Nothing is captured (vLLM has set the mode to NONE); the sizes
        # still need vLLM's derived fields (compile sizes, the padding
        # table its MTP proposer reads), given or not.
        if compilation_config.cudagraph_capture_sizes is None:
            vllm_config._set_cudagraph_sizes()
        else:
            compilation_config.init_with_cudagraph_sizes(
                compilation_config.cudagraph_capture_sizes)
        return
    if compilation_config.cudagraph_capture_sizes is None:
        vllm_config._set_cudagraph_sizes()
    sizes = compilation_config.cudagraph_capture_sizes
    aligned = align_capture_sizes(sizes, num_speculative_tokens)
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if any(size > max_tokens for size in aligned):
        kept = [size for size in aligned if size <= max_tokens]
        logger.warning(
            "Graph capture sizes %s exceed max_num_batched_tokens=%d, the "
            "most tokens a step runs: capturing %s.", sorted(aligned),
            max_tokens, sorted(kept))
        aligned = kept
    aligned = _bound_by_streams(vllm_config, aligned, num_speculative_tokens)
    if aligned != sizes:
        compilation_config.cudagraph_capture_sizes = aligned
        compilation_config.init_with_cudagraph_sizes(aligned)

    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if not compilation_config.cudagraph_capture_sizes:
        logger.warning("No graph capture size left: running without graphs.")
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        return
    if compilation_config.level != CompilationLevel.PIECEWISE:
        logger.warning(
            "cudagraph_mode %s needs compilation level %d (PIECEWISE) in "
            "vllm_ascend, not %d: running without graphs.", mode.name,
            CompilationLevel.PIECEWISE, compilation_config.level)
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        return
    if os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") == "1":
        # ACL cannot capture a graph while every launch synchronizes.
        raise ValueError(
            f"ASCEND_LAUNCH_BLOCKING=1 cannot be used with graphs "
            f"(cudagraph_mode {mode.name}): unset it, or add --enforce-eager "
            "to debug without graphs.")


def budget_of(vllm_config: "VllmConfig",
              num_speculative_tokens: int) -> stream_budget.GraphBudget:
    """The streams the configured graph mode takes per capture size."""
    from vllm.config import CUDAGraphMode
    mode = vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    parallel = vllm_config.parallel_config
    full = mode.has_full_cudagraphs()
    return stream_budget.graph_budget(
        num_attention_layers=(
            vllm_config.model_config.get_num_layers(parallel)),
        # FULL is run as FULL_AND_PIECEWISE (vLLM's runner, for a backend
        # with uniform-batch support).
        piecewise=(mode.requires_piecewise_compilation()
                   or mode == CUDAGraphMode.FULL),
        full=full,
        # The MTP draft's graphs (spec_decode.draft_graphs).
        draft=(full and num_speculative_tokens > 0
               and parallel.data_parallel_size == 1),
        tensor_parallel=parallel.tensor_parallel_size,
        data_parallel=parallel.data_parallel_size,
        expert_parallel=parallel.enable_expert_parallel)


def _bound_by_streams(vllm_config: "VllmConfig", sizes: list[int],
                      num_speculative_tokens: int) -> list[int]:
    from vllm.config import CUDAGraphMode
    mode = vllm_config.compilation_config.cudagraph_mode
    if (not sizes or vllm_config.model_config is None or mode is None
            or mode == CUDAGraphMode.NONE):
        return sizes
    budget = budget_of(vllm_config, num_speculative_tokens)
    kept = stream_budget.keep_evenly(sizes, budget.max_sizes)
    if len(kept) < len(sizes):
        logger.warning(
            "%d graph capture size(s) fit in the NPU's %d streams for graphs "
            "(%s: %d graph(s) per size, %d stream(s) each): capturing %s, "
            "dropping %s.", budget.max_sizes, budget.streams_for_graphs,
            mode.name, budget.graphs_per_size,
            budget.streams_per_size // budget.graphs_per_size, kept,
            sorted(set(sizes) - set(kept)))
    return sorted(kept, reverse=True)
