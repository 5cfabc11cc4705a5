"""Each documented limit of the torch_npu double fires.

A call the real op would reject must fail here too, with the op's name in
the message, or CI would pass code that crashes on an NPU. Every case
first makes one valid call, then breaks one argument.
"""

import pytest
import torch

from tests.utils.npu import REAL_NPU, torch_npu_in_process

pytestmark = pytest.mark.skipif(
    REAL_NPU, reason="checks the double; a real NPU has the real contracts")


@pytest.fixture(scope="module")
def tnpu():
    with torch_npu_in_process() as module:
        yield module


BF16 = torch.bfloat16


def _attention_args(head_dim=128, block_size=128, dtype=BF16, q_lens=(3, 1),
                    kv_lens=(5, 130)):
    torch.manual_seed(0)
    heads, kv_heads = 4, 2
    tokens = sum(q_lens)
    blocks = 4
    query = torch.randn(tokens, heads, head_dim).to(dtype)
    key = torch.randn(blocks, block_size, kv_heads * head_dim).to(dtype)
    value = torch.randn_like(key)
    cum, total = [], 0
    for q in q_lens:
        total += q
        cum.append(total)
    kwargs = dict(
        atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        input_layout="TND", block_size=block_size, actual_seq_lengths=cum,
        actual_seq_lengths_kv=list(kv_lens), num_key_value_heads=kv_heads,
        num_heads=heads, scale=head_dim**-0.5, sparse_mode=3)
    return (query, key, value), kwargs


def _fia(tnpu, args, **changes):
    pos, kwargs = args
    return tnpu.npu_fused_infer_attention_score(*pos, **{**kwargs, **changes})


def test_attention_valid_call_matches_dense(tnpu):
    (q, k, v), kwargs = args = _attention_args()
    out, lse = _fia(tnpu, args)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.numel() == 0
    # Request 0: 3 query tokens at positions 2..4 of a 5-token context.
    keys = k.view(4, 128, 2, 128)[0, :5].float().repeat_interleave(2, 1)
    vals = v.view(4, 128, 2, 128)[0, :5].float().repeat_interleave(2, 1)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:3].float().transpose(0, 1), keys.transpose(0, 1),
        vals.transpose(0, 1), attn_mask=mask,
        scale=kwargs["scale"]).transpose(0, 1)
    torch.testing.assert_close(out[:3].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("change,match", [
    (dict(dtype=torch.float32), "query dtype"),
    (dict(dtype=torch.float16), "TND .* supports bfloat16 only"),
    (dict(block_size=16), "block_size=16"),
    (dict(head_dim=32), "head dim 128 or 192"),
], ids=["float32-query", "float16-tnd", "block-size-16", "head-dim-32"])
def test_attention_documented_limits(tnpu, change, match):
    with pytest.raises(RuntimeError, match=match):
        _fia(tnpu, _attention_args(**change))
    # The workspace query makes the op's checks too.
    (q, k, v), kwargs = _attention_args(**change)
    with pytest.raises(RuntimeError, match=match):
        tnpu._npu_fused_infer_attention_score_get_max_workspace(
            q, k, v, **kwargs)


def test_attention_max_workspace(tnpu):
    """``_npu_fused_infer_attention_score_get_max_workspace``: the op's
    schema without ``out``, a 1-D tensor of query's dtype."""
    (q, k, v), kwargs = _attention_args()
    workspace = tnpu._npu_fused_infer_attention_score_get_max_workspace(
        q, k, v, **kwargs)
    assert workspace.dim() == 1 and workspace.dtype == q.dtype
    with pytest.raises(TypeError, match="unexpected keyword"):
        tnpu._npu_fused_infer_attention_score_get_max_workspace(
            q, k, v, **kwargs, workspace=workspace)
    with pytest.raises(RuntimeError, match="cumulative"):
        tnpu._npu_fused_infer_attention_score_get_max_workspace(
            q, k, v, **{**kwargs, "actual_seq_lengths": [3, 1]})


def _captured_attention(tnpu, workspace):
    """One ``.out`` launch captured in a task group, as the plugin's full
    graphs do; returns (graph, handle, event, args, out)."""
    (q, k, v), kwargs = args = _attention_args()
    out = [torch.empty_like(q), torch.empty(1)]
    graph = torch.npu.NPUGraph()
    event = torch.npu.ExternalEvent()
    with torch.npu.graph(graph):
        event.wait(None)
        event.reset(None)
        torch.npu.graph_task_group_begin(None)
        tnpu.npu_fused_infer_attention_score.out(q, k, v, **kwargs,
                                                 workspace=workspace, out=out)
        handle = torch.npu.graph_task_group_end(None)
    return graph, handle, event, args, out


def test_attention_out_in_graphs_needs_the_captured_workspace(tnpu):
    """Captured and updated ``.out`` launches pass the workspace of
    ``_get_max_workspace``, the same one each time (op-plugin 7.2.0
    torch_npu-npu-graph_task_group_begin.md:68-80, task_update_begin.md:
    71-91; without it the task keeps a workspace freed after the call)."""
    (q, k, v), kwargs = _attention_args()
    refused = pytest.raises(RuntimeError, match="capture without workspace")
    with refused, torch.npu.graph(torch.npu.NPUGraph()):
        tnpu.npu_fused_infer_attention_score.out(
            q, k, v, **kwargs, out=[torch.empty_like(q), torch.empty(1)])

    workspace = tnpu._npu_fused_infer_attention_score_get_max_workspace(
        q, k, v, **kwargs)
    graph, handle, event, ((q, k, v), kwargs), out = _captured_attention(
        tnpu, workspace)
    # The second request now has 2 query tokens of its 131.
    new = {**kwargs, "actual_seq_lengths": [2, 4],
           "actual_seq_lengths_kv": [5, 131]}
    other = workspace.clone()
    torch.npu.graph_task_update_begin(None, handle)
    with pytest.raises(RuntimeError, match="task update without workspace"):
        tnpu.npu_fused_infer_attention_score.out(q, k, v, **new, out=out)
    with pytest.raises(RuntimeError, match="not the captured launch's"):
        tnpu.npu_fused_infer_attention_score.out(q, k, v, **new,
                                                 workspace=other, out=out)
    tnpu.npu_fused_infer_attention_score.out(q, k, v, **new,
                                             workspace=workspace, out=out)
    torch.npu.graph_task_update_end(None)
    event.record(None)
    graph.replay()
    want, _ = tnpu.npu_fused_infer_attention_score(q, k, v, **new)
    torch.testing.assert_close(out[0], want)


def test_attention_out_variant_writes_into_out(tnpu):
    """``.out``: what a captured launch and its task updates share."""
    (q, k, v), kwargs = args = _attention_args()
    want, _ = _fia(tnpu, args)
    out, lse = torch.empty_like(q), torch.empty(1)
    tnpu.npu_fused_infer_attention_score.out(q, k, v, **kwargs,
                                             out=[out, lse])
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("out,match", [
    (lambda q: [torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype),
                torch.empty(1)], "must match query"),
    (lambda q: [torch.empty_like(q, dtype=torch.float32), torch.empty(1)],
     "must match query"),
    (lambda q: [torch.empty_like(q)], r"out must be \[attention_out"),
], ids=["rows", "dtype", "no-lse"])
def test_attention_out_variant_limits(tnpu, out, match):
    (q, k, v), kwargs = _attention_args()
    with pytest.raises(RuntimeError, match=match):
        tnpu.npu_fused_infer_attention_score.out(q, k, v, **kwargs,
                                                 out=out(q))


def test_attention_decode_allows_small_blocks(tnpu):
    # Q_S == 1: block_size only needs 16-alignment.
    args = _attention_args(block_size=16, q_lens=(1, 1), kv_lens=(5, 30))
    _fia(tnpu, args)


@pytest.mark.parametrize("changes,error,match", [
    (dict(actual_seq_lengths=torch.tensor([3, 4])), TypeError, "list of ints"),
    (dict(actual_seq_lengths=[3, 1]), RuntimeError, "cumulative"),
    (dict(actual_seq_lengths_kv=[5]), RuntimeError, "batch"),
    (dict(atten_mask=None), RuntimeError, "2048x2048"),
    (dict(atten_mask=torch.ones(128, 128, dtype=torch.bool)), RuntimeError,
     "2048x2048"),
    (dict(block_table=torch.tensor([[0, 1], [2, 3]])), RuntimeError,
     "int32"),
    (dict(block_size=256), RuntimeError, "paged key"),
    (dict(num_heads=8), RuntimeError, "num_heads"),
    (dict(sparse_mode=1), RuntimeError, "sparse_mode"),
    (dict(actual_seq_lengths_kv=[2, 130]), RuntimeError, "KV length"),
    (dict(actual_seq_lengths_kv=[5, 300]), RuntimeError, "fewer blocks"),
    (dict(input_layout="TNDX"), RuntimeError, "input_layout"),
    (dict(atten_mask=torch.ones(2048, 2048).triu(1)), RuntimeError,
     "bool/int8/uint8"),
    (dict(num_key_value_heads=3), RuntimeError, "multiple of"),
    (dict(softmax_scale=1.0), TypeError, "unexpected keyword"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_attention_argument_contracts(tnpu, changes, error, match):
    with pytest.raises(error, match=match):
        _fia(tnpu, _attention_args(), **changes)


def test_reshape_and_cache(tnpu):
    key = torch.randn(3, 2, 128).to(BF16)
    cache = torch.zeros(2, 128, 2, 128, dtype=BF16)
    vcache = torch.zeros_like(cache)
    slots = torch.tensor([5, -1, 130], dtype=torch.int32)
    tnpu._npu_reshape_and_cache(key=key, value=key, key_cache=cache,
                                value_cache=vcache, slot_indices=slots)
    assert torch.equal(cache[0, 5], key[0]) and torch.equal(cache[1, 2],
                                                            key[2])
    assert int((cache != 0).any(-1).any(-1).sum()) == 2  # slot -1: nothing
    bad = [
        (dict(slot_indices=slots.long()), "int32"),
        (dict(key_cache=cache.float(), value_cache=vcache.float()), "dtype"),
        (dict(value=key.half()), "same dtype"),
        (dict(key_cache=cache.flatten(2)), "num_blocks, block_size"),
        (dict(slot_indices=slots[:2]), "num_tokens"),
    ]
    for change, match in bad:
        call = dict(key=key, value=key, key_cache=cache, value_cache=vcache,
                    slot_indices=slots, **{})
        call.update(change)
        with pytest.raises(RuntimeError, match=match):
            tnpu._npu_reshape_and_cache(**call)


def test_norm_and_activation_contracts(tnpu):
    x = torch.randn(4, 64).to(BF16)
    g = torch.ones(64, dtype=BF16)
    y, rstd = tnpu.npu_rms_norm(x, g, 1e-6)
    assert rstd.shape == (4, 1) and rstd.dtype == torch.float32
    with pytest.raises(RuntimeError, match="trailing dims"):
        tnpu.npu_rms_norm(x, torch.ones(32, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="2-8 dims"):
        tnpu.npu_rms_norm(x[0], g, 1e-6)
    with pytest.raises(RuntimeError, match="unsupported dtypes"):
        tnpu.npu_rms_norm(x.float(), g, 1e-6)
    y, rstd, s = tnpu.npu_add_rms_norm(x, x, g, 1e-6)
    torch.testing.assert_close(s, x + x)
    with pytest.raises(RuntimeError, match="gamma must have x1's dtype"):
        tnpu.npu_add_rms_norm(x, x, g.float(), 1e-6)
    with pytest.raises(RuntimeError, match="same dtype and shape"):
        tnpu.npu_add_rms_norm(x, x.half(), g, 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        tnpu.npu_swiglu(torch.randn(4, 63), dim=-1)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        tnpu.npu_swiglu(torch.randn(64, 4).t(), dim=-1)


def test_rotary_mul_contracts(tnpu):
    x = torch.randn(1, 5, 4, 64)
    cos = torch.randn(1, 5, 1, 64)
    assert tnpu.npu_rotary_mul(x, cos, cos, rotary_mode="half").shape == \
        x.shape
    with pytest.raises(RuntimeError, match="half or interleave"):
        tnpu.npu_rotary_mul(x, cos, cos, rotary_mode="neox")
    with pytest.raises(RuntimeError, match="dimension must be 4"):
        tnpu.npu_rotary_mul(x[0], cos[0], cos[0])
    with pytest.raises(RuntimeError, match="cannot broadcast"):
        tnpu.npu_rotary_mul(x, cos.expand(1, 5, 4, 64)[:, :, :2],
                            cos.expand(1, 5, 4, 64)[:, :, :2])
    with pytest.raises(RuntimeError, match="D=63"):
        tnpu.npu_rotary_mul(x[..., :63], cos[..., :63], cos[..., :63])
    # Query and key heads stacked along N (the plugin's one launch per
    # layer) stay below the documented 1000.
    wide = torch.randn(1, 5, 1000, 64)
    with pytest.raises(RuntimeError, match="N < 1000"):
        tnpu.npu_rotary_mul(wide, cos, cos)


def test_gating_top_k_contracts(tnpu):
    # DeepSeek-V3's pattern, the one CANN 8.3 runs: 256 experts in 8
    # groups, the best 4 groups, 8 experts.
    logits = torch.randn(6, 256)
    bias = torch.randn(256)
    ok = dict(k=8, bias=bias, k_group=4, group_count=8, group_select_mode=1,
              renorm=0, norm_type=1, out_flag=False,
              routed_scaling_factor=1.0, eps=1e-20)
    y, ids, _ = tnpu.npu_moe_gating_top_k(logits, **ok)
    assert ids.dtype == torch.int32 and y.shape == (6, 8)
    torch.testing.assert_close(y.sum(-1), torch.ones(6))
    for change, match in [
        (dict(renorm=1), "renorm"),
        (dict(group_count=128), "quotient > 2"),
        (dict(k=129), "k=129"),
        (dict(k_group=9), "k_group"),
        (dict(bias=bias.half()), "dtype of x and bias"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_moe_gating_top_k(logits, **{**ok, **change})
    with pytest.raises(RuntimeError, match="2048"):
        tnpu.npu_moe_gating_top_k(torch.randn(2, 4096), 4, bias=None,
                                  group_count=1)
    # GLM-4.5's 160 experts: documented (at most 2048), but CANN 8.3 takes
    # the 256-expert pattern only (vllm-ascend v0.11.0 experts_selector.py).
    for groups, k_group in [(1, 1), (8, 4)]:
        with pytest.raises(RuntimeError, match="160 experts.*256-expert"):
            tnpu.npu_moe_gating_top_k(
                torch.randn(6, 160), **{**ok, "bias": torch.randn(160),
                                        "group_count": groups,
                                        "k_group": k_group})


def _routing(tnpu, x, ids, **changes):
    kwargs = dict(active_num=ids.numel(), expert_capacity=-1, expert_num=5,
                  drop_pad_mode=0, expert_tokens_num_type=1,
                  expert_tokens_num_flag=True, quant_mode=-1,
                  active_expert_range=[0, 4], row_idx_type=1)
    return tnpu.npu_moe_init_routing_v2(x, ids, **{**kwargs, **changes})


def test_init_routing_and_grouped_matmul(tnpu):
    x = torch.randn(3, 8)
    # Expert 4 lies outside active_expert_range: its rows go last.
    ids = torch.tensor([[1, 4], [0, 1], [4, 3]], dtype=torch.int32)
    expanded, src, counts, _ = _routing(tnpu, x, ids)
    assert counts.tolist() == [1, 2, 0, 1] and counts.dtype == torch.int64
    assert src[:4].tolist() == [2, 0, 3, 5]  # flat slot t * k + j
    assert torch.equal(expanded[:4], x[src[:4].long() // 2])
    assert bool(expanded[4:].isnan().all())  # invalid rows: undefined
    for change, match in [(dict(expert_tokens_num_type=0), "num_type"),
                          (dict(active_num=5), "active_num"),
                          (dict(active_expert_range=[0, 6]), "expert_end")]:
        with pytest.raises(RuntimeError, match=match):
            _routing(tnpu, x, ids, **change)
    with pytest.raises(RuntimeError, match="int32"):
        _routing(tnpu, x, ids.long())

    w = torch.randn(4, 8, 6)
    y = tnpu.npu_grouped_matmul([expanded], [w], group_list=counts,
                                split_item=2, group_type=0,
                                group_list_type=1)[0]
    torch.testing.assert_close(y[0], expanded[0] @ w[0])
    torch.testing.assert_close(y[3], expanded[3] @ w[3])
    # Rows past sum(group_list) are not computed: an EP caller that adds
    # them up (even times a zero weight) gets NaN.
    assert bool(y[4:].isnan().all())
    gm = dict(group_list=counts, split_item=2, group_type=0,
              group_list_type=1)
    for change, match in [(dict(group_type=None), "group_type"),
                          (dict(group_list=counts.int()), "int64"),
                          (dict(group_list=counts[:1], ), "length"),
                          (dict(group_list=counts + 3), "covers"),
                          (dict(split_item=7), "split_item")]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_grouped_matmul([expanded], [w], **{**gm, **change})
    with pytest.raises(RuntimeError, match="cannot have length 1"):
        tnpu.npu_grouped_matmul([expanded], [w[:1]], **{
            **gm, "group_list": counts[:1]})


def test_runtime_contracts(tnpu):
    torch.npu.set_device(0)
    torch.npu.set_device("npu:1")
    torch.npu.set_device("npu")
    with pytest.raises(ValueError, match="expected a npu device"):
        torch.npu.set_device(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.npu.set_device(99)
    free, total = torch.npu.mem_get_info()
    assert 0 < free <= total == torch.npu.get_device_properties(
        0).total_memory
    stream = torch.npu.Stream()
    event = torch.npu.Event()
    with torch.npu.stream(stream):
        event.record()
        assert torch.npu.current_stream() is stream
    assert torch.npu.current_stream() is not stream
    with pytest.raises(TypeError, match="torch.npu.Stream"):
        event.record(object())
    with pytest.raises(TypeError, match="unexpected"):
        torch.npu.Event(enable_timing=False, device=0)


def test_dynamic_quant(tnpu):
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]).to(BF16)
    q, scale = tnpu.npu_dynamic_quant(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([2.0 / 127, 0.0]))
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    for bad, match in [(x.float(), "input"), (x[0], "2-8 dims")]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_dynamic_quant(bad)


def test_quantize(tnpu):
    x = torch.tensor([[1.0, -3.0], [100.0, 0.26]]).to(BF16)
    scales = torch.tensor([2.0, 0.5]).to(BF16)
    offsets = torch.tensor([1.0, 0.0]).to(BF16)
    q = tnpu.npu_quantize(x, scales, offsets, torch.qint8, -1, False)
    # y = round(x * scale + offset), saturated to int8.
    assert q.dtype == torch.int8
    assert q.tolist() == [[3, -2], [127, 0]]
    # One scale for every channel, no zero points; axis 1 is the last axis.
    q = tnpu.npu_quantize(x, scales[:1], None, torch.qint8, 1, False)
    assert q.tolist() == [[2, -6], [127, 1]]
    three = torch.ones(3, dtype=BF16)
    for args, match in [
        ((x, scales.float(), offsets, torch.qint8, -1, False), "scales dtype"),
        ((x, three, offsets, torch.qint8, -1, False), "scales must"),
        ((x, scales, three, torch.qint8, -1, False), "zero_points must"),
        ((x, scales, offsets, torch.quint8, -1, False), "qint8"),
        ((x, scales, offsets, torch.qint8, -2, False), "axis"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_quantize(*args)


def test_quant_matmul(tnpu):
    x1 = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    x2 = torch.tensor([[2, 0, 1], [1, 1, -1]], dtype=torch.int8)
    scale = torch.tensor([0.5, 1.0, 2.0])
    pertoken = torch.tensor([1.0, 0.25])
    y = tnpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken,
                              output_dtype=BF16)
    assert y.dtype == BF16
    assert y.float().tolist() == [[0.0, -2.0, 6.0], [1.25, 1.0, -0.5]]
    bias = torch.tensor([1, 0, -1], dtype=torch.int32)
    y = tnpu.npu_quant_matmul(x1, x2, scale, bias=bias, output_dtype=BF16)
    assert y.float().tolist() == [[0.5, -2.0, 4.0], [5.5, 4.0, -4.0]]
    good = dict(pertoken_scale=pertoken, output_dtype=BF16)
    for args, change, match in [
        ((x1.float(), x2, scale), {}, "int8"),
        ((x1, x2.t(), scale), {}, "do not match"),
        ((x1, x2, scale[:2]), {}, "size 1 or N"),
        ((x1, x2, scale), dict(pertoken_scale=pertoken.to(BF16)),
         "pertoken_scale"),
        ((x1, x2, scale), dict(output_dtype=torch.float32), "bfloat16"),
        ((x1, x2, scale.to(BF16)), dict(output_dtype=torch.float16),
         "scale"),
        ((x1, x2, scale), dict(pertoken_scale=None, bias=bias.float(),
                               output_dtype=torch.float16), "int64"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_quant_matmul(*args, **{**good, **change})


def test_grouped_matmul_int8(tnpu):
    x = torch.tensor([[1, 2], [3, -1], [0, 5]], dtype=torch.int8)
    w = torch.tensor([[[1, 0], [0, 1]], [[2, 1], [1, -1]]], dtype=torch.int8)
    scale = torch.tensor([[1.0, 0.5], [0.25, 2.0]]).to(BF16)
    pertoken = torch.tensor([1.0, 2.0, 0.5])
    counts = torch.tensor([1, 2])
    gm = dict(scale=[scale], per_token_scale=[pertoken], group_list=counts,
              split_item=2, group_type=0, group_list_type=1,
              output_dtype=BF16)
    y = tnpu.npu_grouped_matmul([x], [w], **gm)[0]
    # Row 0 uses expert 0, rows 1-2 expert 1; y = x @ w * scale * pertoken.
    assert y.float().tolist() == [[1.0, 1.0], [2.5, 16.0], [0.625, -5.0]]
    for change, match in [(dict(output_dtype=None), "output_dtype"),
                          (dict(scale=[scale[:1]]), "scale must be"),
                          (dict(scale=[scale.float()]), "scale dtype"),
                          (dict(act_type=1), "act_type"),
                          (dict(per_token_scale=[pertoken.to(BF16)]),
                           "per_token_scale"),
                          (dict(per_token_scale=None), "per_token_scale")]:
        with pytest.raises(RuntimeError, match=match):
            tnpu.npu_grouped_matmul([x], [w], **{**gm, **change})
    with pytest.raises(RuntimeError, match="int8 weight"):
        tnpu.npu_grouped_matmul([x], [w.to(BF16)], **gm)
    with pytest.raises(RuntimeError, match="transposition"):
        tnpu.npu_grouped_matmul([x.t().contiguous().t()], [w], **gm)


# --- formats (op-plugin 7.2.0 （beta）torch_npu-npu_format_cast.md,
# npu-config-allow_internal_format.md, npu_quant_matmul.md:37-55,94-97) ---

ND, NZ = 2, 29


@pytest.fixture
def internal_format(tnpu):
    """allow_internal_format as the NPU runner sets it, reset after."""
    from torch_npu._formats import config
    config.allow_internal_format = True
    yield config
    config.reset()


def test_format_cast_and_get_npu_format(tnpu, internal_format):
    w = torch.randint(-128, 128, (40, 24), dtype=torch.int8)
    assert tnpu.get_npu_format(w) == ND
    assert tnpu.get_npu_format(torch.zeros(1, 2, 3, 4)) == 0  # NCHW (:58)
    nz = tnpu.npu_format_cast(w, NZ)
    assert nz is not w and torch.equal(nz, w)  # a new tensor (:14, :51)
    assert tnpu.get_npu_format(nz) == NZ and tnpu.get_npu_format(w) == ND
    assert tnpu.npu_format_cast(nz, NZ) is nz  # already NZ
    # The format is the storage's: a Parameter given the data reports it.
    param = torch.nn.Parameter(torch.empty(0, dtype=torch.int8),
                               requires_grad=False)
    param.data = nz
    assert tnpu.get_npu_format(param) == NZ
    back = tnpu.npu_format_cast(nz, ND)
    assert tnpu.get_npu_format(back) == ND and torch.equal(back, w)
    # NZ pads [rows, cols] to 16 x 32-byte fractals: int8 [40, 24] takes
    # [48, 32] on the device.
    from torch_npu._formats import storage_bytes
    assert storage_bytes(w) == 40 * 24 and storage_bytes(nz) == 48 * 32
    assert storage_bytes(tnpu.npu_format_cast(w.to(BF16), NZ)) == (
        48 * 32 * 2)
    with pytest.raises(RuntimeError, match="contiguous"):
        tnpu.npu_format_cast(w.t(), NZ)
    with pytest.raises(RuntimeError, match="unknown format"):
        tnpu.npu_format_cast(w, 28)
    with pytest.raises(TypeError, match="acl_format"):
        tnpu.npu_format_cast(w, "NZ")


def test_internal_format_needs_the_switch(tnpu, monkeypatch):
    """allow_internal_format defaults to True on an Atlas A2 and False on
    an A3 (:24-25); without it torch_npu makes the cast's result in the base
    format and warns (unsafe_empty_with_format)."""
    from torch_npu._formats import config
    w = torch.ones(32, 32, dtype=torch.int8)
    assert config.allow_internal_format is True  # SoC 220, an A2
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION", "250")
    assert torch.npu.config.allow_internal_format is False
    import torch_npu._formats as formats
    monkeypatch.setattr(formats, "_warned", False)
    with pytest.warns(UserWarning, match="base format"):
        assert tnpu.get_npu_format(tnpu.npu_format_cast(w, NZ)) == ND
    torch.npu.config.allow_internal_format = True
    try:
        assert tnpu.get_npu_format(tnpu.npu_format_cast(w, NZ)) == NZ
    finally:
        config.reset()


def test_quant_matmul_takes_nz_x2_only(tnpu, internal_format):
    g = torch.Generator().manual_seed(0)
    x1 = torch.randint(-128, 128, (5, 64), generator=g, dtype=torch.int8)
    x2 = torch.randint(-128, 128, (64, 48), generator=g, dtype=torch.int8)
    scale = torch.rand(48, generator=g)
    pertoken = torch.rand(5, generator=g)
    kw = dict(pertoken_scale=pertoken, output_dtype=BF16)
    nz = tnpu.npu_format_cast(x2, NZ)
    assert torch.equal(tnpu.npu_quant_matmul(x1, nz, scale, **kw),
                       tnpu.npu_quant_matmul(x1, x2, scale, **kw))
    with pytest.raises(RuntimeError, match="x1 must be ND"):
        tnpu.npu_quant_matmul(tnpu.npu_format_cast(x1, NZ), x2, scale, **kw)
    with pytest.raises(RuntimeError, match="scale must be ND"):
        tnpu.npu_quant_matmul(
            x1, x2, tnpu.npu_format_cast(scale.view(6, 8), NZ).view(48),
            **kw)
    # An NZ x2 is the (k, n) tensor that was cast: not a transposed view
    # of an NZ (n, k) one, nor a slice (:96-97, :432).
    nz_nk = tnpu.npu_format_cast(x2.t().contiguous(), NZ)
    with pytest.raises(RuntimeError, match="not a view"):
        tnpu.npu_quant_matmul(x1, nz_nk.t(), scale, **kw)
    with pytest.raises(RuntimeError, match="not a view"):
        tnpu.npu_quant_matmul(x1, nz[:, :32], scale[:32],
                              pertoken_scale=pertoken, output_dtype=BF16)


def test_grouped_matmul_takes_int8_nz_weights(tnpu, internal_format):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-128, 128, (6, 32), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (2, 32, 16), generator=g, dtype=torch.int8)
    gm = dict(scale=[torch.rand(2, 16, generator=g).to(BF16)],
              per_token_scale=[torch.rand(6, generator=g)],
              group_list=torch.tensor([2, 6]), split_item=2, group_type=0,
              group_list_type=0, output_dtype=BF16)
    nz = tnpu.npu_format_cast(w, NZ)
    assert torch.equal(tnpu.npu_grouped_matmul([x], [nz], **gm)[0],
                       tnpu.npu_grouped_matmul([x], [w], **gm)[0])
    # vllm-ascend casts [E, K, N] contiguous; a transposed NZ [E, N, K]
    # is a view of other fractals.
    nz_t = tnpu.npu_format_cast(w.transpose(1, 2).contiguous(), NZ)
    with pytest.raises(RuntimeError, match="not a view"):
        tnpu.npu_grouped_matmul([x], [nz_t.transpose(1, 2)], **gm)
    float_gm = dict(group_list=gm["group_list"], split_item=2, group_type=0)
    xf = torch.randn(6, 32).to(BF16)
    with pytest.raises(RuntimeError, match="float weight must be ND"):
        tnpu.npu_grouped_matmul(
            [xf], [tnpu.npu_format_cast(w.to(BF16), NZ)], **float_gm)


def test_no_float64_on_the_device(tnpu):
    """The NPU runs no float64 kernels. Inside ``with torch.device(...)``
    of the double's NPU (how vLLM builds the model) a factory without a
    device, or an op on such a device tensor, that makes float64 fails;
    host work that names its device does not."""
    with torch.device("cpu"):
        with pytest.raises(RuntimeError, match="float64 tensor on the NPU"):
            torch.arange(4, dtype=torch.float64)
        with pytest.raises(RuntimeError, match="float64 tensor on the NPU"):
            torch.tensor([0.5], dtype=torch.float64)
        x = torch.ones(3)
        with pytest.raises(RuntimeError, match="float64 tensor on the NPU"):
            x.double()
        with pytest.raises(RuntimeError, match="float64 tensor on the NPU"):
            torch.outer(x, torch.ones(2, dtype=torch.float64, device="cpu"))
        host = torch.arange(4, dtype=torch.float64, device="cpu").cos()
        assert x.add(host.float().sum()).dtype == torch.float32
    # Outside a device context tensors are host tensors.
    assert torch.arange(4, dtype=torch.float64).dtype == torch.float64
