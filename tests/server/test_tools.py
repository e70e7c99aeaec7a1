"""Tool calling on both APIs over a tiny Qwen2-architecture model with Qwen2.5's tool template: tools
rendered by the model's own template (as transformers renders them), one token prefix for the same
tools and system prompt whichever API sends them, tool results sent back, and bad tool input as a
400 that names the field."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import ServerThread
from tests.server.tool_templates import QWEN25_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}


def anthropic_tool(tool: dict) -> dict:
    f = tool["function"]
    return {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.model.tiny_models import make_hf_model, write_gguf

    path = write_gguf(make_hf_model("qwen2", max_position_embeddings=4096), "qwen2",
                      tmp_path_factory.mktemp("qwen") / "q.gguf", chat_template=QWEN25_TEMPLATE)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), kv_cache_memory="16MiB",
                                                max_model_len=4096, dtype="float32",
                                                min_cacheable_tokens=128))).start()
    try:
        with ServerThread(build_app(engine, model_name="qwen")) as running:
            yield running, engine
    finally:
        engine.shutdown()


@pytest.fixture
def seen_prompts(tool_server, monkeypatch):
    _, engine = tool_server
    seen: list[list[int]] = []
    real = engine.engine.add_request
    monkeypatch.setattr(engine.engine, "add_request",
                        lambda prompt, *a, **k: (seen.append(list(prompt)), real(prompt, *a, **k))[1])
    return seen


def clients(url: str):
    return (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120))


def test_tools_render_as_transformers_renders_them(tool_server):
    from transformers import PreTrainedTokenizerFast

    _, engine = tool_server
    loaded = engine.engine.loaded
    hf = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, chat_template=QWEN25_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    ours = engine.engine.chat_prompt(messages, [WEATHER, CLOCK])
    assert ours == hf.apply_chat_template(messages, tools=[WEATHER, CLOCK], tokenize=False,
                                          add_generation_prompt=True)
    assert '"name": "get_time"' in ours and "<tool_response>\nsunny" in ours


def test_same_tools_and_system_give_one_prefix_on_both_apis(tool_server, seen_prompts):
    running, engine = tool_server
    gpt, claude = clients(running.url)
    system = f"Session {uuid.uuid4().hex}. You are a weather agent."
    question = "Weather in Paris?"
    first = gpt.chat.completions.create(model="qwen", max_tokens=1, temperature=0, tools=[WEATHER, CLOCK],
                                        messages=[{"role": "system", "content": system},
                                                  {"role": "user", "content": question}])
    again = gpt.chat.completions.create(model="qwen", max_tokens=1, temperature=0, tools=[WEATHER, CLOCK],
                                        messages=[{"role": "system", "content": system},
                                                  {"role": "user", "content": question}])
    second = claude.messages.create(model="qwen", max_tokens=1, system=system,
                                    tools=[anthropic_tool(WEATHER), anthropic_tool(CLOCK)],
                                    messages=[{"role": "user", "content": question}])
    assert len(seen_prompts) == 3 and seen_prompts[0] == seen_prompts[1] == seen_prompts[2]
    n = len(seen_prompts[0])
    page = engine.engine.config.page_size
    assert first.usage.prompt_tokens == n > 200  # the tool definitions are in the prompt
    assert again.usage.prompt_tokens_details.cached_tokens >= (n - 1) // page * page
    assert second.usage.cache_read_input_tokens >= (n - 1) // page * page


def test_tool_results_are_accepted_back_on_both_apis(tool_server, seen_prompts):
    running, engine = tool_server
    gpt, claude = clients(running.url)
    reply = gpt.chat.completions.create(model="qwen", max_tokens=2, temperature=0, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    message = claude.messages.create(model="qwen", max_tokens=2, tools=[anthropic_tool(WEATHER)], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}])
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert seen_prompts[0] == seen_prompts[1]  # one conversation, one prompt, either API
    text = engine.engine.decode(seen_prompts[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def chat_error(url: str, **body) -> tuple[int, dict]:
    body = {"model": "qwen", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    return response.status_code, response.json()


def messages_error(url: str, **body) -> tuple[int, dict]:
    body = {"model": "qwen", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(url + "/v1/messages", json=body, timeout=60)
    return response.status_code, response.json()


def test_bad_tool_input_is_a_400_naming_the_field_on_chat_completions(tool_server):
    url = tool_server[0].url
    status, body = chat_error(url, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert status == 400 and body["error"]["param"] == "tool_choice" and "nope" in body["error"]["message"]
    status, body = chat_error(url, tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tool_choice"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    status, body = chat_error(url, tools=[bad_schema])
    assert status == 400 and body["error"]["param"] == "tools.0.function.parameters"
    status, body = chat_error(url, tools=[{"type": "function", "function": {"name": "has space"}}])
    assert status == 400 and body["error"]["param"] == "tools.0.function.name"
    status, body = chat_error(url, tools=[WEATHER], messages=[
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}])
    assert status == 400 and body["error"]["param"] == "messages.1.tool_call_id"
    status, body = chat_error(url, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": "{not json"}}]}])
    assert status == 400 and body["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


def test_bad_tool_input_is_a_400_naming_the_field_on_messages(tool_server):
    url = tool_server[0].url
    tool = anthropic_tool(WEATHER)
    status, body = messages_error(url, tools=[tool], tool_choice={"type": "tool", "name": "nope"})
    assert status == 400 and "tool_choice.name" in body["error"]["message"] and "nope" in body["error"]["message"]
    status, body = messages_error(url, tools=[{**tool, "input_schema": {"type": "object", "properties": []}}])
    assert status == 400 and body["error"]["message"].startswith("tools.0.input_schema")
    status, body = messages_error(url, tools=[tool], messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}])
    assert status == 400 and body["error"]["message"].startswith("messages.2.content.0.tool_use_id")
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_diagnostics_say_tools_changed_and_reads_cover_unchanged_tools(tool_server):
    """Must-show 4: a cache_control on the last tool is a breakpoint; the next call with the same
    tools reads them from the cache; a call with one tool description changed is `tools_changed`."""
    running, _ = tool_server
    _, claude = clients(running.url)
    tools = [anthropic_tool(WEATHER), {**anthropic_tool(CLOCK), "cache_control": {"type": "ephemeral"}}]
    system = f"Session {uuid.uuid4().hex}. You are a weather agent."
    first = claude.messages.create(model="qwen", max_tokens=1, system=system, tools=tools,
                                   messages=[{"role": "user", "content": "Weather in Paris?"}],
                                   diagnostics={"previous_message_id": None})
    written = first.usage.cache_creation_input_tokens
    assert written > 200 and first.usage.cache_read_input_tokens == 0
    other = claude.messages.create(model="qwen", max_tokens=1, system=system, tools=tools,
                                   messages=[{"role": "user", "content": "And in Rome?"}],
                                   diagnostics={"previous_message_id": first.id})
    # the question changed, not the tools: nothing cached before it was missed
    assert other.diagnostics.cache_miss_reason.type == "messages_changed"
    assert other.diagnostics.cache_miss_reason.cache_missed_input_tokens == 0
    assert other.usage.cache_read_input_tokens == written  # the tools (and the system before them)
    changed_tools = [tools[0], {**tools[1], "description": "The local time in a city, 24-hour clock."}]
    changed = claude.messages.create(model="qwen", max_tokens=1, system=system, tools=changed_tools,
                                     messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     diagnostics={"previous_message_id": first.id})
    assert changed.diagnostics.cache_miss_reason.type == "tools_changed"
    assert changed.usage.cache_read_input_tokens == 0


def test_streams_with_tools_offered_keep_each_apis_event_shape(tool_server):
    running, _ = tool_server
    gpt, claude = clients(running.url)
    chunks = list(gpt.chat.completions.create(model="qwen", max_tokens=8, temperature=0, tools=[WEATHER],
                                              stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    with claude.messages.stream(model="qwen", max_tokens=8, tools=[anthropic_tool(WEATHER)],
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.content and final.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_an_answer_that_is_no_tool_call_lets_its_hold_go(tool_server):
    """The engine holds every finished tools answer for a moment; the server keeps the hold only
    when the answer is a tool call (here the random model answers text: released at once)."""
    running, engine = tool_server
    body = {"model": "qwen", "max_tokens": 3, "temperature": 0, "tools": [WEATHER], "kv_explain": True,
            "tool_choice": "auto", "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}]}
    out = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60).json()
    if out["choices"][0]["finish_reason"] == "stop":
        assert out["kv_cache"]["tool_call_hold"] == {"held": False, "refused": None, "reason": "no_tool_call"}
    report = httpx.get(running.url + "/v1/cache/report", timeout=60).json()
    assert report["tool_call_holds"]["held"] == 0


# -- forced calls: the grammar makes the model call ---------------------------------------------------
def test_openai_tool_round_trip_with_the_call_forced(tool_server):
    """Must-show 1 (OpenAI): a named tool_choice makes the random model call, parsed into tool_calls
    (streamed and not); the tool result goes back and the answer comes; the follow-up reads the
    conversation the hold kept."""
    running, engine = tool_server
    gpt, _ = clients(running.url)
    question = [{"role": "system", "content": f"Session {uuid.uuid4().hex}."},
                {"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = gpt.chat.completions.create(model="qwen", max_tokens=100, temperature=1.0, seed=3, tools=[WEATHER, CLOCK],
                                        tool_choice=forced, messages=question, extra_body={"kv_explain": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert first.kv_cache["tool_call_hold"]["held"] is True
    streamed = list(gpt.chat.completions.create(model="qwen", max_tokens=100, temperature=1.0, seed=4,
                                                tools=[WEATHER, CLOCK], tool_choice="required", stream=True,
                                                messages=question))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name in ("get_weather", "get_time")
    assert json.loads("".join(d.function.arguments or "" for d in deltas))
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    follow = gpt.chat.completions.create(model="qwen", max_tokens=4, temperature=0, tools=[WEATHER, CLOCK],
                                         extra_body={"kv_explain": True}, messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls
    assert follow.kv_cache["tool_call_holds_ended"] == [first.kv_cache["tool_call_hold"]["lease_id"]]
    # the forced call is written as the template writes it back: the hit runs past the question
    assert follow.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


def test_anthropic_tool_round_trip_with_the_call_forced(tool_server):
    """Must-show 1 (Anthropic): tool_choice any makes the model call; tool_use parsed, streamed as
    input_json_delta; the tool_result goes back and the answer comes."""
    running, _ = tool_server
    _, claude = clients(running.url)
    tools = [anthropic_tool(WEATHER), anthropic_tool(CLOCK)]
    question = [{"role": "user", "content": f"Weather in Paris? {uuid.uuid4().hex}"}]
    first = claude.messages.create(model="qwen", max_tokens=100, tools=tools, messages=question,
                                   tool_choice={"type": "tool", "name": "get_time"})
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"][0]
    assert use.name == "get_time" and isinstance(use.input["city"], str)
    with claude.messages.stream(model="qwen", max_tokens=100, tools=tools, messages=question,
                                tool_choice={"type": "any"}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    assert [b for b in final.content if b.type == "tool_use"][0].input
    answer = claude.messages.create(model="qwen", max_tokens=4, tools=tools, messages=question + [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
