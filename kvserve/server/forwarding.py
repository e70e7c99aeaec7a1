"""HTTP forwarding shared by `kvserve proxy` and `kvserve router`: which client headers travel to a
backend, the POST routes that forward a request, and a GET answered as the backend answers it.
(Imported by their app builders only, so that `kvserve --help` imports no web stack.)"""

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

# what a backend needs of the client's headers: its key, the body's type, Anthropic's version
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-api-key", "anthropic-version",
                     "anthropic-beta")


def forwarded_headers(raw: Request) -> dict[str, str]:
    return {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}


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
