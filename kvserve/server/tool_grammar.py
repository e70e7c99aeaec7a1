"""`tool_choice: "required"` and a named function enforced by the grammar, not hoped for: the
constraint (kvserve.structured) that makes the model write a call in its own format, the call
object `{"name": ..., "arguments": ...}` with the arguments validated by the tool's JSON schema.
`required` with `parallel_tool_calls: true` sent (OpenAI) lets it write one or more calls, as its
format writes several (Hermes: `<tool_call>` blocks one per line; the JSON fallback: one object per
line); otherwise, for a named function, on Anthropic's `any`, and in Llama 3.x's format (its template
renders one call per turn) the grammar ends after one call: a grammar that may always go on lets a
weak model write calls until max_tokens.

With fixed JSON separators, the forced call
is the text the template renders for that assistant turn when the conversation comes back, so the
follow-up request can reuse the answer's KV pages too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.sampling_params import SamplingParams
from kvserve.server.protocol import APIError
from kvserve.server.tool_parser import CLOSE, OPEN, ToolFormat
from kvserve.server.tool_protocol import ToolSet
from kvserve.structured import StructuredOutputsParams, lark_json


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def forced_call(toolset: ToolSet, fmt: ToolFormat, field: str = "tool_choice") -> StructuredOutputsParams | None:
    """The constraint for a choice that must call (None for "auto" and "none")."""
    if not toolset.choice.forces_call:
        return None
    names = [toolset.choice.name] if toolset.choice.mode == "named" else toolset.names
    schemas = [call_schema(name, toolset.schema_of(name)) for name in names]
    call = lark_json(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    if fmt is ToolFormat.HERMES:
        call = f"{_lark_string(OPEN + chr(10))} {call} {_lark_string(chr(10) + CLOSE)}"
    several = toolset.choice.mode == "required" and toolset.choice.forced_several and fmt is not ToolFormat.LLAMA3
    if not several:
        return StructuredOutputsParams(grammar=f"start: {call}", field=field)
    return StructuredOutputsParams(grammar=f"start: call ({_lark_string(chr(10))} call)*\ncall: {call}", field=field)


def with_tool_grammar(params: SamplingParams, toolset: ToolSet, fmt: ToolFormat | None,
                      field: str = "tool_choice") -> SamplingParams:
    """`params` with the forced call's constraint, when the choice forces one (a 400 when the
    request constrains its output another way too)."""
    forced = forced_call(toolset, fmt, field) if fmt is not None else None
    if forced is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(f"{field}: a forced tool call and an output constraint (response_format, "
                       "structured_outputs) cannot both apply; send one", param=field)
    return replace(params, structured_outputs=forced)
