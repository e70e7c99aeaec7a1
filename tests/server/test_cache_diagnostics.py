"""Cache diagnostics, pure Python: which change made a prompt miss the previous one's cached prefix,
how many cached tokens that cost, and a bounded per-tenant store of fingerprints."""

from __future__ import annotations

import pytest

from kvserve.server.cache_diagnostics import DiagnosticsStore, cache_miss_reason, fingerprint

SYSTEM = "You are a harbour pilot."
MESSAGES = [("user", "Where is berth 4?"), ("assistant", "North quay."), ("user", "And berth 5?")]


def fp(model="m", tools=(), system=SYSTEM, messages=MESSAGES, cacheable=1500, other=None):
    # tokens: system ends at 1000, then 100 tokens per message
    ends = [1000 + 100 * (i + 1) for i in range(len(messages))]
    return fingerprint(model, list(tools), system, list(messages), 1000, ends, cacheable, other)


def test_an_appended_turn_is_no_miss():
    assert cache_miss_reason(fp(messages=MESSAGES[:2]), fp()) is None
    assert cache_miss_reason(fp(), fp()) is None


def test_changes_are_reported_in_prefix_order_model_tools_system_messages():
    assert cache_miss_reason(fp(), fp(model="other", system="x")) == {
        "type": "model_changed", "cache_missed_input_tokens": 1500}
    assert cache_miss_reason(fp(), fp(tools=[{"name": "t"}], system="x"))["type"] == "tools_changed"
    assert cache_miss_reason(fp(), fp(system="You are a tug master.")) == {
        "type": "system_changed", "cache_missed_input_tokens": 1500}


def test_a_changed_earlier_message_misses_the_cached_tokens_after_it():
    edited = [MESSAGES[0], ("assistant", "South quay."), MESSAGES[2]]
    # the previous request cached 1500 tokens; the first 1100 (system + message 0) still match
    assert cache_miss_reason(fp(), fp(messages=edited)) == {
        "type": "messages_changed", "cache_missed_input_tokens": 400}
    first = [("user", "Where is berth 9?"), *MESSAGES[1:]]
    assert cache_miss_reason(fp(), fp(messages=first))["cache_missed_input_tokens"] == 500


def test_missed_tokens_never_go_below_zero():
    edited = [*MESSAGES[:2], ("user", "Changed.")]
    assert cache_miss_reason(fp(cacheable=1050), fp(messages=edited)) == {
        "type": "messages_changed", "cache_missed_input_tokens": 0}


def test_unknown_previous_and_other_parameters():
    assert cache_miss_reason(None, fp()) == {"type": "previous_message_not_found"}
    assert cache_miss_reason(fp(other={"tool_choice": "auto"}), fp()) == {"type": "unavailable"}


def test_the_store_is_per_tenant_and_bounded_least_recently_used_first():
    store = DiagnosticsStore(capacity=2)
    store.put("a", "msg_1", fp())
    assert store.diagnose("b", "msg_1", fp()) == {"type": "previous_message_not_found"}
    assert store.diagnose("a", "msg_1", fp()) is None
    store.put("a", "msg_2", fp())
    store.get("a", "msg_1")  # used: msg_2 is now the oldest
    store.put("a", "msg_3", fp())
    assert len(store) == 2
    assert store.get("a", "msg_2") is None and store.get("a", "msg_1") is not None
    for i in range(50):  # b's flood: past the capacity b, holding the most, gives way, not a
        store.put("b", f"msg_b{i}", fp())
    assert store.get("a", "msg_1") is not None and len(store) == 2


def test_fingerprints_need_one_end_per_message():
    with pytest.raises(ValueError, match="message ends"):
        fingerprint("m", [], SYSTEM, MESSAGES, 10, [20], 30)
    with pytest.raises(ValueError):
        DiagnosticsStore(capacity=0)
