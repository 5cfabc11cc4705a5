"""The torch_npu paged attention against the reference, and the metadata
the kernels take.

On an Ascend NPU the real kernels run; elsewhere the torch_npu contract
double, which rejects a call the kernel would (layout, dtypes, cumulative
query lengths, block size, mask).
"""

import pytest
import torch

from tests.utils.npu import to_npu, torch_npu_in_process
from vllm_ascend.attention.backend import (SLOT_MAPPING_DTYPE,
                                           AscendAttentionMetadata,
                                           AscendAttentionMetadataBuilder,
                                           classify_batch)
from vllm_ascend.attention.paged_attention import (NpuPagedAttention,
                                                   ReferencePagedAttention)

BLOCK, KV_HEADS, HEADS, DIM = 128, 2, 8, 128


@pytest.fixture(scope="module")
def npu_ops():
    with torch_npu_in_process():
        yield NpuPagedAttention()


def _metadata(q_lens, seq_lens, block_tables, slot_mapping):
    q_lens = torch.tensor(q_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    return AscendAttentionMetadata(
        num_actual_tokens=int(q_lens.sum()), num_reqs=len(seq_lens),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq.max()),
        query_start_loc=to_npu(qsl), query_start_loc_cpu=qsl,
        seq_lens=to_npu(seq), seq_lens_cpu=seq,
        block_tables=to_npu(block_tables),
        slot_mapping=to_npu(slot_mapping.to(SLOT_MAPPING_DTYPE)),
        attn_state=classify_batch(q_lens, seq, int(q_lens.max())),
        seq_lens_list=seq.tolist(), query_ends=qsl[1:].tolist())


@pytest.mark.npu
@pytest.mark.parametrize("shapes", [
    [(9, 9), (5, 5)],  # prefill
    [(1, 7), (1, 200), (1, 1)],  # decode
    [(3, 140), (6, 6), (1, 5)],  # chunked prefill mixed with decode
    [(2, 131), (2, 3), (2, 8)],  # 1 + k verification tokens
])
def test_npu_kernels_match_reference(npu_ops, shapes):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    num_blocks = 8
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    value_cache = torch.randn_like(key_cache)
    free = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(shapes), 2, dtype=torch.int32)
    slots = []
    for i, (q_len, seq_len) in enumerate(shapes):
        n = -(-seq_len // BLOCK)
        block_tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(block_tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
    slot_mapping = torch.cat(slots)
    tokens = slot_mapping.numel()
    key = torch.randn(tokens, KV_HEADS, DIM).to(dtype)
    value = torch.randn_like(key)
    query = torch.randn(tokens, HEADS, DIM).to(dtype)
    meta = _metadata([s[0] for s in shapes], [s[1] for s in shapes],
                     block_tables, slot_mapping)

    ref = ReferencePagedAttention()
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ref.write_kv_cache(key, value, ref_k, ref_v, slot_mapping)
    want = torch.empty_like(query)
    ref.attention(query, ref_k, ref_v, meta, DIM**-0.5, want)

    npu_k, npu_v = to_npu(key_cache.clone()), to_npu(value_cache.clone())
    npu_ops.write_kv_cache(to_npu(key), to_npu(value), npu_k, npu_v,
                           meta.slot_mapping)
    assert torch.equal(npu_k.cpu(), ref_k) and torch.equal(npu_v.cpu(), ref_v)
    got = to_npu(torch.empty_like(query))
    npu_ops.attention(to_npu(query), npu_k, npu_v, meta, DIM**-0.5, got)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2,
                               atol=2e-2)


class _SyncTrap(torch.Tensor):
    """A device tensor whose host reads (a device-to-host sync) fail."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item,
                    torch.Tensor.cpu, torch.Tensor.__bool__):
            raise AssertionError(f"host sync: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _draft_common(seq_lens, seq_lens_cpu):
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=seq_lens.as_subclass(_SyncTrap), seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=seq_lens_cpu - 2, num_reqs=2,
        num_actual_tokens=4, max_query_len=2,
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=torch.zeros(2, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(4, dtype=torch.int64))


def _builder():
    builder = AscendAttentionMetadataBuilder.__new__(
        AscendAttentionMetadataBuilder)
    builder.num_spec_tokens = 3
    builder.slot_mapping = torch.full((8, ), -1, dtype=torch.int32)
    return builder


def test_builder_reads_host_lengths_without_a_device_sync(monkeypatch):
    """No draft step reads the device on the NPU path (S3-12): in draft
    steps 2..k the host lengths are the host's upper bounds (patch 0008);
    the CPU reference reads its (host) seq_lens, exact."""
    from vllm_ascend.attention import backend
    builder = _builder()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    common = _draft_common(seq.clone(), seq)
    # The target step and the first draft step: exact host copies.
    assert builder.build(0, common).seq_lens_list == [5, 9]
    assert builder.build_for_drafting(common, 0).seq_lens_list == [5, 9]
    # Draft steps 2..k, k = 2 and 3: the device lengths (here 2 and 1
    # drafts rejected) are below the host's bounds; a read of them would
    # trip the trap.
    monkeypatch.setattr(backend, "draft_host_seq_lens",
                        backend._draft_seq_lens_known_on_host)
    for step in (1, 2):
        bound = seq + step
        common = _draft_common(torch.tensor([4, 8]) + step, bound)
        metadata = builder.build_for_drafting(common, step)
        assert metadata.seq_lens_list == bound.tolist()
        assert all(host >= exact for host, exact in zip(
            metadata.seq_lens_list, (torch.tensor([4, 8]) + step).tolist()))
    # The CPU reference (its seq_lens on the host): the exact lengths.
    monkeypatch.setattr(backend, "draft_host_seq_lens",
                        backend._draft_seq_lens_from_tensor)
    common = _draft_common(torch.tensor([4, 8]), seq)
    common.seq_lens = torch.tensor([4, 8])
    assert builder.build_for_drafting(common, 1).seq_lens_list == [4, 8]


def test_the_npu_path_selects_host_bounds_for_drafts():
    from vllm_ascend.attention import backend
    from vllm_ascend.device import npu_kernels
    want = (backend._draft_seq_lens_known_on_host
            if npu_kernels() else backend._draft_seq_lens_from_tensor)
    assert backend.draft_host_seq_lens is want


def test_full_graph_tasks_share_one_workspace(npu_ops):
    """In a full graph the fused attention is a task: its capture and every
    update pass the one workspace ``_get_max_workspace`` gave the graph
    (the double refuses a graph launch or update without it, or with
    another one); the updated replay attends with the new lengths."""
    from vllm_ascend.attention import graph_tasks
    torch.manual_seed(0)
    dtype = torch.bfloat16
    key_cache = torch.randn(8, BLOCK, KV_HEADS, DIM).to(dtype)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    query = torch.randn(4, HEADS, DIM).to(dtype)
    outputs = [torch.zeros_like(query) for _ in range(2)]
    slots = torch.full((4, ), -1, dtype=torch.int64)
    # Captured as two requests of 2 tokens; replayed as 1 + 3.
    captured = _metadata([2, 2], [131, 3], block_tables, slots)
    replayed = _metadata([1, 3], [7, 200], block_tables, slots)

    graph = torch.npu.NPUGraph()
    tasks: list[graph_tasks.AttentionTask] = []
    with torch.npu.graph(graph), graph_tasks.collecting(tasks):
        for i, out in enumerate(outputs):
            graph_tasks.launch_task(f"layer.{i}", npu_ops, query,
                                        key_cache, value_cache, captured,
                                        DIM**-0.5, out)
    assert len(tasks) == 2 and tasks[0].workspace is not None
    assert tasks[1].workspace is tasks[0].workspace

    graph_tasks.update_tasks(tasks, {
        "layer.0": replayed,
        "layer.1": replayed
    })
    graph.replay()
    want = torch.empty_like(query)
    ReferencePagedAttention().attention(query, key_cache, value_cache,
                                        replayed, DIM**-0.5, want)
    for out in outputs:
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2,
                                   atol=2e-2)
    # An idle DP rank's replay: not updated, the captured workspace stays.
    graph_tasks.update_tasks(tasks, None)
    graph.replay()


def test_attention_layers_share_one_mask(npu_ops):
    """One 2048 x 2048 causal mask for every layer (S3-6), not one per
    layer (93 x 4 MiB on GLM-4.5): the fused attention of every layer gets
    the same storage."""
    # What each attention layer holds on the NPU path (the process chose
    # its ops at import: the NPU ones are built here as each layer would).
    layers = [NpuPagedAttention() for _ in range(4)]
    query = torch.zeros(2, HEADS, DIM, dtype=torch.bfloat16)
    cache = torch.zeros(2, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
    masks = [
        layer._arguments(query, cache, cache,
                             torch.zeros(1, 1, dtype=torch.int32), [2], [2],
                             DIM**-0.5)["atten_mask"] for layer in layers
    ]
    assert masks[0].shape == (2048, 2048)
    assert len({m.untyped_storage().data_ptr() for m in masks}) == 1
    assert torch.equal(masks[0], torch.ones(2048, 2048).triu(1).bool())


def test_kv_writes_take_the_int32_slots_without_a_cast(npu_ops):
    """The builder keeps the slot mapping int32 (S3-7): a step's KV writes
    are one kernel per layer, the slots cast once per step by the builder's
    copy, not once per layer (before: a ``_to_copy`` per layer)."""
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS,
                             head_size=DIM, dtype=torch.bfloat16)
    builder = AscendAttentionMetadataBuilder(spec, ["a"], VllmConfig(),
                                             torch.device("cpu"))
    assert builder.slot_mapping.dtype == torch.int32
    slots = torch.tensor([3, 130, -1, 7])
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    seq = torch.tensor([4, 131, 1, 8], dtype=torch.int32)
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq,
        seq_lens_cpu=seq, num_computed_tokens_cpu=seq - 1, num_reqs=4,
        num_actual_tokens=4, max_query_len=1, max_seq_len=131,
        block_table_tensor=torch.arange(8, dtype=torch.int32).view(4, 2),
        slot_mapping=slots)
    key = torch.randn(4, KV_HEADS, DIM).bfloat16()
    caches = [torch.zeros(4, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
              for _ in range(6)]
    metadata = builder.build(0, common)  # host work, once per step
    assert metadata.slot_mapping.dtype == torch.int32
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        for layer in range(3):
            npu_ops.write_kv_cache(key, key, caches[2 * layer],
                                   caches[2 * layer + 1],
                                   metadata.slot_mapping)
    kernels = [getattr(n.func, "__name__", str(n.func))
               for n in graph._nodes if getattr(n, "kind", "") != "alias"]
    # One write per layer, nothing else (before: a cast per layer too).
    assert kernels == ["_npu_reshape_and_cache"] * 3, kernels
    graph.replay()
    ref = torch.zeros_like(caches[0])
    ReferencePagedAttention().write_kv_cache(key, key, ref, ref.clone(),
                                             slots)
    assert all(torch.equal(c, ref) for c in caches)


def test_npu_refuses_float16_at_startup():
    """The fused attention's TND layout is bfloat16 only (op-plugin 7.2.0
    torch_npu-npu_fused_infer_attention_score.md:224): ``--dtype float16``
    fails at startup in one line that says what to use."""
    from types import SimpleNamespace

    from vllm_ascend import platform
    model_config = SimpleNamespace(dtype=torch.float16, quantization=None,
                                   get_head_size=lambda: DIM)
    config = SimpleNamespace(model_config=model_config,
                             cache_config=SimpleNamespace(block_size=BLOCK))
    with pytest.raises(ValueError) as error:
        platform._check_npu_limits(config)
    assert str(error.value) == (
        "dtype torch.float16 is not supported on the Ascend NPU (the fused "
        "attention's TND layout takes bfloat16 only): use --dtype bfloat16.")
    model_config.dtype = torch.bfloat16
    platform._check_npu_limits(config)
