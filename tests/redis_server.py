"""A real `redis-server` for the shared-tier tests: on a free loopback port, no persistence, stopped
(or killed, paused, restarted on the same port) by the test. Import the fixtures where needed:
`from tests.redis_server import redis_server  # noqa: F401`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


_handed_out: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports, all free now and none handed out before in
    this process: binding to port 0 and closing can give the same port to two callers in a row (two
    backends then collide at start-up). A KV events endpoint takes 2: its replay socket binds the
    next port."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        run = range(port, port + count)
        if port + count <= 65536 and not _handed_out.intersection(run) and all(map(_bindable, run[1:])):
            _handed_out.update(run)
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    def __init__(self, workdir: str, maxmemory: str = "2gb", policy: str = "allkeys-lru") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
             "--dir", self.workdir, "--proto-max-bulk-len", "2gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: connections drop, the data is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a slow or hung Redis)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)


def _require_redis() -> None:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed (`make install` adds it)")


@pytest.fixture
def redis_server(tmp_path):
    _require_redis()
    server = RedisServer(str(tmp_path)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    _require_redis()
    server = RedisServer(str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()
