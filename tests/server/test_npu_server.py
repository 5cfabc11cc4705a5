"""The reference ``vllm serve`` command (DP 2 x TP 8 + EP, W8A8, graph
capture sizes) on the NPU code paths.

Every flag of that command, ``--quantization ascend`` on a W8A8 checkpoint
with a float MTP layer (``python -m tools.quantize.w8a8 --float-mtp``)
included, with DP and TP 1 and this host's limits (``--max-model-len``
within the checkpoint's positions), graph mode by default: the server
starts, answers completions and chat, and with MTP k = 1 its greedy
answers equal those without MTP, which equal the offline engine on the
same code path.
"""

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.utils.checkpoints import write_random_glm45
from tests.utils.engine import run_engine
from tests.utils.npu import NPU_ENV
from tests.utils.quantized_checkpoints import quantize
from tools.demo.serve import ServeProcess, free_port

pytestmark = pytest.mark.npu

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-glm45"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
MAX_MODEL_LEN = 1024
NAME = "dsv3"
PROMPTS = ["the quiet green frog", "one two three four five six"]
STARTUP_TIMEOUT = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random GLM-4.5 with GLM-4.5's head_dim and the fixture's
    tokenizer (its vocabulary size), as W8A8 with a float MTP layer: the
    report's glm4.5_w8a8_with_float_mtp."""
    tmp = tmp_path_factory.mktemp("glm45-serve")
    path = write_random_glm45(tmp / "float", seed=2, head_dim=128,
                              vocab_size=640,
                              max_position_embeddings=MAX_MODEL_LEN)
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE / name, path / name)
    return quantize(path, tmp / "w8a8_with_float_mtp", "--float-mtp")


def original_command(model: Path, port: int, mtp: bool) -> list[str]:
    args = [
        "serve", f"{model}/", "--host", "127.0.0.1", "--port", str(port),
        "--seed", "1024", "--served-model-name", NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "16384", "--max-num-seqs", "32",
        "--no-enable-prefix-caching", "--trust-remote-code",
        "--enable-expert-parallel", "--gpu-memory-utilization", "0.9",
        "--additional-config", json.dumps({
            "ascend_scheduler_config": {
                "enabled": True,
                "enable_chunked_prefill": True
            }
        }),
        "--compilation-config",
        json.dumps({"cudagraph_capture_sizes": [1, 4, 8, 16, 32, 48, 64]}),
        "--disable-uvicorn-access-log", "--quantization", "ascend",
    ]
    if mtp:
        args += ["--speculative-config", json.dumps({
            "num_speculative_tokens": 1, "model": str(model),
            "method": "glm4_moe_mtp"})]
    return args


def _serve_and_ask(checkpoint: Path, mtp: bool) -> dict:
    port = free_port()
    server = ServeProcess(original_command(checkpoint, port, mtp),
                          port, env=NPU_ENV)
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            completion = client.post("/v1/completions", json={
                "model": NAME, "prompt": PROMPTS, "temperature": 0,
                "max_tokens": 16, "ignore_eos": True})
            assert completion.status_code == 200, completion.text
            chat = client.post("/v1/chat/completions", json={
                "model": NAME, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": PROMPTS[0]}]})
            assert chat.status_code == 200, chat.text
            metrics = client.get("/metrics").text
        log = server.log_tail(200_000)
    finally:
        server.stop()
    choices = sorted(completion.json()["choices"], key=lambda c: c["index"])
    return {
        "texts": [c["text"] for c in choices],
        "chat": chat.json()["choices"][0]["message"]["content"],
        "drafts": sum(
            float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_drafts_total")),
        "log": log,
    }


@pytest.fixture(scope="module")
def no_mtp(checkpoint):
    return _serve_and_ask(checkpoint, mtp=False)


def test_original_command_mtp_answers_equal_no_mtp(checkpoint, no_mtp):
    # Graph mode, the command's default; the eager NPU paths run in
    # tests/npu/test_npu_engine.py.
    got = _serve_and_ask(checkpoint, mtp=True)
    assert got["drafts"] > 0
    assert got["texts"] == no_mtp["texts"]
    assert got["chat"] == no_mtp["chat"]
    assert "vllm_ascend runs on npu" in got["log"]
    assert re.search(r"Ascend quantization from .*: \d+ tensors \(FLOAT \d+, "
                     r"W8A8 \d+, W8A8_DYNAMIC \d+\)", got["log"])
    # Graph mode by default (vLLM's FULL_AND_PIECEWISE: full graphs
    # for verify batches and the draft, piecewise for the rest), with
    # the report's capture sizes rounded to 1 + k.
    assert "capturing [64, 48, 32, 16, 8, 4, 2]" in got["log"]
    assert ("Captured 7 MTP draft graph(s) for sizes [64, 48, 32, 16, "
            "8, 4, 2]") in got["log"], got["log"][-3000:]
    assert re.search(r"Captured \d+ graph\(s\) for \[64, 48, 32, 16, "
                     r"8, 4, 2\]", got["log"]), got["log"][-3000:]


# In `make nightly`: the CPU server's answers equal the offline engine in CI
# (tests/server/test_openai_server.py).
@pytest.mark.heavy
def test_served_answers_equal_offline_engine(checkpoint, no_mtp):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    offline = run_engine(
        dict(model=str(checkpoint), skip_tokenizer_init=True, seed=1024,
             quantization="ascend",
             max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20),
        prompts, dict(temperature=0, max_tokens=16, ignore_eos=True),
        env=NPU_ENV)["outputs"]
    # The server skips special tokens when it detokenizes.
    assert [tokenizer.decode(ids, skip_special_tokens=True)
            for ids in offline] == no_mtp["texts"]
