import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.quantized_checkpoints import (FIXTURE, float_anti_outlier,
                                               quantize)


@pytest.fixture(scope="session")
def w8a8_dirs(tmp_path_factory) -> dict[str, Path]:
    """The trained fixture as W8A8 (static attention, dynamic MLP and
    experts), with its MTP layer quantized and with it float."""
    tmp = tmp_path_factory.mktemp("w8a8")
    return {
        "quantized_mtp": quantize(FIXTURE, tmp / "quantized-mtp"),
        "float_mtp": quantize(FIXTURE, tmp / "float-mtp", "--float-mtp"),
    }


@pytest.fixture(scope="session")
def anti_outlier_dirs(tmp_path_factory) -> dict[str, Path]:
    """The fixture with anti-outlier (m4) norm biases: W8A8 written by the
    tool with ``--anti-outlier``, and the same shift without quantization
    (every tensor FLOAT, the float model's function)."""
    tmp = tmp_path_factory.mktemp("anti-outlier")
    return {
        "w8a8": quantize(FIXTURE, tmp / "w8a8", "--anti-outlier"),
        "float": float_anti_outlier(FIXTURE, tmp / "float"),
    }


@pytest.fixture(scope="session")
def dist_world() -> Iterator[None]:
    """A 1-rank world, for layers built outside an engine (vLLM's
    parameters read their tensor-parallel rank)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (cleanup_dist_env_and_memory,
                                  init_distributed_environment,
                                  initialize_model_parallel)
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    if model_parallel_is_initialized():
        yield  # another folder's 1-rank world (tests/ops) is up
        return
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tempfile.mkstemp()[1]}",
            local_rank=0,
            backend="gloo")
        initialize_model_parallel(1, 1)
    yield
    cleanup_dist_env_and_memory()
