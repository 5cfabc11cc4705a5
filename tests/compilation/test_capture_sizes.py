"""Capture sizes for speculative decoding are multiples of 1 + k."""

from vllm_ascend.compilation.capture_sizes import align_capture_sizes


def test_sizes_round_up_to_multiples_of_verify_batch():
    # The reference serve command's sizes with k = 1.
    sizes = [64, 48, 32, 16, 8, 4, 1]
    assert align_capture_sizes(sizes, 1) == [64, 48, 32, 16, 8, 4, 2]
    got = align_capture_sizes(sizes, 2)
    assert got == [66, 48, 33, 18, 9, 6, 3]
    assert all(size % 3 == 0 for size in got)


def test_without_speculation_sizes_are_unchanged():
    assert align_capture_sizes([8, 4, 1], 0) == [8, 4, 1]
    assert align_capture_sizes([], 3) == []
