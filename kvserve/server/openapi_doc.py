"""The OpenAPI document of `kvserve serve`: FastAPI's, completed where it cannot see. Routes that
read their body themselves (Anthropic's, Responses', Ollama's) get their request model's schema, and
every operation documents its errors in its API family's shape instead of FastAPI's unused 422.
Schema-driven fuzzing (tests/server/test_schema_fuzz.py) takes this document as the contract."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvserve.server.anthropic_protocol import MessagesRequest
from kvserve.server.error_shapes import api_family
from kvserve.server.ollama_protocol import ChatRequest, GenerateRequest
from kvserve.server.responses_protocol import ResponsesRequest

REF = "#/components/schemas/{model}"
# (method, path) -> the model the route validates its raw body with
RAW_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/messages"): MessagesRequest, ("post", "/v1/messages/count_tokens"): MessagesRequest,
    ("post", "/v1/responses"): ResponsesRequest, ("post", "/api/chat"): ChatRequest,
    ("post", "/api/generate"): GenerateRequest}
SHOW_BODY = {"type": "object", "properties": {"model": {"type": "string", "minLength": 1},
                                              "name": {"type": "string", "minLength": 1}}}
_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _NULLABLE_STRING, "code": _NULLABLE_STRING}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": {"type": "string"},
                                                             "message": {"type": "string"}}}}},
    "OllamaError": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
}


# what a 200 may carry besides FastAPI's application/json, by path
STREAMS = {"/v1/completions": "text/event-stream", "/v1/chat/completions": "text/event-stream",
           "/v1/messages": "text/event-stream", "/v1/responses": "text/event-stream",
           "/completion": "text/event-stream", "/infill": "text/event-stream", "/api/chat": "application/x-ndjson",
           "/api/generate": "application/x-ndjson", "/v1/kv_events": "text/event-stream"}
STREAM_ITEM = {  # one server-sent event; one JSON object per NDJSON line
    "text/event-stream": {"type": "object", "required": ["data"],
                          "properties": {"event": {"type": "string"}, "data": {"type": "string"}}},
    "application/x-ndjson": {"type": "object"}}
PLAIN_ANSWERS = {"/metrics": {"text/plain": {"schema": {"type": "string"}}},
                 "/health": None, "/reset_prefix_cache": None}  # None: no body
ERROR_SCHEMA_OF = {"anthropic": "AnthropicError", "ollama": "OllamaError", "openai": "OpenAIError"}


def document(app: FastAPI, model_names: list[str]) -> dict[str, Any]:
    """The app's OpenAPI document (built once, then cached on the app as FastAPI does); a request's
    `model` is documented as one of `model_names`, the names this server answers to."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components.update(copy.deepcopy(ERROR_SCHEMAS))
    for (method, path), model in RAW_BODIES.items():
        operation = spec["paths"].get(path, {}).get(method)
        if operation is not None:
            # the models' own names under their route's model, so that no name meets another
            # model's of the same name (Anthropic's Tool and OpenAI's)
            prefix = model.__name__ + "."
            schema = model.model_json_schema(ref_template=REF.format(model=prefix + "{model}"))
            components.update({prefix + name: sub for name, sub in schema.pop("$defs", {}).items()})
            if path.endswith("/count_tokens"):  # max_tokens is filled in there
                schema["required"] = [r for r in schema.get("required", []) if r != "max_tokens"]
            operation["requestBody"] = _json_body(schema)
    if "post" in spec["paths"].get("/api/show", {}):
        spec["paths"]["/api/show"]["post"]["requestBody"] = _json_body(copy.deepcopy(SHOW_BODY))
    for operations in spec["paths"].values():
        for operation in operations.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            _name_the_models(_resolved(spec, body.get("schema", {})), model_names)
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # validation errors are 400s here
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if path in PLAIN_ANSWERS:
                ok.pop("content", None)
                if PLAIN_ANSWERS[path] is not None:
                    ok["content"] = PLAIN_ANSWERS[path]
            elif path in STREAMS:
                ok.setdefault("content", {})[STREAMS[path]] = {"schema": STREAM_ITEM[STREAMS[path]]}
            if path == "/health":  # the engine loop is down, or the server is draining
                responses["503"] = {"description": "not serving",
                                    "content": {"application/json": {"schema": {"$ref": REF.format(model="OpenAIError")}}}}
            responses["4XX"] = {"description": "the request cannot be served as sent",
                                "content": {"application/json": {"schema": {
                                    "$ref": REF.format(model=ERROR_SCHEMA_OF[api_family(path)])}}}}
    app.openapi_schema = spec
    return spec


def _resolved(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref", "")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def _name_the_models(schema: dict[str, Any], model_names: list[str]) -> None:
    """`model` as an enum of the served names (null still allowed where it was)."""
    prop = schema.get("properties", {}).get("model")
    if prop is not None:
        nullable = any(option.get("type") == "null" for option in prop.get("anyOf", []))
        named = {"type": "string", "enum": list(model_names)}
        schema["properties"]["model"] = {"anyOf": [named, {"type": "null"}]} if nullable else named


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}
