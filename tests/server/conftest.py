"""A real kvserve server on a free loopback port, shared by the server tests: one small engine
(256 MiB of KV pages, max_model_len 2048) behind uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PROPERTY_MODE

SMALL_ENGINE = dict(kv_cache_memory="256MiB", max_model_len=2048, dtype=PROPERTY_MODE)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def on_engine(async_engine, fn, timeout: float = 60):
    """Run fn on the engine thread (between steps) from a test thread."""
    async def run():
        return await asyncio.wait_for(async_engine.call(fn), timeout)
    return asyncio.run(run())


def wait_no_pages_in_use(async_engine, timeout: float = 60) -> None:
    """Aborts are asynchronous: wait until the engine holds no request and no page, then check the
    cache invariants."""
    manager = async_engine.engine.manager
    deadline = time.monotonic() + timeout
    while True:
        used, busy = on_engine(async_engine, lambda: (manager.num_used_pages,
                                                      async_engine.engine.has_unfinished()))
        if used == 0 and not busy:
            break
        assert time.monotonic() < deadline, f"{used} pages still in use, unfinished={busy}"
        time.sleep(0.1)
    on_engine(async_engine, manager.check_invariants)


@pytest.fixture(scope="session")
def async_engine():
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(**SMALL_ENGINE))).start()
    _SESSION_ENGINE.append(engine)
    yield engine
    engine.shutdown()


_SESSION_ENGINE: list = []  # the session's engine, once some test asked for it


@pytest.fixture(scope="module", autouse=True)
def no_leases_past_the_module():
    """Leases a module's requests left on the session's engine (a stored response holds its
    conversation's pages for 5 minutes) end with the module: the next module starts with none."""
    yield
    for engine in _SESSION_ENGINE:
        leases = engine.engine.manager.leases
        on_engine(engine, lambda: [leases.release(lease_id) for lease_id in list(leases.leases)])


@pytest.fixture(scope="session")
def server(async_engine):
    """The default server: no API key."""
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine)) as running:
        yield running


@pytest.fixture(scope="session")
def model_name(async_engine) -> str:
    from kvserve.server.api import default_model_name

    return default_model_name(async_engine.engine)


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(autouse=True)
def no_pages_left_in_use(request):
    """After every test that used the real engine: no request left, no page in use."""
    yield
    if "async_engine" in request.fixturenames:
        wait_no_pages_in_use(request.getfixturevalue("async_engine"))


def poll_health_while(url: str, workers: list[threading.Thread]) -> list[float]:
    """Start `workers`, poll /health until they end; the latencies.

    The server runs inside the test process, whose heap holds everything the suite has built so far:
    a full garbage collection of it can stop every thread for most of a second, which is the suite's
    cost, not the event loop's. So the heap as it stands is frozen out of collection while polling."""
    gc.collect()
    gc.freeze()
    try:
        for worker in workers:
            worker.start()
        health = []
        with httpx.Client(timeout=5) as http:
            while any(worker.is_alive() for worker in workers):
                t0 = time.monotonic()
                assert http.get(url + "/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.02)
        return health
    finally:
        gc.unfreeze()


def stop_serving(proc, timeout_s: float = 60) -> None:
    """SIGINT, as a user stops `kvserve serve`; killed if it does not exit in time."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_until_serving(proc, url: str, log_path, timeout_s: float = 180) -> None:
    """A `kvserve serve` subprocess answers /health with 200 (its log shown if it died first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, Path(log_path).read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvserve serve did not come up"
        time.sleep(0.5)
