"""Chat content parts the served models cannot read (images, audio) get a 400 with OpenAI's error
body, not a 500: the check is part of the request's validation."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
])
def test_non_text_content_parts_are_400(server, part):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}],
            "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert f"content parts of type '{part['type']}' are not supported" in error["message"]


def test_text_parts_are_joined(server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                      {"type": "text", "text": " hi"}]}],
            "max_tokens": 2, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
