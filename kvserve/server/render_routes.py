"""vLLM's render routes: `POST /v1/completions/render` and `/v1/chat/completions/render` give the token
ids a completion request would be served with, rendered and tokenized by the front door exactly as
/v1/completions and /v1/chat/completions do it, without serving anything; in vLLM's GenerateRequest
shape (a list of them for completions, one for chat), which llm-d's tokenizer plugin reads.

`cache_salt` in the answer is what this server's KV events carry in the first page's `extra_keys`
for the request: its own `cache_salt`, or with an API key an opaque digest of the tenant's namespace
(docs/scale-out.md), so a router folding it into its block keys predicts the hits kvserve will serve
and none across tenants."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI

from kvserve.kv_events import event_cache_salt
from kvserve.server.front import FrontDoor
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, model_not_found

_ids = itertools.count()


def register(app: FastAPI, door: FrontDoor, model_names: list[str],
             namespace: Callable[..., Awaitable[str]]) -> None:
    def check_model(model: str | None) -> str:
        if model is not None and model not in model_names:
            raise model_not_found(model, model_names)
        return model or model_names[0]

    def generate_request(token_ids: list[int], body: Any, model: str, ns: str) -> dict[str, Any]:
        return {"request_id": f"render-{next(_ids)}", "token_ids": token_ids, "features": None,
                "sampling_params": {"max_tokens": body.max_tokens, "temperature": body.temperature,
                                    "top_p": body.top_p, "n": body.n},
                "model": model, "stream": False, "cache_salt": event_cache_salt(ns, body.cache_salt),
                "priority": 0, "kv_transfer_params": None}

    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest, ns: str = Depends(namespace)):
        model = check_model(body.model)
        prompts = await door.render_completion_request(body)
        return [generate_request(ids, body, model, ns) for ids in prompts]

    @app.post("/v1/chat/completions/render")
    async def chat_render(body: ChatCompletionRequest, ns: str = Depends(namespace)):
        model = check_model(body.model)
        return generate_request(await door.render_chat_request(body), body, model, ns)
