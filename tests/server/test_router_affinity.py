"""prompt_cache_key in `kvserve router`: one key's requests go to one backend while it is healthy (per
API key), a key whose backend went down is placed again and stays there; through the router app in
front of two real servers, with the openai client."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from kvserve.server.router_affinity import CacheKeyAffinity
from kvserve.server.router_core import Router
from tests.server.conftest import ServerThread


def healthy_router() -> Router:
    router = Router(["http://a:1", "http://b:1", "http://c:1"], "round-robin")
    for b in router.backends:
        b.healthy = True
    return router


def test_a_key_stays_on_its_backend_while_it_is_healthy():
    router = healthy_router()
    key = CacheKeyAffinity.key_of({"authorization": "Bearer sk-a"}, {"prompt_cache_key": "agent-7"})
    router.affinity.place(key, "http://b:1")
    for _ in range(5):  # round-robin turns do not move it
        first, _, reason = router.candidates({}, key)[0]
        assert (first.url, reason) == ("http://b:1", "prompt_cache_key")
    other_tenant = CacheKeyAffinity.key_of({"authorization": "Bearer sk-b"}, {"prompt_cache_key": "agent-7"})
    assert router.affinity.backend_of(other_tenant) is None
    router.backends[1].healthy = False
    firsts = {router.candidates({}, key)[0][0].url for _ in range(4)}
    assert "http://b:1" not in firsts  # down: the policy places it
    assert CacheKeyAffinity.key_of({}, {"prompt_cache_key": ""}) is None
    assert CacheKeyAffinity.key_of({}, {"prompt": "no key"}) is None


def test_another_api_keys_flood_of_cache_keys_leaves_a_tenants_placement():
    affinity = CacheKeyAffinity(max_keys=8)
    mine = CacheKeyAffinity.key_of({"authorization": "Bearer sk-a"}, {"prompt_cache_key": "agent-7"})
    affinity.place(mine, "http://b:1")
    for i in range(100):
        affinity.place(CacheKeyAffinity.key_of({"authorization": "Bearer sk-b"}, {"prompt_cache_key": f"k{i}"}),
                       "http://a:1")
    assert affinity.backend_of(mine) == "http://b:1"


def test_the_router_app_keeps_a_key_on_one_backend(async_engine, model_name):
    from kvserve.server.api import build_app
    from kvserve.server.router_app import build_router_app

    with ServerThread(build_app(async_engine)) as one, ServerThread(build_app(async_engine)) as two:
        app = build_router_app([one.url, two.url], policy="round-robin", poll_interval_s=0.2)
        with ServerThread(app) as router:
            client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            for i in range(4):
                client.chat.completions.create(model=model_name, max_tokens=1, prompt_cache_key="k1",
                                               messages=[{"role": "user", "content": f"Hi {i}"}])
                client.chat.completions.create(model=model_name, max_tokens=1,  # no key: takes turns
                                               messages=[{"role": "user", "content": f"Yo {i}"}])
            decided = app.state.router.metrics.requests
            keyed = {labels: child._value.get() for labels, child in decided._metrics.items()}
    by_key = {backend: n for (backend, reason), n in keyed.items() if reason == "prompt_cache_key"}
    assert list(by_key.values()) == [3]  # the first placed it, the other 3 followed on one backend
    assert len({backend for (backend, reason) in keyed if reason == "round_robin"}) == 2


def test_responses_through_the_router_follow_their_backend(async_engine, model_name):
    """Two servers, each with its own stored responses, round-robin in front: without the router
    learning where a response lives, every other follow-up would be a 404."""
    from kvserve.server.api import build_app
    from kvserve.server.router_app import build_router_app

    with ServerThread(build_app(async_engine)) as one, ServerThread(build_app(async_engine)) as two:
        app = build_router_app([one.url, two.url], policy="round-robin", poll_interval_s=0.2)
        with ServerThread(app) as router:
            client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            first = client.responses.create(model=model_name, input="Name a colour.", max_output_tokens=3)
            previous = first
            for turn in range(3):  # the middle one streamed
                ask = dict(model=model_name, input=f"And another ({turn})?", previous_response_id=previous.id,
                           max_output_tokens=3)
                previous = (list(client.responses.create(**ask, stream=True))[-1].response if turn == 1
                            else client.responses.create(**ask))
                assert previous.previous_response_id is not None
            assert client.responses.retrieve(first.id).id == first.id
            client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.create(model=model_name, input="x", previous_response_id="resp_unknown")
