"""``--quantization ascend`` end to end on the trained fixture.

Both W8A8 checkpoints (MTP layer quantized, MTP layer float) load with
every served parameter traced back to its checkpoint tensors; greedy with
MTP (k = 1..3, chunked prefill, preemption; graph mode on the NPU code
paths) equals greedy without it; the quantized model's next-token
predictions and MTP acceptance are reported next to the float model's.
Anti-outlier (m4) checkpoints serve their norm biases: shifted without
quantization, the float model's function.
"""

import json
import random
import re
from collections import defaultdict

import pytest
from safetensors import safe_open

from tests.utils.checkpoints import write_random_glm45
from tests.utils.engine import run_engines
from tests.utils.npu import NPU_ENV
from tests.utils.quantized_checkpoints import FIXTURE, quantize
from vllm_ascend.ops.weight_format import ACL_FORMAT_FRACTAL_NZ as NZ

MAX_NEW = 20
VOCAB = json.loads((FIXTURE / "config.json").read_text())["vocab_size"]
NUM_LAYERS = json.loads(
    (FIXTURE / "config.json").read_text())["num_hidden_layers"]
# Chunked prefill and a KV pool too small for the batch (preemption).
MTP_MODE = dict(enable_chunked_prefill=True, max_num_batched_tokens=40,
                num_gpu_blocks_override=20, block_size=16)


def _prompts() -> list[list[int]]:
    heldout = json.loads((FIXTURE / "heldout_prompts.json").read_text())
    return ([p["token_ids"] for p in heldout] * 3)[:11]


def _job(model, k=0, logprobs=False, **mode) -> dict:
    engine = dict(model=str(model), dtype="float32", max_model_len=256,
                  max_num_seqs=16, seed=0, max_logprobs=VOCAB, **mode)
    if model != FIXTURE:
        engine["quantization"] = "ascend"
    if k:
        engine["speculative_config"] = dict(method="glm4_moe_mtp",
                                            num_speculative_tokens=k)
    sampling = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    if logprobs:
        sampling["prompt_logprobs"] = VOCAB
    return dict(engine=engine, prompts=_prompts(), sampling=sampling,
                inspect=True)


# k = 2 and 3 on the CPU in `make nightly`; the NPU paths run them in CI
# (test_npu_mtp_outputs_equal_no_mtp).
HEAVY_KS = ("w8a8_k2", "w8a8_k3")


@pytest.fixture(scope="module")
def runs(request, w8a8_dirs, anti_outlier_dirs) -> dict:
    """Every CPU engine run of this module, two at a time; of the MTP runs
    of test_mtp_outputs_equal_no_mtp, only those of selected tests."""
    quantized, float_mtp = w8a8_dirs["quantized_mtp"], w8a8_dirs["float_mtp"]
    selected = {
        item.callspec.params["key"]
        for item in request.session.items if item.module is request.module
        and item.originalname == "test_mtp_outputs_equal_no_mtp"
    }
    jobs = {
        "float_ao": _job(anti_outlier_dirs["float"], logprobs=True),
        "w8a8_ao": _job(anti_outlier_dirs["w8a8"], logprobs=True),
        "w8a8": _job(quantized, logprobs=True),
        "float": _job(FIXTURE, logprobs=True),
        "w8a8_k1": _job(quantized, 1, **MTP_MODE),
        "w8a8_k2": _job(quantized, 2, **MTP_MODE),
        "w8a8_k3": _job(quantized, 3, **MTP_MODE),
        "float_mtp_k1": _job(float_mtp, 1, **MTP_MODE),
        "float_k1": _job(FIXTURE, 1, **MTP_MODE),
    }
    for key in set(HEAVY_KS) - selected:
        del jobs[key]
    results = run_engines(jobs)
    for key, result in results.items():
        if isinstance(result, BaseException):
            raise AssertionError(f"{key}: {result}")
    return results


@pytest.mark.parametrize("key", [
    "w8a8_k1", *(pytest.param(key, marks=pytest.mark.heavy)
                 for key in HEAVY_KS), "float_mtp_k1"
])
def test_mtp_outputs_equal_no_mtp(runs, key):
    got, k = runs[key], int(key[-1])
    assert got["outputs"] == runs["w8a8"]["outputs"]
    metrics = got["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    assert metrics["vllm:num_preemptions"] > 0, metrics
    info = got["inspect"]
    # The draft runs on the target's float embedding and LM head.
    assert info["draft_own_vocab_params"] == []
    assert info["draft_embed_ptr"] == info["target_embed_ptr"]
    assert info["draft_lm_head_ptrs"] == [info["target_lm_head_ptr"]]


def _acceptance(run) -> float:
    m = run["metrics"]
    return (m["vllm:spec_decode_num_accepted_tokens"] /
            m["vllm:spec_decode_num_draft_tokens"])


def _against_float(run, runs) -> tuple[int, int, float]:
    """Teacher-forced next-token predictions over the prompts against the
    float model's: (top-1 agreements, positions, largest log-probability
    error)."""
    agree = total = 0
    max_error = 0.0
    for quant_seq, float_seq in zip(run["prompt_logprobs"],
                                    runs["float"]["prompt_logprobs"]):
        for q, f in zip(quant_seq, float_seq):
            if q is None:
                continue
            q_top = max(q, key=q.get)
            f_top = max(f, key=f.get)
            agree += q_top == f_top
            total += 1
            max_error = max(max_error, max(abs(q[t] - f[t]) for t in f))
    return agree, total, max_error


def test_quality_against_float(runs):
    """Teacher-forced next-token predictions over the prompts: top-1
    agreement and the largest log-probability error, W8A8 vs float; MTP
    acceptance of both."""
    agree, total, max_error = _against_float(runs["w8a8"], runs)
    acceptance = {key: _acceptance(runs[key])
                  for key in ("w8a8_k1", "float_mtp_k1", "float_k1")}
    print(f"\nW8A8 vs float over {total} positions: top-1 agreement "
          f"{agree / total:.3f}, max log-prob error {max_error:.3f}; MTP "
          f"k=1 acceptance: W8A8 {acceptance['w8a8_k1']:.3f}, W8A8 with "
          f"float MTP {acceptance['float_mtp_k1']:.3f}, float "
          f"{acceptance['float_k1']:.3f}")
    assert total > 100
    assert agree / total >= 0.95
    assert max_error < 1.0
    for key in ("w8a8_k1", "float_mtp_k1"):
        assert acceptance[key] >= acceptance["float_k1"] - 0.1, acceptance


# --- every served parameter comes from the checkpoint ---------------------

FUSED = [(re.compile(r"\.self_attn\.[qkv]_proj\."), ".self_attn.qkv_proj."),
         (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
         (re.compile(r"\.experts\.\d+\.(gate|up)_proj\."), ".experts.w13_"),
         (re.compile(r"\.experts\.\d+\.down_proj\."), ".experts.w2_")]
# One value per fused part in the checkpoint, one in the served layer.
SHARED_VALUE = (".input_scale", ".input_offset")


def _served_name(name: str) -> str:
    for pattern, repl in FUSED[2:] + FUSED[:2]:
        name = pattern.sub(repl, name)
    return name


def _expected_sums(model_dir) -> dict[str, list]:
    """Served parameter name -> [numel, sum] from the checkpoint tensors;
    weight offsets must be zero (symmetric) and are not served."""
    groups: dict[str, list] = defaultdict(lambda: [0, 0.0])
    shared: dict[str, set] = defaultdict(set)
    with safe_open(str(model_dir / "model.safetensors"),
                   framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name).double()
            if name.endswith("weight_offset"):
                assert not t.any(), name
                continue
            served = _served_name(name)
            if name.endswith(SHARED_VALUE):
                shared[served].add(t.item())
                continue
            groups[served][0] += t.numel()
            groups[served][1] += t.sum().item()
    for name, values in shared.items():
        assert len(values) == 1, (name, values)
        groups[name] = [1, values.pop()]
    return dict(groups)


def _served_sums(info: dict) -> dict[str, list]:
    served = {n: v for n, v in info["param_sums"].items()}
    for name, value in info.get("draft_param_sums", {}).items():
        # vLLM's MTP module holds the decoder layer as mtp_block; the
        # embedding and head it shares are the target's.
        served.setdefault(name.replace(".mtp_block.", "."), value)
    return served


@pytest.mark.parametrize("key,checkpoint,mtp_dtype", [
    ("w8a8_k1", "quantized_mtp", "torch.int8"),
    ("float_mtp_k1", "float_mtp", "torch.float32"),
])
def test_every_parameter_loaded(runs, w8a8_dirs, key, checkpoint,
                                mtp_dtype):
    served = _served_sums(runs[key]["inspect"])
    expected = _expected_sums(w8a8_dirs[checkpoint])
    # The MTP layer's copies of the embedding and head are not served: the
    # draft uses the target's.
    mtp = f"model.layers.{NUM_LAYERS}."
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):
        expected.pop(mtp + copy, None)
        served.pop(mtp + copy, None)
    assert sorted(served) == sorted(expected)
    for name, (numel, total) in expected.items():
        got_numel, got_total, _ = served[name]
        assert got_numel == numel, name
        assert got_total == pytest.approx(total, rel=1e-6, abs=1e-6), name
    dtypes = {n: v[2] for n, v in served.items()}
    assert dtypes["model.layers.1.mlp.experts.w13_weight"] == "torch.int8"
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == "torch.int8"
    assert dtypes["model.embed_tokens.weight"] == "torch.float32"
    assert dtypes["lm_head.weight"] == "torch.float32"
    assert dtypes[f"{mtp}eh_proj.weight"] == mtp_dtype
    assert dtypes[f"{mtp}mlp.experts.w13_weight"] == mtp_dtype


# --- through the NPU code paths (the torch_npu double off an NPU) ---------

NPU_CAPTURE_SIZES = [1, 4, 8, 16]


@pytest.fixture(scope="module")
def npu_runs(tmp_path_factory) -> dict:
    """A random GLM-4.5 with GLM-4.5's head_dim, W8A8 with its MTP layer
    quantized, on the NPU paths in bfloat16: without MTP, and with k = 1,
    2, 3 under chunked prefill and preemption."""
    tmp = tmp_path_factory.mktemp("w8a8-npu")
    model = quantize(write_random_glm45(tmp / "float", head_dim=128, seed=3),
                     tmp / "w8a8")
    rng = random.Random(7)
    lengths = [rng.randrange(1, 40) for _ in range(5)] + [120, 122]
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]
    engine = dict(model=str(model), skip_tokenizer_init=True,
                  quantization="ascend", max_model_len=256, max_num_seqs=8,
                  seed=0, kv_cache_memory_bytes=64 << 20,
                  compilation_config={"cudagraph_capture_sizes":
                                      NPU_CAPTURE_SIZES})
    sampling = dict(temperature=0, max_tokens=16, ignore_eos=True)
    mode = dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
                num_gpu_blocks_override=3)
    jobs = {0: dict(engine=engine, prompts=prompts, sampling=sampling,
                    env=NPU_ENV)}
    for k in (1, 2, 3):
        spec = dict(method="glm4_moe_mtp", num_speculative_tokens=k)
        jobs[k] = dict(engine=dict(engine, speculative_config=spec, **mode),
                       prompts=prompts, sampling=sampling, env=NPU_ENV,
                       inspect=True)
    return run_engines(jobs)


@pytest.mark.npu
@pytest.mark.parametrize("k", [1, 2, 3])
def test_npu_mtp_outputs_equal_no_mtp(npu_runs, k):
    for key in (0, k):
        if isinstance(npu_runs[key], BaseException):
            raise npu_runs[key]
    got = npu_runs[k]
    assert got["outputs"] == npu_runs[0]["outputs"]
    metrics = got["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:num_preemptions"] > 0, metrics
    assert got["inspect"]["param_sums"][
        "model.layers.1.mlp.experts.w13_weight"][2] == "torch.int8"
    # Every int8 weight (linear and experts, target and MTP layer) is read
    # in the NPU's FRACTAL_NZ format (ND: 2).
    formats = got["inspect"]["int8_formats"]
    assert "model.layers.1.mlp.experts.w13_weight" in formats
    assert "model.layers.0.self_attn.qkv_proj.weight" in formats
    assert set(formats.values()) == {NZ}, formats


# --- anti-outlier (m4) norm biases -----------------------------------------


def test_anti_outlier_norm_biases_are_served(runs, anti_outlier_dirs):
    """Each checkpoint norm bias is served as loaded; shifted without
    quantization the model is the float model (a dropped bias leaves the
    q/k/v compensation alone: log-probabilities off by far more than
    float32 rounding); W8A8 with the shift is as close to float as
    without."""
    for kind in ("float", "w8a8"):
        served = runs[f"{kind}_ao"]["inspect"]["param_sums"]
        with safe_open(str(anti_outlier_dirs[kind] / "model.safetensors"),
                       framework="pt") as f:
            biases = [n for n in f.keys()  # noqa: SIM118
                      if n.endswith("norm.bias")]
            assert len(biases) == NUM_LAYERS, biases
            for name in biases:
                t = f.get_tensor(name).double()
                assert t.abs().max() > 1e-2, name
                assert served[name][:2] == pytest.approx(
                    [t.numel(), t.sum().item()], rel=1e-6, abs=1e-6), name
    agree, total, max_error = _against_float(runs["float_ao"], runs)
    assert agree == total and max_error < 1e-3, (agree, total, max_error)
    assert runs["float_ao"]["outputs"] == runs["float"]["outputs"]
    agree, total, max_error = _against_float(runs["w8a8_ao"], runs)
    print(f"\nW8A8 anti-outlier vs float over {total} positions: top-1 "
          f"agreement {agree / total:.3f}, max log-prob error "
          f"{max_error:.3f}")
    assert agree / total >= 0.95
    assert max_error < 1.0
