"""Fuzzing the HTTP API with hypothesis-generated bodies (valid, half-valid and nonsense) for both
endpoints: every answer is a 2xx or a 4xx with OpenAI's error JSON, never a 500 and never a hang; a
stream always ends with [DONE]; and the engine is idle with no page in use afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import wait_no_pages_in_use

TIMEOUT_S = 120  # a hang fails the test
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                 st.text(max_size=8), st.lists(st.integers(-5, 5), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
# any text, sometimes with a lone surrogate (JSON can carry one as \ud800)
text = st.one_of(st.text(max_size=40),
                 st.tuples(st.text(max_size=8), st.characters(categories=["Cs"])).map("".join))
small_tokens = st.one_of(st.integers(1, 4), junk)  # a valid max_tokens is small: no long runs
token_ids = st.lists(st.integers(-3, 50000), min_size=0, max_size=12)

common = {
    "max_tokens": small_tokens,
    "temperature": st.one_of(st.floats(-1, 3), junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "top_k": st.one_of(st.integers(-2, 100), junk),
    "n": st.one_of(st.integers(-1, 20), junk),
    "seed": st.one_of(st.integers(-2**64, 2**64), junk),
    "stop": st.one_of(text, st.lists(text, max_size=3), junk),
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "user": st.one_of(text, junk),
    "cache_salt": st.one_of(text, junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "presence_penalty": st.one_of(st.just(0), junk),
    "model": st.one_of(st.just("MODEL"), text, junk),
}
completion_body = st.fixed_dictionaries(
    {"prompt": st.one_of(text, token_ids, st.lists(text, max_size=3), st.lists(token_ids, max_size=2),
                         junk)},
    optional={**common, "logprobs": st.one_of(st.integers(-1, 25), junk),
              "echo": st.one_of(st.booleans(), junk), "best_of": junk, "suffix": junk})
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "developer"]), junk),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                "text": text}), max_size=2),
                          junk)})
# chat without max_tokens would run to max_model_len; the generated body always bounds it
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), junk),
     "max_completion_tokens": st.one_of(st.integers(1, 4), junk.filter(lambda v: v is not None))},
    optional={**common, "logprobs": st.one_of(st.booleans(), junk),
              "top_logprobs": st.one_of(st.integers(-1, 25), junk)})


def check(server, model_name: str, path: str, payload) -> None:
    if isinstance(payload, dict) and payload.get("model") == "MODEL":
        payload["model"] = model_name
    content = json.dumps(payload).encode()  # NaN/Infinity stay as JSON extensions on purpose
    with httpx.Client(timeout=TIMEOUT_S) as http:
        response = http.post(server.url + path, content=content,
                             headers={"content-type": "application/json"})
    assert response.status_code < 500, (payload, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"], response.text
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", response.text
        for event in events[:-1]:
            assert "error" not in json.loads(event[6:]), event
    else:
        assert response.json()["choices"], response.text


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=completion_body)
def test_fuzz_completions(server, model_name, payload):
    check(server, model_name, "/v1/completions", payload)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
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
