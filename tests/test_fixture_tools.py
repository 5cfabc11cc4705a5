"""The tool-calling fixture (``tests/fixtures/tiny-glm45-tools``): its
tokenizer and template as GLM-4.5's, its requests' greedy answers, and what
vLLM's ``glm45`` parsers make of them (served: tests/server/
test_tool_calls_mtp.py)."""

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures import build_tiny_glm45_tools as build

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-glm45-tools"


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return json.loads((FIXTURE / "tool_prompts.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(FIXTURE)


def test_tokens_and_stop_ids_are_glm45s(tokenizer):
    added = {t.content: t.special
             for t in tokenizer.added_tokens_decoder.values()}
    assert all(added[t] for t in build.SPECIAL_TOKENS)
    # The tags are single tokens that decoding keeps, as in GLM-4.5.
    assert not any(added[t] for t in build.PLAIN_TOKENS)
    text = "\n<think>a</think>\n<tool_call>f\n</tool_call>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    stops = [tokenizer.convert_tokens_to_ids(t) for t in build.STOP_TOKENS]
    for name in ("config.json", "generation_config.json"):
        assert json.loads((FIXTURE / name).read_text())[
            "eos_token_id"] == stops


def test_chat_template_renders_the_requests_as_vllm_does(prompts,
                                                         tokenizer):
    """vLLM hands the template the tools as dumped by its request model
    and the calls' arguments as dicts: the saved prompt ids."""
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    for p in prompts:
        request = ChatCompletionRequest(model="m", messages=p["messages"],
                                        tools=p["tools"])
        messages = json.loads(json.dumps(p["messages"]))  # a copy
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(
                    call["function"]["arguments"])
        ids = tokenizer.apply_chat_template(
            messages, tools=[t.model_dump() for t in request.tools],
            add_generation_prompt=True, tokenize=True)
        assert ids == p["prompt_token_ids"], p["name"]


def test_greedy_answers_are_the_trained_ones(prompts):
    from tools.reference.acceptance import Glm45Reference

    stops = json.loads((FIXTURE / "generation_config.json").read_text())[
        "eos_token_id"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls
    try:
        results = build.check_greedy(Glm45Reference(FIXTURE), prompts,
                                     stops)
    finally:
        torch.set_num_threads(threads)
    assert all(r["matches"] for r in results), results


def test_glm45_parsers_return_the_expected_answers(prompts, tokenizer):
    """Not streamed, as vLLM's chat server runs them: reasoning first,
    then the calls in the content."""
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.tool_parsers.glm4_moe_tool_parser import (
        Glm4MoeModelToolParser)
    from vllm.reasoning.glm4_moe_reasoning_parser import (
        Glm4MoeModelReasoningParser)

    for p in prompts:
        request = ChatCompletionRequest(model="m", messages=p["messages"],
                                        tools=p["tools"])
        reasoning, content = Glm4MoeModelReasoningParser(
            tokenizer).extract_reasoning_content(p["answer_text"], request)
        info = Glm4MoeModelToolParser(tokenizer).extract_tool_calls(
            content or "", request)
        got = {
            "reasoning_content": reasoning,
            "content": info.content if info.tools_called else content,
            "tool_calls": [{"name": c.function.name,
                            "arguments": json.loads(c.function.arguments)}
                           for c in info.tool_calls],
        }
        assert got == p["expected"], p["name"]
