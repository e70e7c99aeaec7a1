"""A constraint the engine cannot enforce ends in a 400, never in output outside it with finish_reason
"stop" (issue 44). The grammars here require the end-of-turn token (<|im_end|>, id 2: SmolLM2's EOS)
in the middle of the output: the engine must stop on it, so the output ("Hello") would stop short of
the grammar. Before: 200, text "Hello", finish_reason "stop"."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.structured import StructuredOutputsParams
from tests.server.conftest import on_engine

NEEDS_EOS = ['start: "Hello" <|im_end|> " world"', 'start: "Hello" <[2]> " world"']
MESSAGES = [{"role": "user", "content": "Greet the world."}]


def test_a_state_that_ended_short_of_its_grammar_says_why(async_engine):
    engine = async_engine.engine
    compiled = on_engine(async_engine, lambda: engine.grammar_compiler().compile(
        StructuredOutputsParams(grammar=NEEDS_EOS[0])))
    hello = engine.tokenizer.encode("Hello", add_special_tokens=False).ids
    world = engine.tokenizer.encode(" world", add_special_tokens=False).ids
    state = compiled.new_state()
    for token in [*hello, 2]:
        assert state.accept(token)
    assert "before the grammar was complete" in state.violation
    for token in world:
        assert state.accept(token)
    assert state.violation == ""  # complete: a normal stop
    broken = compiled.new_state()
    assert not broken.accept(world[0])  # refused: the matcher is in error
    assert broken.violation.startswith("the grammar could not be followed") and len(broken.violation) < 400


@pytest.mark.parametrize("grammar", NEEDS_EOS, ids=["special-token", "token-id"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_grammar_that_needs_the_end_token_mid_output_is_a_400(server, model_name, grammar, route):
    body = ({"messages": MESSAGES} if route == "chat" else {"prompt": "Greeting:"})
    answer = httpx.post(f"{server.url}/v1/{'chat/' if route == 'chat' else ''}completions", timeout=120,
                        json={"model": model_name, "max_tokens": 16, "temperature": 0, **body,
                              "guided_grammar": grammar})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "constraint_not_enforceable", error
    assert "before the grammar was complete" in error["message"]


def test_streamed_it_ends_with_an_error_event_not_a_stop(server, model_name):
    payloads = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": model_name, "messages": MESSAGES, "max_tokens": 16, "stream": True,
                            "guided_grammar": NEEDS_EOS[0]}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                payloads.append(json.loads(line[6:]))
    reasons = [c.get("finish_reason") for p in payloads for c in p.get("choices", [])]
    assert "stop" not in reasons, payloads
    assert payloads[-1]["error"]["code"] == "constraint_not_enforceable", payloads[-1]


def test_a_grammar_it_can_enforce_still_stops_normally(server, model_name):
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model_name, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
        "guided_grammar": 'start: "Hello" " world"'})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Hello world", "stop")
