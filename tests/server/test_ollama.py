"""Ollama's API through the real `ollama` client against a real server: chat (streamed and not),
generate, list, ps, show, version, `format` with a JSON schema (20 of 20 valid at temperature 1), a tool
call, options honoured (num_predict, seed, num_ctx), logprobs, and bad input answered with Ollama's 4xx error."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import pytest

from kvserve.config import KV_DTYPES

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def oclient(server):
    return ollama.Client(host=server.url, timeout=300)


def test_chat_streamed_equals_not_streamed_and_reports_counts(oclient, model_name):
    options = {"temperature": 0, "num_predict": 12}
    whole = oclient.chat(model=model_name, messages=QUESTION, options=options)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count <= 12 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0
    parts = list(oclient.chat(model=model_name, messages=QUESTION, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_chat_equals_openai_chat_at_temperature_0(oclient, client, model_name):
    ours = oclient.chat(model=f"{model_name}:latest", messages=QUESTION,
                        options={"temperature": 0, "num_predict": 10}).message.content
    theirs = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0,
                                            max_tokens=10).choices[0].message.content
    assert ours == theirs


def test_logprobs_are_openai_chats_entries_whole_and_streamed(server, oclient, client, model_name):
    options = {"temperature": 0, "num_predict": 6}
    whole = oclient.chat(model=model_name, messages=QUESTION, options=options, logprobs=True, top_logprobs=3)
    assert len(whole.logprobs) == whole.eval_count
    theirs = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=6,
                                            logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole.logprobs] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in theirs]
    streamed = list(oclient.chat(model=model_name, messages=QUESTION, options=options, logprobs=True,
                                 top_logprobs=3, stream=True))
    assert [e for p in streamed for e in p.logprobs or []] == whole.logprobs
    # generate, templated and raw (a completion underneath): the same entries; none unless asked, as Ollama
    for raw in (False, True):
        out = oclient.generate(model=model_name, prompt="1, 2, 3,", raw=raw, options=options, logprobs=True)
        assert len(out.logprobs) == out.eval_count and all(not e.top_logprobs for e in out.logprobs)
    # each entry's bytes, as Ollama sends them (the client's model leaves them out)
    body = {"model": model_name, "prompt": "1, 2, 3,", "options": options, "logprobs": True, "stream": False}
    [first, *_] = httpx.post(server.url + "/api/generate", json=body, timeout=120).json()["logprobs"]
    assert first["bytes"] == list(first["token"].encode())
    assert oclient.generate(model=model_name, prompt="1, 2, 3,", options=options, top_logprobs=3).logprobs is None
    with pytest.raises(ollama.ResponseError) as err:
        oclient.chat(model=model_name, messages=QUESTION, logprobs=True, top_logprobs=21)
    assert err.value.status_code == 400 and "top_logprobs" in str(err.value)


def test_generate_templated_raw_and_seeded(oclient, model_name):
    out = oclient.generate(model=model_name, prompt="Name a colour.", options={"temperature": 0, "num_predict": 8})
    assert out.done and out.response
    raw = oclient.generate(model=model_name, prompt="1, 2, 3, 4,", raw=True,
                           options={"temperature": 0, "num_predict": 4})
    assert raw.response.strip().startswith("5")
    seeded = [oclient.generate(model=model_name, prompt="Tell me a word.", options={
        "temperature": 1.0, "seed": 11, "num_predict": 6}).response for _ in range(2)]
    assert seeded[0] == seeded[1]
    streamed = "".join(p.response for p in oclient.generate(model=model_name, prompt="Name a colour.",
                                                               options={"temperature": 0, "num_predict": 8},
                                                               stream=True))
    assert streamed == out.response
    loaded = oclient.generate(model=model_name, prompt="")  # Ollama's "load the model" call
    assert loaded.done and loaded.done_reason == "load"


def test_format_schema_validates_20_of_20_at_temperature_1(oclient, model_name):
    def ask(seed: int) -> dict:
        out = oclient.chat(model=model_name, format=SCHEMA, options={"temperature": 1.0, "seed": seed,
                                                                      "num_predict": 60},
                           messages=[{"role": "user", "content": "Invent a person: name and age."}])
        return json.loads(out.message.content)

    with ThreadPoolExecutor(10) as pool:  # batched on the server: the 20 answers decode together
        people = list(pool.map(ask, range(20)))
    valid = [set(p) == {"name", "age"} and isinstance(p["age"], int) and 0 <= p["age"] <= 120
             and len(p["name"]) <= 12 for p in people]
    assert sum(valid) == 20 and len({json.dumps(p) for p in people}) > 1  # sampled, not one answer
    answers = [oclient.generate(model=model_name, prompt="Give a JSON object.", format="json",
                                options={"temperature": 1.0, "seed": seed, "num_predict": 60}) for seed in range(4)]
    for out in answers:  # an object, or one that num_predict cut
        if out.done_reason == "stop":
            assert isinstance(json.loads(out.response), dict)
        else:
            assert out.done_reason == "length" and out.response.lstrip().startswith("{")
    assert any(out.done_reason == "stop" for out in answers)


def test_list_show_ps_version(oclient, model_name, server):
    listed = oclient.list().models
    assert [m.model for m in listed] == [f"{model_name}:latest"]
    assert listed[0].size > 50_000_000 and listed[0].details.format == "gguf"
    shown = oclient.show(model_name)
    assert "<|im_start|>" in shown.template and shown.details.family == "llama"
    assert shown.modelinfo["llama.context_length"] == 2048
    oclient.chat(model=model_name, messages=QUESTION, options={"num_ctx": 512, "num_predict": 2},
                 keep_alive="10m")
    running = oclient.ps().models
    assert running[0].model == f"{model_name}:latest" and running[0].size > listed[0].size
    kv = httpx.get(server.url + "/api/ps").json()["models"][0]["kv_cache"]
    element_bytes = KV_DTYPES[kv["kv_cache_dtype"]].bytes_per_element  # the session engine's mode's (fp32, bf16)
    per_token = 2 * 30 * 3 * 64 * element_bytes  # K and V, 30 layers, 3 KV heads, head_dim 64
    assert kv["bytes_per_token"] == per_token
    assert kv["num_ctx"] == 512 and kv["reserved_at_load_for_num_ctx"] == per_token * 512
    # pages held now (other tests' leases, if any): whole pages, never the reserve-at-load figure
    assert kv["bytes_in_use"] % (16 * per_token) == 0 and kv["bytes_in_use"] < kv["pool_bytes"]
    assert httpx.get(server.url + "/api/version").json()["version"]


def test_num_ctx_caps_the_request(oclient, model_name):
    with pytest.raises(ollama.ResponseError) as err:
        oclient.chat(model=model_name, messages=QUESTION, options={"num_ctx": 8})
    assert err.value.status_code == 400 and "num_ctx 8" in err.value.error and "tokens" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        oclient.chat(model=model_name, messages=QUESTION, options={"num_ctx": 40, "num_predict": 30})
    assert "num_predict 30" in err.value.error and "num_ctx 40" in err.value.error
    out = oclient.chat(model=model_name, messages=QUESTION, options={"num_ctx": 48, "temperature": 0})
    assert out.prompt_eval_count + out.eval_count <= 48


@pytest.mark.parametrize("body, named, status", [
    ({"model": "MODEL", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", 400),
    ({"model": "MODEL", "messages": QUESTION, "options": {"temperature": -1}}, "options.temperature", 400),
    ({"model": "MODEL", "messages": QUESTION, "options": {"mirostat": 2}}, "options.mirostat", 400),
    ({"model": "MODEL", "messages": QUESTION, "options": {"repeat_penalty": -1}}, "options.repeat_penalty", 400),
    ({"model": "MODEL", "messages": QUESTION, "options": {"num_ctx": 10**9}}, "options.num_ctx", 400),
    ({"model": "MODEL", "messages": QUESTION, "format": "yaml"}, "format", 400),
    ({"model": "MODEL", "messages": QUESTION, "keep_alive": "soon"}, "keep_alive", 400),
    ({"model": "MODEL", "messages": QUESTION, "think": True}, "think", 400),
    ({"model": "MODEL", "messages": [{"role": "tool", "content": "42"}]}, "messages.0", 400),
    ({"model": "no-such-model", "messages": QUESTION}, "model", 404),
    ({"messages": QUESTION}, "model", 400),
    ({"model": "MODEL", "prompt": "hi", "context": [1, 2]}, "context", 400),
    ({"model": "MODEL", "prompt": "hi", "suffix": "x"}, "suffix", 400),
    ({"model": "MODEL", "prompt": 5}, "prompt", 400),
])
def test_bad_input_is_an_ollama_4xx_naming_the_field(server, model_name, body, named, status):
    path = "/api/chat" if "messages" in body else "/api/generate"
    if body.get("model") == "MODEL":
        body = {**body, "model": model_name}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert named in r.json()["error"], r.text
    assert httpx.post(server.url + path, content=b"{not json", timeout=60).status_code == 400


def test_routes_kvserve_does_not_serve_are_ollama_404s_saying_what_is(oclient, model_name, server):
    for call in (lambda: oclient.pull(model_name), lambda: oclient.embed(model=model_name, input="hi"),
                 lambda: oclient.delete(model_name)):
        with pytest.raises(ollama.ResponseError) as missing:
            call()
        assert missing.value.status_code == 404
        assert "not served here" in missing.value.error and "/api/chat" in missing.value.error
    wrong_method = httpx.get(server.url + "/api/chat", timeout=60)
    assert wrong_method.status_code == 405 and isinstance(wrong_method.json()["error"], str)


def test_keys_and_tenants_apply_to_ollamas_routes(async_engine, model_name):
    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    with ServerThread(build_app(async_engine, api_keys=["sk-a", "sk-b"])) as keyed:
        assert httpx.post(keyed.url + "/api/chat", json={"model": model_name, "messages": QUESTION}).status_code == 401
        assert httpx.get(keyed.url + "/api/tags").status_code == 401
        prefix = [{"role": "system", "content": "You keep a lighthouse logbook of ships. " * 12}, *QUESTION]
        ask = dict(model=model_name, messages=prefix, options={"temperature": 0, "num_predict": 1})
        a = ollama.Client(host=keyed.url, headers={"Authorization": "Bearer sk-a"})
        b = ollama.Client(host=keyed.url, headers={"Authorization": "Bearer sk-b"})
        first = a.chat(**ask)
        assert first.prompt_eval_count > 100
        again = httpx.post(keyed.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-b"},
                           json={"model": model_name, "messages": prefix, "max_tokens": 1}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # sk-a's pages are not sk-b's
        assert b.chat(**ask).message.content == first.message.content
