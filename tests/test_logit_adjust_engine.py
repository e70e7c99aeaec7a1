"""Penalties and logit_bias through the engine: the greedy output equals a reference the test builds
token by token from the same model's unadjusted logprobs (vLLM's formula applied here, in the test),
and differs from the plain greedy output, so a field the sampler ignored would fail. The repetition
penalty, which reads raw logits, is held to transformers' greedy loop with its own processor."""

from __future__ import annotations

from collections import Counter

from kvserve import SamplingParams
from tests.conftest import make_llm

PROMPT = "List the days of the week: Monday, Tuesday, Monday, Tuesday, Monday,"
NUM_TOKENS = 10
TOP = 20  # alternatives read per step: more than the tokens a penalty can push down in NUM_TOKENS


def reference_greedy(llm, prompt_ids: list[int], adjust) -> list[int]:
    """Greedy decoding by hand: each step reads the top-20 logprobs of the plain model at the prompt
    plus what the reference chose so far, applies `adjust(token, chosen)` and takes the argmax."""
    chosen: list[int] = []
    for _ in range(NUM_TOKENS):
        out = llm.generate({"prompt_token_ids": prompt_ids + chosen},
                           SamplingParams(max_tokens=1, logprobs=TOP, ignore_eos=True))[0]
        top = out.outputs[0].logprobs[0]
        chosen.append(max(top, key=lambda t: top[t] + adjust(t, chosen)))
    return chosen


def test_penalties_and_logit_bias_match_a_reference_from_the_same_logits():
    llm = make_llm()
    prompt_ids = llm.get_tokenizer().encode(PROMPT).ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    plain_ids = plain.outputs[0].token_ids

    penalized = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, frequency_penalty=1.2,
                               presence_penalty=0.6)
    got = llm.generate(PROMPT, penalized)[0].outputs[0].token_ids

    def penalty(token: int, chosen: list[int]) -> float:
        count = Counter(chosen)[token]
        return -(1.2 * count + 0.6 * (count > 0))
    assert got == reference_greedy(llm, prompt_ids, penalty)
    assert got != plain_ids

    banned = {plain_ids[0]: -100.0, plain_ids[1]: -100.0}
    biased = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True,
                                                 logit_bias=banned))[0].outputs[0].token_ids
    assert biased == reference_greedy(llm, prompt_ids, lambda t, _: banned.get(t, 0.0))
    assert not set(biased) & set(banned)


def test_repetition_penalty_greedy_equals_transformers(hf_model):
    """float32 greedy with vLLM's repetition penalty (the whole context) and llama.cpp's (the last N tokens)
    equals transformers' model stepped by hand with RepetitionPenaltyLogitsProcessor over the same ids."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    llm = make_llm()
    prompt_ids = llm.get_tokenizer().encode(PROMPT).ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))[0].outputs[0].token_ids
    for penalty, last_n in ((1.6, None), (1.6, 6)):
        ids = list(prompt_ids)
        with torch.inference_mode():
            for _ in range(NUM_TOKENS):
                logits = hf_model(input_ids=torch.tensor([ids])).logits[:, -1]
                window = ids if last_n is None else ids[-last_n:]
                logits = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([window]), logits)
                ids.append(int(logits.argmax()))
        params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, repetition_penalty=penalty,
                                repetition_last_n=last_n)
        got = llm.generate(PROMPT, params)[0].outputs[0].token_ids
        assert got == ids[len(prompt_ids):] != plain, (penalty, last_n)


def _hf_greedy(hf_model, prompt_ids: list[int], processor) -> list[int]:
    """transformers' model stepped by hand: each step's logits through `processor(ids, logits)`, then argmax."""
    import torch

    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            logits = processor(torch.tensor([ids]), hf_model(input_ids=torch.tensor([ids])).logits[:, -1])
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def test_bad_words_greedy_equals_transformers(hf_model, hf_tokenizer):
    """vLLM's bad_words: the plain answer's first word, and its first word with the comma after it (two tokens:
    the comma is banned after the word only), each tokenized by transformers' tokenizer as vLLM does (as written,
    and after a space where that is another token of the same length), held to transformers'
    NoBadWordsLogitsProcessor over those ids."""
    from transformers import NoBadWordsLogitsProcessor

    llm = make_llm()
    prompt_ids = llm.get_tokenizer().encode(PROMPT).ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))[0].outputs[0].token_ids
    for words in ([hf_tokenizer.decode(plain[:1])], [hf_tokenizer.decode(plain[:2])]):
        sequences = []
        for word in words:
            written = hf_tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = hf_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences += [written] + ([spaced] if spaced[0] != written[0] and len(spaced) == len(written) else [])
        # (transformers also matches the prompt's tail, vLLM the output's only: no word may start there)
        assert all(s[:-1] != prompt_ids[-len(s) + 1:] for s in sequences if len(s) > 1)
        reference = _hf_greedy(hf_model, prompt_ids, NoBadWordsLogitsProcessor(sequences, eos_token_id=None))

        got = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, bad_words=words))[0]
        assert got.outputs[0].token_ids == reference != plain, (words, sequences)
    assert len(sequences[0]) == 2 and reference[0] == plain[0]  # the two-token word: its first token stays


def test_allowed_token_ids_greedy_equals_transformers(hf_model):
    """vLLM's allowed_token_ids: every other id masked, held to transformers' PrefixConstrainedLogitsProcessor
    with the same ids; the plain answer's first token is left out, so the answer must change."""
    from transformers import PrefixConstrainedLogitsProcessor

    llm = make_llm()
    prompt_ids = llm.get_tokenizer().encode(PROMPT).ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))[0].outputs[0].token_ids
    allowed = sorted(set(plain[1:] + list(range(300, 400))) - {plain[0]})
    reference = _hf_greedy(hf_model, prompt_ids, PrefixConstrainedLogitsProcessor(lambda _, __: allowed, 1))

    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    got = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    assert got == reference != plain
    assert set(got) <= set(allowed)
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=1.5,
                                                  seed=7, allowed_token_ids=allowed[:5]))[0].outputs[0].token_ids
    assert set(sampled) <= set(allowed[:5])
