"""The Responses API through `kvserve router`: a stored response lives on the backend that answered it,
so the router learns each response's backend from the answer's `x-kvserve-response-id` header and sends
a follow-up (`previous_response_id`), a GET and a DELETE of that id there (per API key). An id the
router does not know (it restarted, or forgot it) or whose backend is down or answers 404 is asked of
the other backends in turn: backends that share stored responses through Redis all find it, and a
backend that lacks it answers its own 404 (tenants stay the backends' to tell apart). A streamed answer
whose backend dies is resumed on another one under the same response id (router_responses_stream.py)."""

from __future__ import annotations

import contextlib

import httpx

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.server.forwarding import forwarded_headers, read_forwarded
from kvserve.server.protocol import error_body
from kvserve.server.router_core import Router
from kvserve.server.router_index import bearer
from kvserve.server.router_responses_stream import ResponsesTranscript
from kvserve.server.router_stream import Attempt, ResumingRelay

RESPONSE_ID_HEADER = "x-kvserve-response-id"


def response_key(headers: dict[str, str], response_id: str) -> tuple[str, str]:
    return (bearer(headers) or headers.get("x-api-key") or "", f"response:{response_id}")


def not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(f"Response with id '{response_id}' not found.", "invalid_request_error",
                                   param), 404)


def register(app: FastAPI, router: Router) -> None:
    @app.post("/v1/responses")
    async def create(raw: Request):
        request = await read_forwarded(raw)
        body, headers = request.body, request.headers
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        key = router.affinity.key_of(headers, body)
        if isinstance(previous, str) and router.affinity.backend_of(response_key(headers, previous)) is not None:
            key = response_key(headers, previous)  # (unknown: any backend, which 404s if it lacks it)
        stream = isinstance(body, dict) and body.get("stream") is True
        tried: set[str] = set()
        while True:
            sent = await router.send("/v1/responses", request.content, headers, {}, tried, stream, key)
            if isinstance(sent, str):
                if isinstance(previous, str) and len(tried) == len(router.backends):
                    return not_found(previous, "previous_response_id")  # every backend said 404
                return JSONResponse(error_body(f"no backend could answer ({sent})", "server_error"), 502)
            ticket, response, reason, _ = sent
            if not (isinstance(previous, str) and response.status_code == 404):
                break
            ticket.release()  # this backend lacks the previous response: ask the next one
            with contextlib.suppress(Exception):
                await response.aclose()
        router.metrics.decided(ticket.backend.url, reason, 0)
        if (answered := response.headers.get(RESPONSE_ID_HEADER)) is not None:
            router.affinity.place(response_key(headers, answered), ticket.backend.url)
        kind = response.headers.get("content-type", "application/json")

        async def done() -> None:
            ticket.release()
            with contextlib.suppress(Exception):
                await response.aclose()

        if stream and response.status_code == 200 and kind.startswith("text/event-stream"):
            return resuming(ticket, response, request.content, headers, key)
        try:
            data = await response.aread()
        finally:
            await done()
        return Response(data, response.status_code, media_type=kind)

    def resuming(ticket, response, content: bytes, headers: dict[str, str], key) -> StreamingResponse:
        """The stream relayed through a ResponsesTranscript: resumed on another backend if this one
        dies, under the same response id (router_responses_stream.py)."""
        transcript = ResponsesTranscript()

        async def reopen(tried: set[str]) -> Attempt | None:
            again = {**headers, RESPONSE_ID_HEADER: transcript.response_id} if transcript.response_id else headers
            while not isinstance(sent := await router.send("/v1/responses", content, again, {}, tried, True, key), str):
                ticket, response, _, _ = sent
                if response.status_code == 200 and response.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    router.affinity.place(response_key(headers, transcript.response_id or ""), ticket.backend.url)
                    return Attempt(ticket, response, 0, router.alarms[ticket.backend.url])
                ticket.release()
                await response.aclose()
            return None

        relay = ResumingRelay(transcript, Attempt(ticket, response, 0, router.alarms[ticket.backend.url]), reopen,
                              router.failed, router.metrics, router.timeouts)
        return StreamingResponse(relay.body(), 200, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          RESPONSE_ID_HEADER: response.headers.get(RESPONSE_ID_HEADER, "")},
                                 background=BackgroundTask(relay.finish))

    async def on_its_backend(method: str, response_id: str, raw: Request) -> Response:
        """Its backend first, then the others (healthy first) until one has it."""
        headers = forwarded_headers(raw)
        known = router.affinity.backend_of(response_key(headers, response_id))
        order = sorted(router.backends, key=lambda b: (b.url != known, not b.healthy))
        for url in (b.url for b in order):
            try:
                answer = await router.client.request(method, f"{url}/v1/responses/{response_id}", headers=headers,
                                                     timeout=router.timeouts.whole_s)
            except httpx.HTTPError:
                continue
            if answer.status_code != 404:
                router.affinity.place(response_key(headers, response_id), url)
                return Response(answer.content, answer.status_code,
                                media_type=answer.headers.get("content-type"))
        return not_found(response_id)

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, raw: Request):
        return await on_its_backend("GET", response_id, raw)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request):
        return await on_its_backend("DELETE", response_id, raw)
