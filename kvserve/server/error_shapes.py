"""The error body a client of each API family reads, for answers given before any route runs (the
key gate, the body guard): Anthropic's on /v1/messages, Ollama's on /api/, OpenAI's elsewhere."""

from __future__ import annotations

from typing import Any, Literal

from kvserve.server.anthropic_protocol import anthropic_error
from kvserve.server.protocol import error_body

ApiFamily = Literal["anthropic", "ollama", "openai"]


def api_family(path: str) -> ApiFamily:
    """Whose API a path belongs to, and so whose error shape it answers in."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "ollama" if path.startswith("/api/") else "openai"


def front_error(path: str, status: int, message: str, type_: str = "invalid_request_error",
                code: str | None = None, param: str | None = None) -> dict[str, Any]:
    family = api_family(path)
    if family == "anthropic":
        return anthropic_error(message, status)
    if family == "ollama":
        return {"error": message}
    return error_body(message, type_, param, code)
