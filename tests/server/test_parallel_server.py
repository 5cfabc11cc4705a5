"""``vllm serve`` with the reference serve command's parallel flags scaled
to this host: ``--data-parallel-size 2 --tensor-parallel-size 2
--enable-expert-parallel`` (four engine processes on gloo) with MTP k = 2
in the default mode and MoE communication method (k = 1 runs
offline: tests/e2e/test_data_parallel.py). Its greedy answers and the
acceptance it reports (summed over the DP engines) are the single-process
engine's with MTP (whose tokens equal those without MTP:
tests/e2e/test_mtp_lossless.py)."""

import json
from pathlib import Path

import httpx
import pytest

from tests.utils.engine import run_engine
from tools.demo.serve import ServeProcess, free_port

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-glm45"
PROMPTS = ["the quiet green frog", "one two three four five six",
           "a b c d e f g", "what is the capital of", "red blue",
           "count to ten: one"]
MAX_TOKENS = 12
COUNTERS = ("vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_accepted_tokens")
STARTUP_TIMEOUT = 400


def _offline(prompts: list[list[int]], k: int) -> dict:
    engine = dict(model=str(FIXTURE), skip_tokenizer_init=True,
                  dtype="float32", max_model_len=256, seed=0,
                  kv_cache_memory_bytes=64 << 20,
                  speculative_config=dict(method="glm4_moe_mtp",
                                          num_speculative_tokens=k))
    return run_engine(engine, prompts,
                      dict(temperature=0, max_tokens=MAX_TOKENS,
                           ignore_eos=True),
                      env={"OMP_NUM_THREADS": "1"})


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(f"{name}_total"))


# Four engine processes and a server: in `make nightly`. CI runs the layout
# offline (tests/e2e/test_data_parallel.py, tests/npu/test_npu_engine.py)
# and the reference serve command's other flags served (tests/server).
@pytest.mark.heavy
@pytest.mark.parametrize("k", [2])
def test_dp2_tp2_ep_mtp_server_equals_single_process(k):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    port = free_port()
    server = ServeProcess([
        "serve", str(FIXTURE), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "glm45", "--seed", "0", "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "4",
        # Graph mode as by default, with fewer sizes to capture.
        "--max-num-batched-tokens", "64",
        "--no-enable-prefix-caching", "--data-parallel-size", "2",
        "--tensor-parallel-size", "2", "--enable-expert-parallel",
        "--speculative-config",
        json.dumps({"method": "glm4_moe_mtp", "num_speculative_tokens": k})
    ], port, env={"VLLM_ASCEND_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                  "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            answers = [client.post("/v1/completions", json={
                "model": "glm45", "prompt": prompt, "temperature": 0,
                "max_tokens": MAX_TOKENS, "ignore_eos": True})
                for prompt in prompts]
            metrics = client.get("/metrics").text
        log = server.log_tail(200_000)
    finally:
        server.stop()
    for answer in answers:
        assert answer.status_code == 200, answer.text
    texts = [a.json()["choices"][0]["text"] for a in answers]
    with_mtp = _offline(prompts, k)
    assert texts == [tokenizer.decode(o, skip_special_tokens=True)
                     for o in with_mtp["outputs"]]
    for name in COUNTERS:
        assert _counter(metrics, name) == with_mtp["metrics"][name], name
    assert "MoE communication: mc2" in log, log[-3000:]
