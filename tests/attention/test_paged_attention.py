"""The paged attention reference against dense causal attention.

Requests of different context and query lengths (prefill, decode, chunked
prefill, 1 + k verification tokens) are scattered over shuffled cache
blocks; the result must equal scaled_dot_product_attention over each
request's contiguous keys and values.
"""

import pytest
import torch
import torch.nn.functional as F

from vllm_ascend.attention.backend import (AscendAttentionMetadata,
                                           AscendAttentionState,
                                           classify_batch)
from vllm_ascend.attention.paged_attention import ReferencePagedAttention

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 8, 16


def _dense(q, k, v, scale):
    # q [L, H, D], k/v [S, KVH, D]; the L queries are the last L positions.
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(),
                                         k.transpose(0, 1).double(),
                                         v.transpose(0, 1).double(),
                                         attn_mask=mask,
                                         scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("shapes", [
    [(9, 9), (5, 5)],  # prefill
    [(1, 7), (1, 12), (1, 1)],  # decode
    [(3, 10), (6, 6), (1, 5)],  # chunked prefill mixed with decode
    [(2, 11), (2, 3), (2, 8)],  # 1 + k verification tokens
])
def test_reference_matches_dense_attention(shapes):
    torch.manual_seed(0)
    ops = ReferencePagedAttention()
    num_blocks = 64
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(num_blocks).tolist()
    max_blocks = 8
    block_tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    contexts, queries, slots = [], [], []
    for i, (q_len, seq_len) in enumerate(shapes):
        n = -(-seq_len // BLOCK)
        block_tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        k = torch.randn(seq_len, KV_HEADS, DIM)
        v = torch.randn(seq_len, KV_HEADS, DIM)
        contexts.append((k, v))
        queries.append(torch.randn(q_len, HEADS, DIM))
        pos = torch.arange(seq_len)
        req_slots = block_tables[i, pos // BLOCK] * BLOCK + pos % BLOCK
        # The context before this step is already cached ...
        cached = seq_len - q_len
        key_cache.view(-1, KV_HEADS, DIM)[req_slots[:cached]] = k[:cached]
        value_cache.view(-1, KV_HEADS, DIM)[req_slots[:cached]] = v[:cached]
        slots.append(req_slots[cached:])
    # ... and this step's tokens are written by write_kv_cache.
    new_k = torch.cat([k[len(k) - q.shape[0]:]
                       for (k, _), q in zip(contexts, queries)])
    new_v = torch.cat([v[len(v) - q.shape[0]:]
                       for (_, v), q in zip(contexts, queries)])
    slot_mapping = torch.cat(slots)
    # A padded token (slot -1) must write nothing.
    ops.write_kv_cache(torch.cat([new_k, torch.full_like(new_k[:1], 99.)]),
                       torch.cat([new_v, torch.full_like(new_v[:1], 99.)]),
                       key_cache, value_cache,
                       torch.cat([slot_mapping, torch.tensor([-1])]))
    assert not bool((key_cache == 99.).any())

    query = torch.cat(queries)
    q_lens = torch.tensor([s[0] for s in shapes])
    seq_lens = torch.tensor([s[1] for s in shapes], dtype=torch.int32)
    qsl = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    meta = AscendAttentionMetadata(
        num_actual_tokens=query.shape[0], num_reqs=len(shapes),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens, block_tables=block_tables,
        slot_mapping=slot_mapping,
        attn_state=classify_batch(q_lens, seq_lens, int(q_lens.max())),
        seq_lens_list=seq_lens.tolist(), query_ends=qsl[1:].tolist())
    output = torch.empty_like(query)
    scale = DIM**-0.5
    ops.attention(query, key_cache, value_cache, meta, scale, output)
    for i, ((k, v), q) in enumerate(zip(contexts, queries)):
        got = output[qsl[i]:qsl[i + 1]].double()
        torch.testing.assert_close(got, _dense(q, k, v, scale), rtol=1e-5,
                                   atol=1e-5)


def test_batch_classification():
    t = torch.tensor
    assert classify_batch(t([1, 1]), t([5, 9]),
                          1) == AscendAttentionState.DECODE_ONLY
    assert classify_batch(t([4, 3]), t([4, 3]),
                          4) == AscendAttentionState.PREFILL_NO_CACHE
    assert classify_batch(t([4, 1]), t([9, 3]),
                          4) == AscendAttentionState.CHUNKED_PREFILL
