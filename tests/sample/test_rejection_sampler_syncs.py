"""The rejection sampler reads nothing back from the device: on an NPU a
host read inside the step blocks the host until the target's forward is
done (issue 28: no host-device synchronization in a decode step).

Every device input is a tensor that counts host reads, and so is every
tensor computed from one (a ``__torch_function__`` subclass propagates).
"""

import pytest
import torch

from tests.sample.rejection_inputs import (GREEDY, bonus_tensor,
                                           sampling_metadata, spec_metadata)
from vllm_ascend.sample.rejection_sampler import AscendRejectionSampler

# Host reads of a tensor's values, and ops whose output shape depends on
# them (they sync as well).
_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu,
    torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero,
    torch.nonzero, torch.Tensor.unique, torch.unique,
    torch.Tensor.masked_select, torch.masked_select
}


class _Device(torch.Tensor):
    """A device tensor whose host reads are counted."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            cls.reads.append(getattr(func, "__name__", str(func)))
        if func is torch.Tensor.__getitem__ and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else
                          (args[1], ))):
            cls.reads.append("boolean-mask indexing")
        return super().__torch_function__(func, types, args, kwargs)


def _on_device(t):
    return None if t is None else t.as_subclass(_Device)


@pytest.mark.parametrize("temperature", [None, [0.7, 1.0, 0.9],
                                         [GREEDY, 0.8, GREEDY]],
                         ids=["greedy", "random", "mixed"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_host_read(temperature, k, with_draft_probs):
    torch.manual_seed(0)
    vocab = 32
    drafts = [[(3 * i + j) % vocab for j in range(k)] for i in range(3)]
    metadata = spec_metadata(drafts)
    for name in ("draft_token_ids", "cu_num_draft_tokens",
                 "target_logits_indices", "bonus_logits_indices",
                 "logits_indices"):
        setattr(metadata, name, _on_device(getattr(metadata, name)))
    sampling = sampling_metadata(temperature,
                                 top_k=None if temperature is None else
                                 [5, 10, 32],
                                 generators={1: torch.Generator()})
    sampling.temperature = _on_device(sampling.temperature)
    sampling.top_k = _on_device(sampling.top_k)
    logits = _on_device(torch.randn(3 * k, vocab))
    draft_probs = (_on_device(torch.softmax(torch.randn(3 * k, vocab), -1))
                   if with_draft_probs else None)
    bonus = _on_device(bonus_tensor([1, 2, 3]))
    _Device.reads = []
    out = AscendRejectionSampler().forward(metadata, draft_probs,
                                               logits, bonus, sampling)
    assert _Device.reads == []
    assert out.shape == (3, k + 1)
    # The trap counts: the output read the runner makes afterwards is one.
    out.tolist()
    assert _Device.reads == ["tolist"]
