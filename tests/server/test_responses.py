"""OpenAI's Responses API through the real openai SDK against a real server: text, streaming events,
a function-call round trip, `text.format`, included logprobs, a follow-up by `previous_response_id` whose cached tokens
cover the previous turn's pages, GET and DELETE, `store: false`, tenants kept apart, and bad input
answered with a 4xx naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.conftest import ServerThread, on_engine

PAGE = 16  # the test engine's page size
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city today.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
STORY = ("Here is a short story about a lighthouse keeper named Ada who lives on a rocky island, keeps "
         "a logbook of every ship, and feeds the gulls each morning before the fog lifts. ")


def test_text_and_a_follow_up_that_hits_the_previous_turn(client, model_name, async_engine):
    first = client.responses.create(model=model_name, input=STORY + "Who is the keeper?",
                                    max_output_tokens=12, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.usage.input_tokens > 40
    follow = client.responses.create(model=model_name, input="What does she feed?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=8)
    previous_turn = first.usage.input_tokens + first.usage.output_tokens
    # every full page of the previous turn (prompt and answer) is served from the cache
    assert follow.usage.input_tokens_details.cached_tokens >= previous_turn // PAGE * PAGE
    assert follow.usage.input_tokens > previous_turn
    assert follow.previous_response_id == first.id
    got = client.responses.retrieve(follow.id)
    assert got.id == follow.id and got.output_text == follow.output_text
    leased = lambda: on_engine(async_engine, lambda: async_engine.engine.manager.leases.num_leased_pages)  # noqa: E731
    held = leased()
    assert held > 0  # the stored responses' conversations are held
    client.responses.delete(follow.id)
    client.responses.delete(first.id)
    assert leased() < held  # deleting lets their pages go before the hold's TTL
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)


def test_follow_up_equals_the_same_conversation_sent_whole(client, model_name):
    first = client.responses.create(model=model_name, input="Name a fruit.", max_output_tokens=10, temperature=0)
    follow = client.responses.create(model=model_name, input="Name another.", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    whole = client.responses.create(model=model_name, max_output_tokens=10, temperature=0, store=False, input=[
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "Name another."}])
    assert follow.output_text == whole.output_text
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.create(model=model_name, input="More.", previous_response_id=whole.id)


def test_streaming_events_add_up_to_the_response(client, model_name):
    events = list(client.responses.create(model=model_name, input="Say hello.", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text
    assert client.responses.retrieve(final.id).output_text == text


def test_included_logprobs_are_chats_whole_and_with_each_delta(client, model_name):
    ask = {"model": model_name, "input": "Say hello.", "max_output_tokens": 6, "temperature": 0,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    part = client.responses.create(**ask).output[0].content[0]
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert [e.model_dump() for e in part.logprobs] == [e.model_dump() for e in chat.choices[0].logprobs.content]
    events = list(client.responses.create(**ask, stream=True))
    sent = [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    assert sent == [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in done.logprobs]
    # not included: none; an include naming outputs this server has none of adds nothing
    plain = client.responses.create(**{**ask, "include": ["reasoning.encrypted_content"]}).output[0].content[0]
    assert plain.logprobs is None and plain.text == part.text


def test_function_call_round_trip(client, model_name):
    call = client.responses.create(model=model_name, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=40)
    [fc] = [item for item in call.output if item.type == "function_call"]
    assert fc.name == "get_weather" and isinstance(json.loads(fc.arguments)["city"], str)
    streamed = list(client.responses.create(model=model_name, input="What is the weather in Paris?",
                                            tools=[WEATHER], tool_choice="required", temperature=0,
                                            max_output_tokens=40, stream=True))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == fc.arguments
    answer = client.responses.create(model=model_name, previous_response_id=call.id, tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=20,
                                     input=[{"type": "function_call_output", "call_id": fc.call_id,
                                             "output": "Sunny, 24 C"}])
    assert answer.output_text and answer.usage.input_tokens_details.cached_tokens >= PAGE


def test_text_format_json_schema(client, model_name):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.responses.create(model=model_name, input="Pick a number.", temperature=1.0,
                                  max_output_tokens=30, text={"format": {"type": "json_schema", "name": "n",
                                                                         "schema": schema, "strict": True}})
    assert isinstance(json.loads(out.output_text)["n"], int)


def test_a_tenant_never_reads_or_continues_anothers_response(async_engine, model_name):
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, api_keys=["sk-a", "sk-b"])) as server:
        a = OpenAI(base_url=server.url + "/v1", api_key="sk-a", max_retries=0, timeout=120)
        b = OpenAI(base_url=server.url + "/v1", api_key="sk-b", max_retries=0, timeout=120)
        mine = a.responses.create(model=model_name, input="A secret: 42.", max_output_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError) as err:
            b.responses.create(model=model_name, input="What was it?", previous_response_id=mine.id)
        assert err.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(mine.id)
        assert a.responses.retrieve(mine.id).id == mine.id


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "hi", "prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "include": ["message.output_text.everything"]}, "include.0"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_input_is_a_4xx_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["message"].startswith(param), r.text


def test_prompt_cache_diagnostics_compare_with_an_earlier_response(client, model_name):
    base = client.responses.create(model=model_name, input=STORY + "Who is she?", max_output_tokens=2,
                                   temperature=0, prompt_cache_key="story")
    compare = {"comparison_response_id": base.id}
    same = client.responses.create(model=model_name, input=STORY + "Who is she?", max_output_tokens=2,
                                   prompt_cache_key="story", prompt_cache_options=compare)
    follow = client.responses.create(model=model_name, input="And then?", previous_response_id=base.id,
                                     max_output_tokens=2, prompt_cache_key="story", prompt_cache_options=compare)
    assert same.prompt_cache_diagnostics.type == follow.prompt_cache_diagnostics.type == "cache_hit"
    changed = client.responses.create(model=model_name, input="A different story. " + STORY, max_output_tokens=2,
                                      prompt_cache_key="story", prompt_cache_options=compare)
    miss = changed.prompt_cache_diagnostics
    assert miss.type == "cache_miss" and miss.reason == "input_changed"
    assert miss.cache_missed_tokens == base.usage.input_tokens - miss.comparison_reusable_tokens > 0
    rekeyed = client.responses.create(model=model_name, input=STORY, max_output_tokens=2,
                                      prompt_cache_key="other", prompt_cache_options=compare)
    assert rekeyed.prompt_cache_diagnostics.reason == "prompt_cache_key_changed"
    tooled = client.responses.create(model=model_name, input=STORY, max_output_tokens=2, tools=[WEATHER],
                                     prompt_cache_key="story", prompt_cache_options=compare)
    assert tooled.prompt_cache_diagnostics.reason == "tools_changed"
    gone = client.responses.create(model=model_name, input=STORY, max_output_tokens=2,
                                   prompt_cache_options={"comparison_response_id": "resp_nope"})
    assert gone.prompt_cache_diagnostics.type == "comparison_response_not_found"
    with pytest.raises(openai.BadRequestError):  # a TTL OpenAI does not define is refused, not ignored
        client.responses.create(model=model_name, input="x", prompt_cache_options={"ttl": "7d"})


def test_a_stored_responses_hold_outlives_a_tool_calls_and_then_expires(model_name):
    """Lease TTLs scaled by 0.01: a tool-call hold would last 0.3 s, a stored response's 3 s."""
    import time

    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import SMALL_ENGINE

    engine = AsyncEngine(LLMEngine(EngineConfig(**{**SMALL_ENGINE, "kv_cache_memory": "64MiB", "max_model_len": 512},
                                                lease_ttl_scale=0.01)))
    with ServerThread(build_app(engine)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        leased = lambda: on_engine(engine, lambda: engine.engine.manager.leases.num_leased_pages)  # noqa: E731
        start = time.monotonic()
        client.responses.create(model=model_name, input=STORY, max_output_tokens=4, temperature=0)
        time.sleep(max(0.0, start + 1.5 - time.monotonic()))
        assert leased() >= 4  # past a tool-call hold's 0.3 s, still held
        deadline = time.monotonic() + 10
        while leased() and time.monotonic() < deadline:
            time.sleep(1.0)  # (an idle engine expires leases after 0.5 s without a command: not polled faster)
        assert leased() == 0 and time.monotonic() - start > 2.5  # gone after its 3 s
    engine.shutdown()
