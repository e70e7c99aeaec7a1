"""Stored responses that outlive the process (responses_persist.py): on disk beside the disk tier and in a
real Redis, read back by a new store (a restart), per tenant, bounded in count, expiring, deleted for
good; and end to end, a `previous_response_id` follow-up after a restart of `kvserve serve
--kv-disk-path` is found, reports the previous turn as cached, and answers with the greedy text of the
same conversation run cold."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from kvserve.server.responses_diagnostics import prompt_record
from kvserve.server.responses_persist import DiskResponses, RedisResponses
from kvserve.server.responses_store import ResponseStore
from tests.redis_server import free_port, redis_server  # noqa: F401
from tests.server.conftest import stop_serving
from tests.server.test_prompt_cache_retention import PREFIX, serve


def response(i: int) -> dict:
    return {"id": f"resp_{i:032x}", "object": "response", "output": [{"type": "message", "n": i}]}


def check_backing(make) -> None:
    store = ResponseStore(max_responses=3, ttl_s=60, backing=make())
    record = prompt_record("k", None, None, [1, 2, 3])
    for i in range(5):
        store.put("key:a", response(i), [{"role": "user", "content": f"turn {i}"}], record)
    restarted = ResponseStore(max_responses=3, ttl_s=60, backing=make())
    found = restarted.get("key:a", response(4)["id"])
    assert found is not None and found.response == response(4) and found.prompt == record
    assert found.messages == [{"role": "user", "content": "turn 4"}]
    assert restarted.get("key:b", response(4)["id"]) is None  # another tenant never finds it
    assert restarted.get("key:a", response(0)["id"]) is None  # over the count: the oldest went
    assert restarted.delete("key:a", response(4)["id"])
    assert ResponseStore(backing=make()).get("key:a", response(4)["id"]) is None
    short = ResponseStore(ttl_s=1, backing=make())
    short.put("key:a", response(9), [], None)
    time.sleep(1.1)
    assert ResponseStore(backing=make()).get("key:a", response(9)["id"]) is None  # expired


def test_stored_responses_on_disk_survive_a_new_store(tmp_path):
    check_backing(lambda: DiskResponses(tmp_path, 3, 1 << 20))
    assert not list(tmp_path.glob("*/*.tmp"))


def test_stored_responses_in_redis_survive_a_new_store(redis_server):  # noqa: F811
    check_backing(lambda: RedisResponses(redis_server.url, 3, 1 << 20))
    keys = redis_server.client().keys("kvserve:responses:*")
    assert all(redis_server.client().ttl(k) > 0 for k in keys)  # everything there expires


def test_a_file_named_for_another_id_is_not_served(tmp_path):
    backing = DiskResponses(tmp_path, 3, 1 << 20)
    backing.put("", response(1)["id"], {"response": response(1), "messages": [], "prompt": None}, 60)
    backing._file("", response(2)["id"]).write_bytes(backing._file("", response(1)["id"]).read_bytes())
    assert backing.get("", response(2)["id"]) is None  # (a copied file: its id says whose it is)


@pytest.mark.slow
def test_a_follow_up_by_previous_response_id_after_a_restart(tmp_path):
    disk, port = str(tmp_path / "kv"), free_port()
    question, follow = "What stopped in 1911?", "And what else is in the collection?"
    proc = serve(tmp_path, port, disk, "serve0.log")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, instructions=PREFIX, input=question, max_output_tokens=12,
                                        temperature=0, prompt_cache_retention="24h")
        cold = client.chat.completions.create(  # the same conversation, computed from scratch
            model=model, max_tokens=12, temperature=0, extra_body={"cache_salt": "cold"},
            messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": question},
                      {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow}])
    finally:
        stop_serving(proc)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    proc = serve(tmp_path, port, disk, "serve1.log")
    try:
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(model=model, previous_response_id=first.id, input=follow,
                                         instructions=PREFIX,  # (OpenAI's rule: never carried over)
                                         max_output_tokens=12, temperature=0)
        assert second.usage.input_tokens == cold.usage.prompt_tokens
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 - 16
        assert second.output_text == cold.choices[0].message.content
        client.responses.delete(first.id)
    finally:
        stop_serving(proc)
    proc = serve(tmp_path, port, disk, "serve2.log")
    try:  # the delete held across a restart too
        with pytest.raises(Exception, match="not found"):
            client.responses.retrieve(first.id)
    finally:
        stop_serving(proc)


def test_with_the_tier_secret_a_record_written_or_moved_without_it_is_not_served(tmp_path):
    from kvserve.cache.tier_auth import TierAuth

    sealed = DiskResponses(tmp_path, 3, 1 << 20, TierAuth(b"s" * 32))
    record = {"response": response(1), "messages": [], "prompt": None}
    sealed.put("key:a", response(1)["id"], record, 60)
    assert sealed.get("key:a", response(1)["id"])["response"] == response(1)
    check_backing(lambda: DiskResponses(tmp_path / "sealed", 3, 1 << 20, TierAuth(b"s" * 32)))
    DiskResponses(tmp_path, 3, 1 << 20).put("key:a", response(2)["id"], record | {"response": response(2)}, 60)
    assert sealed.get("key:a", response(2)["id"]) is None  # forged: no MAC
    other = sealed._file("key:b", response(1)["id"])
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(sealed._file("key:a", response(1)["id"]).read_bytes())
    assert sealed.get("key:b", response(1)["id"]) is None  # moved to another tenant: its MAC names key:a
