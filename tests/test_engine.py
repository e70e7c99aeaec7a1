"""The engine's greedy tokens equal transformers' on the same GGUF weights, one request at a time and
all together in one continuous batch with chunked prefill, at several page sizes; bad input gets a
clear error and the engine keeps serving."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import ConfigError
from tests.conftest import ALONE_IN_THE_RUNNER_TEST, make_llm, varied_prompts

# 44: the fed-back tokens still cross a page of 128 for the prompts of 86, 242 and 737 tokens (the
# last written position is prompt + 42: 128, 284, 779); 32 would keep only 242's crossing
NEW_TOKENS = 44
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    from kvserve.model.gguf_loader import bundled_model_path, load_gguf

    return varied_prompts(load_gguf(bundled_model_path()).tokenizer)


def _generate(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


# pages of 16: tests/model/test_runner.py batches 4 of these prompts with chunked prefill on them,
# and the engine runs them on them one at a time below
@pytest.mark.parametrize("page_size", [1, 128])
def test_continuous_batch_with_chunked_prefill_equals_transformers(page_size, prompts, hf_reference):
    llm = make_llm(page_size=page_size, max_num_batched_tokens=256, prefix_cache="off")
    got = _generate(llm, prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_reference(prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("page_size", [16])  # the batched test above covers 1 and 128
def test_one_request_at_a_time_equals_transformers(page_size, prompts, hf_reference):
    """Every prompt runs alone once: these here, the others in tests/model/test_runner.py (the
    runner driven alone), all of them batched above."""
    llm = make_llm(page_size=page_size, prefix_cache="off")
    alone = [p for i, p in enumerate(prompts) if i not in ALONE_IN_THE_RUNNER_TEST]
    assert len(alone) == len(prompts) - len(ALONE_IN_THE_RUNNER_TEST)
    for prompt in alone:
        assert _generate(llm, [prompt])[0] == hf_reference(prompt, NEW_TOKENS)


def test_text_prompt_and_finish_reasons():
    llm = make_llm()
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=5))[0]
    assert out.outputs[0].finish_reason in ("length", "stop")
    assert len(out.outputs[0].token_ids) <= 5
    assert out.outputs[0].text == llm.engine.decode(out.outputs[0].token_ids)
    assert out.metrics.ttft_s is not None and out.metrics.ttft_s >= 0


def test_stop_string_cuts_the_text():
    llm = make_llm()
    free = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text.strip()[:2] if text.strip() else "5"
    cut = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=24, stop=["never here", stop]))[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop  # which stop string ended it (vLLM's stop_reason)
    assert stop not in cut.outputs[0].text
    assert text.startswith(cut.outputs[0].text)


def test_stop_reason_names_the_stop_token_id_and_is_none_otherwise():
    llm = make_llm()
    free = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[3]
    by_id = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert by_id.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert free.stop_reason is None  # length
    # the earliest stop string in the text wins, whatever the list order
    text = free.text
    first, later = text[2:4], text[6:9]
    assert first and later and text.find(first) == 2 and text.find(later) > 2
    both = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=12, ignore_eos=True,
                                                             stop=[later, first]))[0].outputs[0]
    assert (both.stop_reason, both.text) == (first, text[:2])


def test_min_tokens_masks_the_endings_until_then_and_stop_strings_may_be_kept():
    """vLLM's min_tokens: the ids that would end the output (EOS, stop_token_ids) cannot be chosen before it,
    so the first tokens are greedy with those ids banned, and no stop string ending in them counts;
    include_stop_str_in_output keeps the stop string at the text's end."""
    llm = make_llm()
    messages = [{"role": "user", "content": "Say hi."}]
    free = llm.chat(messages, SamplingParams(max_tokens=40))[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 30  # it ends by itself (EOS) early
    n = len(free.token_ids) + 6
    endings = [t for t in {llm.engine.loaded.eos_token_id, *llm.engine.loaded.eos_token_ids} if t is not None]
    banned = llm.chat(messages, SamplingParams(max_tokens=n, ignore_eos=True,
                                               logit_bias=dict.fromkeys(endings, -100.0)))[0].outputs[0]
    held = llm.chat(messages, SamplingParams(max_tokens=n + 20, min_tokens=n))[0].outputs[0]
    assert held.token_ids[:n] == banned.token_ids and not set(held.token_ids[:n]) & set(endings)
    stop_id = free.token_ids[0]  # a stop token id the output would stop at first: ignored until min_tokens
    late = llm.chat(messages, SamplingParams(max_tokens=n + 20, min_tokens=n, stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in late.token_ids[:n] and len(late.token_ids) >= n
    text = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
    word = text.text[2:4]
    kept = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=16, ignore_eos=True, stop=[word],
                                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text.text[:4] and kept.stop_reason == word
    past = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=16, ignore_eos=True, stop=[word],
                                                              min_tokens=len(text.token_ids)))[0].outputs[0]
    assert past.text == text.text  # the stop string's only occurrences end within the first min_tokens
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_skip_special_tokens_false_keeps_them_in_the_text_but_not_the_ending_eos():
    """vLLM's skip_special_tokens: False shows the special tokens the output holds, except the EOS that ended
    it (shown only with include_stop_str_in_output)."""
    llm = make_llm()
    tokenizer = llm.engine.tokenizer
    start, end = (tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert end in {llm.engine.loaded.eos_token_id, *llm.engine.loaded.eos_token_ids}

    def text(**params) -> tuple[str, str]:
        out = llm.generate("Hi", SamplingParams(max_tokens=3, **params))[0].outputs[0]
        return out.text, out.finish_reason
    forced = {"logit_bias": {start: 100.0}, "ignore_eos": True}
    assert text(**forced) == ("", "length")
    assert text(**forced, skip_special_tokens=False) == ("<|im_start|>" * 3, "length")
    ended = {"logit_bias": {end: 100.0}}
    assert text(**ended) == text(**ended, skip_special_tokens=False) == ("", "stop")
    assert text(**ended, skip_special_tokens=False, include_stop_str_in_output=True) == ("<|im_end|>", "stop")


def test_a_running_text_is_decoded_token_by_token_and_leads_the_final_text():
    """Each step decodes a running sample's new tokens onto its text (no whole-output decode per step): at
    every step the text leads the final one, which is the whole output decoded; a character split across
    tokens shows once complete, and nothing is kept once the request ends."""
    llm = make_llm()
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    split = tokenizer.encode("🙂", add_special_tokens=False).ids  # one character, two tokens
    assert len(split) == 2
    params = SamplingParams(max_tokens=24, ignore_eos=True, n=2, temperature=1.0, seed=4,
                            logit_bias=dict.fromkeys(split, 30.0))
    request_id = engine.add_request("Smile:", params)
    seen: list[list[str]] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                seen.append([c.text for c in out.outputs])
                final = out.outputs
    assert all(c.text == tokenizer.decode(c.token_ids) for c in final)
    assert all(final[i].text.startswith(texts[i]) for texts in seen for i in range(2))
    assert any("🙂" in texts[0] for texts in seen[:-1]) and "\ufffd" not in "".join(sum(seen[:-1], []))
    assert not engine.outputs._running


def test_chat_applies_the_template():
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8))[0]
    tokenizer = llm.get_tokenizer()
    assert "<|im_start|>assistant" in tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def test_pages_return_to_the_pool_after_abort():
    llm = make_llm(max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": list(range(100, 300))}, GREEDY) for _ in range(3)]
    engine.step()
    engine.step()
    assert engine.manager.num_used_pages > 0
    for rid in ids:
        out = engine.abort(rid)
        assert out is not None and out.outputs[0].finish_reason == "abort"
    assert engine.manager.num_used_pages == 0
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [1, 2, 10**9]}, SamplingParams(), "token ids"),
    ("x " * 600, SamplingParams(max_tokens=8), "max_model_len"),
])
def test_bad_request_is_rejected_and_the_engine_keeps_serving(prompt, params, message):
    llm = make_llm(max_model_len=512, kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt, "Hello"], params)
    assert not llm.engine.has_unfinished()
    out = llm.generate("Hello, my name is", SamplingParams(max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_config_error():
    with pytest.raises(ConfigError, match="model not found"):
        make_llm(model="/nonexistent/model.gguf")


def test_context_that_cannot_fit_stops_start_up_with_both_numbers():
    with pytest.raises(ConfigError) as err:
        make_llm(kv_cache_memory="8MiB", max_model_len=8192)
    message = str(err.value)
    assert "8,192" in message and "--kv-cache-memory" in message and "--max-model-len" in message
    assert "\n" not in message
