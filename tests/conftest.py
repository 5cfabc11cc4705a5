import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CALL_SITE_TEST = "test_npu_call_sites.py"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "npu: an NPU code path; runs on an Ascend NPU when there "
        "is one, else through the torch_npu contract double")
    config.addinivalue_line(
        "markers", "heavy: another multi-process layout of a path CI already "
        "runs; `make test` leaves it to `make nightly`")
    # Every process the tests start (engine cores, DP ranks, servers)
    # records which plugin call sites reached the torch_npu double.
    if "VLLM_ASCEND_NPU_DOUBLE_TRACE" not in os.environ:
        fd, trace = tempfile.mkstemp(prefix="npu-call-sites-", suffix=".txt")
        os.close(fd)
        os.environ["VLLM_ASCEND_NPU_DOUBLE_TRACE"] = trace


def pytest_collection_modifyitems(config, items):
    """The call-site check reads what all other tests reached: run it
    last."""
    items.sort(key=lambda item: item.fspath.basename == CALL_SITE_TEST)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


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
        yield  # a world another test set up is still up
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
