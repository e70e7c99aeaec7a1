"""Injected fault: a bug met after a stream has started (the text-delta step raises). Every streaming
route ends its answer with an error in its API family's shape instead of a cut connection, the bug is
logged with its traceback, and no page stays in use."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from kvserve.server.text_delta import TextDelta
from tests.server.conftest import wait_no_pages_in_use

PROMPT = [{"role": "user", "content": "Tell me a story."}]


def openai_error(lines: list[str]) -> str:
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return json.loads(data[-2])["error"]["message"]


def anthropic_error(lines: list[str]) -> str:
    assert lines[-2:] == ["event: error", lines[-1]]
    return json.loads(lines[-1].removeprefix("data: "))["error"]["message"]


def ollama_error(lines: list[str]) -> str:
    return json.loads(lines[-1])["error"]


def llamacpp_error(lines: list[str]) -> str:
    return json.loads(lines[-1].removeprefix("data: "))["error"]["message"]


def responses_error(lines: list[str]) -> str:
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    failed = [e for e in events if e["type"] in ("error", "response.failed")]
    assert failed, events[-3:]
    return json.dumps(failed[0])


ROUTES = {
    "openai chat": ("/v1/chat/completions", {"messages": PROMPT}, openai_error),
    "openai completions": ("/v1/completions", {"prompt": "Once upon a time"}, openai_error),
    "anthropic": ("/v1/messages", {"messages": PROMPT}, anthropic_error),
    "ollama": ("/api/chat", {"messages": PROMPT, "options": {"num_predict": 24}}, ollama_error),
    "llama.cpp": ("/completion", {"prompt": "Once upon a time", "n_predict": 24}, llamacpp_error),
    "responses": ("/v1/responses", {"input": "Tell me a story."}, responses_error),
}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("route", ROUTES)
def test_a_bug_mid_stream_ends_the_answer_with_an_error(server, async_engine, model_name, monkeypatch, route):
    path, body, error_of = ROUTES[route]
    calls = {"n": 0}
    update = TextDelta.update

    def fails_on_the_third(self, text, finished):
        calls["n"] += 1
        if calls["n"] == 3:
            raise IndexError("injected")
        return update(self, text, finished)

    monkeypatch.setattr(TextDelta, "update", fails_on_the_third)
    payload = {"model": model_name, "stream": True, "max_tokens": 24, "temperature": 0, **body}
    logged = Records()  # on the logger itself: `kvserve serve` sets its loggers not to propagate
    logging.getLogger("kvserve.server").addHandler(logged)
    try:
        with httpx.stream("POST", server.url + path, json=payload, timeout=60) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.strip()]
    finally:
        logging.getLogger("kvserve.server").removeHandler(logged)
    assert calls["n"] >= 3  # the fault was met after the stream started
    assert "internal error while streaming (IndexError)" in error_of(lines)
    assert any(r.exc_info and "injected" in str(r.exc_info[1]) for r in logged.records)
    wait_no_pages_in_use(async_engine)
