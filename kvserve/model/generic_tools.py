"""The generic tool format, for chat templates that never read `tools` (as llama.cpp falls back to one):
the conversation is rewritten before the template renders it, so any template carries tools.

- The tool definitions go into the system turn (prepended to the first system message, or a new one):
  GENERIC_TOOLS_PREAMBLE, then one JSON line per tool `{"name", "description", "parameters"}`, then
  GENERIC_TOOLS_RULE.
- The model answers a call as the JSON object `{"name": ..., "arguments": {...}}` alone (several: one
  per line), which the server's JSON tool format reads and a forced `tool_choice` enforces by grammar.
- An assistant turn's earlier calls are rendered as that same JSON text (so its KV can be reused), and a
  tool result becomes a user turn `{"tool_response": {"name", "tool_call_id", "content"}}`, since such
  templates know no tool role.
"""

from __future__ import annotations

import json
from typing import Any

GENERIC_TOOLS_PREAMBLE = "You can call these tools (JSON schemas, one per line):"
GENERIC_TOOLS_RULE = ('To call a tool, answer with only the JSON object {"name": <tool name>, "arguments": '
                      '<arguments object>}, one per line for several calls, and nothing else. Otherwise '
                      'answer normally. Tool results come back as {"tool_response": ...}.')


def template_reads_tools(template: str | None) -> bool:
    return "tools" in (template or "")


def with_generic_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (the template's shape) rewritten to carry `tools` (transformers' shape) as text."""
    lines = [json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "parameters": t["function"].get("parameters", {})}, ensure_ascii=False)
             for t in tools]
    preamble = "\n".join([GENERIC_TOOLS_PREAMBLE, *lines, GENERIC_TOOLS_RULE])
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> the tool's name
    for message in messages:
        item = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if message.get("tool_calls"):
            calls = [call["function"] for call in message["tool_calls"]]
            names.update({call["id"]: call["function"]["name"] for call in message["tool_calls"]})
            text = "\n".join(json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                             for c in calls)
            item["content"] = "\n".join(t for t in (message.get("content") or "", text) if t)
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            item = {"role": "user", "content": json.dumps({"tool_response": {
                "name": names.get(call_id, message.get("name", "")), "tool_call_id": call_id,
                "content": message.get("content", "")}}, ensure_ascii=False)}
        out.append(item)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out
