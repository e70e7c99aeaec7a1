"""Server-sent events as the OpenAI-shaped streams write them: one `data:` event from a JSON payload, and
the payloads read back out of such a body (for the routes that re-shape a stream into another API's)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

DONE = "data: [DONE]\n\n"


def event(payload: Any, name: str | None = None) -> str:
    """One event: its `data:` line, after an `event:` line when it has a name (Anthropic's and Responses'
    streams name theirs)."""
    data = f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return data if name is None else f"event: {name}\n{data}"


async def payloads(body: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE body (error events included, [DONE] left out): for the routes that
    answer in another API's streaming shape (llama.cpp's /completion, Ollama's NDJSON, Responses)."""
    async for line in body:
        if line.startswith("data: {"):
            yield json.loads(line[6:])
