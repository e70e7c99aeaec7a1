"""Generated: on every API family's generation route (OpenAI's completions and chat, Anthropic, Ollama,
llama.cpp, Responses), a streamed answer adds up to the whole one. For any stop list (empty strings,
overlapping and repeated ones, strings the output holds), any token limit, greedy or seeded sampling, on
OpenAI's routes n choices and logprobs, and logprobs on Ollama's, llama.cpp's and Responses, the streamed
pieces join to the same text (and logprobs), the stream ends with the same finish (and stop string) as the
whole answer, no error event comes, and no page stays in use afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import wait_no_pages_in_use

QUESTION = [{"role": "user", "content": "List three colours, one per line."}]
# pieces the bundled model's answers often hold, so that stop strings do fire; "" and repeats on purpose
STOP_PIECES = st.sampled_from(["", " ", "\n", "e", "the", ",", "1", ". ", "Red", "ue", "a b", "é"])


def sse_data(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def finish_of_openai(choice: dict) -> tuple:
    return choice["finish_reason"], choice.get("stop_reason")


def logprob_tokens(choice: dict, chat: bool) -> list:
    """The sampled tokens' logprobs a choice (or one chunk of it) carries, in order."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return []
    if chat:
        return [(t["token"], round(t["logprob"], 4)) for t in logprobs["content"]]
    return [(t, round(v, 4)) for t, v in zip(logprobs["tokens"], logprobs["token_logprobs"])]


def read_openai(whole: dict, lines: list[str], chat: bool) -> tuple[list, list]:
    """Per choice index: (text, finish, logprobs), whole and streamed."""
    key = "content" if chat else "text"
    events = sse_data(lines)
    assert lines[-1] == "data: [DONE]" and not any("error" in e for e in events), lines[-3:]
    streamed = []
    for index in range(len(whole["choices"])):
        pieces = [c for e in events for c in e["choices"] if c["index"] == index]
        text = "".join((c["delta"].get(key) or "") if chat else c[key] for c in pieces)
        last = [c for c in pieces if c["finish_reason"]]
        assert len(last) == 1
        streamed.append((text, finish_of_openai(last[0]), [t for c in pieces for t in logprob_tokens(c, chat)]))
    expected = []
    for choice in sorted(whole["choices"], key=lambda c: c["index"]):
        message = choice["message"] if chat else choice
        expected.append((message[key] or "", finish_of_openai(choice), logprob_tokens(choice, chat)))
    return expected, streamed


def read_anthropic(whole: dict, lines: list[str]) -> tuple[tuple, tuple]:
    events = sse_data(lines)
    assert [e["type"] for e in events][-1] == "message_stop" and not any(e["type"] == "error" for e in events)
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    delta = next(e for e in events if e["type"] == "message_delta")["delta"]
    whole_text = "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    return ((whole_text, (whole["stop_reason"], whole["stop_sequence"])),
            (text, (delta["stop_reason"], delta["stop_sequence"])))


def read_ollama(whole: dict, lines: list[str]) -> tuple[tuple, tuple]:
    parts = [json.loads(line) for line in lines]
    assert parts[-1]["done"] and not any("error" in p for p in parts)
    streamed_logprobs = [e for p in parts for e in p.get("logprobs", [])]
    return ((whole["response"], whole["done_reason"], whole.get("logprobs", [])),
            ("".join(p["response"] for p in parts), parts[-1]["done_reason"], streamed_logprobs))


def read_llamacpp(whole: dict, lines: list[str]) -> tuple[tuple, tuple]:
    events = sse_data(lines)
    assert events[-1]["stop"] is True and not any("error" in e for e in events)
    def finish(e: dict) -> tuple:
        return e["stop_type"], e["stopping_word"]

    def probs(entries: list[dict]) -> list:  # (n_probs: each token's id and logprob, and its alternatives' ids)
        return [(p["id"], round(p["logprob"], 4), [t["id"] for t in p["top_logprobs"]]) for p in entries]
    streamed_probs = probs([p for e in events for p in e.get("completion_probabilities", [])])
    return ((whole["content"], finish(whole), probs(whole.get("completion_probabilities", []))),
            ("".join(e["content"] for e in events), finish(events[-1]), streamed_probs))


def read_responses(whole: dict, lines: list[str]) -> tuple[tuple, tuple]:
    events = sse_data(lines)
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]["type"]
    assert not any(e["type"] in ("error", "response.failed") for e in events)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    text, logprobs = "".join(e["delta"] for e in deltas), [p for e in deltas for p in e["logprobs"]]

    def answer(response: dict) -> tuple:
        parts = [c for item in response["output"] if item["type"] == "message"
                 for c in item["content"] if c["type"] == "output_text"]
        return ("".join(c["text"] for c in parts), [p for c in parts for p in c.get("logprobs", [])],
                response["status"], response["incomplete_details"])
    final = answer(events[-1]["response"])
    whole_answer = answer(whole)
    assert final[:2] == (text, logprobs)  # the final event's response holds what the deltas sent
    return whole_answer[2:] + whole_answer[:2], final[2:] + (text, logprobs)


def request(family: str, stop: list[str], max_tokens: int, sampling: dict, n: int, logprobs: bool
            ) -> tuple[str, dict]:
    if family == "completions":
        return "/v1/completions", {"prompt": "Colours: red, green,", "stop": stop, "max_tokens": max_tokens, "n": n,
                                   **({"logprobs": 2} if logprobs else {}), **sampling}
    if family == "chat":
        return "/v1/chat/completions", {"messages": QUESTION, "stop": stop, "max_tokens": max_tokens, "n": n,
                                        **({"logprobs": True, "top_logprobs": 2} if logprobs else {}), **sampling}
    if family == "anthropic":
        return "/v1/messages", {"messages": QUESTION, "stop_sequences": stop, "max_tokens": max_tokens, **sampling}
    if family == "ollama":
        return "/api/generate", {"prompt": "List three colours.", "options": {"stop": stop, "num_predict": max_tokens,
                                 **sampling}, **({"logprobs": True, "top_logprobs": 2} if logprobs else {})}
    if family == "responses":  # (no stop strings in the Responses API)
        included = {"include": ["message.output_text.logprobs"], "top_logprobs": 2} if logprobs else {}
        return "/v1/responses", {"input": "List three colours.", "max_output_tokens": max_tokens, **sampling,
                                 **included}
    return "/completion", {"prompt": "Colours: red, green,", "stop": stop, "n_predict": max_tokens,
                           **({"n_probs": 2} if logprobs else {}), **sampling}


READERS = {"completions": lambda w, s: read_openai(w, s, False), "chat": lambda w, s: read_openai(w, s, True),
           "anthropic": read_anthropic, "ollama": read_ollama, "llamacpp": read_llamacpp, "responses": read_responses}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(sorted(READERS)), stop=st.lists(STOP_PIECES, max_size=4),
       max_tokens=st.integers(1, 24), seed=st.none() | st.integers(0, 2**31 - 1),
       n=st.integers(1, 3), logprobs=st.booleans())
def test_a_stream_adds_up_to_the_whole_answer(server, model_name, async_engine, family, stop, max_tokens, seed, n,
                                              logprobs):
    """(n on OpenAI's chat and completions, and logprobs on every route but Anthropic's: each choice's text,
    finish and sampled tokens' logprobs)"""
    # (Anthropic's and the Responses API have no seed: their sampled answers are not reproducible, so they
    # run greedy)
    seeded = seed is not None and family not in ("anthropic", "responses")
    sampling = {"temperature": 0.9, "seed": seed} if seeded else {"temperature": 0}
    path, body = request(family, stop, max_tokens, sampling, n if seeded else 1, logprobs)
    body["model"] = model_name
    with httpx.Client(base_url=server.url, timeout=120) as http:
        whole = http.post(path, json={**body, "stream": False})
        assert whole.status_code == 200, whole.text
        with http.stream("POST", path, json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.strip()]
    expected, got = READERS[family](whole.json(), lines)
    assert got == expected
    wait_no_pages_in_use(async_engine)
