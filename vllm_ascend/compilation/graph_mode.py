"""The compilation and graph settings both devices take, NPU and CPU alike.

vLLM computes the capture sizes (the platform supports static graph mode)
from ``--compilation-config`` or its defaults; here they are rounded to
multiples of ``1 + k``. Inductor stays off: it would turn the plugin's
custom ops off (``CustomOp.default_on``) and needs triton on the device.
The plugin does not capture graphs yet, so a run that asked for graphs
runs eager, as with ``--enforce-eager``, after one warning.
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
    model_config = vllm_config.model_config
    compilation_config.use_inductor = False
    if compilation_config.cudagraph_capture_sizes is None:
        vllm_config._set_cudagraph_sizes()
    sizes = compilation_config.cudagraph_capture_sizes
    aligned = align_capture_sizes(sizes, num_speculative_tokens)
    if aligned != sizes:
        compilation_config.cudagraph_capture_sizes = aligned
        compilation_config.init_with_cudagraph_sizes(aligned)

    eager = (model_config is None or model_config.enforce_eager
             or compilation_config.level == CompilationLevel.NO_COMPILATION)
    if not eager:
        logger.warning(
            "vllm_ascend does not capture graphs yet: running eager, as with "
            "--enforce-eager (requested compilation level %d, cudagraph_mode "
            "%s, capture sizes %s).", compilation_config.level,
            compilation_config.cudagraph_mode.name
            if compilation_config.cudagraph_mode is not None else None,
            compilation_config.cudagraph_capture_sizes)
    compilation_config.level = CompilationLevel.NO_COMPILATION
    compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    if model_config is not None:
        model_config.enforce_eager = True
