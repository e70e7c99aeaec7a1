"""OpenAI's `prompt_cache_options` through the real openai SDK against a real server: `ttl` leases the
whole prompt for 30 minutes or 12 hours (the implicit breakpoint), `mode: "explicit"` without breakpoints
uses no prompt caching (no hit, and nothing another request hits), `prewarm` computes and leases the
prompt with no output so the next request hits it, `prompt_cache_breakpoint` on a content part leases the
prompt up to that part's end (chat and Responses), the response echoes what was applied, and what kvserve
does not take (an unknown TTL, mode or key, five breakpoints, `kv_retention` beside them) is a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import on_engine

PAGE = 16
# over --min-cacheable-tokens (1,024): OpenAI's threshold too
LONG = ("The harbour master's ledger lists every boat that entered the bay: its name, its captain, its "
        "cargo of salt, timber or wool, and the hour of the tide. ") * 40


def leases(async_engine) -> dict[str, tuple[float, str, int]]:
    table = async_engine.engine.manager.leases
    return on_engine(async_engine, lambda: {i: (lease.ttl_s, lease.label, lease.num_tokens)
                                            for i, lease in table.leases.items()})


def new_leases(async_engine, before: dict) -> list[tuple[float, str, int]]:
    return [v for k, v in leases(async_engine).items() if k not in before]


@pytest.fixture(autouse=True)
def release_new_leases(async_engine):
    """Each test's leases end with it (1,400-token prompts: two would fill --max-leased-fraction)."""
    before = leases(async_engine)
    yield
    table = async_engine.engine.manager.leases
    on_engine(async_engine, lambda: [table.release(i) for i in list(table.leases) if i not in before])


@pytest.mark.parametrize(("ttl", "seconds"), [("30m", 1800.0), ("12h", 43200.0)])
def test_ttl_leases_the_whole_prompt(client, model_name, async_engine, ttl, seconds):
    before = leases(async_engine)
    resp = client.responses.create(model=model_name, input=ttl + LONG, max_output_tokens=2, store=False,
                                   prompt_cache_options={"ttl": ttl})
    assert resp.prompt_cache_options.ttl == ttl and resp.prompt_cache_options.mode == "implicit"
    assert new_leases(async_engine, before) == [(seconds, ttl, resp.usage.input_tokens)]


def test_chat_takes_the_options_too_and_without_them_leases_nothing(client, model_name, async_engine):
    before = leases(async_engine)
    messages = [{"role": "user", "content": "chat " + LONG}]
    client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert new_leases(async_engine, before) == []
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2,
                                          prompt_cache_options={"ttl": "30m"})
    assert new_leases(async_engine, before) == [(1800.0, "30m", chat.usage.prompt_tokens)]


def test_explicit_mode_without_breakpoints_uses_no_prompt_cache(client, model_name, async_engine):
    messages = [{"role": "user", "content": "explicit " + LONG}]
    before = leases(async_engine)
    runs = [client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0,
                                           prompt_cache_options={"mode": "explicit"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in runs] == [0, 0]
    assert new_leases(async_engine, before) == []
    implicit = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    # the explicit runs left nothing shared: at most the template's opening that every chat has is cached
    assert implicit.usage.prompt_tokens_details.cached_tokens <= 2 * PAGE
    again = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= (implicit.usage.prompt_tokens - 1) // PAGE * PAGE
    assert len({r.choices[0].message.content for r in [*runs, implicit, again]}) == 1


def test_prewarm_computes_the_prompt_and_outputs_nothing(client, model_name, async_engine):
    before = leases(async_engine)
    warm = client.responses.create(model=model_name, instructions="prewarm " + LONG, input="Who keeps the ledger?",
                                   max_output_tokens=8, temperature=0, prompt_cache_options={"prewarm": True})
    assert warm.status == "completed" and warm.output == [] and warm.output_text == ""
    assert warm.usage.output_tokens == 0 and warm.usage.total_tokens == warm.usage.input_tokens
    ttl_leases = [lease for lease in new_leases(async_engine, before) if lease[1] != "tool_call"]
    assert ttl_leases == [(1800.0, "30m", warm.usage.input_tokens)]  # (beside the stored response's hold)
    real = client.responses.create(model=model_name, instructions="prewarm " + LONG, input="Who keeps the ledger?",
                                   max_output_tokens=8, temperature=0)
    assert real.usage.input_tokens_details.cached_tokens >= (warm.usage.input_tokens - 1) // PAGE * PAGE
    assert real.output_text
    follow = client.responses.create(model=model_name, instructions="prewarm " + LONG, input="And the boats?",
                                     previous_response_id=warm.id, max_output_tokens=2)
    assert follow.usage.input_tokens > warm.usage.input_tokens  # the prewarmed turn, then the new one


BREAK = {"mode": "explicit"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "implicit"}}]}]}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "7d"}}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": str(k), "prompt_cache_breakpoint": BREAK} for k in range(5)]}]}, None),
    ("/v1/responses", {"input": "x", "prompt_cache_options": {"ttl": "7d"}}, "prompt_cache_options"),
    ("/v1/responses", {"input": "x", "prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_cache_options": {"prewarm": True}}, "prompt_cache_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "kv_retention": {"ttl": "5m"},
                              "prompt_cache_options": {"ttl": "30m"}}, None),
])
def test_what_kvserve_does_not_do_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json={**body, "max_tokens": 1} if "messages" in body else body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert (error["param"] or "").startswith(param) or error["message"].startswith(param), r.text
    else:
        assert "not both" in error["message"] or "at most 4" in error["message"], r.text


def test_the_sdk_types_the_echoed_options(client, model_name):
    resp = client.responses.create(model=model_name, input="Hi", max_output_tokens=1, store=False,
                                   prompt_cache_options={"mode": "explicit", "ttl": "12h"})
    assert isinstance(resp, openai.types.responses.Response)
    assert (resp.prompt_cache_options.mode, resp.prompt_cache_options.ttl) == ("explicit", "12h")
    assert resp.usage.input_tokens_details.cached_tokens == 0


def test_an_explicit_breakpoint_leases_the_prompt_up_to_its_part(client, model_name, async_engine):
    before = leases(async_engine)
    system = {"role": "system", "content": [{"type": "text", "text": "breakpoint " + LONG,
                                             "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]}
    first = client.chat.completions.create(model=model_name, max_tokens=2, prompt_cache_options={"mode": "explicit"},
                                           messages=[system, {"role": "user", "content": "Who keeps it?"}])
    [(ttl_s, label, num_tokens)] = new_leases(async_engine, before)  # the breakpoint's lease only
    assert (ttl_s, label) == (43200.0, "12h")
    # the system turn's text ends a few template tokens before the user's turn and the generation prompt
    assert first.usage.prompt_tokens - 20 < num_tokens < first.usage.prompt_tokens - 4
    other = client.chat.completions.create(model=model_name, max_tokens=2,
                                           messages=[system, {"role": "user", "content": "And the tides?"}])
    assert other.usage.prompt_tokens_details.cached_tokens >= num_tokens // PAGE * PAGE
    resp = client.responses.create(model=model_name, max_output_tokens=2, store=False, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "responses " + LONG,
                                      "prompt_cache_breakpoint": {"mode": "explicit"}},
                                     {"type": "input_text", "text": " Who keeps the ledger, and why?" * 4}]}])
    labels = sorted(lease[1] for lease in new_leases(async_engine, before))
    # its breakpoint (30m: the default ttl) and the implicit one, two pages and more past it
    assert labels == ["12h", "30m", "30m"]
    assert resp.usage.input_tokens > 1000
