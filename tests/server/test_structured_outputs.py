"""Structured outputs over HTTP with the real `openai` client on the bundled SmolLM2: a Pydantic
`response_format` validates 100 of 100 times at temperature 1 (issue 26, must-show 1); json_object,
vLLM's `structured_outputs` and `guided_*` fields on both endpoints, streamed too; a malformed schema,
a grammar that cannot match, or two constraints at once are a 400 naming the field (must-show 5)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

Short = Annotated[str, Field(max_length=24)]


class Address(BaseModel):
    city: Short
    country: Short


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "teacher", "doctor", "artist"]
    address: Address
    skills: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)
    email: Short | None


MESSAGES = [{"role": "system", "content": "You reply with JSON only."},
            {"role": "user", "content": "Invent a person: name, age, role, address, skills, email."}]


@pytest.mark.slow
def test_pydantic_response_format_validates_100_of_100_at_temperature_1(client, model_name):
    """`chat.completions.parse` sends the strict JSON schema the SDK makes of the model and parses
    every choice back into it (a choice that does not validate raises)."""
    def ask(seed: int):
        return client.chat.completions.parse(model=model_name, messages=MESSAGES, response_format=Person,
                                             temperature=1.0, n=10, seed=seed, max_tokens=120)

    with ThreadPoolExecutor(4) as pool:  # choice i of a request samples with seed + i: no overlaps
        answers = list(pool.map(ask, range(0, 1000, 100)))
    people = [c.message.parsed for a in answers for c in a.choices]
    assert len(people) == 100
    assert all(isinstance(p, Person) for p in people)
    assert all(c.finish_reason == "stop" for a in answers for c in a.choices)
    assert len({p.model_dump_json() for p in people}) > 50  # sampled, not one answer repeated


def test_json_object_gives_one_object(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=60, temperature=0.0,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice.message.content.startswith("{")


def test_guided_choice_and_regex_on_completions(client, model_name):
    out = client.completions.create(model=model_name, prompt="Is the sea salty? Answer:", max_tokens=8,
                                    temperature=1.0, seed=3, n=4,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in out.choices} <= {"yes", "no"}
    out = client.completions.create(model=model_name, prompt="A phone number:", max_tokens=12,
                                    temperature=1.0, seed=4,
                                    extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"


def test_streamed_schema_output_equals_the_whole_one(client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=80, temperature=0.0,
                  extra_body={"guided_json": Address.model_json_schema()})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == whole
    Address.model_validate_json(whole)


def test_guided_grammar_lark(client, model_name):
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    out = client.completions.create(model=model_name, prompt="Q: is water wet?\nA:", max_tokens=12,
                                    temperature=0.0, extra_body={"guided_grammar": grammar})
    assert out.choices[0].text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_regex": "(abc"}, "guided_regex"),
    ({"guided_regex": r"[^\x00-\U0010FFFF]"}, "guided_regex"),  # compiles, matches nothing
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_constraints_are_a_400_naming_the_field(client, model_name, extra, param, endpoint):
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
