"""The real `anthropic` SDK against a kvserve server: /v1/messages text, usage and Anthropic's stream
event sequence; errors in Anthropic's shape; x-api-key tenants; cache_control breakpoints (exact
prefix token counts, leases: first call writes, second reads); cache diagnostics over HTTP."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from kvserve.model.tokenizer import Encoded
from kvserve.server.anthropic import Pending, stop_reason, usage
from kvserve.server.anthropic_protocol import MessagesRequest, parse_chat
from kvserve.server.breakpoints import SYSTEM, ChatRenderer, RenderedChat, Turn
from kvserve.server.protocol import APIError
from tests.server.conftest import ServerThread, on_engine

GREEDY = {"temperature": 0.0}


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def keyed_server(async_engine):
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, api_keys=["key-a", "key-b"])) as running:
        yield running


def handbook(tokens_about: int = 1500) -> str:
    """A system prompt of roughly `tokens_about` tokens, unique to this call (a cold cache)."""
    rules = ["Refrigerated containers are checked every fifteen minutes.",
             "Every deviation from the delivery window is recorded in the tracking system.",
             "Visitors sign in at the gate and wear a high-visibility vest on the docks.",
             "Customs paperwork is filed before the vessel leaves the berth."]
    lines = [f"Rule {i + 1}: {rules[i % len(rules)]}" for i in range(tokens_about // 15)]
    return f"Harbour handbook, edition {uuid.uuid4().hex}.\n" + "\n".join(lines)


def rendered_tokens(async_engine, system: str | None, messages: list[dict]) -> list[int]:
    chat = ([{"role": "system", "content": system}] if system is not None else []) + messages
    text = async_engine.engine.chat_prompt(chat)
    return async_engine.engine.tokenizer.encode(text, add_special_tokens=False).ids


def tokens_through(async_engine, system: str | None, messages: list[dict], needle: str) -> int:
    """Prompt tokens up to the end of `needle` (a unique text) in the rendered prompt, found by
    search, independently of breakpoints.py; checked to be a prefix of the prompt's tokens."""
    chat = ([{"role": "system", "content": system}] if system is not None else []) + messages
    text = async_engine.engine.chat_prompt(chat)
    end = text.index(needle) + len(needle)
    encode = async_engine.engine.tokenizer.encode
    prefix = encode(text[:end], add_special_tokens=False).ids
    assert encode(text, add_special_tokens=False).ids[:len(prefix)] == prefix
    return len(prefix)


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def release_leases(async_engine, *responses) -> None:
    """Leases outlive a test; give them back so that the pool is idle for the next one."""
    for response in responses:
        lease = (response.model_extra or {}).get("cache_lease") or {}
        for lease_id in lease.get("lease_ids") or []:
            on_engine(async_engine, lambda i=lease_id: async_engine.engine.release_lease("", i))


# -- messages, streaming, errors -------------------------------------------------------------------
def test_message_reports_text_and_anthropic_usage(claude, model_name, async_engine):
    messages = [{"role": "user", "content": "Name two planets."}]
    out = claude.messages.create(model=model_name, max_tokens=10, system="You are terse.",
                                 messages=messages, extra_body=GREEDY)
    assert isinstance(out, anthropic.types.Message)
    assert out.id.startswith("msg_") and out.role == "assistant" and out.model == model_name
    assert out.content[0].type == "text" and out.content[0].text.strip()
    assert out.stop_reason in ("end_turn", "max_tokens") and out.diagnostics is None
    assert total_input(out.usage) == len(rendered_tokens(async_engine, "You are terse.", messages))
    assert out.usage.cache_creation_input_tokens == 0  # no cache_control: nothing leased
    assert out.usage.cache_creation.ephemeral_5m_input_tokens == 0
    assert 1 <= out.usage.output_tokens <= 10
    assert (out.stop_reason == "max_tokens") == (out.usage.output_tokens == 10)


def test_stream_sends_the_event_sequence_and_the_same_text(claude, model_name):
    kwargs = dict(model=model_name, max_tokens=16, system="You are terse.", extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Write a list of three colours."}])
    whole = claude.messages.create(**kwargs)
    events = list(claude.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason
    assert delta.usage.output_tokens == whole.usage.output_tokens
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == total_input(whole.usage)
    with claude.messages.stream(**kwargs) as stream:  # the SDK's own accumulation
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_system_as_text_blocks_renders_like_the_string(claude, model_name):
    kwargs = dict(model=model_name, max_tokens=8, extra_body=GREEDY,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    plain = claude.messages.create(system="You are terse.", **kwargs)
    blocks = claude.messages.create(system=[{"type": "text", "text": "You are terse."}], **kwargs)
    assert blocks.content[0].text == plain.content[0].text
    assert total_input(blocks.usage) == total_input(plain.usage)


def test_stop_sequence_cuts_the_text_and_is_reported(claude, model_name):
    kwargs = dict(model=model_name, max_tokens=24, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Count from one to ten in words."}])
    free = claude.messages.create(**kwargs).content[0].text
    word = free.split()[2]
    cut = claude.messages.create(stop_sequences=[word], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == free[:free.index(word)]


def test_count_tokens_counts_the_rendered_prompt(claude, model_name, async_engine):
    messages = [{"role": "user", "content": "Name two planets."}]
    counted = claude.messages.count_tokens(model=model_name, system="You are terse.", messages=messages)
    assert counted.input_tokens == len(rendered_tokens(async_engine, "You are terse.", messages))
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=model_name, messages=[])


def test_max_tokens_zero_fills_the_cache_without_output(claude, model_name):
    out = claude.messages.create(model=model_name, max_tokens=0,
                                 messages=[{"role": "user", "content": "Warm me up."}])
    assert out.content == [] and out.usage.output_tokens == 0 and out.stop_reason == "max_tokens"
    events = list(claude.messages.create(model=model_name, max_tokens=0, stream=True,
                                         messages=[{"role": "user", "content": "Warm me up."}]))
    assert [e.type for e in events] == ["message_start", "message_delta", "message_stop"]


def test_a_final_assistant_turn_is_continued(claude, model_name, async_engine):
    messages = [{"role": "user", "content": "Spell the word cat."},
                {"role": "assistant", "content": "The letters are"}]
    out = claude.messages.create(model=model_name, max_tokens=6, messages=messages, extra_body=GREEDY)
    text = async_engine.engine.chat_prompt(messages[:1]) + "The letters are"
    expected = async_engine.engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert total_input(out.usage) == len(expected)


@pytest.mark.parametrize("patch, message", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{"name": "t"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "t", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "u"}}, "tool_choice"),
    ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "ttl"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]}]},
     "A maximum of 4 blocks with cache_control"),
    ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
     "must not come after"),
])
def test_bad_input_is_anthropics_400(server, model_name, patch, message):
    body = {"model": model_name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            **patch}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_errors_reach_the_sdk_as_its_exceptions(claude, server, model_name):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-unknown", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="too long"):
        claude.messages.create(model=model_name, max_tokens=4,
                               messages=[{"role": "user", "content": "word " * 3000}])
    response = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=60)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_x_api_key_is_accepted_like_the_bearer_key(keyed_server, model_name):
    kwargs = dict(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    by_header = anthropic.Anthropic(base_url=keyed_server.url, api_key=None, max_retries=0,
                                    default_headers={"x-api-key": "key-a"})
    assert by_header.messages.create(**kwargs).content
    bearer = anthropic.Anthropic(base_url=keyed_server.url, api_key="key-a", max_retries=0)
    assert bearer.messages.create(**kwargs).content
    wrong = anthropic.Anthropic(base_url=keyed_server.url, api_key=None, max_retries=0,
                                default_headers={"x-api-key": "key-z"})
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(**kwargs)
    assert err.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": err.value.body["error"]["message"]}}
    openai_client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="unused", max_retries=0,
                                  default_headers={"x-api-key": "key-b"})
    assert openai_client.models.list().data  # the OpenAI endpoints take it too


# -- cache diagnostics -----------------------------------------------------------------------------
def test_diagnostics_name_the_change_that_missed_the_cache(claude, model_name, keyed_server):
    system = handbook(300)
    base = [{"role": "user", "content": "Where is berth 4?"},
            {"role": "assistant", "content": "North quay."},
            {"role": "user", "content": "And berth 5?"}]
    kwargs = dict(model=model_name, max_tokens=1)
    first = claude.messages.create(system=system, messages=base, diagnostics={"previous_message_id": None},
                                   **kwargs)
    assert first.diagnostics is None
    prompt = total_input(first.usage)
    more = [*base, {"role": "assistant", "content": "South quay."}, {"role": "user", "content": "Thanks."}]
    appended = claude.messages.create(system=system, messages=more,
                                      diagnostics={"previous_message_id": first.id}, **kwargs)
    assert appended.diagnostics is None  # only turns appended: nothing missed
    changed = claude.messages.create(system=system + " Revised.", messages=base,
                                     diagnostics={"previous_message_id": first.id}, **kwargs)
    reason = changed.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.CacheMissSystemChanged)
    assert prompt - 10 <= reason.cache_missed_input_tokens <= prompt
    edited = [base[0], {"role": "assistant", "content": "South quay."}, base[2]]
    moved = claude.messages.create(system=system, messages=edited,
                                   diagnostics={"previous_message_id": first.id}, **kwargs)
    reason = moved.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.CacheMissMessagesChanged)
    assert 0 < reason.cache_missed_input_tokens < 30  # the tokens after message 0
    unknown = claude.messages.create(system=system, messages=base,
                                     diagnostics={"previous_message_id": "msg_unknown"}, **kwargs)
    assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    other_tenant = anthropic.Anthropic(base_url=keyed_server.url, api_key="key-b", max_retries=0)
    elsewhere = other_tenant.messages.create(system=system, messages=base,
                                             diagnostics={"previous_message_id": first.id}, **kwargs)
    assert isinstance(elsewhere.diagnostics.cache_miss_reason,
                      anthropic.types.CacheMissPreviousMessageNotFound)


# -- breakpoints: where a block ends, in prompt tokens ---------------------------------------------
def test_breakpoint_offsets_end_exactly_at_the_system_block_and_at_a_message_end(async_engine):
    llm = async_engine.engine
    renderer = ChatRenderer(llm.chat_prompt, llm.loaded.encode_with_ends)
    system, question = handbook(200), "Which rule covers visitors?"
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 1,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Context follows.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": question, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}]})
    chat = parse_chat(request)
    rendered = renderer.render(chat.system, chat.turns)
    offsets = renderer.token_offsets(chat.system, chat.turns, rendered, [b.ref for b in chat.breakpoints])
    user = [{"role": "user", "content": "Context follows.\n" + question}]
    assert rendered.token_ids == rendered_tokens(async_engine, system, user)
    assert offsets[0] == tokens_through(async_engine, system, user, system)
    assert offsets[2] == tokens_through(async_engine, system, user, question)
    # inside a message the count may stop one token early (a token may span "\n"), never late
    mid = tokens_through(async_engine, system, user, "Context follows.")
    assert mid - 1 <= offsets[1] <= mid


def char_encode(text: str) -> Encoded:
    """A stand-in tokenizer: one token per character."""
    return Encoded([ord(c) for c in text], known_ends=[i + 1 for i in range(len(text))])


def test_a_template_that_rewrites_text_cannot_place_breakpoints():
    def clipping(messages):
        return "".join(f"[{m['role']}]{m['content'][:5]}" for m in messages) + "[assistant]"

    def verbatim(messages):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    system, turns = Turn("system", ["be brief"]), [Turn("user", ["hi", "there"])]
    loud = ChatRenderer(clipping, char_encode)
    with pytest.raises(APIError, match="verbatim"):
        loud.token_offsets(system, turns, loud.render(system, turns), [(SYSTEM, 0)])
    plain = ChatRenderer(verbatim, char_encode)
    chat = plain.render(system, turns)
    assert plain.token_offsets(system, turns, chat, [(0, 0), (SYSTEM, 0), (0, 1)]) == [
        len("[system]be brief[user]hi"), len("[system]be brief"), len("[system]be brief[user]hi\nthere")]


def test_tokens_before_counts_only_the_leading_run():
    # byte-level BPE can give overlapping spans; the count stops at the first token past the point
    chat = RenderedChat("abcde", [1, 2, 3, 4], [2, 4, 3, 5], is_sorted=False)
    assert [chat.tokens_before(p) for p in (1, 2, 3, 4, 5)] == [0, 1, 1, 3, 4]
    assert RenderedChat("abc", [1, 2], [1, 3], is_sorted=True).tokens_before(2) == 1


def test_top_level_cache_control_marks_the_last_block():
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 1, "cache_control": {"type": "ephemeral", "ttl": "1h"},
        "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
            {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]})
    chat = parse_chat(request)
    assert [(b.ref, b.ttl) for b in chat.breakpoints] == [((0, 2), "1h")]  # merged into one turn
    assert chat.turns[0].text == "a\nb\nc"


# -- usage arithmetic, with a stand-in for the engine's LeaseUsage ---------------------------------
def output_with(num_cached: int, lease=None, num_output: int = 3):
    completion = SimpleNamespace(token_ids=list(range(num_output)), text="abc", finish_reason="length",
                                 stop_reason=None)
    return SimpleNamespace(outputs=[completion], num_cached_tokens=num_cached, lease_usage=lease)


def pending(num_prompt: int, **kw) -> Pending:
    return Pending(**{**dict(id="msg_x", model="m", num_prompt_tokens=num_prompt, stop_sequences=[],
                             is_prewarm=False, is_clamped=False, leases_asked=True, diagnostics=None),
                      **kw})


def test_usage_splits_the_prompt_into_input_written_and_read():
    lease = SimpleNamespace(cache_read_tokens=1024, cache_creation_tokens={"5m": 0, "1h": 512},
                            refused=None, lease_ids=["l1", "l2"])
    got = usage(pending(1600), output_with(1040, lease))
    assert got == {"input_tokens": 64, "cache_creation_input_tokens": 512, "cache_read_input_tokens": 1024,
                   "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 512},
                   "output_tokens": 3}
    # without leases, read is what the prefix cache served; nothing is written
    plain = usage(pending(1600, leases_asked=False), output_with(1040))
    assert (plain["input_tokens"], plain["cache_read_input_tokens"]) == (560, 1040)
    assert plain["cache_creation_input_tokens"] == 0
    # never more than the prompt, whatever the engine says
    greedy = SimpleNamespace(cache_read_tokens=90, cache_creation_tokens={"5m": 50}, refused=None,
                             lease_ids=[])
    capped = usage(pending(100), output_with(0, greedy))
    assert (capped["input_tokens"], capped["cache_creation_input_tokens"]) == (0, 10)


def test_stop_reasons():
    out = output_with(0)
    assert stop_reason(pending(5), out) == ("max_tokens", None)
    assert stop_reason(pending(5, is_clamped=True), out) == ("model_context_window_exceeded", None)
    out.outputs[0].finish_reason = "stop"
    assert stop_reason(pending(5), out) == ("end_turn", None)  # EOS
    out.outputs[0].stop_reason = "STOP"  # the engine's: the stop string it cut the text at
    assert stop_reason(pending(5, stop_sequences=["X", "STOP"]), out) == ("stop_sequence", "STOP")
    assert stop_reason(pending(5, is_prewarm=True), out) == ("max_tokens", None)


# -- leases (need the engine's lease contract) ------------------------------------------------------
def test_a_cached_system_block_is_written_once_then_read(claude, model_name, async_engine):
    system = handbook(1500)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    ask = lambda q, **kw: claude.messages.create(  # noqa: E731
        model=model_name, max_tokens=8, system=blocks, extra_body=GREEDY,
        messages=[{"role": "user", "content": q}], **kw)
    first, second = ask("Which rule covers visitors?"), ask("Which rule covers customs?")
    user = [{"role": "user", "content": "Which rule covers visitors?"}]
    prefix = tokens_through(async_engine, system, user, system)
    assert prefix > 1024
    try:
        assert first.usage.cache_creation_input_tokens == prefix
        assert first.usage.cache_creation.ephemeral_5m_input_tokens == prefix
        assert first.usage.cache_read_input_tokens == 0
        assert second.usage.cache_read_input_tokens == prefix
        assert second.usage.cache_creation_input_tokens == 0
        for out, q in ((first, "Which rule covers visitors?"), (second, "Which rule covers customs?")):
            assert total_input(out.usage) == len(rendered_tokens(
                async_engine, system, [{"role": "user", "content": q}]))
        events = list(ask("Which rule covers customs?", stream=True))
        start, delta = events[0], events[-2]
        release_leases(async_engine, delta)
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
            second.content[0].text
        assert delta.usage.cache_read_input_tokens == prefix
        assert delta.usage.cache_creation_input_tokens == 0
        assert start.message.usage.cache_creation.ephemeral_5m_input_tokens == 0
    finally:
        release_leases(async_engine, first, second)


def test_top_level_cache_control_leases_through_the_last_message(claude, model_name, async_engine):
    question = handbook(1200)
    out = claude.messages.create(model=model_name, max_tokens=2, cache_control={"type": "ephemeral",
                                                                                 "ttl": "1h"},
                                 messages=[{"role": "user", "content": question}])
    try:
        expected = tokens_through(async_engine, None, [{"role": "user", "content": question}], question)
        assert out.usage.cache_creation.ephemeral_1h_input_tokens == expected
        assert out.usage.cache_creation_input_tokens == expected
    finally:
        release_leases(async_engine, out)


def test_a_prefix_under_the_minimum_gets_no_lease(claude, model_name, async_engine):
    out = claude.messages.create(
        model=model_name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
        system=[{"type": "text", "text": "Short.", "cache_control": {"type": "ephemeral"}}])
    release_leases(async_engine, out)
    assert out.usage.cache_creation_input_tokens == 0
    assert out.model_extra["cache_lease"]["refused"] == "below_min_cacheable"
    assert out.model_extra["cache_lease"]["lease_ids"] == []


def test_kv_retention_reaches_the_engine_from_the_openai_endpoints(client, model_name, async_engine):
    # a prompt under the minimum: the lease is asked for and refused, so no lease outlives the test
    for ttl in ("5m", "1h"):
        out = client.chat.completions.create(model=model_name, max_tokens=2, extra_body={
            "kv_retention": {"ttl": ttl}}, messages=[{"role": "user", "content": "Hi"}])
        assert out.usage.prompt_tokens > 0
        out = client.completions.create(model=model_name, max_tokens=2, prompt="Hello", n=2,
                                        extra_body={"kv_retention": {"ttl": ttl}})
        assert len(out.choices) == 2
    on_engine(async_engine, async_engine.engine.manager.check_invariants)


def test_kv_retention_with_a_bad_ttl_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError, match="kv_retention"):
        client.chat.completions.create(model=model_name, max_tokens=2,
                                       extra_body={"kv_retention": {"ttl": "2h"}},
                                       messages=[{"role": "user", "content": "Hi"}])


def test_cache_salt_isolates_the_prefix_as_on_the_openai_routes(claude, model_name):
    system = "You are a careful archivist of maps and letters. " * 30
    ask = dict(model=model_name, max_tokens=1, system=system, messages=[{"role": "user", "content": "Hi"}])
    first = claude.messages.create(**ask, extra_body={"cache_salt": "tenant-one"})
    same = claude.messages.create(**ask, extra_body={"cache_salt": "tenant-one"})
    other = claude.messages.create(**ask, extra_body={"cache_salt": "tenant-two"})
    assert first.usage.input_tokens > 300 and same.usage.cache_read_input_tokens > 300
    assert other.usage.cache_read_input_tokens == 0
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(**ask, extra_body={"cache_salt": ""})
