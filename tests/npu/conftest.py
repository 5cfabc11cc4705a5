from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.utils.npu import torch_npu_in_process


@pytest.fixture(scope="module")
def groups():
    """Two ranks of the double's ``hccl`` process group in this process
    (threads over one store)."""
    with torch_npu_in_process():
        from torch_npu._hccl import HcclContractGroup
        store = dist.HashStore()
        with ThreadPoolExecutor(2) as pool:
            made = list(pool.map(
                lambda rank: HcclContractGroup(store, rank, 2,
                                               timedelta(seconds=30)),
                range(2)))
        yield made
