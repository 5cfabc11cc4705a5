"""Tool calls and reasoning through ``vllm serve`` with GLM-4.5 MTP.

One server of the tool-calling fixture (``tests/fixtures/tiny-glm45-tools``)
with vLLM's ``glm45`` tool and reasoning parsers and MTP k = 3, on the NPU
code paths (the torch_npu double here) in their default graph mode,
bfloat16. Every request of the fixture's ``tool_prompts.json`` (one to
three calls, content before a call, JSON number and object arguments,
Chinese, a tool result, reasoning before text) is sent through the OpenAI
client, streamed and not, with per-request draft caps 0 (no speculation:
the reference), 1, 2 and 3 (``vllm_xargs: {"num_speculative_tokens": N}``);
the requests of one cap run at once, as a server batches them.

The greedy tokens are the trained answers whatever the cap; and MTP must
not change what the client gets: the same tool calls (names, arguments as
JSON, order), content and reasoning for every cap, streamed (the deltas
concatenated, the calls per index) as not streamed. Streaming with MTP
hands the parsers deltas of up to 1 + cap tokens: the tags ``<think>``,
``</think>``, the end of a call and the start of the next, or the end of
a call and the stop token, in one delta.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.utils.npu import NPU_ENV
from tools.demo.serve import ServeProcess, free_port, spec_decode_metrics

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-glm45-tools"
NAME = "glm45-tools"
CAPS = (0, 1, 2, 3)
MAX_TOKENS = 128
STARTUP_TIMEOUT = 300
DRAFTS = "vllm:spec_decode_num_drafts_total"

# About 70 s on a quiet host: the server's start on the double, then 72
# requests.
pytestmark = pytest.mark.npu


@dataclass
class Answer:
    """What the client got for one request."""
    reasoning_content: Optional[str]
    content: Optional[str]
    tool_calls: list[dict[str, str]]
    finish_reason: Optional[str]
    # Not streamed: one list; streamed: the token ids of each chunk.
    chunks: list[list[int]] = field(default_factory=list)

    def parsed(self) -> dict[str, Any]:
        """The fields compared ("" for None), the arguments as JSON."""
        return {
            "reasoning_content": self.reasoning_content or "",
            "content": self.content or "",
            "tool_calls": [{"name": c["name"],
                            "arguments": _json(c["arguments"])}
                           for c in self.tool_calls],
            "finish_reason": self.finish_reason,
        }

    def token_ids(self) -> list[int]:
        return [t for ids in self.chunks for t in ids]


def _json(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return f"<not JSON: {arguments!r}>"


def _serve_command(port: int) -> list[str]:
    return [
        "serve", str(FIXTURE), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", NAME, "--seed", "0", "--dtype", "bfloat16",
        "--max-model-len", "512", "--max-num-seqs", "8",
        "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
        str(64 << 20), "--disable-uvicorn-access-log",
        "--enable-auto-tool-choice", "--tool-call-parser", "glm45",
        "--reasoning-parser", "glm45",
        "--speculative-config",
        json.dumps({"method": "glm4_moe_mtp", "num_speculative_tokens": 3}),
    ]


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, Any]]:
    path = FIXTURE / "tool_prompts.json"
    if not path.exists():
        pytest.skip(f"{path} is missing: build the fixture with python -m "
                    "tests.fixtures.build_tiny_glm45 --corpus tools")
    return json.loads(path.read_text())


@dataclass
class Served:
    # (request name, cap, streamed) -> what the client got
    answers: dict[tuple[str, int, bool], Answer]
    # (cap, streamed) -> drafts the server counted for those requests
    drafts: dict[tuple[int, bool], float]
    log: str

    def parsed(self, name: str, cap: int, stream: bool) -> dict[str, Any]:
        return self.answers[name, cap, stream].parsed()


@pytest.fixture(scope="module")
def served(prompts) -> Served:
    from openai import OpenAI

    port = free_port()
    # One torch thread: the engine's idle threads would spin against the
    # API server, which wakes for every streamed token.
    server = ServeProcess(_serve_command(port), port,
                          env={**NPU_ENV, "OMP_NUM_THREADS": "1"})
    answers: dict[tuple[str, int, bool], Answer] = {}
    drafts: dict[tuple[int, bool], float] = {}
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                        timeout=300)
        with ThreadPoolExecutor(len(prompts)) as pool:
            for cap in CAPS:
                for stream in (False, True):
                    before = _drafts(server)
                    got = pool.map(_ask, [client] * len(prompts), prompts,
                                   [cap] * len(prompts),
                                   [stream] * len(prompts))
                    for p, answer in zip(prompts, got):
                        answers[p["name"], cap, stream] = answer
                    drafts[cap, stream] = _drafts(server) - before
        log = server.log_tail(400_000)
    finally:
        server.stop()
    return Served(answers, drafts, log)


def _drafts(server: ServeProcess) -> float:
    return spec_decode_metrics(server.get("/metrics")).get(DRAFTS, 0.0)


def _ask(client, prompt: dict[str, Any], cap: int, stream: bool) -> Answer:
    kwargs = dict(model=NAME, messages=prompt["messages"],
                  tools=prompt["tools"], temperature=0,
                  max_tokens=MAX_TOKENS,
                  extra_body={"vllm_xargs": {"num_speculative_tokens": cap},
                              "return_token_ids": True})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message.model_dump()
        return Answer(
            reasoning_content=message.get("reasoning_content"),
            content=message.get("content"),
            tool_calls=[{"name": c["function"]["name"],
                         "arguments": c["function"]["arguments"]}
                        for c in message.get("tool_calls") or []],
            finish_reason=choice.finish_reason,
            chunks=[choice.model_dump().get("token_ids") or []])
    reasoning, content, chunks = [], [], []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0].model_dump()
        chunks.append(choice.get("token_ids") or [])
        delta = choice["delta"]
        reasoning.append(delta.get("reasoning_content") or "")
        content.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call["index"], {"name": "",
                                                    "arguments": ""})
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return Answer(reasoning_content="".join(reasoning),
                  content="".join(content),
                  tool_calls=[calls[i] for i in sorted(calls)],
                  finish_reason=finish, chunks=chunks)


def _report(failures: list) -> str:
    return json.dumps(failures, indent=1, ensure_ascii=False)


def test_greedy_tokens_are_the_trained_answers(prompts, served):
    """Every cap: the tokens the fixture was trained to give, up to and
    including the stop token (not streamed: a stream leaves out the
    tokens of deltas the parsers hold back)."""
    failures = [(p["name"], cap) for p in prompts for cap in CAPS
                if served.answers[p["name"], cap, False].token_ids() !=
                p["answer_token_ids"]]
    assert not failures, failures


def test_parsed_answers_are_the_trained_ones(prompts, served):
    """No MTP, not streamed: the parsers return the reasoning, content and
    calls the model was trained to give (tool_prompts.json
    ``expected``)."""
    failures = []
    for p in prompts:
        got = served.parsed(p["name"], 0, False)
        want = dict(p["expected"], finish_reason=(
            "tool_calls" if p["expected"]["tool_calls"] else "stop"))
        if got != want:
            failures.append((p["name"], got, want))
    assert not failures, _report(failures)


@pytest.mark.parametrize("stream", [False, True],
                         ids=["not_streamed", "streamed"])
def test_mtp_answers_equal_no_mtp(prompts, served, stream):
    failures = [(p["name"], cap, served.parsed(p["name"], cap, stream),
                 served.parsed(p["name"], 0, stream))
                for p in prompts for cap in CAPS[1:]
                if served.parsed(p["name"], cap, stream) != served.parsed(
                    p["name"], 0, stream)]
    assert not failures, _report(failures)


@pytest.mark.parametrize("cap", CAPS)
def test_streamed_equals_not_streamed(prompts, served, cap):
    failures = [(p["name"], served.parsed(p["name"], cap, True),
                 served.parsed(p["name"], cap, False))
                for p in prompts
                if served.parsed(p["name"], cap, True) != served.parsed(
                    p["name"], cap, False)]
    assert not failures, _report(failures)


def _token_id(content: str) -> int:
    added = json.loads((FIXTURE / "tokenizer.json").read_text())[
        "added_tokens"]
    return next(t["id"] for t in added if t["content"] == content)


def test_server_drafted_and_deltas_held_several_tokens(prompts, served):
    """Cap 0 drafts nothing and streams a token per delta; caps 1-3 draft
    and stream up to 1 + cap tokens per delta, among them deltas with both
    reasoning tags, with the end of a call and the start of the next, and
    with the end of a call and the stop token."""
    assert "vllm_ascend runs on npu" in served.log
    assert served.drafts[0, False] == served.drafts[0, True] == 0
    assert all(served.drafts[cap, stream] > 0
               for cap in CAPS[1:] for stream in (False, True)), served.drafts
    think, think_end = _token_id("<think>"), _token_id("</think>")
    call, end = _token_id("<tool_call>"), _token_id("</tool_call>")
    stops = set(json.loads((FIXTURE / "generation_config.json").read_text())[
        "eos_token_id"])
    seen: dict[str, list] = {"several": [], "think_and_end": [],
                             "end_and_next": [], "end_and_stop": []}
    for p in prompts:
        name = p["name"]
        assert max(map(len, served.answers[name, 0, True].chunks)) == 1
        for cap in CAPS[1:]:
            chunks = served.answers[name, cap, True].chunks
            assert max(map(len, chunks)) <= 1 + cap, (name, cap)
            for ids in chunks:
                rest = ids[ids.index(end) + 1:] if end in ids else []
                for key, held in (
                        ("several", len(ids) > 1),
                        ("think_and_end", think in ids and think_end in ids),
                        ("end_and_next", call in rest),
                        ("end_and_stop", bool(stops & set(rest)))):
                    if held:
                        seen[key].append((name, cap))
    assert all(seen.values()), seen
