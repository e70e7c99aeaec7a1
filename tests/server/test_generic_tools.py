"""The generic tool format: the bundled model, whose template never reads `tools`, served with no flags,
answers tools through the openai, anthropic and ollama clients (a forced call is a valid call by
grammar; the definitions are in the system turn the model sees), and a tool result comes back as the
documented `tool_response` user turn."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest

from kvserve.model.generic_tools import GENERIC_TOOLS_PREAMBLE, GENERIC_TOOLS_RULE, with_generic_tools
from tests.server.test_tools import WEATHER, anthropic_tool

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_generic_format_puts_tools_in_the_system_turn_and_results_in_a_user_turn():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = with_generic_tools(messages, [WEATHER])
    assert out[0]["content"].startswith("Be brief.\n\n" + GENERIC_TOOLS_PREAMBLE)
    assert json.dumps({"name": "get_weather", "description": WEATHER["function"]["description"],
                       "parameters": WEATHER["function"]["parameters"]}) in out[0]["content"]
    assert out[0]["content"].endswith(GENERIC_TOOLS_RULE)
    assert out[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}
    assert json.loads(out[3]["content"]) == {"tool_response": {"name": "get_weather", "tool_call_id": "c1",
                                                               "content": "sunny"}}
    assert out[3]["role"] == "user" and "tool_calls" not in out[2]


def test_render_shows_the_tools_to_the_bundled_model(server, model_name, async_engine):
    ids = httpx.post(server.url + "/v1/chat/completions/render", timeout=60,
                     json={"model": model_name, "messages": ASK, "tools": [WEATHER]}).json()["token_ids"]
    text = async_engine.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n" + GENERIC_TOOLS_PREAMBLE) and '"get_weather"' in text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_forced_tool_call_on_the_bundled_model(client, model_name, choice):
    out = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                         temperature=0, max_tokens=60)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    follow = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=20, tools=[WEATHER],
        messages=[*ASK, out.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


def test_anthropic_forced_tool_use_on_the_bundled_model(server, model_name):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=300, max_retries=0)
    out = claude.messages.create(model=model_name, max_tokens=60, messages=ASK, tools=[anthropic_tool(WEATHER)],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)


def test_ollama_tool_call_on_the_bundled_model(server, model_name):
    """Ollama's API has no tool_choice, and the 135M model does not call a tool unforced; `format` with
    the call's schema is how an Ollama client forces one, and the answer comes back as a tool call."""
    oclient = ollama.Client(host=server.url, timeout=300)
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "arguments": WEATHER["function"]["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    out = oclient.chat(model=model_name, messages=ASK, tools=[WEATHER], format=call_schema,
                       options={"temperature": 0, "num_predict": 60})
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    streamed = list(oclient.chat(model=model_name, messages=ASK, tools=[WEATHER], format=call_schema,
                                 stream=True, options={"temperature": 0, "num_predict": 60}))
    assert streamed[-1].message.tool_calls[0].function.arguments == call.function.arguments
    answered = oclient.chat(model=model_name, tools=[WEATHER], options={"temperature": 0, "num_predict": 20},
                            messages=[*ASK, out.message, {"role": "tool", "tool_name": "get_weather",
                                                          "content": "Sunny, 24 C"}])
    assert answered.done and not answered.message.tool_calls
