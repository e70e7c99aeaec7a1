"""Structured outputs on /v1/messages in Anthropic's shape, with the real `anthropic` SDK on the bundled
SmolLM2: `messages.parse(output_format=Model)` (sent as `output_config.format`) and the beta's top-level
`output_format` give JSON that validates at temperature 1, through the same constraint code as the
OpenAI routes; bad input is Anthropic's 400 naming the field."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import pytest
from pydantic import BaseModel

MESSAGES = [{"role": "user", "content": "Is the sky green? Reply with JSON."}]


class Verdict(BaseModel):
    answer: Literal["yes", "no", "unsure"]
    certain: bool
    topic: Literal["sky", "sea", "land"]


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=300, max_retries=0)


def test_sdk_parse_validates_at_temperature_1(claude, model_name):
    for _ in range(5):
        message = claude.messages.parse(model=model_name, max_tokens=60, extra_body={"temperature": 1.0}, messages=MESSAGES,
                                        output_format=Verdict)
        assert isinstance(message.parsed_output, Verdict) and message.stop_reason == "end_turn"


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_a_raw_schema_in_either_spelling_constrains_the_text(server, model_name, field):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"model": model_name, "max_tokens": 40, "temperature": 1.0, "messages": MESSAGES,
            field: {"format": fmt} if field == "output_config" else fmt}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    value = json.loads(response.json()["content"][0]["text"])
    assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)


@pytest.mark.parametrize("patch, message", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}},
     "output_format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
      "output_format": {"type": "json_schema", "schema": SCHEMA}}, "both constrain the output"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
])
def test_bad_formats_are_anthropics_400_naming_the_field(server, model_name, patch, message):
    body = {"model": model_name, "max_tokens": 4, "messages": MESSAGES, **patch}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"], error
