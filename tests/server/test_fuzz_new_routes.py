"""Fuzzing the routes other clients use (Ollama's /api/chat and /api/generate, the Responses API,
llama-server's /completion) with hypothesis-generated bodies: every answer is a 2xx or a 4xx with a JSON
error, never a 500 or a hang; and the engine holds no page afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import wait_no_pages_in_use
from tests.server.test_fuzz import TIMEOUT_S, junk, mutated, text

options = st.fixed_dictionaries({"num_predict": st.integers(1, 3)}, optional={
    "num_ctx": st.integers(-1, 4096), "temperature": st.floats(-1, 3),
    "top_k": st.integers(-1, 50), "top_p": st.floats(0, 1), "seed": st.integers(-5, 5),
    "stop": st.lists(text, max_size=2), "repeat_penalty": st.sampled_from([1.0, 1.1]),
    "min_p": st.sampled_from([0.0, 0.05]), "presence_penalty": st.floats(-3, 3)})
fmt = st.one_of(st.sampled_from(["", "json", "yaml"]), st.just({"type": "object"}), junk)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                           "content": text}), max_size=3)
ollama_common = {"stream": st.booleans(), "format": fmt,
                 "keep_alive": st.one_of(st.sampled_from(["5m", "0", "-1", "soon"]), st.integers(-1, 600)),
                 "think": st.one_of(st.booleans(), junk)}
ollama_chat = st.fixed_dictionaries({"model": st.just("MODEL"), "messages": messages, "options": options},
                                    optional=ollama_common).flatmap(
    lambda b: mutated(b, ["model", "messages", *ollama_common]))
ollama_generate = st.fixed_dictionaries({"model": st.just("MODEL"), "prompt": text, "options": options}, optional={
    **ollama_common, "raw": st.booleans(), "system": text, "suffix": text, "context": junk}).flatmap(
    lambda b: mutated(b, ["model", "prompt", "raw", "system", *ollama_common]))
items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]), "content": text}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "message", "x"]),
                           "call_id": text, "name": text, "arguments": text, "output": text})), max_size=3)
responses_body = st.fixed_dictionaries({"input": st.one_of(text, items), "max_output_tokens": st.integers(1, 3)},
                                       optional={"instructions": text, "stream": st.booleans(), "store": st.booleans(),
                                                 "temperature": st.floats(-1, 3), "previous_response_id": text,
                                                 "tool_choice": st.sampled_from(["auto", "none", "required"]),
                                                 "text": st.one_of(junk, st.just({"format": {"type": "json_object"}}))}
                                       ).flatmap(lambda b: mutated(b, ["input", "max_output_tokens", "text", "store"]))
llamacpp_body = st.fixed_dictionaries({"prompt": text, "n_predict": st.integers(-1, 3)}, optional={
    "grammar": st.one_of(text, st.just('root ::= "a"')), "stream": st.booleans(), "cache_prompt": st.booleans(),
    "logit_bias": st.one_of(junk, st.lists(st.tuples(st.integers(-1, 60000), st.booleans()).map(list), max_size=2)),
    "mirostat": st.integers(0, 2)}).flatmap(lambda b: mutated(b, ["prompt", "n_predict", "grammar", "logit_bias"]))


def short(body) -> bool:
    """No example may run long: each keeps a small token limit (one it dropped or junked is filtered)."""
    if not isinstance(body, dict):
        return True
    opts = body.get("options")
    limits = {"/api": opts.get("num_predict") if isinstance(opts, dict) else None,
              "responses": body.get("max_output_tokens"), "completion": body.get("n_predict")}
    kind = "/api" if "model" in body or "messages" in body else "responses" if "input" in body else "completion"
    return type(limits[kind]) is int and 1 <= limits[kind] <= 4 or limits[kind] is not None and type(limits[kind]) is not int


def check(server, model_name: str, path: str, payload) -> None:
    if isinstance(payload, dict) and payload.get("model") == "MODEL":
        payload["model"] = model_name
    with httpx.Client(timeout=TIMEOUT_S) as http:
        response = http.post(server.url + path, content=json.dumps(payload).encode(),
                             headers={"content-type": "application/json"})
    assert response.status_code < 500, (payload, response.text)
    if response.status_code >= 400:
        assert response.json()["error"], response.text


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(ollama_chat.map(lambda b: ("/api/chat", b)),
                         ollama_generate.map(lambda b: ("/api/generate", b)),
                         responses_body.map(lambda b: ("/v1/responses", b)),
                         llamacpp_body.map(lambda b: ("/completion", b))).filter(lambda pb: short(pb[1])))
def test_fuzz_the_other_clients_routes(server, model_name, payload):
    check(server, model_name, *payload)


def test_engine_is_idle_after_fuzzing_them(async_engine, server):
    wait_no_pages_in_use(async_engine)
