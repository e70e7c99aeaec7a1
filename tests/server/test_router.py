"""`kvserve router`: the score (cached prefix against load) and the index fed by real KV event
publishers as pure tests; then real `kvserve serve` processes behind `kvserve router`: answers equal
a backend's own, streams pass through, a killed backend is retried around and forgotten."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvserve.cache.events import MEDIUM_HOST, MEDIUM_REDIS, BlockRemoved, BlockStored
from kvserve.kv_events import KVEventPublisher, KVEventSubscriber, WireEvent, external_hash
from kvserve.cache.hashing import page_hashes
from kvserve.server.router_core import Router
from kvserve.server.router_index import (BackendState, anthropic_to_chat, events_address,
                                         parse_load, rank, request_namespace)
from kvserve.server.router_metrics import reported_cached_tokens

PAGE = 16


def prompt_hashes(tokens: list[int], ns: str = "") -> list[int]:
    return [external_hash(h) for h in page_hashes(tokens, PAGE, ns)]


def backend(url: str, *, load: int = 0, kv: float = 0.0, hashes=()) -> BackendState:
    b = BackendState(url, healthy=True, page_size=PAGE)
    b.observe_load(load, 0, kv)  # requests not sent by this router: of unknown size
    b.apply([WireEvent("BlockStored", list(hashes), "pool")])
    return b


# -- score and index ------------------------------------------------------------------------------
def test_the_backend_holding_the_prefix_wins_at_equal_load():
    hashes = prompt_hashes(list(range(100)))  # 6 full pages
    a, b, c = backend("a"), backend("b", hashes=hashes[:4]), backend("c", hashes=hashes)
    best = rank([a, b, c], hashes)
    assert [x.backend.url for x in best] == ["c", "b", "a"]
    assert [x.matched_pages for x in best] == [6, 4, 0]


def test_unknown_load_outweighs_a_cached_prefix_only_past_four_requests():
    hashes = prompt_hashes(list(range(100)))
    cold = backend("cold", load=1)
    assert rank([backend("warm", load=5, hashes=hashes), cold], hashes)[0].backend.url == "warm"
    assert rank([backend("warm", load=6, hashes=hashes), cold], hashes)[0].backend.url == "cold"
    full = backend("full", kv=1.0, hashes=hashes)  # a full pool still beats recomputing 6 pages
    assert rank([full, backend("empty")], hashes)[0].backend.url == "full"


def test_the_routers_own_requests_are_priced_by_their_prefill_and_decode_work():
    """A request in prefill costs its uncached pages (the backlog a new request waits behind); one
    past its first token costs little (a share of each decode step), so a cached prefix stays put."""
    hashes = prompt_hashes(list(range(100)))  # 6 pages
    warm, cold = backend("warm", hashes=hashes), backend("cold")
    other = prompt_hashes(list(range(500, 600)))
    busy = warm.admit(other, 0)  # 6 uncached pages in prefill ahead: the cached prefix still wins
    assert [(c.backend, c.cost) for c in rank([warm, cold], hashes)] == [(warm, 6), (cold, 12)]
    more = warm.admit(prompt_hashes([7] * 100), 0)  # 12 pages of backlog: a tie, the cache wins
    assert [(c.backend, c.cost) for c in rank([warm, cold], hashes)] == [(warm, 12), (cold, 12)]
    most = warm.admit(prompt_hashes([8] * 20), 0)  # 13: recomputing on the idle one is cheaper
    assert rank([warm, cold], hashes)[0].backend is cold
    more.release()
    most.release()
    busy.first_token()  # prefilled, decoding: it costs a decode share, not a prefill
    assert (warm.backlog, warm.decoding, warm.in_flight) == (0, 1, 1)
    assert rank([warm, cold], hashes)[0].backend is warm
    busy.release()
    busy.release()  # idempotent
    assert (warm.backlog, warm.decoding, warm.in_flight) == (0, 0, 0)
    warm.observe_load(4, 1, 0.0)  # 5 at the backend, none the router's: unknown, priced high
    assert warm.others == 5 and rank([warm, cold], hashes)[0].backend is cold


def test_a_prompt_just_sent_is_predicted_where_it_went_until_its_events_come():
    """Pages of a prompt routed to a backend count as held there while it is in flight and for a
    grace period after, so the same prefix routed before the events arrive follows it."""
    hashes = prompt_hashes(list(range(100)))
    a, b = backend("a"), backend("b")
    ticket = b.admit(hashes, 0)
    assert b.matched_pages(hashes) == 6 and a.matched_pages(hashes) == 0
    assert b.matched_pages(prompt_hashes(list(range(50)) + [1] * 50)) == 3  # a shared prefix
    ticket.release(grace_s=30.0)
    assert b.matched_pages(hashes) == 6  # finished: its events may still be on their way
    now = time.monotonic()
    assert b.matched_pages(hashes, now + 31.0) == 0
    again = b.admit(hashes, 6)
    again.release(grace_s=0.0)
    b._purge(time.monotonic() + 2.0)
    assert not b.predicted and b.matched_pages(hashes) == 0
    b.admit(hashes, 0)
    b.forget()  # a dead backend: predictions go too
    assert b.matched_pages(hashes) == 0


def test_nothing_cached_goes_to_the_least_loaded_and_ties_take_turns():
    hashes = prompt_hashes(list(range(40)))
    a, b, c = backend("a", load=2), backend("b", load=1), backend("c", load=1)
    assert rank([a, b, c], hashes)[0].backend.url == "b"
    assert rank([a, b, c], hashes, start=2)[0].backend.url == "c"
    assert rank([a, b, c], [])[0].backend.url == "b"  # no prompt hashes at all


def test_only_a_leading_run_counts_and_removals_and_clears_apply():
    hashes = prompt_hashes(list(range(64)))
    b = backend("b", hashes=[hashes[0], hashes[2], hashes[3]])
    assert b.matched_pages(hashes) == 1  # page 1 missing: pages 2 and 3 are no prefix hit
    b.apply([WireEvent("BlockStored", [hashes[1]], MEDIUM_HOST)])
    assert b.matched_pages(hashes) == 4
    b.apply([WireEvent("BlockRemoved", [hashes[1]], "pool")])  # another medium: still on host
    assert b.matched_pages(hashes) == 4
    b.apply([WireEvent("BlockRemoved", [hashes[1]], MEDIUM_HOST)])
    assert b.matched_pages(hashes) == 1
    b.apply([WireEvent("BlockStored", [hashes[1]], MEDIUM_REDIS)])  # shared by all: no preference
    assert b.matched_pages(hashes) == 1
    b.apply([WireEvent("AllBlocksCleared")])
    assert b.matched_pages(hashes) == 0 and not b.pages


def test_namespaces_match_the_servers_derivation():
    from kvserve.server.api import key_namespace as server_key_namespace
    from kvserve.server.router_index import key_namespace

    assert key_namespace("sk-1") == server_key_namespace("sk-1")
    assert request_namespace(None, None, False) == ""
    assert request_namespace("sk-1", None, False) == ""  # keys sharing one namespace
    assert request_namespace(None, "salt", False) == "salt"
    assert request_namespace("sk-1", "salt", True) == server_key_namespace("sk-1") + "\x00salt"


def test_load_is_read_from_a_real_metrics_page():
    from kvserve.cache.stats import CacheStats
    from kvserve.engine_stats import EngineStats
    from kvserve.metrics import EngineMetrics
    from kvserve.scheduler import SchedulerCounts

    metrics = EngineMetrics("m")
    metrics.observe(EngineStats(CacheStats(kv_cache_usage_perc=0.25),
                                SchedulerCounts(num_requests_running=3, num_requests_waiting=2)))
    assert parse_load(metrics.render().decode()) == {
        "num_requests_running": 3.0, "num_requests_waiting": 2.0, "kv_cache_usage_perc": 0.25}


def test_small_translations():
    assert events_address("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert events_address("tcp://0.0.0.0:5557", "http://h:1/v1") == "tcp://h:5557"
    assert events_address("tcp://10.1.1.1:5557", "http://h:1") == "tcp://10.1.1.1:5557"
    assert anthropic_to_chat({"system": [{"type": "text", "text": "Be brief."}],
                              "messages": [{"role": "user", "content": "Hi"}]}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert anthropic_to_chat({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}) is None
    usage = {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}
    assert reported_cached_tokens(json.dumps(usage).encode()) == 32
    stream = b"data: {\"choices\": []}\n\ndata: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
    assert reported_cached_tokens(stream, sse=True) == 32
    anthropic = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 7}}}
    assert reported_cached_tokens(b"data: " + json.dumps(anthropic).encode(), sse=True) == 7
    assert reported_cached_tokens(b"not json") is None


def test_router_metrics_count_decisions_and_predicted_against_reported():
    from kvserve.server.router_metrics import RouterMetrics

    m = RouterMetrics()
    m.decided("http://a:1", "prefix", 32)
    m.reported(32, 30)
    m.decided("http://a:1", "least_loaded", 0)
    m.reported(0, None)  # a stream without usage: not compared
    m.observe_backend(backend("http://a:1", load=2, hashes=[1, 2]))
    text = m.render().decode()
    assert metric(text, 'kvserve_router:requests_total{backend="http://a:1",reason="prefix"}') == 1
    assert metric(text, "kvserve_router:predicted_cached_tokens_total") == 32
    assert metric(text, "kvserve_router:predicted_cached_tokens_of_reported_total") == 32
    assert metric(text, "kvserve_router:reported_cached_tokens_total") == 30
    assert metric(text, 'kvserve_router:index_pages{backend="http://a:1"}') == 2
    assert metric(text, 'kvserve_router:backend_load{backend="http://a:1"}') == 2


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_router_follows_real_publishers_and_forgets_a_dead_backend():
    """Two backends' event streams (real publishers and subscribers): a request goes where its pages
    were announced, back to least-loaded when they are removed, and a backend marked down is
    forgotten."""
    tokens = list(range(1000, 1000 + 5 * PAGE + 3))
    raw = page_hashes(tokens, PAGE, "")
    hashes = {"int": [external_hash(h) for h in raw]}
    router = Router(["http://a:1", "http://b:1"], "kv")
    pubs = [KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in range(2)]
    for b, pub in zip(router.backends, pubs):
        b.healthy, b.page_size = True, PAGE
        router.subscribers[b.url] = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, b.apply)
    a, b = router.backends
    try:
        pubs[1].publish([BlockStored(raw, None, tokens[:5 * PAGE], PAGE)])
        wait_for(lambda: len(b.pages) == 5)
        for _ in range(2):  # whichever backend's turn it is
            first = router.candidates(hashes)[0]
            assert (first[0].url, first[1], first[2]) == (b.url, 5, "prefix")
        pubs[1].publish([BlockRemoved(raw[2:])])
        wait_for(lambda: len(b.pages) == 2)
        assert router.candidates(hashes)[0][:2] == (b, 2)
        a.observe_load(0, 0, 0.0)
        b.observe_load(5, 0, 0.0)  # two cached pages do not outweigh a queue of five
        assert router.candidates(hashes)[0][0] is a
        router.mark_down(b, "test")
        assert not b.pages and b.url not in router.subscribers and b.page_size is None
        order = router.candidates(hashes)
        assert [c[0] for c in order] == [a, b]  # the down backend only as a last resort
    finally:
        router.close()
        for pub in pubs:
            pub.close()


def test_round_robin_takes_turns_over_healthy_backends():
    router = Router(["http://a:1", "http://b:1/v1", "http://c:1"], "round-robin")
    for b in router.backends:
        b.healthy = True
    router.backends[2].healthy = False
    firsts = [router.candidates({})[0][0].url for _ in range(4)]
    assert firsts == ["http://a:1", "http://b:1", "http://a:1", "http://b:1"]
    with pytest.raises(ValueError, match="round-robin"):
        Router(["http://a:1"], "random")
    with pytest.raises(ValueError, match="at least one"):
        Router([], "kv")


def test_a_backend_slow_to_answer_its_health_check_keeps_its_index_for_a_while():
    """A health check timing out may be a busy backend: its pages stay indexed until three in a row
    time out; a refused connection marks it down at once."""
    import asyncio
    import socket

    import httpx

    from kvserve.server.router_core import POLL_TIMEOUTS_DOWN

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # never accepts: a request to it waits for its answer until the timeout
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in (hung, closed)]
    router = Router(urls, "kv")
    busy, dead = router.backends
    for b in router.backends:
        b.healthy, b.pages = True, {1: {"pool"}}

    async def polls(n: int) -> None:
        async with httpx.AsyncClient() as client:
            router.client = client
            for _ in range(n):
                await asyncio.gather(router.poll(busy), router.poll(dead))

    try:
        asyncio.run(polls(POLL_TIMEOUTS_DOWN - 1))
        assert busy.healthy and busy.pages and busy.poll_timeouts == POLL_TIMEOUTS_DOWN - 1
        assert not dead.healthy and not dead.pages
        asyncio.run(polls(1))
        assert not busy.healthy and not busy.pages
    finally:
        hung.close()
        closed.close()


# -- real processes ---------------------------------------------------------------------------------
ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "4",
          "--log-level", "warning"]


def start(args: list[str], log_path) -> subprocess.Popen:
    log = open(log_path, "w+")
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT)


def wait_healthy(url: str, procs, logs, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in procs), [p.read_text()[-2000:] for p in logs if p.exists()]
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.3)


def stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.mark.slow
def test_router_in_front_of_two_kvserve_processes(tmp_path):
    import httpx
    from openai import OpenAI

    from tests.redis_server import free_port

    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    backends = [start(["serve", "--port", str(p), *ENGINE], logs[i])
                for i, p in enumerate(ports[:2])]
    procs = list(backends)
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        # a long poll interval: the router must find the dead backend by failing on it
        procs.append(start(["router", "--backend", urls[0], "--backend", urls[1] + "/v1",
                            "--port", str(ports[2]), "--poll-interval", "60", "--log-level",
                            "warning"], logs[2]))
        router = f"http://127.0.0.1:{ports[2]}"
        wait_healthy(router, procs, logs)
        client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=300, max_retries=0)
        direct = OpenAI(base_url=urls[0] + "/v1", api_key="unused", timeout=300, max_retries=0)
        model = client.models.list().data[0].id
        assert client.models.retrieve(model).id == model
        missing = httpx.get(router + "/v1/models/no-such/model", timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        prompt = "The lighthouse keeper counted the ships. " * 3
        kwargs = dict(model=model, prompt=prompt, max_tokens=6, temperature=0)
        expected = direct.completions.create(**kwargs).choices[0].text
        assert client.completions.create(**kwargs).choices[0].text == expected

        messages = [{"role": "user", "content": "Name a color."}]
        chat = dict(model=model, messages=messages, max_tokens=5, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **chat) if c.choices)
        assert streamed == direct.chat.completions.create(**chat).choices[0].message.content

        body = {"model": model, "max_tokens": 4, "messages": messages}
        assert (httpx.post(router + "/v1/messages", json=body, timeout=300).status_code
                == httpx.post(urls[0] + "/v1/messages", json=body, timeout=300).status_code)

        bad = httpx.post(router + "/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"}, timeout=60)
        assert bad.status_code == 400 and "error" in bad.json()  # the backend's own answer

        text = httpx.get(router + "/metrics").text
        assert metric(text, "kvserve_router:requests_total") == 4
        assert metric(text, "kvserve_router:retries_total") == 0

        backends[0].kill()
        backends[0].wait(30)
        for i in range(4):  # every one completes: the router retries on the live backend
            out = client.completions.create(model=model, prompt=f"{i}: {prompt}", max_tokens=3,
                                            temperature=0)
            assert out.choices[0].finish_reason == "length"
        state = {b["url"]: b for b in httpx.get(router + "/router/backends").json()}
        assert state[urls[0]]["healthy"] is False and state[urls[0]]["index_pages"] == 0
        assert state[urls[1]]["healthy"] is True
        text = httpx.get(router + "/metrics").text
        assert metric(text, "kvserve_router:retries_total") >= 1
        assert metric(text, f'kvserve_router:backend_failures_total{{backend="{urls[0]}"}}') == 1
    finally:
        stop(procs)


@pytest.mark.slow
def test_kv_policy_sends_a_known_prefix_where_its_pages_are(tmp_path):
    """Two backends publishing KV events; the router learns where each prefix's pages are from the
    events and sends a known prefix to the backend that holds it."""
    import httpx

    from tests.redis_server import free_port

    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    procs = [start(["serve", "--port", str(p), "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{free_port(2)}", *ENGINE], logs[i])
             for i, p in enumerate(ports[:2])]
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        procs.append(start(["router", "--backend", urls[0], "--backend", urls[1], "--port",
                            str(ports[2]), "--poll-interval", "0.2", "--log-level", "warning"],
                           logs[2]))
        router = f"http://127.0.0.1:{ports[2]}"
        wait_healthy(router, procs, logs)
        wait_for(lambda: all(b["page_size"] for b in httpx.get(router + "/router/backends").json()),
                 timeout=30)
        system = "You are a careful lighthouse keeper who logs every passing ship. " * 12
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Any ships today?"}],
                "max_tokens": 3, "temperature": 0}

        def post(extra: dict | None = None) -> dict:
            response = httpx.post(router + "/v1/chat/completions", json={**body, **(extra or {})},
                                  timeout=300)
            assert response.status_code == 200, response.text
            return response.json()

        first = post()
        # the first answer's pages reach the router's index through the backend's events
        wait_for(lambda: max(b["index_pages"] for b in
                             httpx.get(router + "/router/backends").json()) >= 8, timeout=30)
        for _ in range(2):  # whichever backend's turn it is, the one holding the prefix wins
            again = post()
            assert again["choices"][0]["message"] == first["choices"][0]["message"]
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= again["usage"]["prompt_tokens"] - 2 * PAGE
        salted = post({"cache_salt": "another-tenant"})  # another namespace: nothing cached
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = httpx.get(router + "/metrics").text
        assert metric(text, "kvserve_router:requests_total") == 4
        prefix = sum(metric(text, f'kvserve_router:requests_total{{backend="{u}",reason="prefix"}}')
                     for u in urls)
        assert prefix == 2
        predicted = metric(text, "kvserve_router:predicted_cached_tokens_of_reported_total")
        reported = metric(text, "kvserve_router:reported_cached_tokens_total")
        assert predicted > 0 and abs(predicted - reported) <= 2 * PAGE
    finally:
        stop(procs)


def cacheable(num_tokens: int) -> int:
    """Tokens a hit can cover: the full pages before the last token (always computed)."""
    return (num_tokens - 1) // PAGE * PAGE
