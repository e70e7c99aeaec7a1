"""The real `openai` client against a kvserve server on a free loopback port: completions, chat and
streaming for both; `usage` with cached tokens; a shared prefix hits the cache without changing the
greedy text; n, seed, stop and logprobs; API keys as tenants."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.conftest import ServerThread, wait_no_pages_in_use

GREEDY = dict(temperature=0.0)


def long_prefix() -> str:
    """A ~600-token system prompt, the same in every run."""
    rules = ["Refrigerated containers are checked every fifteen minutes.",
             "Every deviation from the delivery window is recorded in the tracking system.",
             "Visitors sign in at the gate and wear a high-visibility vest on the docks.",
             "Customs paperwork is filed before the vessel leaves the berth.",
             "Overtime is approved in advance by the shift supervisor."]
    lines = [f"Rule {i + 1}: {rules[i % len(rules)]} (see section {i // 5 + 1})." for i in range(40)]
    return "Harbour operations handbook.\n" + "\n".join(lines) + "\n\n"


def salt() -> str:
    """A fresh cache namespace: the first request of a test is cold whatever ran before."""
    return uuid.uuid4().hex


def test_completion_reports_text_and_usage(client, model_name):
    out = client.completions.create(model=model_name, prompt="The capital of France is",
                                    max_tokens=8, **GREEDY)
    assert out.object == "text_completion" and out.model == model_name
    assert out.choices[0].text.strip() and out.choices[0].finish_reason in ("stop", "length")
    usage = out.usage
    assert usage.prompt_tokens == 5 and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_uses_the_models_template(client, model_name):
    out = client.chat.completions.create(
        model=model_name, max_tokens=12, **GREEDY,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say hello."}])
    message = out.choices[0].message
    assert message.role == "assistant" and message.content.strip()
    assert out.usage.prompt_tokens > 10  # the template's markup is counted
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("include_usage", [True, False])
def test_streamed_completion_equals_the_whole_one(client, model_name, include_usage):
    kwargs = dict(model=model_name, prompt="Write a list of three colours:", max_tokens=16,
                  extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True} if include_usage else None))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage  # the last chunk always carries usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before
    assert all(c.usage is None for c in chunks[:-1])
    if include_usage:
        assert chunks[-1].choices == []


def test_streamed_chat_equals_the_whole_one(client, model_name):
    kwargs = dict(model=model_name, max_tokens=24, **GREEDY,
                  messages=[{"role": "user", "content": "Name two planets."}])
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_shared_long_prefix_hits_the_cache_with_equal_greedy_text(client, model_name):
    prefix, tenant = long_prefix(), salt()
    kwargs = dict(model=model_name, max_tokens=24, extra_body={"cache_salt": tenant}, **GREEDY)
    cold = client.completions.create(prompt=prefix + "Q: When are containers checked?\nA:", **kwargs)
    warm = client.completions.create(prompt=prefix + "Q: When are containers checked?\nA:", **kwargs)
    other = client.completions.create(prompt=prefix + "Q: Who approves overtime?\nA:", **kwargs)
    assert cold.usage.prompt_tokens > 550
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 16
    assert warm.choices[0].text == cold.choices[0].text
    assert other.usage.prompt_tokens_details.cached_tokens >= 550  # the shared prefix
    streamed = list(client.completions.create(
        prompt=prefix + "Q: When are containers checked?\nA:", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cold.choices[0].text
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 550


def test_cache_salt_isolates_tenants(client, model_name):
    prompt = long_prefix() + "Q: What is filed before departure?\nA:"
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                      extra_body={"cache_salt": salt()}, **GREEDY)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                       extra_body={"cache_salt": salt()}, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices_are_seeded_samples(client, model_name):
    kwargs = dict(model=model_name, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                  extra_body={"ignore_eos": True})
    both = client.completions.create(n=2, seed=1234, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    again = client.completions.create(n=2, seed=1234, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in both.choices]
    alone = client.completions.create(seed=1235, **kwargs)  # choice i uses seed + i
    assert alone.choices[0].text == both.choices[1].text
    assert both.usage.completion_tokens == 2 * 8  # both choices count (ignore_eos: 8 each)
    assert both.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once


def test_batched_prompts_get_one_choice_each(client, model_name):
    out = client.completions.create(model=model_name, prompt=["One, two,", "Red, green,"],
                                    max_tokens=4, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(model=model_name, prompt="Red, green,", max_tokens=4, **GREEDY)
    assert out.choices[1].text == single.choices[0].text


def test_token_id_prompt_equals_text_prompt(client, model_name, async_engine):
    ids = async_engine.engine.tokenizer.encode("The sea is", add_special_tokens=False).ids
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model=model_name, prompt="The sea is", max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_is_cut_the_same_way_when_streamed(client, model_name):
    kwargs = dict(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=24, stop=[" 8"], **GREEDY)
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop" and " 8" not in whole.choices[0].text
    assert whole.choices[0].stop_reason == " 8"  # vLLM's field: which stop string ended it
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    finishing = [c.choices[0] for c in streamed if c.choices and c.choices[0].finish_reason]
    assert [(c.finish_reason, c.stop_reason) for c in finishing] == [("stop", " 8")]
    chat = client.chat.completions.create(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                          **GREEDY)
    assert chat.choices[0].stop_reason is None  # EOS or the length: no stop string


def test_logprobs_in_both_formats(client, model_name):
    out = client.completions.create(model=model_name, prompt="The sky is", max_tokens=4, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(len(top) <= 3 and value <= 0 for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=model_name, max_tokens=4, logprobs=True,
                                          top_logprobs=2, **GREEDY,
                                          messages=[{"role": "user", "content": "Hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)


def test_models_and_health(client, server, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_requests_get_openai_errors(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="word " * 2100, max_tokens=4)
    assert "max_model_len" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="hi", n=17, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=[], max_tokens=1)
    assert err.value.body["param"] == "messages"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[]", None),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', None),  # (the prompt alone needs echo: prompt_only.py)
    (b'{"prompt": "hi", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (b'{"prompt": "hi", "logprobs": 50}', "logprobs"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream"),
    (b'{"prompt": "", "max_tokens": 1}', "prompt"),
    (b'{"prompt": [99999999], "max_tokens": 1}', "prompt"),
    (b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    (b'{"prompt": "hi", "cache_salt": ""}', None),
    (b'{"prompt": "hi", "logit_bias": {"abc": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias.5"),
    (b'{"prompt": "hi", "logit_bias": {"999999": -100}, "max_tokens": 1}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": [1, 2]}', "logit_bias"),
    (b'{"prompt": "hi", "frequency_penalty": 3}', "frequency_penalty"),
    (b'{"prompt": "hi", "presence_penalty": "high"}', "presence_penalty"),
    (b'{"prompt": "hi", "echo": true, "logprobs": 1, "stream": true}', None),
    (b'{"prompt": "hi", "prompt_logprobs": 1, "stream": true}', None),
    (b'{"prompt": "hi", "prompt_logprobs": 21}', "prompt_logprobs"),
    (b'{"prompt": "hi", "suffix": "x"}', "suffix"),
    (b'{"prompt": "hi", "n_predict": -2}', "n_predict"),
    (b'{"prompt": "hi", "n_predict": 3, "max_tokens": 4}', None),
    (b'{"prompt": "hi", "grammar": "root ::= undefined_rule"}', "grammar"),
    (b'{"prompt": "hi", "json_schema": "x"}', "json_schema"),
    (b'{"prompt": "hi", "json_schema": {"type": "object"}, "grammar": "root ::= \\"a\\""}', "json_schema"),
    (b'{"prompt": "hi", "cache_prompt": "no"}', "cache_prompt"),
])
def test_invalid_completion_bodies_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


def test_echo_with_logprobs_and_prompt_logprobs_score_the_prompt(server, client, model_name):
    """What lm-evaluation-harness scores a continuation with: echo + logprobs give the prompt's tokens first
    (the first without a logprob), and vLLM's prompt_logprobs the same numbers with ranks."""
    PROMPT = "The capital of France is Paris, and the capital of Italy is"
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                      logprobs=2)
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2)
    choice, generated = whole.choices[0], plain.choices[0].logprobs
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    n = len(tokens)
    assert choice.text == PROMPT + plain.choices[0].text and "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.tokens[n:] == generated.tokens and choice.logprobs.token_logprobs[n:] == \
        generated.token_logprobs and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.text_offset == [len("".join(choice.logprobs.tokens[:i])) for i in range(n + 2)]
    scored = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == n
    for i in range(1, n):
        own = scored[i][str(tokens[i])]
        assert own["logprob"] == choice.logprobs.token_logprobs[i] and own["rank"] >= 1
        assert own["decoded_token"] == choice.logprobs.tokens[i]
        assert sorted(e["rank"] for e in scored[i].values())[0] == 1


def test_chat_prompt_logprobs_score_the_rendered_template(server, client, model_name):
    """vLLM's prompt_logprobs on chat: at the answer's top level, the template's tokens scored as
    /v1/completions scores the same token ids; streamed, a 400."""
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    scored = chat.model_extra["prompt_logprobs"]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    assert len(scored) == len(ids) == chat.usage.prompt_tokens and scored[0] is None
    same = client.completions.create(model=model_name, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert scored == same
    assert all(str(ids[i]) in scored[i] and min(e["rank"] for e in scored[i].values()) == 1
               for i in range(1, len(ids)))
    plain = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert "prompt_logprobs" not in (plain.model_extra or {})
    streamed = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": messages, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]
    too_many = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": messages, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


@pytest.fixture(scope="module")
def keyed_servers(async_engine):
    """Two more apps on the same engine: keys as tenants, and keys sharing one namespace."""
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, api_keys=["key-a", "key-b"])) as tenants, \
            ServerThread(build_app(async_engine, api_keys=["key-a", "key-b"],
                                   shared_cache_namespace=True)) as shared:
        yield tenants, shared


def test_api_key_is_required(keyed_servers, model_name):
    tenants, _ = keyed_servers
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"}):
        r = httpx.post(tenants.url + "/v1/completions", headers=headers,
                       json={"model": model_name, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tenants.url + "/v1/models").status_code == 401
    assert httpx.get(tenants.url + "/metrics").status_code == 200  # operators scrape without a key
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=tenants.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_each_api_key_is_its_own_cache_namespace(keyed_servers, model_name, async_engine):
    tenants, shared = keyed_servers
    prompt = f"Tenant check {uuid.uuid4().hex}.\n" + long_prefix()

    def cached(server, key):
        client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, **GREEDY)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(tenants, "key-a") == 0  # the engine has seen this prompt in no namespace yet
    assert cached(tenants, "key-a") > 550  # the same tenant hits its own pages
    assert cached(tenants, "key-b") == 0  # another tenant does not see key-a's pages
    assert cached(tenants, "key-b") > 550
    cached(shared, "key-a")
    assert cached(shared, "key-b") > 550  # --shared-cache-namespace: one cache for all keys
    wait_no_pages_in_use(async_engine)


def test_streamed_choices_of_n_equal_the_whole_ones(client, model_name):
    kwargs = dict(model=model_name, max_tokens=6, temperature=1.0, seed=99, n=2,
                  messages=[{"role": "user", "content": "Name a colour."}],
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        text = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == choice.index)
        assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices[0].finish_reason
