"""A thinking model's reasoning apart from its answer: `reasoning_content` on /v1/chat/completions (whole and
streamed, the same texts), Ollama's `thinking` (and `think: false` reaching the template), and the splitter's
streamed pieces always adding up to the whole answer's split. The model thinks because a regex makes it write a
think block (the chat route), or because a DeepSeek-R1-style template opens one for it (the other routes)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.server.reasoning import ReasoningFormat, split
from tests.server.conftest import SMALL_ENGINE, ServerThread

# DeepSeek-R1's way, cut down: the generation prompt opens the think block (unless enable_thinking is false)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if not (enable_thinking is defined and enable_thinking is false) %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# a regex makes the model think (the template told not to open the block: under a constraint, only an output that
# opens it has reasoning)
UNOPENED = {"enable_thinking": False}
THINKS = {"structured_outputs": {"regex": "<think>\n[A-Za-z ]{4,24}\n</think>\n\n[A-Za-z ]{4,24}"},
          "chat_template_kwargs": UNOPENED}
PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<th", "</thi", "nk>", " ", "\n", "word", "a b"]),
                  max_size=12).map("".join)


@given(text=PIECES, cuts=st.lists(st.integers(0, 200), max_size=6), opened=st.booleans())
def test_streamed_pieces_add_up_to_the_whole_answers_split(text, cuts, opened):
    format_ = ReasoningFormat()
    tail = "<think>\n" if opened else "assistant\n"
    splitter, bounds = format_.splitter(tail), sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    streamed = ["", ""]
    for start, end in zip(bounds, bounds[1:]):
        for i, part in enumerate(splitter.update(text[start:end], finished=False)):
            streamed[i] += part
    for i, part in enumerate(splitter.update("", finished=True)):
        streamed[i] += part
    assert tuple(streamed) == split(format_, tail, text)


def test_the_splits_rules():
    format_ = ReasoningFormat()
    assert split(format_, "", "<think>\nHmm.\n</think>\n\nParis.") == ("Hmm.", "Paris.")
    assert split(format_, "<think>\n", "Hmm.\n</think>\n\nParis.") == ("Hmm.", "Paris.")  # opened by the prompt
    assert split(format_, "", " Paris, surely.") == ("", " Paris, surely.")  # no think block: all content
    assert split(format_, "<think>\n", "Still thinking") == ("Still thinking", "")  # cut before it closed
    streaming = format_.splitter("")
    assert streaming.update("<think>Hm", finished=False) == ("Hm", "")
    assert streaming.whole("<think>Hmm</think>Paris") == ("Hmm", "Paris")  # a whole answer leaves the stream be
    assert streaming.update("m</think>Paris", finished=True) == ("m", "Paris")


@pytest.fixture(scope="module")
def thinking_server():
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app

    engine = LLMEngine(EngineConfig(**SMALL_ENGINE, chat_template=TEMPLATE))
    with ServerThread(build_app(engine)) as running:
        yield running


def test_chat_gives_the_reasoning_apart_whole_and_streamed(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=ASK, max_tokens=40, temperature=0, extra_body=THINKS)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    thought, answer = whole.model_extra["reasoning_content"], whole.content
    assert thought and answer and "think>" not in thought + answer
    ids = httpx.post(thinking_server.url + "/tokenize", json={"messages": ASK, "chat_template_kwargs": UNOPENED},
                     timeout=60).json()["tokens"]
    raw = client.completions.create(model=model, prompt=ids, max_tokens=40, temperature=0,
                                    extra_body={"structured_outputs": THINKS["structured_outputs"]})
    assert raw.choices[0].text == f"<think>\n{thought}\n</think>\n\n{answer}"  # the same tokens, told apart
    through_close = client.completions.create(model=model, prompt=ids, max_tokens=40, temperature=0, logprobs=0,
                                              extra_body={"structured_outputs": THINKS["structured_outputs"]})
    pieces = through_close.choices[0].logprobs.tokens
    closed_at = next(k for k in range(1, len(pieces) + 1) if "</think>" in "".join(pieces[:k]))
    counted = client.chat.completions.create(**kwargs).usage.completion_tokens_details.reasoning_tokens
    assert counted == closed_at  # OpenAI's reasoning_tokens: the answer's tokens through the close marker
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for key in streamed:
            streamed[key] += (delta.model_extra.get(key) if key != "content" else delta.content) or "" if delta else ""
    assert streamed == {"reasoning_content": thought, "content": answer}
    # an output constraint decides the answer from its first token: the block the template opened is no
    # reasoning then, the JSON is the content
    constrained = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0,
                                                 response_format={"type": "json_object"}).choices[0].message
    assert constrained.content.lstrip().startswith("{") and "reasoning_content" not in constrained.model_extra


def test_ollama_gives_thinking_and_think_false_reaches_the_template(thinking_server, server):
    """(No regex on Ollama's API: unconstrained, the model never closes the block the template opened, so all of
    its answer is thinking, as on the OpenAI route.)"""
    import ollama

    client = ollama.Client(host=thinking_server.url)
    model = client.list().models[0].model
    options = {"temperature": 0, "num_predict": 24}
    body = {"model": model, "messages": ASK, "options": options, "stream": False, "think": True}
    answer = httpx.post(thinking_server.url + "/api/chat", json=body, timeout=120).json()
    openai_client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0)
    openai_answer = openai_client.chat.completions.create(model=openai_client.models.list().data[0].id, messages=ASK,
                                                          max_tokens=24, temperature=0).choices[0].message
    assert answer["message"]["thinking"] == openai_answer.model_extra["reasoning_content"] != ""
    assert answer["message"]["content"] == openai_answer.content == ""
    lines = [json.loads(line) for line in httpx.post(thinking_server.url + "/api/chat", json={
        **body, "stream": True}, timeout=120).text.splitlines()]
    assert "".join(e["message"].get("thinking", "") for e in lines) == answer["message"]["thinking"]
    plain = client.chat(model=model, messages=ASK, think=False, options=options)
    assert plain.message.thinking is None and plain.message.content
    assert plain.prompt_eval_count < answer["prompt_eval_count"]  # the template did not open the think block
    assert "thinking" in client.show(model).capabilities  # (Open WebUI offers its think switch on this)
    assert "thinking" not in ollama.Client(host=server.url).show(model).capabilities
    refused = httpx.post(server.url + "/api/chat", json={"model": model, "messages": ASK, "think": True}, timeout=60)
    assert refused.status_code == 400 and "does not think" in refused.text  # (the bundled template does not)


def test_responses_give_the_reasoning_as_a_reasoning_item(thinking_server):
    """The Responses API (the real openai client): a `reasoning` item whose reasoning_text is the chat route's
    reasoning_content, whole and from `response.reasoning_text.delta` events."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0).choices[0].message
    response = client.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=24, temperature=0)
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text == chat.model_extra["reasoning_content"]
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens  # (never closed)
    events = list(client.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=24,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [item.content[0].text]


def test_anthropic_gives_a_thinking_block_when_thinking_is_enabled(thinking_server):
    """The real anthropic client: with extended thinking, the reasoning is a thinking block (streamed as
    thinking_delta, then its signature_delta) equal to the chat route's reasoning_content; without it, the
    template is told not to think; a thinking block sent back is not rendered."""
    import anthropic

    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)
    model = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused").models.list().data[0].id
    chat = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused").chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0).choices[0].message
    thinking = {"type": "enabled", "budget_tokens": 1024}
    kwargs = dict(model=model, messages=ASK, max_tokens=24, extra_body={"temperature": 0})
    answer = client.messages.create(**kwargs, thinking=thinking)
    assert answer.content[0].type == "thinking"
    assert answer.content[0].thinking == chat.model_extra["reasoning_content"]
    with client.messages.stream(**kwargs, thinking=thinking) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == answer.content[0].thinking
    assert any(d.type == "signature_delta" for d in deltas)
    plain = client.messages.create(**kwargs)
    assert plain.content[0].type == "text"
    prompts = [client.messages.count_tokens(model=model, messages=ASK, **t).input_tokens
               for t in ({}, {"thinking": thinking})]
    assert prompts[0] < prompts[1]  # (without thinking, the template opens no think block)
    blocks = [answer.content[0].model_dump(), {"type": "text", "text": "Paris."}]
    sent_back = [*ASK, {"role": "assistant", "content": blocks}, {"role": "user", "content": "And of Spain?"}]
    text_only = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    counted = [client.messages.count_tokens(model=model, messages=m, thinking=thinking).input_tokens
               for m in (sent_back, text_only)]
    assert counted[0] == counted[1]
