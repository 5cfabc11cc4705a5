"""``vllm serve`` through the plugin with GLM-4.5 MTP: the OpenAI API.

One server for the module (CPU reference device, localhost, MTP k=1). The
offline ``LLM`` reference (no speculative decoding) runs in a subprocess
while the server starts.
"""

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.utils.engine import hf_greedy, run_engine
from tools.demo.serve import (KV_CACHE_BYTES, SERVED_NAME, ServeProcess,
                              free_port, serve_args, spec_decode_metrics)

MAX_MODEL_LEN = 256
MAX_NEW = 24
STARTUP_TIMEOUT = 300
REQUEST_TIMEOUT = 120
TEXT = "the quiet green frog"


@dataclass
class Served:
    server: ServeProcess
    client: httpx.Client
    prompts: list[list[int]]
    offline: "Future[dict]"


def _heldout(model_dir: Path, count: int) -> list[list[int]]:
    prompts = json.loads((model_dir / "heldout_prompts.json").read_text())
    return [p["token_ids"] for p in prompts[:count]]


@pytest.fixture(scope="module")
def served(model_dir):
    prompts = _heldout(model_dir, 4)
    port = free_port()
    server = ServeProcess(
        serve_args(model_dir, port, mtp=True, max_model_len=MAX_MODEL_LEN),
        port, env={"VLLM_ASCEND_DEVICE": "cpu"})
    pool = ThreadPoolExecutor(1)
    offline = pool.submit(
        run_engine,
        dict(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
             max_model_len=MAX_MODEL_LEN, seed=1024,
             enable_prefix_caching=False,
             kv_cache_memory_bytes=KV_CACHE_BYTES),
        prompts, dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        None, STARTUP_TIMEOUT)
    client = httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT)
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
        yield Served(server, client, prompts, offline)
    finally:
        client.close()
        server.stop()
        pool.shutdown(wait=True)


def _complete(served: Served, **body) -> httpx.Response:
    return served.client.post("/v1/completions", json={
        "model": SERVED_NAME, "temperature": 0, "max_tokens": 16, **body})


def _stream_text(served: Served, path: str, body: dict) -> str:
    """Concatenate the text of a server-sent-event stream."""
    parts = []
    with served.client.stream("POST", path,
                              json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"]
            if not choice:
                continue
            if "text" in choice[0]:
                parts.append(choice[0]["text"])
            else:
                parts.append(choice[0]["delta"].get("content") or "")
    return "".join(parts)


def test_completion_streaming_equals_non_streaming(served):
    resp = _complete(served, prompt=TEXT)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    text = body["choices"][0]["text"]
    assert text.strip()
    assert 1 <= body["usage"]["completion_tokens"] <= 16
    assert body["model"] == SERVED_NAME
    streamed = _stream_text(served, "/v1/completions", dict(
        model=SERVED_NAME, prompt=TEXT, temperature=0, max_tokens=16))
    assert streamed == text


def test_chat_streaming_equals_non_streaming(served, model_dir):
    assert (model_dir / "chat_template.jinja").exists() or "chat_template" \
        in (model_dir / "tokenizer_config.json").read_text()
    body = dict(model=SERVED_NAME, temperature=0, max_tokens=16,
                messages=[{"role": "user", "content": TEXT}])
    resp = served.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"].strip()
    assert _stream_text(served, "/v1/chat/completions",
                        body) == message["content"]


def _server_greedy(served: Served, prompts: list[list[int]]) -> list:
    resp = _complete(served, prompt=prompts, max_tokens=MAX_NEW,
                     ignore_eos=True, return_token_ids=True)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def test_greedy_matches_offline_llm_and_transformers(served, model_dir):
    """MTP on through the server, off offline, and transformers' own
    Glm4MoeForCausalLM: the same greedy tokens."""
    expected = served.offline.result(timeout=STARTUP_TIMEOUT)["outputs"]
    assert len(expected) == len(served.prompts)
    assert all(len(out) == MAX_NEW for out in expected)
    assert hf_greedy(model_dir, served.prompts, MAX_NEW) == expected
    assert _server_greedy(served, served.prompts) == expected


def test_concurrent_requests_all_complete(served):
    """Eight requests at once (two per prompt) all finish, each with the
    tokens the offline engine produced for its prompt."""
    expected = served.offline.result(timeout=STARTUP_TIMEOUT)["outputs"]
    jobs = [i % len(served.prompts) for i in range(8)]
    results: dict[int, list] = {}
    errors: list[str] = []
    barrier = threading.Barrier(len(jobs))

    def work(slot: int, prompt: int) -> None:
        barrier.wait()
        try:
            results[slot] = _server_greedy(served,
                                           [served.prompts[prompt]])[0]
        except Exception as exc:  # reported below with its slot
            errors.append(f"request {slot}: {exc!r}")

    threads = [threading.Thread(target=work, args=(slot, prompt))
               for slot, prompt in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT)
    assert not errors
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert [results[slot] for slot in range(len(jobs))] == [
        expected[p] for p in jobs]


def test_spec_decode_metrics(served):
    before = spec_decode_metrics(served.server.get("/metrics"))
    resp = _complete(served, prompt=TEXT, max_tokens=32, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    after = spec_decode_metrics(served.server.get("/metrics"))
    drafts = "vllm:spec_decode_num_drafts_total"
    drafted = "vllm:spec_decode_num_draft_tokens_total"
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    assert {drafts, drafted, accepted,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total"} <= set(
                after), sorted(after)
    new_drafts = after[drafts] - before.get(drafts, 0)
    new_drafted = after[drafted] - before.get(drafted, 0)
    new_accepted = after[accepted] - before.get(accepted, 0)
    assert new_drafts > 0
    # k=1: one draft token per draft; at most 31 of 32 tokens are drafted.
    assert new_drafted == new_drafts <= 31
    # The trained MTP head accepts about 94% greedily (fixture README); a
    # broken drafter (wrong layer, lost hidden states) accepts about 0%.
    assert new_accepted / new_drafted > 0.5, after
    # The speculation watchdog is on, and quiet on the trained head.
    assert after["vllm:spec_decode_paused"] == 0, after
    assert after["vllm:spec_decode_num_pauses_total"] == 0, after


def test_request_turns_speculation_off(served):
    """``vllm_xargs: {"num_speculative_tokens": 0}``: the request decodes
    without drafts, to the same tokens; 1 caps it at k=1."""
    expected = served.offline.result(timeout=STARTUP_TIMEOUT)["outputs"]
    drafts = "vllm:spec_decode_num_drafts_total"
    for cap, drafting in ((0, False), (1, True)):
        before = spec_decode_metrics(served.server.get("/metrics"))
        resp = _complete(served, prompt=served.prompts[:1], max_tokens=MAX_NEW,
                         ignore_eos=True, return_token_ids=True,
                         vllm_xargs={"num_speculative_tokens": cap})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected[0]
        after = spec_decode_metrics(served.server.get("/metrics"))
        assert (after[drafts] > before[drafts]) == drafting, (cap, after)


BAD_REQUESTS = {
    "prompt_longer_than_max_model_len": (
        dict(prompt=[5] * (MAX_MODEL_LEN + 10)), "maximum context length"),
    "text_prompt_longer_than_max_model_len": (
        dict(prompt="the frog " * 400), "maximum context length"),
    "negative_temperature": (dict(prompt=TEXT, temperature=-1),
                             "temperature must be non-negative"),
    "top_p_above_1": (dict(prompt=TEXT, top_p=2), "top_p must be in (0, 1]"),
    "max_tokens_0": (dict(prompt=TEXT, max_tokens=0),
                     "max_tokens must be at least 1"),
    "max_tokens_negative": (dict(prompt=TEXT, max_tokens=-3),
                            "max_tokens must be at least 1"),
    "n_0": (dict(prompt=TEXT, n=0), "n must be at least 1"),
    "negative_draft_cap": (
        dict(prompt=TEXT, vllm_xargs={"num_speculative_tokens": -1}),
        "num_speculative_tokens in extra_args (vllm_xargs)"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400_and_server_keeps_serving(served, case):
    body, message = BAD_REQUESTS[case]
    resp = _complete(served, **body)
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]["message"]
    ok = _complete(served, prompt=TEXT, max_tokens=4)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4


def test_bad_chat_request_is_400(served):
    resp = served.client.post("/v1/chat/completions", json=dict(
        model=SERVED_NAME, temperature=-1, max_tokens=4,
        messages=[{"role": "user", "content": TEXT}]))
    assert resp.status_code == 400, resp.text
    assert "temperature must be non-negative" in resp.json()["error"][
        "message"]


def test_n_too_large_is_400(served):
    # 300 one-token completions finish in seconds when unchecked, so this
    # test cannot wedge the server while the check is not wired.
    resp = _complete(served, prompt=TEXT, n=300, temperature=1.0,
                     max_tokens=1)
    assert resp.status_code == 400, resp.text[:300]
    assert "n=300" in resp.json()["error"]["message"]
    assert _complete(served, prompt=TEXT, max_tokens=4).status_code == 200
