"""HTTP forwarding shared by `kvserve proxy` and `kvserve router`: which client headers travel to a
backend, the request body read once (JSON or not), the prefill call of disaggregated serving, the POST
routes that forward a request, and a GET answered as the backend answers it.
(Imported by their app builders only, so that `kvserve --help` imports no web stack.)"""

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

# what a backend needs of the client's headers: its key, the body's type, Anthropic's version
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-api-key", "anthropic-version",
                     "anthropic-beta")


log = logging.getLogger("kvserve.forwarding")


def forwarded_headers(raw: Request) -> dict[str, str]:
    return {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}


@dataclass(slots=True)
class Forwarded:
    """A client's request as a backend gets it: the bytes as sent, their JSON (None when they are
    not JSON: the backend answers with the right 400) and the headers that travel."""

    content: bytes
    body: Any
    headers: dict[str, str]


async def read_forwarded(raw: Request) -> Forwarded:
    content = await raw.body()
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    return Forwarded(content, body, forwarded_headers(raw))


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one choice, no stream."""
    body = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    body.update(max_tokens=1, stream=False, n=1)
    return body


async def prefill(client: httpx.AsyncClient, url: str, request: Forwarded, **kwargs: Any) -> None:
    """Have a prefill instance compute the prompt (disaggregated serving); a failure is logged, and
    the decode instance then computes the prompt itself."""
    if not isinstance(request.body, dict):
        return
    try:
        response = await client.post(url, json=prefill_body(request.body), headers=request.headers, **kwargs)
        if response.status_code != 200:
            log.warning("prefill %s answered %d: %s", url, response.status_code, response.text[:200])
    except httpx.HTTPError as err:
        log.warning("prefill %s failed (%s); the decode instance computes the prompt", url, err)


def add_forward_routes(app: FastAPI, forward: Callable[[str, Request], Awaitable[Any]],
                       paths: tuple[str, ...]) -> None:
    """POST `path` -> `forward(path, request)`, for each path (the proxy's and the router's routes)."""
    def route(path: str):
        async def endpoint(raw: Request):
            return await forward(path, raw)
        return endpoint

    for path in paths:
        app.add_api_route(path, route(path), methods=["POST"])


async def relay_get(client: httpx.AsyncClient, url: str, raw: Request) -> Response:
    """GET `url` with the client's headers, answered as the backend answered (httpx errors raise)."""
    response = await client.get(url, headers=forwarded_headers(raw))
    return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))
