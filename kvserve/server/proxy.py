"""`kvserve proxy`: an OpenAI-compatible front for disaggregated prefill/decode.

    client -> proxy -> prefill instance (`serve --role prefill`, max_tokens=1): computes the prompt,
                       writes its full pages to Redis, answers
                    -> decode instance (`serve --role decode`): loads those pages, computes the
                       last partial page and the last token, generates; its answer (JSON or SSE
                       stream) passes through unchanged

A prefill that fails is logged and skipped: the decode instance then computes the prompt itself, so
a request never fails because of the prefill side. With several --prefill / --decode URLs the proxy
takes them in turn.
"""

import argparse
import contextlib
import itertools


def base_url(url: str) -> str:
    """`http://host:8001/v1/` -> `http://host:8001`."""
    return url.rstrip("/").removesuffix("/v1")


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0):
    # (imported here so that `kvserve --help` imports no web stack; no `from __future__ import
    # annotations` in this module: FastAPI must see these local types in the endpoint signatures)
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask

    from kvserve.server.forwarding import add_forward_routes, prefill, read_forwarded, relay_get
    from kvserve.server.protocol import error_body

    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    prefills = itertools.cycle([base_url(u) for u in prefill_urls])
    decodes = itertools.cycle([base_url(u) for u in decode_urls])
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0)) as client:
            state["client"] = client
            yield

    app = FastAPI(title="kvserve proxy", lifespan=lifespan)

    async def forward(path: str, raw: Request):
        request = await read_forwarded(raw)
        client, url = state["client"], next(decodes) + path
        await prefill(client, next(prefills) + path, request)
        try:
            response = await client.send(client.build_request("POST", url, content=request.content,
                                                              headers=request.headers), stream=True)
        except httpx.HTTPError as err:
            return JSONResponse(error_body(f"the decode instance is unreachable: {err}",
                                           "server_error"), 502)
        kind = response.headers.get("content-type", "application/json")
        if kind.startswith("text/event-stream"):
            return StreamingResponse(response.aiter_raw(), response.status_code, media_type=kind,
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(response.aclose))
        data = await response.aread()
        await response.aclose()
        return Response(data, response.status_code, media_type=kind)

    add_forward_routes(app, forward, ("/v1/completions", "/v1/chat/completions"))

    @app.get("/v1/models")
    async def models(raw: Request):
        try:
            return await relay_get(state["client"], next(decodes) + "/v1/models", raw)
        except httpx.HTTPError as err:
            return JSONResponse(error_body(f"the decode instance is unreachable: {err}",
                                           "server_error"), 502)

    @app.get("/health")
    async def health():
        """200 when every prefill and decode instance answers its /health."""
        for url in {*prefill_urls, *decode_urls}:
            try:
                response = await state["client"].get(base_url(url) + "/health", timeout=5.0)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                return JSONResponse(error_body(f"{base_url(url)} is not healthy", "server_error"),
                                    503)
        return Response(status_code=200)

    return app


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a `kvserve serve --role prefill` instance (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a `kvserve serve --role decode` instance (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for an instance's answer")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def main_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_proxy_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
