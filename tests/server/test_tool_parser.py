"""The tool-call parser on the formats kvserve's model families write, whole and streamed."""

from __future__ import annotations

import json

import pytest

from kvserve.server.anthropic_blocks import BlockEvents
from kvserve.server.text_delta import TextDelta
from kvserve.server.tool_parser import ToolFormat, ToolStream, parse_output, tool_format

QWEN = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
QWEN_TWO = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": "}"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_format_from_the_template():
    assert tool_format("{{ '<tool_call>' }}") is ToolFormat.HERMES
    assert tool_format("<|python_tag|> ipython") is ToolFormat.LLAMA3
    assert tool_format("{{ messages }}") is ToolFormat.JSON
    assert tool_format(None) is ToolFormat.JSON


def test_qwen_call_with_content():
    out = parse_output(QWEN, ToolFormat.HERMES)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]})]


def test_qwen_parallel_calls():
    out = parse_output(QWEN_TWO, ToolFormat.HERMES)
    assert [c.name for c in out.calls] == ["a", "b"]
    assert json.loads(out.calls[1].arguments) == {"y": "}"}


def test_llama_json_and_python_tag():
    out = parse_output(LLAMA, ToolFormat.LLAMA3)
    assert out.content == "" and out.calls[0].name == "get_weather"
    assert json.loads(out.calls[0].arguments) == {"city": "Paris"}
    two = parse_output('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}', ToolFormat.LLAMA3)
    assert [c.name for c in two.calls] == ["a", "b"]


def test_json_fallback_object_and_list():
    out = parse_output('{"name": "f", "arguments": {"q": "x"}}', ToolFormat.JSON)
    assert out.calls[0].name == "f"
    listed = parse_output('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{\\"a\\": 1}"}]',
                          ToolFormat.JSON)
    assert [c.name for c in listed.calls] == ["f", "g"] and json.loads(listed.calls[1].arguments) == {"a": 1}


@pytest.mark.parametrize("text,fmt", [
    ("Paris is sunny.", ToolFormat.HERMES),
    ("Paris is sunny.", ToolFormat.JSON),
    ('{"answer": 42}', ToolFormat.JSON),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1\n</tool_call>', ToolFormat.HERMES),
    ('{"name": "f", "arguments": {"x": ', ToolFormat.JSON),
])
def test_not_a_call_stays_content(text, fmt):
    out = parse_output(text, fmt)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("text,fmt", [(QWEN, ToolFormat.HERMES), (QWEN_TWO, ToolFormat.HERMES),
                                      (LLAMA, ToolFormat.LLAMA3),
                                      ('{"name": "f", "arguments": {"q": "}}"}}', ToolFormat.JSON),
                                      ("plain answer <tool", ToolFormat.HERMES)])
def test_streamed_pieces_add_up_to_the_whole(text, fmt):
    """Fed one character at a time, the deltas sum to the parsed answer; nothing is resent."""
    stream = ToolStream(fmt)
    content, names, args = "", [], []
    for end in range(1, len(text) + 1):
        piece, deltas = stream.update(text[:end], end == len(text))
        content += piece
        for d in deltas:
            if d.name is not None:
                names.append(d.name)
                args.append("")
            args[d.index] += d.arguments
    whole = parse_output(text, fmt)
    assert content.strip() == whole.content.strip()
    assert names == [c.name for c in whole.calls]
    assert args == [c.arguments for c in whole.calls]


def test_a_character_still_arriving_is_not_streamed_as_u_fffd():
    """Detokenized mid-character, the text ends in U+FFFD until the character's last byte comes: an
    Anthropic stream's tool arguments are read from what TextDelta lets out, so the arguments
    streamed are the final ones (cut at the U+FFFD, nothing was ever resent)."""
    final = '<tool_call>\n{"name": "f", "arguments": {"city": "Pari\u03f3"}}\n</tool_call>'
    cut = final.index("\u03f3")
    texts = [final[:cut], final[:cut] + "\ufffd", final[:cut + 1], final[:cut + 2], final]
    blocks, args = BlockEvents(ToolFormat.HERMES, True, TextDelta(None)), ""
    for i, text in enumerate(texts):
        for _, event in blocks.update(text, i == len(texts) - 1):
            if event.get("delta", {}).get("type") == "input_json_delta":
                args += event["delta"]["partial_json"]
    assert json.loads(args) == {"city": "Pari\u03f3"}


def test_stream_of_one_call_only_when_not_parallel():
    stream = ToolStream(ToolFormat.HERMES, parallel=False)
    _, deltas = stream.update(QWEN_TWO, True)
    assert {d.index for d in deltas} == {0}
