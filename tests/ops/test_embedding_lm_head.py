"""Vocab-parallel embedding and the LM head run unchanged on our platform.

No OOT class is registered for them: on the OOT platform they dispatch to
``forward_oot`` (vLLM's torch ``forward_native``) and use F.embedding /
F.linear. These tests show that path gives the right numbers.
"""

import torch

VOCAB, H = 100, 16  # 100 is padded to 128 rows by vLLM


def test_embedding_and_lm_head_logits(vllm_config, float32_default):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, VocabParallelEmbedding)
    embed = VocabParallelEmbedding(VOCAB, H)
    head = ParallelLMHead(VOCAB, H, prefix="lm_head")
    assert "vllm_ascend" not in type(embed).__module__
    assert embed._forward_method == embed.forward_oot
    g = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, H, generator=g)
    head_w = torch.randn(VOCAB, H, generator=g)
    with torch.no_grad():
        embed.weight_loader(embed.weight, table)
        head.weight_loader(head.weight, head_w)
    ids = torch.tensor([0, 5, 99, 42])
    hidden = embed(ids)
    torch.testing.assert_close(hidden, table[ids])

    logits = LogitsProcessor(VOCAB)(head, hidden)
    assert logits.shape == (4, VOCAB)  # the padding rows are cut off
    expected = table[ids].double() @ head_w.double().t()
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5,
                               atol=1e-4)
