"""llama-server's native /completion: llama.cpp's body and answer shapes, its grammar constraining the
output, n_predict (0: the prompt evaluated into the cache), cache_prompt and tokens_cached, streaming as llama.cpp streams, and its sampler
fields kvserve lacks refused with a 400 that names them (never silently ignored); `/props` as
llama-server's clients read it."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from kvserve.tools.bench.servers import llama_server_path

PROMPT = "The capital of France is"


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/completion", json=body, timeout=120)


def test_completion_answers_in_llamacpps_shape(server, client, model_name):
    r = post(server, {"prompt": PROMPT, "n_predict": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["tokens_predicted"] <= 6
    assert body["stop_type"] in ("eos", "limit") and body["tokens_evaluated"] > 0 and body["stopping_word"] == ""
    same = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert body["content"] == same.choices[0].text  # the same greedy answer as /v1/completions
    again = post(server, {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "cache_prompt": False})
    assert again.json()["tokens_cached"] == 0 and again.json()["content"] == body["content"]


def test_n_predict_0_evaluates_the_prompt_into_the_cache_and_predicts_nothing(server, client, model_name):
    """llama.cpp's cache warming: the answer is empty, and the next request on the prompt finds it cached;
    on chat, n_predict 0 is a 400 naming n_predict."""
    prompt = f"{uuid.uuid4().hex}: a prefix that a client warms before its users arrive. " * 6
    warm = post(server, {"prompt": prompt, "n_predict": 0, "temperature": 0})
    assert warm.status_code == 200, warm.text
    body = warm.json()
    assert (body["content"], body["tokens_predicted"], body["stop_type"]) == ("", 0, "limit")
    assert body["tokens_evaluated"] > 40 and body["tokens_cached"] == 0
    again = post(server, {"prompt": prompt, "n_predict": 2, "temperature": 0})
    assert again.json()["tokens_cached"] >= body["tokens_evaluated"] - 16  # all but the partial last page
    streamed = httpx.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 0, "stream": True},
                          timeout=120)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 0
    assert "".join(e.get("content", "") for e in events) == ""
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model_name, "messages": [{"role": "user", "content": "Hi"}], "n_predict": 0})
    assert chat.status_code == 400 and "n_predict" in chat.json()["error"]["message"]


def test_a_stop_word_is_named_as_llama_server_names_it(server):
    free = post(server, {"prompt": "1, 2, 3, 4, 5,", "n_predict": 12, "temperature": 0}).json()
    word = free["content"][3:6]
    body = {"prompt": "1, 2, 3, 4, 5,", "n_predict": 12, "temperature": 0, "stop": ["never seen", word]}
    cut = post(server, body).json()
    assert (cut["stop_type"], cut["stopping_word"]) == ("word", word)
    assert free["content"].startswith(cut["content"]) and word not in cut["content"]
    with httpx.stream("POST", server.url + "/completion", timeout=120, json={**body, "stream": True}) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert (last["stop_type"], last["stopping_word"]) == ("word", word)
    # a stop list that did not end the answer: EOS or the limit, no word
    other = post(server, {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "stop": ["never seen"]}).json()
    assert (other["stop_type"], other["stopping_word"]) in (("limit", ""), ("eos", ""))


def test_grammar_constrains_the_output(server):
    for seed in range(4):
        r = post(server, {"prompt": "Is water wet? Answer:", "grammar": 'root ::= ("yes" | "no") "."',
                          "seed": seed, "temperature": 1.0, "n_predict": 8})
        assert r.json()["content"] in ("yes.", "no."), r.text


def test_streaming_sends_content_pieces_then_the_final_object(server):
    whole = post(server, {"prompt": PROMPT, "n_predict": 6, "temperature": 0}).json()
    with httpx.stream("POST", server.url + "/completion", timeout=120,
                      json={"prompt": PROMPT, "n_predict": 6, "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_logit_bias_pairs_ban_a_token(server):
    first = post(server, {"prompt": PROMPT, "n_predict": 1, "temperature": 0}).json()["content"]
    [token] = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}
                         ).json()["tokens"]
    banned = post(server, {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                           "logit_bias": [[token, False]]}).json()["content"]
    assert banned != first


@pytest.mark.parametrize("body, named", [
    ({"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ({"prompt": PROMPT, "repeat_penalty": 0}, "repeat_penalty"),
    ({"prompt": PROMPT, "repeat_last_n": -2}, "repeat_last_n"),
    ({"prompt": PROMPT, "typical_p": 0.5}, "typical_p"),
    ({"prompt": PROMPT, "mirostat": 2}, "mirostat"),
    ({"prompt": PROMPT, "n_probs": 3, "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": PROMPT, "n_probs": 3, "logprobs": 2}, "n_probs"),
    ({"prompt": PROMPT, "n_probs": "3"}, "n_probs"),
    ({"prompt": PROMPT, "n_predict": "ten"}, "n_predict"),
    ({"prompt": PROMPT, "grammar": "root ::= missing"}, "grammar"),
    ({"prompt": PROMPT, "logit_bias": [[1]]}, "logit_bias"),
    ({"prompt": PROMPT, "cache_prompt": 3}, "cache_prompt"),
    ({"n_predict": 3}, "prompt"),
])
def test_bad_or_unsupported_fields_are_a_400_naming_them(server, body, named):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"] or r.json()["error"]["param"] == named


def n_probs_answers(url: str, body: dict) -> tuple[dict, list]:
    """The whole answer to `body` and the completion_probabilities of its stream, chunk after chunk."""
    whole = httpx.post(url + "/completion", json=body, timeout=120).json()
    with httpx.stream("POST", url + "/completion", timeout=120, json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "completion_probabilities" not in events[-1]  # (llama-server's final streamed object has none)
    return whole, [p for e in events for p in e.get("completion_probabilities", [])]


def test_n_probs_gives_each_tokens_probabilities_as_llama_server_does(server, client, model_name):
    from kvserve.model.gguf_loader import bundled_model_path
    from kvserve.tools.bench.servers import llama_server

    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "n_probs": 3}
    ours, ours_streamed = n_probs_answers(server.url, body)
    probs = ours["completion_probabilities"]
    assert len(probs) == ours["tokens_predicted"] and ours_streamed == probs
    for entry in probs:
        assert [t["id"] for t in entry["top_logprobs"]][0] == entry["id"]  # greedy: the top one
        assert len(entry["top_logprobs"]) == 3 and entry["bytes"] == list(entry["token"].encode())
    # the same numbers as OpenAI's logprobs on /v1/completions
    same = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    assert [e["logprob"] for e in probs] == same.choices[0].logprobs.token_logprobs
    # llama-server's own answer: the same fields at every level, the same top tokens for " Paris"
    if not llama_server_path().is_file():
        return
    with llama_server(llama_server_path(), bundled_model_path(), 1, 512, 1) as peer:
        theirs, _ = n_probs_answers(peer.base_url, body)
    entry, peer_entry = probs[0], theirs["completion_probabilities"][0]
    assert set(entry) == set(peer_entry) and set(entry["top_logprobs"][0]) == set(peer_entry["top_logprobs"][0])
    assert [t["id"] for t in entry["top_logprobs"][:2]] == [t["id"] for t in peer_entry["top_logprobs"][:2]]
    assert abs(entry["logprob"] - peer_entry["logprob"]) < 0.1
    # none asked, none given; more than the server's logprobs limit is capped, as llama-server caps it
    assert "completion_probabilities" not in post(server, {"prompt": PROMPT, "n_predict": 1, "n_probs": -1}).json()
    many = post(server, {"prompt": PROMPT, "n_predict": 1, "n_probs": 10**6}).json()["completion_probabilities"]
    assert len(many[0]["top_logprobs"]) == 20


def test_completion_samples_in_llama_cpps_order_and_samplers_decides_it(server, client, model_name):
    """/completion runs llama.cpp's chain: top-k, top-p and min-p on the untempered distribution, the temperature
    last (a seeded answer equals the engine's with temperature_last, not vLLM's order); `samplers` (names or
    llama-server's letters, as its web UI sends them) picks the order on any route and turns off what it leaves
    out; an order kvserve does not run is a 400 naming the field."""
    from kvserve import SamplingParams
    from tests.conftest import make_llm
    from tests.server.conftest import SMALL_ENGINE

    llm = make_llm(**SMALL_ENGINE)  # (the server's mode)

    def engine(**params) -> str:
        params = SamplingParams(max_tokens=12, seed=11, temperature=1.6, **params)
        return llm.generate(PROMPT, params)[0].outputs[0].text
    filters = dict(top_k=40, top_p=0.95, min_p=0.05)
    llama_order, vllm_order = engine(temperature_last=True, **filters), engine(**filters)
    assert llama_order != vllm_order
    body = {"prompt": PROMPT, "n_predict": 12, "seed": 11, "temperature": 1.6}
    assert post(server, body).json()["content"] == llama_order
    in_vllms_order = post(server, {**body, "samplers": ["temperature", "min_p", "top_k", "top_p"]})
    assert in_vllms_order.json()["content"] == vllm_order
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, seed=11, temperature=1.6, top_p=0.95)
    letters = client.completions.create(**kwargs, extra_body={"samplers": "edkypmxt", "top_k": 40, "min_p": 0.05})
    assert letters.choices[0].text == llama_order
    assert client.completions.create(**kwargs).choices[0].text == engine(top_p=0.95)  # (OpenAI's route: vLLM's)
    # top-k and the temperature only: top_p and min_p are left out of the chain
    assert post(server, {**body, "samplers": "kt"}).json()["content"] == engine(top_k=40, temperature_last=True)
    refused = post(server, {**body, "samplers": ["temperature", "top_p", "min_p"]})
    assert refused.status_code == 400 and "samplers" in refused.json()["error"]["message"], refused.text


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    r = post(server, {"prompt": PROMPT, "n_predict": 2, "typical_p": 1.0, "dry_multiplier": 0.0, "mirostat": 0})
    assert r.status_code == 200, r.text


def test_props_tell_the_context_template_and_the_defaults_completion_samples_with(server):
    props = httpx.get(server.url + "/props", timeout=60).json()
    settings = props["default_generation_settings"]
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    assert settings["n_ctx"] == tokenized["max_model_len"] and props["total_slots"] >= 1
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"
    # the defaults are what /completion samples with: sent back explicitly, the same seeded answer
    implicit = post(server, {"prompt": PROMPT, "n_predict": 8, "seed": 5})
    explicit = post(server, {"prompt": PROMPT, "seed": 5, **settings["params"], "n_predict": 8})
    assert implicit.status_code == explicit.status_code == 200, explicit.text
    assert implicit.json()["content"] == explicit.json()["content"]
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["min_p"] == 0.05


@pytest.mark.skipif(not llama_server_path().is_file(), reason="llama-server binary absent "
                    "(../shared/peers/llama.cpp/llama-server or $KVSERVE_LLAMA_SERVER)")
def test_props_use_llama_servers_own_names(server):
    from kvserve.model.gguf_loader import bundled_model_path
    from kvserve.tools.bench.servers import llama_server

    ours = httpx.get(server.url + "/props", timeout=60).json()
    with llama_server(llama_server_path(), bundled_model_path(), 1, 512, 1) as peer:
        theirs = httpx.get(peer.base_url + "/props", timeout=60).json()
    assert set(ours) <= set(theirs)
    assert set(ours["default_generation_settings"]) <= set(theirs["default_generation_settings"])
    assert set(ours["default_generation_settings"]["params"]) <= set(theirs["default_generation_settings"]["params"])
    ours_params, their_params = ours["default_generation_settings"]["params"], theirs["default_generation_settings"]["params"]
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"):
        assert ours_params[name] == pytest.approx(their_params[name], rel=1e-6), name  # /completion's defaults
    assert ours_params["samplers"] == their_params["samplers"]  # (the chain, in llama.cpp's default order)
    assert theirs["eos_token"] == ours["eos_token"] and theirs["chat_template"] == ours["chat_template"]
