"""Structured outputs through the engine, on a tiny random-weight Llama (whose unconstrained output is
noise, so valid JSON can only come from the mask): outputs validate; the grammar state survives
chunked prefill, preemption (recompute and swap) and n > 1; a neighbour without a grammar gets the
same greedy tokens as alone; a grammar stops the sequence when it is complete."""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from kvserve import SamplingParams
from kvserve.structured import GrammarError, StructuredOutputsParams, lark_json
from tests.conftest import make_llm

PAGE = 16


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


class Owner(BaseModel):
    """Nested object, array of objects, optional field: a realistic Pydantic schema, bounded so a
    random model finishes inside max_tokens."""

    name: str = Field(max_length=16)
    pets: list[Pet] = Field(min_length=1, max_length=2)
    email: str | None = Field(default=None, max_length=20)


JSON = StructuredOutputsParams(json=Owner.model_json_schema(), strict=True)
PET = StructuredOutputsParams(json=Pet.model_json_schema(), strict=True)  # shorter outputs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.model.tiny_models import make_hf_model, write_gguf

    root = tmp_path_factory.mktemp("tiny-llama3")
    return str(write_gguf(make_hf_model("llama3"), "llama3", root / "llama3.gguf"))


def tiny(path, **kwargs):
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return make_llm(model=path, page_size=PAGE, **kwargs)


def prompt(seed: int, length: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 2047) for _ in range(length)]}


def sampled(seed: int, schema: StructuredOutputsParams = PET, max_tokens: int = 160, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=schema, **kwargs)


def test_outputs_validate_against_the_schema_at_temperature_1(tiny_path):
    llm = tiny(tiny_path)
    outs = llm.generate([prompt(i, 20 + i) for i in range(6)], [sampled(i, JSON) for i in range(6)])
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        Owner.model_validate_json(completion.text)


def test_without_the_grammar_the_tiny_model_writes_no_json(tiny_path):
    """The test above can fail: unconstrained, the same requests are not JSON."""
    llm = tiny(tiny_path)
    outs = llm.generate([prompt(i, 20 + i) for i in range(4)],
                        [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(4)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


def test_grammar_state_survives_chunked_prefill(tiny_path):
    """A 300-token prompt in chunks of 32: the state advances only on sampled tokens, so the seeded
    output equals the one-chunk run's."""
    p = prompt(7, 300)
    whole = tiny(tiny_path, max_num_batched_tokens=2048).generate(p, sampled(3))[0].outputs[0]
    chunked_llm = tiny(tiny_path, max_num_batched_tokens=32)
    chunked = chunked_llm.generate(p, sampled(3))[0].outputs[0]
    assert chunked.token_ids == whole.token_ids
    Pet.model_validate_json(chunked.text)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(tiny_path, preemption_mode):
    from kvserve.config import kv_bytes_per_page, resolve_kv_dtype
    from kvserve.model.gguf_loader import load_gguf

    prompts = [prompt(20 + i, 40 + 9 * i) for i in range(5)]
    params = [sampled(100 + i, max_tokens=48) for i in range(5)]
    expected = [o.outputs[0].token_ids for o in tiny(tiny_path, prefix_cache="off").generate(prompts, params)]
    cfg = load_gguf(tiny_path).config
    page_bytes = kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, PAGE, resolve_kv_dtype("auto", "float32"))
    needed = sum(-(-(len(p["prompt_token_ids"]) + len(e)) // PAGE) for p, e in zip(prompts, expected))
    tight = tiny(tiny_path, prefix_cache="off", kv_cache_memory=max(needed // 3 + 1, 9) * page_bytes,
                 max_model_len=128, preemption_mode=preemption_mode, swap_space="64MiB")
    got = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == expected
    for o in got:
        Pet.model_validate_json(o.outputs[0].text)


def test_n_samples_each_keep_their_own_grammar_state(tiny_path):
    out = tiny(tiny_path).generate(prompt(5, 33), sampled(11, n=4))[0]
    texts = [c.text for c in out.outputs]
    for text in texts:
        Pet.model_validate_json(text)
    assert len(set(texts)) > 1  # independent samples, not one state shared


def test_a_neighbour_without_a_grammar_is_unaffected(tiny_path):
    """Greedy tokens as alone; and bit for bit (logprobs too) as beside the same neighbours without
    their grammars (the batch's shape, not the grammar, is what may move low bits of a logit)."""
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = tiny(tiny_path).generate(prompt(1, 50), plain)[0].outputs[0]
    neighbours = [prompt(2, 40), prompt(1, 50), prompt(3, 45)]
    free = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True), plain,
            SamplingParams(max_tokens=16, ignore_eos=True)]
    constrained = [sampled(1), plain, SamplingParams(max_tokens=16, structured_outputs=PET)]
    without = tiny(tiny_path).generate(neighbours, free)[1].outputs[0]
    beside = tiny(tiny_path).generate(neighbours, constrained)[1].outputs[0]
    assert beside.token_ids == alone.token_ids
    assert (beside.token_ids, beside.logprobs) == (without.token_ids, without.logprobs)


def test_a_complete_grammar_stops_the_sequence(tiny_path):
    llm = tiny(tiny_path)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    outs = llm.generate([prompt(1, 10), prompt(2, 10)],
                        [SamplingParams(max_tokens=50, temperature=1.0, seed=1, structured_outputs=choice),
                         SamplingParams(max_tokens=50, temperature=1.0, seed=2, structured_outputs=regex)])
    assert outs[0].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[1].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_lark_grammar_with_an_embedded_schema(tiny_path):
    """The shape tool calling uses: a fixed wrapper around a JSON schema."""
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": Pet.model_json_schema()},
            "required": ["name", "arguments"], "additionalProperties": False}
    grammar = StructuredOutputsParams(grammar='start: "<tool_call>" ' + lark_json(call) + ' "</tool_call>"')
    text = tiny(tiny_path).generate(prompt(4, 12), SamplingParams(max_tokens=120, temperature=1.0, seed=4,
                                                                  structured_outputs=grammar))[0].outputs[0].text
    body = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.S)
    assert body, text
    parsed = json.loads(body.group(1))
    assert parsed["name"] == "get_weather"
    Pet.model_validate(parsed["arguments"])


@pytest.mark.parametrize("bad, says", [
    (StructuredOutputsParams(json={"type": "objekt"}, field="response_format"), "objekt"),
    (StructuredOutputsParams(json='{"type": ', field="guided_json"), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}, strict=True, field="f"), "uniqueItems"),
    (StructuredOutputsParams(regex="(abc", field="guided_regex"), "unclosed group"),
    (StructuredOutputsParams(grammar="start: foo", field="guided_grammar"), "foo"),
    (StructuredOutputsParams(regex=r"[^\x00-\U0010FFFF]", field="guided_regex"), "cannot match"),
])
def test_bad_constraints_are_refused_with_the_field_named(tiny_path, bad, says):
    llm = tiny(tiny_path)
    with pytest.raises(GrammarError) as err:
        llm.generate(prompt(1, 5), SamplingParams(max_tokens=4, structured_outputs=bad))
    assert says in str(err.value) and str(err.value).startswith(bad.field + ":")
    assert not llm.engine.has_unfinished()


def test_lenient_schema_ignores_what_strict_refuses(tiny_path):
    loose = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "maxItems": 3, "uniqueItems": True})
    text = tiny(tiny_path).generate(prompt(3, 9), SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                                 structured_outputs=loose))[0].outputs[0].text
    assert isinstance(json.loads(text), list)


def test_params_need_exactly_one_constraint():
    with pytest.raises(GrammarError):
        StructuredOutputsParams()
    with pytest.raises(GrammarError):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(GrammarError):
        StructuredOutputsParams(choice=[])


def test_beam_search_keeps_a_grammar_state_per_beam(tiny_path):
    from kvserve import BeamSearchParams

    llm = tiny(tiny_path)
    out = llm.beam_search(prompt(6, 20), BeamSearchParams(beam_width=3, max_tokens=60, structured_outputs=PET))[0]
    assert len(out.texts) == 3
    for beam, text in zip(out.beams, out.texts):
        assert beam.finished, text
        Pet.model_validate_json(text)


def test_speculative_decoding_leaves_grammar_requests_undrafted(tiny_path):
    """Drafts are verified against unmasked predictions, so a grammar request gets none; its output
    is the one without speculation, and a plain neighbour still speculates."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 8}
    repeat = {"prompt_token_ids": [5, 6, 7, 8] * 12}
    params = [sampled(9), SamplingParams(max_tokens=24, ignore_eos=True)]
    off = [o.outputs[0].token_ids for o in tiny(tiny_path).generate([prompt(8, 30), repeat], params)]
    llm = tiny(tiny_path, speculative_config=spec)
    on = llm.generate([prompt(8, 30), repeat], params)
    assert [o.outputs[0].token_ids for o in on] == off
    Pet.model_validate_json(on[0].outputs[0].text)
    assert on[0].spec_decode is None or on[0].spec_decode.num_draft_tokens == 0
    assert on[1].spec_decode.num_draft_tokens > 0  # (the test can tell)
