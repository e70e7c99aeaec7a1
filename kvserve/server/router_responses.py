"""The Responses API through `kvserve router`: a stored response lives on the backend that answered it,
so the router learns each response's backend from the answer's `x-kvserve-response-id` header and sends
a follow-up (`previous_response_id`), a GET and a DELETE of that id there (per API key). A streamed
answer is relayed as it comes (no resume on another backend: the follow-up state is on this one)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.server.forwarding import forwarded_headers, read_forwarded
from kvserve.server.protocol import error_body
from kvserve.server.router_core import Router
from kvserve.server.router_index import bearer

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
        if isinstance(previous, str):
            key = response_key(headers, previous)
            if router.affinity.backend_of(key) is None:
                return not_found(previous, "previous_response_id")
        else:
            key = router.affinity.key_of(headers, body)
        stream = isinstance(body, dict) and body.get("stream") is True
        sent = await router.send("/v1/responses", request.content, headers, {}, set(), stream, key)
        if isinstance(sent, str):
            return JSONResponse(error_body(f"no backend could answer ({sent})", "server_error"), 502)
        ticket, response, reason, _ = sent
        router.metrics.decided(ticket.backend.url, reason, 0)
        if (answered := response.headers.get(RESPONSE_ID_HEADER)) is not None:
            router.affinity.place(response_key(headers, answered), ticket.backend.url)
        kind = response.headers.get("content-type", "application/json")

        async def done() -> None:
            ticket.release()
            with contextlib.suppress(Exception):
                await response.aclose()

        if stream and response.status_code == 200:
            return StreamingResponse(response.aiter_raw(), 200, media_type=kind,
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(done))
        try:
            data = await response.aread()
        finally:
            await done()
        return Response(data, response.status_code, media_type=kind)

    async def on_its_backend(method: str, response_id: str, raw: Request) -> Response:
        headers = forwarded_headers(raw)
        url = router.affinity.backend_of(response_key(headers, response_id))
        if url is None:
            return not_found(response_id)
        answer = await router.client.request(method, f"{url}/v1/responses/{response_id}", headers=headers,
                                             timeout=router.timeouts.whole_s)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, raw: Request):
        return await on_its_backend("GET", response_id, raw)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request):
        return await on_its_backend("DELETE", response_id, raw)
