"""A streamed Responses API answer through `kvserve router` whose backend's connection breaks mid-answer
is resumed on the other backend: the openai client gets one response (one id, item ids unchanged,
sequence numbers 0..n-1 with no gap, each character of text once) whose text equals an uninterrupted
greedy run, and the response is stored under that id, so GET and a `previous_response_id` follow-up
work. Real servers; the first backend sits behind a proxy that cuts its stream after a few events."""

from __future__ import annotations

import httpx
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.server.conftest import ServerThread

STORY = "Tell a long story about a lighthouse keeper who counts the ships that pass her island."
CUT_AFTER = 12  # events: created, in_progress, the item and part, then some deltas


def cutting_proxy(target: str) -> Starlette:
    """Forwards everything to `target`; a streamed /v1/responses breaks after CUT_AFTER events."""
    client = httpx.AsyncClient(timeout=120)

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream = client.build_request(request.method, target + request.url.path, content=body,
                                        headers=headers, params=request.query_params)
        answer = await client.send(upstream, stream=True)
        if request.url.path != "/v1/responses" or b'"stream":true' not in body.replace(b" ", b""):
            data = await answer.aread()
            await answer.aclose()
            return Response(data, answer.status_code, media_type=answer.headers.get("content-type"))

        async def cut():
            count = 0
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
                    count += chunk.count(b"\n\n")
                    if count >= CUT_AFTER:
                        raise ConnectionResetError("cut mid-stream")  # the connection drops
            finally:
                await answer.aclose()

        return StreamingResponse(cut(), answer.status_code, media_type="text/event-stream",
                                 headers={k: v for k, v in answer.headers.items() if k.startswith("x-kvserve")})

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "DELETE"])])


def test_a_responses_stream_resumes_on_another_backend(async_engine, model_name):
    from kvserve.server.api import build_app
    from kvserve.server.router_app import build_router_app

    ask = dict(model=model_name, input=STORY, max_output_tokens=60, temperature=0)
    with ServerThread(build_app(async_engine)) as upstream, ServerThread(build_app(async_engine)) as other, \
            ServerThread(cutting_proxy(upstream.url)) as cut:
        whole = OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0, timeout=120).responses.create(
            **ask, store=False)
        app = build_router_app([cut.url, other.url], policy="round-robin", poll_interval_s=0.2)
        with ServerThread(app) as router:
            client = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
            events = list(client.responses.create(**ask, stream=True))
            resumes = app.state.router.metrics.stream_resumes._value.get()
            final = events[-1].response
            assert events[-1].type in ("response.completed", "response.incomplete") and resumes == 1
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
            assert len([e for e in events if e.type == "response.output_item.added"]) == 1
            item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
            assert item_ids == {final.output[0].id}
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text == final.output_text == whole.output_text
            assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored on `other`
            follow = client.responses.create(model=model_name, input="And then?", previous_response_id=final.id,
                                             max_output_tokens=4)
            assert follow.previous_response_id == final.id
            assert follow.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens // 16 * 16


def test_a_replacement_that_says_something_else_is_refused_not_spliced():
    import pytest

    from kvserve.server.router_responses_stream import ResponsesTranscript
    from kvserve.server.router_stream import Diverged, Event

    def event(kind: str, **fields) -> Event:
        return Event(b"", kind, {"type": kind, "sequence_number": 99, **fields})

    t = ResponsesTranscript()
    t.accept(event("response.created", response={"id": "resp_a", "output": []}))
    t.accept(event("response.output_item.added", output_index=0, item={"id": "msg_a", "type": "message"}))
    t.accept(event("response.output_text.delta", output_index=0, content_index=0, item_id="msg_a", delta="Hello"))
    t.resume()
    assert t.accept(event("response.created", response={"id": "resp_b", "output": []})) is None
    assert t.accept(event("response.output_item.added", output_index=0, item={"id": "msg_b"})) is None
    out = t.accept(event("response.output_text.delta", output_index=0, content_index=0, item_id="msg_b",
                         delta="Hello there"))
    assert b'"delta":" there"' in out and b'"item_id":"msg_a"' in out and b'"sequence_number":3' in out
    t.resume()  # a third stream whose text is not the client's
    with pytest.raises(Diverged):
        t.accept(event("response.output_text.delta", output_index=0, content_index=0, delta="Help"))


def test_a_thinking_models_reasoning_item_resumes_without_repeats():
    """A reasoning item (kvserve/server/reasoning.py) before the message: its reasoning_text deltas are cut to
    what the client lacks, as the message's text is, and its done event is sent once."""
    from kvserve.server.router_responses_stream import ResponsesTranscript
    from kvserve.server.router_stream import Event

    def event(kind: str, **fields) -> Event:
        return Event(b"", kind, {"type": kind, "sequence_number": 99, **fields})

    def stream(t: ResponsesTranscript, thoughts: list[str], texts: list[str]) -> list[bytes]:
        events = [event("response.created", response={"id": "resp", "output": []}),
                  event("response.output_item.added", output_index=0, item={"id": "rs", "type": "reasoning"})]
        events += [event("response.reasoning_text.delta", output_index=0, content_index=0, item_id="rs", delta=d)
                   for d in thoughts]
        events += [event("response.reasoning_text.done", output_index=0, content_index=0, item_id="rs",
                         text="".join(thoughts))] if texts else []
        events += [event("response.output_text.delta", output_index=1, content_index=0, item_id="msg", delta=d)
                   for d in texts]
        return [out for out in map(t.accept, events) if out is not None]

    t = ResponsesTranscript()
    first = stream(t, ["Hmm, ", "Fra"], [])
    t.resume()
    rest = stream(t, ["Hmm, France."], ["Par", "is."])
    sent = [e for e in first + rest if b"reasoning_text" in e]
    assert b"".join(sent).count(b'"delta":"Hmm, "') == 1 and any(b'"delta":"nce."' in e for e in sent)
    assert sum(b"reasoning_text.done" in e for e in first + rest) == 1
