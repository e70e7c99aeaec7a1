"""The sampling fields clients send by default, through the real openai client: logit_bias, the
penalties, the repetition penalty and min_p change the output as the engine's reference-checked sampler does (the reference is in
tests/test_logit_adjust_engine.py), echo returns the prompt (alone with max_tokens 0), suffix is a clear 400 on a model without
FIM tokens, and llama.cpp's grammar / json_schema / n_predict / cache_prompt are honoured."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve import SamplingParams
from tests.conftest import make_llm
from tests.server.conftest import SMALL_ENGINE

PROMPT = "List the days of the week: Monday, Tuesday, Monday, Tuesday, Monday,"


def test_logit_bias_bans_the_top_token_and_the_runner_up_follows(client, model_name):
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=2)
    first, runner_up = list(plain.choices[0].logprobs.top_logprobs[0])
    [top_id] = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                          json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(top_id): -100})
    assert plain.choices[0].text == first
    assert banned.choices[0].text == runner_up


def test_penalties_over_http_equal_the_engines(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    penalized = client.completions.create(frequency_penalty=1.2, presence_penalty=0.6, **kwargs)
    llm = make_llm(**{k: v for k, v in SMALL_ENGINE.items() if k != "dtype"})
    want = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.2,
                                               presence_penalty=0.6))[0].outputs[0].text
    assert penalized.choices[0].text == want != plain


def test_repetition_penalty_and_min_p_by_each_clients_names_equal_the_engines(server, client, model_name):
    """vLLM's `repetition_penalty` (the whole context) and `min_p` through the openai client, llama.cpp's
    `repeat_penalty` on /completion and Ollama's option of that name (the last 64 tokens, as both default),
    each the engine's greedy answer for the same SamplingParams, and not the plain one."""
    import ollama

    llm = make_llm(**SMALL_ENGINE)  # (the server's mode)
    prompt = PROMPT + " Tuesday, Monday, Tuesday, Monday,"

    def engine(**params) -> str:
        return llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **params))[0].outputs[0].text
    plain = engine()
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "repetition_penalty": 1.5, "min_p": 0.2})
    assert whole.choices[0].text == engine(repetition_penalty=1.5) != plain
    window = engine(repetition_penalty=1.5, repetition_last_n=64)
    llamacpp = httpx.post(server.url + "/completion", timeout=120, json={
        "prompt": prompt, "n_predict": 10, "temperature": 0, "ignore_eos": True, "repeat_penalty": 1.5})
    assert llamacpp.json()["content"] == window != plain
    answer = ollama.Client(host=server.url).generate(model=model_name, prompt=prompt, raw=True, options={
        "temperature": 0, "num_predict": 10, "repeat_penalty": 1.5})
    assert answer.response in (window, window[:len(answer.response)]) and answer.response  # (Ollama stops at EOS)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                                  extra_body={"repetition_penalty": 1.5, "repeat_penalty": 1.2})
    assert "disagree" in err.value.body["message"]


def test_vllms_stop_fields_min_tokens_stop_token_ids_and_include_stop_str(client, model_name):
    """vLLM's min_tokens, stop_token_ids, include_stop_str_in_output and skip_special_tokens through the
    openai client, each as the engine applies them (tests/test_engine.py holds the engine to its references)."""
    messages = [{"role": "user", "content": "Say hi."}]
    free = client.chat.completions.create(model=model_name, messages=messages, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop"
    n = free.usage.completion_tokens + 5
    held = client.chat.completions.create(model=model_name, messages=messages, max_tokens=n + 10, temperature=0,
                                          extra_body={"min_tokens": n})
    assert held.usage.completion_tokens >= n
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    word = plain[1:4]
    kept = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == plain[:4] and kept.choices[0].model_extra["stop_reason"] == word
    ids = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    [stop_id] = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                           json={"prompt": ids[2], "add_special_tokens": False}).json()["tokens"][:1] or [None]
    by_id = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}).choices[0]
    assert (by_id.finish_reason, by_id.model_extra["stop_reason"]) == ("stop", stop_id)
    assert plain.startswith(by_id.text) and len(by_id.text) < len(plain)
    [start] = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                         json={"prompt": "<|im_start|>", "add_special_tokens": False}).json()["tokens"]
    shown = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, logit_bias={str(start): 100},
                                      extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert shown.choices[0].text == "<|im_start|>" * 2
    for extra, param in (({"min_tokens": 9}, None), ({"stop_token_ids": [10**9]}, "stop_token_ids")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, extra_body=extra)
        assert err.value.body["param"] == param and next(iter(extra)) in err.value.body["message"]


def test_vllms_bad_words_and_allowed_token_ids_equal_the_engines(client, model_name):
    """vLLM's bad_words and allowed_token_ids through the openai client (chat and completions), each the
    engine's greedy answer for the same SamplingParams (tests/test_logit_adjust_engine.py holds the engine to
    transformers' processors) and not the plain one; what the engine refuses is a 400 naming the field."""
    llm = make_llm(**SMALL_ENGINE)  # (the server's mode)
    kwargs = dict(model=model_name, max_tokens=8, temperature=0)
    plain = client.completions.create(prompt=PROMPT, logprobs=0, extra_body={"ignore_eos": True}, **kwargs)
    first_word = plain.choices[0].logprobs.tokens[0]
    banned = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True, "bad_words": [first_word]},
                                       **kwargs).choices[0].text
    want = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, bad_words=[first_word]))[0]
    assert banned == want.outputs[0].text != plain.choices[0].text
    assert not banned.startswith(first_word)
    allowed = sorted({t for t in llm.get_tokenizer().encode(" Friday, Saturday, Sunday.").ids})
    messages = [{"role": "user", "content": "Name a day of the week."}]
    chat = client.chat.completions.create(messages=messages, extra_body={"allowed_token_ids": allowed}, **kwargs)
    rendered = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), timeout=60,
                          json={"model": model_name, "messages": messages}).json()["tokens"]
    want = llm.generate({"prompt_token_ids": rendered}, SamplingParams(max_tokens=8, allowed_token_ids=allowed))[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    assert want.outputs[0].token_ids and set(want.outputs[0].token_ids) <= set(allowed)
    for extra, param in (({"allowed_token_ids": []}, None), ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                         ({"bad_words": ["  "]}, None),
                         ({"bad_words": ["Monday"], "response_format": {"type": "json_object"}}, None)):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(prompt=PROMPT, extra_body=extra, **kwargs)
        assert err.value.body["param"] == param and next(iter(extra)) in err.value.body["message"], err.value.body


def test_echo_returns_the_prompt_before_the_output(client, model_name):
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server, client, model_name):
    """OpenAI's legacy echo without generation (vLLM's too): the prompt's text and its tokens' scores, no
    completion token; streamed, the same text. Without echo, max_tokens 0 is a 400 that says why."""
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    alone = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
    one = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0)
    choice = alone.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (len(tokens), 0)
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:len(tokens)]
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:len(tokens)]
    assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    two = client.completions.create(model=model_name, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in two.choices] == [PROMPT, PROMPT, "Hello", "Hello"]
    streamed = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)
    assert "echo" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=0)


def test_suffix_needs_a_fim_model(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="def f(", suffix="    return x",
                                  max_tokens=4)
    assert err.value.body["param"] == "suffix" and "fill-in-the-middle" in err.value.body["message"]


def test_llamacpp_grammar_and_json_schema_constrain(client, model_name):
    grammar = 'root ::= "yes" | "no"'
    for seed in range(3):
        out = client.completions.create(model=model_name, prompt="Is the sky blue? Answer:", seed=seed,
                                        temperature=1.0, max_tokens=8, extra_body={"grammar": grammar})
        assert out.choices[0].text in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=model_name, temperature=1.0, seed=1, max_tokens=40,
                                         messages=[{"role": "user", "content": "Pick a number."}],
                                         extra_body={"json_schema": schema})
    assert isinstance(json.loads(out.choices[0].message.content)["n"], int)


def test_n_predict_limits_and_cache_prompt_false_reuses_nothing(client, model_name):
    prompt = "A long shared prefix for the cache test. " * 8
    out = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                    extra_body={"n_predict": 3, "ignore_eos": True})
    assert out.usage.completion_tokens == 3
    again = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                      extra_body={"n_predict": 3, "ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    fresh = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                      extra_body={"n_predict": 3, "ignore_eos": True,
                                                  "cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].text == again.choices[0].text == out.choices[0].text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client, model_name):
    """vLLM's truncate_prompt_tokens: the answer is the one for the prompt's last k tokens (completions and
    chat, echo shows what is left); 0 is a 400 naming it."""
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    kwargs = dict(model=model_name, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 7}, **kwargs)
    tail = client.completions.create(prompt=tokens[-7:], echo=True, **kwargs)
    whole = client.completions.create(prompt=PROMPT, **kwargs)
    assert cut.choices[0].text == tail.choices[0].text and cut.usage.prompt_tokens == 7
    assert not cut.choices[0].text.startswith(PROMPT) and whole.usage.prompt_tokens == len(tokens)
    messages = [{"role": "user", "content": PROMPT}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    chat = client.chat.completions.create(messages=messages, extra_body={"truncate_prompt_tokens": 9}, **kwargs)
    by_ids = client.completions.create(prompt=rendered[-9:], **kwargs)
    assert chat.choices[0].message.content == by_ids.choices[0].text and chat.usage.prompt_tokens == 9
    everything = client.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1}, **kwargs)
    assert everything.choices[0].text == whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0}, **kwargs)
    assert err.value.body["param"] == "truncate_prompt_tokens"
