"""The compilation and graph settings both devices take, NPU and CPU alike.

vLLM decides the compilation level, the cudagraph mode and the capture sizes
from ``--compilation-config`` and ``--enforce-eager`` (the platform supports
static graph mode, so graphs are the default); here the capture sizes are
rounded to multiples of ``1 + k`` and inductor stays off (it would turn the
plugin's custom ops off, ``CustomOp.default_on``, and needs triton). The
pieces between attention calls are captured by the plugin's graph wrapper;
full graphs hold the attention too, its host arguments updated before each
replay (``attention_tasks``). vLLM's runner keeps full graphs to uniform
batches (the attention backend's ``UNIFORM_BATCH`` support) and runs the
rest piecewise.
"""

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_ascend.compilation.capture_sizes import align_capture_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def configure_graph_mode(vllm_config: "VllmConfig",
                         num_speculative_tokens: int) -> None:
    from vllm.config import CompilationLevel, CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    compilation_config.use_inductor = False
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
