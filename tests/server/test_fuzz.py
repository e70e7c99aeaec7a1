"""Fuzzing the HTTP API with hypothesis-generated bodies (valid, half-valid and nonsense) for both
endpoints: every answer is a 2xx or a 4xx with OpenAI's error JSON, never a 500 and never a hang; a
stream always ends with [DONE]; and the engine is idle with no page in use afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import wait_no_pages_in_use

TIMEOUT_S = 120  # a hang fails the test
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                 st.text(max_size=8), st.lists(st.integers(-5, 5), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
# any text, sometimes with a lone surrogate (JSON can carry one as \ud800)
text = st.one_of(st.text(max_size=40),
                 st.tuples(st.text(max_size=8), st.characters(categories=["Cs"])).map("".join))
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)

# values a client may well send (some still invalid: empty prompts, odd stop strings, ...);
# a valid max_tokens is small, so no example runs long
common = {
    "model": st.just("MODEL"),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "n": st.integers(1, 3),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": text,
    "cache_salt": text,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(st.integers(0, 60000).map(str), st.floats(-150, 150), max_size=3),
}
completion_fields = {**common, "logprobs": st.integers(0, 5), "echo": st.booleans()}
chat_fields = {**common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
               "max_completion_tokens": st.integers(1, 4)}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                "text": text}), max_size=2))})


def mutated(body: dict, fields: list[str]):
    """The body as it is, or with one field (present or not) set to junk, or one field dropped."""
    return st.one_of(
        st.just(body),
        st.tuples(st.sampled_from(fields), junk).map(lambda kv: {**body, kv[0]: kv[1]}),
        st.sampled_from(sorted(body)).map(lambda k: {f: v for f, v in body.items() if f != k}))




def short(body: dict) -> bool:
    """No example may ask for a long generation (a junk integer can be a valid max_tokens)."""
    limits = [body.get("max_tokens"), body.get("max_completion_tokens")]
    return not any(type(v) is int and 4 < v <= 4096 for v in limits)


# the body starts with a token limit, as a chat body does: without one /v1/completions generates its
# default 16 tokens for every prompt and choice; dropping a field (mutated) still sends some bodies
# without it, so the default stays fuzzed
completion_body = st.fixed_dictionaries(
    {"prompt": st.one_of(text, token_ids, st.lists(text, min_size=1, max_size=3),
                         st.lists(token_ids, min_size=1, max_size=2)),
     "max_tokens": completion_fields["max_tokens"]},
    optional={k: v for k, v in completion_fields.items() if k != "max_tokens"},
).flatmap(lambda b: mutated(b, ["prompt", *completion_fields])).filter(short)
# chat without a token limit would run to max_model_len: the body always keeps one
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3), "max_tokens": st.integers(1, 4)},
    optional={k: v for k, v in chat_fields.items() if k != "max_tokens"},
).flatmap(lambda b: mutated(b, ["messages", *chat_fields])).filter(short).filter(
    lambda b: type(b.get("max_tokens")) is int or type(b.get("max_completion_tokens")) is int)


def check(server, model_name: str, path: str, payload) -> None:
    if isinstance(payload, dict) and payload.get("model") == "MODEL":
        payload["model"] = model_name
    content = json.dumps(payload).encode()  # NaN/Infinity stay as JSON extensions on purpose
    with httpx.Client(timeout=TIMEOUT_S) as http:
        response = http.post(server.url + path, content=content,
                             headers={"content-type": "application/json"})
    assert response.status_code < 500, (payload, response.text)
    event(f"status {response.status_code}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"], response.text
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", response.text
        for line in events[:-1]:
            assert "error" not in json.loads(line[6:]), line
    else:
        assert response.json()["choices"], response.text


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=completion_body)
def test_fuzz_completions(server, model_name, payload):
    check(server, model_name, "/v1/completions", payload)


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=chat_body)
def test_fuzz_chat(server, model_name, payload):
    check(server, model_name, "/v1/chat/completions", payload)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bytes(server, raw, path):
    with httpx.Client(timeout=TIMEOUT_S) as http:
        response = http.post(server.url + path, content=raw,
                             headers={"content-type": "application/json"})
    assert response.status_code < 500, (raw, response.text)


def test_engine_is_idle_after_fuzzing(async_engine, server):
    wait_no_pages_in_use(async_engine)
