"""llm-d routes to kvserve unchanged: a Python rendering of its KV-event subscriber and precise
prefix-cache scorer (tests/llm_d_mirror.py, written from llm-d's Go source) follows three live
kvserve instances (topic `kv@<pod>@<model>`, replay with the topic frame, FNV-64a CBOR block keys
over the events' token ids), gets each prompt's token ids from `/v1/chat/completions/render`, and
picks the instance holding the longest prefix for every prompt of the route check's six personas;
across two API keys it never predicts a hit (kvserve would serve none)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import httpx
import pytest

from kvserve.kv_events import fill_topic
from tests.llm_d_mirror import Index, Subscriber, TokenProcessor
from tests.server.conftest import ServerThread

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
PAGE = 16
NUM_PROMPTS = 30


def route_check():
    path = Path(__file__).resolve().parents[2] / "docs" / "scale_out_check.py"
    spec = importlib.util.spec_from_file_location("scale_out_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common_pages(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // PAGE


@pytest.fixture(scope="module")
def instances():
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app, default_model_name

    running = []
    try:
        for _ in range(3):
            engine = LLMEngine(EngineConfig(kv_cache_memory="96MiB", max_model_len=1024, page_size=PAGE,
                                            kv_events_endpoint="tcp://127.0.0.1:*"))
            model = default_model_name(engine)
            server = ServerThread(build_app(engine, api_keys=[KEY_A, KEY_B]))
            engine.event_publisher.set_topic(fill_topic("kv@{pod_ip}:{port}@{model}", pod_ip="127.0.0.1",
                                                        port=server.port, model=model))
            running.append((server.__enter__(), engine, model))
        yield running
    finally:
        for server, _, _ in running:
            server.__exit__(None, None, None)


def chat_body(model: str, system: str, question: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": question}], **extra}


def render(url: str, key: str, body: dict) -> dict:
    response = httpx.post(url + "/v1/chat/completions/render", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def wait_indexed(index: Index, pod: str, tokens: list[int], model: str, salt: str) -> None:
    deadline = time.monotonic() + 30
    while index.score(tokens, model, salt).get(pod, 0) < len(tokens) // PAGE:
        assert time.monotonic() < deadline, "the events of a served prompt never reached the index"
        time.sleep(0.05)


@pytest.mark.slow
def test_llm_d_picks_the_longest_prefix_and_never_across_api_keys(instances):
    check = route_check()
    model = instances[0][2]
    pods = [f"127.0.0.1:{server.port}" for server, _, _ in instances]
    index = Index(TokenProcessor(block_size=PAGE))
    subscribers = [Subscriber(index, e.event_publisher.endpoint, e.event_publisher.replay_endpoint)
                   for _, e, _ in instances]
    try:
        served: dict[str, list[list[int]]] = {pod: [] for pod in pods}
        counts = {pod: 0 for pod in pods}
        where: dict[int, str] = {}  # persona -> the pod its prompts went to
        hits = 0
        for persona, question in check.trace(NUM_PROMPTS):
            system = check.system_prompt(persona, words=120)
            rendered = render(instances[0][0].url, KEY_A, chat_body(model, system, question))
            tokens, salt = rendered["token_ids"], rendered["cache_salt"]
            scores = index.score(tokens, model, salt)
            # llm-d: highest prefix score wins; a tie goes to the less loaded pod (queue scorer)
            pick = max(pods, key=lambda p: (scores.get(p, 0), -counts[p], -pods.index(p)))
            truth = {p: max((common_pages(tokens, t) for t in served[p]), default=0) for p in pods}
            best = max(truth.values())
            assert truth[pick] == best and scores.get(pick, 0) == best, (persona, scores, truth)
            server = instances[pods.index(pick)][0]
            answer = httpx.post(server.url + "/v1/chat/completions",
                                json=chat_body(model, system, question, max_tokens=2, temperature=0),
                                headers={"Authorization": f"Bearer {KEY_A}"}, timeout=300).json()
            assert answer["usage"]["prompt_tokens"] == len(tokens)  # render gave the served ids
            cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert cached // PAGE == best  # what llm-d predicted is what kvserve served
            hits += best > 0
            served[pick].append(tokens)
            counts[pick] += 1
            where.setdefault(persona, pick)
            wait_indexed(index, pick, tokens, model, salt)
        assert hits == NUM_PROMPTS - 6  # every persona's first prompt is cold, the rest hit

        for persona in range(6):  # tenant B, same text: no pod is predicted to hold any of it
            system = check.system_prompt(persona, words=120)
            rendered = render(instances[0][0].url, KEY_B, chat_body(model, system, "Question 0: hi"))
            assert rendered["cache_salt"] != salt
            assert index.score(rendered["token_ids"], model, rendered["cache_salt"]) == {}
            assert index.score(rendered["token_ids"], model, "") == {}  # stock llm-d: body salt only
        system = check.system_prompt(0, words=120)  # kvserve indeed serves B no hit where A's copy is
        server = instances[pods.index(where[0])][0]
        answer = httpx.post(server.url + "/v1/chat/completions",
                            json=chat_body(model, system, "Question 0: hi", max_tokens=1),
                            headers={"Authorization": f"Bearer {KEY_B}"}, timeout=300).json()
        assert not (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert index.num_skipped == 0 and all(s.num_batches for s in subscribers)
    finally:
        for subscriber in subscribers:
            subscriber.close()
