"""The error body a client of each API family reads, for answers given before any route runs (the
key gate, the body guard): Anthropic's on /v1/messages, Ollama's on /api/, OpenAI's elsewhere."""

from __future__ import annotations

from typing import Any

from kvserve.server.anthropic_protocol import anthropic_error
from kvserve.server.protocol import error_body


def front_error(path: str, status: int, message: str, type_: str = "invalid_request_error",
                code: str | None = None, param: str | None = None) -> dict[str, Any]:
    if path.startswith("/v1/messages"):
        return anthropic_error(message, status)
    if path.startswith("/api/"):
        return {"error": message}
    return error_body(message, type_, param, code)
