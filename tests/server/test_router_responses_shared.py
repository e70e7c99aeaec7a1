"""`kvserve router` and stored responses it did not see stored: a router that restarted (an empty map of
response ids) asks each backend in turn, so a follow-up, a GET and a DELETE still reach the backend
that holds the response; and with the backends' stored responses in one Redis (responses_persist.py),
a follow-up whose backend has died is answered by another backend. Real servers, the openai client."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from kvserve.server.responses_persist import RedisResponses
from tests.redis_server import redis_server  # noqa: F401
from tests.server.conftest import ServerThread


def client_of(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_router_that_forgot_asks_each_backend(async_engine, model_name):
    from kvserve.server.api import build_app
    from kvserve.server.router_app import build_router_app

    with ServerThread(build_app(async_engine)) as one, ServerThread(build_app(async_engine)) as two:
        first = client_of(two.url).responses.create(model=model_name, input="Name a colour.", max_output_tokens=3)
        for _ in range(2):  # a fresh router each time: round-robin starts at backend one, which lacks it
            app = build_router_app([one.url, two.url], policy="round-robin", poll_interval_s=0.2)
            with ServerThread(app) as router:
                follow = client_of(router.url).responses.create(model=model_name, input="Another?",
                                                                previous_response_id=first.id, max_output_tokens=3)
                assert follow.previous_response_id == first.id
        with ServerThread(build_router_app([one.url, two.url], policy="round-robin")) as router:
            client = client_of(router.url)
            assert client.responses.retrieve(first.id).id == first.id
            client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):  # every backend lacks it: one 404, not a 502
                client.responses.create(model=model_name, input="x", previous_response_id=first.id)


def test_with_a_shared_store_another_backend_answers_for_a_dead_one(async_engine, model_name,
                                                                    redis_server):  # noqa: F811
    from kvserve.server.api import build_app
    from kvserve.server.router_app import build_router_app

    apps = [build_app(async_engine), build_app(async_engine)]
    for app in apps:  # as `kvserve serve --redis-url` builds it
        app.state.responses.backing = RedisResponses(redis_server.url, 1024, 64 << 20)
    one, two = ServerThread(apps[0]).__enter__(), ServerThread(apps[1])
    with two:
        try:
            first = client_of(one.url).responses.create(model=model_name, input="Name a colour.",
                                                        max_output_tokens=3, temperature=0)
        finally:
            one.__exit__(None, None, None)  # the backend that stored it is gone
        with ServerThread(build_router_app([one.url, two.url], policy="round-robin")) as router:
            client = client_of(router.url)
            follow = client.responses.create(model=model_name, input="Another?", previous_response_id=first.id,
                                             max_output_tokens=3)
            assert follow.previous_response_id == first.id
            assert client.responses.retrieve(first.id).output_text == first.output_text
