"""Forced tool calls in the grammar (issue 26): `tool_choice: "required"` with `parallel_tool_calls:
true` accepts one or more calls in the model's own format (Hermes blocks one per line, JSON objects one
per line); without it, for a named function, or in Llama 3.x's format, exactly one."""

from __future__ import annotations

import json

import pytest

from kvserve.server.tool_grammar import forced_call
from kvserve.server.tool_parser import CLOSE, OPEN, ToolFormat, parse_output
from kvserve.server.tool_protocol import ToolChoice, ToolSet, template_tool

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (template_tool("get_weather", None, CITY), template_tool("get_time", None, CITY))


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from tests.model.tiny_models import make_hf_model, write_gguf

    path = write_gguf(make_hf_model("qwen2"), "qwen2", tmp_path_factory.mktemp("qwen") / "q.gguf")
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=512, dtype="float32"))
    return engine.grammar_compiler(), engine.tokenizer


def calls_text(fmt: ToolFormat, names: list[str]) -> str:
    objects = [json.dumps({"name": n, "arguments": {"city": "Paris"}}, separators=(",", ":")) for n in names]
    if fmt is ToolFormat.HERMES:
        objects = [f"{OPEN}\n{o}\n{CLOSE}" for o in objects]
    return "\n".join(objects)


def accepted(compiler, choice: ToolChoice, fmt: ToolFormat, text: str) -> bool:
    """The whole text is allowed by the forced call's grammar, and the grammar may end after it."""
    grammar, tokenizer = compiler
    state = grammar.compile(forced_call(ToolSet(TOOLS, choice), fmt)).new_state()
    return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False).ids) and state.is_accepting


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.JSON])
def test_required_with_parallel_calls_takes_one_or_more_calls(compiler, fmt):
    parallel = ToolChoice("required", None, True, True)
    one, two = calls_text(fmt, ["get_weather"]), calls_text(fmt, ["get_weather", "get_time"])
    assert accepted(compiler, parallel, fmt, one) and accepted(compiler, parallel, fmt, two)
    assert [c.name for c in parse_output(two, fmt).calls] == ["get_weather", "get_time"]  # read back as two
    for single in (ToolChoice("required", None, False), ToolChoice("required", None, True)):  # not asked for
        assert accepted(compiler, single, fmt, one) and not accepted(compiler, single, fmt, two)
    named = ToolChoice("named", "get_weather", True, True)
    assert not accepted(compiler, named, fmt, calls_text(fmt, ["get_weather"] * 2))
    assert not accepted(compiler, parallel, fmt, calls_text(fmt, ["get_weather", "unknown"]))


def test_llama3_format_stays_one_call(compiler):
    fmt, parallel = ToolFormat.LLAMA3, ToolChoice("required", None, True, True)
    assert accepted(compiler, parallel, fmt, calls_text(fmt, ["get_time"]))
    assert not accepted(compiler, parallel, fmt, calls_text(fmt, ["get_time", "get_weather"]))
