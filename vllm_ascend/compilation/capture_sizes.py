"""Graph capture sizes that speculative decoding can replay.

A verification batch holds ``1 + k`` tokens per request, so a captured graph
is only ever replayed for token counts that are multiples of ``1 + k``.
"""

from vllm.logger import init_logger

logger = init_logger(__name__)


def align_capture_sizes(sizes: list[int], num_speculative_tokens: int
                        ) -> list[int]:
    """Round each capture size up to a multiple of ``1 + k``, deduplicated
    and in vLLM's order (descending). Without speculation: unchanged."""
    step = 1 + num_speculative_tokens
    if step == 1 or not sizes:
        return list(sizes)
    aligned = sorted({-(-size // step) * step for size in sizes},
                     reverse=True)
    if aligned != sorted(sizes, reverse=True):
        logger.warning(
            "Graph capture sizes %s are not all multiples of 1 + "
            "num_speculative_tokens = %d; capturing %s instead.",
            sorted(sizes), step, aligned)
    return aligned
