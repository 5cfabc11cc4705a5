"""``vllm serve`` through the plugin with GLM-4.5 MTP: the OpenAI API.

One server for the module (CPU reference device, localhost, MTP k=1,
structured outputs through xgrammar). The offline ``LLM`` reference (no
speculative decoding) runs in a subprocess while the server starts.
"""

import contextlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import jsonschema
import pytest

from tests.utils.engine import hf_greedy, run_engine
from tools.demo.serve import (KV_CACHE_BYTES, SERVED_NAME, ServeProcess,
                              free_port, serve_args, spec_decode_metrics)

MAX_MODEL_LEN = 256
MAX_NEW = 24
STARTUP_TIMEOUT = 300
REQUEST_TIMEOUT = 120
TEXT = "the quiet green frog"
# xgrammar, vLLM's 'auto' choice for the JSON schemas below, without the
# flexible whitespace: with it the tiny model fills the object with newlines
# until max_tokens ('{\n\n\n...'). disable_any_whitespace needs a named
# backend (StructuredOutputsConfig rejects it with 'auto').
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar",
                             "disable_any_whitespace": True}


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
        serve_args(model_dir, port, mtp=True, max_model_len=MAX_MODEL_LEN) +
        ["--structured-outputs-config",
         json.dumps(STRUCTURED_OUTPUTS_CONFIG)],
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


@dataclass
class Generated:
    text: str
    token_ids: Optional[list[int]]
    finish_reason: Optional[str]


def _stream(served: Served, path: str, body: dict) -> Generated:
    """The text, token ids (with ``return_token_ids``) and finish reason of
    a server-sent-event stream."""
    texts, token_ids, finish = [], [], None
    with served.client.stream("POST", path,
                              json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):])["choices"]
            if not choices:
                continue
            choice = choices[0]
            if "text" in choice:
                texts.append(choice["text"])
            else:
                texts.append(choice["delta"].get("content") or "")
            token_ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return Generated("".join(texts), token_ids or None, finish)


def _stream_text(served: Served, path: str, body: dict) -> str:
    return _stream(served, path, body).text


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


# Structured outputs with MTP: vLLM 0.11 combines them. The scheduler keeps
# the prefix of each draft the grammar accepts (update_draft_token_ids ->
# grammar.validate_tokens) and builds one bitmask per draft position plus
# the bonus position (StructuredOutputManager.grammar_bitmask); the model
# runner masks the target logits with them before the rejection sampler.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "maxItems": 3,
                 "items": {"type": "string", "maxLength": 8}},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "frog": {
            "type": "object",
            "properties": {"pond": {"type": "string", "maxLength": 10},
                           "size": {"enum": ["small", "big"]}},
            "required": ["pond", "size"],
            "additionalProperties": False,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["frog", "count"],
    "additionalProperties": False,
}
# English inside a long string: where most drafts are valid and accepted
# (the drafter does not see the grammar; a draft the grammar rejects is
# dropped before it is scheduled, so punctuation and enums draft little).
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 20,
                             "maxLength": 80},
                   "done": {"type": "boolean"}},
    "required": ["story", "done"],
    "additionalProperties": False,
}
# case: (schema, endpoint, how the request names the schema). vLLM 0.11's
# /v1/completions maps only response_format json_object (it ignores
# json_schema), so response_format is a chat spelling here.
STRUCTURED = {
    "person-completion-guided_json":
    (PERSON, "/v1/completions", "guided_json"),
    "nested-chat-response_format":
    (NESTED, "/v1/chat/completions", "response_format"),
    "story-completion-structured_outputs":
    (STORY, "/v1/completions", "structured_outputs"),
    "story-chat-guided_json": (STORY, "/v1/chat/completions", "guided_json"),
}
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def _structured_request(case: str,
                        cap: Optional[int] = None) -> tuple[str, dict]:
    schema, path, spelling = STRUCTURED[case]
    body: dict = dict(model=SERVED_NAME, temperature=0, max_tokens=120,
                      return_token_ids=True)
    if spelling == "guided_json":
        body["guided_json"] = schema
    elif spelling == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    else:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema}}
    if path == "/v1/completions":
        body["prompt"] = TEXT
    else:
        body["messages"] = [{"role": "user", "content": TEXT}]
    if cap is not None:
        body["vllm_xargs"] = {"num_speculative_tokens": cap}
    return path, body


def _generate(served: Served, path: str, body: dict) -> Generated:
    resp = served.client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"][
        "content"]
    return Generated(text, choice["token_ids"], choice["finish_reason"])


def _assert_valid(case: str, out: Generated) -> None:
    assert out.finish_reason == "stop", (case, out)
    jsonschema.validate(json.loads(out.text), STRUCTURED[case][0])


@contextlib.contextmanager
def _spec_decode_delta(served: Served) -> Iterator[dict[str, float]]:
    """The speculative-decoding counters' growth over the block."""
    before = spec_decode_metrics(served.server.get("/metrics"))
    delta: dict[str, float] = {}
    yield delta
    after = spec_decode_metrics(served.server.get("/metrics"))
    delta.update({k: v - before.get(k, 0) for k, v in after.items()})


@dataclass
class StructuredRefs:
    outputs: dict[str, Generated]
    spec_decode_delta: dict[str, float]


@pytest.fixture(scope="module")
def structured_refs(served) -> StructuredRefs:
    """Each structured case with speculation off for the request (cap 0),
    one at a time: the no-MTP reference."""
    with _spec_decode_delta(served) as delta:
        outputs = {case: _generate(served, *_structured_request(case, cap=0))
                   for case in STRUCTURED}
    return StructuredRefs(outputs, delta)


def test_structured_output_without_drafts_is_valid(structured_refs):
    """Cap 0 schedules no draft (the counters stay), and each output is
    JSON valid under its schema."""
    assert structured_refs.spec_decode_delta[DRAFTS] == 0, \
        structured_refs.spec_decode_delta
    for case, out in structured_refs.outputs.items():
        _assert_valid(case, out)


@pytest.mark.parametrize("case", list(STRUCTURED))
def test_structured_output_with_mtp_equals_without(served, structured_refs,
                                                   case):
    """MTP at the server's k (non-streamed) and capped at 1 (streamed; the
    same k on this server, through the per-request cap): the cap-0 tokens,
    with drafts scheduled and accepted under the grammar."""
    ref = structured_refs.outputs[case]
    deltas = []
    for cap, send in ((None, _generate), (1, _stream)):
        with _spec_decode_delta(served) as delta:
            out = send(served, *_structured_request(case, cap))
        _assert_valid(case, out)
        assert out == ref, (case, cap)
        deltas.append(delta)
    for delta in deltas:
        assert delta[DRAFTS] > 0 and delta[ACCEPTED] > 0, (case, deltas)


def test_structured_and_free_requests_batched_with_mtp(served,
                                                       structured_refs):
    """The structured cases and the free-text prompts at once, MTP on: the
    batches mix grammar-masked rows with other requests' draft rows (the
    bitmask's row offsets); each request gets its one-at-a-time tokens."""
    expected = served.offline.result(timeout=STARTUP_TIMEOUT)["outputs"]
    jobs = [(case, None) for case in STRUCTURED] + [
        (None, i) for i in range(len(served.prompts))]
    barrier = threading.Barrier(len(jobs))

    def work(job: tuple) -> object:
        case, prompt = job
        barrier.wait(timeout=REQUEST_TIMEOUT)
        if case is not None:
            return _generate(served, *_structured_request(case))
        return _server_greedy(served, [served.prompts[prompt]])[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(work, jobs))
    assert results == [
        structured_refs.outputs[case] if case is not None else expected[p]
        for case, p in jobs]
