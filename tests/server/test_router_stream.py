"""Resuming a broken stream (kvserve/server/router_stream.py): a replacement stream's events are cut
so the client's text is the uninterrupted answer's, in OpenAI's and Anthropic's SSE forms; a
replacement whose text disagrees ends the stream with an error. The real-process test (a backend
killed mid-stream) is in test_router.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.server.router_stream import (BackendBroke, Diverged, Transcript, encode, parse_event, sse_events,
                                          with_seed)


def chat_stream(rid: str, pieces: list[str], finish: bool = True) -> list[bytes]:
    def chunk(delta, reason=None):
        return encode(None, {"id": rid, "object": "chat.completion.chunk", "created": 1,
                             "model": "m", "choices": [{"index": 0, "delta": delta,
                                                        "logprobs": None,
                                                        "finish_reason": reason}]})
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in pieces]
    if finish:
        events += [chunk({"content": ""}, "length"),
                   encode(None, {"id": rid, "choices": [], "usage": {"prompt_tokens": 3}}),
                   b"data: [DONE]\n\n"]
    return events


def relay(transcript: Transcript, raw: list[bytes]) -> list[bytes]:
    async def run():
        async def chunks():
            for event in raw:  # split across chunk boundaries, as a socket may
                yield event[:5]
                yield event[5:]
        return [transcript.accept(e) async for e in sse_events(chunks())]
    return [out for out in asyncio.run(run()) if out]


def client_view(sent: list[bytes]) -> tuple[str, list[dict]]:
    text, payloads = "", []
    for raw in sent:
        data = raw.decode().split("data: ", 1)[1].strip()
        if data == "[DONE]":
            payloads.append({"done": True})
            continue
        payload = json.loads(data)
        payloads.append(payload)
        for c in payload.get("choices") or []:
            text += c.get("delta", {}).get("content") or c.get("text") or ""
    return text, payloads


def test_a_chat_stream_resumes_where_the_client_is():
    t = Transcript(anthropic=False, chat=True)
    first = relay(t, chat_stream("a", ["Hel", "lo wo"], finish=False))
    t.resume()  # the backend died; the same request on another one, chunked differently
    rest = relay(t, chat_stream("b", ["Hello", " w", "orld", "!"]))
    text, payloads = client_view(first + rest)
    assert text == "Hello world!" and t.done
    roles = [p for p in payloads if "role" in (p.get("choices") or [{}])[0].get("delta", {})]
    assert len(roles) == 1  # the replacement's role chunk is not repeated
    assert {p["id"] for p in payloads if "id" in p} == {"a"}  # one coherent stream
    assert sum(bool(c.get("finish_reason")) for p in payloads for c in p.get("choices") or []) == 1
    assert payloads[-1] == {"done": True} and payloads[-2]["usage"] == {"prompt_tokens": 3}


def test_a_thinking_models_chat_stream_resumes_its_reasoning_and_its_answer():
    """reasoning_content (a thinking model's, kvserve/server/reasoning.py) is the client's too: a replacement
    repeats neither it nor the answer."""
    def chunk(delta, reason=None):
        return encode(None, {"id": "r", "created": 1, "choices": [{"index": 0, "delta": delta,
                                                                    "finish_reason": reason}]})

    def stream(thoughts: list[str], pieces: list[str], finish: bool) -> list[bytes]:
        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"reasoning_content": t}) for t in thoughts] + [chunk({"content": p}) for p in pieces]
        return events + ([chunk({"content": ""}, "stop"), b"data: [DONE]\n\n"] if finish else [])

    def seen(sent: list[bytes], key: str) -> str:
        return "".join((c.get("delta") or {}).get(key) or "" for raw in sent
                       if (data := raw.decode().split("data: ", 1)[1].strip()) != "[DONE]"
                       for c in json.loads(data).get("choices") or [])

    for thoughts_first, pieces_first in ((["Hm", "m, Fra"], []), (["Hmm, France."], ["Par"])):
        t = Transcript(anthropic=False, chat=True)
        assert t.first_output(parse_event(stream(["Hm"], [], False)[1]))  # (the prefill is done)
        first = relay(t, stream(thoughts_first, pieces_first, finish=False))
        t.resume()
        rest = relay(t, stream(["Hmm, ", "France."], ["Pa", "ris."], finish=True))
        assert seen(first + rest, "reasoning_content") == "Hmm, France."
        assert seen(first + rest, "content") == "Paris." and t.done


def test_an_unbroken_stream_passes_through_byte_for_byte():
    t = Transcript(anthropic=False, chat=True)
    raw = chat_stream("a", ["Hi", " there"])
    assert relay(t, raw) == raw


def test_completions_resume_and_a_different_text_is_refused():
    def stream(rid, pieces):
        return [encode(None, {"id": rid, "created": 1, "choices": [
            {"index": 0, "text": p, "finish_reason": None}]}) for p in pieces]

    t = Transcript(anthropic=False, chat=False)
    first = relay(t, stream("a", ["one", " two"]))
    t.resume()
    rest = relay(t, stream("b", ["one two", " three"]) + [b"data: [DONE]\n\n"])
    assert client_view(first + rest)[0] == "one two three"
    t.resume()
    with pytest.raises(Diverged):
        relay(t, stream("c", ["one two", " four"]))  # unseeded sampling would do this
    assert b"stream_resume_failed" in t.error_event("x") and t.error_event("x").endswith(
        b"data: [DONE]\n\n")


def test_a_backend_reporting_its_own_shutdown_counts_as_broken():
    t = Transcript(anthropic=False, chat=True)
    with pytest.raises(BackendBroke):
        relay(t, [encode(None, {"error": {"message": "shutting down", "type": "server_error",
                                          "code": "shutting_down"}})])


def anthropic_stream(mid: str, pieces: list[str], finish: bool = True) -> list[bytes]:
    events = [encode("message_start", {"type": "message_start", "message": {"id": mid}}),
              encode("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}),
              encode("ping", {"type": "ping"})]
    events += [encode("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": p}})
               for p in pieces]
    if finish:
        events += [encode("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   encode("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": "max_tokens"}}),
                   encode("message_stop", {"type": "message_stop"})]
    return events


def test_an_anthropic_stream_resumes_without_repeating_an_event():
    t = Transcript(anthropic=True)
    first = relay(t, anthropic_stream("msg_a", ["Hel", "lo"], finish=False))
    t.resume()
    rest = relay(t, anthropic_stream("msg_b", ["He", "llo the", "re"]))
    names = [raw.split(b"\n", 1)[0].decode()[7:] for raw in first + rest]
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * 4 \
        + ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(json.loads(raw.split(b"data: ", 1)[1])["delta"]["text"]
                   for raw in first + rest if raw.startswith(b"event: content_block_delta"))
    assert text == "Hello there" and t.done
    assert b"msg_b" not in b"".join(rest)


def test_only_sampled_openai_streams_without_a_seed_get_one():
    assert isinstance(with_seed("/v1/chat/completions", {"stream": True})["seed"], int)
    assert with_seed("/v1/completions", {"stream": True, "temperature": 0}) is None
    assert with_seed("/v1/completions", {"stream": True, "seed": 5}) is None
    assert with_seed("/v1/completions", {"stream": False}) is None
    assert with_seed("/v1/messages", {"stream": True}) is None  # no seed in Anthropic's API

